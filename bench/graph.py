"""Graph benchmark: our ggml graph against llama.cpp on the same GGUF, and the DSA paths by context.

    python bench/graph.py --workdir /tmp/kimi-graph-bench

One synthetic K3.1-Pro checkpoint with the real model's widths and layer kinds (`kimi-k3-synth
--preset large --experts 8`: hidden 7168, dense layer 0, KDA+MoE layers 1-2, MLA+DSA+MoE layer
3, 8 MXFP4 experts, about 6.1 GB) is converted twice by this project's converter: as is (DSA
indexer kept) and with `--no-dsa`, which llama.cpp can load. Then, each in a process of its own
(ggml-python and llama-cpp-python cannot share one, tests/interop/llama_worker.py says why):

  speed    on the --no-dsa GGUF, same thread count: prompt processing (one batch of --prompt
           tokens from an empty cache) and decode (--gen tokens one at a time after it), tokens/s,
           for our fast path as it loads by default (as llama.cpp's, the routed experts copied
           into ggml's CPU_REPACK layout when the GGUF fits in memory, which it does here), our
           fast path with every weight mapped from the file (`repack=False`, `-nr`) and llama.cpp
           (llama-cpp-python with its defaults: flash attention on, F16 cache, repacked
           experts), each process's peak RSS (ru_maxrss). Every process first evaluates one
           token, which pages the mapped weights in; the best of --repeats runs counts. Ours
           records whether its ggml has llamafile's sgemm (scripts/setup_env.sh builds it so).
  contexts on the DSA GGUF: decode time of one token (whole model, fast and exact path) at
           each context length N of --contexts, for dense MLA (dsa off), the masked DSA path and
           the gathered one, with top_k = N / 8; and the time of the attention kernel alone per
           decoded token (given the selection: masked = flash attention, or softmax on the exact
           path, over all N keys with the DSA mask; gather = top-k of the mask, get_rows of those
           rows, attention over them), for both kernels (fast: F16 cache + flash attention;
           exact: F32 cache + mul_mat/softmax). The caches are filled with random rows rather
           than by a prefill of N tokens (which would take hours on 2 cores): the cost of a decode
           step does not depend on what the rows hold. The attention kernel is also timed at
           --kernel-contexts (default 32k-128k: synthetic inputs, seconds each), and only its
           graph compute counts (allocated and given its inputs first: in the model the cache
           is already there). Timings are the minimum of --sweep-repeats runs (decode) or 7 runs
           (attention kernel) (the machine may be shared; the JSON records the load average).
           The models, and the paths' kernels, take turns run by run, so that a busy period
           slows all of them alike.
  ops      on the DSA GGUF, fast path, one thread: the CPU time of each op of one decode step,
           masked against gather, at each context (bench/op_profile.py: thread CPU time, node by
           node, which a shared machine's load does not inflate), printed as the ops where the
           two paths differ most; and the same for the fast attention kernel alone at every
           kernel context (where the gathered kernel's time goes: matmuls, get_rows, copies).

The JSON records the CPU's features (/proc/cpuinfo flags such as avx512_bf16, avx512f, avx2):
ggml picks its kernels by them, so results from two CPUs are two different benchmarks.

Results: bench/results/graph.json and bench/results/graph.png (written when matplotlib, of the
project's bench extra, is installed; decode time per token and the
attention kernel's time per token, fast and exact, against the context length); the crossover
contexts (the first measured N from which on the gathered path is faster than the masked one, for
each of the four timings) are printed.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Callable, Iterator

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script or imported as bench.graph: bench.plotting either way
from bench.plotting import pyplot  # noqa: E402
RESULTS = REPO / "bench" / "results"
SYNTH = ["--preset", "large", "--experts", "8"]
TOP_K_FRACTION = 8  # top_k = context / 8 in the context sweep
PATHS = ("dense", "masked", "gather")
ATTENTION_REPEATS = 7
TIMINGS = ("decode_s", "decode_exact_s")
KERNEL_TIMINGS = ("attention_fast_s", "attention_exact_s")


# ---- checkpoint and GGUFs ---------------------------------------------------------------------

def prepare(workdir: Path) -> tuple[Path, Path]:
    """The synthetic checkpoint and its two GGUFs (reused when already there)."""
    ckpt, dsa, no_dsa = workdir / "k31pro-large", workdir / "k31pro.gguf", workdir / "k31pro-no-dsa.gguf"
    bin_dir = Path(sys.executable).parent
    if not (ckpt / "config.json").exists():
        subprocess.run([str(bin_dir / "kimi-k3-synth"), str(ckpt), *SYNTH, "--overwrite"], check=True)
    for out, flags in ((dsa, []), (no_dsa, ["--no-dsa"])):
        if not out.exists():
            subprocess.run([sys.executable, str(REPO / "convert_kimi_k3.py"), str(ckpt), str(out), "--quiet", *flags],
                           check=True)
    return dsa, no_dsa


# ---- children ---------------------------------------------------------------------------------

def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _time(f) -> float:
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def _speed(load, eval_tokens, reset, a: argparse.Namespace) -> dict:
    """Shared by both runtimes: warm-up, then the best of `repeats` prompt and decode runs."""
    llm = load()
    prompt = [(7 * i) % 900 + 1 for i in range(a.prompt)]
    eval_tokens(llm, prompt[:1])  # pages the weights in; thread pools and allocators start
    pp, tg = [], []
    for _ in range(a.repeats):
        reset(llm)
        pp.append(_time(lambda: eval_tokens(llm, prompt)))
        tg.append(_time(lambda: [eval_tokens(llm, [prompt[i % a.prompt]]) for i in range(a.gen)]))
    return {"prompt_tokens": a.prompt, "gen_tokens": a.gen, "pp_tok_s": a.prompt / min(pp),
            "tg_tok_s": a.gen / min(tg), "pp_s": pp, "tg_s": tg, "peak_rss_mib": _peak_rss_mib()}


def child_ours(a: argparse.Namespace) -> dict:
    import ggml

    from ggml_graph_spec.engine.model import Model
    repack = False if a.child == "ours-mapped" else None  # None: the default (repack.choose_repack)
    loaded = []

    def load():
        loaded.append(Model.load(a.gguf, n_ctx=a.prompt + a.gen + 1, n_threads=a.threads, dsa=False, repack=repack))
        return loaded[-1]

    r = _speed(load, lambda m, ids: m.eval(ids), lambda m: m.reset(), a)
    r["llamafile_sgemm"] = bool(ggml.ggml_cpu_has_llamafile())
    r["repacked_tensors"] = len(loaded[0].weights.repacked)
    r["repack_why"] = loaded[0].weights.repack_why
    return r


def child_llama(a: argparse.Namespace) -> dict:
    import llama_cpp
    n_ctx = a.prompt + a.gen + 1
    load = lambda: llama_cpp.Llama(model_path=str(a.gguf), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,  # noqa: E731
                                   n_threads=a.threads, n_threads_batch=a.threads, flash_attn=True, verbose=False)
    r = _speed(load, lambda llm, ids: llm.eval(ids), lambda llm: llm.reset(), a)
    r["llama_cpp"] = llama_cpp.__version__
    return r


def fill_caches(m, n: int, rng) -> None:
    """Random rows 0..n-1 in every latent and indexer key cache; the sequence is n tokens long."""
    import ggml
    import numpy as np
    for layer in m.cfg.mla_layers:
        tensors = [m.cache.mla_latent(layer)] + ([m.cache.indexer_keys(layer)] if m.cache.has_indexer(layer) else [])
        for t in tensors:
            dtype = np.float16 if t.contents.type == ggml.GGML_TYPE_F16 else np.float32
            rows = rng.standard_normal((n, t.contents.ne[0])).astype(dtype)
            ggml.ggml_backend_tensor_set(t, rows.ctypes.data, 0, rows.nbytes)
    m.cache.n_past = n


def _attention_graph(g, n: int, top_k: int | None, path: str, rng):
    """The attention kernel of one decode step over n cached keys, given the selection: dense
    (causal mask), masked (flash attention / softmax over all n keys with the DSA mask) or
    gather (top-k of the mask, get_rows of those rows, attention over them). The cache, the
    absorbed query and the DSA mask (top_k random visible keys) are random graph inputs."""
    import numpy as np

    from ggml_graph_spec.blocks import mla
    from ggml_graph_spec.graph.build import F16, F32
    cfg = g.cfg
    d, h = cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.num_heads
    kv = g.input("kv", F32 if g.exact else F16, (d, n), rng.standard_normal((n, d), dtype=np.float32))
    q = g.input("q", F32, (d, 1, h), rng.standard_normal((h, 1, d), dtype=np.float32))
    mask = g.kq_mask
    if top_k is not None:
        sel = np.full((1, n), -np.inf, dtype=np.float32)
        sel[0, rng.choice(n, top_k, replace=False)] = 0.0
        mask = g.input("dsa_mask", F32, (n, 1), sel)
    scale = cfg.qk_head_dim ** -0.5
    if path == "gather" and top_k is not None:
        return mla.attend_gathered(g, q, kv, mask, top_k, scale)
    return (mla.attend_exact if g.exact else mla.attend_flash)(g, q, kv, mask, scale)


@contextmanager
def attention_kernel(m, n: int, top_k: int | None, path: str, exact: bool, rng) -> Iterator[Callable[[], None]]:
    """A function that computes the attention kernel graph once more: allocated and given its
    inputs on entry, so that each call times the kernel's own work only, as in the model,
    where the cache is already in memory (uploading it would cost more than the gathered
    kernel itself)."""
    from functools import partial

    from ggml_graph_spec.graph.build import GraphBuild
    m.cache.n_past = n - 1
    make = partial(GraphBuild, cfg=m.cfg, cache=m.cache, n_tokens=1, exact=exact, top_k=top_k,
                   dsa_path="masked" if path == "dense" else path)
    with m.executor.graph(1024, make) as g:
        out = _attention_graph(g, n, top_k, path, rng)
        m.executor.compute(g, [out])
        yield lambda: m.executor._run(g)


def _decode_times(models: dict, n: int, top_k: int, a: argparse.Namespace, rng) -> dict:
    """The fastest of `sweep_repeats` whole-model decode steps at context n for every (path, exact)
    model, the models taking turns run by run: a busy period of a shared machine then slows
    every path alike instead of whichever one it happened to fall on."""
    for (path, _), m in models.items():
        if path != "dense":
            m.top_k = top_k
        fill_caches(m, n, rng)
    runs: dict = {key: [] for key in models}
    for _ in range(a.sweep_repeats):
        for key, m in models.items():
            m.cache.n_past = n
            runs[key].append(_time(lambda: m.eval([1])))
    return {key: min(v) for key, v in runs.items()}


def _attention_times(models: dict, n: int, k: int, exact: bool, rng) -> dict:
    """The fastest of ATTENTION_REPEATS runs of each path's attention kernel at context n, the
    paths taking turns run by run (each on its own model's allocator, so that the three graphs
    stay allocated together), as the decode sweep does against a busy machine."""
    with ExitStack() as stack:
        runs = {p: stack.enter_context(attention_kernel(models[p], n, None if p == "dense" else k, p, exact, rng))
                for p in PATHS}
        times: dict = {p: [] for p in PATHS}
        for _ in range(ATTENTION_REPEATS):
            for p, run in runs.items():
                times[p].append(_time(run))
    return {p: min(v) for p, v in times.items()}


def kernel_times(models: dict, contexts: list[int]) -> dict:
    """The attention kernel alone at each context (top_k = N / 8) for every path (models: path ->
    a Model of the DSA GGUF), both kernels: synthetic inputs, no whole-model step, so it reaches
    contexts a decode sweep cannot."""
    import numpy as np
    rng = np.random.default_rng(1)
    out: dict = {"contexts": contexts, "top_k": [max(1, n // TOP_K_FRACTION) for n in contexts],
                 **{p: {key: [] for key in KERNEL_TIMINGS} for p in PATHS}}
    for n, k in zip(contexts, out["top_k"]):
        for key, exact in (("attention_fast_s", False), ("attention_exact_s", True)):
            for p, v in _attention_times(models, n, k, exact, rng).items():
                out[p][key].append(v)
        print(f"  kernel N {n:6d} top_k {k:5d}: " + "; ".join(f"{p} " + ", ".join(
            f"{key[:-2]} {out[p][key][-1] * 1e3:.2f} ms" for key in KERNEL_TIMINGS) for p in PATHS),
              file=sys.stderr, flush=True)
    return out


def child_contexts(a: argparse.Namespace) -> dict:
    import numpy as np

    from ggml_graph_spec.engine.model import Model
    rng = np.random.default_rng(0)
    n_ctx = max(a.contexts) + 1

    # Six models in one process, all mapped (repack=False): the default would repack the first ones
    # and map the rest once memory runs short, so the paths would not compare like for like.
    def load(path: str, exact: bool):
        if path == "dense":
            return Model.load(a.gguf, n_ctx=n_ctx, n_threads=a.threads, dsa=False, exact_experts=exact, repack=False)
        return Model.load(a.gguf, n_ctx=n_ctx, n_threads=a.threads, dsa_path=path, exact_experts=exact, repack=False)

    models = {(p, exact): load(p, exact) for p in PATHS for exact in (False, True)}
    out: dict = {"contexts": a.contexts, "top_k": [], "layer": models["masked", False].cfg.indexer.layers[0],
                 **{p: {key: [] for key in TIMINGS} for p in PATHS}}
    for m in models.values():
        m.eval([1])  # warm-up
    for n in a.contexts:
        top_k = max(1, n // TOP_K_FRACTION)
        out["top_k"].append(top_k)
        decode = _decode_times(models, n, top_k, a, rng)
        for path in PATHS:
            for exact in (False, True):
                out[path]["decode_exact_s" if exact else "decode_s"].append(decode[path, exact])
            print(f"  N {n:6d} top_k {top_k:5d} {path:6s}: " + ", ".join(
                f"{key[:-2]} {out[path][key][-1] * 1e3:7.2f} ms" for key in TIMINGS), file=sys.stderr, flush=True)
    out["kernel"] = kernel_times({p: models[p, False] for p in PATHS}, kernel_contexts(a))
    return out


def kernel_contexts(a: argparse.Namespace) -> list[int]:
    """Where the attention kernel alone is timed: the decode sweep's contexts and --kernel-contexts."""
    return sorted(set(a.contexts) | set(a.kernel_contexts))


OP_PROFILE_RUNS = 3


def child_ops(a: argparse.Namespace) -> dict:
    """Per-op CPU time of one whole-model decode step (fast path, one thread: op_profile.py says
    why) on the masked and the gathered DSA path at each context: where each path's time goes."""
    import numpy as np

    from bench import op_profile
    from ggml_graph_spec.engine.model import Model
    rng = np.random.default_rng(0)
    out: dict = {"threads": 1, "clock": "thread CPU time", "runs": OP_PROFILE_RUNS, "contexts": a.contexts}
    models = {p: Model.load(a.gguf, n_ctx=max(a.contexts) + 1, n_threads=1, dsa_path=p, repack=False)
              for p in PATHS[1:]}
    for p, m in models.items():
        m.eval([1])  # warm-up
        out[p] = []
    for n in a.contexts:
        for p, m in models.items():
            m.top_k = max(1, n // TOP_K_FRACTION)
            fill_caches(m, n, rng)
            records: list = []
            with op_profile.profiling(records):
                for _ in range(OP_PROFILE_RUNS):
                    m.cache.n_past = n
                    m.eval([1])
            out[p].append(_op_summary(records))
    out["kernel"] = kernel_ops(models["masked"], kernel_contexts(a))
    return out


def _op_summary(records: list) -> dict:
    from bench import op_profile
    ops = op_profile.per_op(records)
    return {"nodes": len(records[0]), "total_s": sum(ops.values()), "ops_s": ops}


def kernel_ops(m, contexts: list[int]) -> dict:
    """Per-op CPU time (one thread) of the fast attention kernel alone, masked against gather, at
    each context: which ops the gathered kernel's time goes to as the context grows."""
    import numpy as np

    from bench import op_profile
    rng = np.random.default_rng(2)
    out: dict = {"contexts": contexts, "masked": [], "gather": []}
    for n in contexts:
        for p in ("masked", "gather"):
            records: list = []
            with attention_kernel(m, n, max(1, n // TOP_K_FRACTION), p, False, rng) as run:
                with op_profile.profiling(records):
                    for _ in range(OP_PROFILE_RUNS):
                        run()
            out[p].append(_op_summary(records))
    return out


CHILDREN = {"ours": child_ours, "ours-mapped": child_ours, "llama": child_llama, "contexts": child_contexts,
            "ops": child_ops}


def run_child(kind: str, gguf: Path, a: argparse.Namespace) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", kind, "--gguf", str(gguf),
           "--threads", str(a.threads), "--prompt", str(a.prompt), "--gen", str(a.gen),
           "--repeats", str(a.repeats), "--sweep-repeats", str(a.sweep_repeats), "--contexts", *map(str, a.contexts),
           "--kernel-contexts", *map(str, a.kernel_contexts)]
    r = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    return json.loads(r.stdout.strip().splitlines()[-1])


# ---- report -----------------------------------------------------------------------------------

def crossover(ctx: dict, key: str) -> int | None:
    """The first measured context from which on the gathered path is faster than the masked one."""
    faster = [g < m for g, m in zip(ctx["gather"][key], ctx["masked"][key])]
    for i, n in enumerate(ctx["contexts"]):
        if all(faster[i:]):
            return n
    return None


def best_of_rounds(kind: str, gguf: Path, a: argparse.Namespace) -> dict:
    """`rounds` fresh processes, interleaved with the other runtime's by the caller; the fastest
    prompt and decode figures count (a shared machine only ever makes a run slower)."""
    runs = []
    for _ in range(a.rounds):
        runs.append(run_child(kind, gguf, a))
        yield runs[-1]
    best = dict(runs[0])
    for key in ("pp_tok_s", "tg_tok_s", "peak_rss_mib"):
        best[key] = max(r[key] for r in runs)
    best["rounds"] = runs
    yield best


# The /proc/cpuinfo flags that decide which ggml CPU kernels run (BF16 dot products, F16
# conversion, the repacked layouts): two machines with different ones are different benchmarks.
CPU_FLAGS = ("avx512_bf16", "avx512_vnni", "avx512f", "avx512bw", "avx512vl", "amx_bf16", "amx_tile", "amx_int8",
             "avx_vnni", "avx2", "fma", "f16c", "avx")


def cpu_features(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict:
    """The CPU model name and which of CPU_FLAGS it has (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        lines = cpuinfo.read_text().splitlines()
    except OSError:
        return {"model_name": None, "flags": []}
    info = dict(line.split(":", 1) for line in lines if ":" in line)
    info = {k.strip(): v.strip() for k, v in info.items()}
    flags = set(info.get("flags", "").split())
    return {"model_name": info.get("model name"), "flags": [f for f in CPU_FLAGS if f in flags]}


def print_ops(ops: dict, what: str = "one decode step", top: int = 8) -> None:
    """Per-op CPU time of `what`, masked against gather, the ops that differ most first."""
    for i, n in enumerate(ops["contexts"]):
        m, g = ops["masked"][i], ops["gather"][i]
        print(f"N {n:6d} per-op CPU time of {what} (1 thread): masked {m['total_s'] * 1e3:.1f} ms "
              f"({m['nodes']} nodes), gather {g['total_s'] * 1e3:.1f} ms ({g['nodes']} nodes)")
        names = set(m["ops_s"]) | set(g["ops_s"])
        diff = sorted(names, key=lambda op: -abs(g["ops_s"].get(op, 0) - m["ops_s"].get(op, 0)))
        for op in diff[:top]:
            print(f"    {op:16s} masked {m['ops_s'].get(op, 0) * 1e3:8.2f} ms  gather {g['ops_s'].get(op, 0) * 1e3:8.2f} ms")


def plot(ctx: dict, path: Path) -> None:
    plt = pyplot(path)
    if plt is None:
        return
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.2))
    panels = (("decode_s", "decode time per token (whole model, fast path)"),
              ("decode_exact_s", "decode time per token (whole model, exact path)"),
              ("attention_fast_s", "attention kernel per token, fast path"),
              ("attention_exact_s", "attention kernel per token, exact path"))
    for ax, (key, title) in zip(axes, panels):
        series = ctx if key in TIMINGS else ctx["kernel"]
        for p in PATHS:
            label = p if p == "dense" else f"{p} DSA (top_k = N/{TOP_K_FRACTION})"
            ax.plot(series["contexts"], [v * 1e3 for v in series[p][key]], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context length N (tokens)")
        ax.set_ylabel("ms")
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(result: dict) -> None:
    """The speed ratios, the gather/masked ratios by context, the crossovers and the per-op table."""
    s, ctx = result["speed"], result["contexts"]
    ours, mapped, llama = s["ours"], s["ours_mapped"], s["llama_cpp"]
    print(f"ours: llamafile sgemm {ours['llamafile_sgemm']}, default: {ours['repacked_tensors']} tensors repacked "
          f"({ours['repack_why']})")
    print(f"prompt processing: ours {ours['pp_tok_s']:.2f} tok/s ({s['pp_ratio']:.2f}x), mapped {mapped['pp_tok_s']:.2f} "
          f"tok/s ({s['mapped_pp_ratio']:.2f}x), llama.cpp {llama['pp_tok_s']:.2f} tok/s (1.00x)")
    print(f"decode:            ours {ours['tg_tok_s']:.2f} tok/s ({s['decode_ratio']:.2f}x), mapped {mapped['tg_tok_s']:.2f} "
          f"tok/s ({s['mapped_decode_ratio']:.2f}x), llama.cpp {llama['tg_tok_s']:.2f} tok/s (1.00x)")
    print(f"peak RSS:          ours {ours['peak_rss_mib']:.0f} MiB, mapped {mapped['peak_rss_mib']:.0f} MiB, "
          f"llama.cpp {llama['peak_rss_mib']:.0f} MiB")
    for i, (n, k) in enumerate(zip(ctx["contexts"], ctx["top_k"])):
        print(f"N {n:6d} top_k {k:5d}: gather/masked decode fast {ctx['gather']['decode_s'][i] / ctx['masked']['decode_s'][i]:.2f}, "
              f"exact {ctx['gather']['decode_exact_s'][i] / ctx['masked']['decode_exact_s'][i]:.2f}")
    print_kernel(ctx["kernel"])
    for key, n in result["crossover_context"].items():
        print(f"crossover context ({key}: gather faster than masked from here on): {n}")
    print_ops(result["decode_ops"])
    print_ops(result["decode_ops"]["kernel"], "the fast attention kernel")


def print_kernel(kernel: dict) -> None:
    """The attention kernel alone, gathered against masked, by context; the longest one against the 1/3 target."""
    ratio = {key: [g / m for g, m in zip(kernel["gather"][key], kernel["masked"][key])] for key in KERNEL_TIMINGS}
    for i, (n, k) in enumerate(zip(kernel["contexts"], kernel["top_k"])):
        print(f"N {n:6d} top_k {k:5d}: attention kernel ms, fast: masked {kernel['masked']['attention_fast_s'][i] * 1e3:.2f}, "
              f"gather {kernel['gather']['attention_fast_s'][i] * 1e3:.2f} ({ratio['attention_fast_s'][i]:.2f}); exact: "
              f"masked {kernel['masked']['attention_exact_s'][i] * 1e3:.2f}, gather "
              f"{kernel['gather']['attention_exact_s'][i] * 1e3:.2f} ({ratio['attention_exact_s'][i]:.2f})")
    print(f"longest context {kernel['contexts'][-1]}: gathered/masked attention kernel fast "
          f"{ratio['attention_fast_s'][-1]:.2f}, exact {ratio['attention_exact_s'][-1]:.2f} (target <= 0.33)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, default=Path("/tmp/kimi-graph-bench"),
                   help="where the checkpoint and GGUFs go (about 18 GB; reused by later runs)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens (one batch)")
    p.add_argument("--gen", type=int, default=8, help="decoded tokens")
    p.add_argument("--repeats", type=int, default=3, help="runs per process (the fastest counts)")
    # The paths' decode steps differ by the attention kernel, 0.5-3 ms of a ~220 ms step below
    # 16k: more runs per path than the speed comparison's, so that the fastest of them is not a
    # busy period's.
    p.add_argument("--sweep-repeats", type=int, default=7, help="whole-model decode runs per path and context")
    p.add_argument("--rounds", type=int, default=3, help="processes per runtime for the speed comparison")
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072])
    p.add_argument("--kernel-contexts", type=int, nargs="+", default=[32768, 65536, 131072],
                   help="further contexts for the attention kernel alone (synthetic inputs: seconds, not a decode sweep)")
    p.add_argument("--json", type=Path, default=RESULTS / "graph.json")
    p.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    p.add_argument("--gguf", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(CHILDREN[a.child](a)))
        return 0
    a.workdir.mkdir(parents=True, exist_ok=True)
    load_at_start = os.getloadavg()  # other processes on the machine make every timing slower
    dsa, no_dsa = prepare(a.workdir)
    print(f"speed on {no_dsa.name}, {a.threads} threads", file=sys.stderr)
    kinds = ("ours", "ours-mapped", "llama")
    runs = [best_of_rounds(kind, no_dsa, a) for kind in kinds]
    for _ in range(a.rounds):  # alternate the runtimes, so that a busy period hits all of them
        for r in runs:
            next(r)
    ours, mapped, llama = (next(r) for r in runs)
    print(f"contexts on {dsa.name}", file=sys.stderr)
    ctx = run_child("contexts", dsa, a)
    print(f"per-op profile on {dsa.name}", file=sys.stderr)
    ops = run_child("ops", dsa, a)
    result = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "threads": a.threads,
                    "cpu_features": cpu_features(), "load_average_at_start": load_at_start,
                    "load_average_at_end": os.getloadavg()},
        "checkpoint": {"synth": SYNTH, "gguf_bytes": {no_dsa.name: no_dsa.stat().st_size, dsa.name: dsa.stat().st_size}},
        "speed": {"threads": a.threads, "gguf": no_dsa.name, "ours": ours, "ours_mapped": mapped, "llama_cpp": llama,
                  "decode_ratio": ours["tg_tok_s"] / llama["tg_tok_s"], "pp_ratio": ours["pp_tok_s"] / llama["pp_tok_s"],
                  "mapped_decode_ratio": mapped["tg_tok_s"] / llama["tg_tok_s"],
                  "mapped_pp_ratio": mapped["pp_tok_s"] / llama["pp_tok_s"]},
        "contexts": ctx, "crossover_context": {**{key: crossover(ctx, key) for key in TIMINGS},
                                                        **{key: crossover(ctx["kernel"], key) for key in KERNEL_TIMINGS}}, "decode_ops": ops,
    }
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(result, indent=1) + "\n")
    plot(ctx, a.json.with_suffix(".png"))
    report(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
