"""Planning benchmark: the work done before (or instead of) moving tensor bytes, at real size.

    python bench/planning.py [--reference tests/fixtures/reference]

Each operation is timed next to a named baseline measured in the same run: the parse or load that
the operation cannot avoid, so the ratio says how much the project's own work adds to it.

  dry_run            `convert_kimi_k3.py MODEL OUT --dry-run` on the real K3 config and 497,220-name
                     index (no shards)      vs  baseline: `json.load` of that index in a fresh
                     interpreter (the same process start included);
  print_tensor_types `--print-tensor-types --outtype q8_0` on the real K3.1-Pro plan (the K3 index
                     plus the indexer fields and tensors of docs/reference/config.md)  vs  the same baseline;
  merge_recovery     gguf_arch.arch.tokenizer.recover_merges on a 163,584-rank random merge tree with the
                     real vocabulary's token lengths  vs  baseline: building tiktoken's own
                     Encoding from the same ranks;
  shard_header       gguf_arch.io.safetensors.read_shard_header on a header of 100,000 tensors
                     vs  baseline: `json.loads` of that header.

Times are wall and CPU seconds (the minimum of --repeats runs; CPU of the child for the
command-line runs). Results: bench/results/planning.json (or --json). The tests check what these
operations produce; how long they take is measured here, not asserted there.
"""
from __future__ import annotations

import argparse
import gzip
import json
import random
import resource
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gguf_arch.io.safetensors import read_shard_header  # noqa: E402
from gguf_arch.arch.tokenizer import recover_merges  # noqa: E402
from tests.support.real_plan import write_k31pro_plan  # noqa: E402


def _child(cmd: list[str]) -> tuple[float, float]:
    """(wall s, CPU s) of one child process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _in_process(fn: Callable[[], object]) -> tuple[float, float]:
    start, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - start, time.process_time() - cpu


def _best(measure: Callable[[], tuple[float, float]], repeats: int) -> dict:
    runs = [measure() for _ in range(repeats)]
    return {"wall_s": round(min(w for w, _ in runs), 3), "cpu_s": round(min(c for _, c in runs), 3)}


def _pair(name: str, ours: dict, baseline_name: str, baseline: dict) -> dict:
    ratio = round(ours["wall_s"] / baseline["wall_s"], 2)
    print(f"{name:20s} {ours['wall_s']:7.2f} s wall {ours['cpu_s']:7.2f} s CPU   "
          f"{baseline_name}: {baseline['wall_s']:6.2f} s   ratio {ratio}x")
    return {"ours": ours, "baseline": {"what": baseline_name, **baseline}, "ratio_wall": ratio}


def _k3_model_dir(reference: Path, work: Path) -> Path:
    model = work / "kimi-k3"
    model.mkdir()
    shutil.copy(reference / "kimi-k3-config.json", model / "config.json")
    with gzip.open(reference / "kimi-k3-model.safetensors.index.json.gz") as src:
        (model / "model.safetensors.index.json").write_bytes(src.read())
    return model


def _random_vocab(n_ranks: int = 163_584) -> list[bytes]:
    rng = random.Random(1)
    ranks = [bytes([b]) for b in range(256)]
    seen = set(ranks)
    while len(ranks) < n_ranks:  # a random merge tree with real-vocabulary token lengths (mean ~8 bytes)
        n = len(ranks)
        token = ranks[int(n * rng.random() ** 5)] + ranks[int(n * rng.random() ** 5)]
        if len(token) <= 24 and token not in seen:
            seen.add(token)
            ranks.append(token)
    return ranks


def _header_file(work: Path, n: int = 100_000) -> tuple[Path, bytes]:
    text = json.dumps({f"t{i}": {"dtype": "U8", "shape": [1], "data_offsets": [i, i + 1]} for i in range(n)}).encode()
    path = work / "model-00001-of-000001.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(n))
    return path, text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reference", type=Path, default=REPO / "tests" / "fixtures" / "reference",
                   help="folder with kimi-k3-config.json and kimi-k3-model.safetensors.index.json.gz")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "planning.json")
    args = p.parse_args(argv)
    import tiktoken

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        k3 = _k3_model_dir(args.reference, work)
        k31 = work / "kimi-k3.1-pro"
        k31.mkdir()
        write_k31pro_plan(k31)
        index = k3 / "model.safetensors.index.json"
        load_index = _best(lambda: _child([sys.executable, "-c", f"import json; json.load(open({str(index)!r}))"]),
                           args.repeats)
        conv = [sys.executable, "convert_kimi_k3.py"]
        results = {
            "dry_run": _pair("dry_run", _best(lambda: _child(conv + [str(k3), str(work / "o.gguf"), "--dry-run"]),
                                              args.repeats), "json.load of the index", load_index),
            "print_tensor_types": _pair(
                "print_tensor_types",
                _best(lambda: _child(conv + [str(k31), "--print-tensor-types", "--outtype", "q8_0"]), args.repeats),
                "json.load of the index", load_index),
        }
        ranks = _random_vocab()
        mergeable = {token: rank for rank, token in enumerate(ranks)}
        results["merge_recovery"] = _pair(
            "merge_recovery", _best(lambda: _in_process(lambda: recover_merges(ranks)), args.repeats),
            "tiktoken.Encoding from the ranks",
            _best(lambda: _in_process(lambda: tiktoken.Encoding("bench", pat_str=r"\S+|\s+", mergeable_ranks=mergeable,
                                                                special_tokens={})), args.repeats))
        shard, header = _header_file(work)
        results["shard_header"] = _pair(
            "shard_header", _best(lambda: _in_process(lambda: read_shard_header(shard)), args.repeats),
            "json.loads of the header", _best(lambda: _in_process(lambda: json.loads(header)), args.repeats))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"command": "python bench/planning.py", "repeats": args.repeats,
                                     "results": results}, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
