"""kimi-k3-quantize's plan and command line, without running llama-quantize (tests/interop/
test_llama_tools.py runs it): which type each tensor gets, the pins handed to llama-quantize,
and the one-line errors with their exit codes."""
from __future__ import annotations

import re

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter

import kimi_k3_quantize
from gguf_arch.errors import KimiError
from quant_rules import llama_quantize as lq
from quant_rules.rules import QuantOptions, QuantRuleError, load_protected_set, parse_tensor_type
from tests.support.generated import ROWS_256, generated_gguf


def _plan(gguf, expert_type: Q, *rules: str):
    options = QuantOptions(tensor_types=tuple(parse_tensor_type(r, allowed=lq.RULE_TYPES) for r in rules))
    return lq.plan(lq.read_gguf_tensors(gguf), expert_type, options)


def test_protected_tensors_keep_their_types_and_the_experts_get_type(k31pro_tiny_gguf):
    tensors = {t.name: t.contract_type for t in lq.read_gguf_tensors(k31pro_tiny_gguf)}
    r = _plan(k31pro_tiny_gguf, Q.Q8_0, r"attn_k\.weight=f16")
    prot = load_protected_set()
    final = {d.name: d.final_type for d in r.decisions}
    assert final.keys() == tensors.keys()
    for name, t in tensors.items():
        rule = prot.rule_for(name)
        if rule is not None and rule.experts:
            assert final[name] == Q.Q8_0, name
        elif rule is not None or not name.endswith(".attn_k.weight"):
            assert final[name] == t, name  # protected, or no rule names it: as in IN
        else:
            assert final[name] == Q.F16, name  # the KDA layers' attn_k
    assert sum(final[n] == Q.Q8_0 for n in final) == 36  # 3 expert tensors x 12 MoE layers
    assert final["blk.3.indexer.attn_k.weight"] == Q.BF16  # the rule reached the indexer: refused
    [refusal] = r.log
    assert refusal.startswith(r"--tensor-type attn_k\.weight=f16: left 4 protected tensor(s) alone:")
    assert "kept at bf16: blk.*.indexer.attn_k.weight (4 layers)" in refusal


def test_a_rule_picks_an_expert_projection_before_type(k3_tiny_gguf):
    final = {d.name: d.final_type for d in _plan(k3_tiny_gguf, Q.Q8_0, r"ffn_down_exps=bf16").decisions}
    assert final["blk.1.ffn_down_exps.weight"] == Q.BF16
    assert final["blk.1.ffn_gate_exps.weight"] == final["blk.1.ffn_up_exps.weight"] == Q.Q8_0


def test_a_block_that_does_not_divide_the_row_is_refused_not_fallen_back(k3_tiny_gguf):
    # llama-quantize would write Q5_0 instead (tensor_type_fallback) and say so in its log only.
    with pytest.raises(QuantRuleError, match=r"^blk\.1\.ffn_gate_exps\.weight: row length 64 is not a multiple "
                                             r"of the q4_k block size 256"):
        _plan(k3_tiny_gguf, Q.Q4_K)


def test_the_pins_give_every_tensor_its_planned_type_under_first_match(k31pro_tiny_gguf):
    r = _plan(k31pro_tiny_gguf, Q.Q8_0, "ffn_down_exps=bf16", "attn_q_b=q8_0")
    pins = [line.rsplit("=", 1) for line in lq.pin_rules(r)]
    assert len(pins) < len(r.decisions) / 4  # one per layer template where the layers agree
    for d in r.decisions:
        first = next(t for p, t in pins if re.search(p, d.name))
        assert first == d.final_type.name.lower(), d.name
    for pattern, _ in pins:  # what llama-quantize does to them: lower-cased, whitespace-split
        assert pattern == pattern.lower() and not re.search(r"\s", pattern)


@pytest.fixture(scope="module")
def rows_256_gguf(tmp_path_factory):
    return generated_gguf(tmp_path_factory.mktemp("rows256"), "k3", *ROWS_256)


def test_very_low_bit_types_need_an_importance_matrix(tmp_path, rows_256_gguf):
    r = _plan(rows_256_gguf, Q.Q4_K, "blk\\.1\\.ffn_up_exps=iq2_xxs")
    with pytest.raises(QuantRuleError, match=r"^blk\.1\.ffn_up_exps\.weight: iq2_xxs needs an importance matrix"):
        lq.check_imatrix(r, None)
    other = tmp_path / "other.gguf"
    _write_gguf(other, {"blk.1.ffn_up_exps.weight.in_sum2": 4}, kind="model")
    with pytest.raises(KimiError, match="not an imatrix GGUF"):
        lq.check_imatrix(r, other)
    partial = tmp_path / "im.gguf"
    _write_gguf(partial, {"blk.2.ffn_up_exps.weight.in_sum2": 1024}, kind="imatrix")
    with pytest.raises(QuantRuleError, match=r"no importance data for blk\.1\.ffn_up_exps\.weight \(1 tensor"):
        lq.check_imatrix(r, partial)
    _write_gguf(partial, {"blk.1.ffn_up_exps.weight.in_sum2": 4}, kind="imatrix")
    with pytest.raises(QuantRuleError, match=r"the entry for blk\.1\.ffn_up_exps\.weight has 4 values, the "
                                             r"tensor needs 1024: an importance matrix of another model\?"):
        lq.check_imatrix(r, partial)
    _write_gguf(partial, {"blk.1.ffn_up_exps.weight.in_sum2": 256 * 4}, kind="imatrix")  # ne0 x 4 experts
    lq.check_imatrix(r, partial)
    lq.check_imatrix(_plan(rows_256_gguf, Q.Q4_K), None)  # no imatrix needed


def _write_gguf(path, tensors: dict[str, int], kind: str) -> None:
    w = GGUFWriter(path, arch="imatrix" if kind == "imatrix" else "kimi-k3")
    w.add_type(kind)
    for name, n in tensors.items():
        w.add_tensor(name, np.ones(n, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ---- the command line: one line on stderr and the documented exit code ------------------------

def _cli(capsys, *argv) -> tuple[int, str]:
    rc = kimi_k3_quantize.main([str(a) for a in argv])
    err = capsys.readouterr().err
    return rc, err


@pytest.mark.parametrize("args, code, message", [
    (("TYPE_PLACEHOLDER", "q9"), 2, "TYPE: unknown or unsupported type 'q9'"),
    (("TYPE_PLACEHOLDER", "q4_0"), 2, "TYPE: unknown or unsupported type 'q4_0'"),
    (("TYPE_PLACEHOLDER", "tq1_0"), 2, "TYPE: unknown or unsupported type 'tq1_0'"),
    (("TYPE_PLACEHOLDER", "q8_0", "--tensor-type", "attn_q"), 2, "malformed rule 'attn_q'"),
    (("TYPE_PLACEHOLDER", "q8_0", "--tensor-type", "attn_q=q1_0"), 2, "unknown or unsupported type 'q1_0'"),
    (("TYPE_PLACEHOLDER", "q8_0", "--imatrix", "absent.gguf"), 2, "absent.gguf: --imatrix file not found"),
    (("TYPE_PLACEHOLDER", "q8_0", "--threads", "0"), 2, "--threads 0: must be >= 1"),
    (("TYPE_PLACEHOLDER",), 2, "the following arguments are required: TYPE (see kimi-k3-quantize --help)"),
])
def test_bad_arguments(capsys, tmp_path, k3_tiny_gguf, args, code, message):
    argv = [k3_tiny_gguf, tmp_path / "out.gguf", *args[1:]]
    rc, err = _cli(capsys, *argv)
    assert rc == code and err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert not (tmp_path / "out.gguf").exists()


def test_input_that_is_not_a_kimi_k3_gguf(capsys, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF not really")
    rc, err = _cli(capsys, bad, tmp_path / "out.gguf", "q8_0")
    assert rc == 2 and err.startswith(f"error: {bad}: ") and err.count("\n") == 1
    rc, err = _cli(capsys, tmp_path / "absent.gguf", tmp_path / "out.gguf", "q8_0")
    assert rc == 2 and err == f"error: {tmp_path / 'absent.gguf'}: not found\n"


def test_existing_output_and_missing_tool_are_runtime_failures(capsys, tmp_path, monkeypatch, k3_tiny_gguf):
    out = tmp_path / "out.gguf"
    out.write_bytes(b"keep me")
    rc, err = _cli(capsys, k3_tiny_gguf, out, "q8_0")
    assert rc == 1 and err == f"error: {out}: already exists (use --overwrite to replace it)\n"
    assert out.read_bytes() == b"keep me"
    monkeypatch.setenv(lq.LLAMA_BIN_ENV, str(tmp_path))
    rc, err = _cli(capsys, k3_tiny_gguf, out, "q8_0", "--overwrite")
    assert rc == 1 and err.startswith(f"error: {tmp_path / 'llama-quantize'}: not found or not executable")
    assert out.read_bytes() == b"keep me"


def test_same_file_in_and_out_is_refused(capsys, tmp_path, k3_tiny_gguf):
    rc, err = _cli(capsys, k3_tiny_gguf, k3_tiny_gguf, "q8_0", "--overwrite")
    assert rc == 2 and "which this run reads" in err
    link = tmp_path / "link.gguf"
    link.symlink_to(k3_tiny_gguf)  # the input again, through a link
    rc, err = _cli(capsys, k3_tiny_gguf, link, "q8_0", "--overwrite")
    assert rc == 2 and "which this run reads" in err
    rules = tmp_path / "rules.txt"
    rules.write_text("")
    rc, err = _cli(capsys, k3_tiny_gguf, rules, "q8_0", "--tensor-type-file", str(rules), "--overwrite")
    assert rc == 2 and "is a --tensor-type-file" in err and rules.exists()


def test_print_tensor_types_lists_every_tensor_and_writes_nothing(capsys, tmp_path, k3_tiny_gguf):
    rc = kimi_k3_quantize.main([str(k3_tiny_gguf), str(tmp_path / "out.gguf"), "q8_0", "--print-tensor-types"])
    out = capsys.readouterr().out.splitlines()
    assert rc == 0 and not (tmp_path / "out.gguf").exists()
    row = next(line for line in out if line.startswith("blk.1.ffn_gate_exps.weight "))
    assert row.split()[-6:] == ["mxfp4", "q8_0", "TYPE", "q8_0", "(routed", "experts)"]
    assert out[-1].startswith("353 tensors, ")


# ---- what comes back from llama-quantize (a stand-in script here; the real one in tests/interop) ----

def _stand_in(tmp_path, monkeypatch, body: str) -> None:
    """A llama-quantize that runs `body` with IN and OUT set from its command line."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "llama-quantize"
    # kimi-k3-quantize ends the command with IN OUT FTYPE NTHREADS.
    tool.write_text('#!/bin/sh\nn=$#\neval IN=\\${$((n - 3))}\neval OUT=\\${$((n - 2))}\n' + body + "\n")
    tool.chmod(0o755)
    monkeypatch.setenv(lq.LLAMA_BIN_ENV, str(bin_dir))


@pytest.mark.parametrize("body, message", [
    ('echo "llama_model_quantize: failed to quantize: disk on fire" >&2; exit 3',
     "llama-quantize failed: llama_model_quantize: failed to quantize: disk on fire (exit code 3)"),
    ('cp "$IN" "$OUT"', "llama-quantize wrote blk.1.ffn_gate_exps.weight as mxfp4, planned q8_0"),
    ('echo junk > "$OUT"', "llama-quantize's output is not a readable GGUF: "),
    ("exit 0", "llama-quantize's output is not a readable GGUF: "),
])
def test_a_bad_llama_quantize_run_is_one_line_and_leaves_nothing(capsys, tmp_path, monkeypatch, k3_tiny_gguf,
                                                                 body, message):
    _stand_in(tmp_path, monkeypatch, body)
    rc, err = _cli(capsys, k3_tiny_gguf, tmp_path / "out.gguf", "q8_0")
    assert rc == 1 and err.startswith(f"error: {message}") and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin"]  # no output, no temporary directory
