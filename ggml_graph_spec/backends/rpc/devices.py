"""A model spread over ggml RPC servers and the local CPU: connect, place, upload, run.

    devices = Devices.connect(weights, ["10.0.0.2:50052", "10.0.0.3:50052"], n_threads=8)
    exe = devices.executor(n_nodes)       # a SchedExecutor over [servers..., CPU]
    devices.layer_backends(exe.backend)   # layer -> backend, for the caches

The servers are checked with ggml's own handshake first (rpc.handshake), then given to ggml's
RPC backend through a relay each (relay.py: every reply checked, every wait bounded). Layers are
placed by `placement.Placement` (the memory each device reports, or --tensor-split); each
server's layers get their weights in one buffer on that server, uploaded once here from the
memory-mapped file in UPLOAD_CHUNK_BYTES pieces. A piece above ggml's 10 MiB hash threshold is
offered by content hash first, so a server started with --cache that already holds it (a
client reconnecting with the same GGUF) is not sent it again. Layers on the CPU keep their
weights in the mapped file.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any, Sequence

import ggml
from tqdm import tqdm

from gguf_arch.arch.tensors import TOKEN_EMBD, plan_tensors
from gguf_arch.errors.signals import native_call
from gguf_arch.io.console import human_size, task_bar

from ...graph.cache import SequenceCache
from ...weights.loader import GGUFWeights
from ...graph.placement import INPUT_SEGMENT, Placement, layer_ranges, parse_tensor_split
from .relay import DEFAULT_TIMEOUT_S
from .wire import (Connection, Endpoint, EndpointError, RpcError, SizedHere, check_alive, guard, handshake,
                   parse_endpoints, unguard)
from ..sched import SchedExecutor

UPLOAD_CHUNK_BYTES = 64 << 20


@dataclass
class _Remote:
    """One server that holds layers: its backend, connection and weight buffer."""

    endpoint: Endpoint
    connection: Connection
    backend: Any
    ctx: Any = None
    buffer: Any = None
    names: list[str] = field(default_factory=list)
    nbytes: int = 0


def _reach(endpoints: Sequence[Endpoint], timeout: float) -> list[Connection]:
    """Handshake with every server; their connections (relays), guarded from here on (ggml's own
    connect aborts on failure)."""
    connections = [Connection(ep, handshake(ep, timeout), timeout) for ep in endpoints]
    seen: dict[tuple[str, int], Endpoint] = {}
    for c in connections:
        where = (c.address, c.endpoint.port)
        if where in seen:
            for other in connections:
                other.close()
            # A server serves one connection at a time: ggml's second one would wait forever.
            raise EndpointError(f"--rpc {c.endpoint} and {seen[where]} are the same server ({c.address}:{where[1]})")
        seen[where] = c.endpoint
    for c in connections:
        guard(c)
    return connections


def _cpu_memory() -> int:
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    ggml.ggml_backend_dev_memory(ggml.ggml_backend_dev_by_type(ggml.GGML_BACKEND_DEVICE_TYPE_CPU),
                                 ctypes.byref(free), ctypes.byref(total))
    return free.value


def _server_memory(address: bytes) -> int:
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    with native_call(may_stall=True):
        ggml.ggml_backend_rpc_get_device_memory(address, 0, ctypes.byref(free), ctypes.byref(total))
    return free.value


def _backend(c: Connection):
    """ggml's RPC backend for the server, and its buffer type's alignment and largest buffer as
    ggml cached them, checked through ggml's own getters before anything is allocated (the relay
    checked the replies they came from; this is where ggml-alloc reads them)."""
    with native_call(may_stall=True):
        backend = ggml.ggml_backend_rpc_init(c.ggml_endpoint, 0)
        buft = ggml.ggml_backend_get_default_buffer_type(backend)
    align, largest = ggml.ggml_backend_buft_get_alignment(buft), ggml.ggml_backend_buft_get_max_size(buft)
    if not align or align & (align - 1) or largest < align:
        raise RpcError(f"RPC server {c.endpoint}: its buffers have an alignment of {align} and at most {largest} "
                       "bytes (a power of two, and buffers at least that large, expected)")
    return backend


class Devices:
    """The servers with layers (in --rpc order) and the local CPU, and where each layer runs."""

    def __init__(self, weights: GGUFWeights, placement: Placement, remotes: dict[int, _Remote], n_threads: int):
        self.weights = weights
        self.placement = placement
        self._remotes = remotes  # device index -> server holding layers
        self._n_threads = n_threads
        self._mapped: dict[str, Any] = {}  # the file-mapped tensors the uploads replaced
        self._compute_types: list[SizedHere] = []  # the scheduler's buffer types: live as long as it

    @classmethod
    def connect(cls, weights: GGUFWeights, rpc: str | Sequence[str], *,
                tensor_split: str | Sequence[float] | None = None, n_threads: int, progress: bool = False,
                timeout: float = DEFAULT_TIMEOUT_S) -> "Devices":
        """Handshake with every server, place the layers, upload the servers' weights. `timeout`:
        the longest wait for any one reply of a server (--rpc-timeout)."""
        if not ggml.GGML_USE_RPC:
            raise RuntimeError("this ggml-python was built without RPC (rebuild it with CMAKE_ARGS=-DGGML_RPC=ON)")
        endpoints = parse_endpoints(rpc)
        names = [f"RPC{i}[{ep}]" for i, ep in enumerate(endpoints)] + ["CPU"]
        shares = None if tensor_split is None else parse_tensor_split(
            tensor_split if isinstance(tensor_split, str) else ",".join(map(str, tensor_split)), len(names))
        connections = _reach(endpoints, timeout)
        try:
            if shares is None:
                shares = (*(_server_memory(c.ggml_endpoint) for c in connections), _cpu_memory())
            placement = Placement.plan(names, weights.cfg.num_layers, shares)
            remotes = {d: _Remote(endpoints[d], connections[d], _backend(connections[d]))
                       for d in placement.used() if d != placement.cpu}
        except BaseException:
            for c in connections:
                unguard(c)
                c.close()
            raise
        for d, c in enumerate(connections):
            if d not in remotes:
                unguard(c)  # no layers there: ggml never connects to it again
                c.close()
        devices = cls(weights, placement, remotes, n_threads)
        try:
            devices._upload(progress)
        except BaseException:
            devices.close()
            raise
        return devices

    # ---- weights -------------------------------------------------------------------------------
    def _device_of_tensor(self, name: str, layer: int | None) -> int:
        if layer is not None:
            return self.placement.layer_device[layer]
        # The embedding is what the input segment reads (build_forward's get_rows); every other
        # global tensor belongs to the output head.
        return self.placement.device_of(INPUT_SEGMENT) if name == TOKEN_EMBD else self.placement.output_device

    def _upload(self, progress: bool) -> None:
        for p in plan_tensors(self.weights.cfg):
            r = self._remotes.get(self._device_of_tensor(p.name, p.layer))
            if r is not None and p.name in self.weights.tensors:
                r.names.append(p.name)
        total = sum(ggml.ggml_nbytes(self.weights.tensors[n]) for r in self._remotes.values() for n in r.names)
        with task_bar("upload to the RPC servers", total, enabled=progress, in_bytes=True) as bar, native_call(may_stall=True):
            for r in self._remotes.values():
                self._allocate_remote(r)
                for name in r.names:
                    self._send(self._mapped[name], self.weights.tensors[name], bar)

    def _allocate_remote(self, r: _Remote) -> None:
        """A context of copies of the server's tensors, allocated in one buffer there."""
        r.ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=ggml.ggml_tensor_overhead() * (len(r.names) + 1),
                                                     mem_buffer=None, no_alloc=True))
        for name in r.names:
            src = self.weights.tensors[name]
            dst = ggml.ggml_dup_tensor(r.ctx, src)
            ggml.ggml_set_name(dst, name.encode())
            self._mapped[name], self.weights.tensors[name] = src, dst
        r.buffer = ggml.ggml_backend_alloc_ctx_tensors(r.ctx, r.backend)
        if not r.buffer:
            raise MemoryError(f"RPC server {r.endpoint}: cannot allocate {human_size(self._bytes(r.names))} "
                              "for its layers' weights")
        ggml.ggml_backend_buffer_set_usage(r.buffer, ggml.GGML_BACKEND_BUFFER_USAGE_WEIGHTS)
        r.nbytes = self._bytes(r.names)
        # The buffer holds ggml's connection from here on: watch its socket.
        r.connection.attach()

    def _bytes(self, names: Sequence[str]) -> int:
        return sum(ggml.ggml_nbytes(self.weights.tensors[n]) for n in names)

    @staticmethod
    def _send(src, dst, bar: tqdm) -> None:
        n, base = ggml.ggml_nbytes(src), src.contents.data
        for offset in range(0, n, UPLOAD_CHUNK_BYTES):
            size = min(UPLOAD_CHUNK_BYTES, n - offset)
            ggml.ggml_backend_tensor_set(dst, ctypes.c_void_p(base + offset), offset, size)
            bar.update(size)

    # ---- running -------------------------------------------------------------------------------
    @property
    def connections(self) -> list[Connection]:
        return [r.connection for r in self._remotes.values()]

    def check(self, when: str) -> None:
        """RpcError if a server's connection is gone (before any ggml call that would abort)."""
        check_alive(self.connections, when)

    def alive(self) -> bool:
        """Every server that holds a buffer still connected (a failed load may leave servers
        without one: nothing of theirs to free)."""
        return all(r.connection.alive() for r in self._remotes.values() if r.buffer)

    def layer_backends(self, cpu_backend) -> dict[int, Any]:
        return {l: self._remotes[d].backend if d in self._remotes else cpu_backend
                for l, d in enumerate(self.placement.layer_device)}

    def executor(self, n_nodes: int) -> SchedExecutor:
        backends = [r.backend for r in self._remotes.values()]
        index = {d: i for i, d in enumerate(self._remotes)}  # placement device -> scheduler backend
        cpu = ggml.ggml_backend_cpu_init()
        ggml.ggml_backend_cpu_set_n_threads(cpu, self._n_threads)
        self._compute_types = [SizedHere(ggml.ggml_backend_get_default_buffer_type(b)) for b in backends]
        buffer_types = [t.address for t in self._compute_types] + [ggml.ggml_backend_get_default_buffer_type(cpu)]
        return SchedExecutor([*backends, cpu], n_nodes,
                             lambda segment: index.get(self.placement.device_of(segment), len(backends)),
                             lambda: self.check("before a graph"), buffer_types)

    def traffic(self) -> dict[str, tuple[int, int]]:
        """Per server: (bytes sent, bytes received) on ggml's connection since it opened."""
        return {str(r.endpoint): r.connection.traffic() for r in self._remotes.values()}

    # ---- report, teardown ----------------------------------------------------------------------
    def summary(self, cache: SequenceCache, executor: SchedExecutor) -> list[tuple[str, str]]:
        """(key, value) rows: per device where it is, its layers, and the bytes it holds."""
        p = self.placement
        backends = {d: r.backend for d, r in self._remotes.items()} | {p.cpu: executor.backend}
        remote = {n for r in self._remotes.values() for n in r.names}
        weights = {d: r.nbytes for d, r in self._remotes.items()}
        weights[p.cpu] = sum(ggml.ggml_nbytes(t) for n, t in self.weights.tensors.items() if n not in remote)
        rows = []
        for d, name in enumerate(p.names):
            layers = p.layers_on(d)
            parts = ["this host"] if d == p.cpu else []
            parts.append(f"layers {layer_ranges(layers)}" if layers else "no layers")
            parts += (["embedding"] if d == p.cpu else []) + (["output"] if d == p.output_device else [])
            if d in backends:
                b = backends[d]
                parts.append(f"{human_size(weights[d])} weights, {human_size(cache.nbytes(b))} caches, "
                             f"{human_size(executor.buffer_size(b))} compute")
            else:
                parts.append("not used")
            rows.append((f"device {d}", f"{name}: {'; '.join(parts)}"))
        return rows

    def close(self) -> None:
        """Free the servers' weight buffers and backends (when every server is still there:
        ggml aborts on a command to a lost one, so the buffers of a lost server are left)."""
        if not self.alive():
            return
        for r in self._remotes.values():
            if r.buffer:
                ggml.ggml_backend_buffer_free(r.buffer)  # the last buffer on a server closes the connection
                r.buffer = None
            if r.ctx is not None:
                ggml.ggml_free(r.ctx)
                r.ctx = None
            ggml.ggml_backend_free(r.backend)
            unguard(r.connection)
            r.connection.close()
        self.weights.tensors.update(self._mapped)
        self._mapped = {}
        self._remotes = {}
