"""What a conversion would write, without converting: `--print-tensor-types` and `--dry-run` (the
text GGUF, and with `--mmproj` the mmproj: `mmproj_listing`).

`listing_resolution` gives every output tensor's final type; `planned_files` / `plan_lines` the
dry run: every output tensor (GGUF name, type, bytes) under the file it lands in, each file's
exact size, and the total. Without shards (a checkpoint being downloaded, or only its index) the
source types come from config.json. Without the tokenizer files the GGUF header cannot be built:
the sizes are then the tensor data only, and the listing says so.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, NamedTuple

from ..arch.config import K3Config, parse_config, read_config_json, text_section
from ..arch.keys import ARCH, DRY_RUN_HEADER, dsa_key_lines, moe_key_lines
from ..arch.mmproj import ARCH as MMPROJ_ARCH, plan_vision_tensors
from ..arch.tensors import plan_tensors
from ..arch.tokenizer import TIKTOKEN_FILE
from ..arch.vision import VisionConfig, load_vision_config
from ..errors import ConfigError
from ..io.console import human_size
from ..io.gguf_writer import GGUFLayout, padded
from ..io.safetensors import TensorMeta, open_checkpoint, read_weight_map
from ..io.split import SplitLimits
from .mmproj import MmprojOptions, mmproj_metadata, plan_mmproj
from .plan import check_source_count, gguf_metadata, plan_conversion, resolve_plan
from .resume import OutputFile
from .run import output_files
from quant_rules.apply import final_outputs
from quant_rules.rules import QuantOptions, Resolution, type_name


# config.json `dtype` / `torch_dtype` -> safetensors dtype, for listing types without shards.
_DECLARED_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def _declared_dtype(path: Path, raw: dict) -> str:
    text = text_section(raw)
    declared = text.get("dtype", text.get("torch_dtype"))
    if declared not in _DECLARED_DTYPES:
        raise ConfigError(f"{path}: text_config.dtype is {declared!r}; without the shards the source types are "
                          f"taken from it, so it must be one of {', '.join(_DECLARED_DTYPES)}")
    return _DECLARED_DTYPES[declared]


def _declared_metas(names: Iterable[str], cfg: K3Config, dtype: str) -> dict[str, TensorMeta]:
    """Index names with the shapes the config implies and the config's declared dtype, except for the
    sources the checkpoint stores in another dtype than bf16 (the f32 families, the u8 experts):
    config.json's dtype does not cover those."""
    shared: dict[tuple, TensorMeta] = {}  # 497k sources, a few hundred distinct metas
    expected: dict[str, TensorMeta] = {}
    for pt in plan_tensors(cfg):
        dtypes = [dtype if s.stored == "BF16" else s.stored for s in pt.spec.sources]
        for i, (name, shape) in enumerate(pt.sources):
            key = (dtypes[i % len(dtypes)], shape)
            expected[name] = shared.get(key) or shared.setdefault(key, TensorMeta(*key))
    unplanned = TensorMeta(dtype, ())
    return {name: expected.get(name, unplanned) for name in names}


class Listing(NamedTuple):
    types: Resolution
    source: str  # where the source types came from
    cfg: K3Config  # as the conversion plans it (without the indexer under --no-dsa)


def listing_resolution(model_dir: Path, options: QuantOptions, dsa: bool = True) -> Listing:
    """The types a conversion would write, without converting: from the shard headers when the shards
    are there, else from config.json and the index alone (source dtypes as config.json declares)."""
    path, raw = read_config_json(model_dir)
    cfg = parse_config(raw, str(path))  # a dict from here on
    wmap = read_weight_map(model_dir)
    if any((model_dir / s).is_file() for s in set(wmap.values())):
        with open_checkpoint(model_dir) as ckpt:
            metas = ckpt.metas
        source = "source types from the shard headers"
    else:
        dtype = _declared_dtype(path, raw)
        check_source_count(cfg, wmap)
        metas = _declared_metas(wmap, cfg, dtype)
        source = (f"source types as config.json declares them ({dtype.lower()}, except the tensors K3 stores "
                  "in f32 and the mxfp4 routed experts): no shard present")
    plan = plan_conversion(cfg, metas, dsa=dsa)
    return Listing(resolve_plan(plan.outputs, options), source, plan.cfg)


def planned_files(model_dir: Path, out: Path, *, dsa: bool = True, quant: QuantOptions = QuantOptions(),
                  split: SplitLimits = SplitLimits()) -> tuple[list[OutputFile], list[str]]:
    """(the files a conversion would write, notes on how the plan was made)."""
    types, source, cfg = listing_resolution(model_dir, quant, dsa=dsa)
    notes = [source, *dsa_key_lines(cfg), *moe_key_lines(cfg), *types.log]
    has_tokenizer = (model_dir / TIKTOKEN_FILE).is_file()
    kv = tuple(gguf_metadata(cfg, model_dir)) if has_tokenizer else ()
    layout = GGUFLayout(ARCH, kv, final_outputs(types))
    files = output_files(out, layout, split)
    if not has_tokenizer:
        notes.append(f"no {TIKTOKEN_FILE}: file sizes are the tensor data only (the header, mostly the "
                     "tokenizer, is not counted)")
        files = [OutputFile(f.path, f.layout, sum(padded(t.nbytes) for t in f.layout.tensors)) for f in files]
    return files, notes


def _vision_metas(model_dir: Path, vcfg: VisionConfig) -> tuple[dict[str, TensorMeta], str]:
    """The vision tensors' metas: from the shard headers, or as config.json declares them."""
    path, raw = read_config_json(model_dir)
    wmap = read_weight_map(model_dir)
    if any((model_dir / s).is_file() for s in set(wmap.values())):
        with open_checkpoint(model_dir) as ckpt:
            return dict(ckpt.metas), "source types from the shard headers"
    dtype = _declared_dtype(path, raw)
    shapes = {name: shape for pt in plan_vision_tensors(vcfg) for name, shape in pt.sources}
    return ({n: TensorMeta(dtype, shapes.get(n, ())) for n in wmap},
            f"source types as config.json declares them ({dtype.lower()}): no shard present")


def mmproj_listing(model_dir: Path, mmproj: MmprojOptions, split: SplitLimits = SplitLimits(),
                   ) -> tuple[Resolution, list[OutputFile], list[str]]:
    """(the mmproj's tensor types, its files, notes): what `--mmproj` would write."""
    vcfg, origin = load_vision_config(model_dir)
    metas, source = _vision_metas(model_dir, vcfg)
    plan = plan_mmproj(vcfg, metas)
    types = resolve_plan(plan.outputs, mmproj.quant)
    layout = GGUFLayout(MMPROJ_ARCH, tuple(mmproj_metadata(vcfg, model_dir)), final_outputs(types))
    return types, output_files(mmproj.path, layout, split), [f"mmproj: {source}; {origin}", *types.log]


def plan_lines(files: list[OutputFile], notes: list[str]) -> list[str]:
    """The printed plan: one line per tensor, one per file, one total."""
    lines = [DRY_RUN_HEADER, *notes]
    width = max((len(t.name) for f in files for t in f.layout.tensors), default=4)
    for f in files:
        lines.append(f"file {f.path}: {len(f.layout.tensors)} tensors, {f.size} bytes ({human_size(f.size)})")
        lines.extend(f"  {t.name:<{width}}  {type_name(t.ggml_type):<6}  {t.nbytes}" for t in f.layout.tensors)
    total = sum(f.size for f in files)
    lines.append(f"total: {len(files)} file(s), {sum(len(f.layout.tensors) for f in files)} tensors, "
                 f"{total} bytes ({human_size(total)})")
    return lines
