"""The options through the converter CLI: a Q8_0 trunk within Q8_0's bound of the source, the
experts and every protected tensor byte-identical to the plain conversion, and
--print-tensor-types / --export-quantize-rules on the real K3.1-Pro plan without weights."""
from __future__ import annotations

import re

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, quants

import convert_kimi_k3
from gguf_arch.io.safetensors import open_checkpoint
from gguf_arch.io.safetensors import to_f32
from quant_rules.rules import load_protected_set

from tests.support.real_plan import write_k31pro_plan


def _tensors(path) -> dict:
    return {t.name: t for t in GGUFReader(path).tensors}


@pytest.fixture(scope="module")
def q8_gguf(tmp_path_factory, k31pro_tiny_dir):
    out = tmp_path_factory.mktemp("q8") / "q8.gguf"
    rc = convert_kimi_k3.main([str(k31pro_tiny_dir), str(out), "--quiet", "--outtype", "q8_0",
                               "--tensor-type", ".*=q8_0", "--tensor-type", "attn_k=q8_0"])
    assert rc == 0
    return out


def test_protected_tensors_and_experts_are_byte_identical(q8_gguf, k31pro_tiny_gguf):
    plain, q8 = _tensors(k31pro_tiny_gguf), _tensors(q8_gguf)
    prot = load_protected_set()
    protected = [n for n in plain if prot.rule_for(n) is not None]
    assert sum("_exps." in n for n in protected) == 36 and sum(".indexer." in n for n in protected) == 16
    for name in protected:
        assert q8[name].tensor_type == plain[name].tensor_type, name
        assert q8[name].data.tobytes() == plain[name].data.tobytes(), name
    assert q8["blk.3.indexer.attn_q_b.weight"].tensor_type == Q.BF16
    assert q8["blk.3.indexer.attn_k.weight"].tensor_type == Q.BF16
    assert q8["blk.3.indexer.proj.weight"].tensor_type == Q.F32


def test_q8_0_trunk_is_within_the_q8_0_bound_of_the_source(q8_gguf, k31pro_tiny_dir):
    q8 = _tensors(q8_gguf)
    t = q8["blk.1.attn_q.weight"]
    assert t.tensor_type == Q.Q8_0
    got = quants.dequantize(t.data, Q.Q8_0).reshape(-1, 32).astype(np.float64)
    with open_checkpoint(k31pro_tiny_dir) as ckpt:
        ref = to_f32(*ckpt.read("language_model.model.layers.1.self_attn.q_proj.weight")).reshape(-1, 32)
    amax = np.abs(ref).max(axis=1, keepdims=True).astype(np.float64)
    bound = amax / 254 + 127 * np.maximum(amax / 127 * 2.0 ** -11, 2.0 ** -25)
    err = np.abs(got - ref)
    assert np.all(err <= bound) and err.max() > 0
    assert sum(v.tensor_type == Q.Q8_0 for v in q8.values()) > 100


def test_requantized_f32_experts_equal_the_mxfp4_values(tmp_path, k31pro_tiny_dir, k31pro_tiny_gguf, capsys):
    out = tmp_path / "f32.gguf"
    assert convert_kimi_k3.main([str(k31pro_tiny_dir), str(out), "--requantize-experts", "f32"]) == 0
    io = capsys.readouterr()
    assert "warning: --requantize-experts f32" in io.err
    assert "blk.1.ffn_gate_exps.weight: requantized mxfp4 -> f32, relative error ||w'-w||/||w|| = 0.000%" in io.out
    plain, f32 = _tensors(k31pro_tiny_gguf), _tensors(out)
    src = plain["blk.1.ffn_down_exps.weight"]
    assert f32["blk.1.ffn_down_exps.weight"].tensor_type == Q.F32
    assert np.array_equal(quants.dequantize(src.data, Q.MXFP4).reshape(-1),
                          np.asarray(f32["blk.1.ffn_down_exps.weight"].data).reshape(-1))


def test_convert_logs_the_tensors_it_left_alone(tmp_path, k31pro_tiny_dir, capsys):
    out = tmp_path / "o.gguf"
    assert convert_kimi_k3.main([str(k31pro_tiny_dir), str(out), "--tensor-type", "indexer=q8_0"]) == 0
    (line,) = [l for l in capsys.readouterr().out.splitlines() if "alone" in l]
    assert line.startswith("--tensor-type indexer=q8_0: left 16 protected tensor(s) alone:")


@pytest.fixture(scope="module")
def k31pro_real_plan(tmp_path_factory):
    return write_k31pro_plan(tmp_path_factory.mktemp("k31pro-plan"))


def test_print_tensor_types_on_the_real_k31pro_plan(k31pro_real_plan, tmp_path, capsys):
    rules = tmp_path / "protect.txt"
    # How long it takes is measured by bench/planning.py, not asserted here.
    rc = convert_kimi_k3.main([str(k31pro_real_plan), "--print-tensor-types", "--outtype", "q8_0",
                               "--export-quantize-rules", str(rules)])
    assert rc == 0
    out = capsys.readouterr().out.splitlines()
    rows = {l.split()[0]: re.split(r"\s{2,}", l) for l in out if l.startswith(("blk.", "token_embd", "output"))}
    assert len(rows) == 2573 + 24 * 4  # K3's tensors plus 4 indexer tensors per DSA layer
    assert rows["blk.3.indexer.attn_q_b.weight"][2:] == ["bf16", "bf16", "protected: indexer-projections"]
    assert rows["blk.3.indexer.attn_k.weight"][2:] == ["bf16", "bf16", "protected: indexer-projections"]
    assert rows["blk.3.indexer.proj.weight"][2:] == ["bf16", "f32", "protected: indexer-head-weights"]
    assert rows["blk.3.attn_q_b.weight"][2:] == ["bf16", "q8_0", "--outtype q8_0"]
    assert rows["blk.1.ffn_gate_exps.weight"][2:] == ["mxfp4", "mxfp4", "protected: routed-experts"]
    assert out[0].startswith("source types as config.json declares them (bf16")
    # The protected-tensor note: a header, then per rule its tensors (at most 3 named) and its reason,
    # wrapped at 100 columns (it was one 2,900-character line).
    start = out.index("--outtype q8_0: left 1484 protected tensor(s) alone:")
    note = out[start:next(i for i in range(start + 1, len(out)) if not out[i].startswith(" "))]
    assert max(map(len, note)) <= 100 and len(note) > 10
    assert "  norms, kept at f32: output_norm.weight, blk.*.attn_norm.weight (93 layers), blk.*.ffn_norm.weight" in note
    assert "      (93 layers) ... and 4 more" in note
    assert sum(l.startswith("    why: ") for l in note) == 11
    assert out[-2] == ("2669 tensors, 1.37 TiB: q8_0 1185 (55.5 GiB), f32 1160 (2.27 GiB), mxfp4 276 (1.32 TiB), "
                       "bf16 48 (330 MiB)")
    assert out[-2].startswith("2669 tensors") and out[-1].startswith(
        f"wrote llama-quantize rules to {rules}: pass them before your own rules")
    assert r"\.indexer\.(attn_q_b|attn_k)\.weight$=bf16" in rules.read_text().split()


def test_output_is_required_unless_printing(k31pro_tiny_dir, capsys):
    assert convert_kimi_k3.main([str(k31pro_tiny_dir)]) == 2
    assert capsys.readouterr().err == ("error: the output file OUT (or --outfile OUT) is required unless "
                                       "--print-tensor-types or --mmproj-only is given (see convert-kimi-k3 --help)\n")
    assert convert_kimi_k3.main([str(k31pro_tiny_dir), "--print-tensor-types", "--tensor-type", "attn_q"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == "error: --tensor-type: malformed rule 'attn_q' (expected PATTERN=TYPE)"
