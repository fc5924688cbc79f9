"""kimi-k3-encode-images: images (and clips) through an mmproj's vision tower and projector, their
embedding rows saved to an .npz.

    kimi-k3-encode-images MMPROJ.gguf a.png b.jpg --video f0.png,f1.png -o rows.npz

The .npz holds, per media item i in the order given (images first, then clips): `rows_i` (float32
[N, D_text], what replaces the item's placeholder in the text model's input), `grid_i` ((t, h, w)
in patches), `size_i` (the original width and height) and `block_i` (the item's media block, the
text that goes where llama.cpp's `<__media__>` marker is). Every file is read and checked before
anything is computed; the output is written whole or not at all.

Exit codes: 0 done, 2 bad input (an unreadable, truncated, too large or unsupported image, an
mmproj that is not a Kimi K3 one, bad arguments), 1 a runtime failure (the output exists without
--overwrite, an I/O error), 130 / 143 / 129 SIGINT / SIGTERM / SIGHUP (nothing written).
"""
from __future__ import annotations

from gguf_arch.errors.signals import install

install("no output written")  # first: a stop signal during the imports below is the documented line and code

import argparse
from pathlib import Path
from typing import Sequence

import numpy as np

from gguf_arch.errors import run_cli
from gguf_arch.io.atomic import write_atomically
from gguf_arch.io.console import ArgumentParser, output_file
from gguf_arch.io.output_paths import guard_outputs

from ..vision.encode import VisionEncoder
from ..vision.preprocess import MediaItem
from ..vision.prompt import media_block


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="kimi-k3-encode-images", description=__doc__.split("\n\n")[0])
    p.add_argument("mmproj", type=Path, metavar="MMPROJ.gguf", help="the mmproj (convert-kimi-k3 --mmproj)")
    p.add_argument("images", type=Path, nargs="*", metavar="IMAGE", help="PNG, JPEG or WebP files")
    p.add_argument("--video", action="append", default=[], metavar="F0,F1,...",
                   help="the frames of one clip, comma-separated (repeatable)")
    p.add_argument("-o", "--output", type=output_file, required=True, metavar="OUT.npz", help="where to save the rows")
    p.add_argument("--overwrite", action="store_true", help="replace OUT.npz if it exists")
    p.add_argument("--fast", action="store_true",
                   help="the weights as stored (BF16 matmuls, ggml's table GELU) instead of F32 everywhere")
    p.add_argument("-t", "--threads", type=int, metavar="N", help="CPU threads (default: all this process may use)")
    return p


def _arrays(items: Sequence[MediaItem], rows: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for i, (item, r) in enumerate(zip(items, rows)):
        out.update({f"rows_{i}": r, f"grid_{i}": np.asarray(item.grid), f"size_{i}": np.asarray(item.size),
                    f"block_{i}": np.asarray(media_block(item))})
    return out


def run(args: argparse.Namespace) -> None:
    media = [[p] for p in args.images] + [[Path(f) for f in v.split(",")] for v in args.video]
    if not media:
        build_parser().error("give at least one IMAGE or --video")
    if args.threads is not None and args.threads < 1:
        build_parser().error(f"-t/--threads must be at least 1, got {args.threads}")
    reads = [(args.mmproj, "the mmproj"), *((f, "an input image") for m in media for f in m)]
    guard_outputs([(args.output, "the output (-o)")], reads=reads, replace=args.overwrite)
    with VisionEncoder.open(args.mmproj, exact=not args.fast, threads=args.threads) as enc:
        items = [enc.media(m) for m in media]
        rows = [enc.encode(item) for item in items]

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            np.savez(f, **_arrays(items, rows))

    write_atomically(args.output, write)
    print(f"wrote {args.output}: " + ", ".join(f"{len(r)} rows" for r in rows))


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(lambda: run(build_parser().parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
