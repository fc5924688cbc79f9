"""Which layer runs where when a model is split over ggml RPC servers and the local CPU.

Devices are numbered as ggml's scheduler sees them: the servers in the order `--rpc` names them,
then this host's CPU (the scheduler wants the CPU last, and llama.cpp also puts its RPC devices
before the local ones). Layers go to the devices in that order in contiguous runs, sized by one
proportion per device (`--tensor-split`, or each device's free memory) with llama.cpp's rule:
layer l goes to the first device whose cumulative share exceeds l / n_layers. The token
embedding stays on the CPU (a row lookup of the input ids); the output head (final AttnRes mix,
norm, lm_head) goes with the last layer, so that only logits leave its device.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Hashable, Sequence

from gguf_arch.errors import KimiError

INPUT_SEGMENT = "input"  # graph segment of the token embedding (GraphBuild's first segment)
OUTPUT_SEGMENT = "output"  # graph segment of the output head


class PlacementError(KimiError):
    """--tensor-split is malformed or leaves nothing to run the layers on (exit code 2)."""


def parse_tensor_split(text: str, n_devices: int) -> tuple[float, ...]:
    """`3,1` -> one proportion per device (servers in --rpc order, then the local CPU); missing
    trailing values are 0, as in llama.cpp."""
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise PlacementError(f"--tensor-split {text!r}: expected comma-separated numbers such as 3,1") from None
    if len(values) > n_devices:
        raise PlacementError(f"--tensor-split {text!r}: {len(values)} values for {n_devices} devices "
                             f"({n_devices - 1} RPC server(s), then this host)")
    if any(not v >= 0 or v == float("inf") for v in values) or sum(values) == 0:
        raise PlacementError(f"--tensor-split {text!r}: proportions must be finite, >= 0 and not all 0")
    return tuple(values) + (0.0,) * (n_devices - len(values))


def split_layers(n_layers: int, proportions: Sequence[float]) -> tuple[int, ...]:
    """The device of each layer: contiguous runs in device order, sized by the proportions."""
    shares = [Fraction(p) for p in proportions]
    total = sum(shares)
    if total <= 0 or any(s < 0 for s in shares):
        raise PlacementError(f"proportions {list(proportions)} must be >= 0 and not all 0")
    cumulative, acc = [], Fraction(0)
    for s in shares:
        acc += s
        cumulative.append(acc / total)
    # Exact fractions: l / n_layers < cumulative[-1] = 1 always finds a device.
    return tuple(next(d for d, c in enumerate(cumulative) if c > Fraction(l, n_layers)) for l in range(n_layers))


def layer_ranges(layers: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    runs: list[list[int]] = []
    for l in layers:
        if runs and runs[-1][1] == l - 1:
            runs[-1][1] = l
        else:
            runs.append([l, l])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


@dataclass(frozen=True)
class Placement:
    """Device names (CPU last) and the device of every layer."""

    names: tuple[str, ...]
    layer_device: tuple[int, ...]

    @classmethod
    def plan(cls, names: Sequence[str], n_layers: int, proportions: Sequence[float]) -> "Placement":
        if len(proportions) != len(names):
            raise PlacementError(f"{len(proportions)} proportions for {len(names)} devices")
        return cls(tuple(names), split_layers(n_layers, proportions))

    @property
    def cpu(self) -> int:
        return len(self.names) - 1

    @property
    def output_device(self) -> int:
        return self.layer_device[-1]

    def device_of(self, segment: Hashable) -> int:
        """The device of a graph segment: a layer index, INPUT_SEGMENT or OUTPUT_SEGMENT."""
        if segment == INPUT_SEGMENT:
            return self.cpu
        if segment == OUTPUT_SEGMENT:
            return self.output_device
        return self.layer_device[segment]

    def layers_on(self, device: int) -> list[int]:
        return [l for l, d in enumerate(self.layer_device) if d == device]

    def used(self) -> list[int]:
        """Devices that hold at least one layer (the CPU always takes part: embedding, inputs)."""
        return sorted(set(self.layer_device) | {self.cpu})
