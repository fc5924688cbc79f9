"""Expert tiers: the MXFP4 routed experts requantized by llama.cpp's llama-quantize (through
kimi-k3-quantize), what each type costs in size and in fidelity, and what it would make of the
real K3.1-Pro.

    python bench/tiers.py [--workdir /tmp/kimi-tiers]

Needs llama.cpp's tools (KIMI_K3_LLAMA_BIN, exported by scripts/setup_env.sh).

The model (`kimi-k3-synth` with TIER_MODEL's sizes, seeded random weights) is a K3 with rows of
256 in every expert matrix, so the 256-wide K-quant and i-quant blocks fit; its experts are 66%
of the GGUF. It is converted as released (MXFP4 experts, BF16 trunk). The importance matrix is
llama-imatrix's on the first half of tests/fixtures/text/lighthouse.txt; the second half is the
evaluation text, EVAL_CHUNKS chunks of EVAL_CTX tokens, each evaluated from an empty cache.

Every tier keeps the trunk and the protected tensors as converted and gives the routed experts
one type. Fidelity is measured on our exact path (Model.load(..., exact_experts=True): each
selected expert dequantized to F32, F32 activations and caches), so it shows what the weights
lost and nothing else, against the same path on the MXFP4 original: mean KL(P_mxfp4 || P_tier)
of the next-token distributions over all evaluated positions, and how often the top-1 tokens
agree. A requantized MXFP4 weight is quantized twice (E2M1 x 2^e, then the tier's grid), so
the cost is measured here, not taken from llama.cpp's tables for 16-bit sources.

Projection to the real K3.1-Pro: 82,432 routed experts (92 MoE layers x 896, docs/reference/mxfp4.md),
each 3 x 3584 x 3072 = 33,030,144 weights (17,547,264 bytes in MXFP4, 4.25 bits per weight),
at the tier's bits per weight (exact: both row lengths are multiples of 256), plus the trunk
as converted (108.8 GB in BF16), which every tier keeps.

Results: bench/results/tiers.json; the table of docs/bench/tiers.md is printed at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf import GGUFReader  # noqa: E402
from gguf.constants import GGML_QUANT_SIZES  # noqa: E402

import convert_kimi_k3  # noqa: E402
import kimi_k3_quantize  # noqa: E402
from ggml_graph_spec.engine.model import Model  # noqa: E402
from ggml_graph_spec.text.tokenizer import BPETokenizer  # noqa: E402
from gguf_arch.synth import cli as synth  # noqa: E402
from quant_rules import llama_quantize  # noqa: E402
from quant_rules.llama_types import LLAMA_QUANTIZE_TYPES, NEEDS_IMATRIX  # noqa: E402
from quant_rules.rules import load_protected_set  # noqa: E402
from tests.support.paths import TEXT  # noqa: E402  (the prose fixture)

RESULTS = REPO / "bench" / "results" / "tiers.json"
TIER_MODEL = ["--variant", "k3", "--layers", "4", "--experts", "8", "--experts-per-token", "2",
              "--latent", "256", "--moe-intermediate", "256", "--seed", "0"]
# Every type kimi-k3-quantize offers, without and with the importance matrix (the very-low-bit
# i-quants only with one: llama-quantize refuses them without).
TIERS: tuple[tuple[Q, bool], ...] = tuple(
    (t, im) for t in LLAMA_QUANTIZE_TYPES for im in (False, True) if im or t not in NEEDS_IMATRIX)
EVAL_CHUNKS, EVAL_CTX = 7, 128
IMATRIX_CTX = 128
THREADS = 2

K31PRO_EXPERTS = 82_432
K31PRO_EXPERT_WEIGHTS = 3 * 3584 * 3072
K31PRO_EXPERT_MXFP4_BYTES = 17_547_264
K31PRO_TRUNK_BYTES = 108.8e9


def calibration_and_evaluation() -> tuple[str, str]:
    """The text's paragraphs split in two halves: the imatrix's and the evaluation's."""
    paragraphs = TEXT.read_text(encoding="utf-8").strip().split("\n\n")
    half = len(paragraphs) // 2
    return "\n\n".join(paragraphs[:half]) + "\n", "\n\n".join(paragraphs[half:]) + "\n"


def make_model(workdir: Path) -> Path:
    """The tier model, converted as released (MXFP4 experts)."""
    ckpt, gguf = workdir / "tier-model", workdir / "tier-mxfp4.gguf"
    assert synth.main([str(ckpt), *TIER_MODEL, "--overwrite"]) == 0
    assert convert_kimi_k3.main([str(ckpt), str(gguf), "--quiet", "--overwrite"]) == 0
    return gguf


def tool(name: str) -> Path:
    return llama_quantize.find_tool(name)


def make_imatrix(gguf: Path, workdir: Path, chunks: int = -1) -> Path:
    """llama-imatrix over the calibration half of the text (at most `chunks` chunks; -1: all)."""
    calib, out = workdir / "calibration.txt", workdir / "tier-imatrix.gguf"
    calib.write_text(calibration_and_evaluation()[0], encoding="utf-8")
    cmd = [str(tool("llama-imatrix")), "-m", str(gguf), "-f", str(calib), "-o", str(out), "-c", str(IMATRIX_CTX),
           "-b", str(IMATRIX_CTX), "-t", str(THREADS), "--no-ppl", "--chunks", str(chunks)]
    r = subprocess.run(cmd, capture_output=True, text=True, errors="replace", stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        raise RuntimeError(f"llama-imatrix failed ({r.returncode}): {r.stderr[-2000:]}")
    return out


def tier_name(t: Q, imatrix: bool) -> str:
    return f"{t.name.lower()}{'+imatrix' if imatrix else ''}"


def make_tier(gguf: Path, t: Q, imatrix: Path | None, workdir: Path) -> Path:
    out = workdir / f"tier-{tier_name(t, imatrix is not None)}.gguf"
    argv = [str(gguf), str(out), t.name.lower(), "--overwrite", "-t", str(THREADS)]
    rc = kimi_k3_quantize.main(argv + (["--imatrix", str(imatrix)] if imatrix is not None else []))
    if rc != 0:
        raise RuntimeError(f"kimi-k3-quantize {' '.join(argv)} exited with {rc}")
    return out


def tensor_bytes(gguf: Path) -> int:
    """The tensor data of a GGUF: its layout, without the metadata (which names the imatrix file)."""
    return sum(int(t.n_bytes) for t in GGUFReader(gguf).tensors)


def expert_bits(gguf: Path) -> float:
    """Bits per weight of the routed experts as stored in the file."""
    experts = next(r for r in load_protected_set().rules if r.experts)
    ts = [t for t in GGUFReader(gguf).tensors if experts.matches(t.name)]
    return 8 * sum(int(t.n_bytes) for t in ts) / sum(int(t.n_elements) for t in ts)


def eval_chunks(gguf: Path) -> list[list[int]]:
    tokens = BPETokenizer.from_gguf(gguf).encode(calibration_and_evaluation()[1])
    assert len(tokens) >= EVAL_CHUNKS * EVAL_CTX, len(tokens)
    return [tokens[i * EVAL_CTX:(i + 1) * EVAL_CTX] for i in range(EVAL_CHUNKS)]


def log_probs(gguf: Path, chunks: list[list[int]], exact: bool = True) -> np.ndarray:
    """log softmax of our exact (or fast) path's logits at every evaluated position [positions, vocab]."""
    m = Model.load(gguf, n_ctx=EVAL_CTX, exact_experts=exact, n_threads=THREADS)
    try:
        out = []
        for chunk in chunks:
            m.reset()
            z = m.eval(chunk).astype(np.float64)
            z -= z.max(axis=1, keepdims=True)
            out.append(z - np.log(np.exp(z).sum(axis=1, keepdims=True)))
        return np.concatenate(out)
    finally:
        m.close()


@dataclass
class Fidelity:
    kl_mean: float
    kl_p99: float
    top1: float


def fidelity(ref: np.ndarray, got: np.ndarray) -> Fidelity:
    kl = (np.exp(ref) * (ref - got)).sum(axis=1)
    return Fidelity(float(kl.mean()), float(np.quantile(kl, 0.99)), float((ref.argmax(1) == got.argmax(1)).mean()))


def type_bits(t: Q) -> float:
    block, size = GGML_QUANT_SIZES[t]
    return 8 * size / block


def k31pro_bytes(t: Q) -> float:
    """The real K3.1-Pro with its routed experts at type t and the trunk as converted."""
    return K31PRO_TRUNK_BYTES + K31PRO_EXPERTS * K31PRO_EXPERT_WEIGHTS * type_bits(t) / 8


def measure(workdir: Path) -> dict:
    original = make_model(workdir)
    imatrix = make_imatrix(original, workdir)
    chunks = eval_chunks(original)
    ref = log_probs(original, chunks)
    # What the runtime's own rounding costs, for scale: the fast path (8-bit activations for the
    # experts, BF16 for the matrices, F16 cache) on the original against its exact path.
    fast = fidelity(ref, log_probs(original, chunks, exact=False))
    rows = [_row("mxfp4 (as converted)", Q.MXFP4, False, original, fidelity(ref, ref))]
    for t, with_im in TIERS:
        t0 = time.perf_counter()
        gguf = make_tier(original, t, imatrix if with_im else None, workdir)
        quantize_s = time.perf_counter() - t0
        rows.append(_row(tier_name(t, with_im), t, with_im, gguf, fidelity(ref, log_probs(gguf, chunks)), quantize_s))
        print(json.dumps(rows[-1]), flush=True)
    return {"positions": len(ref), "fast_path_on_original": vars(fast), "rows": rows}


def _row(name: str, t: Q, with_im: bool, gguf: Path, f: Fidelity, quantize_s: float | None = None) -> dict:
    assert abs(expert_bits(gguf) - type_bits(t)) < 1e-9  # every expert tensor is at the tier's type
    return {"tier": name, "type": t.name.lower(), "imatrix": with_im, "file_bytes": gguf.stat().st_size,
            "tensor_bytes": tensor_bytes(gguf),
            "expert_bits_per_weight": type_bits(t), "kl_mean": f.kl_mean, "kl_p99": f.kl_p99, "top1_agreement": f.top1,
            "quantize_s": quantize_s, "k31pro_projected_bytes": k31pro_bytes(t)}


def table(result: dict) -> list[str]:
    lines = ["| tier | experts bits/weight | GGUF here | mean KL vs MXFP4 | p99 KL | top-1 agreement | "
             "K3.1-Pro projected |", "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['tier']} | {r['expert_bits_per_weight']:.4g} | {r['file_bytes'] / 1e6:.2f} MB | "
                     f"{r['kl_mean']:.2e} | {r['kl_p99']:.2e} | {100 * r['top1_agreement']:.1f}% | "
                     f"{r['k31pro_projected_bytes'] / 1e12:.3f} TB |")
    f = result["fast_path_on_original"]
    lines.append(f"\nOur fast path on the MXFP4 original, against its exact path: mean KL {f['kl_mean']:.2e}, "
                 f"p99 {f['kl_p99']:.2e}, top-1 agreement {100 * f['top1']:.1f}%.")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, default=Path("/tmp/kimi-tiers"))
    a = p.parse_args()
    a.workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    result = measure(a.workdir)
    doc = {"command": "python bench/tiers.py", "model": {"synth": TIER_MODEL, "eval_chunks": EVAL_CHUNKS,
           "eval_ctx": EVAL_CTX, "imatrix_ctx": IMATRIX_CTX, "text": str(TEXT.relative_to(REPO))},
           "k31pro": {"experts": K31PRO_EXPERTS, "expert_weights": K31PRO_EXPERT_WEIGHTS,
                      "expert_mxfp4_bytes": K31PRO_EXPERT_MXFP4_BYTES, "trunk_bytes": K31PRO_TRUNK_BYTES},
           "load_average": os.getloadavg(), "wall_s": round(time.perf_counter() - t0, 1), **result}
    RESULTS.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    print("\n".join(table(result)))


if __name__ == "__main__":
    main()
