"""Which GGML type each output tensor gets, and which tensors no option may change.

The protected set is data (`protected.json`): regular expressions over GGUF tensor names, each
with the reason it is protected. A protected tensor keeps its contract type, the one the
converter's tensor table gives it (F32, or the checkpoint's own precision); the routed experts
keep MXFP4 unless `--requantize-experts` names another type.

For every other tensor the user's options decide, with llama-quantize's precedence and pattern
semantics (tools/quantize/quantize.cpp and src/llama-quant.cpp in llama.cpp):

* `--token-embedding-type` / `--output-tensor-type` decide `token_embd.weight` / `output.weight`
  before any pattern is looked at;
* `--tensor-type PATTERN=TYPE` rules are tried in the order given (command line, then files);
  PATTERN is lower-cased (parse_tensor_type) and *searched*, not fully matched, in the tensor name
  (std::regex_search, ECMAScript syntax); the first rule that matches decides. That is current
  llama.cpp: llama_tensor_get_type breaks out of its loop at the first hit. Older builds had no
  break ("if two or more types are specified for the same tensor, the last match wins"), so the
  exported protection rules say where to put them for either;
* otherwise `--outtype` (auto keeps the source precision, as convert_hf_to_gguf.py does).

A type whose block does not divide a tensor's row length falls back, as llama.cpp does, to F16
(F32 for an F32 source), with a log line.
"""
from __future__ import annotations

import json
import re
import textwrap
from collections import defaultdict
from dataclasses import dataclass
from importlib import resources
from typing import Iterable, Sequence

from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES

from gguf_arch.arch.tensors import LAYER
from gguf_arch.io.console import summarised
from gguf_arch.io.gguf_writer import tensor_nbytes
from gguf_arch.errors import KimiError


class QuantRuleError(KimiError):
    """A type name, --tensor-type rule or rules file is malformed."""


# Types gguf-py's quantizers write byte-identically to ggml's own (checked against
# ggml_quantize_chunk in tests/quant_rules/test_quantize.py). K-quants and i-quants are absent:
# gguf-py cannot produce them.
WRITABLE_TYPES: tuple[Q, ...] = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q5_1, Q.Q5_0, Q.Q4_1, Q.Q4_0, Q.MXFP4)
OUTTYPES: dict[str, Q | None] = {"auto": None, "f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0}
# Experts are only ever widened or moved to 8 bits; another 4-bit format would lose accuracy
# and not save space (see quant_rules.options.requantize_warning).
EXPERT_TYPES: tuple[Q, ...] = (Q.F32, Q.F16, Q.BF16, Q.Q8_0)

_DATA = "protected.json"


def type_name(t: Q) -> str:
    """ggml's spelling of a type name (ggml_type_name), as llama-quantize prints and parses it."""
    return t.name.lower()


def parse_type(text: str, allowed: Sequence[Q], what: str) -> Q:
    """A type name, case-insensitive as llama-quantize's parse_ggml_type; QuantRuleError otherwise."""
    for t in allowed:
        if text.lower() == type_name(t):
            return t
    names = ", ".join(type_name(t) for t in allowed)
    raise QuantRuleError(f"{what}: unknown or unsupported type {text!r} (expected one of: {names})")


@dataclass(frozen=True)
class ProtectedRule:
    name: str
    pattern: str
    reason: str
    experts: bool = False  # the routed-experts rule: --requantize-experts may change these

    def matches(self, tensor: str) -> bool:
        return re.search(self.pattern, tensor) is not None


@dataclass(frozen=True)
class ProtectedSet:
    rules: tuple[ProtectedRule, ...]  # the experts rule last
    token_embedding: str  # the tensors --token-embedding-type and --output-tensor-type name
    output: str

    def rule_for(self, tensor: str) -> ProtectedRule | None:
        return next((r for r in self.rules if r.matches(tensor)), None)


def load_protected_set() -> ProtectedSet:
    """The protected set shipped as package data."""
    raw = json.loads(resources.files(__package__).joinpath(_DATA).read_text(encoding="utf-8"))
    rules = [ProtectedRule(r["name"], r["pattern"], r["reason"]) for r in raw["protected"]]
    e = raw["experts"]
    rules.append(ProtectedRule(e["name"], e["pattern"], e["reason"], experts=True))
    named = raw["named_tensors"]
    return ProtectedSet(tuple(rules), named["token_embedding"], named["output"])


@dataclass(frozen=True)
class TensorTypeRule:
    """One `--tensor-type PATTERN=TYPE` rule, pattern lower-cased as llama-quantize does."""

    pattern: str
    type: Q
    origin: str  # where it came from, for messages: "--tensor-type" or "FILE:LINE"

    @property
    def label(self) -> str:
        flag = self.origin if self.origin.startswith("--") else "--tensor-type"  # a file's rule: FILE:LINE
        return f"{flag} {self.pattern}={type_name(self.type)}"

    def matches(self, tensor: str) -> bool:
        return re.search(self.pattern, tensor) is not None


def parse_tensor_type(text: str, origin: str = "--tensor-type",
                      allowed: Sequence[Q] = WRITABLE_TYPES) -> TensorTypeRule:
    """`PATTERN=TYPE`, split at the first '=' as llama-quantize's parse_tensor_type does; TYPE one
    of `allowed` (the converter's: what gguf-py writes exactly)."""
    pattern, sep, type_text = text.partition("=")
    if not sep:
        raise QuantRuleError(f"{origin}: malformed rule {text!r} (expected PATTERN=TYPE)")
    if not pattern:
        raise QuantRuleError(f"{origin}: rule {text!r} has no tensor name pattern before '='")
    if not type_text:
        raise QuantRuleError(f"{origin}: rule {text!r} has no type after '='")
    pattern = pattern.lower()
    try:
        re.compile(pattern)
    except re.error as exc:
        raise QuantRuleError(f"{origin}: pattern {pattern!r} is not a valid regular expression: {exc}") from None
    return TensorTypeRule(pattern, parse_type(type_text, allowed, origin), origin)


@dataclass(frozen=True)
class QuantOptions:
    outtype: Q | None = None  # None: auto, the source precision
    tensor_types: tuple[TensorTypeRule, ...] = ()
    output_tensor_type: Q | None = None
    token_embedding_type: Q | None = None
    requantize_experts: Q | None = None


@dataclass(frozen=True)
class TypedTensor:
    """What the resolver needs of one planned output tensor."""

    name: str
    shape: tuple[int, ...]  # numpy order; the last dimension is the row
    source_type: str  # the checkpoint's dtype ("BF16", "F32") or "MXFP4" for the packed experts
    contract_type: Q  # what the tensor table writes when no option changes it


@dataclass(frozen=True)
class Decision:
    name: str
    shape: tuple[int, ...]
    source_type: str
    contract_type: Q
    final_type: Q
    rule: str  # what decided final_type
    refused: str | None = None  # the user option that would have changed a protected tensor
    protected_by: ProtectedRule | None = None
    fell_back_from: Q | None = None  # the chosen type, when its block does not divide the row

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.final_type, self.shape)


@dataclass(frozen=True)
class Resolution:
    decisions: tuple[Decision, ...]
    log: tuple[str, ...]


def _user_choice(t: TypedTensor, opts: QuantOptions, prot: ProtectedSet) -> tuple[str, Q] | None:
    """What the options alone would pick, in llama-quantize's precedence; None: the contract type."""
    if opts.token_embedding_type is not None and t.name == prot.token_embedding:
        return f"--token-embedding-type {type_name(opts.token_embedding_type)}", opts.token_embedding_type
    if opts.output_tensor_type is not None and t.name == prot.output:
        return f"--output-tensor-type {type_name(opts.output_tensor_type)}", opts.output_tensor_type
    for rule in opts.tensor_types:
        if rule.matches(t.name):
            return rule.label, rule.type
    if opts.outtype is not None:
        return f"--outtype {type_name(opts.outtype)}", opts.outtype
    return None


def _decide(t: TypedTensor, opts: QuantOptions, prot: ProtectedSet) -> Decision:
    rule = prot.rule_for(t.name)
    choice = _user_choice(t, opts, prot)
    if rule is not None and rule.experts and opts.requantize_experts is not None:
        final, why = opts.requantize_experts, f"--requantize-experts {type_name(opts.requantize_experts)}"
    elif rule is not None:
        refused = choice[0] if choice is not None and choice[1] != t.contract_type else None
        return Decision(t.name, t.shape, t.source_type, t.contract_type, t.contract_type,
                        f"protected: {rule.name}", refused, rule)
    elif choice is not None:
        why, final = choice
    else:
        final, why = t.contract_type, "auto: source precision"
    block = GGML_QUANT_SIZES[final][0]
    if t.shape[-1] % block == 0:
        return Decision(t.name, t.shape, t.source_type, t.contract_type, final, why, None, rule)
    fallback = Q.F32 if t.source_type == "F32" else Q.F16
    why = (f"{why}, fell back to {type_name(fallback)}: row length {t.shape[-1]} is not a multiple of "
           f"the {type_name(final)} block size {block}")
    return Decision(t.name, t.shape, t.source_type, t.contract_type, fallback, why, None, rule, final)


_LAYER = re.compile("^" + re.escape(LAYER).replace(re.escape("{l}"), r"\d+"))
_ANY_LAYER = LAYER.format(l="*")
_NOTE_WIDTH = 100  # columns of a log note


def _templates(names: Iterable[str]) -> list[str]:
    """blk.3.x, blk.7.x -> ['blk.*.x (2 layers)']: which tensors, compactly."""
    counts: dict[str, int] = defaultdict(int)
    for n in names:
        counts[_LAYER.sub(_ANY_LAYER, n)] += 1
    return [f"{k} ({v} layers)" if k.startswith(_ANY_LAYER) else k for k, v in counts.items()]


def _refusal_note(option: str, ds: list[Decision]) -> str:
    """A header line, then per protected rule its tensors (at most 3 named) and its reason, wrapped."""
    groups: dict[ProtectedRule, list[Decision]] = defaultdict(list)
    for d in ds:
        groups[d.protected_by].append(d)
    lines = [f"{option}: left {len(ds)} protected tensor(s) alone:"]
    for rule, members in groups.items():
        kept = "/".join(sorted({type_name(d.final_type) for d in members}))
        lines += textwrap.wrap(f"{rule.name}, kept at {kept}: {summarised(_templates(d.name for d in members))}",
                               _NOTE_WIDTH, initial_indent="  ", subsequent_indent="      ")
        lines += textwrap.wrap(f"why: {rule.reason}", _NOTE_WIDTH, initial_indent="    ", subsequent_indent="      ")
    return "\n".join(lines)


def refusal_log(decisions: Iterable[Decision]) -> list[str]:
    """One note per user option that would have changed protected tensors: which, and why not."""
    by_option: dict[str, list[Decision]] = defaultdict(list)
    for d in decisions:
        if d.refused is not None:
            by_option[d.refused].append(d)
    return [_refusal_note(option, ds) for option, ds in by_option.items()]


def fallback_log(decisions: Iterable[Decision]) -> list[str]:
    return [f"{d.name}: {d.rule}" for d in decisions if d.fell_back_from is not None]


def resolve_types(tensors: Iterable[TypedTensor], options: QuantOptions,
                  protected: ProtectedSet | None = None) -> Resolution:
    """Each tensor's final type and the rule that decided it, plus the log lines to print."""
    prot = protected or load_protected_set()
    decisions = tuple(_decide(t, options, prot) for t in tensors)
    return Resolution(decisions, tuple(refusal_log(decisions) + fallback_log(decisions)))
