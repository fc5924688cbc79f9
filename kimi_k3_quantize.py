"""Requantize a kimi-k3 GGUF's routed experts with llama.cpp's own llama-quantize, the protected
tensors kept at their types (quant_rules/llama_quantize.py says how).

    kimi-k3-quantize IN.gguf OUT.gguf TYPE [--imatrix IM.gguf] [--tensor-type PATTERN=TYPE ...]
        [--tensor-type-file FILE] [--output-tensor-type T] [--token-embedding-type T] [-t N]
        [--overwrite] [--print-tensor-types]

IN must be a GGUF our graph loads, and so must OUT before it is renamed into place.

Exit codes: 0 written; 1 llama-quantize not found or failed, an output other than planned, OUT
exists, I/O error; 2 bad input (IN, TYPE, a rule, the imatrix); 130 interrupted (no partial
output is left).
"""
from __future__ import annotations

from gguf_arch.errors.signals import install

install()  # first: a stop signal during the imports below is the documented line and code

import argparse
import os
import sys
from pathlib import Path
from typing import Sequence

from ggml_graph_spec.weights.loader import load_gguf
from gguf_arch.arch.tensors import OUTPUT, TOKEN_EMBD
from gguf_arch.errors import GGUFError, run_cli
from gguf_arch.io.console import ArgumentParser, output_file
from gguf_arch.io.output_paths import OutputPaths
from quant_rules import llama_quantize as lq
from quant_rules.llama_types import LLAMA_QUANTIZE_TYPES, NEEDS_IMATRIX
from quant_rules.options import format_tensor_types
from quant_rules.rules import QuantRuleError, parse_type, type_name


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="kimi-k3-quantize", description=__doc__.split("\n\n")[0])
    p.add_argument("input", type=Path, metavar="IN.gguf", help="a kimi-k3 GGUF (single file or first part)")
    p.add_argument("output", type=output_file, metavar="OUT.gguf")
    p.add_argument("type", metavar="TYPE",
                   help=f"the routed experts' type: {', '.join(type_name(t) for t in LLAMA_QUANTIZE_TYPES)}")
    needs = ", ".join(type_name(t) for t in LLAMA_QUANTIZE_TYPES if t in NEEDS_IMATRIX)
    p.add_argument("--imatrix", type=Path, metavar="IM.gguf",
                   help=f"importance matrix from llama-imatrix (required for {needs})")
    p.add_argument("--tensor-type", action="append", default=[], metavar="PATTERN=TYPE",
                   help="llama-quantize-style override for unprotected tensors, experts included; the first "
                        "matching rule wins, before TYPE")
    p.add_argument("--tensor-type-file", action="append", default=[], type=Path, metavar="FILE",
                   help="PATTERN=TYPE rules, whitespace-separated, '#' starts a comment")
    p.add_argument("--output-tensor-type", metavar="TYPE", help=f"type of {OUTPUT} (default: kept)")
    p.add_argument("--token-embedding-type", metavar="TYPE", help=f"type of {TOKEN_EMBD} (default: kept)")
    p.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1, help="llama-quantize threads")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    p.add_argument("--print-tensor-types", action="store_true",
                   help="print each tensor's type in IN and OUT and the rule that decides it; write nothing")
    return p


def _check_paths(args: argparse.Namespace) -> None:
    if args.imatrix is not None and not args.imatrix.is_file():
        raise QuantRuleError(f"{args.imatrix}: --imatrix file not found")
    # The one output guard: never over a file this run reads, never through a link, never an
    # existing file without --overwrite.
    reads = [(args.input, "IN.gguf"), *[(f, "a --tensor-type-file") for f in args.tensor_type_file]]
    if args.imatrix is not None:
        reads.append((args.imatrix, "the imatrix (--imatrix)"))
    guard = OutputPaths(read_files=reads, resumable=False)
    guard.add(args.output, "the quantized GGUF", replace=args.overwrite)
    guard.check()
    if args.threads < 1:
        raise QuantRuleError(f"--threads {args.threads}: must be >= 1")


def _graph_loads(path: Path) -> None:
    try:
        load_gguf(path).close()
    except GGUFError as exc:
        raise lq.ToolError(f"the graph's loader refuses llama-quantize's output: {exc}") from None


def run(args: argparse.Namespace) -> None:
    expert_type = parse_type(args.type, LLAMA_QUANTIZE_TYPES, "TYPE")
    options = lq.options_for(args.tensor_type, args.tensor_type_file, args.output_tensor_type,
                             args.token_embedding_type)
    load_gguf(args.input).close()  # IN is a kimi-k3 GGUF the graph runs, or one line says why not
    resolution = lq.plan(lq.read_gguf_tensors(args.input), expert_type, options)
    for line in resolution.log:
        print(f"kimi-k3-quantize: {line}", file=sys.stderr)
    if args.print_tensor_types:
        print("\n".join(format_tensor_types(resolution)))
        return
    _check_paths(args)
    lq.check_imatrix(resolution, args.imatrix)
    lq.quantize(args.input, args.output, resolution, expert_type, args.imatrix, args.threads, _graph_loads)
    print(lq.summary_line(args.output, resolution))


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(lambda: run(_parser().parse_args(argv)), runtime_errors=(OSError,))


if __name__ == "__main__":
    sys.exit(main())
