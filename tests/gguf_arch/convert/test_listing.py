"""--dry-run: the plan from config and headers in seconds, exact sizes, nothing written."""
from __future__ import annotations

import gzip
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGUFReader
from gguf import GGMLQuantizationType as Q

import convert_kimi_k3
from quant_rules.rules import type_name

from tests.support.paths import REPO

REAL_K3_TENSORS = 2573
FILE_LINE = re.compile(r"^file (\S+): (\d+) tensors, (\d+) bytes")
TENSOR_LINE = re.compile(r"^  (\S+)\s+(\S+)\s+(\d+)$")
TOTAL_LINE = re.compile(r"^total: (\d+) file\(s\), (\d+) tensors, (\d+) bytes")


def _parse(text: str) -> tuple[list[tuple], dict[str, list[tuple]], tuple]:
    files, tensors, total, current = [], {}, None, None
    for line in text.splitlines():
        if m := FILE_LINE.match(line):
            current = m[1]
            files.append((Path(m[1]).name, int(m[2]), int(m[3])))
            tensors[current] = []
        elif m := TENSOR_LINE.match(line):
            tensors[current].append((m[1], m[2], int(m[3])))
        elif m := TOTAL_LINE.match(line):
            total = (int(m[1]), int(m[2]), int(m[3]))
    return files, tensors, total


# In a child: planning 497k names in the test process would leave pytest ~1 GB larger, and tests that
# read a child's ru_maxrss (inherited across fork) would measure that.
_LISTING = """
import json, sys
from pathlib import Path
from gguf_arch.convert.listing import listing_resolution
from quant_rules.rules import QuantOptions, type_name
types, _, _ = listing_resolution(Path(sys.argv[1]), QuantOptions())
print(json.dumps([(d.name, type_name(d.final_type), d.nbytes) for d in types.decisions]))
"""


def _listing_in_a_child(model: Path) -> list[tuple]:
    """quant_rules' own byte count for every planned tensor (--print-tensor-types' source)."""
    res = subprocess.run([sys.executable, "-c", _LISTING, str(model)], cwd=REPO, capture_output=True, text=True,
                         timeout=120, check=True)
    return [tuple(x) for x in json.loads(res.stdout)]


def _aligned(n: int) -> int:
    return n + (-n % 32)


def test_real_k3_index_without_weights(reference_dir, tmp_path):
    """The real config and 497,220-name index, no shard on disk: every planned tensor listed with
    the bytes quant_rules computes for its type, file and total sizes their aligned sums (its time,
    about 4 s here, is measured by bench/planning.py)."""
    model = tmp_path / "kimi-k3"
    model.mkdir()
    shutil.copy(reference_dir / "kimi-k3-config.json", model / "config.json")
    with gzip.open(reference_dir / "kimi-k3-model.safetensors.index.json.gz") as src:
        (model / "model.safetensors.index.json").write_bytes(src.read())
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    res = subprocess.run([sys.executable, "convert_kimi_k3.py", str(model), str(out_dir / "k3.gguf"), "--dry-run",
                          "--split-max-size", "50G"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    files, tensors, total = _parse(res.stdout)
    listed = [t for ts in tensors.values() for t in ts]
    assert listed == _listing_in_a_child(model)
    assert len(listed) == REAL_K3_TENSORS
    assert [n for n, _, _ in files] == [f"k3-{i:05d}-of-{len(files):05d}.gguf" for i in range(1, len(files) + 1)]
    for (name, count, size), ts in zip(files, tensors.values()):
        assert count == len(ts) and size == sum(_aligned(b) for _, _, b in ts) <= 50 * 10 ** 9
    assert total == (len(files), REAL_K3_TENSORS, sum(size for _, _, size in files))
    assert "no tiktoken.model" in res.stdout and list(out_dir.iterdir()) == []


def test_sizes_are_those_of_the_files_written(k3_tiny_dir, tmp_path, capsys):
    out = tmp_path / "k3.gguf"
    assert convert_kimi_k3.main([str(k3_tiny_dir), str(out), "--dry-run", "--split-max-tensors", "150"]) == 0
    files, tensors, total = _parse(capsys.readouterr().out)
    assert list(tmp_path.iterdir()) == []
    assert convert_kimi_k3.main([str(k3_tiny_dir), str(out), "--quiet", "--split-max-tensors", "150"]) == 0
    written = sorted(tmp_path.glob("k3-*.gguf"))
    assert [(p.name, p.stat().st_size) for p in written] == [(n, size) for n, _, size in files]
    for part, (path, listed) in zip(written, tensors.items()):
        assert Path(path).name == part.name
        assert listed == [(t.name, type_name(Q(t.tensor_type)), int(t.n_bytes)) for t in GGUFReader(part).tensors]
    assert total[2] == sum(p.stat().st_size for p in written)


@pytest.mark.parametrize("mode", ["--dry-run", "--print-tensor-types"])
def test_the_listings_show_the_dsa_keys(tmp_path, k31pro_tiny_dir, capsys, mode):
    out = [] if mode == "--print-tensor-types" else [str(tmp_path / "x.gguf")]
    assert convert_kimi_k3.main([str(k31pro_tiny_dir), *out, mode]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "kimi-k3.attention.indexer.types = arr[bool, 13], true on layers [3, 7, 11, 12]" in lines
    assert "kimi-k3.attention.indexer.top_k = 2048" in lines
    assert convert_kimi_k3.main([str(k31pro_tiny_dir), *out, mode, "--no-dsa"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "no DSA keys (kimi-k3.attention.indexer.*): a plain kimi-k3 GGUF" in lines
    assert not any(l.startswith("kimi-k3.attention.indexer.") for l in lines)
    assert not (tmp_path / "x.gguf").exists()
