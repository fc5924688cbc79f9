"""Vision benchmark: one image's encode on the ggml graph against the same computation in PyTorch.

    python bench/vision.py [--workdir /tmp/kimi-vision-bench] [--blocks 4] [--repeats 3]

A generated tower with MoonViT's real widths (K3's vision_config: patch 14, width 1024, q/k/v
1536 in 12 heads of 128, MLP 4096, a 64x64 position table, 2x2 merge, projector to 7168) but
--blocks encoder blocks instead of 27, seeded random BF16 weights, is converted to an mmproj by
this project's converter. An image of 448x448 and one of 896x896 (32x32 and 64x64 patches; 256
and 1024 rows) are preprocessed once; then, in one process with the same number of threads,
taking turns run by run (a busy machine slows all alike), the best of --repeats runs of:

  exact    our graph, F32 everywhere (`VisionEncoder(exact=True)`, what the tests hold to the reference)
  fast     our graph, the weights as stored (BF16 matmuls, ggml's table GELU)
  torch    bench/moonvit_torch.py: the same math in PyTorch, float32 (the weights upcast), its
           attention through scaled_dot_product_attention

The time is the encode's alone (graph build and compute; torch's forward), from the processor's
patches to the rows, measured two ways: wall time with --threads threads (both libraries), and
the CPU time of a one-thread run (both compute in the calling thread then, so a machine shared
with other jobs slows it far less). The results record the distance of each of ours from torch's
rows (the exact path's must be float32 noise: the two compute the same function) and the speed of
each as torch's time over ours (1.0: as fast as PyTorch).

Then (`--parts ttft`) the encode's share of a multimodal prompt's time to first token: a text
model of the real widths, bench/graph.py's (`kimi-k3-synth --preset large --experts 8`: hidden
7168, 4 layers: dense, 2 KDA + MoE, MLA + DSA + MoE), converted here, and the tower above paired
with it; the prompt `[BOS]<__media__>Describe the picture in one line.` with each image, through
`generate_media` (the library call kimi-k3-cli makes) on the fast path, as a user runs it, until
its first token: the image read and preprocessed, encoded, the merged prompt prefilled (runs of
ids and rows), the first token sampled. Wall time at --threads, the best of --repeats; the parts
from the generation's timings.

Results: bench/results/vision.json; the tables of docs/bench/vision.md are printed at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from contextlib import ExitStack
from datetime import date
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import convert_kimi_k3  # noqa: E402
from bench.graph import cpu_features  # noqa: E402
from bench.moonvit_torch import MoonViT  # noqa: E402
from ggml_graph_spec.engine.model import Model  # noqa: E402
from ggml_graph_spec.generation.events import StopRules, Timings  # noqa: E402
from ggml_graph_spec.generation.media import generate_media  # noqa: E402
from ggml_graph_spec.generation.sampling import Sampler, SamplingParams  # noqa: E402
from ggml_graph_spec.vision.encode import VisionEncoder  # noqa: E402

RESULTS = REPO / "bench" / "results" / "vision.json"
SIZES = (448, 896)
TEXT_SYNTH = ["--preset", "large", "--experts", "8"]  # bench/graph.py's model
PROMPT = "[BOS]<__media__>Describe the picture in one line."
# K3's vision_config (tests/fixtures/reference/kimi-k3-config.json) but the depth.
VISION = {"_attn_implementation": "flash_attention_2", "activation_func": "gelu_pytorch_tanh", "attn_bias": False,
          "init_pos_emb_height": 64, "init_pos_emb_time": 4, "init_pos_emb_width": 64, "linear_bias": False,
          "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool", "mlp_type": "mlp2", "mm_hidden_size": 1024,
          "mm_projector_type": "patchmergerv2", "norm_type": "rmsnorm", "patch_embed_proj_bias": False,
          "patch_size": 14, "pos_emb_interpolation_mode": "bilinear", "pos_emb_type": "divided_fixed",
          "projector_hidden_act": "gelu", "projector_ln_eps": 1e-05, "qkv_hidden_size": 1536,
          "text_hidden_size": 7168, "vt_hidden_size": 1024, "vt_intermediate_size": 4096,
          "vt_num_attention_heads": 12}


def _weights(vision: dict, seed: int) -> dict[str, torch.Tensor]:
    """Seeded random BF16 weights: projections N(0, 1/fan_in), norm gains 1 + 0.1 N, the table N(0, 0.1)."""
    g = torch.Generator().manual_seed(seed)
    c, q, inner, p = (vision[k] for k in ("vt_hidden_size", "qkv_hidden_size", "vt_intermediate_size", "patch_size"))
    m, d = 4 * c, vision["text_hidden_size"]

    def proj(*shape):
        fan_in = int(np.prod(shape[1:]))
        return (torch.randn(*shape, generator=g) / fan_in ** 0.5).bfloat16()

    def gain(n):
        return (1 + 0.1 * torch.randn(n, generator=g)).bfloat16()
    w = {"vision_tower.patch_embed.proj.weight": proj(c, 3, p, p),
         "vision_tower.patch_embed.pos_emb.weight": (0.1 * torch.randn(64, 64, c, generator=g)).bfloat16(),
         "vision_tower.encoder.final_layernorm.weight": gain(c), "mm_projector.proj.0.weight": proj(m, m),
         "mm_projector.proj.2.weight": proj(d, m), "mm_projector.post_norm.weight": gain(d)}
    for i in range(vision["vt_num_hidden_layers"]):
        pre = f"vision_tower.encoder.blocks.{i}."
        w.update({pre + "wqkv.weight": proj(3 * q, c), pre + "wo.weight": proj(c, q), pre + "norm0.weight": gain(c),
                  pre + "norm1.weight": gain(c), pre + "mlp.fc0.weight": proj(inner, c),
                  pre + "mlp.fc1.weight": proj(c, inner)})
    return w


def make_tower(workdir: Path, blocks: int, seed: int, placeholder: int = 163605) -> tuple[Path, dict]:
    """A checkpoint directory holding only the tower (what --mmproj-only reads), and its mmproj;
    placeholder: the text model's <|media_pad|> id (K3's by default)."""
    model = workdir / "tower"
    model.mkdir(parents=True, exist_ok=True)
    vision = {**VISION, "vt_num_hidden_layers": blocks}
    shard = "model-00001-of-000001.safetensors"
    weights = _weights(vision, seed)
    save_file(weights, str(model / shard), metadata={"format": "pt"})
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {n: shard for n in weights}}))
    config = {"architectures": ["KimiK3ForConditionalGeneration"], "media_placeholder_token_id": placeholder,
              "text_config": {"hidden_size": vision["text_hidden_size"]}, "vision_config": vision}
    (model / "config.json").write_text(json.dumps(config))
    mmproj = workdir / "tower-mmproj.gguf"
    assert convert_kimi_k3.main([str(model), "--mmproj", str(mmproj), "--mmproj-only", "--overwrite", "--quiet"]) == 0
    return mmproj, vision


def _image(size: int, seed: int) -> Image.Image:
    """A smooth picture with some noise (as a photo is), size x size."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size] / size
    base = np.stack([np.sin(6 * x + 3 * y), np.cos(5 * y - 2 * x), np.sin(9 * x * y)], axis=-1)
    return Image.fromarray(np.clip(127 + 100 * base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8))


def _timed(f, cpu: bool) -> tuple[float, object]:
    """(seconds, result): wall time, or with cpu the calling thread's CPU time (a 1-thread run
    computes in the calling thread, so other processes' load does not count)."""
    clock = time.thread_time if cpu else time.perf_counter
    start = clock()
    out = f()
    return clock() - start, out


def _one_round(item, pixels, encoders: dict, baseline: MoonViT, cpu: bool, runs: dict, rows: dict) -> None:
    for name, enc in encoders.items():
        seconds, rows[name] = _timed(lambda: enc.encode(item), cpu)
        runs[name].append(seconds)
    seconds, out = _timed(lambda: baseline(pixels, item.grid), cpu)
    runs["torch"].append(seconds)
    rows["torch"] = out.numpy()


def bench_size(size: int, encoders: dict[str, dict[int, VisionEncoder]], baseline: MoonViT, threads: int,
               repeats: int) -> dict:
    """Wall time at `threads` threads and CPU time at one, each the best of `repeats` runs taken in turns."""
    item = encoders["exact"][1].media(_image(size, size))
    pixels = torch.from_numpy(item.pixel_values)
    names = (*encoders, "torch")
    wall, cpu = {k: [] for k in names}, {k: [] for k in names}
    rows: dict[str, np.ndarray] = {}
    for _ in range(repeats):  # taking turns: a busy period slows all of them alike
        torch.set_num_threads(threads)
        _one_round(item, pixels, {k: e[threads] for k, e in encoders.items()}, baseline, False, wall, rows)
        torch.set_num_threads(1)
        _one_round(item, pixels, {k: e[1] for k, e in encoders.items()}, baseline, True, cpu, rows)
    best = {"wall": {k: min(v) for k, v in wall.items()}, "cpu_1_thread": {k: min(v) for k, v in cpu.items()}}
    ref = rows["torch"]
    return {"size": size, "patches": int(item.pixel_values.shape[0]), "rows": int(ref.shape[0]),
            "runs_s": {"wall": wall, "cpu_1_thread": cpu}, "best_s": best,
            "speed_vs_torch": {m: {k: b["torch"] / b[k] for k in encoders} for m, b in best.items()},
            "max_rel_diff_vs_torch": {k: float(np.abs(rows[k] - ref).max() / np.abs(ref).max()) for k in encoders}}


def machine(threads: int) -> dict:
    return {"cpu": platform.machine(), "cpus": os.cpu_count(), "threads": threads, "cpu_features": cpu_features(),
            "torch": torch.__version__, "load_average": os.getloadavg(), "date": date.today().isoformat()}


def table(results: dict) -> list[str]:
    threads = results["machine"]["threads"]
    lines = ["| image | patches -> rows | clock | exact (s) | fast (s) | PyTorch f32 (s) | exact vs PyTorch | "
             "fast vs PyTorch |", "|---|---|---|---|---|---|---|---|"]
    for r in results["sizes"]:
        for clock, label in (("wall", f"wall, {threads} threads"), ("cpu_1_thread", "CPU, 1 thread")):
            b, s = r["best_s"][clock], r["speed_vs_torch"][clock]
            lines.append(f"| {r['size']}x{r['size']} | {r['patches']} -> {r['rows']} | {label} | {b['exact']:.2f} | "
                         f"{b['fast']:.2f} | {b['torch']:.2f} | {s['exact']:.2f}x | {s['fast']:.2f}x |")
    return lines


def make_text_model(workdir: Path) -> tuple[Path, int]:
    """bench/graph.py's synthetic K3.1-Pro converted (reused when there), and its <|media_pad|> id."""
    ckpt, gguf = workdir / "k31pro-large", workdir / "k31pro-large.gguf"
    if not (ckpt / "config.json").exists():
        subprocess.run([str(Path(sys.executable).parent / "kimi-k3-synth"), str(ckpt), *TEXT_SYNTH, "--overwrite"],
                       check=True)
    if not gguf.exists():
        assert convert_kimi_k3.main([str(ckpt), str(gguf), "--quiet"]) == 0
    return gguf, json.loads((ckpt / "config.json").read_text())["media_placeholder_token_id"]


def _first_token(model: Model, enc: VisionEncoder, image: Image.Image) -> dict:
    """One prompt with `image` until its first token: wall seconds, and the generation's parts."""
    model.reset()
    timings = Timings()
    start = time.perf_counter()
    gen = generate_media(model, enc, PROMPT, [image], Sampler(SamplingParams(temp=0)),
                         StopRules(frozenset(), n_predict=1), timings=timings)
    next(iter(gen))
    ttft = time.perf_counter() - start
    return {"ttft_s": ttft, "encode_s": timings.encode_s, "prefill_s": timings.prompt_s,
            "prompt_positions": timings.prompt_tokens, "rest_s": ttft - timings.encode_s - timings.prompt_s}


def bench_ttft(text_gguf: Path, mmproj: Path, threads: int, repeats: int) -> list[dict]:
    """Per image size, the best of `repeats` first tokens (by TTFT), on the fast path."""
    model = Model.load(text_gguf, n_ctx=4096, n_threads=threads)
    out = []
    try:
        with VisionEncoder.open(mmproj, exact=False, threads=threads) as enc:
            model.eval([model.tokenizer.bos_id])  # pages the weights in, as the runner's warm-up
            for size in SIZES:
                runs = [_first_token(model, enc, _image(size, size)) for _ in range(repeats)]
                best = min(runs, key=lambda r: r["ttft_s"])
                out.append({"size": size, "runs": runs, "best": best, "encode_share": best["encode_s"] / best["ttft_s"]})
                print(json.dumps(out[-1]["best"]), flush=True)
    finally:
        model.close()
    return out


def ttft_table(results: dict) -> list[str]:
    lines = ["| image | prompt positions | time to first token (s) | encode (s) | prefill (s) | other (s) | "
             "encode's share |", "|---|---|---|---|---|---|---|"]
    for r in results["ttft"]:
        b = r["best"]
        lines.append(f"| {r['size']}x{r['size']} | {b['prompt_positions']} | {b['ttft_s']:.2f} | {b['encode_s']:.2f} | "
                     f"{b['prefill_s']:.2f} | {b['rest_s']:.2f} | {100 * r['encode_share']:.0f}% |")
    return lines


def _encode_part(a: argparse.Namespace, mmproj: Path, vision: dict) -> dict:
    weights = {k: v.float() for k, v in load_file(str(a.workdir / "tower" / "model-00001-of-000001.safetensors")).items()}
    baseline = MoonViT(weights, vision, vision["projector_ln_eps"])
    results = {"machine": machine(a.threads), "tower": {"blocks": a.blocks, "vision_config": vision}, "sizes": []}
    with ExitStack() as stack:
        encoders = {name: {n: stack.enter_context(VisionEncoder.open(mmproj, exact=name == "exact", threads=n))
                           for n in {1, a.threads}} for name in ("exact", "fast")}
        for size in SIZES:
            results["sizes"].append(bench_size(size, encoders, baseline, a.threads, a.repeats))
            print(json.dumps(results["sizes"][-1]["best_s"]), flush=True)
    results["machine"]["load_average_at_end"] = os.getloadavg()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/kimi-vision-bench"))
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--parts", default="encode,ttft",
                    help="encode (against PyTorch), ttft (the share of the time to first token), or both; a part "
                         "not run keeps its results from the JSON")
    a = ap.parse_args()
    parts = set(a.parts.split(","))
    torch.set_num_threads(a.threads)
    text_gguf, placeholder = make_text_model(a.workdir) if "ttft" in parts else (None, 163605)
    mmproj, vision = make_tower(a.workdir, a.blocks, a.seed, placeholder)
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    if "encode" in parts:
        results.update(_encode_part(a, mmproj, vision))
    if "ttft" in parts:
        results["ttft_machine"] = {**machine(a.threads), "text_model": TEXT_SYNTH, "prompt": PROMPT}
        results["ttft"] = bench_ttft(text_gguf, mmproj, a.threads, a.repeats)
        results["ttft_machine"]["load_average_at_end"] = os.getloadavg()
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    print("\n".join(table(results) + [""] + (ttft_table(results) if "ttft" in results else [])))


if __name__ == "__main__":
    main()
