"""Pruning quality on the fixtures: how far REAP-pruned logits move from the unpruned ones as a
function of N (kept experts per layer), against random choices of N experts; and how much the
top-N experts of two tagged texts overlap, against random choices.

    python bench/prune.py --workdir /tmp/kimi-prune-bench

Models, run on the exact path: tests/fixtures/k31pro-tiny (8 experts, top 2, 12 MoE layers;
k3-tiny has the same base tensors bit for bit, so the same numbers) and a generated one with 64
experts, top 8 (`kimi-k3-synth --preset tiny --experts 64 --experts-per-token 8 --layers 5`).
Calibration: tests/fixtures/text/prose.txt (tag prose) and code.txt (tag code), chunks of 64
tokens, all of them. Evaluation: k31pro-tiny's reference "long" prompt (96 tokens, not part of
the calibration). KL is KL(P_full || P_pruned) of the next-token distributions in nats, the mean
over the prompt's positions. Choices of the N kept experts per layer: REAP (kimi-k3-prune), the N
most often routed (--rank frequency), and --random draws (mean and smallest KL). Overlap: per MoE
layer |top_N(prose) & top_N(code)| / N by REAP saliency, the mean over layers; two random
N-subsets of E experts overlap by N/E on average.

Caveat: the fixtures' weights are random, so neither the KL nor the overlap says anything about a
trained model (whose experts specialise: kimi-k3-mlx measured 57-59% top-242 overlap within a
domain against 27% for random choices); these numbers show the machinery end to end and how the
loss grows as experts go. Results: bench/results/prune.json.
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

from gguf_arch.convert.run import convert  # noqa: E402
from gguf_arch.io.saliency import read_saliency  # noqa: E402
from ggml_graph_spec.tools.prune import RANKS, SourceGGUF, plan_from_saliency, prune_gguf, ranked_by  # noqa: E402
from ggml_graph_spec.tools.calibrate import main as calibrate  # noqa: E402
from ggml_graph_spec.engine.model import Model  # noqa: E402
from tests.support.paths import CODE, K31PRO_TINY, PROSE  # noqa: E402

CHUNK = 64
SYNTH_64 = ["--preset", "tiny", "--experts", "64", "--experts-per-token", "8", "--layers", "5"]


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64) - z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def mean_kl(full: np.ndarray, pruned: np.ndarray) -> float:
    p, q = log_softmax(full), log_softmax(pruned)
    return float((np.exp(p) * (p - q)).sum(axis=1).mean())


def logits(gguf: Path, ids: list[int], threads: int) -> np.ndarray:
    m = Model.load(gguf, n_ctx=len(ids), exact_experts=True, n_threads=threads)
    try:
        return m.eval(ids)
    finally:
        m.close()


def kl_of_plan(src: SourceGGUF, plan: dict, out: Path, ids: list[int], full: np.ndarray, threads: int) -> float:
    prune_gguf(src, out, plan, overwrite=True)
    return mean_kl(full, logits(out, ids, threads))


def kl_by_n(src: SourceGGUF, sal, work: Path, ids: list[int], keeps: list[int], a: argparse.Namespace) -> list[dict]:
    full = logits(src.path, ids, a.threads)
    rng = np.random.default_rng(0)
    E, layers = src.cfg.num_experts, src.cfg.moe_layers
    rows = []
    for n in keeps:
        row = {"keep": n}
        for rank in RANKS:
            plan = plan_from_saliency(ranked_by(sal.layers, rank), n)
            row[f"{rank}_kl"] = kl_of_plan(src, plan, work / "p.gguf", ids, full, a.threads)
        random = [kl_of_plan(src, {l: tuple(sorted(rng.choice(E, n, replace=False).tolist())) for l in layers},
                             work / "p.gguf", ids, full, a.threads) for _ in range(a.random if n < E else 0)]
        row.update(random_kl_mean=float(np.mean(random)) if random else 0.0,
                   random_kl_min=float(np.min(random)) if random else 0.0)
        rows.append(row)
        print("  " + ", ".join(f"{k} {v:.4g}" for k, v in row.items()), flush=True)
    return rows


def overlap_by_tag(sal, keeps: list[int], n_expert: int) -> list[dict]:
    prose, code = sal.scores("prose"), sal.scores("code")
    rows = []
    for n in (k for k in keeps if k < n_expert):
        a, b = plan_from_saliency(prose, n), plan_from_saliency(code, n)
        overlap = float(np.mean([len(set(a[l]) & set(b[l])) / n for l in a]))
        rows.append({"keep": n, "prose_code_overlap": overlap, "random_expected": n / n_expert})
    return rows


def prepare(name: str, model_dir: Path | None, work: Path) -> Path:
    """The fixture converted, or (model_dir None) the 64-expert checkpoint generated and converted."""
    gguf = work / f"{name}.gguf"
    if not gguf.exists():
        if model_dir is None:
            model_dir = work / name
            subprocess.run([sys.executable, "-m", "gguf_arch.synth", str(model_dir), *SYNTH_64, "--overwrite"],
                           check=True, cwd=REPO)
        convert(model_dir, gguf, log=lambda _m: None)
    return gguf


def bench_model(name: str, gguf: Path, work: Path, ids: list[int], a: argparse.Namespace) -> dict:
    sal_path = work / f"{name}.saliency.json"
    t = time.perf_counter()
    assert calibrate(["-m", str(gguf), "-f", f"{PROSE}:prose", "-f", f"{CODE}:code", "-o", str(sal_path),
                      "-c", str(CHUNK), "--exact-experts", "-t", str(a.threads), "--overwrite"]) == 0
    calib_s = time.perf_counter() - t
    src = SourceGGUF.open(gguf)
    sal = read_saliency(sal_path, src.cfg.moe_layers, src.cfg.num_experts)
    print(f"{name}: calibrated in {calib_s:.1f} s", flush=True)
    E = src.cfg.num_experts
    keeps = sorted({E, *(max(1, E * f // 8) for f in range(7, 0, -1)), 1}, reverse=True)
    return {"model": name, "experts": E, "experts_used": src.cfg.num_experts_used,
            "calibration_tokens": json.loads(sal_path.read_text())["tokens"], "calibration_s": calib_s,
            "kl_by_keep": kl_by_n(src, sal, work, ids, keeps, a), "overlap_by_tag": overlap_by_tag(sal, keeps, E)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--random", type=int, default=3, help="random plans per N")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "prune.json")
    a = p.parse_args()
    a.workdir.mkdir(parents=True, exist_ok=True)
    results = {"threads": a.threads, "load_average_at_start": list(os.getloadavg()), "chunk": CHUNK,
               "evaluation": "reference.npz input_ids_long (96 tokens), exact path", "kl": "KL(full || pruned), nats",
               "models": []}
    ids = np.load(K31PRO_TINY / "reference.npz")["input_ids_long"].tolist()
    for name, model_dir in (("k31pro-tiny", K31PRO_TINY), ("synth-64-experts", None)):
        gguf = prepare(name, model_dir, a.workdir)
        results["models"].append(bench_model(name, gguf, a.workdir, ids, a))
    a.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
