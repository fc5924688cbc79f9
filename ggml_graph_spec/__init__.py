"""Kimi K3 / K3.1-Pro on a ggml graph built from Python. The subpackages are layers; each imports
only the layers below it (tests/test_layout.py checks it, docs/architecture.md draws it):

    text/        the GGUF's tokenizer and chat template                          (gguf_arch)
    weights/     GGUF loading and validation, repack, --override-kv, identity    (gguf_arch)
    graph/       GraphBuild, the micro-batch of sequences, caches, taps, placement   (weights)
    blocks/      one builder per block (KDA, MLA, DSA, MoE, FFN, AttnRes), the whole model
    backends/    what runs a graph: CPU, RPC devices, memory budget; their registry
    engine/      Model: load options, many sequences, decode, sequence state
    generation/  sampling, token events, generation and continuous batching, perplexity
    runner/      kimi-k3-cli: its arguments, summary, conversation
    server/      kimi-k3-server                                                 (runner)
    tools/       calibrate, prune, rpc-server, doctor                           (runner)
"""
