"""What a pruned GGUF records about its experts: per MoE layer, the original id of each kept one.

kimi-k3-prune keeps N experts per MoE layer (llama.cpp's `expert_count` is one number for every
layer) in ascending original id, so expert i of layer l in the file is expert kept[l][i] of the
checkpoint. Two keys (arch/keys.py) carry this: PRUNED_EXPERT_COUNT, the checkpoint's
expert count, and PRUNED_KEPT_EXPERTS, the N ids of every MoE layer in layer order, one flat
array (GGUF readers handle arrays of arrays unevenly). The tensor diff and --verify read them to
compare a pruned GGUF with the checkpoint (`select_experts`): kept experts bit for bit, the
others absent by design.
"""
from __future__ import annotations

from typing import Any, Iterator, Mapping, Sequence

import numpy as np
from gguf import GGUFValueType as T

from ..errors import GGUFError
from . import keys as K
from .tensors import PER_EXPERT, layer_name

Kept = dict[int, tuple[int, ...]]  # MoE layer -> original ids of its kept experts, ascending


def kept_keys(kept: Kept, original_count: int) -> list[tuple[str, Any, T, T | None]]:
    """The two keys (KV tuples as the writer takes them) recording `kept`."""
    flat = [e for layer in sorted(kept) for e in kept[layer]]
    return [(K.PRUNED_EXPERT_COUNT, original_count, T.UINT32, None),
            (K.PRUNED_KEPT_EXPERTS, flat, T.ARRAY, T.UINT32)]


def read_kept(meta: Mapping[str, Any], moe_layers: Sequence[int], n_expert: int, where: str) -> tuple[int, Kept] | None:
    """(original expert count, kept ids) of a pruned GGUF's metadata; None for an unpruned one.

    n_expert is the file's expert_count: every MoE layer keeps that many."""
    present = [k for k in (K.PRUNED_EXPERT_COUNT, K.PRUNED_KEPT_EXPERTS) if k in meta]
    if not present:
        return None
    if len(present) == 1:
        raise GGUFError(f"{where}: has {present[0]} without its companion key (the pruning keys come together)")
    original, flat = meta[K.PRUNED_EXPERT_COUNT], meta[K.PRUNED_KEPT_EXPERTS]
    if not isinstance(original, int) or original < n_expert:
        raise GGUFError(f"{where}: {K.PRUNED_EXPERT_COUNT} is {original!r}, expected at least expert_count {n_expert}")
    if not isinstance(flat, list) or len(flat) != len(moe_layers) * n_expert:
        raise GGUFError(f"{where}: {K.PRUNED_KEPT_EXPERTS} must list {n_expert} ids for each of the "
                        f"{len(moe_layers)} MoE layers ({len(moe_layers) * n_expert} values)")
    kept = {}
    for i, layer in enumerate(moe_layers):
        ids = tuple(flat[i * n_expert:(i + 1) * n_expert])
        if any(not isinstance(e, int) or not 0 <= e < original for e in ids) or list(ids) != sorted(set(ids)):
            raise GGUFError(f"{where}: {K.PRUNED_KEPT_EXPERTS} for layer {layer} must be distinct ascending ids in "
                            f"0..{original - 1}, got {list(ids)}")
        kept[layer] = ids
    return original, kept


def is_per_expert(name: str, layer: int | None) -> bool:
    return layer is not None and name in {layer_name(t, layer) for t in PER_EXPERT}


def select_experts(chunks: Iterator, shape: tuple[int, ...], kept: Sequence[int], make: type) -> Iterator:
    """Rows of a full per-expert tensor (first axis: the expert), as chunks of the pruned one.

    `chunks` yield (row, values [n, ne0], unit) records of the full tensor viewed as
    [prod(shape[:-1]), ne0] (`make` builds the same record type); a 1-D tensor (the router bias)
    is one row [1, E] whose columns are the experts.
    """
    index = {e: i for i, e in enumerate(kept)}
    if len(shape) == 1:
        for ch in chunks:
            yield make(0, ch.values[:, list(kept)], ch.unit)
        return
    per = int(np.prod(shape[1:-1], dtype=np.int64))  # rows of one expert
    for ch in chunks:
        expert_of = (ch.row + np.arange(len(ch.values))) // per
        for e in np.unique(expert_of):
            if int(e) in index:
                rows = np.flatnonzero(expert_of == e)
                offset = ch.row + int(rows[0]) - int(e) * per
                yield make(index[int(e)] * per + offset, ch.values[rows], ch.unit)
