"""Conversion benchmark: this converter against the disk's own limit and a plain copy, from disk and
from the page cache, at 1 and 2 threads; the CPU each stage costs per GB.

    python bench/convert.py --workdir /tmp/kimi-bench [--no-llama-cpp]

On one synthetic K3.1-Pro checkpoint in the real on-disk format (`kimi-k3-synth --preset large
--variant k31pro`: real hidden size 7168, real expert shapes, 4 layers, 64 MXFP4 experts, 9.1 GB;
~40 GB free needed with the half-experts checkpoint, one output and one copy), in one run, each
into WORKDIR/out on the same file system:
  from disk   the page cache dropped before each step (as root: /proc/sys/vm/drop_caches; where
              that is refused, posix_fadvise(DONTNEED) on every shard and output file, said in
              the results): read_only = the shards to /dev/null, the faster of `cat` and
              `dd iflag=direct`; write_only = `dd` of the output's size from /dev/zero, fsync'd,
              buffered and oflag=direct, the faster; copy = `cp --reflink=never` of the shards;
              ours = `convert_kimi_k3.py MODEL OUT.gguf --quiet -j N` for N in 1 and 2;
              ratio_to_read_only = ours / read_only, ratio_to_read_bound = ours / max(read_only,
              write_only) (the physical limit of any converter on this disk);
  page cache  the shards read once before each step (the "infinitely fast disk"): read_only
              (`cat`), copy and ours at -j 1 and 2, each as a throughput ratio to the copy;
  stages      CPU seconds per GB of each stage, one at a time in this process, from the page cache
              (bench/convert_stages.py: read, transform/repack, non-finite scan, BLAKE3 digest,
              write; and SHA-256, the digest before BLAKE3, beside them), and the projection for
              the real 1.56 TB checkpoint: cores needed to keep up with 1, 3 and 7 GB/s disks,
              from the stages' total and from the conversion's own measured CPU per GB;
  llama_cpp   (unless --no-llama-cpp) llama.cpp's `convert_hf_to_gguf.py --outtype bf16` from the
              llama-cpp-python 0.3.36 source distribution fetched with `pip download` into WORKDIR,
              from disk;
and ours once more, from disk, on a checkpoint with half the experts (`--experts 32`), to show that
peak RSS does not follow the checkpoint size.

Each timing runs from the start of the command until its output is on disk (a `sync` after it:
our converter fsyncs every file before renaming it, cp and llama.cpp's converter do not). Peak
RSS is the child's VmHWM from /proc, polled every 20 ms; CPU seconds (user + system) are the
child's own, from wait4. MB/s is checkpoint bytes (10^6) per second for every run, so the ratios
are time ratios. The load average at the end is recorded: other sessions share the cores. Results
go to bench/results/convert.json (or --json); a summary goes to stderr.

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
import datetime
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.convert_stages import stage_costs  # noqa: E402

SDIST = "llama-cpp-python==0.3.36"
SYNTH = ["--preset", "large", "--variant", "k31pro"]
EXPERTS = 64  # the preset's: 9.1 GB
THREADS = (1, 2)
POLL_S = 0.02
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "sha_ni")

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


def drop_method() -> str:
    """How this run empties the page cache: drop_caches (root), else fadvise on each file."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return "posix_fadvise(DONTNEED) on every shard and output file"
    return "/proc/sys/vm/drop_caches"


def _fadvise_out(paths) -> None:
    for path in paths:
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def prepare_cache(model: Path, cold: bool, out: Path | None = None) -> None:
    """Warm: every shard read once (page cache); cold: the cache dropped, or the shards' and
    the outputs' pages advised out where that is refused."""
    os.sync()
    if cold:
        try:
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
        except OSError:
            _fadvise_out([*_shards(model), *(out.rglob("*") if out and out.exists() else [])])
        return
    for shard in _shards(model):
        with open(shard, "rb") as f:
            while f.read(64 << 20):
                pass


def synth(model: Path, experts: int) -> None:
    if (model / "config.json").exists():
        return
    subprocess.run([sys.executable, "-m", "gguf_arch.synth.cli", str(model), *SYNTH, "--experts", str(experts)],
                   cwd=REPO, check=True, stdout=subprocess.DEVNULL)


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


def _cat(model: Path, nbytes: int) -> dict:
    return measure(["sh", "-c", 'cat "$@" > /dev/null', "read", *map(str, _shards(model))], nbytes)


def bounds(model: Path, nbytes: int, out: Path) -> dict:
    """From disk: the read-only time of the shards (`cat > /dev/null`, and `dd iflag=direct`) and
    the write-only time of `nbytes` (`dd` from /dev/zero, fsync'd), through the page cache and
    around it (`oflag=direct`); each the faster of its two: the physical limit of any converter."""
    reads = {}
    prepare_cache(model, cold=True, out=out)
    reads["buffered"] = _cat(model, nbytes)
    prepare_cache(model, cold=True, out=out)
    reads["direct"] = measure(["sh", "-c", 'for f; do dd if="$f" of=/dev/null bs=16M iflag=direct status=none; done',
                               "read", *map(str, _shards(model))], nbytes)
    writes = {}
    for method, flags in (("buffered", []), ("direct", ["oflag=direct"])):
        prepare_cache(model, cold=True, out=out)
        mib = -(-nbytes // (16 << 20))
        writes[method] = measure(["dd", "if=/dev/zero", f"of={_fresh(out) / 'zeros'}", "bs=16M", f"count={mib}",
                                  *flags, "conv=fsync", "status=none"], nbytes)
    shutil.rmtree(out, ignore_errors=True)
    read, write = (min(d, key=lambda k: d[k]["wall_s"]) for d in (reads, writes))
    return {"read_only": {**reads[read], "method": read}, "read_only_buffered": reads["buffered"],
            "read_only_direct": reads["direct"], "write_only": {**writes[write], "method": write},
            "write_only_buffered": writes["buffered"], "write_only_direct": writes["direct"]}


def _ours(threads: int) -> list[str]:
    return [sys.executable, str(REPO / "convert_kimi_k3.py"), "--quiet", "--threads", str(threads)]


def compare(model: Path, out: Path, nbytes: int, cold: bool) -> dict:
    """cp and ours at each of THREADS, from the page cache or (cold) from disk, in this order."""
    prepare_cache(model, cold, out)
    copy = measure(["cp", "--reflink=never", *map(str, _shards(model)), str(_fresh(out))], nbytes)
    ours = {}
    for threads in THREADS:
        prepare_cache(model, cold, out)
        ours[f"j{threads}"] = measure([*_ours(threads), str(model), str(_fresh(out) / "k.gguf")], nbytes, cwd=REPO)
    best = min(ours, key=lambda k: ours[k]["wall_s"])
    return {"copy": copy, "ours": ours,
            "throughput_vs_copy": {k: round(copy["wall_s"] / r["wall_s"], 3) for k, r in ours.items()},
            "best": best, "best_throughput_vs_copy": round(copy["wall_s"] / ours[best]["wall_s"], 3)}


def projection(cpu_s_per_gb: float, total_tb: float = 1.56) -> dict:
    """The real checkpoint at 1, 3 and 7 GB/s: the disk's time (reading it; the output is about
    the input's size and goes to another disk) and the cores whose CPU keeps up with that disk
    (`cpu_s_per_gb` spread perfectly over them: every stage runs on threads of its own)."""
    gb = total_tb * 1000
    return {f"{disk}_gb_per_s": {"disk_minutes": round(gb / disk / 60, 1),
                                 "cores_to_keep_up": math.ceil(disk * cpu_s_per_gb)} for disk in (1, 3, 7)}


def _cpu_info() -> dict:
    info = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    flags = info.get("flags", "").split()
    return {"model_name": info.get("model name"), "flags": [f for f in CPU_FLAGS if f in flags]}


def _disk(path: Path) -> dict:
    src = subprocess.run(["df", "--output=source,fstype", str(path)], capture_output=True, text=True).stdout.split()
    return {"device": src[-2] if len(src) >= 2 else None, "fstype": src[-1] if src else None}


def _measured(workdir: Path, llama_cpp: bool) -> dict:
    """Every measurement, in an order that keeps each from-disk step after a cache drop."""
    model, half = workdir / "k31pro-large", workdir / f"k31pro-large-e{EXPERTS // 2}"
    synth(model, EXPERTS)
    synth(half, EXPERTS // 2)
    nbytes = sum(p.stat().st_size for p in _shards(model))
    out = workdir / "out"
    m = {"nbytes": nbytes, "shards": len(_shards(model)), "drop": drop_method(), "disk": bounds(model, nbytes, out),
         "cold": compare(model, out, nbytes, True)}
    prepare_cache(model, cold=False)
    m["warm_read_only"] = _cat(model, nbytes)
    m["warm"] = compare(model, out, nbytes, False)
    prepare_cache(model, cold=False)
    m["stages"] = stage_costs(model, out / "k.gguf", workdir / "stage-scratch")
    runs = m["runs"] = {}
    if llama_cpp:
        llama_dir = llama_cpp_tree(workdir)
        prepare_cache(model, True, out)
        runs["llama_cpp_from_disk"] = measure([sys.executable, "-c", LLAMA_RUNNER, str(llama_dir), str(model),
                                               str(_fresh(out) / "k-llama.gguf")], nbytes)
    m["half_bytes"] = sum(p.stat().st_size for p in _shards(half))
    prepare_cache(half, True, out)
    runs["ours_half_experts_from_disk"] = measure([*_ours(max(THREADS)), str(half), str(_fresh(out) / "k-half.gguf")],
                                                  m["half_bytes"], cwd=REPO)
    shutil.rmtree(out, ignore_errors=True)
    return m


def _targets(m: dict) -> dict:
    cold, warm, disk, runs = m["cold"], m["warm"], m["disk"], m["runs"]
    rss = max(r["peak_rss_mib"] for c in (cold, warm) for r in c["ours"].values())
    ratio = round(cold["ours"][cold["best"]]["wall_s"] / disk["read_only"]["wall_s"], 3)
    return {"from_disk_ratio_to_read_only": ratio, "from_disk_at_most_1.25x_read_only": ratio <= 1.25,
            "page_cache_throughput_vs_copy": warm["best_throughput_vs_copy"],
            "page_cache_at_least_1.0x_copy": warm["best_throughput_vs_copy"] >= 1.0,
            "stages_total_cpu_s_per_gb": m["stages"]["total_cpu_s_per_gb"],
            "stages_total_at_most_0.6": m["stages"]["total_cpu_s_per_gb"] <= 0.6,
            "peak_rss_mib": rss, "peak_rss_under_1_gib": rss < 1024,
            "peak_rss_full_vs_half_experts": round(cold["ours"][f"j{max(THREADS)}"]["peak_rss_mib"]
                                                   / runs["ours_half_experts_from_disk"]["peak_rss_mib"], 3)}


def run_all(workdir: Path, llama_cpp: bool = True) -> dict:
    m = _measured(workdir, llama_cpp)
    (workdir / "convert-measured.json").write_text(json.dumps(m, indent=1))  # kept if what follows fails
    disk = m["disk"]
    read_bound = max(disk["read_only"]["wall_s"], disk["write_only"]["wall_s"])
    measured_cpu = round(m["warm"]["ours"]["j1"]["cpu_s"] / (m["nbytes"] / 1e9), 3)
    return {
        "command": "python bench/convert.py --workdir DIR" + ("" if llama_cpp else " --no-llama-cpp"),
        "date": datetime.date.today().isoformat(),
        "machine": {"cpu": _cpu_info(), "cpus": os.cpu_count(), "affinity_cpus": len(os.sched_getaffinity(0)),
                    "kernel": platform.release(), "disk": _disk(workdir),
                    "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
                    "loadavg_at_end": os.getloadavg()},
        "page_cache_dropped_by": m["drop"],
        "checkpoint": {"synth": [*SYNTH, "--experts", str(EXPERTS)], "bytes": m["nbytes"], "shards": m["shards"],
                       "half_experts_bytes": m["half_bytes"]},
        "disk_bounds": disk,
        "from_disk": {**m["cold"], "ratio_to_read_bound": round(m["cold"]["ours"][m["cold"]["best"]]["wall_s"]
                                                                / read_bound, 3)},
        "page_cache": {**m["warm"], "read_only": m["warm_read_only"]},
        "stages": m["stages"],
        "projection_1_56_tb": {"from_stages": projection(m["stages"]["total_cpu_s_per_gb"]),
                               "from_measured_j1_cpu": {"cpu_s_per_gb": measured_cpu, **projection(measured_cpu)}},
        "runs": m["runs"],
        "targets": _targets(m),
    }


def _print_summary(r: dict) -> None:
    st = r["stages"]["cpu_s_per_gb"]
    print("CPU-s per GB: " + ", ".join(f"{k} {v}" for k, v in st.items())
          + f"; total {r['stages']['total_cpu_s_per_gb']}", file=sys.stderr)
    d, c, w = r["disk_bounds"], r["from_disk"], r["page_cache"]
    for name, run in (("from disk", c), ("page cache", w)):
        ours = ", ".join(f"ours -{k} {r['wall_s']} s" for k, r in run["ours"].items())
        print(f"{name}: cp {run['copy']['wall_s']} s, {ours}; best throughput vs cp {run['best_throughput_vs_copy']}",
              file=sys.stderr)
    print(f"read-only from disk {d['read_only']['wall_s']} s ({d['read_only']['method']}), from the page cache "
          f"{w['read_only']['wall_s']} s; targets {json.dumps(r['targets'])}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, required=True,
                   help="where the checkpoints, llama.cpp's sources and the outputs go (needs ~40 GB free); "
                        "checkpoints already there are reused")
    p.add_argument("--no-llama-cpp", action="store_true",
                   help="skip llama.cpp's converter (it needs the bench extra's transformers)")
    p.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "convert.json")
    args = p.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    result = run_all(args.workdir.resolve(), llama_cpp=not args.no_llama_cpp)
    text = json.dumps(result, indent=2)
    print(text)
    _print_summary(result)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
