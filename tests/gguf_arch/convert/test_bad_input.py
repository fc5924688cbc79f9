"""Bad input: exit code 2 (or 1 for the output), one line on stderr, no output file left behind."""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest

import convert_kimi_k3

from tests.support.checkpoint_edit import EditableCheckpoint

L = "language_model.model.layers.{}."


@pytest.fixture
def pro(tmp_path, k31pro_tiny_dir) -> EditableCheckpoint:
    return EditableCheckpoint(k31pro_tiny_dir, tmp_path / "model")


def _fails(ckpt: EditableCheckpoint, tmp_path, capsys, code: int, *needles: str, args=()) -> str:
    out_dir = tmp_path / "out"
    out_dir.mkdir(exist_ok=True)
    rc = convert_kimi_k3.main([str(ckpt.dir), str(out_dir / "m.gguf"), "--quiet", *args])
    err = capsys.readouterr().err
    assert rc == code, err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, err
    assert list(out_dir.iterdir()) == []
    return err


def test_mismatched_index_layers(pro, tmp_path, capsys):
    pro.edit_config(lambda c: c["text_config"].__setitem__("index_layers", [4, 8, 12, 11]))
    _fails(pro, tmp_path, capsys, 2, "index_layers", "only in index_layers: [11]")


def test_index_layers_missing_one_full_attention_layer(pro, tmp_path, capsys):
    pro.edit_config(lambda c: c["text_config"].__setitem__("index_layers", [4, 8, 12]))
    _fails(pro, tmp_path, capsys, 2, "only in full_attn_layers: [13]")


def test_missing_config_field(pro, tmp_path, capsys):
    pro.edit_config(lambda c: c["text_config"].pop("kv_lora_rank"))
    _fails(pro, tmp_path, capsys, 2, "config.json", "missing required field(s): text_config.kv_lora_rank")


def test_missing_expert(pro, tmp_path, capsys):
    base = L.format(2) + "block_sparse_moe.experts.5.w1."
    pro.drop(base + "weight_packed")
    pro.drop(base + "weight_scale")
    _fails(pro, tmp_path, capsys, 2, f"missing tensor {base}weight_packed", "blk.2.ffn_gate_exps.weight")


def test_missing_scale(pro, tmp_path, capsys):
    name = L.format(6) + "block_sparse_moe.experts.7.w2.weight_scale"
    pro.drop(name)
    _fails(pro, tmp_path, capsys, 2, f"missing tensor {name}", "blk.6.ffn_down_exps.weight")


def test_unpaired_attn_res_half(pro, tmp_path, capsys):
    name = L.format(4) + "mlp_res_proj.weight"
    pro.drop(name)
    _fails(pro, tmp_path, capsys, 2, f"missing tensor {name}", "blk.4.ffn_res_score.weight")


def test_stray_weight_packed_outside_the_routed_experts(pro, tmp_path, capsys):
    name = L.format(2) + "block_sparse_moe.shared_experts.gate_proj.weight_packed"
    pro.add(name, "U8", [64, 32], bytes(64 * 32), "model-00003-of-000016.safetensors")
    _fails(pro, tmp_path, capsys, 2, name, "outside the routed experts")


def test_unknown_tensor(pro, tmp_path, capsys):
    name = L.format(2) + "self_attn.rotary_emb.inv_freq"
    pro.add(name, "F32", [4], bytes(16), "model-00003-of-000016.safetensors")
    _fails(pro, tmp_path, capsys, 2, f"unknown tensor {name}")


def test_indexer_tensor_on_a_non_index_layer_is_unknown(pro, tmp_path, capsys):
    name = L.format(2) + "self_attn.indexer.wk.weight"
    pro.add(name, "BF16", [16, 64], bytes(16 * 64 * 2), "model-00003-of-000016.safetensors")
    _fails(pro, tmp_path, capsys, 2, f"unknown tensor {name}")


def test_wrong_shape(pro, tmp_path, capsys):
    name = L.format(2) + "self_attn.q_proj.weight"
    pro.replace(name, "BF16", [64, 32], bytes(64 * 32 * 2))
    _fails(pro, tmp_path, capsys, 2, name, "shape [64, 32], expected [64, 64]")


def test_wrong_dtype(pro, tmp_path, capsys):
    name = L.format(2) + "block_sparse_moe.experts.0.w3.weight_scale"
    pro.replace(name, "BF16", [32, 2], bytes(32 * 2 * 2))
    _fails(pro, tmp_path, capsys, 2, name, "dtype BF16, expected U8")


def test_truncated_shard(pro, tmp_path, capsys):
    shard = pro.dir / "model-00005-of-000016.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])
    _fails(pro, tmp_path, capsys, 2, "model-00005-of-000016.safetensors", "truncated")


def test_corrupt_safetensors_header(pro, tmp_path, capsys):
    shard = pro.dir / "model-00007-of-000016.safetensors"
    data = bytearray(shard.read_bytes())
    data[8:20] = b"{not json!!!"
    shard.write_bytes(bytes(data))
    _fails(pro, tmp_path, capsys, 2, "model-00007-of-000016.safetensors", "corrupt safetensors header")


def test_header_length_beyond_the_file(pro, tmp_path, capsys):
    shard = pro.dir / "model-00007-of-000016.safetensors"
    data = bytearray(shard.read_bytes())
    data[:8] = struct.pack("<Q", len(data))
    shard.write_bytes(bytes(data))
    _fails(pro, tmp_path, capsys, 2, "model-00007-of-000016.safetensors", "header length")


def test_overlapping_tensors(pro, tmp_path, capsys):
    shard = pro.dir / "model-00002-of-000016.safetensors"
    data = shard.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    names = [k for k in header if k != "__metadata__"]
    a, b = sorted(names, key=lambda k: header[k]["data_offsets"][0])[:2]
    size = header[b]["data_offsets"][1] - header[b]["data_offsets"][0]
    header[b]["data_offsets"] = [header[a]["data_offsets"][0], header[a]["data_offsets"][0] + size]
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (n - len(raw))
    assert len(raw) == n
    shard.write_bytes(data[:8] + raw + data[8 + n:])
    _fails(pro, tmp_path, capsys, 2, "model-00002-of-000016.safetensors", "overlap")


@pytest.mark.parametrize("shard", ["../model-00001-of-000016.safetensors", "/etc/passwd", "sub/x.safetensors"])
def test_shard_name_must_stay_inside_the_model_dir(pro, tmp_path, capsys, shard):
    pro.edit_weight_map(lambda wmap: wmap.update({next(iter(wmap)): shard}))
    _fails(pro, tmp_path, capsys, 2, "not a plain file name")


def test_nonzero_a_log_padding_fails_mid_write_and_leaves_nothing(pro, tmp_path, capsys):
    name = L.format(9) + "self_attn.A_log"
    a_log = np.zeros(16, np.float32)
    a_log[:4] = [0.1, 0.2, 0.3, 0.4]
    a_log[11] = 1.0
    pro.replace(name, "F32", [16], a_log.tobytes())
    _fails(pro, tmp_path, capsys, 2, name, "zero padding", "[11]")


def test_missing_tokenizer_file(pro, tmp_path, capsys):
    (pro.dir / "tiktoken.model").unlink()
    _fails(pro, tmp_path, capsys, 2, "tiktoken.model")


def test_missing_config(pro, tmp_path, capsys):
    (pro.dir / "config.json").unlink()
    _fails(pro, tmp_path, capsys, 2, "config.json", "not found")


def test_output_already_exists(k3_tiny_dir, tmp_path, capsys):
    out = tmp_path / "m.gguf"
    out.write_bytes(b"keep me")
    rc = convert_kimi_k3.main([str(k3_tiny_dir), str(out)])
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith("error: ") and err.count("\n") == 1 and "--overwrite" in err
    assert out.read_bytes() == b"keep me"
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]
