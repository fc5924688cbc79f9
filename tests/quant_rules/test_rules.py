"""The resolver on the k31pro-tiny plan: protected tensors keep their contract types whatever the
options; other tensors follow llama-quantize's precedence and pattern semantics."""
from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType as Q

from gguf_arch.arch.config import load_config
from gguf_arch.arch.mmproj import plan_vision_tensors
from gguf_arch.arch.vision import load_vision_config
from gguf_arch.convert.plan import plan_conversion
from gguf_arch.errors import EXIT_BAD_INPUT
from gguf_arch.io.safetensors import open_checkpoint
from gguf_arch.arch.tensors import OUT_F32, plan_tensors
from quant_rules.rules import (QuantOptions, QuantRuleError, TypedTensor, load_protected_set, parse_tensor_type,
                               resolve_types)

INDEXER_PROJECTIONS = ("indexer.attn_q_b.weight", "indexer.attn_k.weight", "indexer.proj.weight")


@pytest.fixture(scope="module")
def tiny(k31pro_tiny_dir):
    cfg = load_config(k31pro_tiny_dir)
    with open_checkpoint(k31pro_tiny_dir) as ckpt:
        plan = plan_conversion(cfg, ckpt.metas)
        return [p.typed() for p in plan.outputs], plan


def _rules(*texts: str) -> tuple:
    return tuple(parse_tensor_type(t) for t in texts)


CASES = {
    "all": QuantOptions(tensor_types=_rules(".*=q8_0")),
    "attn_k": QuantOptions(tensor_types=_rules("attn_k=q8_0")),
    "indexer": QuantOptions(tensor_types=_rules("indexer=q8_0")),
    "outtype": QuantOptions(outtype=Q.Q8_0),
}


@pytest.mark.parametrize("case", CASES)
def test_protected_tensors_keep_contract_types(tiny, case):
    tensors, _ = tiny
    res = resolve_types(tensors, CASES[case])
    protected = [d for d in res.decisions if d.protected_by is not None]
    assert protected and all(d.final_type == d.contract_type for d in protected)
    indexer = [d for d in res.decisions if d.name.endswith(INDEXER_PROJECTIONS)]
    assert len(indexer) == 3 * 4  # 4 DSA layers in the fixture
    for d in indexer:
        want = Q.F32 if d.name.endswith("indexer.proj.weight") else Q.BF16  # docs/reference/gguf.md#indexer-tensors
        assert d.final_type == want and d.rule.startswith("protected: indexer-"), d


@pytest.mark.parametrize("case", ["all", "attn_k", "outtype"])
def test_other_matching_tensors_change(tiny, case):
    tensors, _ = tiny
    opts = CASES[case]
    res = resolve_types(tensors, opts)
    rule = opts.tensor_types[0] if opts.tensor_types else None
    targets = [d for d in res.decisions if d.protected_by is None and (rule is None or rule.matches(d.name))]
    assert targets
    for d in targets:
        want = Q.Q8_0 if d.shape[-1] % 32 == 0 else Q.F16  # the fixture's 16-wide rows fall back
        assert d.final_type == want, d
    assert any(d.final_type == Q.Q8_0 for d in targets)
    untouched = [d for d in res.decisions if d.protected_by is None and d not in targets]
    assert all(d.final_type == d.contract_type for d in untouched)


def test_indexer_pattern_changes_nothing_and_says_so(tiny):
    tensors, _ = tiny
    res = resolve_types(tensors, CASES["indexer"])
    assert all(d.final_type == d.contract_type for d in res.decisions)
    (line,) = [l for l in res.log if l.startswith("--tensor-type indexer=q8_0")]
    assert "blk.*.indexer.attn_q_b.weight (4 layers)" in line and "blk.*.indexer.attn_k.weight (4 layers)" in line
    assert "top-k key selection is sensitive" in line and "kept at bf16" in line


@pytest.mark.parametrize("case", CASES)
def test_one_log_line_per_refusing_option(tiny, case):
    tensors, _ = tiny
    res = resolve_types(tensors, CASES[case])
    refusals = [l for l in res.log if "protected tensor(s) alone" in l]
    assert len(refusals) == 1
    assert "indexer.attn_k.weight" in refusals[0]


def test_refusal_only_when_the_type_would_differ(tiny):
    tensors, _ = tiny
    res = resolve_types(tensors, QuantOptions(tensor_types=_rules(r"indexer\.proj=f32")))
    assert not any("alone" in l for l in res.log)


def test_first_matching_rule_wins_and_patterns_are_lowercased(tiny):
    tensors, _ = tiny
    first = resolve_types(tensors, QuantOptions(tensor_types=_rules("ATTN_Q=F16", "attn_q=q8_0", ".*=q4_0")))
    by = {d.name: d for d in first.decisions}
    assert by["blk.0.attn_q.weight"].final_type == Q.F16
    assert by["blk.0.attn_q.weight"].rule == "--tensor-type attn_q=f16"
    assert by["blk.0.attn_v.weight"].final_type == Q.Q4_0


def test_named_tensor_options_take_precedence_over_patterns(tiny):
    tensors, _ = tiny
    opts = QuantOptions(outtype=Q.F16, tensor_types=_rules(".*=q8_0"), token_embedding_type=Q.Q4_0,
                        output_tensor_type=Q.BF16)
    by = {d.name: d for d in resolve_types(tensors, opts).decisions}
    assert by["token_embd.weight"].final_type == Q.Q4_0
    assert by["output.weight"].final_type == Q.BF16
    assert by["blk.0.attn_q.weight"].final_type == Q.Q8_0


def test_auto_keeps_every_contract_type(tiny):
    tensors, plan = tiny
    res = resolve_types(tensors, QuantOptions())
    assert [d.final_type for d in res.decisions] == [p.output.ggml_type for p in plan.outputs]
    assert res.log == ()


def test_experts_change_only_with_requantize_experts(tiny):
    tensors, _ = tiny
    kept = resolve_types(tensors, QuantOptions(outtype=Q.F32, tensor_types=_rules("exps=f16")))
    experts = [d for d in kept.decisions if "_exps." in d.name]
    assert len(experts) == 3 * 12 and all(d.final_type == Q.MXFP4 for d in experts)
    moved = resolve_types(tensors, QuantOptions(requantize_experts=Q.Q8_0))
    for d in moved.decisions:
        assert d.final_type == (Q.Q8_0 if "_exps." in d.name else d.contract_type)


def test_fallback_is_f16_or_f32_with_a_log_line():
    tensors = [TypedTensor("blk.0.attn_q.weight", (4, 48), "BF16", Q.BF16),
               TypedTensor("blk.0.attn_v.weight", (4, 48), "F32", Q.F32)]
    res = resolve_types(tensors, QuantOptions(outtype=Q.Q8_0))
    assert [d.final_type for d in res.decisions] == [Q.F16, Q.F32]
    assert all(d.fell_back_from == Q.Q8_0 for d in res.decisions)
    assert res.log == ("blk.0.attn_q.weight: --outtype q8_0, fell back to f16: row length 48 is not a multiple "
                       "of the q8_0 block size 32",
                       "blk.0.attn_v.weight: --outtype q8_0, fell back to f32: row length 48 is not a multiple "
                       "of the q8_0 block size 32")


def _both_plans(model_dir):
    """The text GGUF's tensors and the mmproj's."""
    return [*plan_tensors(load_config(model_dir)), *plan_vision_tensors(load_vision_config(model_dir)[0])]


def test_every_f32_contract_tensor_is_protected(k31pro_tiny_dir):
    """The tables' forced-F32 tensors (the mmproj's too) and the protected set agree: no option can move one."""
    prot = load_protected_set()
    for pt in _both_plans(k31pro_tiny_dir):
        if pt.spec.out == OUT_F32:
            assert prot.rule_for(pt.name) is not None, pt.name


def test_every_protected_rule_and_named_tensor_exists_in_the_plan(k31pro_tiny_dir):
    prot = load_protected_set()
    names = [pt.name for pt in _both_plans(k31pro_tiny_dir)]
    for rule in prot.rules:
        assert any(rule.matches(n) for n in names), rule.name
    assert prot.token_embedding in names and prot.output in names


@pytest.mark.parametrize("text, says", [
    ("attn_k", "malformed rule"),
    ("=q8_0", "no tensor name pattern"),
    ("attn_k=", "no type after"),
    ("attn_k=q4_k", "unknown or unsupported type 'q4_k'"),
    ("(attn=q8_0", "not a valid regular expression"),
])
def test_bad_rules_are_one_line_input_errors(text, says):
    with pytest.raises(QuantRuleError) as err:
        parse_tensor_type(text, "rules.txt:3")
    assert says in str(err.value) and str(err.value).startswith("rules.txt:3: ")
    assert "\n" not in str(err.value) and err.value.exit_code == EXIT_BAD_INPUT
