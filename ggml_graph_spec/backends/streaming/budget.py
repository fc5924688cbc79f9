"""What a memory budget keeps resident: SIZE parsing, the named presets and the pinning plan.

The plan pins a prefix of trunk layers (a deterministic hit rate: the kernel's LRU over a
cyclic layer scan hits nothing) and streams the rest through two rotating slots. A layer's trunk
is all of it but its routed experts: a token uses only a few of those (16 of 896 in K3.1-Pro),
so they are read as selected into an expert cache, which gets the budget the trunks leave (at
least one token's experts of a layer). The resident set is: the tensors outside the layers + the
caches + the compute buffer + two slots + the pinned trunks + the expert cache, and never more
than the budget. Pinning trunks comes first: a pinned trunk byte saves one byte read per token,
a cached expert byte only the chance that a token selects that expert. A model that fits whole
is pinned whole.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

from gguf_arch.errors import KimiError

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}

# The named budgets: the memory of the machines the K3.1-Pro's users have (8 to 512 GB).
PRESETS: dict[str, int] = {
    "laptop": 8 << 30,
    "desktop": 32 << 30,
    "workstation": 64 << 30,
    "server": 128 << 30,
    "max": 512 << 30,
}

# Two slots: the layer being computed and the next one, read while the first computes.
N_SLOTS = 2


class BudgetError(KimiError):
    """A memory budget that cannot be parsed or is too small for the model."""


def parse_size(text: str | int) -> int:
    """Bytes of `512M`, `8G`, `1.5G`, `4096` (binary units) or a preset name."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 1:
            raise BudgetError(f"--mem-budget must be a positive size, got {text}")
        return text
    s = str(text).strip()
    if s.lower() in PRESETS:
        return PRESETS[s.lower()]
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?", s, re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise BudgetError(f"--mem-budget: expected a size such as 512M or 8G or one of "
                          f"{', '.join(PRESETS)}, got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


@dataclass(frozen=True)
class ExpertSizes:
    """The routed experts of the layers: how many each layer stacks, the bytes of one (its gate,
    up and down slices together) and how many a token uses per layer."""

    per_layer: tuple[int, ...]  # 0 for a dense layer
    nbytes: int
    used: int

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(i for i, n in enumerate(self.per_layer) if n)

    @property
    def total(self) -> int:
        return sum(self.per_layer) * self.nbytes


@dataclass(frozen=True)
class BudgetPlan:
    """Which layers stay pinned, which are streamed, and the bytes of each part.

    Without experts the layers are whole; with them, `layer_bytes` were the trunks (everything of
    a layer but its routed experts) and the experts of every MoE layer go through an expert cache
    of `cache_entries` experts (which is also where the experts a token selects are read to).
    """

    budget: int
    fixed: int  # tensors outside the layers + caches + compute buffer
    slot_bytes: int
    pinned: tuple[int, ...]
    streamed: tuple[int, ...]
    pinned_bytes: int
    streamed_bytes: int  # read from the file per token (the streamed layers or trunks)
    expert_bytes: int = 0  # one expert
    cache_entries: int = 0
    expert_layers: tuple[int, ...] = ()  # the layers whose experts are read per token as selected
    experts_used: int = 0  # per token and layer
    n_experts: int = 0  # of all the expert layers

    @property
    def resident(self) -> int:
        return (self.fixed + N_SLOTS * self.slot_bytes * bool(self.streamed) + self.pinned_bytes
                + self.cache_entries * self.expert_bytes)

    @property
    def predicted_bytes_per_token(self) -> float:
        """The streamed trunks plus the experts a decoded token misses, if every expert were as
        likely as any other: the cache beyond one layer's working set then holds a fraction
        (entries - used) / n_experts of them. A skewed router (the real one) hits more."""
        if not self.expert_layers:
            return float(self.streamed_bytes)
        held = min(1.0, (self.cache_entries - self.experts_used) / self.n_experts)
        missed = len(self.expert_layers) * self.experts_used * (1 - held)
        return self.streamed_bytes + missed * self.expert_bytes


def plan_budget(budget: int, fixed: int, layer_bytes: list[int], experts: ExpertSizes | None = None) -> BudgetPlan:
    """Pin the longest prefix of layers (trunks, with `experts`) that fits beside `fixed`, the
    slots and the smallest expert cache (one token's experts of a layer); stream the rest; the
    budget left is the expert cache. A model that fits whole is pinned whole."""
    if experts is not None and not experts.layers:
        experts = None
    whole = fixed + sum(layer_bytes) + (experts.total if experts else 0)
    if experts is not None and whole <= budget:
        return BudgetPlan(budget, fixed, 0, tuple(range(len(layer_bytes))), (), whole - fixed, 0)
    floor = experts.used * experts.nbytes if experts else 0
    pinned, used = _prefix(budget - floor, fixed, layer_bytes)
    streamed = tuple(range(pinned, len(layer_bytes)))
    slot = max((layer_bytes[i] for i in streamed), default=0)
    need = fixed + N_SLOTS * slot * bool(streamed) + used + floor
    if need > budget:
        smallest = fixed + N_SLOTS * max(layer_bytes, default=0) + floor
        raise BudgetError(f"--mem-budget {budget} bytes is too small for this model: it needs at least "
                          f"{smallest} bytes (outside-layer tensors, caches and compute buffer {fixed}, "
                          f"plus {N_SLOTS} layer slots of {max(layer_bytes, default=0)}"
                          + (f", plus one token's {experts.used} experts of {experts.nbytes})" if experts else ")"))
    plan = BudgetPlan(budget, fixed, slot, tuple(range(pinned)), streamed, used,
                      sum(layer_bytes[i] for i in streamed))
    if experts is None:
        return plan
    entries = min((budget - need) // experts.nbytes + experts.used, sum(experts.per_layer))
    return replace(plan, expert_bytes=experts.nbytes, cache_entries=entries, expert_layers=experts.layers,
                   experts_used=experts.used, n_experts=sum(experts.per_layer))


def _prefix(budget: int, fixed: int, layer_bytes: list[int]) -> tuple[int, int]:
    """How many leading layers fit beside the slots the rest needs, and their bytes."""
    pinned, used = 0, 0
    for i, n in enumerate(layer_bytes):
        rest = layer_bytes[i + 1:]
        slots = N_SLOTS * max(rest) if rest else 0
        if fixed + used + n + slots > budget:
            break
        pinned, used = i + 1, used + n
    return pinned, used
