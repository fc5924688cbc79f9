"""Split output: llama-gguf-split's file names, keys and merge rule, and llama.cpp loading the parts."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter

import convert_kimi_k3
from gguf_arch.errors import EXIT_BAD_INPUT
from gguf_arch.io.split import SplitLimits, parse_size, split_layout
from gguf_arch.io.gguf_writer import GGUFLayout, OutputTensor, padded
from gguf import GGMLQuantizationType as Q

SPLIT_KEYS = ["split.no", "split.count", "split.tensors.count"]


def _convert(model_dir: Path, out: Path, *flags: str) -> None:
    assert convert_kimi_k3.main([str(model_dir), str(out), "--quiet", *flags]) == 0


def _fields(r: GGUFReader) -> list[tuple]:
    """Every KV pair in file order as (key, value types, value), the reader's GGUF.* header fields left out."""
    return [(k, f.types, f.contents()) for k, f in r.fields.items() if not k.startswith("GGUF.")]


def _tensors(r: GGUFReader) -> list[tuple]:
    return [(t.name, t.tensor_type, tuple(int(d) for d in t.shape), bytes(t.data)) for t in r.tensors]


def merge_like_llama_gguf_split(first: Path, out: Path) -> Path:
    """llama-gguf-split --merge (tools/gguf-split/gguf-split.cpp): the first part's keys, split.count
    set to 0, then every part's tensors in order; parts found from the first's name and split.count."""
    r0 = GGUFReader(first)
    count = int(r0.fields["split.count"].contents())
    stem = first.name[:-len(f"-00001-of-{count:05d}.gguf")]
    readers = [r0, *(GGUFReader(first.with_name(f"{stem}-{i:05d}-of-{count:05d}.gguf")) for i in range(2, count + 1))]
    w = GGUFWriter(out, str(r0.fields["general.architecture"].contents()))
    for key, f in r0.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(key, 0 if key == "split.count" else f.contents(), f.types[0], sub)
    for r in readers:
        for t in r.tensors:
            w.add_tensor(t.name, np.ascontiguousarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.mark.parametrize("flags", [("--split-max-tensors", "150"), ("--split-max-size", "500K")])
def test_merged_parts_equal_the_unsplit_conversion(k3_tiny_dir, k3_tiny_gguf, tmp_path, flags):
    _convert(k3_tiny_dir, tmp_path / "k3.gguf", *flags)
    parts = sorted(tmp_path.glob("k3-*-of-*.gguf"))
    n = len(parts)
    assert n >= 3 and [p.name for p in parts] == [f"k3-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]
    assert not (tmp_path / "k3.gguf").exists()
    merged = GGUFReader(merge_like_llama_gguf_split(parts[0], tmp_path / "merged.gguf"))
    whole = GGUFReader(k3_tiny_gguf)
    fields = _fields(merged)
    assert fields[:-3] == _fields(whole)
    assert [(k, v) for k, _, v in fields[-3:]] == list(zip(SPLIT_KEYS, [0, 0, len(whole.tensors)]))
    assert _tensors(merged) == _tensors(whole)


def test_part_keys_follow_llama_cpp(k3_tiny_dir, k3_tiny_gguf, tmp_path):
    """First part: every key of the unsplit file, then split.no/count (uint16) and split.tensors.count
    (int32); later parts: only the split keys, no general.architecture. Each part has its manifest."""
    _convert(k3_tiny_dir, tmp_path / "k3.gguf", "--split-max-tensors", "150")
    parts = sorted(tmp_path.glob("k3-*-of-*.gguf"))
    whole = GGUFReader(k3_tiny_gguf)
    total = len(whole.tensors)
    split_types = [[GGUFValueType.UINT16], [GGUFValueType.UINT16], [GGUFValueType.INT32]]
    for i, part in enumerate(parts):
        fields = _fields(GGUFReader(part))
        head, tail = fields[:-3], fields[-3:]
        assert head == (_fields(whole) if i == 0 else [])
        assert tail == list(zip(SPLIT_KEYS, split_types, [i, len(parts), total]))
        manifest = json.loads((tmp_path / f"{part.name}.manifest.json").read_text())
        assert manifest["gguf"] == part.name and manifest["gguf_size"] == part.stat().st_size
    counts = [len(GGUFReader(p).tensors) for p in parts]
    assert counts[:-1] == [150] * (len(parts) - 1) and sum(counts) == total


def _layout(sizes: list[int]) -> GGUFLayout:
    return GGUFLayout("kimi-k3", (), tuple(OutputTensor(f"t{i}", Q.I8, (n,)) for i, n in enumerate(sizes)))


def test_size_rule_is_llama_gguf_splits():
    """A new part when the next tensor's aligned bytes would exceed the limit; an oversized tensor
    gets a part of its own; one part means one plain file without split keys."""
    parts = split_layout(Path("m.gguf"), _layout([30, 30, 64, 10, 500, 1, 1]), SplitLimits(max_bytes=100))
    assert [[t.name for t in p.tensors] for _, p in parts] == [["t0", "t1"], ["t2", "t3"], ["t4"], ["t5", "t6"]]
    assert [sum(padded(t.nbytes) for t in p.tensors) for _, p in parts] == [64, 96, 512, 64]
    assert [path.name for path, _ in parts][0] == "m-00001-of-00004.gguf"
    assert parts[1][1].arch is None and parts[0][1].arch == "kimi-k3"
    one = split_layout(Path("m.gguf"), _layout([10, 10]), SplitLimits(max_bytes=10 ** 9, max_tensors=5))
    assert one == [(Path("m.gguf"), _layout([10, 10]))]


def test_size_values_are_llama_cpps():
    assert parse_size("50G") == 50 * 10 ** 9 and parse_size("300M") == 3 * 10 ** 8
    assert parse_size("7K") == 7000 and parse_size("123") == 123


@pytest.mark.parametrize("value", ["0", "12Q", "-5G", "1.5G", ""])
def test_bad_split_size_is_bad_input(k3_tiny_dir, tmp_path, capsys, value):
    rc = convert_kimi_k3.main([str(k3_tiny_dir), str(tmp_path / "o.gguf"), f"--split-max-size={value}"])
    err = capsys.readouterr().err
    assert rc == EXIT_BAD_INPUT and "--split-max-size" in err and len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


_LLAMA_LOGITS = """
import sys, numpy as np, llama_cpp
out = []
for path in sys.argv[2:]:
    llm = llama_cpp.Llama(model_path=path, n_ctx=64, n_batch=64, n_threads=2, logits_all=True, verbose=False)
    llm.eval([1, 2, 3, 4, 5])
    out.append(np.array(llm.scores[:5], dtype=np.float32))
    llm.close()
np.save(sys.argv[1], np.stack(out))
"""


def _llama_cpp_problem() -> str:
    r = subprocess.run([sys.executable, "-c", "import llama_cpp"], capture_output=True, text=True)
    return "" if r.returncode == 0 else f"llama_cpp cannot be imported: {r.stderr.strip().splitlines()[-1:]}"


def test_llama_cpp_loads_the_split_k3_conversion(k3_tiny_dir, k3_tiny_gguf, tmp_path):
    """llama.cpp (llama-cpp-python, in a child: its ggml cannot share a process with ggml-python)
    loads the parts from the first one's name and computes the unsplit file's logits."""
    problem = _llama_cpp_problem()
    if problem:
        pytest.skip(problem)
    _convert(k3_tiny_dir, tmp_path / "k3.gguf", "--split-max-tensors", "150")
    first = sorted(tmp_path.glob("k3-*-of-*.gguf"))[0]
    res = subprocess.run([sys.executable, "-c", _LLAMA_LOGITS, str(tmp_path / "logits.npy"), str(k3_tiny_gguf),
                          str(first)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    whole, split = np.load(tmp_path / "logits.npy")
    assert np.isfinite(whole).all() and np.array_equal(whole, split)
