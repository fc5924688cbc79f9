"""The K3 transforms on small arrays, and the streaming of real-size tensors."""
from __future__ import annotations

import time
import tracemalloc

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from gguf_arch.arch import transforms
from gguf_arch.io import buffers, pipeline
from gguf_arch.errors import CheckpointError
from gguf_arch.arch.mxfp4 import BLOCK_BYTES
from gguf_arch.io.direct_io import BLOCK
from gguf_arch.io.safetensors import open_checkpoint
from gguf_arch.arch.tensors import TABLE, PlannedTensor, specs_by_gguf_template
from gguf_arch.arch.transforms import TRANSFORMS, tensor_chunks
from gguf_arch.io.safetensors import to_f32

from tests.support.checkpoint_edit import write_shard


def _pt(template: str, shape: tuple, sources: tuple):
    """A planned row of a table spec with concrete names and shapes."""
    return PlannedTensor(specs_by_gguf_template()[template], 0, template.format(l=0), shape, sources)


def _reader(arrays: dict):
    return lambda name: arrays[name]


def _bytes(chunks) -> bytes:
    return b"".join(bytes(c) for c in chunks)


def _bf16(values) -> np.ndarray:
    return torch.tensor(values, dtype=torch.float32).to(torch.bfloat16).view(torch.uint16).numpy()


def test_every_table_transform_is_implemented():
    assert {spec.transform for spec in TABLE} <= TRANSFORMS.keys()


def test_bf16_widening_is_exact_for_every_bit_pattern():
    every = np.arange(1 << 16, dtype=np.uint16)
    want = torch.from_numpy(every.view(np.int16)).view(torch.bfloat16).float().numpy()
    got = to_f32("BF16", every)
    finite = np.isfinite(want)
    assert np.array_equal(got.view(np.uint32)[finite], want.view(np.uint32)[finite])
    assert np.array_equal(np.isnan(got), np.isnan(want))


def test_neg_exp_heads_is_the_correctly_rounded_f32_of_the_head_entries():
    a_log = np.zeros(64, dtype=np.float32)
    a_log[:48] = np.random.default_rng(5).uniform(-3, 3, 48)
    pt = _pt("blk.{l}.ssm_a", (48,), (("A", (64,)),))
    out = np.frombuffer(_bytes(tensor_chunks(pt, Q.F32, _reader({"A": ("F32", a_log)}))), np.float32)
    exact = -np.exp(a_log[:48].astype(np.float64))
    assert np.array_equal(out, exact.astype(np.float32))
    # The nearest f32: no other f32 is closer to the float64 value.
    for direction in (np.inf, -np.inf):
        assert np.all(np.abs(np.nextafter(out, direction).astype(np.float64) - exact) >= np.abs(out - exact))


def test_neg_exp_heads_refuses_a_nonzero_padding_tail_naming_the_tensor():
    a_log = np.array([0.5, -1.0, 2.0, 0.0, 1e-30, 0.0], dtype=np.float32)
    pt = _pt("blk.{l}.ssm_a", (3,), (("layers.0.self_attn.A_log", (6,)),))
    with pytest.raises(CheckpointError, match=r"layers\.0\.self_attn\.A_log.*zero padding.*\[4\]"):
        _bytes(tensor_chunks(pt, Q.F32, _reader({"layers.0.self_attn.A_log": ("F32", a_log)})))


def test_res_score_is_norm_times_proj_in_f32():
    rng = np.random.default_rng(0)
    norm, proj = rng.standard_normal(8), rng.standard_normal((1, 8))
    pt = _pt("blk.{l}.attn_res_score.weight", (8,), (("n", (8,)), ("p", (1, 8))))
    arrays = {"n": ("BF16", _bf16(norm)), "p": ("BF16", _bf16(proj))}
    got = np.frombuffer(_bytes(tensor_chunks(pt, Q.F32, _reader(arrays))), np.float32)
    tn = torch.from_numpy(_bf16(norm).view(np.int16)).view(torch.bfloat16).float()
    tp = torch.from_numpy(_bf16(proj).view(np.int16)).view(torch.bfloat16).float()
    assert np.array_equal(got, (tn * tp.flatten()).numpy())


@pytest.mark.parametrize("heads,nope,v,lora", [(2, 3, 4, 5), (4, 16, 16, 32)])
def test_kv_b_split(heads, nope, v, lora):
    kv_b = np.arange(heads * (nope + v) * lora, dtype=np.uint16).reshape(heads * (nope + v), lora)
    src = (("kv", kv_b.shape),)
    k = _pt("blk.{l}.attn_k_b.weight", (heads, lora, nope), src)
    vv = _pt("blk.{l}.attn_v_b.weight", (heads, v, lora), src)
    read = _reader({"kv": ("BF16", kv_b)})
    got_k = np.frombuffer(_bytes(tensor_chunks(k, Q.BF16, read)), np.uint16).reshape(heads, lora, nope)
    got_v = np.frombuffer(_bytes(tensor_chunks(vv, Q.BF16, read)), np.uint16).reshape(heads, v, lora)
    for h in range(heads):
        rows = kv_b[h * (nope + v):(h + 1) * (nope + v)]
        assert np.array_equal(got_k[h], rows[:nope].T)  # k_b[h] = W_k^T: latent is the row
        assert np.array_equal(got_v[h], rows[nope:])


def test_conv_reshape_keeps_bytes_and_bf16_is_widened_for_f32_outputs():
    conv = np.arange(12, dtype=np.float32).reshape(3, 1, 4)
    pt = _pt("blk.{l}.ssm_conv1d_q.weight", (1, 3, 1, 4), (("c", (3, 1, 4)),))
    assert _bytes(tensor_chunks(pt, Q.F32, _reader({"c": ("F32", conv)}))) == conv.tobytes()
    norm = _bf16([1.5, -2.25, 3e-3])
    pt = _pt("blk.{l}.attn_norm.weight", (3,), (("n", (3,)),))
    got = np.frombuffer(_bytes(tensor_chunks(pt, Q.F32, _reader({"n": ("BF16", norm)}))), np.float32)
    assert np.array_equal(got, torch.from_numpy(norm.view(np.int16)).view(torch.bfloat16).float().numpy())


def test_bf16_passthrough_keeps_the_source_bytes():
    w = _bf16(np.random.default_rng(1).standard_normal((5, 7)))
    pt = _pt("blk.{l}.attn_q.weight", (5, 7), (("w", (5, 7)),))
    assert _bytes(tensor_chunks(pt, Q.BF16, _reader({"w": ("BF16", w)}))) == w.tobytes()


@pytest.fixture(scope="module")
def real_size_checkpoint(tmp_path_factory):
    """One real K3 KDA projection [12288, 7168] bf16 and six real-size w1 experts."""
    d = tmp_path_factory.mktemp("realsize")
    big = (np.arange(12288 * 7168, dtype=np.uint32) % 65521).astype(np.uint16)
    rng = np.random.default_rng(2)
    tensors = {"q": ("BF16", [12288, 7168], big.tobytes())}
    for e in range(6):
        tensors[f"e{e}.p"] = ("U8", [3072, 1792], rng.integers(0, 256, 3072 * 1792, dtype=np.uint8).tobytes())
        tensors[f"e{e}.s"] = ("U8", [3072, 112], rng.integers(118, 130, 3072 * 112, dtype=np.uint8).tobytes())
    write_shard(d / "model-00001-of-000001.safetensors", tensors)
    (d / "model.safetensors.index.json").write_text(
        '{"weight_map": {%s}}' % ", ".join(f'"{n}": "model-00001-of-000001.safetensors"' for n in tensors))
    return d


@pytest.fixture
def traced_buffers(monkeypatch):
    """Every chunk buffer fresh memory, so that tracemalloc sees it (the reused set is a mapping
    tracemalloc does not trace)."""
    monkeypatch.setattr(buffers, "_shared", buffers.BufferSet(0))


def test_real_size_bf16_passthrough_is_read_in_bounded_chunks(real_size_checkpoint, monkeypatch, traced_buffers):
    """The shards are read with pread (no map to SIGBUS): a 176 MB projection above WHOLE_BYTES is
    read a chunk at a time. At most two chunks live at once (the one the consumer still holds while
    the next is read), so 8 MiB chunks bound the peak at 16 MiB plus bookkeeping, whatever the
    tensor's size (21 chunks here)."""
    monkeypatch.setattr(transforms, "CHUNK_BYTES", 8 << 20)
    with open_checkpoint(real_size_checkpoint) as ckpt:
        pt = _pt("blk.{l}.attn_q.weight", (12288, 7168), (("q", (12288, 7168)),))
        want = np.asarray(ckpt.array("q")).reshape(-1).view(np.uint8)
        tracemalloc.start()
        n = total = 0
        for chunk in tensor_chunks(pt, Q.BF16, ckpt.read):
            assert len(chunk) <= transforms.CHUNK_BYTES
            assert np.array_equal(np.frombuffer(chunk, dtype=np.uint8), want[total:total + len(chunk)])
            n, total = n + 1, total + len(chunk)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert total == 12288 * 7168 * 2 and n == 21
    assert peak < 2 * transforms.CHUNK_BYTES + (1 << 20)


def test_real_size_experts_are_produced_one_expert_at_a_time(real_size_checkpoint, monkeypatch, traced_buffers):
    monkeypatch.setattr(transforms, "REPACK_AHEAD", 1)
    with open_checkpoint(real_size_checkpoint) as ckpt:
        sources = tuple((n, ckpt.entries[n].meta.shape) for e in range(6) for n in (f"e{e}.p", f"e{e}.s"))
        pt = _pt("blk.{l}.ffn_gate_exps.weight", (6, 3072, 3584), sources)
        one_expert = 3072 * 3584 // 32 * BLOCK_BYTES
        tracemalloc.start()
        try:
            sizes = [len(chunk) for chunk in tensor_chunks(pt, Q.MXFP4, ckpt.read)]
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert sizes == [one_expert] * 6
    # The experts' source bytes are read into memory (pread, 5.85 MB a pair, the size of one
    # repacked expert). In flight with one expert repacked ahead: its input and output, the next
    # input the generator holds, and the output the consumer holds: 4 experts' worth (measured 3.3,
    # the repack's temporaries are ~1.5 MB), whatever the number of experts (896 in the real K3);
    # a non-streaming path would hold all 6 inputs or outputs.
    assert peak < 4 * one_expert


def test_copies_and_experts_are_laid_out_for_their_offset_in_the_output(real_size_checkpoint):
    """With the tensor's offset in the output file, every chunk of a copied tensor and every
    repacked expert sits at an address congruent to its own offset there modulo BLOCK (the writer
    writes its whole blocks without a copy), and the bytes are those produced without it."""
    place = 10 ** 9 + 4096 * 3 + 77
    with open_checkpoint(real_size_checkpoint) as ckpt:
        sources = tuple((n, ckpt.entries[n].meta.shape) for e in range(6) for n in (f"e{e}.p", f"e{e}.s"))
        for pt, qtype in [(_pt("blk.{l}.attn_q.weight", (12288, 7168), (("q", (12288, 7168)),)), Q.BF16),
                          (_pt("blk.{l}.ffn_gate_exps.weight", (6, 3072, 3584), sources), Q.MXFP4)]:
            at = place
            for chunk, plain in zip(tensor_chunks(pt, qtype, ckpt.read, place=place),
                                    tensor_chunks(pt, qtype, ckpt.read), strict=True):
                assert np.frombuffer(chunk, np.uint8).ctypes.data % BLOCK == at % BLOCK, (pt.name, at - place)
                assert chunk == plain, (pt.name, at - place)
                at += len(chunk)
            assert at - place == pt.shape[0] * pt.shape[1] * (2 if qtype == Q.BF16 else pt.shape[2] // 32 * BLOCK_BYTES)


def test_ahead_keeps_order_and_bounds_the_work_in_flight():
    running, most = set(), [0]

    def work(i):
        running.add(i)
        most[0] = max(most[0], len(running))
        time.sleep(0.001 * (7 - i % 7))
        running.discard(i)
        return i * i

    consumed = []
    for result in pipeline.ahead(work, range(30), 3):
        consumed.append(result)
        assert len(running) <= 3
    assert consumed == [i * i for i in range(30)] and most[0] <= 3
