"""Both fixtures convert; the GGUF carries every key and tensor the tables promise, exactly."""
from __future__ import annotations

import errno
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFValueType, quants

import convert_kimi_k3
from gguf_arch.convert import run as convert_mod
from gguf_arch.arch.config import load_config
from gguf_arch.convert.plan import output_type, plan_conversion
from gguf_arch.convert.run import convert
from gguf_arch.arch.keys import ARCH, INDEXER_KEYS, model_keys
from gguf_arch.arch.mxfp4 import dequantize_compressed
from gguf_arch.io.safetensors import open_checkpoint
from gguf_arch.synth.cli import plan_checkpoint, write_checkpoint
from gguf_arch.synth.config import PRESETS
from gguf_arch.arch.tensors import OUT_SOURCE, plan_tensors

from tests.support.cli import peak_rss_kib
from tests.support.held import interrupt_mid_write

from tests.support.checkpoint_edit import EditableCheckpoint, as_f32, source_array
from tests.support.paths import K31PRO_TINY



def _reader(path: Path) -> GGUFReader:
    return GGUFReader(path)


def _data(r: GGUFReader, name: str) -> bytes:
    t = next(t for t in r.tensors if t.name == name)
    return bytes(r.data[t.data_offset:t.data_offset + t.n_bytes])


def _f32(r: GGUFReader, name: str) -> np.ndarray:
    return np.frombuffer(_data(r, name), np.float32)


def _value(r: GGUFReader, key: str):
    return r.fields[key].contents()


@pytest.fixture(params=["k3", "k31pro"])
def converted(request, k3_tiny_dir, k31pro_tiny_dir, k3_tiny_gguf, k31pro_tiny_gguf):
    if request.param == "k3":
        return k3_tiny_dir, k3_tiny_gguf
    return k31pro_tiny_dir, k31pro_tiny_gguf


def test_arch_and_every_key_with_the_config_value(converted):
    model_dir, gguf = converted
    cfg = load_config(model_dir)
    r = _reader(gguf)
    assert _value(r, "general.architecture") == ARCH == "kimi-k3"
    assert _value(r, "general.file_type") == 38
    assert _value(r, "general.quantization_version") == 2
    for key, value, vtype, _ in model_keys(cfg):
        got = _value(r, key)
        if vtype == GGUFValueType.FLOAT32:
            assert got == float(np.float32(value)), key
        else:
            assert got == value, key


def test_indexer_keys_have_the_config_values(k31pro_tiny_gguf, k3_tiny_gguf):
    r = _reader(k31pro_tiny_gguf)
    assert _value(r, "kimi-k3.attention.indexer.head_count") == 4
    assert _value(r, "kimi-k3.attention.indexer.key_length") == 16
    assert _value(r, "kimi-k3.attention.indexer.top_k") == 2048
    # One bool per layer (llama.cpp's indexer.types), true exactly on index_layers [4,8,12,13] - 1.
    types = r.fields["kimi-k3.attention.indexer.types"]
    assert types.types == [GGUFValueType.ARRAY, GGUFValueType.BOOL]
    assert _value(r, "kimi-k3.attention.indexer.types") == [l in (3, 7, 11, 12) for l in range(13)]
    assert "kimi-k3.attention.indexer.layers" not in r.fields  # the older key is no longer written
    assert not set(INDEXER_KEYS) & set(_reader(k3_tiny_gguf).fields)


def test_indexer_tensors_at_contract_precision(k31pro_tiny_gguf):
    types = {t.name: t.tensor_type for t in _reader(k31pro_tiny_gguf).tensors}
    for layer in (3, 7, 11, 12):
        assert types[f"blk.{layer}.indexer.attn_q_b.weight"] == Q.BF16
        assert types[f"blk.{layer}.indexer.attn_k.weight"] == Q.BF16
        assert types[f"blk.{layer}.indexer.proj.weight"] == Q.F32
        assert types[f"blk.{layer}.indexer.k_norm.weight"] == Q.F32
    assert not any("indexer" in n for n, _ in types.items() if not n.startswith(("blk.3.", "blk.7.", "blk.11.", "blk.12.")))


def test_tensor_counts_and_types(converted):
    model_dir, gguf = converted
    cfg = load_config(model_dir)
    r = _reader(gguf)
    names = [t.name for t in r.tensors]
    assert names == [pt.name for pt in plan_tensors(cfg) if not pt.spec.optional]
    assert len(names) == (369 if cfg.indexer else 353)  # 353: llama.cpp's converter (docs/reference/findings.md)
    ne = {t.name: tuple(int(x) for x in t.shape) for t in r.tensors}
    for pt in plan_tensors(cfg):
        if pt.name in ne:
            assert ne[pt.name] == tuple(reversed(pt.shape)), pt.name


def test_every_passthrough_tensor_is_byte_identical(converted):
    model_dir, gguf = converted
    r = _reader(gguf)
    types = {t.name: t.tensor_type for t in r.tensors}
    n = 0
    for pt in plan_tensors(load_config(model_dir)):
        if pt.transform not in ("copy", "reshape") or pt.name not in types:
            continue
        dtype, src = source_array(model_dir, pt.sources[0][0])
        if pt.spec.out == OUT_SOURCE or dtype == "F32":
            assert _data(r, pt.name) == src.tobytes(), pt.name
        else:  # widened to F32: exact
            assert types[pt.name] == Q.F32
            assert np.array_equal(_f32(r, pt.name), as_f32(dtype, src).reshape(-1)), pt.name
        n += 1
    assert n > 200


def test_transformed_tensors_match_the_source(k31pro_tiny_dir, k31pro_tiny_gguf):
    d, r = k31pro_tiny_dir, _reader(k31pro_tiny_gguf)
    p = "language_model.model.layers.{}."
    a_log = as_f32(*source_array(d, p.format(0) + "self_attn.A_log"))
    assert np.array_equal(_f32(r, "blk.0.ssm_a"), (-np.exp(a_log[:4].astype(np.float64))).astype(np.float32))
    norm = as_f32(*source_array(d, p.format(5) + "mlp_res_norm.weight"))
    proj = as_f32(*source_array(d, p.format(5) + "mlp_res_proj.weight"))
    assert np.array_equal(_f32(r, "blk.5.ffn_res_score.weight"), norm * proj[0])
    _, kv_b = source_array(d, p.format(3) + "self_attn.kv_b_proj.weight")  # [4*(16+16), 32] bf16
    per_head = kv_b.reshape(4, 32, 32)
    k_b = np.frombuffer(_data(r, "blk.3.attn_k_b.weight"), np.uint16).reshape(4, 32, 16)
    v_b = np.frombuffer(_data(r, "blk.3.attn_v_b.weight"), np.uint16).reshape(4, 16, 32)
    assert np.array_equal(k_b, per_head[:, :16, :].transpose(0, 2, 1))
    assert np.array_equal(v_b, per_head[:, 16:, :])


@pytest.mark.parametrize("w,gguf", [("w1", "ffn_gate_exps"), ("w3", "ffn_up_exps"), ("w2", "ffn_down_exps")])
def test_stacked_experts_decode_to_the_hf_experts(k31pro_tiny_dir, k31pro_tiny_gguf, w, gguf):
    r = _reader(k31pro_tiny_gguf)
    layer = 7
    got = quants.dequantize(np.frombuffer(_data(r, f"blk.{layer}.{gguf}.weight"), np.uint8), Q.MXFP4)
    rows, cols = (32, 64) if w != "w2" else (64, 32)
    got = got.reshape(8, rows, cols)
    for e in range(8):
        base = f"language_model.model.layers.{layer}.block_sparse_moe.experts.{e}.{w}."
        want = dequantize_compressed(source_array(k31pro_tiny_dir, base + "weight_packed")[1],
                                     source_array(k31pro_tiny_dir, base + "weight_scale")[1])
        assert np.array_equal(got[e], want), e  # -0.0 == +0.0: values equal, expert order and layout exact


def test_ledger_counts(k3_tiny_dir, k31pro_tiny_dir):
    for model_dir, consumed, written in ((k3_tiny_dir, 916, 353), (k31pro_tiny_dir, 932, 369)):
        with open_checkpoint(model_dir) as ckpt:
            ledger = plan_conversion(load_config(model_dir), ckpt.metas).ledger
        assert (ledger.consumed, ledger.skipped, ledger.written) == (consumed, 18, written)


def test_output_type_is_decided_in_one_place():
    cfg = load_config(K31PRO_TINY)
    by_name = {pt.name: pt for pt in plan_tensors(cfg)}
    assert output_type(by_name["blk.3.attn_q_b.weight"], "BF16") == Q.BF16
    assert output_type(by_name["blk.3.attn_q_b.weight"], "F16") == Q.F16
    assert output_type(by_name["blk.3.indexer.proj.weight"], "BF16") == Q.F32
    assert output_type(by_name["blk.1.ffn_gate_exps.weight"], "U8") == Q.MXFP4
    assert output_type(by_name["blk.1.ffn_gate_inp.weight"], "BF16") == Q.F32


def test_converting_twice_is_byte_identical(k31pro_tiny_dir, k31pro_tiny_gguf, tmp_path):
    again = tmp_path / "again.gguf"
    convert(k31pro_tiny_dir, again, log=lambda _m: None)
    assert again.read_bytes() == k31pro_tiny_gguf.read_bytes()


def test_no_dsa_writes_plain_kimi_k3(k31pro_tiny_dir, k3_tiny_gguf, tmp_path, capsys):
    out = tmp_path / "nodsa.gguf"
    assert convert_kimi_k3.main([str(k31pro_tiny_dir), str(out), "--no-dsa"]) == 0
    printed = capsys.readouterr().out
    assert "950 (916 consumed, 34 skipped)" in printed and "written: 353" in printed
    r, plain = _reader(out), _reader(k3_tiny_gguf)
    assert not set(INDEXER_KEYS) & set(r.fields)
    assert [(t.name, t.tensor_type) for t in r.tensors] == [(t.name, t.tensor_type) for t in plain.tensors]
    assert set(r.fields) == set(plain.fields)


def test_cli_prints_counts_and_quiet_prints_nothing(k3_tiny_dir, tmp_path, capsys):
    assert convert_kimi_k3.main([str(k3_tiny_dir), str(tmp_path / "a.gguf")]) == 0
    assert "934 (916 consumed, 18 skipped); GGUF tensors written: 353" in capsys.readouterr().out
    assert convert_kimi_k3.main([str(k3_tiny_dir), str(tmp_path / "b.gguf"), "--quiet"]) == 0
    assert capsys.readouterr() == ("", "")
    assert convert_kimi_k3.main([str(k3_tiny_dir), str(tmp_path / "b.gguf"), "--quiet", "--overwrite"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.gguf", "a.gguf.manifest.json", "b.gguf", "b.gguf.manifest.json"]


def _failing_chunks(exc: BaseException):
    def chunks(pt, out, read, *threads):
        if pt.name.startswith("blk.5."):
            raise exc
        return real(pt, out, read, *threads)
    real = convert_mod.tensor_chunks
    return chunks


@pytest.mark.parametrize("exc,code,line", [
    (KeyboardInterrupt(), 130, "error: interrupted (SIGINT); no output written"),
    (OSError(errno.ENOSPC, "No space left on device"), 1, "No space left on device"),
])
def test_interrupt_and_disk_full_leave_nothing(k3_tiny_dir, tmp_path, monkeypatch, capsys, exc, code, line):
    monkeypatch.setattr(convert_mod, "tensor_chunks", _failing_chunks(exc))
    assert convert_kimi_k3.main([str(k3_tiny_dir), str(tmp_path / "out.gguf"), "--quiet"]) == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and line in err
    assert list(tmp_path.iterdir()) == []


linux_only = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc")


@linux_only
def test_cli_as_a_script_and_peak_rss(k31pro_tiny_dir, tmp_path):
    rss_kb = peak_rss_kib(k31pro_tiny_dir, tmp_path / "cli.gguf", "--quiet")
    assert rss_kb < 120 * 1024, rss_kb  # measured: 41 MiB (36 MiB of it is the imports)
    assert (tmp_path / "cli.gguf").stat().st_size > 1_700_000


@pytest.fixture(scope="module")
def synthetic_210mb(tmp_path_factory) -> Path:
    """A K3.1-Pro checkpoint of about 210 MB from the project's synthetic generator."""
    dims = dict(PRESETS["tiny"], layers=4, hidden=1024, intermediate=2048, experts=32, **{
        "moe-intermediate": 1024, "latent": 1024, "kda-heads": 8, "kda-head-dim": 128, "mla-heads": 8,
        "q-lora": 256, "kv-lora": 128, "qk-nope": 64, "qk-rope": 32, "v-head-dim": 64,
        "index-heads": 8, "index-head-dim": 64})
    plan = plan_checkpoint(dims, "k31pro", seed=1)
    assert plan.total_size > 200 * 2 ** 20
    out = tmp_path_factory.mktemp("synth") / "model"
    write_checkpoint(plan, out)
    return out


@linux_only
def test_peak_rss_does_not_grow_with_model_size(synthetic_210mb, tmp_path):
    """The 210 MB checkpoint converts in about the RSS of the 2 MB fixture: tensor bytes are streamed
    from the mmap and its pages are unmapped after each chunk (measured 45 MiB for 425 MB)."""
    rss_kb = peak_rss_kib(synthetic_210mb, tmp_path / "big.gguf", "--quiet")
    assert rss_kb < 120 * 1024, rss_kb
    assert (tmp_path / "big.gguf").stat().st_size > 200 * 2 ** 20


def test_real_ctrl_c_mid_write_removes_the_partial_file(synthetic_210mb, tmp_path):
    """A real SIGINT while the conversion writes (held at its fifth tensor until the signal is
    sent, so that a loaded machine cannot make it finish first). It used to fail under load with
    exit 1: the KeyboardInterrupt landed inside threading's Condition.wait, between the wait and
    the lock's re-acquisition, and `with` released the lock twice ("release unlocked lock");
    tests/faults/test_stop_signals.py puts a signal exactly there. The stop now waits for the
    next chunk (gguf_arch/errors/signals.py)."""
    ctl, out = tmp_path / "ctl", tmp_path / "out"
    ctl.mkdir()
    out.mkdir()
    rc, err = interrupt_mid_write(ctl, synthetic_210mb, out / "big.gguf", "--quiet")
    assert rc == 130, err
    assert err.startswith("error: interrupted (SIGINT); no output written") and err.count("\n") == 1, err
    assert list(out.iterdir()) == []


def test_optional_indexer_k_norm_bias_is_converted_to_f32(k31pro_tiny_dir, tmp_path):
    ck = EditableCheckpoint(k31pro_tiny_dir, tmp_path / "model")
    name = "language_model.model.layers.7.self_attn.indexer.k_norm.bias"
    bias = np.linspace(-1, 1, 16, dtype=np.float32)
    ck.add(name, "BF16", [16], _bf16_bytes(bias), "model-00008-of-000016.safetensors")
    out = tmp_path / "bias.gguf"
    ledger = convert(ck.dir, out, log=lambda _m: None)
    assert (ledger.consumed, ledger.written) == (933, 370)
    r = _reader(out)
    assert [t.tensor_type for t in r.tensors if t.name == "blk.7.indexer.k_norm.bias"] == [Q.F32]
    assert np.array_equal(_f32(r, "blk.7.indexer.k_norm.bias"), as_f32(*source_array(ck.dir, name)))
    assert not any(t.name == "blk.3.indexer.k_norm.bias" for t in r.tensors)


def _bf16_bytes(values: np.ndarray) -> bytes:
    return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()
