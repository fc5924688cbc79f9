"""What a memory budget keeps resident: SIZE parsing, the named presets and the pinning plan.

The plan pins a prefix of whole trunk layers (a deterministic hit rate: the kernel's LRU over a
cyclic layer scan hits nothing) and streams the rest through two rotating slots, so the
resident set is: the tensors outside the layers + the caches + the compute buffer + two slots
+ the pinned layers, and never more than the budget.
"""
from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

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


def add_budget_argument(p: argparse.ArgumentParser) -> None:
    """The runner's --mem-budget option (parsed by Model.load: parse_size)."""
    p.add_argument("--mem-budget", metavar="SIZE", default=None,
                   help=f"keep at most SIZE resident (512M, 8G, or {', '.join(PRESETS)}); layers that do not "
                        "fit are read from the file per token")


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
class BudgetPlan:
    """Which layers stay pinned, which are streamed, and the bytes of each part."""

    budget: int
    fixed: int  # tensors outside the layers + caches + compute buffer
    slot_bytes: int
    pinned: tuple[int, ...]
    streamed: tuple[int, ...]
    pinned_bytes: int
    streamed_bytes: int  # read from the file per token

    @property
    def resident(self) -> int:
        return self.fixed + N_SLOTS * self.slot_bytes * bool(self.streamed) + self.pinned_bytes


def plan_budget(budget: int, fixed: int, layer_bytes: list[int]) -> BudgetPlan:
    """Pin the longest prefix of layers that fits beside `fixed` and the slots; stream the rest."""
    pinned, used = 0, 0
    for i, n in enumerate(layer_bytes):
        rest = layer_bytes[i + 1:]
        slots = N_SLOTS * max(rest, default=0) if rest else 0
        if fixed + used + n + slots > budget:
            break
        pinned, used = i + 1, used + n
    streamed = tuple(range(pinned, len(layer_bytes)))
    slot = max((layer_bytes[i] for i in streamed), default=0)
    need = fixed + N_SLOTS * slot * bool(streamed) + used
    if need > budget:
        smallest = fixed + N_SLOTS * max(layer_bytes, default=0)
        raise BudgetError(f"--mem-budget {budget} bytes is too small for this model: it needs at least "
                          f"{smallest} bytes (outside-layer tensors, caches and compute buffer {fixed}, "
                          f"plus {N_SLOTS} layer slots of {max(layer_bytes, default=0)})")
    return BudgetPlan(budget, fixed, slot, tuple(range(pinned)), streamed, used,
                      sum(layer_bytes[i] for i in streamed))
