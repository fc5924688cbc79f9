"""Tensor diff: each GGUF tensor of the chosen layers against the HF checkpoint it came from.

Every expected tensor is recomputed from the safetensors bytes with small reference forms of its
own (`reference.py`: per-head slicing for kv_b, float64 `-exp` for ssm_a, the E2M1 x 2^(e-127)
values of the routed experts). Neither this module nor those forms import the converter's write
path (`transforms`, the repack, `gguf_writer`), so a bug there cannot also be in the check that is
meant to catch it. The checkpoint is read with the one safetensors reader (`io.safetensors`), the
GGUF with gguf-py's GGUFReader and decoded with gguf-py's own dequantizers.

Verdicts per tensor:
  exact         the GGUF type is the table's output type and every value is equal (floats: also
                the sign of zero; MXFP4: the decoded values, since ggml's table has no -0)
  within_bound  the GGUF holds another type (a quantized trunk, issue 4): its dequantized values
                are within that type's rounding bound of the source (`bounds.py`)
  mismatch      a value differs; the first one is reported (per expert for stacked experts)
  missing / unexpected / type / shape   as the names say

Memory stays bounded: tensors are compared in row chunks, stacked experts one expert at a time.
Exit codes follow cmp(1): 0 every tensor matches, 1 a difference, 2 bad input (errors.py).
"""
from __future__ import annotations

from ..errors.signals import install

install()  # first: a stop signal during the imports below ends as documented

import argparse
import dataclasses
import itertools
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Mapping

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf.quants import dequantize

from ..arch.config import K3Config
from ..arch.keys import ARCH, EXPERT_COUNT
from ..arch.pruned import is_per_expert, read_kept, select_experts
from ..arch.tensors import PlannedTensor
from ..errors import CheckpointError, KimiError, run_cli
from ..io.console import ArgumentParser, task_bar
from ..io.safetensors import Checkpoint, open_checkpoint
from .bounds import BOUNDS
from .gguf_rows import GGUFRows, releasing
from .plans import ModelPlan, model_plan
from .reference import REFERENCES, Chunk, Source, exact_type

DIFFERENCES_EXIT = 1
_MAX_UNITS_SHOWN = 8  # failing experts named in one line

# ---- the comparison ------------------------------------------------------------------------

EXACT, WITHIN_BOUND, MISMATCH = "exact", "within_bound", "mismatch"
MISSING, UNEXPECTED, TYPE, SHAPE = "missing", "unexpected", "type", "shape"
OK_STATUSES = frozenset({EXACT, WITHIN_BOUND})


@dataclass(frozen=True)
class Mismatch:
    flat: int  # index into the GGUF tensor's elements in numpy (C) order
    coords: tuple[int, ...]  # the same in the GGUF numpy shape
    expected: float
    found: float
    unit: str | None = None

    def describe(self) -> str:
        where = f"{self.unit}: " if self.unit else ""
        return (f"{where}first mismatch at {list(self.coords)} (flat {self.flat}): "
                f"expected {np.float32(self.expected)!s}, found {np.float32(self.found)!s}")


@dataclass(frozen=True)
class TensorDiff:
    name: str
    layer: int | None
    status: str
    detail: str = ""
    gguf_type: str | None = None
    table_type: str | None = None  # the type the table gives it unquantized
    mismatches: tuple[Mismatch, ...] = ()

    @property
    def ok(self) -> bool:
        return self.status in OK_STATUSES

    def line(self) -> str:
        return f"{self.name}  {self.status.upper() if not self.ok else self.status}" + \
            (f"  {self.detail}" if self.detail else "")


@dataclass
class DiffReport:
    model_dir: str
    gguf: str
    layers: tuple[int, ...]
    tensors: list[TensorDiff] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(t.ok for t in self.tensors)

    def counts(self) -> dict[str, int]:
        order = (EXACT, WITHIN_BOUND, MISMATCH, MISSING, UNEXPECTED, TYPE, SHAPE)
        return {s: sum(t.status == s for t in self.tensors) for s in order}

    def summary(self) -> str:
        counts = self.counts()
        parts = ", ".join(f"{n} {s.replace('_', ' ')}" for s, n in counts.items() if n or s == EXACT)
        verdict = "all match" if self.ok else "DIFFERENT"
        return f"{len(self.tensors)} tensors over {len(self.layers)} layers: {parts}: {verdict}"

    def to_json(self) -> dict:
        return {"model_dir": self.model_dir, "gguf": self.gguf, "layers": list(self.layers), "ok": self.ok,
                "counts": self.counts(), "tensors": [asdict(t) for t in self.tensors]}


def _first_mismatch(plan: PlannedTensor, chunk: Chunk, bad: np.ndarray, expected: np.ndarray,
                    found: np.ndarray) -> Mismatch:
    r, c = np.unravel_index(int(np.argmax(bad)), bad.shape)
    flat = (chunk.row + int(r)) * plan.shape[-1] + int(c)
    coords = tuple(int(i) for i in np.unravel_index(flat, plan.shape))
    return Mismatch(flat, coords, float(expected[r, c]), float(found[r, c]), chunk.unit)


# The largest finite magnitude a type's values (or its f16 block scales) hold: an expected value
# beyond it has no finite encoding, so a non-finite value found there is what the type gives.
_F16_MAX = float(np.finfo(np.float16).max)
_FINITE_MAX = {Q.F16: _F16_MAX, Q.BF16: 3.3895313892515355e38, Q.Q8_0: _F16_MAX, Q.Q4_0: _F16_MAX,
               Q.Q4_1: _F16_MAX, Q.Q5_0: _F16_MAX, Q.Q5_1: _F16_MAX}


def _non_finite_agrees(expected: np.ndarray, found: np.ndarray, qtype: Q) -> np.ndarray:
    """Where a value found is right although the reference is not finite, or it is not: the
    reference is non-finite there too, the MXFP4 block has a NaN scale, or the expected value (of
    its block, for block types) is beyond what the type can hold finitely."""
    agrees = ~np.isfinite(expected) & ~np.isfinite(found)
    if qtype == Q.MXFP4:
        # A block whose E8M0 scale is NaN (0xFF) is NaN by the format; ggml decodes it as 2^127
        # times its nibbles (0, huge, inf): none of those values means anything to compare.
        agrees |= np.isnan(expected)
    limit = _FINITE_MAX.get(qtype)
    if limit is not None:
        block = GGML_QUANT_SIZES[qtype][0]
        with np.errstate(invalid="ignore"):
            over = np.abs(expected) > limit
        over = np.repeat(over.reshape(*over.shape[:-1], -1, block).any(axis=-1), block, axis=-1)
        agrees |= over.reshape(found.shape) & ~np.isfinite(found)
    return agrees


def _bad_values(expected: np.ndarray, found: np.ndarray, qtype: Q, exact: bool) -> np.ndarray:
    agreed = _non_finite_agrees(expected, found, qtype)
    if not exact:
        with np.errstate(invalid="ignore", over="ignore"):
            return ~(agreed | (np.abs(found.astype(np.float64) - expected) <= BOUNDS[qtype](expected)))
    same = (found == expected) | agreed
    if qtype != Q.MXFP4:  # ggml's MXFP4 table has no -0; the float types keep the sign of zero
        same &= np.signbit(found) == np.signbit(expected)
    return ~same


def _compare(gguf: GGUFRows, plan: PlannedTensor, chunks: Iterable[Chunk], qtype: Q, exact: bool) -> list[Mismatch]:
    """First mismatch of the tensor, or of each unit (expert) when the chunks name units."""
    found_bad: list[Mismatch] = []
    for chunk in chunks:
        with np.errstate(over="ignore", invalid="ignore"):  # non-finite values are compared, not warned about
            found = dequantize(gguf.rows(plan.name, chunk.row, len(chunk.values)), qtype)
        bad = _bad_values(chunk.values, found.reshape(chunk.values.shape), qtype, exact)
        if bad.any():
            found_bad.append(_first_mismatch(plan, chunk, bad, chunk.values, found.reshape(chunk.values.shape)))
            if chunk.unit is None:
                break
    return found_bad


def _type_problem(plan: PlannedTensor, qtype: Q, want: Q) -> str | None:
    if qtype != want and qtype not in BOUNDS:
        return f"GGUF type {qtype.name}, expected {want.name} (no error bound known for {qtype.name})"
    block = GGML_QUANT_SIZES[qtype][0]
    if plan.shape[-1] % block:
        return f"GGUF type {qtype.name} needs rows of whole {block}-blocks, the row length is {plan.shape[-1]}"
    return None


def _source(ckpt: Checkpoint, name: str, shape: tuple[int, ...], dtypes: Iterable[str]) -> Source:
    entry = ckpt.entries.get(name)
    if entry is None:
        raise CheckpointError(f"{ckpt.model_dir}: tensor {name} is not in the checkpoint")
    where = f"{ckpt.model_dir / entry.shard}: tensor {name}"
    if entry.meta.dtype not in dtypes:
        raise CheckpointError(f"{where} has dtype {entry.meta.dtype!r}, expected one of {sorted(dtypes)}")
    if entry.meta.shape != shape:
        raise CheckpointError(f"{where} has shape {list(entry.meta.shape)}, the config implies {list(shape)}")
    return Source(name, entry.meta.dtype, ckpt.array(name))


def read_sources(ckpt: Checkpoint, plan: PlannedTensor) -> list[Source]:
    """The plan's sources (per expert: the table's source rows again), checked against the table."""
    specs = itertools.cycle(plan.spec.sources)
    return [_source(ckpt, name, shape, spec.dtypes) for (name, shape), spec in zip(plan.sources, specs)]


def _diff_one(ckpt: Checkpoint, gguf: GGUFRows, cfg: K3Config, plan: PlannedTensor,
              intended: Mapping[str, str], kept: tuple[int, ...] | None = None) -> TensorDiff:
    """kept: for a per-expert tensor of a pruned GGUF, the original ids of the experts it holds."""
    t = gguf.tensors[plan.name]
    qtype = Q(t.tensor_type)
    sources = read_sources(ckpt, plan)
    want = exact_type(plan, sources)
    references = REFERENCES[plan.transform](cfg, plan, sources)
    if kept is not None:
        references = select_experts(references, plan.shape, kept, Chunk)
        plan = dataclasses.replace(plan, shape=(len(kept), *plan.shape[1:]))

    def result(status: str, detail: str, mismatches: Iterable[Mismatch] = ()) -> TensorDiff:
        return TensorDiff(plan.name, plan.layer, status, detail, qtype.name, want.name, tuple(mismatches))

    found_shape = tuple(int(n) for n in reversed(t.shape))
    if found_shape != plan.shape:
        return result(SHAPE, f"GGUF shape {list(found_shape)} (numpy order), expected {list(plan.shape)}")
    problem = _type_problem(plan, qtype, want)
    if plan.name in intended and intended[plan.name] != qtype.name:
        problem = f"GGUF type {qtype.name}, the conversion intended {intended[plan.name]}"
    if problem:
        return result(TYPE, problem)
    exact = qtype == want
    mismatches = _compare(gguf, plan, releasing(references, gguf), qtype, exact)
    if mismatches:
        shown = "; ".join(m.describe() for m in mismatches[:_MAX_UNITS_SHOWN])
        more = f"; and {len(mismatches) - _MAX_UNITS_SHOWN} more" if len(mismatches) > _MAX_UNITS_SHOWN else ""
        bound = "" if exact else f" (beyond the {qtype.name} bound; expected type {want.name})"
        return result(MISMATCH, shown + more + bound, mismatches)
    return result(EXACT, "") if exact else result(WITHIN_BOUND, f"within {qtype.name} bound (source type {want.name})")


# ---- the diff over a layer selection --------------------------------------------------------

def _pruned_experts(gguf: GGUFRows, cfg: K3Config) -> dict[int, tuple[int, ...]]:
    """The kept experts of a GGUF made by kimi-k3-prune (arch/pruned.py); {} when unpruned."""
    f = gguf.reader.fields
    meta = {k: f[k].contents() for k in f if k.startswith(ARCH)}
    pruning = read_kept(meta, cfg.moe_layers, meta.get(EXPERT_COUNT, cfg.num_experts), str(gguf.path))
    if pruning is None:
        return {}
    if pruning[0] != cfg.num_experts:
        raise KimiError(f"{gguf.path}: pruned from a model with {pruning[0]} experts per layer, the checkpoint has "
                        f"{cfg.num_experts}")
    return pruning[1]


def select_layers(cfg: K3Config, layers: Iterable[int] | None) -> tuple[int, ...]:
    if layers is None:
        return tuple(range(cfg.num_layers))
    chosen = tuple(sorted(set(int(l) for l in layers)))
    outside = [l for l in chosen if not 0 <= l < cfg.num_layers]
    if outside:
        raise KimiError(f"layers {outside} are outside 0..{cfg.num_layers - 1} "
                        f"(0-based; the model has {cfg.num_layers})")
    return chosen


def _in_scope(layer: int | None, chosen: set[int], include_globals: bool) -> bool:
    return (layer is None and include_globals) or layer in chosen


def iter_tensor_diffs(model_dir: Path | str, gguf_path: Path | str, layers: Iterable[int] | None = None,
                      include_globals: bool = True, intended_types: Mapping[str, str] | None = None,
                      ) -> Iterator[TensorDiff]:
    """Per tensor verdicts in file order, then the GGUF's unexpected tensors (stop early at will); an
    mmproj against the checkpoint's vision tower (`plans.model_plan`), its blocks as the layers.

    `intended_types` (GGUF name -> GGML type name, e.g. from the quantization rules) makes any other
    type a `type` difference; without it every type with a known error bound is compared.
    """
    mp = model_plan(model_dir, gguf_path)
    chosen = set(select_layers(mp.cfg, layers))
    with open_checkpoint(model_dir) as ckpt:
        yield from _diffs(ckpt, GGUFRows(Path(gguf_path)), mp, chosen, include_globals, intended_types or {})


def _diffs(ckpt: Checkpoint, gguf: GGUFRows, mp: ModelPlan, chosen: set[int], include_globals: bool,
           intended: Mapping[str, str]) -> Iterator[TensorDiff]:
    cfg, kept = mp.cfg, {} if mp.is_mmproj else _pruned_experts(gguf, mp.cfg)
    expected: set[str] = set()
    for plan in mp.tensors():
        if not _in_scope(plan.layer, chosen, include_globals):
            continue
        if plan.spec.optional and plan.sources[0][0] not in ckpt.entries:
            continue  # not in this checkpoint, so not in its plan: a GGUF copy is unexpected
        expected.add(plan.name)
        if plan.name not in gguf.tensors:
            yield TensorDiff(plan.name, plan.layer, MISSING, "in the plan, not in the GGUF")
        else:
            yield _diff_one(ckpt, gguf, cfg, plan, intended,
                            kept.get(plan.layer) if is_per_expert(plan.name, plan.layer) else None)
    for name, t in gguf.tensors.items():
        layer = mp.layer_of(name)
        in_scope = layer in chosen or (layer is None and include_globals) or (layer or 0) >= cfg.num_layers
        if in_scope and name not in expected:
            yield TensorDiff(name, layer, UNEXPECTED, "in the GGUF, not in the plan for this checkpoint",
                             Q(t.tensor_type).name)


def diff_gguf(model_dir: Path | str, gguf_path: Path | str, layers: Iterable[int] | None = None,
              include_globals: bool = True, intended_types: Mapping[str, str] | None = None) -> DiffReport:
    """Compare every GGUF tensor of `layers` (None: all) and, if asked, the globals with the checkpoint."""
    cfg = model_plan(model_dir, gguf_path).cfg
    report = DiffReport(str(model_dir), str(gguf_path), select_layers(cfg, layers))
    report.tensors.extend(iter_tensor_diffs(model_dir, gguf_path, report.layers, include_globals, intended_types))
    _compared_something(report, include_globals)
    return report


# ---- command line ---------------------------------------------------------------------------

def _parse_layers(text: str) -> list[int] | None:
    if text.strip().lower() == "all":
        return None
    try:
        layers = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        layers = []
    if not layers:
        raise KimiError(f"--layers must be 'all' or comma-separated 0-based layer numbers, got {text!r}")
    return layers


def _compared_something(report: DiffReport, include_globals: bool) -> None:
    """A diff that compared no tensor proves nothing: never "all match" for it."""
    if not report.tensors:
        scope = f"layers {list(report.layers)}" + (" and the globals" if include_globals else "")
        raise KimiError(f"{report.gguf}: no tensor to compare in {scope} (nothing was checked)")


def _parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="kimi-k3-diff",
        description="Compare a kimi-k3 GGUF (or mmproj) tensor by tensor with the HF checkpoint it came from. "
                    "Exit 0: everything matches; 1: a difference; 2: bad input.")
    parser.add_argument("model_dir", type=Path, metavar="MODEL_DIR", help="HF checkpoint directory (config.json + safetensors shards)")
    parser.add_argument("gguf", type=Path, metavar="GGUF", help="the converted GGUF file")
    parser.add_argument("--layers", default="all", help="'all' (default) or 0-based layers, e.g. 0,3,12")
    parser.add_argument("--no-globals", action="store_true",
                        help="leave out token_embd, output and the other globals")
    parser.add_argument("--json", action="store_true", help="one JSON report instead of one line per tensor")
    return parser


def _run(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    mp = model_plan(args.model_dir, args.gguf)
    report = DiffReport(str(args.model_dir), str(args.gguf), select_layers(mp.cfg, _parse_layers(args.layers)))
    in_scope = [p for p in mp.tensors() if _in_scope(p.layer, set(report.layers), not args.no_globals)]
    with task_bar("comparing", len(in_scope), enabled=sys.stderr.isatty()) as bar:
        for diff in iter_tensor_diffs(args.model_dir, args.gguf, report.layers, not args.no_globals):
            report.tensors.append(diff)
            bar.update()
            if not args.json:
                bar.write(diff.line(), file=sys.stdout)
    _compared_something(report, not args.no_globals)
    print(json.dumps(report.to_json(), indent=1) if args.json else report.summary())
    return 0 if report.ok else DIFFERENCES_EXIT


def main(argv: list[str] | None = None) -> int:
    # Parsing runs inside run_cli: a bad argument is the one-line error of every console script.
    return run_cli(lambda: _run(argv))


if __name__ == "__main__":
    sys.exit(main())
