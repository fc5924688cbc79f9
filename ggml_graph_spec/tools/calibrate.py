"""kimi-k3-calibrate: REAP expert saliency, and llama.cpp's importance matrix, from our graph.

    kimi-k3-calibrate -m MODEL.gguf -f FILE[:TAG] [-f ...] -o saliency.json [--imatrix OUT.gguf]
                      [-c N] [--chunks N] [-t N] [--exact-experts] [--process-output] [--overwrite]

Each file is tokenized as the runner tokenizes a prompt (`encode(text)`, BOS by the GGUF's
add_bos_token) and cut into consecutive chunks of -c tokens, the last one possibly shorter; each
chunk runs from an empty cache, so a text that fits in one chunk is routed exactly as the runner
routes it as a prompt. --chunks caps the chunks taken from each file. A file's tag (for the
per-tag statistics) is the text after its last ':' when the whole argument is not itself a file,
else the file name without its suffix.

Outputs: the saliency JSON (gguf_arch/io/saliency.py: per MoE layer and expert the tokens routed to
it and its REAP saliency, overall and per tag) and, with --imatrix, llama-imatrix's GGUF
(gguf_arch/io/imatrix.py) for llama-quantize. As llama-imatrix, the imatrix covers the matmuls of
the blk.* weights, output.weight too with --process-output; unlike it, batches under 16 tokens
are not skipped. Only per-layer sums are kept between chunks: memory does not grow with the corpus.

Exit codes: 0 written; 1 runtime failure (an output exists without --overwrite, I/O error);
2 bad input (model, text file, option); 130 interrupted (no partial output is left).
"""
from __future__ import annotations

from gguf_arch.errors.signals import install

install()  # first: a stop signal during the imports below is the documented line and code

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
from tqdm import tqdm

from gguf_arch.arch.tensors import OUTPUT, ROUTED_EXPERTS, gguf_layer, layer_name
from gguf_arch.errors import KimiError, run_cli
from gguf_arch.io.console import ArgumentParser, output_file
from gguf_arch.io.output_paths import guard_outputs
from gguf_arch.io.imatrix import ImatrixAccumulator, write_imatrix
from gguf_arch.io.jsonfile import read_text
from gguf_arch.io.saliency import SaliencyAccumulator, write_saliency

from ..graph import taps
from ..engine.model import Model
from ..engine.options import LoadOptions
from ..engine.results import EvalResult
from ..text.tokenizer import BPETokenizer

DEFAULT_CHUNK = 512  # llama-imatrix's -c default


class UsageError(KimiError):
    """A command-line argument is malformed or inconsistent (exit code 2)."""


@dataclass(frozen=True)
class TextFile:
    path: Path
    tag: str


def parse_file_arg(spec: str) -> TextFile:
    """FILE or FILE:TAG (module docstring)."""
    path, sep, tag = spec.rpartition(":")
    if not sep or Path(spec).is_file() or not tag:
        return TextFile(Path(spec), Path(spec).stem)
    return TextFile(Path(path), tag)


def chunks_of(tokens: Sequence[int], size: int, limit: int) -> list[list[int]]:
    """Consecutive chunks of `size` tokens (the last may be shorter); at most `limit` (< 0: all)."""
    chunks = [list(tokens[i:i + size]) for i in range(0, len(tokens), size)]
    return chunks if limit < 0 else chunks[:limit]


@dataclass
class Calibration:
    """What one pass over the chunks accumulates: saliency always, the imatrix when asked."""

    model: Model
    saliency: SaliencyAccumulator
    imatrix: ImatrixAccumulator | None
    process_output: bool = False
    _routed: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        cfg = self.model.cfg
        self._routed = frozenset(layer_name(t, l) for l in cfg.moe_layers for t in ROUTED_EXPERTS)

    @property
    def wants(self) -> tuple[str, ...]:
        return ("moe", taps.MOE_NORMS) + ((taps.IMATRIX,) if self.imatrix is not None else ())

    def run_chunk(self, tag: str, chunk: list[int]) -> None:
        self.model.reset()
        r = self.model.run(chunk, want=self.wants)
        self.saliency.add(tag, r.moe_experts, r.moe_weights, r.moe_norms)
        if self.imatrix is not None:
            self._add_imatrix(r, len(chunk))

    def _add_imatrix(self, r: EvalResult, n_tokens: int) -> None:
        n_expert = self.model.cfg.num_experts
        counts = {l: np.bincount(ids.ravel(), minlength=n_expert) for l, ids in r.moe_experts.items()}
        for name, sums in r.imatrix.items():
            layer = gguf_layer(name)
            if layer is None and not (self.process_output and name == OUTPUT):
                continue
            if name in self._routed:
                self.imatrix.add_experts(name, sums, counts[layer])
            else:
                self.imatrix.add_dense(name, sums, n_tokens)
        self.imatrix.chunks += 1


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="kimi-k3-calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", type=Path, required=True, help="the kimi-k3 GGUF to calibrate")
    p.add_argument("-f", "--file", dest="files", action="append", type=parse_file_arg, required=True,
                   metavar="FILE[:TAG]", help="a UTF-8 calibration text (repeatable); TAG groups statistics")
    p.add_argument("-o", "--output", type=output_file, required=True, help="the saliency JSON to write")
    p.add_argument("--imatrix", type=output_file, metavar="OUT.gguf", help="also write llama.cpp's importance matrix")
    p.add_argument("-c", "--ctx-size", type=int, default=DEFAULT_CHUNK, help=f"tokens per chunk ({DEFAULT_CHUNK})")
    p.add_argument("--chunks", type=int, default=-1, help="at most N chunks per file (default: all)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--exact-experts", action="store_true",
                   help="the exact path (F32 activations), as kimi-k3-cli --exact-experts routes")
    p.add_argument("--process-output", action="store_true", help="imatrix: include output.weight, as llama-imatrix")
    p.add_argument("--overwrite", action="store_true", help="replace existing output files")
    return p


def _check_args(a: argparse.Namespace) -> None:
    if a.ctx_size < 1:
        raise UsageError(f"kimi-k3-calibrate: -c/--ctx-size must be >= 1, got {a.ctx_size}")
    if a.chunks == 0 or a.chunks < -1:
        raise UsageError(f"kimi-k3-calibrate: --chunks must be >= 1 (or -1: all), got {a.chunks}")
    if a.threads is not None and a.threads < 1:
        raise UsageError(f"kimi-k3-calibrate: -t/--threads must be >= 1, got {a.threads}")
    outputs = [(a.output, "the saliency JSON (-o)")] + ([(a.imatrix, "the imatrix (--imatrix)")] if a.imatrix else [])
    reads = [(a.model, "the model (-m)")] + [(f.path, "a calibration text (-f)") for f in a.files]
    guard_outputs(outputs, reads=reads, replace=a.overwrite)


def _tokenized(files: list[TextFile], tokenizer: BPETokenizer, size: int, limit: int) -> list[tuple[TextFile, list]]:
    out = []
    for f in files:
        tokens = tokenizer.encode(read_text(f.path, UsageError, "no such calibration file"))
        if not tokens:
            raise UsageError(f"{f.path}: the text tokenizes to no tokens")
        out.append((f, chunks_of(tokens, size, limit)))
    return out


def _file_entry(f: TextFile, chunks: list[list[int]]) -> dict:
    return {"path": str(f.path), "tag": f.tag, "tokens": sum(map(len, chunks)), "chunks": len(chunks)}


def _calibrate(a: argparse.Namespace, model: Model, work: list[tuple[TextFile, list]]) -> Calibration:
    cal = Calibration(model, SaliencyAccumulator(model.cfg.num_experts),
                      ImatrixAccumulator() if a.imatrix is not None else None, a.process_output)
    total = sum(len(chunks) for _, chunks in work)
    with tqdm(total=total, unit="chunk", desc="calibrate", file=sys.stderr, disable=not sys.stderr.isatty(),
              dynamic_ncols=True) as bar:
        for f, chunks in work:
            for chunk in chunks:
                cal.run_chunk(f.tag, chunk)
                bar.update(1)
    return cal


def run(a: argparse.Namespace) -> None:
    _check_args(a)
    model = Model.load(a.model, LoadOptions(n_ctx=a.ctx_size, exact_experts=a.exact_experts, n_threads=a.threads))
    try:
        work = _tokenized(a.files, BPETokenizer.from_gguf(a.model), a.ctx_size, a.chunks)
        n_tokens = sum(len(c) for _, chunks in work for c in chunks)
        print(f"calibrate: {len(work)} file(s), {n_tokens} tokens in chunks of {a.ctx_size}", file=sys.stderr)
        cal = _calibrate(a, model, work)
    finally:
        model.close()
    write_saliency(a.output, cal.saliency.to_json(model=a.model.name, chunk_size=a.ctx_size, tokens=n_tokens,
                                                  files=[_file_entry(f, chunks) for f, chunks in work]))
    print(f"calibrate: wrote {a.output}", file=sys.stderr)
    if cal.imatrix is not None:
        write_imatrix(a.imatrix, cal.imatrix, [str(f.path) for f, _ in work], a.ctx_size)
        print(f"calibrate: wrote {a.imatrix} ({len(cal.imatrix.entries)} weights)", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(lambda: run(build_parser().parse_args(argv)), runtime_errors=(OSError, MemoryError, RuntimeError))


if __name__ == "__main__":
    sys.exit(main())
