"""REAP expert saliency: the accumulator kimi-k3-calibrate fills and the JSON kimi-k3-prune reads.

For expert j of a MoE layer, over the calibration tokens X_j that the router sends to j (REAP,
Lasby et al. 2025, eq. 9: the mean is over X_j, not over all tokens):

    count_j    = |X_j|
    saliency_j = (1 / |X_j|) * sum over x in X_j of g_j(x) * ||e_j(x)||_2      (0 when |X_j| = 0)

g_j(x) is the routing weight the model multiplies e_j(x) by: the sigmoid score renormalised over
the selected experts (`expert_weights_norm`), before the constant `expert_weights_scale`, which
scales every expert alike. e_j(x) is the expert's output in the latent space, the
[latent] vector ffn_down_exps writes for x (ggml_graph_spec/graph/taps.py), see `NORM_SPACE`.

The file:
    {"format": FORMAT, "model": NAME, "expert_count": E, "chunk_size": C, "tokens": N,
     "files": [{"path", "tag", "tokens", "chunks"}, ...],
     "layers": {"<layer>": {"count": [E ints], "saliency": [E floats],
                            "by_tag": {"<tag>": {"count": [...], "saliency": [...]}}}}}
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from ..errors import KimiError
from .atomic import write_atomically
from .jsonfile import read_json

FORMAT = "kimi-k3-saliency/1"

# Why the latent space: LatentMoE sums the routed experts' outputs in the latent space, RMS-norms
# the sum and only then projects it up (ffn_routed_up). No expert has an output of its own after
# the up-projection (the norm couples them), and ||ffn_routed_up e_j|| would measure the shared
# projection as much as the expert. The latent e_j is exactly what expert j adds to the sum.
NORM_SPACE = "latent (ffn_down_exps output, before ffn_routed_norm and ffn_routed_up)"


class SaliencyError(KimiError):
    """A saliency file is malformed or does not belong to the GGUF (exit code 2)."""


@dataclass
class ExpertStats:
    """count and the sum of g * ||e|| per expert, for one layer (and one tag)."""

    count: np.ndarray  # int64 [E]
    weighted: np.ndarray  # float64 [E]

    @classmethod
    def empty(cls, n_expert: int) -> "ExpertStats":
        return cls(np.zeros(n_expert, np.int64), np.zeros(n_expert, np.float64))

    def add(self, experts: np.ndarray, weights: np.ndarray, norms: np.ndarray) -> None:
        """One call's [T, k] routing: expert ids, their weights g and latent output norms."""
        np.add.at(self.count, experts.ravel(), 1)
        np.add.at(self.weighted, experts.ravel(), weights.astype(np.float64).ravel() * norms.ravel())

    @property
    def saliency(self) -> np.ndarray:
        return np.divide(self.weighted, self.count, out=np.zeros_like(self.weighted), where=self.count > 0)

    def to_json(self) -> dict[str, list]:
        return {"count": self.count.tolist(), "saliency": self.saliency.tolist()}


@dataclass
class SaliencyAccumulator:
    """Per MoE layer, overall and per tag: bounded by layers x experts x tags, whatever the corpus."""

    n_expert: int
    layers: dict[int, ExpertStats] = field(default_factory=dict)
    by_tag: dict[str, dict[int, ExpertStats]] = field(default_factory=dict)

    def add(self, tag: str, experts: Mapping[int, np.ndarray], weights: Mapping[int, np.ndarray],
            norms: Mapping[int, np.ndarray]) -> None:
        tagged = self.by_tag.setdefault(tag, {})
        for layer, ids in experts.items():
            for stats in (self.layers, tagged):
                stats.setdefault(layer, ExpertStats.empty(self.n_expert)).add(ids, weights[layer], norms[layer])

    def to_json(self, **header: Any) -> dict[str, Any]:
        layers = {}
        for layer, stats in sorted(self.layers.items()):
            entry = stats.to_json()
            entry["by_tag"] = {tag: per[layer].to_json() for tag, per in self.by_tag.items() if layer in per}
            layers[str(layer)] = entry
        return {"format": FORMAT, "expert_count": self.n_expert, **header, "layers": layers}


def write_saliency(path: Path, doc: Mapping[str, Any]) -> None:
    write_atomically(path, lambda tmp: tmp.write_text(json.dumps(doc) + "\n", encoding="utf-8"))


# ---- reading ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class LayerSaliency:
    count: np.ndarray  # int64 [E]
    saliency: np.ndarray  # float64 [E]


@dataclass(frozen=True)
class Saliency:
    expert_count: int
    layers: dict[int, LayerSaliency]  # overall
    by_tag: dict[str, dict[int, LayerSaliency]]

    def scores(self, tag: str | None) -> dict[int, LayerSaliency]:
        """Per layer: the overall statistics, or those of one tag."""
        if tag is None:
            return self.layers
        if tag not in self.by_tag:
            have = ", ".join(sorted(self.by_tag)) or "none"
            raise SaliencyError(f"no tag {tag!r} in the saliency file (it has {have})")
        return self.by_tag[tag]


def _vector(path: Path, where: str, value: Any, n: int, integral: bool) -> np.ndarray:
    ok = isinstance(value, list) and len(value) == n and all(
        not isinstance(v, bool) and isinstance(v, int if integral else (int, float)) and math.isfinite(v) and v >= 0
        for v in value)
    if not ok:
        kind = "non-negative integers" if integral else "finite non-negative numbers"
        raise SaliencyError(f"{path}: {where} must be a list of {n} {kind}")
    return np.asarray(value, dtype=np.int64 if integral else np.float64)


def _layer_stats(path: Path, where: str, entry: Any, n: int) -> LayerSaliency:
    if not isinstance(entry, dict):
        raise SaliencyError(f"{path}: {where} must be an object with count and saliency")
    return LayerSaliency(_vector(path, f"{where}.count", entry.get("count"), n, True),
                         _vector(path, f"{where}.saliency", entry.get("saliency"), n, False))


def read_saliency(path: Path, moe_layers: Sequence[int], n_expert: int) -> Saliency:
    """The file at `path`, checked against the GGUF it is applied to (its MoE layers, expert count)."""
    doc = read_json(path, SaliencyError, "no such saliency file (make one with kimi-k3-calibrate)")
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("layers"), dict):
        raise SaliencyError(f"{path}: not a {FORMAT} file (expected format and layers; made by kimi-k3-calibrate)")
    if doc.get("expert_count") != n_expert:
        raise SaliencyError(f"{path}: expert_count is {doc.get('expert_count')!r}, the GGUF has {n_expert} experts "
                            "per layer (calibrated on another model?)")
    want = {str(l) for l in moe_layers}
    if set(doc["layers"]) != want:
        raise SaliencyError(f"{path}: layers {sorted(doc['layers'], key=str)} differ from the GGUF's MoE layers "
                            f"{sorted(moe_layers)}")
    layers, by_tag = {}, {}
    for key, entry in doc["layers"].items():
        layer = int(key)
        layers[layer] = _layer_stats(path, f"layers.{key}", entry, n_expert)
        tags = entry.get("by_tag", {})
        if not isinstance(tags, dict):
            raise SaliencyError(f"{path}: layers.{key}.by_tag must be an object of tags")
        for tag, stats in tags.items():
            by_tag.setdefault(tag, {})[layer] = _layer_stats(path, f"layers.{key}.by_tag.{tag}", stats, n_expert)
    for tag, per in by_tag.items():
        if set(per) != set(layers):
            raise SaliencyError(f"{path}: tag {tag!r} is missing from some layers")
    return Saliency(n_expert, layers, by_tag)
