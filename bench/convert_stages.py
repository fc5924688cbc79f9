"""The conversion's CPU per stage, for bench/convert.py: each stage run alone in this process, on
every byte of one checkpoint and its GGUF, timed with process_time (this process, every thread).

    python bench/convert_stages.py MODEL_DIR OUT.gguf SCRATCH_DIR   (prints the JSON)

Stages, in CPU seconds per GB (10^9 checkpoint bytes):
  read              the converter's reader over every tensor byte in 16 MiB ranges (O_DIRECT from
                    disk, through the page cache for ranges it holds: `io/residency.py`)
  transform_repack  producing every output tensor's bytes as the converter does (read, transforms,
                    MXFP4 repack, non-finite scan) at -j 1, minus read and scan
  non_finite_scan   io/nonfinite.py over every tensor byte of the GGUF
  digest            the manifest's hash (BLAKE3, io/digests.py) over the same bytes; the SHA-256
                    of manifests before it is measured beside it (digest_sha256_before), not summed
  write             the converter's writer (io/direct_io.py: O_DIRECT writes, fsync) putting the
                    output's size on disk from chunks laid out as the converter's reach it
                    (io/buffers.py: written straight from their memory, no staging copy)
Each stage's figure is the least of 3 rounds (all rounds' totals are recorded).
Every chunk the scan and the digests see is copied into memory first (as the converter's buffers
are), so the page faults of reading the GGUF count for no stage.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CHUNK = 16 << 20


def _timed(fn) -> float:
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def _gguf_chunks(gguf: Path):
    """(GGML type, 16 MiB chunk copied into memory) over every tensor of `gguf`."""
    from gguf import GGUFReader
    reader = GGUFReader(gguf)
    for t in reader.tensors:
        data = reader.data[t.data_offset:t.data_offset + int(t.n_bytes)]
        for start in range(0, data.size, CHUNK):
            yield t.tensor_type, np.array(data[start:start + CHUNK])


def _scan_and_digests(gguf: Path) -> dict[str, float]:
    import hashlib
    from gguf_arch.io.digests import new_hash
    from gguf_arch.io.nonfinite import NonFiniteScan
    cpu = {"non_finite_scan": 0.0, "digest": 0.0, "digest_sha256_before": 0.0}
    for qtype, chunk in _gguf_chunks(gguf):
        cpu["non_finite_scan"] += _timed(lambda: NonFiniteScan(qtype).feed(chunk))
        cpu["digest"] += _timed(lambda: new_hash("blake3").update(chunk))
        cpu["digest_sha256_before"] += _timed(lambda: hashlib.sha256(chunk).digest())
    return cpu


def _read(model: Path) -> float:
    from gguf_arch.io.safetensors import NUMPY_DTYPES, open_checkpoint

    def read_all() -> None:
        with open_checkpoint(model) as ckpt:
            for e in ckpt.entries.values():
                step = CHUNK // NUMPY_DTYPES[e.meta.dtype].itemsize
                count = math.prod(e.meta.shape)
                for first in range(0, count, step):
                    ckpt.read_range(e, first, min(step, count - first))
    return _timed(read_all)


def _produce(model: Path) -> float:
    from gguf_arch.arch.config import load_config
    from gguf_arch.convert.run import OutputOptions, plan_files, source_chunks_for
    from gguf_arch.io.safetensors import open_checkpoint
    from quant_rules.rules import QuantOptions

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


def _write(scratch: Path, nbytes: int) -> float:
    from gguf_arch.io.buffers import placed
    from gguf_arch.io.direct_io import SequentialWriter
    chunk = placed(CHUNK, 0)  # laid out as the converter's chunks reach the writer (every offset is k * CHUNK)
    chunk[:] = 1  # not zeros: no page of it may be shared
    scratch.mkdir(parents=True, exist_ok=True)
    path = scratch / "written"

    def write_all() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            with SequentialWriter(fd) as w:
                for start in range(0, nbytes, chunk.size):
                    w.write(chunk[:min(chunk.size, nbytes - start)])
                w.finish()
        finally:
            os.close(fd)
    cpu = _timed(write_all)
    shutil.rmtree(scratch, ignore_errors=True)
    return cpu


def _one_round(model: Path, gguf: Path, scratch: Path) -> dict[str, float]:
    cpu = {"write": _write(scratch, gguf.stat().st_size), "read": _read(model)}
    produce = _produce(model)
    cpu.update(_scan_and_digests(gguf))
    cpu["transform_repack"] = max(0.0, produce - cpu["read"] - cpu["non_finite_scan"])
    return cpu


def stage_costs(model: Path, gguf: Path, scratch: Path, repeats: int = 3) -> dict:
    """CPU seconds and CPU seconds per GB of each stage (the shards should be in the page cache):
    the least of `repeats` rounds per stage, as the other benchmarks take their best round (the
    first round pays page faults of fresh buffers, and the machine may be shared)."""
    nbytes = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    rounds = [_one_round(model, gguf, scratch) for _ in range(repeats)]
    cpu = {k: min(r[k] for r in rounds) for k in rounds[0]}
    per_gb = {k: round(v / (nbytes / 1e9), 3) for k, v in cpu.items()}
    summed = [k for k in per_gb if k != "digest_sha256_before"]
    return {"cpu_s": {k: round(v, 2) for k, v in cpu.items()}, "cpu_s_per_gb": per_gb,
            "total_cpu_s_per_gb": round(sum(per_gb[k] for k in summed), 3), "summed": summed,
            "rounds_total_cpu_s_per_gb": [round(sum(r[k] for k in summed) / (nbytes / 1e9), 3) for r in rounds]}


if __name__ == "__main__":
    print(json.dumps(stage_costs(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])), indent=2))
