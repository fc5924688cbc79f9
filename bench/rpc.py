"""Across machines: one client against 2 and 3 loopback kimi-k3-rpc-server processes on the same
GGUF, against the local run; and a projection for the real K3.1-Pro over N hosts.

    python bench/rpc.py --workdir /tmp/kimi-rpc-bench

The GGUF is a synthetic K3.1-Pro (`kimi-k3-synth` with MEDIUM's sizes: hidden 2048, 12 layers,
16 MXFP4 experts, about 1.2 GB) converted by this project's converter. Every server and the
client run on this machine, so the timings show the protocol's cost, not a network's.

  measured  for the local run and for 2 and 3 servers holding every layer (--tensor-split
            1,1,0 / 1,1,1,0: this host keeps the embedding and runs the graphs): load time
            (Model.load: handshake, placement, upload of the servers' weights), prompt tok/s
            (one batch of --prompt tokens from an empty cache) and decode tok/s (--gen tokens
            one at a time after it), best of --repeats; the bytes on ggml's connections from
            the client's socket counters (TCP_INFO bytes_acked / bytes_received of each
            connection): at load, per prompt token, per decoded token. A second pass through
            counting proxies (tests/support/rpc_servers.Proxy) splits the decode traffic by
            command: graph messages and tensor copies (and any other command, should one appear).
  predicted the same per-token traffic from the decode graph alone (`traffic_per_token`: which
            tensors cross between devices, how large each device's graph message is), checked
            here against the measurement.
  projected the real K3.1-Pro (tests/fixtures/reference's config, with the K3.1-Pro indexer
            fields of docs/reference/config.md) over N hosts of equal memory (N-1 servers and the
            client's host): layers per host by llama.cpp's rule, weights per host, bytes crossing
            each boundary per decoded token, per-host graph messages, and the per-token network
            time at 1, 10 and 100 Gb/s (bytes over bandwidth; each server adds its round trips,
            counted, times the link's latency). Built from the real model's decode graph with
            shapes only (nothing allocated).

Results: bench/results/rpc.json.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import ggml
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gguf_arch.arch.config import parse_config  # noqa: E402
from gguf_arch.arch.tensors import OUT_F32, OUT_MXFP4, TOKEN_EMBD, plan_tensors  # noqa: E402
from ggml_graph_spec.graph.cache import CONV_INPUTS, SequenceCache  # noqa: E402
from ggml_graph_spec.graph.build import I32, GraphBuild  # noqa: E402
from ggml_graph_spec.weights.loader import GGUFWeights  # noqa: E402
from ggml_graph_spec.blocks.forward import build_forward, graph_size  # noqa: E402
from ggml_graph_spec.engine.model import Model  # noqa: E402
from ggml_graph_spec.graph.placement import INPUT_SEGMENT, OUTPUT_SEGMENT, Placement  # noqa: E402
from ggml_graph_spec.backends.sched import _VIEW_OPS  # noqa: E402
from tests.support.rpc_servers import Proxy, RpcServers  # noqa: E402

RESULTS = REPO / "bench" / "results"
MEDIUM = ["--preset", "tiny", "--hidden", "2048", "--layers", "12", "--intermediate", "5632", "--experts", "16",
          "--experts-per-token", "4", "--moe-intermediate", "1024", "--latent", "1024", "--mla-heads", "16",
          "--q-lora", "512", "--kv-lora", "256", "--qk-nope", "64", "--qk-rope", "32", "--v-head-dim", "64",
          "--kda-heads", "16", "--kda-head-dim", "128", "--index-heads", "8", "--index-head-dim", "64"]
# K3.1-Pro's indexer (docs/reference/config.md, K3.1-Pro indexer fields), added to the real K3 config.
K31PRO_INDEXER = {"index_n_heads": 32, "index_head_dim": 128, "index_topk": 2048}
RPC_TENSOR = 296  # sizeof(rpc_tensor) in ggml 0.15.3 (ggml-rpc.cpp, packed)
HEADER = 9  # command byte + u64 size
REPLY_HEADER = 8
GET_TENSOR_REQUEST = RPC_TENSOR + 16
LINKS_GBIT = (1, 10, 100)
HOSTS = (2, 3, 4, 8)
CONTEXTS = (4096, 131072)


# ---- GGUF -------------------------------------------------------------------------------------

def prepare(workdir: Path) -> Path:
    ckpt, gguf = workdir / "medium", workdir / "medium.gguf"
    if not (ckpt / "config.json").exists():
        subprocess.run([sys.executable, "-m", "gguf_arch.synth.cli", str(ckpt), *MEDIUM, "--overwrite"], check=True,
                       cwd=REPO)
    if not gguf.exists():
        subprocess.run([sys.executable, str(REPO / "convert_kimi_k3.py"), str(ckpt), str(gguf), "--quiet"],
                       check=True)
    return gguf


# ---- measured ---------------------------------------------------------------------------------

def _traffic(m: Model) -> tuple[int, int]:
    if m.devices is None:
        return 0, 0
    t = m.devices.traffic().values()
    return sum(s for s, _ in t), sum(r for _, r in t)


def _delta(after: tuple[int, int], before: tuple[int, int], n: int) -> dict:
    return {"sent": (after[0] - before[0]) / n, "received": (after[1] - before[1]) / n}


def run_config(gguf: Path, rpc: list[str], split: str | None, a: argparse.Namespace) -> dict:
    """Load, then prompt and decode --repeats times; timings are the best run, bytes the last."""
    rng = np.random.default_rng(0)
    t = time.perf_counter()
    m = Model.load(gguf, n_ctx=a.prompt + a.gen + 1, n_threads=a.threads, rpc=rpc, tensor_split=split)
    load_s = time.perf_counter() - t
    try:
        loaded = _traffic(m)
        prompt_s, decode_s = [], []
        for _ in range(a.repeats):
            m.reset()
            ids = rng.integers(0, m.cfg.vocab_size, a.prompt).tolist()
            before = _traffic(m)
            t = time.perf_counter()
            m.eval(ids)
            prompt_s.append(time.perf_counter() - t)
            after_prompt = _traffic(m)
            t = time.perf_counter()
            for tok in rng.integers(0, m.cfg.vocab_size, a.gen).tolist():
                m.eval([tok])
            decode_s.append(time.perf_counter() - t)
            after_decode = _traffic(m)
        return {"servers": len(rpc), "tensor_split": split, "load_s": round(load_s, 3),
                "placement": m.devices.summary(m.cache, m.executor) if m.devices else None,
                "prompt_tok_s": round(a.prompt / min(prompt_s), 2), "decode_tok_s": round(a.gen / min(decode_s), 2),
                "bytes_at_load": {"sent": loaded[0], "received": loaded[1]},
                "bytes_per_prompt_token": _delta(after_prompt, before, a.prompt),
                "bytes_per_decode_token": _delta(after_decode, after_prompt, a.gen)}
    finally:
        m.close()


def decode_breakdown(gguf: Path, servers: RpcServers, split: str, a: argparse.Namespace) -> dict:
    """Per decoded token and server: bytes and calls by command, through counting proxies."""
    proxies = [Proxy(p) for p in servers.ports]
    try:
        m = Model.load(gguf, n_ctx=a.prompt + a.gen + 1, n_threads=a.threads, rpc=[p.endpoint for p in proxies],
                       tensor_split=split)
        try:
            m.eval(list(range(1, a.prompt + 1)))
            before = [p.snapshot() for p in proxies]
            for tok in range(a.gen):
                m.eval([tok + 1])
            after = [p.snapshot() for p in proxies]
            predicted = traffic_per_token(m.weights, m.devices.placement, m.cache, n_past=a.prompt + a.gen - 1)
        finally:
            m.close()
    finally:
        for p in proxies:
            p.close()
    return {"measured": [_per_token(b, e, a.gen) for b, e in zip(before, after)], "graph": predicted}


def _per_token(before, after, n: int) -> dict:
    sent = Counter(after[0])
    sent.subtract(before[0])
    calls = Counter(after[1])
    calls.subtract(before[1])
    return {"sent_by_command": {k: v / n for k, v in sent.items() if v},
            "calls_by_command": {k: v / n for k, v in calls.items() if v},
            "received": (after[2] - before[2]) / n}


# ---- predicted from the graph -----------------------------------------------------------------

class _Graph:
    """One decode graph as the scheduler places it: each node's device, with the sources it reads."""

    def __init__(self, g: GraphBuild, placement: Placement, device_of_leaf):
        self.nodes = [ggml.ggml_graph_node(g.gf, i) for i in range(ggml.ggml_graph_n_nodes(g.gf))]
        self._g, self._p, self._leaf = g, placement, device_of_leaf
        self._dev: dict[int, int] = {}

    def device(self, t) -> int:
        key = ctypes.addressof(t.contents)
        if key not in self._dev:
            c = t.contents
            if c.view_src:
                self._dev[key] = self.device(c.view_src)  # views stay with what they view
            elif c.op == ggml.GGML_OP_NONE:
                self._dev[key] = self._leaf(t)
            else:
                self._dev[key] = self._p.device_of(self._g.segment_of(t))
        return self._dev[key]


def _runs(graph: _Graph) -> list[tuple[int, list]]:
    """Runs of consecutive nodes by device, a view joining the run it sits in (as ggml's split)."""
    runs: list[tuple[int, list]] = []
    for n in graph.nodes:
        d = graph.device(n) if n.contents.op not in _VIEW_OPS else (runs[-1][0] if runs else graph.device(n))
        if not runs or (n.contents.op not in _VIEW_OPS and d != runs[-1][0]):
            runs.append((d, []))
        runs[-1][1].append(n)
    return runs


def _graph_message(graph: _Graph, d: int, nodes: list) -> int:
    """GRAPH_COMPUTE bytes of one run: node ids, and every tensor reachable from its nodes (a
    source on another device is replaced by its copy, a leaf here)."""
    seen: set[int] = set()

    def add(t) -> None:
        key = ctypes.addressof(t.contents)
        if key in seen:
            return
        seen.add(key)
        if graph.device(t) != d:
            return  # the scheduler's copy of it: a leaf
        for s in list(t.contents.src) + [t.contents.view_src]:
            if s:
                add(s)
    for n in nodes:
        add(n)
    return HEADER + 4 + 4 + 8 * len(nodes) + 4 + RPC_TENSOR * len(seen)


def traffic_per_token(weights: GGUFWeights, placement: Placement, cache: SequenceCache, *, n_past: int) -> dict:
    """Bytes on each server's connection for one decoded token after n_past, from the graph:
    per run of nodes on a server its GRAPH_COMPUTE message, per tensor crossing to a server a
    SET_TENSOR, per tensor leaving one a GET_TENSOR (a round trip), and the logits."""
    cfg = weights.cfg
    saved, cache.n_past = cache.n_past, n_past
    n_nodes = graph_size(weights)
    ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=ggml.ggml_tensor_overhead() * n_nodes * 2
                                               + ggml.ggml_graph_overhead_custom(n_nodes, False),
                                               mem_buffer=None, no_alloc=True))
    try:
        g = GraphBuild(ctx, ggml.ggml_new_graph_custom(ctx, n_nodes, False), cfg, cache, n_tokens=1, exact=False,
                       top_k=cfg.indexer.top_k if cfg.indexer else None, segments=True, dsa_path="gather")
        logits = build_forward(g, weights, g.input("tokens", I32, (1,), np.zeros(1, np.int32)))
        g.expand(logits)
        return _count(_Graph(g, placement, _leaf_device(weights, cache, placement)), placement, logits,
                      cfg.vocab_size)
    finally:
        ggml.ggml_free(ctx)
        cache.n_past = saved


def _leaf_device(weights: GGUFWeights, cache: SequenceCache, placement: Placement):
    """Where a leaf lives: weights and caches with their layer (globals as devices.py places
    them), graph inputs on the CPU."""
    where = {p.name: (placement.layer_device[p.layer] if p.layer is not None else
                      placement.device_of(INPUT_SEGMENT if p.name == TOKEN_EMBD else OUTPUT_SEGMENT))
             for p in plan_tensors(weights.cfg)}
    by_address = {ctypes.addressof(t.contents): where[n] for n, t in weights.tensors.items()}
    cfg = weights.cfg
    for l in range(cfg.num_layers):
        state = ([cache.kda_conv(l, x) for x in CONV_INPUTS] + [cache.kda_state(l)] if cfg.is_kda(l) else
                 [cache.mla_latent(l)] + ([cache.indexer_keys(l)] if cache.has_indexer(l) else []))
        by_address.update({ctypes.addressof(t.contents): placement.layer_device[l] for t in state})
    return lambda t: by_address.get(ctypes.addressof(t.contents), placement.cpu)


def _count(graph: _Graph, p: Placement, logits, vocab: int) -> dict:
    per = {d: Counter() for d in range(len(p.names)) if d != p.cpu}
    copied: set[tuple[int, int]] = set()
    boundary: Counter[str] = Counter()
    for n in graph.nodes:
        if n.contents.op in _VIEW_OPS:
            continue
        d = graph.device(n)
        for s in n.contents.src:
            if not s or graph.device(s) == d or (ctypes.addressof(s.contents), d) in copied:
                continue
            copied.add((ctypes.addressof(s.contents), d))
            a, nbytes = graph.device(s), ggml.ggml_nbytes(s)
            boundary[f"{p.names[a]} -> {p.names[d]}"] += nbytes
            if a in per:  # read back from its server by the client
                per[a]["GET_TENSOR"] += HEADER + GET_TENSOR_REQUEST
                per[a]["received"] += REPLY_HEADER + nbytes
                per[a]["round_trips"] += 1
            if d in per:
                per[d]["SET_TENSOR"] += HEADER + RPC_TENSOR + 8 + nbytes
    for d, nodes in _runs(graph):
        if d in per:
            per[d]["GRAPH_COMPUTE"] += _graph_message(graph, d, nodes)
    if graph.device(logits) in per:
        o = per[graph.device(logits)]
        o["GET_TENSOR"] += HEADER + GET_TENSOR_REQUEST
        o["received"] += REPLY_HEADER + 4 * vocab
        o["round_trips"] += 1
    return {"per_server": {p.names[d]: {k: round(v) for k, v in c.items()} for d, c in per.items()},
            "crossing": dict(boundary)}


# ---- projected ------------------------------------------------------------------------------

def real_k31pro_weights():
    """The real K3.1-Pro's tensors as shapes only (no data), typed as the converter writes them."""
    raw = json.loads((REPO / "tests/fixtures/reference/kimi-k3-config.json").read_text())
    text = raw.get("text_config", raw)
    text.update(K31PRO_INDEXER, index_layers=text["linear_attn_config"]["full_attn_layers"])
    cfg = parse_config(raw)
    plan = list(plan_tensors(cfg))
    ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=ggml.ggml_tensor_overhead() * (len(plan) + 1),
                                               mem_buffer=None, no_alloc=True))
    types = {OUT_F32: ggml.GGML_TYPE_F32, OUT_MXFP4: ggml.GGML_TYPE_MXFP4}
    tensors = {}
    for p in plan:
        ne = tuple(reversed(p.shape))
        t = ggml.ggml_new_tensor(ctx, types.get(p.spec.out, ggml.GGML_TYPE_BF16), len(ne),
                                 (ctypes.c_int64 * len(ne))(*ne))
        ggml.ggml_set_name(t, p.name.encode())
        tensors[p.name] = t
    return GGUFWeights(Path("K3.1-Pro (shapes only)"), cfg, {}, tensors, [], ctx)


def project() -> dict:
    weights = real_k31pro_weights()
    cfg = weights.cfg
    per_layer, globals_ = [0] * cfg.num_layers, {}
    for p in plan_tensors(cfg):
        nbytes = ggml.ggml_nbytes(weights.tensors[p.name])
        if p.layer is None:
            globals_[p.name] = nbytes
        else:
            per_layer[p.layer] += nbytes
    out = {"model": {"layers": cfg.num_layers, "weights_bytes": sum(per_layer) + sum(globals_.values()),
                     "layer_bytes_min_max": [min(per_layer), max(per_layer)], "global_bytes": globals_},
           "hosts": []}
    for n_hosts in HOSTS:
        names = [f"server {i + 1}" for i in range(n_hosts - 1)] + ["client host"]
        p = Placement.plan(names, cfg.num_layers, [1.0] * n_hosts)
        host_bytes = [sum(per_layer[l] for l in p.layers_on(d)) for d in range(n_hosts)]
        host_bytes[p.cpu] += sum(globals_.values())
        entry = {"hosts": n_hosts, "layers_per_host": [len(p.layers_on(d)) for d in range(n_hosts)],
                 "weights_per_host_gib": [round(b / 2**30, 1) for b in host_bytes], "contexts": {}}
        for n_ctx in CONTEXTS:
            cache = SequenceCache(cfg, None, n_ctx=n_ctx, exact=False, with_indexer=True)
            try:
                t = traffic_per_token(weights, p, cache, n_past=n_ctx - 1)
            finally:
                cache.free()
            entry["contexts"][n_ctx] = {**t, "network_ms_per_token": _network_ms(t)}
        out["hosts"].append(entry)
    weights.close()
    return out


def _network_ms(t: dict) -> dict:
    """Serial per-token time on the wire: every byte once (the client is the hub), over each link rate."""
    total = sum(c.get(k, 0) for c in t["per_server"].values()
                for k in ("GRAPH_COMPUTE", "SET_TENSOR", "GET_TENSOR", "received"))
    trips = sum(c.get("round_trips", 0) for c in t["per_server"].values())
    return {"bytes": round(total), "round_trips": round(trips),
            **{f"{g}_gbit_s": round(total * 8 / (g * 1e9) * 1e3, 3) for g in LINKS_GBIT}}


# ---- main -------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", type=Path, default=RESULTS / "rpc.json")
    a = ap.parse_args()
    a.workdir.mkdir(parents=True, exist_ok=True)
    gguf = prepare(a.workdir)
    runs = [run_config(gguf, [], None, a)]
    breakdown = {}
    for n in (2, 3):
        split = ",".join(["1"] * n + ["0"])
        with RpcServers(n, threads=a.threads) as servers:
            runs.append(run_config(gguf, servers.endpoints, split, a))
            breakdown[n] = decode_breakdown(gguf, servers, split, a)
    result = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "loadavg": os.getloadavg()},
              "gguf": {"synth": MEDIUM, "bytes": gguf.stat().st_size}, "threads": a.threads,
              "prompt_tokens": a.prompt, "gen_tokens": a.gen, "runs": runs, "decode_breakdown": breakdown,
              "projection_k31pro": project()}
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(result, indent=1) + "\n")
    for r in runs:
        print(f"{r['servers']} servers: load {r['load_s']} s, prompt {r['prompt_tok_s']} tok/s, decode "
              f"{r['decode_tok_s']} tok/s, {r['bytes_per_decode_token']['sent'] / 1024:.0f} KiB sent per token")
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
