"""Conversion benchmark: this converter against the disk's own limit, a plain copy and llama.cpp's converter.

    sudo python bench/convert.py --workdir /tmp/kimi-bench --no-llama-cpp

On one synthetic K3 checkpoint in the real on-disk format (`kimi-k3-synth --preset large
--variant k3`: real hidden size 7168, real expert shapes, 4 layers, 16 MXFP4 experts by default,
6.6 GB; ~17 GB free needed with the half-experts checkpoint and one output), in one run, each into
WORKDIR/out on the same filesystem, the page cache dropped (root) before each from-disk step:
  read_only   the shards to /dev/null, `cat` and `dd iflag=direct`;  write_only  `dd` of the
              output size, fsync'd, buffered and with oflag=direct (the faster of each pair
              counts: on this project's machine buffered I/O has cost up to ~10x the time and
              ~3 CPU-s per GB of kernel copies, erratically):
              ratio_to_read_bound = ours / max(read_only, write_only), the converter's distance
              from the physical limit of any converter;
  copy, ours  `cp` of the shards and `convert_kimi_k3.py MODEL OUT.gguf --quiet [--threads N]`,
              from disk and again from the page cache, each as a ratio to the copy of its run;
  stages      CPU seconds per GB of each stage, from the page cache, one stage at a time in this
              process: read (pread into 16 MiB buffers), transform/repack (producing the output
              bytes minus read and scan), non-finite scan, SHA-256 digest, write (our writer's CPU);
              and the projection of those for the real 1.56 TB checkpoint at 1, 3 and 7 GB/s;
  llama_cpp   llama.cpp's `convert_hf_to_gguf.py --outtype bf16` (same types as ours: bf16 kept,
              experts repacked to MXFP4), from the llama-cpp-python 0.3.36 source distribution
              fetched with `pip download` into WORKDIR (never into the repository), from disk;
and ours once more, from disk, on a checkpoint with half the experts, to show that peak RSS does
not follow the checkpoint size.

Each timing runs from the start of the command until its output is on disk (a `sync` after it:
our converter fsyncs every file before renaming it, cp and llama.cpp's converter do not). Peak
RSS is the child's VmHWM from /proc, polled every 20 ms; CPU seconds (user + system) are the
child's own, from wait4. MB/s is checkpoint bytes (10^6) per second for every run, so the ratios
are time ratios. The load average at the end is recorded: other sessions share the cores. Results
go to bench/results/convert.json (or --json); a one-line summary goes to stderr.

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
import math
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


def _gguf_chunks(gguf: Path):
    """(GGML type, chunk) over every tensor of `gguf`, each 16 MiB chunk copied into memory first
    (as the converter's buffers are), so the page faults of reading them count for no stage."""
    from gguf import GGUFReader
    reader = GGUFReader(gguf)
    for t in reader.tensors:
        data = reader.data[t.data_offset:t.data_offset + int(t.n_bytes)]
        for start in range(0, data.size, 16 << 20):
            yield t.tensor_type, np.array(data[start:start + (16 << 20)])


def _timed(fn) -> float:
    t0 = time.process_time()  # this process, every thread
    fn()
    return time.process_time() - t0


def _scan_and_digest_cpu(gguf: Path) -> tuple[float, float]:
    """CPU seconds of the non-finite scan (gguf_arch/io/nonfinite.py) and of SHA-256 (the
    manifest's digest) over every tensor byte of the GGUF just written."""
    import hashlib
    from gguf_arch.io.nonfinite import NonFiniteScan
    scan_s = digest_s = 0.0
    for qtype, chunk in _gguf_chunks(gguf):
        scan_s += _timed(lambda: NonFiniteScan(qtype).feed(chunk))
        digest_s += _timed(lambda: hashlib.sha256(chunk).digest())
    return scan_s, digest_s


def _read_cpu(model: Path) -> float:
    """CPU seconds of the converter's reader over every tensor byte, 16 MiB reads (those go around the
    page cache: from disk, whatever is cached)."""
    from gguf_arch.io.safetensors import NUMPY_DTYPES, open_checkpoint

    def read_all() -> None:
        with open_checkpoint(model) as ckpt:
            for e in ckpt.entries.values():
                step = (16 << 20) // NUMPY_DTYPES[e.meta.dtype].itemsize
                count = math.prod(e.meta.shape)
                for first in range(0, count, step):
                    ckpt.read_range(e, first, min(step, count - first))
    return _timed(read_all)


def _produce_cpu(model: Path) -> float:
    """CPU seconds of producing every output tensor's bytes as the converter does (read,
    transform/repack, non-finite scan), at -j 1, without hashing or writing them."""
    from gguf_arch.convert.run import OutputOptions, plan_files, source_chunks_for
    from gguf_arch.io.safetensors import open_checkpoint
    from quant_rules.rules import QuantOptions
    from gguf_arch.arch.config import load_config

    def produce() -> None:
        with open_checkpoint(model) as ckpt:
            p = plan_files(load_config(model), ckpt, model, model.parent / "unused.gguf", True, QuantOptions(),
                           OutputOptions(), lambda _m: None)
            chunks_for = source_chunks_for(p, ckpt, OutputOptions(), lambda _m: None)
            for f in p.files:
                for t in f.layout.tensors:
                    for _chunk in chunks_for(t):
                        pass
    return _timed(produce)


def stage_costs(model: Path, gguf: Path, out: Path) -> dict:
    """CPU seconds per GB (10^9 checkpoint bytes) of each stage, from the page cache, one thread
    at a time: read (pread), transform/repack (producing the output bytes minus read and scan),
    non-finite scan, digest (SHA-256), write (the converter's writer, the output's size, fsync'd)."""
    nbytes = sum(p.stat().st_size for p in _shards(model))
    write_s = _write_cpu(out / "write-stage", gguf.stat().st_size)
    prepare_cache(model, cold=False)
    read_s = _read_cpu(model)
    produce_s = _produce_cpu(model)
    scan_s, digest_s = _scan_and_digest_cpu(gguf)
    cpu = {"read": read_s, "transform_repack": max(0.0, produce_s - read_s - scan_s), "non_finite_scan": scan_s,
           "digest_sha256": digest_s, "write": write_s}
    per_gb = {k: round(v / (nbytes / 1e9), 3) for k, v in cpu.items()}
    return {"cpu_s": {k: round(v, 2) for k, v in cpu.items()}, "cpu_s_per_gb": per_gb,
            "total_cpu_s_per_gb": round(sum(per_gb.values()), 3)}


def projection(cpu_s_per_gb: float, cores: int, total_tb: float = 1.56) -> dict:
    """Time for the real checkpoint at a disk speed: the larger of the disk's time (reading it;
    the output is about the input's size and a separate disk is assumed) and the CPU's
    (measured CPU per GB spread perfectly over `cores`: the stages run on their own threads)."""
    gb = total_tb * 1000
    cpu_wall = gb * cpu_s_per_gb / cores
    rows = {}
    for disk in (1, 3, 7):
        disk_s = gb / disk
        rows[f"{disk}_gb_per_s"] = {"disk_s": round(disk_s), "cpu_s_on_cores": round(cpu_wall),
                                    "bound": "cpu" if cpu_wall > disk_s else "disk",
                                    "minutes": round(max(disk_s, cpu_wall) / 60, 1),
                                    "cores_to_keep_up": math.ceil(gb * cpu_s_per_gb / disk_s)}
    return {"checkpoint_tb": total_tb, "cores": cores, "cpu_s_per_gb": cpu_s_per_gb, "disks": rows}


def bounds(model: Path, nbytes: int, out: Path) -> dict:
    """From disk: the read-only time of the shards (`cat > /dev/null`, and `dd iflag=direct`) and
    the write-only time of `nbytes` (`dd` from /dev/zero, fsync'd), through the page cache and
    around it (`oflag=direct`); each the faster of its two: the physical limit of any converter."""
    reads = {}
    for method, cmd in (("buffered", 'cat "$@" > /dev/null'),
                        ("direct", 'for f; do dd if="$f" of=/dev/null bs=16M iflag=direct status=none; done')):
        prepare_cache(model, cold=True)
        reads[method] = measure(["sh", "-c", cmd, "read", *map(str, _shards(model))], nbytes)
    read = min(reads.values(), key=lambda r: r["wall_s"])
    read = {**read, "method": min(reads, key=lambda k: reads[k]["wall_s"])}
    writes = {}
    for method, flags in (("buffered", []), ("direct", ["oflag=direct"])):
        prepare_cache(model, cold=True)
        mib = -(-nbytes // (16 << 20))
        writes[method] = measure(["dd", "if=/dev/zero", f"of={_fresh(out) / 'zeros'}", "bs=16M", f"count={mib}",
                                  *flags, "conv=fsync", "status=none"], nbytes)
    shutil.rmtree(out, ignore_errors=True)
    best = min(writes, key=lambda k: writes[k]["wall_s"])
    return {"read_only": read, "read_only_buffered": reads["buffered"], "read_only_direct": reads["direct"],
            "write_only": {**writes[best], "method": best},
            "write_only_buffered": writes["buffered"], "write_only_direct": writes["direct"]}


def _write_cpu(out: Path, nbytes: int) -> float:
    """CPU seconds of the converter's writer (gguf_arch/io/direct_io.py: staging copy plus the
    write) putting `nbytes` of 16 MiB chunks on disk, fsync'd."""
    from gguf_arch.io.direct_io import SequentialWriter
    chunk = np.ones(16 << 20, np.uint8)  # not zeros: no page of it may be shared

    def write_all() -> None:
        fd = os.open(_fresh(out) / "written", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            with SequentialWriter(fd) as w:
                for start in range(0, nbytes, chunk.size):
                    w.write(chunk[:min(chunk.size, nbytes - start)])
                w.finish()
        finally:
            os.close(fd)
    cpu = _timed(write_all)
    shutil.rmtree(out, ignore_errors=True)
    return cpu


def _ours(threads: int | None) -> list[str]:
    return [sys.executable, str(REPO / "convert_kimi_k3.py"), "--quiet",
            *(["--threads", str(threads)] if threads else [])]


def compare(model: Path, out: Path, nbytes: int, cold: bool, threads: int | None) -> dict:
    """cp and ours, from the page cache or (cold) from disk, in this order."""
    prepare_cache(model, cold)
    copy = measure(["cp", *map(str, _shards(model)), str(_fresh(out))], nbytes)
    prepare_cache(model, cold)
    ours = measure([*_ours(threads), str(model), str(_fresh(out) / "k3.gguf")], nbytes, cwd=REPO)
    return {"source": "disk (page cache dropped before each step)" if cold else
            "page cache (shards read once before each step)", "copy": copy, "ours": ours,
            "ours_time_vs_copy": round(ours["wall_s"] / copy["wall_s"], 3),
            "ours_throughput_vs_copy": round(copy["wall_s"] / ours["wall_s"], 3)}


def _can_drop_caches() -> str | None:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as exc:
        return f"cannot drop the page cache ({exc}): the from-disk figures are not measured"
    return None


def _measured(workdir: Path, experts: int, threads: int | None, llama_cpp: bool) -> dict:
    """Every measurement, in an order that keeps each from-disk step after a cache drop."""
    model, half = workdir / f"k3-large-e{experts}", workdir / f"k3-large-e{experts // 2}"
    synth(model, "--experts", str(experts))
    synth(half, "--experts", str(experts // 2))
    nbytes = sum(p.stat().st_size for p in _shards(model))
    out = workdir / "out"
    problem = _can_drop_caches()
    if problem:
        raise SystemExit(f"error: {problem} (run as root)")
    m = {"nbytes": nbytes, "shards": len(_shards(model)), "disk": bounds(model, nbytes, out),
         "cold": compare(model, out, nbytes, True, threads), "warm": compare(model, out, nbytes, False, threads)}
    m["stages"] = stage_costs(model, out / "k3.gguf", out)
    runs = m["runs"] = {}
    if llama_cpp:
        llama_dir = llama_cpp_tree(workdir)
        prepare_cache(model, True)
        runs["llama_cpp_from_disk"] = measure([sys.executable, "-c", LLAMA_RUNNER, str(llama_dir), str(model),
                                               str(_fresh(out) / "k3-llama.gguf")], nbytes)
    m["half_bytes"] = sum(p.stat().st_size for p in _shards(half))
    prepare_cache(half, True)
    runs["ours_half_experts_from_disk"] = measure([*_ours(threads), str(half), str(_fresh(out) / "k3-half.gguf")],
                                                  m["half_bytes"], cwd=REPO)
    shutil.rmtree(out, ignore_errors=True)
    return m


def run_all(workdir: Path, experts: int, threads: int | None, llama_cpp: bool = True) -> dict:
    m = _measured(workdir, experts, threads, llama_cpp)
    disk, cold, warm, stages, runs = m["disk"], m["cold"], m["warm"], m["stages"], m["runs"]
    nbytes, half_bytes = m["nbytes"], m["half_bytes"]
    read_bound = max(disk["read_only"]["wall_s"], disk["write_only"]["wall_s"])
    cores = len(os.sched_getaffinity(0))
    ratio = round(cold["ours"]["wall_s"] / read_bound, 3)
    return {
        "command": f"python bench/convert.py --workdir DIR --experts {experts}"
                   + (f" --threads {threads}" if threads else "") + ("" if llama_cpp else " --no-llama-cpp"),
        "machine": {"cpus": os.cpu_count(), "affinity_cpus": cores, "kernel": platform.release(),
                    "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
                    "loadavg_at_end": os.getloadavg()},
        "converter_threads": threads or cores,
        "checkpoint": {"synth": [*SYNTH, "--experts", str(experts)], "bytes": nbytes, "shards": m["shards"],
                       "half_experts_bytes": half_bytes},
        "disk_bounds": disk,
        "from_disk": cold,
        "page_cache": warm,
        "ratio_to_read_bound": ratio,
        "stages": stages,
        "projection_1_56_tb": projection(stages["total_cpu_s_per_gb"], cores),
        "runs": runs,
        "targets": {"ratio_to_read_bound_at_most_1.25": ratio <= 1.25,
                    "from_disk_throughput_at_least_0.8x_copy": cold["ours_throughput_vs_copy"] >= 0.8,
                    "page_cache_throughput_at_least_0.8x_copy": warm["ours_throughput_vs_copy"] >= 0.8,
                    "peak_rss_under_1_gib": cold["ours"]["peak_rss_mib"] < 1024,
                    "peak_rss_full_vs_half_experts": round(cold["ours"]["peak_rss_mib"]
                                                           / runs["ours_half_experts_from_disk"]["peak_rss_mib"], 3)},
    }


def _print_summary(r: dict) -> None:
    st = r["stages"]["cpu_s_per_gb"]
    print("CPU-s per GB: " + ", ".join(f"{k} {v}" for k, v in st.items()) + f"; total {r['stages']['total_cpu_s_per_gb']}",
          file=sys.stderr)
    d, c, w = r["disk_bounds"], r["from_disk"], r["page_cache"]
    print(f"from disk: read-only {d['read_only']['wall_s']} s ({d['read_only']['method']}; buffered "
          f"{d['read_only_buffered']['wall_s']} s), write-only {d['write_only']['wall_s']} s "
          f"({d['write_only']['method']}; buffered {d['write_only_buffered']['wall_s']} s), "
          f"cp {c['copy']['wall_s']} s, ours {c['ours']['wall_s']} s: ratio_to_read_bound {r['ratio_to_read_bound']}, "
          f"ours/cp {c['ours_time_vs_copy']}; page cache: cp {w['copy']['wall_s']} s, ours {w['ours']['wall_s']} s, "
          f"ours/cp {w['ours_time_vs_copy']}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, required=True,
                   help="where the checkpoints, llama.cpp's sources and the outputs go (needs ~40 GB free); "
                        "checkpoints already there are reused")
    p.add_argument("--experts", type=int, default=16, help="routed experts of the main checkpoint (16: 6.6 GB)")
    p.add_argument("--threads", type=int, help="the converter's -j (default: its own, the CPUs it may run on)")
    p.add_argument("--no-llama-cpp", action="store_true",
                   help="skip llama.cpp's converter (it needs the bench extra's transformers)")
    p.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "convert.json")
    args = p.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    result = run_all(args.workdir.resolve(), args.experts, args.threads, llama_cpp=not args.no_llama_cpp)
    text = json.dumps(result, indent=2)
    print(text)
    _print_summary(result)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
