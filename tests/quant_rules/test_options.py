"""Rule files, option parsing, and the llama-quantize export: valid in llama-quantize's syntax
(parse_tensor_type, whitespace-split files, lower-cased std::regex patterns, first match wins) and
keeping every protected tensor at its type when a user's own rules follow."""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess

import pytest
from gguf import GGMLQuantizationType as Q

from gguf_arch.arch.config import load_config
from gguf_arch.convert.plan import plan_conversion, resolve_plan
from gguf_arch.io.safetensors import open_checkpoint
from quant_rules.options import (add_quant_arguments, quant_options, quantize_rules_lines, read_tensor_type_file,
                                     requantize_warning, write_quantize_rules)
from quant_rules.rules import EXPERT_TYPES, QuantOptions, QuantRuleError, parse_tensor_type

# ggml_type_name() of every type llama-quantize's parse_ggml_type accepts that can appear here.
GGML_TYPE_NAMES = {"f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "mxfp4", "q4_k", "q6_k"}


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_quant_arguments(p)
    return p.parse_args(argv)


def test_options_from_arguments(tmp_path):
    f = tmp_path / "rules.txt"
    f.write_text("# trunk\nffn_down=q4_0   attn_output=q5_0  # two on a line\n\n  output=q8_0\n")
    opts = quant_options(_parse(["--outtype", "bf16", "--tensor-type", "attn_q=q8_0", "--tensor-type-file", str(f),
                                 "--output-tensor-type", "F16", "--token-embedding-type", "q8_0",
                                 "--requantize-experts", "BF16"]))
    assert opts.outtype == Q.BF16 and opts.output_tensor_type == Q.F16 and opts.token_embedding_type == Q.Q8_0
    assert opts.requantize_experts == Q.BF16
    assert [(r.pattern, r.type, r.origin) for r in opts.tensor_types] == [
        ("attn_q", Q.Q8_0, "--tensor-type"), ("ffn_down", Q.Q4_0, f"{f}:2"), ("attn_output", Q.Q5_0, f"{f}:2"),
        ("output", Q.Q8_0, f"{f}:4")]
    assert quant_options(_parse([])) == QuantOptions()


def test_rule_file_errors_name_file_and_line(tmp_path):
    f = tmp_path / "rules.txt"
    f.write_text("attn_q=q8_0\nattn_k\n")
    with pytest.raises(QuantRuleError, match=re.escape(f"{f}:2: malformed rule 'attn_k'")):
        read_tensor_type_file(f)
    with pytest.raises(QuantRuleError, match="cannot read"):
        read_tensor_type_file(tmp_path / "missing.txt")


def test_four_bit_expert_requantization_is_refused_with_the_measured_cost():
    with pytest.raises(QuantRuleError, match=r"9\.8% mean relative error"):
        quant_options(_parse(["--requantize-experts", "q4_0"]))
    with pytest.raises(QuantRuleError, match="unknown or unsupported type 'q6_k'"):
        quant_options(_parse(["--requantize-experts", "q6_k"]))


@pytest.mark.parametrize("t, says", [(Q.F32, "exact"), (Q.BF16, "exact"), (Q.F16, "104..140"), (Q.Q8_0, "/254")])
def test_requantize_warning_states_the_cost(t, says):
    assert t in EXPERT_TYPES
    text = requantize_warning(t)
    assert text.startswith("warning: --requantize-experts") and says in text and "\n" not in text


@pytest.fixture(scope="module")
def exported(k31pro_tiny_dir):
    cfg = load_config(k31pro_tiny_dir)
    with open_checkpoint(k31pro_tiny_dir) as ckpt:
        plan = plan_conversion(cfg, ckpt.metas)
        res = resolve_plan(plan.outputs, QuantOptions(outtype=Q.Q8_0))
    return res, quantize_rules_lines(res)


def _llama_quantize_parse(word: str) -> tuple[str, str]:
    """llama-quantize's parse_tensor_type: split at the first '=', both sides non-empty, the
    pattern lower-cased, the type one of ggml's names (case-insensitive)."""
    pattern, sep, t = word.partition("=")
    assert sep and pattern and t and t.lower() in GGML_TYPE_NAMES, word
    return pattern.lower(), t.lower()


def _allows_quantization(name: str, ndim: int) -> bool:
    """llama-quant.cpp tensor_allows_quantization, the parts that concern kimi-k3 names."""
    return (ndim >= 2 and name.endswith("weight") and "_norm.weight" not in name
            and "ffn_gate_inp.weight" not in name and "ssm_conv1d" not in name)


def _llama_quantize_types(rules: list[tuple[str, str]], decisions) -> dict[str, str]:
    """The type llama-quantize gives each tensor: allowed tensors take the first matching rule."""
    out = {}
    for d in decisions:
        cur = d.final_type.name.lower()
        if _allows_quantization(d.name, len(d.shape)):
            cur = next((t for p, t in rules if re.search(p, d.name)), cur)
        out[d.name] = cur
    return out


def test_exported_rules_parse_as_llama_quantize_reads_them(exported, tmp_path):
    res, lines = exported
    path = tmp_path / "protect.txt"
    write_quantize_rules(path, res)
    words = path.read_text().split()  # llama-quantize reads the file word by word
    assert words == lines and all(not w.startswith("#") for w in words)
    for word in words:
        pattern, _ = _llama_quantize_parse(word)
        assert pattern == word.partition("=")[0]  # lower-casing changes nothing


def test_exported_rules_keep_protected_tensors_before_user_rules(exported):
    res, lines = exported
    user = [".*=q4_0"]
    got = _llama_quantize_types([_llama_quantize_parse(w) for w in lines + user], res.decisions)
    for d in res.decisions:
        if d.protected_by is not None:
            assert got[d.name] == d.final_type.name.lower(), d.name
        elif _allows_quantization(d.name, len(d.shape)):
            assert got[d.name] == "q4_0", d.name
    assert got["blk.3.indexer.attn_k.weight"] == "bf16" and got["blk.3.indexer.proj.weight"] == "f32"
    assert got["blk.1.ffn_up_exps.weight"] == "mxfp4"


def test_exported_rules_agree_wherever_they_overlap(exported):
    """So builds where the last match wins give the same types as those where the first wins."""
    res, lines = exported
    rules = [_llama_quantize_parse(w) for w in lines]
    for d in res.decisions:
        types = {t for p, t in rules if re.search(p, d.name)}
        assert len(types) <= 1, (d.name, types)


_HARNESS = r"""
#include <iostream>
#include <regex>
#include <string>
int main(int argc, char ** argv) {
    std::regex pattern(argv[1]);  // what llama-quant.cpp builds from a --tensor-type pattern
    std::string name;
    while (std::getline(std::cin, name)) std::cout << (std::regex_search(name, pattern) ? 1 : 0);
    return 0;
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a C++ compiler for std::regex")
def test_exported_patterns_match_the_same_tensors_in_std_regex(exported, tmp_path):
    res, lines = exported
    src = tmp_path / "match.cpp"
    src.write_text(_HARNESS)
    exe = tmp_path / "match"
    subprocess.run(["g++", "-std=c++17", "-O0", str(src), "-o", str(exe)], check=True)
    names = [d.name for d in res.decisions]
    for word in lines:
        pattern = word.partition("=")[0]
        out = subprocess.run([str(exe), pattern], input="\n".join(names) + "\n", capture_output=True,
                             text=True, check=True).stdout
        assert out == "".join("1" if re.search(pattern, n) else "0" for n in names), pattern


def test_bad_option_values_are_input_errors():
    with pytest.raises(QuantRuleError, match="--output-tensor-type: unknown or unsupported type 'q3_k'"):
        quant_options(_parse(["--output-tensor-type", "q3_k"]))
    with pytest.raises(SystemExit):
        _parse(["--outtype", "q4_0"])
    assert parse_tensor_type("Blk\\.0\\.ATTN_Q=Q8_0").pattern == "blk\\.0\\.attn_q"
