"""Memory-budget benchmark: s/token and bytes read per token against --mem-budget.

    python bench/memory.py --workdir /tmp/kimi-membench [--model PATH]

On one K3.1-Pro GGUF: by default generated here (`kimi-k3-synth --preset large`, the real expert
shapes, 17.5 MB per MXFP4 expert, with a small trunk, 6 layers and 32 experts of which a token
uses 4, then `convert_kimi_k3`: ~3.9 GB, so that reading the selected experts, not the per-layer
work, is what a streamed token costs), or the one given with --model. Per budget (1/6, 1/3, 1/2
of the GGUF, unlimited), in a child process: greedy decode of N tokens after a short prompt;
s/token of the decode; bytes read per token from the child's /proc/self/io `read_bytes` (what
reached the disk, raw: the streamer drops the pages it read); the bytes a token had to read (the
streamed trunks, and the selected experts the cache did not hold before their layer's
prediction or selection: the executor's counters); the expert cache's hit rate; the read-ahead
of the next layer's predicted experts (issued, useful, wasted and the wasted bytes, and the
prediction's accuracy: of the selected experts, how many were predicted); the disk's sequential
read speed measured right before and right after each run (uncached: kimi-k3-doctor's buffered
read and the same bytes O_DIRECT; the fastest of the four counts for that run); and ratio_to_disk_bound = s/token / (bytes needed per token / read speed).
The bound counts the needed bytes, not the raw ones: a wasted read ahead costs time (it is in
s/token) but does not raise the bound; where the raw count is the smaller (a page the kernel still
held was not read from the disk), it is the one used: the stricter bound. The tokens of every budget are compared with the
unlimited run's. A second bound, measured rather than computed: right after each run the bytes a
token had to read are read again without compute (replay_s_per_token: the streamed trunk bytes
from the trunk tensors, the missed experts as gate/up/down slices of random experts, O_DIRECT,
with one and with the runner's READERS readers, the faster counts), and
ratio_to_replayed_reads = s/token / that time: this disk's sustained speed on the requests the
runner makes, where a 256 MB read-speed probe catches its bursts (0.3-1.9 GB/s here within minutes). The compute alone (warm_compute_s_per_token: unlimited, the GGUF read into the
page cache first) is the floor under every s/token. Also a projection for the real K3.1-Pro from the issue's
sizes: whole layers streamed (every expert of a streamed layer read) against the plan of
backends/streaming/budget.py (trunks pinned first, the selected experts read into an expert cache; misses
predicted as if every expert were equally likely). Results in bench/results/memory.json and
bench/results/memory.png (with matplotlib, the bench extra).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import convert_kimi_k3  # noqa: E402
from gguf_arch.synth.cli import main as synth_main  # noqa: E402
from ggml_graph_spec.backends.streaming.budget import ExpertSizes, plan_budget  # noqa: E402
from ggml_graph_spec.tools.doctor import read_speed  # noqa: E402
from gguf_arch.io.direct_io import open_direct, scratch  # noqa: E402
from ggml_graph_spec.weights.loader import load_gguf  # noqa: E402
from ggml_graph_spec.backends.streaming.experts import READERS, EXPERT_REQUEST, read_range  # noqa: E402
from ggml_graph_spec.backends.streaming.layer_files import LayerFiles  # noqa: E402
from bench.plotting import pyplot  # noqa: E402

CHILD = """
import json, sys, time, numpy as np
from ggml_graph_spec.engine.model import Model
def io():
    return int([l for l in open("/proc/self/io") if l.startswith("read_bytes")][0].split()[1])
m = Model.load(sys.argv[1], n_ctx=128, n_threads=int(sys.argv[4]),
               mem_budget=None if sys.argv[2] == "none" else sys.argv[2])
logits, out, x = m.eval([1, 5, 9]), [], m.executor
c = getattr(x, "cache", None)
def counters():  # trunk bytes read, experts missed (bytes), read ahead: issued, useful, wasted (bytes)
    e = (c.miss_bytes, c.predicted, c.useful, c.wasted, c.wasted_bytes, c.hits, c.misses) if c else (0,) * 7
    return np.array((getattr(x, "bytes_read", 0), *e, getattr(x, "guess_right", 0), getattr(x, "guess_total", 0)))
k0, r0, t0 = counters(), io(), time.perf_counter()
for _ in range(int(sys.argv[3])):
    out.append(int(np.argmax(logits[-1])))
    logits = m.eval([out[-1]])
dt, read, k = time.perf_counter() - t0, io() - r0, (counters() - k0).tolist()
print(" ".join(map(str, out)))
summary = [f"{a}: {b}" for a, b in x.summary()] if hasattr(x, "summary") else []
keys = ("trunk", "expert_misses", "predicted", "useful", "wasted", "wasted_bytes", "hits", "misses", "right", "of")
print(json.dumps({"s": dt / len(out), "read": read / len(out), "n": len(out), **dict(zip(keys, k)),
                  "summary": summary}))
m.close()
"""

DIRECT_SPEED_BYTES = 256 << 20  # as much as kimi-k3-doctor's read (its pages are never cached: O_DIRECT)

# The bench's generated model: real expert shapes (latent 3584 x 3072), a small trunk.
SYNTH = ["--preset", "large", "--layers", "6", "--hidden", "1024", "--intermediate", "2048", "--experts", "32",
         "--experts-per-token", "4", "--vocab", "912"]

# The real K3.1-Pro (issue 14): trunk bytes, experts, and how many a token uses.
REAL = {"trunk_bf16": 108.8e9, "trunk_q8_0": 57.8e9, "n_experts": 82432, "expert_bytes": 17547264,
        "layers": 93, "experts_per_layer": 896, "active_per_layer": 16}


def _model(work: Path) -> Path:
    gguf = work / "m.gguf"
    if not gguf.exists():
        assert synth_main([*SYNTH, "--overwrite", str(work / "hf")]) == 0
        assert convert_kimi_k3.main([str(work / "hf"), str(gguf), "--quiet"]) == 0
    return gguf


def _run(gguf: Path, budget: str, n: int, threads: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run(["nice", sys.executable, "-c", CHILD, str(gguf), budget, str(n), str(threads)], env=env,
                       capture_output=True, text=True, timeout=3600)
    if r.returncode:
        raise SystemExit(f"error: the run at budget {budget} failed: {r.stderr.strip().splitlines()[-1:]}")
    tokens, stats = r.stdout.strip().splitlines()
    s = json.loads(stats)
    lookups, n = s["hits"] + s["misses"], s["n"]
    return {"budget": budget, "tokens": tokens, "s_per_token": s["s"], "bytes_read_per_token": s["read"],
            "bytes_needed_per_token": (s["trunk"] + s["expert_misses"]) / n,
            "bytes_trunk_per_token": s["trunk"] / n, "bytes_experts_missed_per_token": s["expert_misses"] / n,
            "expert_hit_rate": s["hits"] / lookups if lookups else None,
            "prefetch": {"issued": s["predicted"], "useful": s["useful"], "wasted": s["wasted"],
                         "wasted_bytes_per_token": s["wasted_bytes"] / n,
                         "prediction_accuracy": s["right"] / s["of"] if s["of"] else None},
            "summary": s["summary"]}


def replay_s_per_token(gguf: Path, run: dict, n: int) -> float:
    """The disk's time for the bytes a token had to read, as the runner reads them: the streamed
    trunk bytes from the layers' trunk tensors, the missed experts as their gate/up/down slices
    at random (layer, expert) of the file, O_DIRECT in the runner's requests (EXPERT_REQUEST) into
    buffers kept, one reader and READERS readers (the faster
    counts), no compute; right after the run, so the disk is the one the run had."""
    weights = load_gguf(gguf, repack=False)
    files = LayerFiles(weights)
    try:
        rng = random.Random(0)
        trunk = [(p.path, p.file_offset, p.nbytes) for l in sorted(files.layers, reverse=True)
                 for p in files.layers[l]]
        reads, want = [], run["bytes_trunk_per_token"] * n
        for r in trunk * n:  # the trunk of the last layers first: those a budget streams
            if want <= 0:
                break
            reads.append(r)
            want -= r[2]
        stacks = list(files.experts.values())
        one = sum(st.stride for st in stacks[0]) if stacks else 1  # an expert's gate, up and down slices
        for _ in range(round(run["bytes_experts_missed_per_token"] * n / one)):
            layer = rng.choice(stacks)
            e = rng.randrange(layer[0].count)
            reads += [(st.path, st.file_offset + e * st.stride, st.stride) for st in layer]
        return min(_timed_reads(reads, k, EXPERT_REQUEST) for k in (1, READERS)) / n if reads else 0.0
    finally:
        files.close()
        weights.close()


def _timed_reads(reads: list[tuple[str, int, int]], readers: int, chunk: int = 0) -> float:
    """Seconds to pread (path, offset, bytes) `reads` on `readers` threads, O_DIRECT in requests of
    `chunk` bytes (0: one per read) where the file system allows it, else buffered with the
    files' pages dropped first and after: uncached either way.
    Each reader reads into one buffer it keeps, as the runner reads into its cache and slots
    (direct_io.scratch: fresh memory per read ran at half the speed or less)."""
    fds = {path: os.open(path, os.O_RDONLY) for path in {r[0] for r in reads}}
    direct = {path: open_direct(fd, path) for path, fd in fds.items()}
    for fd in fds.values():
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    try:
        start = time.perf_counter()
        with ThreadPoolExecutor(readers) as pool:  # read_range: the runner's read, and its buffered fallback
            list(pool.map(lambda r: read_range(fds[r[0]], direct[r[0]], r[0], scratch(r[1], r[2]), r[2], r[1],
                                               room=True, chunk=chunk), reads))
        return time.perf_counter() - start
    finally:
        for path, fd in fds.items():
            if direct[path] is not None:
                os.close(direct[path])
            os.close(fd)


def bound_bytes(run: dict) -> float:
    """The bytes per token the disk bound counts (module docstring): needed, or raw if fewer."""
    return min(run["bytes_needed_per_token"], run["bytes_read_per_token"])


def warm_compute(gguf: Path, n: int, threads: int) -> float:
    """s/token of an unlimited run with the whole GGUF in the page cache first: the compute alone
    (no byte comes from the disk), the floor under every budget's s/token. Its pages are dropped after."""
    fd = os.open(gguf, os.O_RDONLY)
    try:
        while os.read(fd, 16 << 20):
            pass
        return _run(gguf, "none", n, threads)["s_per_token"]
    finally:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def projection(speed: float) -> list[dict]:
    """Per budget: bytes a token must read with whole layers streamed, and with the plan."""
    experts = REAL["n_experts"] * REAL["expert_bytes"]
    total, layer = REAL["trunk_q8_0"] + experts, (REAL["trunk_q8_0"] + experts) / REAL["layers"]
    moe = REAL["n_experts"] // REAL["experts_per_layer"]
    trunks = [int(REAL["trunk_q8_0"] / REAL["layers"])] * REAL["layers"]
    sizes = ExpertSizes((0,) * (REAL["layers"] - moe) + (REAL["experts_per_layer"],) * moe, REAL["expert_bytes"],
                        REAL["active_per_layer"])
    rows = []
    for gb in (8, 32, 64, 128, 256):
        whole = max(0, REAL["layers"] - int(gb * 1e9 // layer)) * layer
        p = plan_budget(int(gb * 1e9), 0, trunks, sizes)
        planned = p.predicted_bytes_per_token
        rows.append({"budget_gb": gb, "total_bytes": total, "whole_layers_bytes_per_token": whole,
                     "whole_layers_s_per_token": whole / speed, "pinned_trunks": len(p.pinned),
                     "expert_cache_entries": p.cache_entries, "active_experts_bytes_per_token": planned,
                     "active_experts_s_per_token": planned / speed})
    return rows


def plot(out: dict, path: Path) -> None:
    plt = pyplot(path)
    if plt is None:
        return
    def mib(r: dict) -> float:  # unlimited is drawn at the GGUF's size
        return (out["gguf_bytes"] if r["budget"] == "none" else int(r["budget"])) / 2**20
    runs = sorted(out["runs"], key=mib)
    x = [mib(r) for r in runs]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    ax.plot(x, [r["s_per_token"] for r in runs], marker="o", label="measured s/token")
    bound = [bound_bytes(r) / r["read_speed_bytes_per_s"] for r in runs]
    ax.plot(x, bound, marker="x", linestyle="--", label="disk bound (bytes needed / read speed)")
    ax.axhline(out["warm_compute_s_per_token"], color="gray", linewidth=0.8, label="compute alone (warm)")
    ax.set_xlabel("--mem-budget (MiB; the rightmost point: unlimited)")
    ax.set_ylabel("s/token")
    ax.set_title(f"decode within a memory budget, {out['gguf_bytes'] / 2**30:.1f} GiB GGUF", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def disk_speed(gguf: Path) -> float:
    """The faster of kimi-k3-doctor's buffered sequential read and the same bytes read O_DIRECT
    (the way the runner reads experts), both uncached."""
    chunk, end = 8 << 20, min(DIRECT_SPEED_BYTES, gguf.stat().st_size)
    sequential = [(str(gguf), off, min(chunk, end - off)) for off in range(0, end, chunk)]
    direct = sum(r[2] for r in sequential) / _timed_reads(sequential, 1)
    return max(direct, read_speed([str(gguf)]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, required=True, help="where the generated model is kept")
    ap.add_argument("--model", type=Path, default=None, help="a K3.1-Pro GGUF to use instead of generating one")
    ap.add_argument("-n", type=int, default=8, help="decode tokens per run")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=ROOT / "bench/results/memory.json")
    a = ap.parse_args()
    a.workdir.mkdir(parents=True, exist_ok=True)
    gguf = a.model or _model(a.workdir)
    size = gguf.stat().st_size
    # This VM's disk moves between ~0.5 and ~1.8 GB/s within minutes: each run's bound takes the
    # disk's speed measured right before and right after it (the faster reading: the stricter bound)
    runs, speeds = [], [disk_speed(gguf)]
    for b in ("none", str(size // 6), str(size // 3), str(size // 2)):
        runs.append(_run(gguf, b, a.n, a.threads))
        runs[-1]["replay_s_per_token"] = replay_s_per_token(gguf, runs[-1], a.n)
        speeds.append(disk_speed(gguf))
        runs[-1]["read_speed_bytes_per_s"] = max(speeds[-2:])
    speed, warm = max(speeds), warm_compute(gguf, a.n, a.threads)
    for r in runs:
        r["identical_tokens"] = r["tokens"] == runs[0]["tokens"]
        bound = bound_bytes(r) / r["read_speed_bytes_per_s"]
        # unlimited: the weights are in memory after the first graph; a few stray pages are no bound
        r["ratio_to_disk_bound"] = r["s_per_token"] / bound if bound and r["budget"] != "none" else None
        replay = r["replay_s_per_token"]
        r["ratio_to_replayed_reads"] = r["s_per_token"] / replay if replay and r["budget"] != "none" else None
    model = "generated: kimi-k3-synth " + " ".join(SYNTH) if a.model is None else gguf.name
    out = {"gguf_bytes": size, "model": model, "read_speed_bytes_per_s": speed, "read_speeds_between_runs": speeds,
           "warm_compute_s_per_token": warm, "threads": a.threads, "runs": runs, "projection_k31pro_q8_0": projection(speed)}
    a.json.write_text(json.dumps(out, indent=1) + "\n")
    plot(out, a.json.with_suffix(".png"))
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
