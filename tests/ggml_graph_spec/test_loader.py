"""The GGUF loader: config rebuilt from the keys, zero-copy tensors, one-line errors before ggml."""
from __future__ import annotations

import ctypes
import dataclasses
from pathlib import Path

import ggml
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from gguf_arch.arch import keys as K
from gguf_arch.arch.config import load_config
from gguf_arch.errors import GGUFError
from gguf_arch.arch.tensors import plan_tensors
from ggml_graph_spec.weights.loader import load_gguf
from tests.support.gguf_edit import rewritten_copy


@pytest.mark.parametrize("which", ["k3", "k31pro"])
def test_config_is_rebuilt_from_the_keys(which, k3_tiny_gguf, k31pro_tiny_gguf, k3_tiny_dir, k31pro_tiny_dir):
    gguf, model_dir = {"k3": (k3_tiny_gguf, k3_tiny_dir), "k31pro": (k31pro_tiny_gguf, k31pro_tiny_dir)}[which]
    weights = load_gguf(gguf)
    try:
        want = load_config(model_dir)
        got = weights.cfg
        # The GGUF stores eps as f32; everything else round-trips exactly.
        assert np.float32(got.rms_norm_eps) == np.float32(want.rms_norm_eps)
        assert got == dataclasses.replace(want, rms_norm_eps=got.rms_norm_eps)
        assert (got.indexer is not None) == (which == "k31pro")
    finally:
        weights.close()


def test_tensors_point_into_the_mapped_file_without_copies(k31pro_tiny_gguf):
    weights = load_gguf(k31pro_tiny_gguf)
    try:
        reader = GGUFReader(k31pro_tiny_gguf)
        expected = {p.name for p in plan_tensors(weights.cfg)}
        assert set(weights.tensors) == {t.name for t in reader.tensors} <= expected
        mapped = weights._files[0].reader.data
        lo, hi = mapped.ctypes.data, mapped.ctypes.data + mapped.nbytes
        for t in reader.tensors:
            gt = weights.tensors[t.name]
            addr = ggml.ggml_get_data(gt)
            assert lo <= addr and addr + t.n_bytes <= hi, t.name
            assert addr - lo == t.data_offset, t.name
            assert ggml.ggml_nbytes(gt) == t.n_bytes, t.name
            got = np.frombuffer((ctypes.c_uint8 * t.n_bytes).from_address(addr), dtype=np.uint8)
            assert np.array_equal(got, t.data.reshape(-1).view(np.uint8)), t.name
    finally:
        weights.close()


def test_split_gguf_loads_all_parts(tmp_path, k3_tiny_gguf):
    """llama.cpp-style split files (gguf-py's writer): tensors found in every part, same bytes."""
    rewritten_copy(k3_tiny_gguf, tmp_path / "split.gguf", split_max_tensors=150)
    parts = sorted(tmp_path.glob("split-*-of-*.gguf"))
    assert len(parts) == 3
    whole, split = load_gguf(k3_tiny_gguf), load_gguf(parts[0])
    try:
        assert split.cfg == whole.cfg and set(split.tensors) == set(whole.tensors)
        assert len({f.reader.data.filename for f in split._files}) == 3
        for name, t in whole.tensors.items():
            n = ggml.ggml_nbytes(t)
            a = (ctypes.c_uint8 * n).from_address(ggml.ggml_get_data(t))
            b = (ctypes.c_uint8 * n).from_address(ggml.ggml_get_data(split.tensors[name]))
            assert bytes(a) == bytes(b), name
    finally:
        whole.close()
        split.close()
    parts[1].unlink()
    _one_line_error(parts[0], "split-00002-of-00003.gguf", "not found")
    _one_line_error(parts[2], "part of a 3-part split", "give the first part")


def test_split_count_zero_is_one_file_as_llama_gguf_split_merge_leaves_it(k3_tiny_gguf, tmp_path):
    merged = rewritten_copy(k3_tiny_gguf, tmp_path / "merged.gguf", keys={"split.count": (0, GGUFValueType.UINT16)})
    weights = load_gguf(merged)
    try:
        assert len({f.reader.data.filename for f in weights._files}) == 1
    finally:
        weights.close()


def _one_line_error(path: Path, *fragments: str) -> str:
    with pytest.raises(GGUFError) as e:
        load_gguf(path)
    msg = str(e.value)
    assert "\n" not in msg
    for f in fragments:
        assert f in msg, msg
    return msg


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "junk.gguf"
    bad.write_bytes(b"not a gguf at all" * 10)
    _one_line_error(bad, str(bad), "not a readable GGUF")
    _one_line_error(tmp_path / "absent.gguf", "not found")


def test_truncated_file(tmp_path, k3_tiny_gguf):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(k3_tiny_gguf.read_bytes()[:-4096])
    _one_line_error(cut, str(cut))


def test_wrong_architecture(tmp_path, k3_tiny_gguf):
    out = tmp_path / "llama.gguf"
    w = GGUFWriter(out, "llama")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _one_line_error(out, "general.architecture is 'llama'", K.ARCH)


def test_missing_key(tmp_path, k3_tiny_gguf):
    key = f"{K.ARCH}.activation.situ_linear_beta"
    _one_line_error(rewritten_copy(k3_tiny_gguf, tmp_path / "x.gguf", keys={key: None}), "missing metadata key", key)


def test_inconsistent_key(tmp_path, k3_tiny_gguf):
    key = f"{K.ARCH}.attention.key_length"
    out = rewritten_copy(k3_tiny_gguf, tmp_path / "x.gguf", keys={key: (999, GGUFValueType.UINT32)})
    _one_line_error(out, key, "999")


def test_bad_layer_kinds(tmp_path, k3_tiny_gguf):
    key = f"{K.ARCH}.attention.head_count_kv"
    out = rewritten_copy(k3_tiny_gguf, tmp_path / "x.gguf", keys={key: ([2] * 13, GGUFValueType.ARRAY, GGUFValueType.UINT32)})
    _one_line_error(out, key, "0 (KDA) or 1 (MLA)")


def test_partial_indexer_keys(tmp_path, k31pro_tiny_gguf):
    out = rewritten_copy(k31pro_tiny_gguf, tmp_path / "x.gguf", keys={K.INDEXER_TOP_K: None})
    _one_line_error(out, K.INDEXER_TOP_K, "together")


def test_a_gguf_with_only_the_older_layers_key_still_loads_with_a_note(tmp_path, k31pro_tiny_gguf, capsys):
    legacy = rewritten_copy(k31pro_tiny_gguf, tmp_path / "legacy.gguf", keys={
        K.INDEXER_TYPES: None, K.LEGACY_INDEXER_LAYERS: ([3, 7, 11, 12], GGUFValueType.ARRAY, GGUFValueType.UINT32)})
    weights, current = load_gguf(legacy), load_gguf(k31pro_tiny_gguf)
    try:
        assert weights.cfg == current.cfg and weights.cfg.indexer.layers == (3, 7, 11, 12)
        assert current.notes == ()
        (note,) = weights.notes
        assert K.LEGACY_INDEXER_LAYERS in note and K.INDEXER_TYPES in note
    finally:
        weights.close()
        current.close()
    from ggml_graph_spec.runner.cli import main

    assert main(["-m", str(legacy), "-p", "x", "-n", "1", "-c", "16", "-t", "2"]) == 0
    notes = [l for l in capsys.readouterr().err.splitlines() if l.startswith("print_info: note")]
    assert notes == [f"print_info: note             = {note}"]


@pytest.mark.parametrize("keys, message", [
    ({K.INDEXER_TYPES: ([True] * 13, GGUFValueType.ARRAY, GGUFValueType.BOOL)}, "they must be the MLA layers"),
    ({K.INDEXER_TYPES: ([l in (3, 7, 11, 12) for l in range(12)], GGUFValueType.ARRAY, GGUFValueType.BOOL)},
     "must be an array of 13 bools"),
    ({K.INDEXER_TYPES: ([1 if l in (3, 7, 11, 12) else 0 for l in range(13)], GGUFValueType.ARRAY,
                        GGUFValueType.UINT32)}, "must be an array of 13 bools"),
    ({K.INDEXER_TYPES: None, K.LEGACY_INDEXER_LAYERS: ([3, 7, 11, 13], GGUFValueType.ARRAY, GGUFValueType.UINT32)},
     "0-based layer ids below"),
])
def test_bad_indexer_types(tmp_path, k31pro_tiny_gguf, keys, message):
    _one_line_error(rewritten_copy(k31pro_tiny_gguf, tmp_path / "x.gguf", keys=keys), K.ARCH, message)


def test_missing_tensor(tmp_path, k3_tiny_gguf):
    name = "blk.5.ssm_beta.weight"
    _one_line_error(rewritten_copy(k3_tiny_gguf, tmp_path / "x.gguf", replace={name: None}), "missing tensor", name)


def test_unexpected_tensor(tmp_path, k3_tiny_gguf):
    out = rewritten_copy(k3_tiny_gguf, tmp_path / "x.gguf", extra={"blk.3.indexer.attn_k.weight": np.zeros((16, 64), np.float32)})
    _one_line_error(out, "not in the kimi-k3 table", "blk.3.indexer.attn_k.weight")


def test_wrong_shape(tmp_path, k3_tiny_gguf):
    name = "blk.2.ssm_a"
    out = rewritten_copy(k3_tiny_gguf, tmp_path / "x.gguf", replace={name: (np.zeros(16, np.float32), Q.F32)})
    _one_line_error(out, name, "ne [16]", "expected [4]")


def test_wrong_type(tmp_path, k3_tiny_gguf):
    name = "blk.1.ffn_gate_inp.weight"
    data = next(t for t in GGUFReader(k3_tiny_gguf).tensors if t.name == name).data
    out = rewritten_copy(k3_tiny_gguf, tmp_path / "x.gguf", replace={name: (data.astype(np.float16), Q.F16)})
    _one_line_error(out, name, "type F16", "expected F32")


def test_quantized_trunk_types_are_accepted(tmp_path, k3_tiny_gguf):
    """Matrices keep the source precision or any ggml block type (a trunk converted to Q8_0)."""
    from gguf.quants import quantize

    name = "blk.0.ffn_up.weight"
    data = next(t for t in GGUFReader(k3_tiny_gguf).tensors if t.name == name)
    f32 = data.data.view(np.uint16).astype(np.uint32) << 16  # BF16 -> F32 bits
    q8 = quantize(f32.view(np.float32).reshape(data.data.shape[0], -1), Q.Q8_0)
    weights = load_gguf(rewritten_copy(k3_tiny_gguf, tmp_path / "x.gguf", replace={name: (q8, Q.Q8_0)}))
    try:
        assert weights.tensors[name].contents.type == Q.Q8_0
    finally:
        weights.close()
