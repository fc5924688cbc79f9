"""What runs a model's graphs, chosen in one place.

Three executors share one interface (cpu.Executor: `graph`, `plan`, `compute`, `read`, `free`,
and the hooks a graph reads: `segments`, `bind_experts`, `predict_experts`, `wants_plan`):

* "cpu": ggml's CPU backend over the memory-mapped weights (cpu.py), the default;
* "rpc": ggml's backend scheduler over RPC servers and this host (rpc/devices.py, sched.py);
* "mem-budget": the CPU backend with the layers that do not fit read from the file per token
  (streaming/executor.py).

A new ggml device (CUDA, Metal, Vulkan) is one more entry here and one module beside these: an
Executor whose backend is that device's (`ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_GPU)`,
then `ggml_backend_dev_init`) with the weights uploaded to its buffers the way rpc/devices.py
uploads a server's layers (the mapped file is host memory), built by setting ggml's flag in
scripts/setup_env.sh (`CMAKE_ARGS="... -DGGML_CUDA=ON"`); docs/architecture.md says where.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from ..weights.loader import GGUFWeights
from .cpu import Executor
from .rpc.devices import Devices
from .rpc.relay import DEFAULT_TIMEOUT_S
from .streaming.budget import parse_size
from .streaming.executor import StreamingExecutor


@dataclass(frozen=True)
class BackendRequest:
    """What the engine asks of a backend (from its LoadOptions)."""

    n_threads: int
    n_nodes: int  # the graphs' node budget (the scheduler sizes its hash set by it)
    exact: bool
    rpc: Sequence[str] | str = ()
    tensor_split: Sequence[float] | str | None = None
    mem_budget: int | str | None = None
    progress: bool = False
    rpc_timeout: float = DEFAULT_TIMEOUT_S  # the longest wait for one reply of a server


@dataclass
class Backend:
    """An executor and, over RPC, the devices holding the layers."""

    name: str
    executor: Executor
    devices: Devices | None = None

    def close(self) -> None:
        self.executor.free()
        if self.devices is not None:
            self.devices.close()


def _cpu(weights: GGUFWeights, req: BackendRequest) -> Backend:
    return Backend("cpu", Executor(req.n_threads))


def _rpc(weights: GGUFWeights, req: BackendRequest) -> Backend:
    devices = Devices.connect(weights, req.rpc, tensor_split=req.tensor_split, n_threads=req.n_threads,
                              progress=req.progress, timeout=req.rpc_timeout)
    try:
        return Backend("rpc", devices.executor(req.n_nodes), devices)
    except BaseException:
        devices.close()
        raise


def _mem_budget(weights: GGUFWeights, req: BackendRequest) -> Backend:
    return Backend("mem-budget", StreamingExecutor(weights, parse_size(req.mem_budget), req.n_threads,
                                                   exact=req.exact))


BACKENDS: dict[str, Callable[[GGUFWeights, BackendRequest], Backend]] = {
    "cpu": _cpu, "rpc": _rpc, "mem-budget": _mem_budget}


def backend_name(req: BackendRequest) -> str:
    """The backend a request asks for: RPC servers, else a memory budget, else the CPU."""
    if req.rpc:
        return "rpc"
    return "mem-budget" if req.mem_budget is not None else "cpu"


def open_backend(weights: GGUFWeights, req: BackendRequest) -> Backend:
    return BACKENDS[backend_name(req)](weights, req)
