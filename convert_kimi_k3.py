"""Convert a Kimi K3 / K3.1-Pro Hugging Face checkpoint to one GGUF file (arch kimi-k3).

    python convert_kimi_k3.py MODEL_DIR OUT.gguf [--overwrite] [--no-dsa] [--quiet]

Exit codes: 0 ok, 2 bad input, 1 runtime failure (I/O, disk full, output exists), 130 Ctrl-C.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gguf_arch.convert import convert
from gguf_arch.errors import EXIT_INTERRUPTED, EXIT_RUNTIME, KimiError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="convert-kimi-k3", description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir", type=Path, help="checkpoint directory (config.json, index, shards, tokenizer)")
    p.add_argument("out", type=Path, help="output .gguf file")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    p.add_argument("--no-dsa", action="store_true",
                   help="convert a K3.1-Pro checkpoint as plain kimi-k3 (no indexer keys or tensors)")
    p.add_argument("--quiet", action="store_true", help="print nothing but errors")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    log = (lambda _msg: None) if args.quiet else print
    try:
        convert(args.model_dir, args.out, overwrite=args.overwrite, dsa=not args.no_dsa, log=log)
    except KimiError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("error: interrupted; no output written", file=sys.stderr)
        return EXIT_INTERRUPTED
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    return 0


if __name__ == "__main__":
    sys.exit(main())
