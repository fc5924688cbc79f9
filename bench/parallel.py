"""Parallel decoding benchmark: aggregate decode tokens/s with 1, 2, 4 and 8 sequences decoding
together, each its own prompt, in one graph per step (engine/model.py, graph/ubatch.py).

    python bench/parallel.py --workdir /tmp/kimi-graph-bench

On the graph benchmark's model (bench/graph.py: `kimi-k3-synth --preset large --experts 8`, the
real widths, 4 layers of which one MLA+DSA, ~6.1 GB; generated and converted once into --workdir,
shared with bench/graph.py), fast path, --threads threads:

  speed     one model with 8 sequences; for each count N of --sequences, N prompts of --prompt
            tokens prefilled together, then --steps decode steps of one token per sequence, timed
            (the model call only: sampling is argmax); tokens_per_s = N * steps / time. The counts
            take turns, --repeats rounds, and the best round of each counts (the machine may be
            shared). ratio_to_1 = tokens_per_s / the 1-sequence tokens_per_s of this run.
  budget    the same decode under --mem-budget at a third of the GGUF (a child process per count,
            1 and 4 sequences): bytes read per generated token, from the executor's counters (the
            streamed trunks and the missed experts) and from /proc/self/io (what reached the disk);
            with 4 sequences one step's reads serve four tokens. On the memory benchmark's model
            (bench/memory.py: the real expert shapes, 17.5 MB an MXFP4 expert, 32 experts of which a
            token uses 4, a small trunk; ~3.9 GB): the graph model's layers are 2.3 GB each, and a
            budget holds two layer slots at least, so a third of it does not run at all.
  caches    the cache bytes per sequence and token of context (the MLA latent and the indexer
            keys) and per sequence (the KDA states), as SequenceCache reports them, against the
            formula from the config; the run stops if they differ.

Results: bench/results/parallel.json (`runs`: one row per sequence count, `sequences`,
`tokens_per_s`, `ratio_to_1`, `mem_budget` null; then the budget rows with `mem_budget` in bytes and
`bytes_read_per_token`) and bench/results/parallel.png (tokens/s and the ratio against the count).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.graph import cpu_features, prepare  # noqa: E402
from bench.memory import _model as memory_model  # noqa: E402
from bench.plotting import pyplot  # noqa: E402

RESULTS = REPO / "bench" / "results"

BUDGET_CHILD = """
import json, sys, time, numpy as np  # noqa: E401
from ggml_graph_spec.engine.model import Model
from ggml_graph_spec.engine.options import LoadOptions
gguf, budget, n, steps, prompt, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), \\
    int(sys.argv[5]), int(sys.argv[6])
def io():
    return int([l for l in open("/proc/self/io") if l.startswith("read_bytes")][0].split()[1])
m = Model.load(gguf, LoadOptions(n_ctx=(prompt + steps + 1) * n, n_seq=n, n_threads=threads, mem_budget=budget))
x = m.executor
def needed():
    return x.bytes_read + (x.cache.miss_bytes if getattr(x, "cache", None) else 0)
out = m.decode({s: [(31 * s + 7 * i) % 900 + 1 for i in range(prompt)] for s in range(n)})
k0, r0, t0 = needed(), io(), time.perf_counter()
for _ in range(steps):
    out = m.decode({s: [int(np.argmax(out[s]))] for s in range(n)})
dt, tokens = time.perf_counter() - t0, n * steps
print(json.dumps({"s": dt, "needed": (needed() - k0) / tokens, "read": (io() - r0) / tokens}))
m.close()
"""


def cache_formula(cfg) -> dict[str, int]:
    """Bytes per sequence and token of context, and per sequence, from the config alone."""
    latent_row = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2  # F16 on the fast path
    index_row = cfg.indexer.head_dim * 4 if cfg.indexer is not None else 0
    kda = cfg.kda
    per_kda_layer = 4 * (3 * (kda.conv_kernel - 1) * kda.proj_dim + kda.head_dim * kda.head_dim * kda.num_heads)
    n_dsa = sum(cfg.is_dsa(l) for l in cfg.mla_layers) if cfg.indexer is not None else 0
    return {"latent": len(cfg.mla_layers) * latent_row, "indexer": n_dsa * index_row,
            "kda_states": len(kda.layers) * per_kda_layer}


def _prompts(n: int, length: int) -> dict[int, list[int]]:
    return {s: [(31 * s + 7 * i) % 900 + 1 for i in range(length)] for s in range(n)}


def speed(gguf: Path, a: argparse.Namespace) -> tuple[list[dict], dict]:
    from ggml_graph_spec.engine.model import Model
    from ggml_graph_spec.engine.options import LoadOptions

    n_max = max(a.sequences)
    m = Model.load(gguf, LoadOptions(n_ctx=(a.prompt + a.steps + 1) * n_max, n_seq=n_max, n_threads=a.threads))
    try:
        caches = {**m.cache.bytes_per_token(), "kda_states": m.cache.bytes_per_sequence()}
        m.decode({0: [1]})  # pages the weights in, starts the thread pool and the allocator
        best: dict[int, float] = {}
        for _ in range(a.repeats):
            for n in a.sequences:
                m.reset()
                out = m.decode(_prompts(n, a.prompt))
                t = time.perf_counter()
                for _ in range(a.steps):
                    out = m.decode({s: [int(np.argmax(out[s]))] for s in range(n)})
                best[n] = min(best.get(n, float("inf")), time.perf_counter() - t)
                print(f"  {n} sequence(s): {n * a.steps / best[n]:.2f} tokens/s (best so far)", file=sys.stderr)
        cfg = m.cfg
    finally:
        m.close()
    base = a.steps / best[1]
    rows = [{"sequences": n, "tokens_per_s": n * a.steps / best[n], "ratio_to_1": n * a.steps / best[n] / base,
             "mem_budget": None, "decode_s": best[n]} for n in a.sequences]
    formula = cache_formula(cfg)
    if formula != caches:
        raise SystemExit(f"error: the caches' bytes {caches} differ from the formula {formula}")
    return rows, {"measured": caches, "formula": formula}


def budget_rows(gguf: Path, a: argparse.Namespace) -> list[dict]:
    budget = gguf.stat().st_size // 3
    rows = []
    for n in (1, 4):
        env = dict(os.environ, PYTHONPATH=str(REPO))
        r = subprocess.run([sys.executable, "-c", BUDGET_CHILD, str(gguf), str(budget), str(n), str(a.steps),
                            str(a.prompt), str(a.threads)], env=env, capture_output=True, text=True, timeout=7200)
        if r.returncode:
            raise SystemExit(f"error: the budget run with {n} sequence(s) failed: {r.stderr.strip()[-400:]}")
        s = json.loads(r.stdout.strip().splitlines()[-1])
        rows.append({"sequences": n, "tokens_per_s": n * a.steps / s["s"], "mem_budget": budget, "model": gguf.name,
                     "bytes_needed_per_token": s["needed"], "bytes_read_per_token": s["read"]})
        print(f"  budget {budget >> 20} MiB, {n} sequence(s): {s['needed'] / 2**20:.1f} MiB needed per token",
              file=sys.stderr)
    for row in rows:
        row["ratio_to_1"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
        row["bytes_needed_ratio_to_1"] = row["bytes_needed_per_token"] / rows[0]["bytes_needed_per_token"]
    return rows


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot(path)
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    n = [r["sequences"] for r in rows]
    left.plot(n, [r["tokens_per_s"] for r in rows], "o-")
    left.set(xlabel="sequences decoding together", ylabel="aggregate decode tokens/s", xscale="log", xticks=n)
    left.set_xticklabels(n)
    right.plot(n, [r["ratio_to_1"] for r in rows], "o-", label="measured")
    right.plot(n, [2.5 if x == 4 else 4 if x == 8 else None for x in n], "x", label="goal")
    right.set(xlabel="sequences decoding together", ylabel="ratio to 1 sequence", xscale="log", xticks=n)
    right.set_xticklabels(n)
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, required=True, help="where the generated model is kept")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--sequences", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-budget", action="store_true", help="skip the --mem-budget rows")
    ap.add_argument("--json", type=Path, default=RESULTS / "parallel.json")
    a = ap.parse_args()
    a.workdir.mkdir(parents=True, exist_ok=True)
    dsa, _no_dsa = prepare(a.workdir)
    print(f"speed on {dsa.name}, {a.threads} threads", file=sys.stderr)
    rows, caches = speed(dsa, a)
    budget = [] if a.no_budget else budget_rows(memory_model(a.workdir / "memory"), a)
    result = {"date": time.strftime("%Y-%m-%d"), "machine": {"cpu": cpu_features(), "arch": platform.machine(),
              "cores": os.cpu_count(), "load_average": os.getloadavg()},
              "model": dsa.name, "threads": a.threads, "prompt": a.prompt, "steps": a.steps, "repeats": a.repeats,
              "runs": rows + budget, "caches_bytes": caches}
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(result, indent=1) + "\n")
    plot(rows, a.json.with_suffix(".png"))
    for r in rows + budget:
        print(f"{r['sequences']} seq{'' if r['mem_budget'] is None else ' (mem-budget)'}: "
              f"{r['tokens_per_s']:.2f} tok/s, {r['ratio_to_1']:.2f}x")


if __name__ == "__main__":
    main()
