"""Memory-budget benchmark: s/token and bytes read per token against --mem-budget.

    python bench/memory.py --workdir /tmp/kimi-membench

On one generated K3.1-Pro GGUF (`kimi-k3-synth --preset tiny` with more layers and experts, so
that a layer is a small part of the file), per budget (1/6, 1/3, 1/2 of the GGUF, unlimited), in
a child process: greedy decode of N tokens after a short prompt; s/token of the decode; bytes
read per token from the child's /proc/self/io `read_bytes` (what reached the disk: the streamer
drops the pages it read); the disk's sequential read speed measured in the same run (uncached,
kimi-k3-doctor's read); and ratio_to_disk_bound = s/token / (bytes read per token / read speed).
The tokens of every budget are compared with the unlimited run's. Also a projection for the real
K3.1-Pro from the issue's sizes: with this streamer (whole layers, every expert of a streamed layer
read) and with only the 16 active experts read. Results in bench/results/memory.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import convert_kimi_k3  # noqa: E402
from gguf_arch.synth.cli import main as synth_main  # noqa: E402
from ggml_graph_spec.memory.doctor import read_speed  # noqa: E402

CHILD = """
import sys, time, numpy as np
from ggml_graph_spec.model import Model
def io():
    return int([l for l in open("/proc/self/io") if l.startswith("read_bytes")][0].split()[1])
m = Model.load(sys.argv[1], n_ctx=128, n_threads=1, mem_budget=None if sys.argv[2] == "none" else sys.argv[2])
logits, out = m.eval([1, 5, 9]), []
r0, t0 = io(), time.perf_counter()
for _ in range(int(sys.argv[3])):
    out.append(int(np.argmax(logits[-1])))
    logits = m.eval([out[-1]])
dt, read = time.perf_counter() - t0, io() - r0
print(" ".join(map(str, out)))
print(dt / len(out), read / len(out))
m.close()
"""

# The real K3.1-Pro (issue 14): trunk bytes, experts, and how many a token uses.
REAL = {"trunk_bf16": 108.8e9, "trunk_q8_0": 57.8e9, "n_experts": 82432, "expert_bytes": 17547264,
        "layers": 93, "experts_per_layer": 896, "active_per_layer": 16}


def _model(work: Path) -> Path:
    gguf = work / "m.gguf"
    if not gguf.exists():
        assert synth_main(["--preset", "tiny", "--layers", "26", "--experts", "256", "--overwrite", str(work / "hf")]) == 0
        assert convert_kimi_k3.main([str(work / "hf"), str(gguf), "--quiet"]) == 0
    return gguf


def _run(gguf: Path, budget: str, n: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run(["nice", sys.executable, "-c", CHILD, str(gguf), budget, str(n)], env=env,
                       capture_output=True, text=True, timeout=1800, check=True)
    tokens, stats = r.stdout.strip().splitlines()
    s, read = (float(x) for x in stats.split())
    return {"budget": budget, "tokens": tokens, "s_per_token": s, "bytes_read_per_token": read}


def projection(speed: float) -> list[dict]:
    """Per budget: bytes a token must read (whole layers streamed / only the active experts)."""
    experts = REAL["n_experts"] * REAL["expert_bytes"]
    total, layer = REAL["trunk_q8_0"] + experts, (REAL["trunk_q8_0"] + experts) / REAL["layers"]
    rows = []
    for gb in (8, 32, 64, 128, 256):
        streamed_layers = max(0, REAL["layers"] - int(gb * 1e9 // layer))
        whole = streamed_layers * layer
        active = streamed_layers * REAL["active_per_layer"] * REAL["expert_bytes"]
        rows.append({"budget_gb": gb, "total_bytes": total, "whole_layers_bytes_per_token": whole,
                     "whole_layers_s_per_token": whole / speed, "active_experts_bytes_per_token": active,
                     "active_experts_s_per_token": active / speed})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("-n", type=int, default=8, help="decode tokens per run")
    ap.add_argument("--json", type=Path, default=ROOT / "bench/results/memory.json")
    a = ap.parse_args()
    a.workdir.mkdir(parents=True, exist_ok=True)
    gguf = _model(a.workdir)
    size = gguf.stat().st_size
    speed = read_speed([str(gguf)])
    runs = [_run(gguf, b, a.n) for b in ("none", str(size // 6), str(size // 3), str(size // 2))]
    for r in runs:
        r["identical_tokens"] = r["tokens"] == runs[0]["tokens"]
        bound = r["bytes_read_per_token"] / speed
        r["ratio_to_disk_bound"] = r["s_per_token"] / bound if bound else None
    out = {"gguf_bytes": size, "read_speed_bytes_per_s": speed, "runs": runs, "projection_k31pro_q8_0": projection(speed)}
    a.json.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
