"""The streaming writer produces what gguf-py's own in-memory writer produces, byte for byte."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFValueType as T, GGUFWriter

from gguf_arch.errors import OutputError
from gguf_arch.io.gguf_writer import GGUFLayout, OutputTensor, partial_path, write_gguf

KV = (("general.name", "t", T.STRING, None), ("x.count", 7, T.UINT32, None),
      ("x.list", [1, 2, 3], T.ARRAY, T.UINT32), ("x.eps", 1e-5, T.FLOAT32, None))


def _tensors():
    rng = np.random.default_rng(0)
    return {  # odd byte sizes so that padding matters
        "a": (Q.F32, (3,), rng.standard_normal(3).astype(np.float32).view(np.uint8)),
        "b": (Q.BF16, (5, 7), rng.integers(0, 1 << 16, 35, dtype=np.uint16).view(np.uint8)),
        "c": (Q.MXFP4, (2, 3, 64), rng.integers(0, 256, 2 * 3 * 2 * 17, dtype=np.uint8)),
    }


def _layout(tensors) -> GGUFLayout:
    return GGUFLayout("kimi-k3", KV, tuple(OutputTensor(n, t, s) for n, (t, s, _) in tensors.items()))


def _chunks(tensors, size: int):
    def produce(t: OutputTensor):
        data = tensors[t.name][2]
        return (memoryview(data[i:i + size]) for i in range(0, data.size, size))
    return produce


@pytest.mark.parametrize("chunk", [1, 5, 4096])
def test_identical_to_gguf_py_add_tensor(tmp_path, chunk):
    tensors = _tensors()
    ours = tmp_path / "ours.gguf"
    write_gguf(ours, _layout(tensors), _chunks(tensors, chunk))

    ref = GGUFWriter(tmp_path / "ref.gguf", "kimi-k3")
    for key, value, vtype, sub in KV:
        ref.add_key_value(key, value, vtype, sub)
    for name, (qtype, shape, data) in tensors.items():
        byte_shape = (*shape[:-1], data.size // int(np.prod(shape[:-1])))
        ref.add_tensor(name, data.reshape(byte_shape), raw_dtype=qtype)
    ref.write_header_to_file()
    ref.write_kv_data_to_file()
    ref.write_tensors_to_file()
    ref.close()
    assert ours.read_bytes() == (tmp_path / "ref.gguf").read_bytes()

    r = GGUFReader(ours)
    for t in r.tensors:
        assert t.data_offset % 32 == 0
        assert bytes(r.data[t.data_offset:t.data_offset + t.n_bytes]) == tensors[t.name][2].tobytes()
        assert tuple(int(x) for x in reversed(t.shape)) == tensors[t.name][1]


def test_short_tensor_data_fails_and_leaves_nothing(tmp_path):
    tensors = _tensors()
    tensors["b"] = (Q.BF16, (5, 7), tensors["b"][2][:-2])
    with pytest.raises(ValueError, match="b: produced 68 bytes, planned 70"):
        write_gguf(tmp_path / "o.gguf", _layout(tensors), _chunks(tensors, 16))
    assert list(tmp_path.iterdir()) == []


def test_existing_output_needs_overwrite(tmp_path):
    tensors = _tensors()
    out = tmp_path / "o.gguf"
    out.write_bytes(b"old")
    with pytest.raises(OutputError, match="already exists"):
        write_gguf(out, _layout(tensors), _chunks(tensors, 16))
    assert out.read_bytes() == b"old"
    write_gguf(out, _layout(tensors), _chunks(tensors, 16), overwrite=True)
    assert out.read_bytes()[:4] == b"GGUF" and not partial_path(out).exists()


def test_missing_output_directory(tmp_path):
    tensors = _tensors()
    with pytest.raises(OutputError, match="output directory does not exist"):
        write_gguf(tmp_path / "nope" / "o.gguf", _layout(tensors), _chunks(tensors, 16))
