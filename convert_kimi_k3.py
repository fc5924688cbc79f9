"""Convert a Kimi K3 / K3.1-Pro Hugging Face checkpoint to one GGUF file (arch kimi-k3).

    python convert_kimi_k3.py MODEL_DIR OUT.gguf [--overwrite | --resume] [--no-dsa] [--quiet] [type options]
        (or --outfile OUT.gguf, as llama.cpp's convert_hf_to_gguf.py)
        [--split-max-size N(K|M|G)] [--split-max-tensors N] [--log-json FILE] [--dry-run]
        [--mmproj MMPROJ.gguf [--mmproj-tensor-type PATTERN=TYPE]]
    python convert_kimi_k3.py MODEL_DIR --mmproj MMPROJ.gguf --mmproj-only [--dry-run] [...]
    python convert_kimi_k3.py MODEL_DIR --print-tensor-types [type options] [--mmproj MMPROJ.gguf]
    python convert_kimi_k3.py --verify OUT.gguf MODEL_DIR    (OUT.gguf: a text GGUF or an mmproj)

Exit codes: 0 ok, 2 bad input (including a missing or truncated shard), 1 runtime failure (I/O,
not enough free disk, output exists; with --verify: the first difference from the manifest or the
checkpoint), 130 Ctrl-C, 143 SIGTERM, 129 SIGHUP.
"""
from __future__ import annotations

from gguf_arch.errors.signals import install

install("no output written")  # first: a stop signal during the imports below is the documented line and code

import argparse
import sys
from pathlib import Path

from gguf_arch.arch.keys import dsa_key_lines
from gguf_arch.convert.listing import listing_resolution, mmproj_listing, plan_lines, planned_files
from gguf_arch.convert.mmproj import MmprojOptions
from gguf_arch.convert.run import OutputOptions, convert
from gguf_arch.errors import run_cli
from gguf_arch.io.console import ArgumentParser, cpu_count, output_file
from gguf_arch.io.output_paths import OutputPaths
from gguf_arch.io.split import SplitLimits, parse_size
from gguf_arch.verify.verify import verify
from quant_rules.options import (add_quant_arguments, format_tensor_types, quant_options, requantize_warning,
                                 write_quantize_rules)
from quant_rules.rules import parse_tensor_type


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="convert-kimi-k3", description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir", type=Path, help="checkpoint directory (config.json, index, shards, tokenizer)")
    p.add_argument("out", type=output_file, nargs="?", metavar="OUT", help="output .gguf file (not with --print-tensor-types)")
    p.add_argument("--outfile", type=output_file, metavar="OUT", help="the output file, as llama.cpp's converter names it "
                                                              "(instead of the positional OUT)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    p.add_argument("--no-dsa", action="store_true",
                   help="convert a K3.1-Pro checkpoint as plain kimi-k3 (no indexer keys or tensors)")
    p.add_argument("--quiet", action="store_true", help="print nothing but errors (no progress bar)")
    p.add_argument("--resume", action="store_true",
                   help="continue an interrupted conversion: keep its finished files once verified against "
                        "their manifests (.manifest.json, or an earlier converter's .sha256.json), rewrite the rest")
    p.add_argument("--dry-run", action="store_true",
                   help="print every output file and tensor with its type and bytes; read only config.json "
                        "and the shard headers, write nothing")
    p.add_argument("--split-max-size", metavar="N(K|M|G)",
                   help="split the output into OUT-00001-of-0000N.gguf parts of at most this much tensor data "
                        "(powers of 1000, as llama.cpp; a larger tensor gets a part of its own)")
    p.add_argument("--split-max-tensors", metavar="N", type=int, default=0,
                   help="split the output into parts of at most N tensors")
    p.add_argument("--log-json", type=output_file, metavar="FILE",
                   help="write one JSON progress line per tensor to FILE (file, tensor, bytes done/total, "
                        "elapsed, rate)")
    p.add_argument("--allow-non-finite", action="store_true",
                   help="write tensors holding NaN or inf (one warning line per tensor) instead of refusing them")
    p.add_argument("--verify", type=Path, metavar="OUT.gguf",
                   help="re-check OUT.gguf against its manifest (OUT.gguf.manifest.json: BLAKE3; an earlier "
                        "converter's OUT.gguf.sha256.json: SHA-256) and every tensor against MODEL_DIR")
    p.add_argument("-j", "--threads", type=int, metavar="N",
                   help="worker threads per stage (expert repack, shard reads in flight, non-finite scan, BLAKE3 digest; "
                        "default: the CPUs this process may run on); the output bytes do not depend on it")
    add_quant_arguments(p)
    g = p.add_argument_group("vision (the tower and projector as llama.cpp's separate mmproj GGUF)")
    g.add_argument("--mmproj", type=output_file, metavar="MMPROJ.gguf",
                   help="also write the vision tower and projector to MMPROJ.gguf (general.architecture clip, "
                        "projector type kimik3); planned and checked with OUT before either is written")
    g.add_argument("--mmproj-only", action="store_true", help="write only the mmproj (no OUT)")
    g.add_argument("--mmproj-tensor-type", action="append", default=[], metavar="PATTERN=TYPE",
                   help="as --tensor-type, for the mmproj's tensors (v.*, mm.*): the text model's type options "
                        "never change them; the norms stay F32")
    return p


def _list_only(args: argparse.Namespace, quant, mmproj: MmprojOptions | None, split: SplitLimits, log) -> None:
    """--print-tensor-types and --dry-run: print; the one file written is --export-quantize-rules."""
    text = not args.mmproj_only
    types, source, cfg = listing_resolution(args.model_dir, quant, dsa=not args.no_dsa) if text else (None,) * 3
    vision = mmproj_listing(args.model_dir, mmproj, split) if mmproj is not None else None
    if args.export_quantize_rules:
        guard = OutputPaths([(args.model_dir, "the model directory")])
        guard.add(args.export_quantize_rules, "the llama-quantize rules (--export-quantize-rules)",
                  replace=args.overwrite)
        guard.check()
    if args.print_tensor_types:
        if text:
            print("\n".join([source, *dsa_key_lines(cfg), *types.log, *format_tensor_types(types)]))
        if vision is not None:
            print("\n".join([*vision[2], *format_tensor_types(vision[0])]))
    if args.dry_run:
        files, notes = planned_files(args.model_dir, args.out, dsa=not args.no_dsa, quant=quant,
                                     split=split) if text else ([], [])
        if vision is not None:
            files, notes = files + vision[1], notes + vision[2]
        print("\n".join(plan_lines(files, notes)))
    if args.export_quantize_rules:
        log(write_quantize_rules(args.export_quantize_rules, types, args.overwrite))


def _run(args: argparse.Namespace, log) -> None:
    if args.verify:
        verify(args.verify, args.model_dir, log, bar=not args.quiet and sys.stderr.isatty())
        return
    quant = quant_options(args)
    if quant.requantize_experts is not None:
        print(requantize_warning(quant.requantize_experts), file=sys.stderr)
    split = SplitLimits(parse_size(args.split_max_size) if args.split_max_size is not None else 0,
                        args.split_max_tensors)
    mmproj = None if args.mmproj is None else MmprojOptions(
        args.mmproj, tuple(parse_tensor_type(r, "--mmproj-tensor-type") for r in args.mmproj_tensor_type))
    if args.print_tensor_types or args.dry_run:
        _list_only(args, quant, mmproj, split, log)
        return
    output = OutputOptions(split, args.resume, progress_bar=not args.quiet and sys.stderr.isatty(),
                           log_json=args.log_json, export_rules=args.export_quantize_rules,
                           allow_non_finite=args.allow_non_finite, threads=args.threads)
    convert(args.model_dir, None if args.mmproj_only else args.out, overwrite=args.overwrite, dsa=not args.no_dsa,
            quant=quant, output=output, log=log, mmproj=mmproj)


# Options that only a conversion reads: (attribute, flag), set when not at their default.
_WRITING = (("overwrite", "--overwrite"), ("resume", "--resume"), ("split_max_size", "--split-max-size"),
            ("split_max_tensors", "--split-max-tensors"), ("log_json", "--log-json"),
            ("allow_non_finite", "--allow-non-finite"), ("threads", "--threads"))
# Options of the text GGUF only: what --mmproj-only would ignore (--outtype, set when not auto, too).
_TEXT_ONLY = (("no_dsa", "--no-dsa"), ("export_quantize_rules", "--export-quantize-rules"),
              ("tensor_type", "--tensor-type"), ("tensor_type_file", "--tensor-type-file"),
              ("output_tensor_type", "--output-tensor-type"), ("token_embedding_type", "--token-embedding-type"),
              ("requantize_experts", "--requantize-experts"))
_CONVERTING = (*_WRITING, *_TEXT_ONLY, ("dry_run", "--dry-run"), ("print_tensor_types", "--print-tensor-types"),
               ("mmproj", "--mmproj"), ("mmproj_only", "--mmproj-only"), ("mmproj_tensor_type", "--mmproj-tensor-type"))


def _given(args: argparse.Namespace, options) -> list[str]:
    return [flag for attr, flag in options if getattr(args, attr) not in (None, False, 0, [])]


def _refuse_mmproj_misuse(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--mmproj-only writes no text GGUF: its options and OUT would be ignored; the mmproj options
    need --mmproj."""
    if args.mmproj is None:
        given = _given(args, (("mmproj_only", "--mmproj-only"), ("mmproj_tensor_type", "--mmproj-tensor-type")))
        if given:
            parser.error(f"{', '.join(given)} need(s) --mmproj MMPROJ.gguf")
        return
    if args.mmproj_only:
        ignored = _given(args, _TEXT_ONLY) + (["--outtype"] if args.outtype != "auto" else []) + \
            (["OUT"] if args.out is not None else [])
        if ignored:
            parser.error(f"--mmproj-only writes no text GGUF; {', '.join(ignored)} would be ignored")


def _refuse_ignored(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A combination whose option would be silently ignored is refused in one line."""
    if args.verify:
        ignored = _given(args, _CONVERTING) + (["OUT"] if args.out is not None else [])
        if ignored:
            parser.error(f"--verify takes OUT.gguf MODEL_DIR and checks it; {', '.join(ignored)} would be ignored")
        return
    if args.print_tensor_types:
        ignored = _given(args, [o for o in _WRITING if o[0] != "overwrite"]) + (["OUT"] if args.out else [])
        if ignored:
            parser.error(f"--print-tensor-types converts nothing; {', '.join(ignored)} would be ignored")
    elif args.dry_run:
        ignored = _given(args, [o for o in _WRITING if not o[0].startswith("split") and o[0] != "overwrite"])
        if ignored:
            parser.error(f"--dry-run writes nothing; {', '.join(ignored)} would be ignored")
    _refuse_mmproj_misuse(parser, args)
    if args.out is None and not args.print_tensor_types and not args.mmproj_only:
        parser.error("the output file OUT (or --outfile OUT) is required unless --print-tensor-types or "
                     "--mmproj-only is given")
    if args.resume and args.overwrite:
        parser.error("--resume keeps verified finished files, --overwrite replaces everything: pick one")
    if args.split_max_tensors < 0:
        parser.error("--split-max-tensors must be a positive number of tensors")
    if args.threads is not None and args.threads < 1:
        parser.error(f"-j/--threads must be at least 1, got {args.threads}")


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.outfile is not None:
        if args.out is not None and args.out != args.outfile:
            parser.error(f"two outputs: OUT {args.out} and --outfile {args.outfile}; give one")
        args.out = args.outfile
    _refuse_ignored(parser, args)
    if args.threads is None:
        args.threads = cpu_count()
    return args


def _main(argv: list[str] | None) -> None:
    args = _arguments(argv)
    _run(args, (lambda _msg: None) if args.quiet else print)


def main(argv: list[str] | None = None) -> int:
    return run_cli(lambda: _main(argv), interrupted="no output written")


if __name__ == "__main__":
    sys.exit(main())
