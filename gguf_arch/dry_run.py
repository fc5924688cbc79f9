"""`--dry-run`: the conversion's output plan from config.json and the shard headers, nothing written.

Every output tensor (GGUF name, type, bytes) under the file it lands in, each file's exact size,
and the total. Without shards (a checkpoint being downloaded, or only its index) the source types
come from config.json, as for --print-tensor-types. Without the tokenizer files the GGUF header
cannot be built: the sizes are then the tensor data only, and the listing says so.
"""
from __future__ import annotations

from pathlib import Path

from quant_rules.apply import final_outputs
from quant_rules.cli_options import listing_resolution
from quant_rules.rules import QuantOptions, type_name

from .console import human_size
from .convert import gguf_metadata, output_files
from .keys import ARCH, dsa_key_lines
from .resume import OutputFile
from .split import SplitLimits
from .tokenizer import TIKTOKEN_FILE
from .writer import GGUFLayout, padded


def planned_files(model_dir: Path, out: Path, *, dsa: bool = True, quant: QuantOptions = QuantOptions(),
                  split: SplitLimits = SplitLimits()) -> tuple[list[OutputFile], list[str]]:
    """(the files a conversion would write, notes on how the plan was made)."""
    types, source, cfg = listing_resolution(model_dir, quant, dsa=dsa)
    notes = [source, *dsa_key_lines(cfg), *types.log]
    has_tokenizer = (model_dir / TIKTOKEN_FILE).is_file()
    kv = tuple(gguf_metadata(cfg, model_dir)) if has_tokenizer else ()
    layout = GGUFLayout(ARCH, kv, final_outputs(types))
    files = output_files(out, layout, split)
    if not has_tokenizer:
        notes.append(f"no {TIKTOKEN_FILE}: file sizes are the tensor data only (the header, mostly the "
                     "tokenizer, is not counted)")
        files = [OutputFile(f.path, f.layout, sum(padded(t.nbytes) for t in f.layout.tensors)) for f in files]
    return files, notes


def plan_lines(files: list[OutputFile], notes: list[str]) -> list[str]:
    """The printed plan: one line per tensor, one per file, one total."""
    lines = ["dry run: nothing written", *notes]
    width = max((len(t.name) for f in files for t in f.layout.tensors), default=4)
    for f in files:
        lines.append(f"file {f.path}: {len(f.layout.tensors)} tensors, {f.size} bytes ({human_size(f.size)})")
        lines.extend(f"  {t.name:<{width}}  {type_name(t.ggml_type):<6}  {t.nbytes}" for t in f.layout.tensors)
    total = sum(f.size for f in files)
    lines.append(f"total: {len(files)} file(s), {sum(len(f.layout.tensors) for f in files)} tensors, "
                 f"{total} bytes ({human_size(total)})")
    return lines
