"""--mem-budget: tokens identical to an unlimited run with most layers streamed from the file,
on the fast and the exact path, and inside a real memory cgroup (backends/streaming/budget.py, streaming.py)."""
from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import ggml
import numpy as np
import pytest

import convert_kimi_k3
from gguf_arch.arch.tensors import gguf_layer
from gguf_arch.synth.cli import main as synth_main
from ggml_graph_spec.backends.streaming.budget import PRESETS, BudgetError, parse_size, plan_budget

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 300
# Anonymous memory of the child that is not the model's: the interpreter, numpy, ggml, gguf-py.
OVERHEAD = 64 << 20
CGROUP_V1 = Path("/sys/fs/cgroup/memory")

# A greedy run in a child process: prints the tokens, then the anonymous RSS and bytes streamed,
# then what the expert streaming did (JSON). A warm-up token first (the plan is made at the first
# graph, so the prompt's graph already reads the experts as selected), then a 24-token prompt.
CHILD = """
import json, sys, numpy as np
from ggml_graph_spec.engine.model import Model
path, exact, budget = sys.argv[1], sys.argv[2] == "1", (None if sys.argv[3] == "none" else sys.argv[3])
# repack=False: a budget streams the mapped experts, so the unlimited reference maps them too (the
# default would repack them where the GGUF fits, and the repacked kernels round their sums otherwise)
m = Model.load(path, n_ctx=64, exact_experts=exact, n_threads=1, mem_budget=budget, repack=False)
m.eval([1]); m.reset()
x = m.executor
def read():
    return x.bytes_read + (x.cache.bytes_read if getattr(x, "cache", None) else 0)
whole0 = getattr(x, "whole_reads", 0)
logits, out = m.eval([(7 * i + 1) % 50 for i in range(24)]), []
whole1, read1 = getattr(x, "whole_reads", 0), read() if budget else 0
guessed1 = getattr(x, "guess_total", 0)
for _ in range(6):
    out.append(int(np.argmax(logits[-1])))
    logits = m.eval([out[-1]])
plan = getattr(x, "plan_", None)
rss = [l for l in open("/proc/self/status") if l.startswith("RssAnon:")][0].split()[1]
print(" ".join(map(str, out)))
# the layers any part of which (trunk or experts) is read per token, and the bytes read in all
print(int(rss) * 1024, tuple(sorted({*plan.streamed, *plan.expert_layers})) if plan else (), read() if budget else 0)
c = getattr(x, "cache", None)
stats = {"prompt_whole": whole1 - whole0, "decode_whole": getattr(x, "whole_reads", 0) - whole1,
         "decode_read_per_token": (read() - read1) / len(out) if budget else 0,
         "resident": plan.resident if plan else 0, "entries": c.entries if c else 0,
         "hits": c.hits if c else 0, "misses": c.misses if c else 0,
         "prefetch": [c.predicted, c.useful, c.wasted] if c else [0, 0, 0],
         "guessed": [getattr(x, "guess_right", 0), getattr(x, "guess_total", 0)],
         "decode_guessed": getattr(x, "guess_total", 0) - guessed1, "decoded": len(out),
         "used": m.cfg.num_experts_used, "moe_layers": len(plan.expert_layers) if plan else 0,
         "pitched": bool(c and c.pitched), "trunks_streamed": len(plan.streamed) if plan else 0,
         "whole_layer_read_per_token": (plan.streamed_bytes + sum(s.stride * s.count for l in plan.expert_layers
                                        for s in x.files.experts[l])) if plan else 0}
print(json.dumps(stats))
m.close()
"""


@pytest.fixture(scope="module")
def big_gguf(tmp_path_factory) -> Path:
    """A generated K3.1-Pro with 64 experts per layer (~4 MB): several times the budgets below."""
    d = tmp_path_factory.mktemp("membudget")
    assert synth_main(["--preset", "tiny", "--experts", "64", str(d / "hf")]) == 0
    assert convert_kimi_k3.main([str(d / "hf"), str(d / "m.gguf"), "--quiet"]) == 0
    return d / "m.gguf"


@pytest.fixture(scope="module")
def pitched_gguf(tmp_path_factory) -> Path:
    """Experts of whole blocks (latent 256 x 512 MXFP4: 69,632 bytes = 17 x 4096 a slice, as the
    real model's 5.8 MB are 1428 blocks), their stacks at file offsets that differ from layer to
    layer modulo the block: the fast path's expert cache is pitched (backends/streaming/experts.py; ~84 MB)."""
    d = tmp_path_factory.mktemp("pitched")
    assert synth_main(["--preset", "tiny", "--experts", "32", "--latent", "256", "--moe-intermediate", "512",
                       str(d / "hf")]) == 0
    assert convert_kimi_k3.main([str(d / "hf"), str(d / "m.gguf"), "--quiet"]) == 0
    return d / "m.gguf"


@dataclass(frozen=True)
class Run:
    tokens: str
    rss: int
    streamed: str
    read: int
    experts: dict  # what the expert streaming did (CHILD)


def _run(path: Path, exact: bool, budget: str, preexec=None) -> Run:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", CHILD, str(path), "1" if exact else "0", budget], env=env,
                       capture_output=True, text=True, timeout=TIMEOUT, preexec_fn=preexec)
    assert r.returncode == 0, r.stderr[-2000:]
    tokens, stats, experts = r.stdout.strip().splitlines()
    rss, rest = stats.split(" ", 1)
    streamed, read = rest.rsplit(" ", 1)
    return Run(tokens, int(rss), streamed, int(read), json.loads(experts))


def _child(path: Path, exact: bool, budget: str, preexec=None) -> tuple[str, int, str, int]:
    r = _run(path, exact, budget, preexec)
    return r.tokens, r.rss, r.streamed, r.read


def test_sizes_and_presets():
    assert parse_size("512M") == 512 << 20 and parse_size("8G") == 8 << 30 and parse_size("1.5k") == 1536
    assert parse_size("laptop") == PRESETS["laptop"] and parse_size(4096) == 4096
    for bad in ("", "12Q", "-1G", "0", "G"):
        with pytest.raises(BudgetError, match="--mem-budget"):
            parse_size(bad)


def test_plan_pins_a_prefix_that_fits():
    p = plan_budget(100 + 3 * 10 + 2 * 10, 100, [10] * 6)
    assert p.pinned == (0, 1, 2) and p.streamed == (3, 4, 5) and p.resident <= p.budget
    assert p.streamed_bytes == 30
    assert plan_budget(10**6, 100, [10] * 6).streamed == ()
    with pytest.raises(BudgetError, match="too small"):
        plan_budget(100 + 19, 100, [10] * 6)


@pytest.mark.parametrize("exact", [False, True], ids=["fast", "exact"])
def test_tokens_identical_at_budgets_below_a_third_of_the_model(big_gguf, exact):
    size = big_gguf.stat().st_size
    ref, _, streamed, _ = _child(big_gguf, exact, "none")
    assert streamed == "()"
    for budget in (size // 3, size // 2):
        tokens, _, streamed, read = _child(big_gguf, exact, str(budget))
        assert tokens == ref, f"budget {budget}"
        assert streamed != "()" and read > 0, "the budget streamed no layer: the test proves nothing"


@pytest.mark.parametrize("exact", [False, True], ids=["fast", "exact"])
def test_only_the_selected_experts_are_read(big_gguf, exact):
    """At every budget the decode reads the trunks and the missed experts only: less than the
    whole layers; no decoded token falls back to a whole expert stack; the tokens stay the same,
    with the next layer's predicted experts read ahead (ExpertCache.place's `ahead`)."""
    size = big_gguf.stat().st_size
    ref, prefetched = _run(big_gguf, exact, "none"), []
    for budget in (size // 5, size // 3, size // 2):
        r = _run(big_gguf, exact, str(budget))
        e = r.experts
        assert r.tokens == ref.tokens, f"budget {budget}"
        assert e["entries"] > 0 and e["misses"] > 0, f"budget {budget}: no expert was streamed: {e}"
        assert e["decode_whole"] == 0, e
        assert 0 < e["decode_read_per_token"] < e["whole_layer_read_per_token"], e
        assert e["resident"] <= budget
        predicted, useful, wasted = e["prefetch"]
        assert useful + wasted == predicted, e  # every read ahead resolved by its layer
        prefetched.append(predicted)
        print(f"budget {budget}: read ahead {predicted}, useful {useful}; predicted right "
              f"{e['guessed'][0]}/{e['guessed'][1]} of the selected experts")
    assert max(prefetched) > 0, "no budget read an expert ahead: the identical tokens prove nothing of it"


def test_pitched_entries_hold_every_layer_at_its_own_offset(pitched_gguf):
    """Experts read with O_DIRECT straight into pitched entries, each layer's at its own place in
    a block, entries reused across layers: the tokens are the unlimited run's. Every MoE layer's
    experts are predicted, the first one's from the dense layer before it."""
    size, ref = pitched_gguf.stat().st_size, _run(pitched_gguf, False, "none")
    for budget in (size // 5, size // 2):
        r = _run(pitched_gguf, False, str(budget))
        e = r.experts
        assert e["pitched"] and e["misses"] > e["entries"], e  # entries were reused
        assert r.tokens == ref.tokens, f"budget {budget}"
        assert e["decode_whole"] == 0 and e["prefetch"][0] > 0, e
        assert e["trunks_streamed"] == 0, e  # the premise: every router resident, so every layer predicted
        assert e["decode_guessed"] == e["decoded"] * e["used"] * e["moe_layers"], e


# (the exact path's larger compute buffer and caches leave less of a budget to the expert cache)
@pytest.mark.parametrize("exact,part", [(False, 6), (True, 5)], ids=["fast", "exact"])
def test_a_prompt_selecting_more_experts_than_the_cache_reads_them_whole(big_gguf, exact, part):
    """At 1/6 (1/5) of the file the cache holds a few experts: the 24-token prompt's union does not
    fit, its layers use the mapped stacks whole, and the tokens are still the unlimited run's."""
    budget = big_gguf.stat().st_size // part
    r, ref = _run(big_gguf, exact, str(budget)), _run(big_gguf, exact, "none")
    assert r.experts["entries"] < 24 * 2, r.experts  # fewer than the prompt's k x T selections
    assert r.experts["prompt_whole"] > 0 and r.tokens == ref.tokens


def test_cli_summary_says_what_is_pinned(big_gguf):
    budget = big_gguf.stat().st_size // 3
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    args = [sys.executable, "-m", "ggml_graph_spec", "-m", str(big_gguf), "-p", "hi", "-n", "3", "--temp", "0",
            "-c", "64", "-t", "1"]
    ref = subprocess.run(args, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    r = subprocess.run(args + ["--mem-budget", str(budget)], env=env, capture_output=True, text=True,
                       timeout=TIMEOUT)
    assert r.returncode == 0 and ref.returncode == 0, r.stderr[-2000:]
    assert r.stdout == ref.stdout
    assert "mem pinned" in r.stderr and "bytes read per token" in r.stderr
    assert "mem experts" in r.stderr and "hits " in r.stderr
    bad = subprocess.run(args + ["--mem-budget", "12Q"], env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert bad.returncode == 2 and bad.stderr.startswith("error: --mem-budget")


def _make_cgroup(limit: int) -> Path:
    if not CGROUP_V1.is_dir():
        pytest.skip(f"no cgroup v1 memory controller at {CGROUP_V1}")
    group = CGROUP_V1 / f"kimi-k3-membudget-{os.getpid()}"
    try:
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(limit))
    except OSError as e:
        if group.exists():
            group.rmdir()
        pytest.skip(f"cannot create a memory cgroup at {group}: {e}")
    return group


@pytest.mark.parametrize("exact", [False, True], ids=["fast", "exact"])
def test_inside_a_memory_cgroup(big_gguf, exact):
    budget = big_gguf.stat().st_size // 3
    ref, _, _, _ = _child(big_gguf, exact, "none")
    group = _make_cgroup(budget + OVERHEAD)
    try:
        procs = group / "cgroup.procs"
        r = _run(big_gguf, exact, str(budget), preexec=lambda: procs.write_text(str(os.getpid())))
        failed = int((group / "memory.failcnt").read_text())
    finally:
        group.rmdir()
    tokens, rss, streamed = r.tokens, r.rss, r.streamed
    assert tokens == ref and streamed != "()"
    assert r.experts["entries"] > 0 and r.experts["misses"] > 0, "the expert cache was not engaged"
    assert r.experts["resident"] <= budget
    assert rss <= budget + OVERHEAD, f"anonymous RSS {rss} > budget {budget} + overhead {OVERHEAD}"
    print(f"cgroup limit {budget + OVERHEAD}: anonymous RSS {rss}, limit hits {failed}")


@pytest.fixture(scope="module")
def split_gguf(big_gguf) -> Path:
    out = big_gguf.parent / "split" / "m.gguf"
    out.parent.mkdir()
    assert convert_kimi_k3.main([str(big_gguf.parent / "hf"), str(out), "--quiet", "--split-max-size", "2M"]) == 0
    parts = sorted(out.parent.glob("*.gguf"))
    assert len(parts) >= 2
    return parts[0]


def test_streaming_a_split_gguf(big_gguf, split_gguf):
    budget = str(big_gguf.stat().st_size // 3)
    ref, _, _, _ = _child(big_gguf, False, "none")
    tokens, _, streamed, _ = _child(split_gguf, False, budget)
    assert tokens == ref and streamed != "()"


def _doctor(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ggml_graph_spec.tools.doctor", *map(str, args)],
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=TIMEOUT)


@pytest.mark.parametrize("which", ["single", "split"])
def test_doctor_reports_memory_disk_and_presets(big_gguf, split_gguf, which):
    r = _doctor(big_gguf if which == "single" else split_gguf)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for needle in ("RAM ", "free disk", "read speed", "trunk", "experts", "run: kimi-k3-cli -m"):
        assert needle in out, out
    assert sum(line.startswith("preset ") for line in out.splitlines()) == len(PRESETS)
    trunk, experts = (int(w) for w in (out.split("trunk ")[1].split()[0], out.split("experts ")[1].split()[0]))
    assert experts > 0 and trunk > 0
    assert trunk + experts <= sum(p.stat().st_size for p in big_gguf.parent.glob("m.gguf"))


def test_doctor_reads_each_file_of_a_split_from_its_start(tmp_path, monkeypatch):
    """The read speed of a split GGUF times its files one after the other, each from byte 0
    (the bytes read are every file's, up to the bound)."""
    from ggml_graph_spec.tools import doctor
    sizes = (3 * doctor._CHUNK + 5, doctor._CHUNK // 2, 2 * doctor._CHUNK)
    paths = []
    for i, size in enumerate(sizes):
        paths.append(tmp_path / f"m-{i:05d}-of-00003.gguf")
        paths[-1].write_bytes(bytes([i]) * size)
    real, reads = os.pread, []
    def pread(fd, n, offset):
        data = real(fd, n, offset)
        reads.append((os.readlink(f"/proc/self/fd/{fd}"), offset, len(data)))
        return data
    monkeypatch.setattr(doctor.os, "pread", pread)
    monkeypatch.setattr(doctor, "_READ_SECONDS", 600.0)  # the byte bound, not a slow disk, ends it
    assert doctor.read_speed([str(p) for p in paths]) > 0
    for p, size in zip(paths, sizes):
        mine = [(off, n) for path, off, n in reads if path == str(p)]
        assert mine[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(mine, mine[1:])), (p, mine)
        assert sum(n for _, n in mine) == size, p


def test_doctor_bad_input_is_one_line():
    r = _doctor("no-such.gguf")
    assert r.returncode == 2 and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1


def test_usable_memory_is_at_most_the_cgroup_limit():
    """The default's repack choice reads the memory a process may use: a cgroup's limit counts."""
    limit = 512 << 20
    group = _make_cgroup(limit)
    try:
        procs = group / "cgroup.procs"
        code = "from ggml_graph_spec.weights.host import cgroup_limit, usable_memory; print(cgroup_limit(), usable_memory())"
        r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                           text=True, timeout=TIMEOUT, preexec_fn=lambda: procs.write_text(str(os.getpid())))
    finally:
        group.rmdir()
    assert r.returncode == 0, r.stderr
    seen, usable = map(int, r.stdout.split())
    assert seen == limit and 0 < usable <= limit


def _dry_run(model_dir: Path, out: Path, listing: Path) -> Path:
    r = subprocess.run([sys.executable, str(ROOT / "convert_kimi_k3.py"), str(model_dir), str(out), "--dry-run"],
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr
    listing.write_text(r.stdout)
    return listing


def _plan_fields(out: str) -> tuple[str, list[str]]:
    """The doctor's weights line and its presets' plans (without the speed, which is measured)."""
    weights = next(line for line in out.splitlines() if line.startswith("weights")).split(" (planned")[0]
    return weights, [line.split(" bytes/token")[0] for line in out.splitlines() if line.startswith("preset ")]


def test_doctor_plans_from_a_dry_run_listing_as_from_the_gguf(big_gguf, tmp_path):
    """The listing of the checkpoint the GGUF was converted from gives the GGUF's own figures."""
    listing = _dry_run(big_gguf.parent / "hf", big_gguf, tmp_path / "plan.txt")
    from_gguf, from_listing = _doctor(big_gguf), _doctor(listing)
    assert from_listing.returncode == 0, from_listing.stderr
    assert _plan_fields(from_listing.stdout) == _plan_fields(from_gguf.stdout)
    assert "read speed   not measured" in from_listing.stdout and "--disk FILE" in from_listing.stdout
    with_disk = _doctor(listing, "--disk", big_gguf)
    assert "MB/s (sequential, uncached, 1 file(s))" in with_disk.stdout
    assert f"run: kimi-k3-cli -m {big_gguf}" in with_disk.stdout


def test_doctor_plans_the_real_k31pro_from_its_dry_run(tmp_path):
    """The real model's layout without its 1.5 TB: 82,432 experts of 17,547,264 bytes (issue 14)."""
    from tests.support.real_plan import write_k31pro_plan
    model = tmp_path / "k31pro"
    model.mkdir()
    listing = _dry_run(write_k31pro_plan(model), tmp_path / "k31pro.gguf", tmp_path / "plan.txt")
    r = _doctor(listing)
    assert r.returncode == 0, r.stderr
    experts = int(r.stdout.split("experts ")[1].split()[0])
    assert experts == 82432 * 17547264
    total = int(next(line for line in listing.read_text().splitlines() if line.startswith("total:")).split()[5])
    trunk = int(r.stdout.split("trunk ")[1].split()[0])
    # the listing pads each tensor to 32 bytes, the plan each trunk tensor to 64 (2669 tensors)
    assert abs(total - (experts + trunk)) < 64 * 2669
    assert sum(line.startswith("preset ") for line in r.stdout.splitlines()) == len(PRESETS)


@pytest.mark.parametrize("cut", ["keys", "tensor"])
def test_doctor_refuses_a_broken_listing_in_one_line(big_gguf, tmp_path, cut):
    lines = _dry_run(big_gguf.parent / "hf", big_gguf, tmp_path / "plan.txt").read_text().splitlines()
    if cut == "keys":
        lines = [line for line in lines if not line.startswith("kimi-k3.expert")]
    else:
        i = next(i for i, line in enumerate(lines) if "ffn_up_exps" in line)
        lines[i] = lines[i].rsplit(" ", 1)[0] + " 12x"
    bad = tmp_path / "bad.txt"
    bad.write_text("\n".join(lines) + "\n")
    r = _doctor(bad)
    assert r.returncode == 2 and r.stderr.startswith(f"error: {bad}") and r.stderr.count("\n") == 1, r.stderr


def _decode_at_half(gguf: Path, n: int, after_prompt=None, at_end=None) -> None:
    """Greedy-decode n tokens after the prompt [3, 1, 4] in-process, unlimited and at half the
    file: the tokens must be the same. after_prompt(model) and at_end(model) see the budget run."""
    from ggml_graph_spec.engine.model import Model
    tokens = {}
    for budget in (None, str(gguf.stat().st_size // 2)):
        m = Model.load(gguf, n_ctx=64, n_threads=1, mem_budget=budget)
        try:
            logits, out = m.eval([3, 1, 4]), []
            if budget and after_prompt:
                after_prompt(m)
            for _ in range(n):
                out.append(int(np.argmax(logits[-1])))
                logits = m.eval([out[-1]])
            if budget and at_end:
                at_end(m)
            tokens[budget is None] = out
        finally:
            m.close()
    assert tokens[True] == tokens[False]


def _srcs(t) -> list:
    """t's sources (ggml_tensor_p), the ones it has."""
    return [s for s in (t.contents.src[i] for i in range(ggml.GGML_MAX_SRC)) if s]


def _name(t) -> str:
    return ggml.ggml_get_name(t).decode()


def _leaves(t, seen: set | None = None) -> set[str]:
    """The names of the tensors no op computes (weights, inputs) that t is computed from."""
    seen = set() if seen is None else seen
    if not t or ctypes.addressof(t.contents) in seen:
        return set()
    seen.add(ctypes.addressof(t.contents))
    if t.contents.op == ggml.GGML_OP_NONE and not t.contents.view_src:
        return {_name(t)}
    return set().union(*(_leaves(s, seen) for s in [*_srcs(t), t.contents.view_src] if s))


def _weight_layers(node) -> set:
    """The layers of the weights `node` reads directly (or through a view)."""
    leaves = [s.contents.view_src or s for s in _srcs(node)]
    return {gguf_layer(_name(t)) for t in leaves if t.contents.op == ggml.GGML_OP_NONE}


@pytest.mark.parametrize("dense", [1, 2])
def test_the_first_moe_layer_is_predicted_from_the_embedding(tmp_path, monkeypatch, dense):
    """The token's first MoE layer's experts are predicted in the first layer's segment, from the
    embedding alone (no weight of a layer before it), ahead of every node that reads the first
    layer's weights: their reads overlap its attention (model._predict_experts); the others in
    the layer before. Every MoE layer is predicted, every decoded token, and the tokens are the
    unlimited run's."""
    from ggml_graph_spec.backends.streaming.executor import StreamingExecutor
    assert synth_main(["--preset", "tiny", "--experts", "32", "--latent", "256", "--moe-intermediate", "512",
                       "--dense-layers", str(dense), str(tmp_path / "hf")]) == 0  # as pitched_gguf: big experts
    gguf = tmp_path / "m.gguf"
    assert convert_kimi_k3.main([str(tmp_path / "hf"), str(gguf), "--quiet"]) == 0
    seen, run = [], StreamingExecutor._run

    def looking(self, g):
        segments = g.segments_by_address()
        nodes = [ggml.ggml_graph_node(g.gf, i) for i in range(ggml.ggml_graph_n_nodes(g.gf))]
        first_reader = min(i for i, n in enumerate(nodes) if 0 in _weight_layers(n))
        for layer, ids in self._predicted.values():
            at = [ctypes.addressof(n.contents) for n in nodes].index(ctypes.addressof(ids.contents))
            seen.append((layer, segments[ctypes.addressof(ids.contents)], at < first_reader,
                         {gguf_layer(n) for n in _leaves(ids) if n.startswith("blk.")}))
        return run(self, g)

    def after_prompt(m):
        x = m.executor
        assert x.plan_.streamed == () and x.cache is not None, x.summary()  # every router resident
        guessed.append(x.guess_total)

    def at_end(m):  # every MoE layer predicted, every decoded token
        x = m.executor
        assert x.guess_total - guessed[0] == 4 * m.cfg.num_experts_used * len(x.plan_.expert_layers)

    monkeypatch.setattr(StreamingExecutor, "_run", looking)
    guessed: list[int] = []
    _decode_at_half(gguf, 4, after_prompt, at_end)
    assert guessed
    early = [s for s in seen if s[0] == dense and s[1] == 0]
    assert early and all(s[2:] == (True, {dense}) for s in early), early
    where: dict[int, set] = {}
    for layer, segment, *_ in seen:
        where.setdefault(layer, set()).add(segment)
    assert where.pop(dense) == {0}
    assert where and all(segments == {layer - 1} for layer, segments in where.items()), where


def _sources(g, i0: int, i1: int) -> tuple[set[str], set[int]]:
    """The names (of the viewed tensor, for a view) and addresses of nodes i0..i1's sources."""
    srcs = [s for i in range(i0, i1) for s in _srcs(ggml.ggml_graph_node(g.gf, i))]
    return {_name(s.contents.view_src or s) for s in srcs}, {ctypes.addressof(s.contents) for s in srcs}


def test_the_shared_experts_compute_while_the_missed_experts_are_read(pitched_gguf, monkeypatch):
    """At a MoE layer the executor computes, after reading the router's ids back and submitting
    the missed experts' reads and before waiting for them, the nodes up to the expert matmuls:
    the shared experts' three matmuls among them, no node that reads the expert cache
    (ExpertCache.place's `during`). The tokens are the unlimited run's."""
    from ggml_graph_spec.backends.streaming.experts import ExpertCache
    from ggml_graph_spec.backends.streaming.executor import StreamingExecutor
    calls, place, compute, run = [], ExpertCache.place, StreamingExecutor._compute, StreamingExecutor._run
    state: dict = {"in": None, "pool": set()}

    def placing(self, layer, stacks, experts, ahead=None, during=None, **kw):
        def watched():
            state["in"] = {"layer": layer, "in_flight": len(self._inflight), "names": set(), "sources": set()}
            during()
            d, state["in"] = state["in"], None
            d["reads_pool"] = bool(d.pop("sources") & state["pool"])
            calls.append(d)
        return place(self, layer, stacks, experts, ahead, during=watched if during else None, **kw)

    def computing(self, g, i0, i1):
        if state["in"] is not None:
            names, addresses = _sources(g, i0, i1)
            state["in"]["names"] |= names
            state["in"]["sources"] |= addresses
        return compute(self, g, i0, i1)

    def running(self, g):
        state["pool"] = {ctypes.addressof(t.contents) for b in self._bound.values() for t in (b.slots, *b.pool)}
        return run(self, g)

    monkeypatch.setattr(ExpertCache, "place", placing)
    monkeypatch.setattr(StreamingExecutor, "_compute", computing)
    monkeypatch.setattr(StreamingExecutor, "_run", running)
    moe_layers: list = []
    _decode_at_half(pitched_gguf, 4, at_end=lambda m: moe_layers.extend(m.executor.plan_.expert_layers))
    assert moe_layers and {d["layer"] for d in calls} == set(moe_layers)
    assert any(d["in_flight"] for d in calls), "no layer had a read in flight while it computed: proves nothing"
    for d in calls:
        shexp = {f"blk.{d['layer']}.ffn_{k}_shexp.weight" for k in ("gate", "up", "down")}
        assert shexp <= d["names"] and not d["reads_pool"], (d["layer"], sorted(d["names"]))


def test_each_slot_computes_once_its_own_experts_are_in(pitched_gguf, monkeypatch):
    """Decoding at a budget, a MoE layer's routed experts run one slot at a time
    (moe._routed_experts_by_slot): place() gets the selected experts in slot order (so the missed
    ones are read in that order) and does not wait for them; then for each slot in turn the
    executor waits for that slot's entry alone and computes the slot's nodes, so the first slots
    compute while the later ones are read. The tokens are the unlimited run's."""
    from ggml_graph_spec.backends.streaming.experts import ExpertCache
    from ggml_graph_spec.backends.streaming.executor import StreamingExecutor
    events, place, ready, compute = [], ExpertCache.place, ExpertCache.ready, StreamingExecutor._compute

    def placing(self, *a, **kw):
        entries = place(self, *a, **kw)
        events.append(("place", None if entries is None else entries.tolist(), kw.get("settle", True)))
        return entries

    def waiting(self, entries):
        events.append(("ready", sorted(set(entries.tolist()))))
        return ready(self, entries)

    def computing(self, g, i0, i1):
        if events and events[-1][0] != "compute":
            events.append(("compute",))
        return compute(self, g, i0, i1)

    monkeypatch.setattr(ExpertCache, "place", placing)
    monkeypatch.setattr(ExpertCache, "ready", waiting)
    monkeypatch.setattr(StreamingExecutor, "_compute", computing)
    used: list[int] = []
    _decode_at_half(pitched_gguf, 3, after_prompt=lambda m: events.clear(),
                    at_end=lambda m: used.append(m.cfg.num_experts_used))
    k = used[0]
    starts = [i for i, e in enumerate(events) if e[0] == "place"]
    assert starts and all(events[i][1] is not None and events[i][2] is False for i in starts), events[:3]
    for i in starts:
        entries, after = events[i][1], events[i + 1:i + 1 + 2 * k + 1]
        want = [x for j in range(k) for x in (("ready", [entries[j]]), ("compute",))] + [("ready", sorted(entries))]
        assert after == want, (entries, after)
