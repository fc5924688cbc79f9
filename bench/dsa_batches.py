"""DSA paths by batch size: gathered against masked (the baseline) for batches of 1..256 tokens
after a filled context, and for a whole prompt from an empty cache.

    python bench/dsa_batches.py --workdir /tmp/kimi-dsa-bench

bench/graph.py measures single-token decode on a model with the real widths, where the weights
dominate. This one uses the generator's tiny K3.1-Pro (`kimi-k3-synth --preset tiny --variant
k31pro`, converted by us), where attention is a large share of every step, to show what the
choice of path costs when a batch has many queries: each query gathers its own top_k rows, while
the masked flash attention reads the cache once for the whole batch. The cache is filled with
random rows as in bench/graph.py; each timing is the fastest of --repeats runs. Results:
bench/results/dsa_batches.json, ratios gather / masked printed.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.graph import TOP_K_FRACTION, fill_caches  # noqa: E402
from ggml_graph_spec.engine.model import Model  # noqa: E402

PATHS = ("masked", "gather")


def prepare(workdir: Path) -> Path:
    ckpt, gguf = workdir / "tiny", workdir / "tiny.gguf"
    bin_dir = Path(sys.executable).parent
    if not gguf.exists():
        subprocess.run([str(bin_dir / "kimi-k3-synth"), str(ckpt), "--preset", "tiny", "--variant", "k31pro",
                        "--overwrite"], check=True)
        subprocess.run([sys.executable, str(REPO / "convert_kimi_k3.py"), str(ckpt), str(gguf), "--quiet"], check=True)
    return gguf


def _best(f, repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        f()
        runs.append(time.perf_counter() - t)
    return min(runs)


def batches_after_context(gguf: Path, n: int, sizes: list[int], a: argparse.Namespace) -> list[dict]:
    rng = np.random.default_rng(0)
    models = {p: Model.load(gguf, n_ctx=n + max(sizes), n_threads=a.threads, dsa_path=p, top_k=n // TOP_K_FRACTION)
              for p in PATHS}
    rows = []
    for T in sizes:
        ids = [(7 * i) % 900 + 1 for i in range(T)]
        row = {"context": n, "top_k": n // TOP_K_FRACTION, "batch": T}
        for p, m in models.items():
            fill_caches(m, n, rng)

            def step():
                m.cache.n_past = n
                m.eval(ids)
            row[f"{p}_s"] = _best(step, a.repeats)
        rows.append(row)
        print(f"context {n} top_k {row['top_k']} batch {T:4d}: gather/masked {row['gather_s'] / row['masked_s']:.2f}",
              flush=True)
    for m in models.values():
        m.close()
    return rows


def prompts(gguf: Path, sizes: list[int], a: argparse.Namespace) -> list[dict]:
    rows = []
    for T in sizes:
        row = {"prompt": T, "top_k": T // TOP_K_FRACTION}
        for p in PATHS:
            m = Model.load(gguf, n_ctx=T, n_threads=a.threads, dsa_path=p, top_k=T // TOP_K_FRACTION)
            ids = [(7 * i) % 900 + 1 for i in range(T)]

            def prefill():
                m.reset()
                m.eval(ids)
            row[f"{p}_s"] = _best(prefill, a.repeats)
            m.close()
        rows.append(row)
        print(f"prompt {T:5d} top_k {row['top_k']}: gather/masked {row['gather_s'] / row['masked_s']:.2f}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, default=Path("/tmp/kimi-dsa-bench"))
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--context", type=int, default=16384, help="filled context before the batches")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    p.add_argument("--prompts", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "dsa_batches.json")
    a = p.parse_args(argv)
    a.workdir.mkdir(parents=True, exist_ok=True)
    gguf = prepare(a.workdir)
    result = {"threads": a.threads, "load_average_at_start": os.getloadavg(), "baseline": "masked",
              "batches": batches_after_context(gguf, a.context, a.batches, a), "prompts": prompts(gguf, a.prompts, a)}
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
