"""Kimi K3 / K3.1-Pro in GGUF: what the model is, how its files are read and written, and the
tools built on both. The subpackages are layers; each imports only the layers below it:

    errors.py   the one-line errors and exit codes every layer raises         (imports nothing)
    io/         file formats: JSON inputs, safetensors (read and write), GGUF (read, write,
                split), the integrity manifest, the bounded worker pipeline     (errors)
    arch/       the architecture as data: config.json reader, GGUF key table, tensor table,
                transforms, MXFP4, tokenizer                                    (io, errors)
    convert/    the conversion: plan and ledger, listing (--dry-run, --print-tensor-types),
                run, resume, preflight, progress                  (arch, io, errors, quant_rules)
    verify/     the independent check: tensor diff, reference forms, error bounds, --verify
                                                                                (arch, io, errors)
    synth/      synthetic checkpoints in the released format                    (arch, io, errors)

convert, verify and synth never import one another: a conversion does not load the verifier.
quant_rules sits between arch and convert (it imports arch and io, never convert, verify or
synth); ggml_graph_spec (the runner) imports arch, io and quant_rules' type sets.
tests/test_layout.py checks these rules on the source.
"""
