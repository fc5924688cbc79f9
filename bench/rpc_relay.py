"""What the RPC relay costs (ggml_graph_spec/backends/rpc/relay.py): every byte between ggml's
client and a server passes through Python in the client's process, each reply checked.

    python bench/rpc_relay.py --workdir /tmp/kimi-relay-bench

Against one loopback kimi-k3-rpc-server, the same work straight to the server (ggml given the
server's address, as before the relay) and through the relay, measured in the same run,
alternating, best of --repeats:

  round trip  one GET_TENSOR of a decoded token's hidden state as it crosses between hosts (the
              real K3's 7168 floats, 28 KiB): microseconds per call;
  bandwidth   64 MiB tensor uploads and reads (a weight upload's pieces): GB/s each way;
  decode      a synthetic K3.1-Pro GGUF (MEDIUM's sizes, as bench/rpc.py; or --gguf) with every
              layer on the server: decoded tokens per second, and the relay's cost per token (ms
              and %).

The server and the client share this machine, so the network costs nothing and the relay's
share is as large as it can be: over a real link the same microseconds sit beside the link's.
Results: bench/results/rpc_relay.json.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import sys
import time
from pathlib import Path

import ggml
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ggml_graph_spec.backends.rpc import devices as rpc_devices  # noqa: E402
from ggml_graph_spec.backends.rpc.wire import Connection, Endpoint  # noqa: E402
from ggml_graph_spec.engine.model import Model  # noqa: E402
from tests.support.rpc_servers import RpcServers  # noqa: E402
from bench.rpc import prepare  # noqa: E402

RESULTS = REPO / "bench" / "results"
HIDDEN_BYTES = 7168 * 4  # one token's hidden state of the real K3, F32
BIG = 64 << 20


class _Direct(Connection):
    """The connection as it was before the relay: ggml given the server's own address."""

    @property
    def ggml_endpoint(self) -> bytes:
        return f"{self.address}:{self.endpoint.port}".encode()

    def attach(self) -> None:
        pass

    def alive(self) -> bool:
        return True


def _tensor(ctx, nbytes: int):
    return ggml.ggml_new_tensor_1d(ctx, ggml.GGML_TYPE_I8, nbytes)


def _io_times(endpoint: bytes, calls: int) -> dict:
    """Seconds per small GET_TENSOR, and GB/s of 64 MiB sets and gets, on one buffer."""
    backend = ggml.ggml_backend_rpc_init(endpoint, 0)
    ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=ggml.ggml_tensor_overhead() * 4, mem_buffer=None,
                                               no_alloc=True))
    small, big = _tensor(ctx, HIDDEN_BYTES), _tensor(ctx, BIG)
    buffer = ggml.ggml_backend_alloc_ctx_tensors(ctx, backend)
    host = np.zeros(BIG, np.uint8)
    ptr = ctypes.c_void_p(host.ctypes.data)
    try:
        t = time.perf_counter()
        for _ in range(calls):
            ggml.ggml_backend_tensor_get(small, ptr, 0, HIDDEN_BYTES)
        round_trip = (time.perf_counter() - t) / calls
        t = time.perf_counter()
        for _ in range(4):
            ggml.ggml_backend_tensor_set(big, ptr, 0, BIG)
        up = 4 * BIG / (time.perf_counter() - t)
        t = time.perf_counter()
        for _ in range(4):
            ggml.ggml_backend_tensor_get(big, ptr, 0, BIG)
        down = 4 * BIG / (time.perf_counter() - t)
    finally:
        ggml.ggml_backend_buffer_free(buffer)
        ggml.ggml_free(ctx)
        ggml.ggml_backend_free(backend)
    return {"round_trip_us": round_trip * 1e6, "set_gb_s": up / 1e9, "get_gb_s": down / 1e9}


def _decode(gguf: Path, endpoint: str, tokens: int) -> float:
    """Decoded tokens per second with every layer on the server."""
    m = Model.load(gguf, n_ctx=tokens + 16, n_threads=1, rpc=[endpoint], tensor_split="1,0")
    try:
        m.eval([1, 2, 3, 4])
        t = time.perf_counter()
        for tok in range(tokens):
            m.eval([5 + tok % 100])
        return tokens / (time.perf_counter() - t)
    finally:
        m.close()


def measure(gguf: Path, a: argparse.Namespace) -> tuple[dict, dict]:
    """(best of the repeats, every repeat) per mode."""
    best: dict[str, dict] = {"direct": {}, "relay": {}}
    every: dict[str, list] = {"direct": [], "relay": []}
    with RpcServers(1, threads=a.threads) as one:
        ep = Endpoint("127.0.0.1", one.ports[0])
        for _ in range(a.repeats):
            for mode in ("direct", "relay"):
                conn = (_Direct if mode == "direct" else Connection)(ep, "127.0.0.1")
                io = _io_times(conn.ggml_endpoint, a.calls)
                conn.close()
                rpc_devices.Connection = _Direct if mode == "direct" else Connection
                try:
                    io["decode_tok_s"] = _decode(gguf, one.endpoints[0], a.tokens)
                finally:
                    rpc_devices.Connection = Connection
                every[mode].append(io)
                b = best[mode]
                for k, v in io.items():
                    better = min if k == "round_trip_us" else max
                    b[k] = better(b.get(k, v), v)
    return best, every


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--gguf", type=Path, default=None,
                    help="decode this GGUF instead of the synthetic MEDIUM one (e.g. a converted test fixture)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--calls", type=int, default=2000, help="small round trips per measurement")
    ap.add_argument("--tokens", type=int, default=64, help="decoded tokens per measurement")
    ap.add_argument("--threads", type=int, default=2, help="the server's threads")
    ap.add_argument("--json", type=Path, default=RESULTS / "rpc_relay.json")
    a = ap.parse_args()
    a.workdir.mkdir(parents=True, exist_ok=True)
    gguf = a.gguf or prepare(a.workdir)
    best, every = measure(gguf, a)
    d, r = best["direct"], best["relay"]
    per_token_ms = (1 / r["decode_tok_s"] - 1 / d["decode_tok_s"]) * 1e3
    result = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "loadavg": os.getloadavg()},
              "date": time.strftime("%Y-%m-%d"), "gguf": gguf.name, "gguf_bytes": gguf.stat().st_size,
              "repeats": a.repeats, "tokens": a.tokens, "direct": d, "relay": r,
              "relay_round_trip_extra_us": r["round_trip_us"] - d["round_trip_us"],
              "relay_cost_per_token_ms": per_token_ms,
              "relay_cost_per_token_percent": 100 * per_token_ms * d["decode_tok_s"] / 1e3, "every_repeat": every}
    a.json.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
