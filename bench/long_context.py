"""Long-context benchmark: decode time against the context for dense MLA, the masked DSA path and
the gathered one, with top_k 2048, on the graph benchmark's model (bench/graph.py: K3.1-Pro's real
widths, 4 layers of which one MLA+DSA: kv_lora_rank 512 + 64, 96 heads, 32 indexer heads x 128).

    python bench/long_context.py --workdir /tmp/kimi-graph-bench

1. prefill   a real prefill of --base tokens of text (the repository's sample texts, repeated)
             through the whole model with F32 caches: the caches' rows and the KDA states. Every
             cache type's rows are made from these (gguf-py encodes F16, BF16 and Q8_0 as ggml does).
2. contexts  a context of N tokens repeats those latent and indexer key rows, every copy after the
             first with noise of 5% of each row's scale (so that keys do not tie and a selection
             reaches across the whole context, as a long text's does), written into the caches
             directly through the state format (a real prefill of 128k tokens would take most of
             a day on 2 cores); the KDA states are the prefill's. The tokens decoded after it are
             real: greedy from the model's own logits.
3. decode    at each N of --contexts, each path decodes --steps tokens on one thread, the paths
             taking turns step by step; a step's time is the thread's CPU time around the whole
             decode call (graph build and compute: on one thread ggml computes in the calling
             thread), which other processes on a shared machine do not inflate, where the wall
             clock of a 2-thread step measured 1.2-9.4 s for a 0.3 s step under a load of 15
             (ggml's threads wait for each other at every node); the fastest step counts. The
             wall clock is recorded too.
4. ops       one decode step per path at each N on one thread, each node timed by the thread's CPU
             clock (bench/op_profile.py): the per-op split, the O(context) ops by kind, the
             indexer's share of the step.
5. prefill   the DSA layer alone (its attention block on the layer's own weights, random inputs):
             micro-batches of --ubatch tokens at five positions through an 8k and a 32k prompt
             (the cost per token is affine in the position on every path, so the trapezoid over
             them is the prompt's), dense / masked / gather, one thread: tokens/s of the layer.
6. types     --agree-tokens of text teacher-forced in one micro-batch after an --agree-context
             context, through every cache type against the F32 caches (the context's rows encoded
             in the type, the text's written by the graph): the share of the DSA layer's
             selections identical to the F32 caches', their mean overlap, and the logits'
             divergence (KL of the type's distribution from the F32 one, top-1 agreement).
7. memory    the caches' bytes per 1k tokens of context for each type, this model and K3.1-Pro
             (24 MLA+DSA layers, 69 KDA layers).

Results: bench/results/long_context.json (`rows`: one per context with `context`,
`dense_s_per_token`, `masked_s_per_token`, `gather_s_per_token` and `ops`, the per-op split) and
bench/results/long_context.png (s/token against the context; the gathered step's split).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import long_context_parts as parts  # noqa: E402
from bench.graph import cpu_features, prepare  # noqa: E402
from bench.plotting import pyplot  # noqa: E402

RESULTS = REPO / "bench" / "results"
PATHS = ("dense", "masked", "gather")
GOAL_CONTEXT = 131072  # where the goals are set: gather <= 1.3x its 4k time, >= 3x faster than dense


def decode_rows(a: argparse.Namespace, gguf: Path, base) -> list[dict]:
    """Per context: each path's fastest decode step (one thread's CPU time; wall clock too) and
    its per-op split."""
    n_ctx = max(a.contexts) + a.steps + 1
    models = {p: parts.load(gguf, p, n_ctx, 1, a.top_k) for p in PATHS}
    rows = []
    try:
        for n in a.contexts:
            for p, m in models.items():
                m.state_set(0, parts.long_state(m, base, n))
            times = parts.decode_times(models, a.steps)
            row = {"context": n, **{f"{p}_s_per_token": min(times[p]["cpu"]) for p in PATHS},
                   **{f"{p}_wall_s_per_token": min(times[p]["wall"]) for p in PATHS}}
            row["ops"] = {p: parts.op_split(m, n) for p, m in models.items()}
            rows.append(row)
            print(f"N {n:6d}: " + ", ".join(f"{p} {row[f'{p}_s_per_token'] * 1e3:7.1f} ms" for p in PATHS) +
                  f" (CPU, one thread); gather indexer {row['ops']['gather']['indexer_share']:.1%} of the step",
                  file=sys.stderr, flush=True)
    finally:
        for m in models.values():
            m.close()
    return rows


def plot(result: dict, path: Path) -> None:
    plt = pyplot(path)
    if plt is None:
        return
    rows = result["rows"]
    ctx = [r["context"] for r in rows]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.5))
    for p in PATHS:
        ax.plot(ctx, [r[f"{p}_s_per_token"] * 1e3 for r in rows], marker="o", label=p if p == "dense" else f"{p} DSA")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("ms per decoded token (CPU time, one thread)")
    ax.set_title(f"decode, whole model, top_k {result['top_k']}", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    bottom = np.zeros(len(rows))
    for kind in parts.KINDS[:-1]:  # the rest (the weights' matmuls, KDA, MoE) does not grow with the context
        ms = np.array([r["ops"]["gather"]["kinds_s"].get(kind, 0.0) * 1e3 for r in rows])
        bx.bar([str(c // 1024) + "k" for c in ctx], ms, bottom=bottom, label=kind)
        bottom += ms
    rest = [r["ops"]["gather"]["kinds_s"]["rest"] * 1e3 for r in rows]
    bx.set_ylabel("ms, one thread (CPU time)")
    bx.set_title(f"gathered step: the ops that grow with the context (rest {min(rest):.0f}-{max(rest):.0f} ms)",
                 fontsize=10)
    bx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(result: dict) -> None:
    rows = result["rows"]
    first = rows[0]
    goal = next((r for r in rows if r["context"] == GOAL_CONTEXT), rows[-1])
    for r in (goal, rows[-1]) if rows[-1] is not goal else (goal,):
        n = r["context"]
        print(f"at {n}: gather decode / at {first['context']}: {r['gather_s_per_token'] / first['gather_s_per_token']:.2f} "
              f"(goal at {GOAL_CONTEXT}: <= 1.3); dense / gather: {r['dense_s_per_token'] / r['gather_s_per_token']:.2f} "
              f"(goal >= 3); masked / gather: {r['masked_s_per_token'] / r['gather_s_per_token']:.2f}; the indexer's "
              f"share of the gathered step: {r['ops']['gather']['indexer_share']:.1%}")
        for p in PATHS:
            print(f"  {p:6s} " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in r["ops"][p]["kinds_s"].items()))
    for prompt, r in result["prefill"].items():
        print(f"prefill {prompt} tokens, DSA layer alone: " + ", ".join(f"{p} {r[p]['tok_s']:.1f} tok/s" for p in PATHS))
    for name, r in result["cache_types"]["types"].items():
        print(f"cache {name}: selections identical {r['selection_identical']:.1%}, overlap {r['selection_overlap']:.2%}, "
              f"KL mean {r['kl_mean']:.2e} max {r['kl_max']:.2e}, top-1 {r['top1_agreement']:.1%}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, default=Path("/tmp/kimi-graph-bench"),
                   help="bench/graph.py's work directory (its GGUFs are made there when missing)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="the prefills' threads")
    p.add_argument("--top-k", type=int, default=2048)
    p.add_argument("--base", type=int, default=512, help="tokens of the real prefill")
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 32768, 65536, 131072, 262144])
    p.add_argument("--steps", type=int, default=5, help="decoded tokens per path and context")
    p.add_argument("--prompts", type=int, nargs="+", default=[8192, 32768], help="prefill: prompt lengths")
    p.add_argument("--ubatch", type=int, default=64, help="prefill: tokens of each measured micro-batch")
    p.add_argument("--agree-context", type=int, default=16384, help="cache types: the context before the text")
    p.add_argument("--agree-tokens", type=int, default=128, help="cache types: tokens of text teacher-forced")
    p.add_argument("--json", type=Path, default=RESULTS / "long_context.json")
    a = p.parse_args(argv)
    load_at_start = os.getloadavg()
    gguf, _ = prepare(a.workdir)
    t0 = time.perf_counter()
    base = parts.prefill(gguf, a.base, a.threads)
    print(f"prefill of {a.base} tokens: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    result = {"machine": {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                          "cpu_features": cpu_features(), "load_average_at_start": load_at_start},
              "gguf": gguf.name, "threads": a.threads, "top_k": a.top_k, "base": a.base, "steps": a.steps,
              "date": time.strftime("%Y-%m-%d")}
    result["rows"] = decode_rows(a, gguf, base)
    result["prefill"] = {str(n): parts.layer_prefill(gguf, base, n, a.ubatch, a.top_k) for n in a.prompts}
    result["cache_types"] = parts.cache_types(gguf, base, a.agree_context, a.agree_tokens, a.top_k, a.threads)
    result["cache_bytes_per_1k"] = parts.cache_bytes_per_1k(gguf)
    result["machine"]["load_average_at_end"] = os.getloadavg()
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, a.json.with_suffix(".png"))
    report(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
