"""Conversion benchmark: a plain copy of the shards vs this converter vs llama.cpp's converter.

    python bench/convert.py --workdir /tmp/kimi-bench

On one synthetic K3 checkpoint of several GB in the real on-disk format (`kimi-k3-synth --preset
large --variant k3`: real hidden size 7168, real expert shapes, 4 layers, 64 MXFP4 experts, about
9.1 GB), in one run, each into WORKDIR/out on the same filesystem:
  copy       `cp` of the shards: the physical limit of reading and writing those bytes;
  ours       `convert_kimi_k3.py MODEL OUT.gguf --quiet`;
  llama_cpp  llama.cpp's `convert_hf_to_gguf.py --outtype bf16` (same types as ours: bf16 kept,
             experts repacked to MXFP4), from the llama-cpp-python 0.3.36 source distribution
             fetched with `pip download` into WORKDIR (never into the repository).
and our converter once more on a checkpoint with half the experts (7.4 GB: attention and the dense
layer stay), to show that peak RSS does not follow the checkpoint size.

Each timing runs from the start of the command until its output is on disk (a `sync` after it:
our converter fsyncs every file before renaming it, cp and llama.cpp's converter do not). Peak
RSS is the child's VmHWM from /proc, polled every 20 ms; CPU seconds (user + system) are the
child's own, from wait4. MB/s is checkpoint bytes (10^6) per
second for every run, so the ratios are time ratios. By default the shards are read into the page
cache before each run (`--cold` drops the caches instead, which needs root), and the JSON says
which. Results go to bench/results/convert.json (or --json).

llama.cpp's workaround: its K3 `set_vocab` loads the tokenizer through transformers'
AutoTokenizer with `tokenization_kimi.py`, which a synthetic checkpoint (like this repository's
fixtures) does not ship. A runner script imports their converter and replaces only
`KimiK3Model.set_vocab` with a no-op before calling its `main()`: their GGUF then has no
tokenizer keys (a few hundred KB of metadata for this vocabulary), every tensor path is theirs,
unchanged. Their converter imports `transformers` (AutoConfig) at module level: the `bench`
extra installs it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # scan_cost imports the converter's scan
SDIST = "llama-cpp-python==0.3.36"
SYNTH = ["--preset", "large", "--variant", "k3"]
POLL_S = 0.02

# Their converter, with only the tokenizer step replaced (see the module docstring).
LLAMA_RUNNER = """
import sys
llama_dir, model, out = sys.argv[1:4]
sys.path.insert(0, llama_dir)
sys.argv = ["convert_hf_to_gguf.py", model, "--outfile", out, "--outtype", "bf16"]
import convert_hf_to_gguf
from conversion.kimi_k3 import KimiK3Model
KimiK3Model.set_vocab = lambda self: None
convert_hf_to_gguf.main()
"""


def _vm_hwm_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def measure(cmd: list[str], nbytes: int, **kw) -> dict:
    """Run `cmd`, then sync; wall time, MB/s of `nbytes`, the child's CPU seconds and peak RSS."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, **kw)
    peak = 0
    while True:
        peak = max(peak, _vm_hwm_kib(proc.pid) or 0)
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)  # rusage: the child's own CPU time
        if pid:
            break
        time.sleep(POLL_S)
    err = proc.stderr.read().decode(errors="replace")
    code = proc.returncode = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"{' '.join(cmd)} failed with {code}: {err[-2000:]}")
    os.sync()
    wall = time.monotonic() - start
    return {"wall_s": round(wall, 2), "mb_per_s": round(nbytes / 1e6 / wall, 1),
            "cpu_s": round(usage.ru_utime + usage.ru_stime, 1), "peak_rss_mib": round(peak / 1024, 1)}


def _shards(model: Path) -> list[Path]:
    return sorted(model.glob("*.safetensors"))


def prepare_cache(model: Path, cold: bool) -> None:
    """Warm: every shard read once (page cache); cold: caches dropped (root only)."""
    os.sync()
    if cold:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return
    for shard in _shards(model):
        with open(shard, "rb") as f:
            while f.read(64 << 20):
                pass


def synth(model: Path, *extra: str) -> None:
    if (model / "config.json").exists():
        return
    subprocess.run([sys.executable, "-m", "gguf_arch.synth.cli", str(model), *SYNTH, *extra], cwd=REPO, check=True,
                   stdout=subprocess.DEVNULL)


def llama_cpp_tree(workdir: Path) -> Path:
    """llama.cpp's sources from the llama-cpp-python sdist, downloaded with pip at bench time."""
    dest = workdir / "sdist"
    found = sorted(dest.glob("llama_cpp_python-*/vendor/llama.cpp"))
    if found:
        return found[0]
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", SDIST,
                    "-d", str(dest)], check=True, stdout=subprocess.DEVNULL)
    archive = next(dest.glob("llama_cpp_python-*.tar.gz"))
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    return next(dest.glob("llama_cpp_python-*/vendor/llama.cpp"))


def _fresh(out: Path) -> Path:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    os.sync()
    return out


def scan_cost(gguf: Path) -> dict:
    """CPU seconds of the non-finite scan (gguf_arch/io/nonfinite.py) over every tensor of the
    GGUF just written, fed in the converter's 16 MiB chunks already in memory (the page faults of
    reading them are not the scan's): the check's share of a conversion, which runs it inside its
    one streaming pass."""
    from gguf import GGUFReader
    from gguf_arch.io.nonfinite import NonFiniteScan
    reader = GGUFReader(gguf)
    cpu = 0.0
    for t in reader.tensors:
        scan = NonFiniteScan(t.tensor_type)
        data = reader.data[t.data_offset:t.data_offset + int(t.n_bytes)]
        for start in range(0, data.size, 16 << 20):
            chunk = np.array(data[start:start + (16 << 20)])  # in memory first, as the converter's buffers are
            t0 = time.process_time()
            scan.feed(chunk)
            cpu += time.process_time() - t0
    return {"scan_cpu_s": round(cpu, 2)}


def run_all(workdir: Path, cold: bool, experts: int, llama_cpp: bool = True) -> dict:
    model, half = workdir / f"k3-large-e{experts}", workdir / f"k3-large-e{experts // 2}"
    synth(model, "--experts", str(experts))
    synth(half, "--experts", str(experts // 2))
    nbytes = sum(p.stat().st_size for p in _shards(model))
    out = workdir / "out"
    runs = {}
    prepare_cache(model, cold)
    runs["copy"] = measure(["cp", *map(str, _shards(model)), str(_fresh(out))], nbytes)
    prepare_cache(model, cold)
    ours = [sys.executable, str(REPO / "convert_kimi_k3.py"), "--quiet"]
    runs["ours"] = measure([*ours, str(model), str(_fresh(out) / "k3.gguf")], nbytes, cwd=REPO)
    scan = scan_cost(out / "k3.gguf")
    scan["share_of_ours_wall"] = round(scan["scan_cpu_s"] / runs["ours"]["wall_s"], 3)
    if llama_cpp:
        llama_dir = llama_cpp_tree(workdir)
        prepare_cache(model, cold)
        runs["llama_cpp"] = measure([sys.executable, "-c", LLAMA_RUNNER, str(llama_dir), str(model),
                                     str(_fresh(out) / "k3-llama.gguf")], nbytes)
    half_bytes = sum(p.stat().st_size for p in _shards(half))
    prepare_cache(half, cold)
    runs["ours_half_experts"] = measure([*ours, str(half), str(_fresh(out) / "k3-half.gguf")], half_bytes, cwd=REPO)
    shutil.rmtree(out, ignore_errors=True)
    return {
        "command": f"python bench/convert.py --workdir DIR --experts {experts}" + (" --cold" if cold else "")
                   + ("" if llama_cpp else " --no-llama-cpp"),
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release(),
                    "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
                    "loadavg_at_end": os.getloadavg()},
        "source": "disk (page cache dropped before each run)" if cold else "page cache (shards read once before each run)",
        "checkpoint": {"synth": [*SYNTH, "--experts", str(experts)], "bytes": nbytes, "shards": len(_shards(model)),
                       "half_experts_bytes": half_bytes},
        "runs": runs,
        "non_finite_scan": scan,
        "ratios": {"ours_vs_copy_throughput": round(runs["copy"]["wall_s"] / runs["ours"]["wall_s"], 3),
                   **({"ours_vs_llama_cpp_throughput": round(runs["llama_cpp"]["wall_s"] / runs["ours"]["wall_s"], 3)}
                      if llama_cpp else {}),
                   "ours_peak_rss_full_vs_half": round(runs["ours"]["peak_rss_mib"]
                                                       / runs["ours_half_experts"]["peak_rss_mib"], 3)},
        "targets": {"throughput_at_least_0.8x_copy": runs["copy"]["wall_s"] / runs["ours"]["wall_s"] >= 0.8,
                    "peak_rss_under_1_gib": runs["ours"]["peak_rss_mib"] < 1024},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, required=True,
                   help="where the checkpoints, llama.cpp's sources and the outputs go (needs ~40 GB free); "
                        "checkpoints already there are reused")
    p.add_argument("--cold", action="store_true", help="drop the page cache before each run (root) instead of warming it")
    p.add_argument("--experts", type=int, default=64, help="routed experts of the main checkpoint (64: 9.1 GB)")
    p.add_argument("--no-llama-cpp", action="store_true",
                   help="skip llama.cpp's converter (it needs the bench extra's transformers)")
    p.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "convert.json")
    args = p.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    result = run_all(args.workdir.resolve(), args.cold, args.experts, llama_cpp=not args.no_llama_cpp)
    text = json.dumps(result, indent=2)
    print(text)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
