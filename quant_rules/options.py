"""The converter's quantization options: argparse wiring, rule files, the type listing and the
llama-quantize rules export.

`--tensor-type-file` reads one or more `PATTERN=TYPE` rules per line, split on whitespace as
llama-quantize reads its own rule files, so a file written for llama-quantize works here too;
in addition `#` starts a comment (llama-quantize has no comments: the exported file has none).
"""
from __future__ import annotations

import argparse
from collections import Counter, defaultdict
from pathlib import Path
from typing import Iterable, Sequence

from gguf import GGMLQuantizationType as Q

from gguf_arch.arch.tensors import OUTPUT, TOKEN_EMBD
from gguf_arch.errors import OutputError
from gguf_arch.io.console import human_size, output_file
from gguf_arch.io.jsonfile import read_text
from gguf_arch.io.output_paths import create

from .rules import (EXPERT_TYPES, OUTTYPES, WRITABLE_TYPES, QuantOptions, QuantRuleError,
                    Resolution, TensorTypeRule, parse_tensor_type, parse_type, type_name)


def add_quant_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output types (the DSA indexer projections, norms, router, AttnRes scores "
                             "and routed experts are protected: see quant_rules/protected.json)")
    g.add_argument("--outtype", default="auto", choices=list(OUTTYPES),
                   help="type of the trunk's weight matrices; auto keeps the checkpoint's precision")
    g.add_argument("--tensor-type", action="append", default=[], metavar="PATTERN=TYPE",
                   help="llama-quantize-style override, repeatable: PATTERN (lower-cased) is a regular "
                        "expression searched in GGUF tensor names, the first matching rule wins; "
                        f"TYPE one of {', '.join(type_name(t) for t in WRITABLE_TYPES)}")
    g.add_argument("--tensor-type-file", action="append", default=[], type=Path, metavar="FILE",
                   help="PATTERN=TYPE rules, whitespace-separated, '#' starts a comment; read after "
                        "the --tensor-type rules")
    g.add_argument("--output-tensor-type", metavar="TYPE", help=f"type of {OUTPUT}")
    g.add_argument("--token-embedding-type", metavar="TYPE", help=f"type of {TOKEN_EMBD}")
    g.add_argument("--requantize-experts", metavar="TYPE",
                   help="dequantize the MXFP4 routed experts one expert at a time and write them as "
                        f"TYPE ({', '.join(type_name(t) for t in EXPERT_TYPES)}); lossy for q8_0 and f16")
    g.add_argument("--print-tensor-types", action="store_true",
                   help="print each output tensor's source type, final type and deciding rule; convert nothing")
    g.add_argument("--export-quantize-rules", type=output_file, metavar="FILE",
                   help="write the llama-quantize --tensor-type rules that keep the protected tensors "
                        "at their types in this GGUF")


def read_tensor_type_file(path: Path, allowed: Sequence[Q] = WRITABLE_TYPES) -> list[TensorTypeRule]:
    text = read_text(path, QuantRuleError, "cannot read the tensor type file: it does not exist")  # never waits on a FIFO
    rules = []
    for number, line in enumerate(text.splitlines(), 1):
        for word in line.split("#", 1)[0].split():
            rules.append(parse_tensor_type(word, f"{path}:{number}", allowed))
    return rules


def _optional_type(text: str | None, allowed: Iterable[Q], what: str) -> Q | None:
    return None if text is None else parse_type(text, tuple(allowed), what)


def quant_options(args: argparse.Namespace) -> QuantOptions:
    """QuantOptions from parsed arguments; QuantRuleError names the bad option."""
    rules = [parse_tensor_type(r) for r in args.tensor_type]
    for path in args.tensor_type_file:
        rules.extend(read_tensor_type_file(path))
    return QuantOptions(
        outtype=OUTTYPES[args.outtype],
        tensor_types=tuple(rules),
        output_tensor_type=_optional_type(args.output_tensor_type, WRITABLE_TYPES, "--output-tensor-type"),
        token_embedding_type=_optional_type(args.token_embedding_type, WRITABLE_TYPES, "--token-embedding-type"),
        requantize_experts=_requantize_type(args.requantize_experts),
    )


def _requantize_type(text: str | None) -> Q | None:
    if text is not None and text.lower() in {type_name(t) for t in WRITABLE_TYPES} - {type_name(t) for t in EXPERT_TYPES}:
        raise QuantRuleError(
            f"--requantize-experts: {text!r} is not offered: moving MXFP4 experts to another 4-bit format "
            "loses accuracy (kimi-k3-mlx measured 9.8% mean relative error for affine 4-bit) and does "
            "not make the file smaller; use f32, bf16, f16 or q8_0, or keep them MXFP4")
    return _optional_type(text, EXPERT_TYPES, "--requantize-experts")


# Why each expert type costs what it costs. MXFP4 weights are E2M1 x 2^(e-127): two significant
# bits and an 8-bit exponent per block of 32 (docs/reference/mxfp4.md#byte-layout).
_REQUANTIZE_COST: dict[Q, str] = {
    Q.F32: "exact (every MXFP4 weight with a scale byte up to 252 is an f32 value); experts grow 7.5x "
           "(32 vs 4.25 bits per weight)",
    Q.BF16: "exact (bf16 keeps f32's exponent range and the two significant bits E2M1 needs); experts "
            "grow 3.8x (16 vs 4.25 bits per weight)",
    Q.F16: "exact only for blocks whose scale byte lies in 104..140 (2^-23..2^13); smaller scales lose "
           "bits to f16 subnormals, larger ones overflow to inf; experts grow 3.8x",
    Q.Q8_0: "lossy: Q8_0 rounds each weight to 1/127 of its block's largest weight, an error up to "
            "max|block|/254 (0.4% of the block maximum) plus the f16 rounding of the block scale; "
            "experts grow 2x (8.5 vs 4.25 bits per weight)",
}


def requantize_warning(t: Q) -> str:
    return (f"warning: --requantize-experts {type_name(t)}: the routed experts are dequantized from MXFP4 "
            f"one expert at a time and re-encoded: {_REQUANTIZE_COST[t]}; the measured relative error "
            "is logged per tensor")


def _ne(shape: tuple[int, ...]) -> str:
    return "{" + ", ".join(str(d) for d in reversed(shape)) + "}"


def format_tensor_types(resolution: Resolution) -> list[str]:
    """The --print-tensor-types table: one line per output tensor, then totals per type."""
    ds = resolution.decisions
    w_name = max((len(d.name) for d in ds), default=4)
    w_ne = max((len(_ne(d.shape)) for d in ds), default=2)
    lines = [f"{'tensor':<{w_name}}  {'ne':<{w_ne}}  {'source':<6}  {'final':<6}  rule"]
    for d in ds:
        lines.append(f"{d.name:<{w_name}}  {_ne(d.shape):<{w_ne}}  {d.source_type.lower():<6}  "
                     f"{type_name(d.final_type):<6}  {d.rule}")
    count: Counter = Counter()
    size: Counter = Counter()
    for d in ds:
        count[d.final_type] += 1
        size[d.final_type] += d.nbytes
    totals = ", ".join(f"{type_name(t)} {count[t]} ({human_size(size[t])})" for t in count)
    lines.append(f"{len(ds)} tensors, {human_size(sum(size.values()))}: {totals}")
    return lines


def _escaped(name: str) -> str:
    return "^" + name.replace(".", r"\.") + "$"


def quantize_rules_lines(resolution: Resolution) -> list[str]:
    """llama-quantize `PATTERN=TYPE` words that pin every protected tensor to its type in our GGUF.

    One word per protected rule when its tensors share a type, else one anchored name per tensor.
    The patterns are lower case and contain no whitespace, so llama-quantize's lower-casing and its
    whitespace-split rule files leave them unchanged.
    """
    members: dict = defaultdict(list)
    for d in resolution.decisions:
        if d.protected_by is not None:
            members[d.protected_by].append(d)
    lines = []
    for rule, ds in members.items():
        types = {d.final_type for d in ds}
        if len(types) == 1:
            lines.append(f"{rule.pattern}={type_name(types.pop())}")
        else:
            lines.extend(f"{_escaped(d.name)}={type_name(d.final_type)}" for d in ds)
    return lines


def write_quantize_rules(path: Path, resolution: Resolution, replace: bool = False) -> str:
    """Write the export (a path the run's output guard claimed); returns the line that says how to
    use it with llama-quantize."""
    try:
        with create(path, replace, "w") as f:
            f.write("".join(line + "\n" for line in quantize_rules_lines(resolution)))
    except OSError as exc:
        raise OutputError(f"{path}: cannot write the llama-quantize rules: {exc.strerror or exc}") from None
    return (f"wrote llama-quantize rules to {path}: pass them before your own rules, llama-quantize "
            f"--tensor-type-file {path} [--tensor-type ...] IN.gguf OUT.gguf TYPE (the first matching rule "
            "wins; builds where the last match wins need the file last); llama-quantize applies --tensor-type "
            "rules only when TYPE is a quantized type, not for F16/BF16/F32")
