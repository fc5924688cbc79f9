"""llama.cpp's own `llama-quantize` with this project's protected set, so the routed experts can
go below 4 bits and nothing else moves by accident (the CLI: kimi_k3_quantize.py).

Every tensor's type is decided here first (quant_rules.rules.resolve_types, the converter's
resolver): the protected tensors (protected.json: DSA indexer projections at source precision,
norms, router, AttnRes scores and the KDA vectors in F32) keep their type in IN, the
`--token-embedding-type` / `--output-tensor-type` / `--tensor-type` options decide next (first
matching rule wins, as in llama-quantize), then the routed experts get TYPE and every other
tensor keeps its type. llama-quantize is then handed one `PATTERN=TYPE` pin for every tensor
(anchored patterns, a layer template per rule where all its layers agree), so none of its own
mixture rules (Q4_K_M's Q6_K ffn_down, ...) or fallbacks applies; its output is checked tensor by
tensor against the plan (and by the caller: the CLI has the graph's loader take it) before it is
renamed into place.

MXFP4 experts are dequantized by llama-quantize and quantized again (double quantization:
`--allow-requantize` is always passed); bench/tiers.py measures what each TYPE costs.
"""
from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Callable, Sequence

from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from gguf.constants import GGML_QUANT_SIZES

from gguf_arch.errors import EXIT_RUNTIME, GGUFError, KimiError
from gguf_arch.io.gguf_file import open_gguf
from gguf_arch.io.imatrix import imatrix_sizes
from gguf_arch.io.split_names import part_paths

from .options import read_tensor_type_file
from .llama_types import LLAMA_QUANTIZE_TYPES, NEEDS_IMATRIX
from .rules import (Decision, ProtectedSet, QuantOptions, QuantRuleError, Resolution, TensorTypeRule, TypedTensor,
                    load_protected_set, parse_tensor_type, parse_type, resolve_types, type_name)

LLAMA_BIN_ENV = "KIMI_K3_LLAMA_BIN"  # scripts/setup_env.sh exports the built tools' directory
# Types a --tensor-type rule may name: the kimi-k3-quantize types and the float ones.
RULE_TYPES: tuple[Q, ...] = (Q.F32, Q.F16, Q.BF16, *LLAMA_QUANTIZE_TYPES)


class ToolError(KimiError):
    """llama-quantize is missing or failed (exit code 1)."""

    exit_code = EXIT_RUNTIME


def find_tool(name: str) -> Path:
    """A llama.cpp tool: in $KIMI_K3_LLAMA_BIN when set (the build setup_env.sh made), else on PATH."""
    where = os.environ.get(LLAMA_BIN_ENV)
    if where:
        tool = Path(where) / name
        if not os.access(tool, os.X_OK):
            raise ToolError(f"{tool}: not found or not executable ({LLAMA_BIN_ENV}={where}); rerun "
                            "scripts/setup_env.sh to build llama.cpp's tools")
        return tool
    found = shutil.which(name)
    if found is None:
        raise ToolError(f"{name} not found: set {LLAMA_BIN_ENV} to the directory scripts/setup_env.sh "
                        "builds the llama.cpp tools into, or put llama.cpp's tools on PATH")
    return Path(found)


# ---------------------------------------------------------------------------------------------
# the plan
# ---------------------------------------------------------------------------------------------

def read_gguf_tensors(path: Path) -> list[TypedTensor]:
    """Every tensor of a GGUF (all parts of a split one), its type in the file as the type to keep."""
    first = open_gguf(path)
    readers: list[GGUFReader] = [first] + [open_gguf(p) for p in part_paths(path, first)[1:]]
    out = []
    for r in readers:
        for t in r.tensors:
            shape = tuple(int(d) for d in reversed(t.shape))
            out.append(TypedTensor(t.name, shape, t.tensor_type.name, t.tensor_type))
    return out


class _TypeRule(TensorTypeRule):
    """The routed experts' rule that TYPE makes, after the --tensor-type rules."""

    @property
    def label(self) -> str:
        return f"TYPE {type_name(self.type)} (routed experts)"


def _without_experts(prot: ProtectedSet) -> tuple[ProtectedSet, str]:
    """The protected set without its routed-experts rule, and that rule's pattern: here the experts
    are what TYPE changes, and a --tensor-type rule may still pick theirs."""
    experts = next(r for r in prot.rules if r.experts)
    trunk = ProtectedSet(tuple(r for r in prot.rules if not r.experts), prot.token_embedding, prot.output)
    return trunk, experts.pattern


def plan(tensors: Sequence[TypedTensor], expert_type: Q, options: QuantOptions,
         protected: ProtectedSet | None = None) -> Resolution:
    """Each tensor's type in OUT; QuantRuleError for a type llama-quantize would not write as asked."""
    trunk, experts = _without_experts(protected or load_protected_set())
    rule = _TypeRule(experts, expert_type, "TYPE")
    resolution = resolve_types(tensors, QuantOptions(
        tensor_types=options.tensor_types + (rule,), output_tensor_type=options.output_tensor_type,
        token_embedding_type=options.token_embedding_type), trunk)
    for d in resolution.decisions:
        if d.fell_back_from is not None:  # llama-quantize would silently pick another type
            block = GGML_QUANT_SIZES[d.fell_back_from][0]
            raise QuantRuleError(f"{d.name}: row length {d.shape[-1]} is not a multiple of the "
                                 f"{type_name(d.fell_back_from)} block size {block}; choose a type with a "
                                 "smaller block for it (--tensor-type)")
    return resolution


def check_imatrix(resolution: Resolution, imatrix: Path | None) -> None:
    """The very-low-bit types llama-quantize writes only with an importance matrix for the tensor,
    and an imatrix that fits the tensors it has data for (llama-quantize aborts on a size mismatch)."""
    needs = [d for d in resolution.decisions if d.final_type in NEEDS_IMATRIX and d.final_type != d.contract_type]
    if imatrix is None:
        if needs:
            d = needs[0]
            raise QuantRuleError(f"{d.name}: {type_name(d.final_type)} needs an importance matrix: pass --imatrix "
                                 "IM.gguf (made by llama-imatrix); llama-quantize refuses it without one")
        return
    entries = imatrix_sizes(imatrix)  # KimiError (bad input) for a file that is not one
    for d in resolution.decisions:
        # One sum per input column, per expert for the stacked experts (ne0 * ne2).
        want = d.shape[-1] * (d.shape[0] if len(d.shape) == 3 else 1)
        if d.name in entries and d.final_type != d.contract_type and entries[d.name] != want:
            raise QuantRuleError(f"{imatrix}: the entry for {d.name} has {entries[d.name]} values, the tensor needs "
                                 f"{want}: an importance matrix of another model?")
    missing = [d.name for d in needs if d.name not in entries]
    if missing:
        raise QuantRuleError(f"{imatrix}: no importance data for {missing[0]} ({len(missing)} tensor(s) "
                             f"without), which {type_name(needs[0].final_type)} needs")


_LAYER = re.compile(r"^blk\.\d+\.")


def pin_rules(resolution: Resolution) -> list[str]:
    """llama-quantize `PATTERN=TYPE` words fixing every tensor at its planned type: one per layer
    template whose layers all agree, else one per tensor; anchored, so no pattern reaches a
    tensor it does not name."""
    by_template: dict[str, list] = defaultdict(list)
    for d in resolution.decisions:
        by_template[_LAYER.sub("blk.N.", d.name)].append(d)
    lines = []
    for template, ds in by_template.items():
        types = {d.final_type for d in ds}
        if len(types) == 1 and template.startswith("blk.N."):
            rest = re.escape(template.removeprefix("blk.N."))
            lines.append(f"^blk\\.[0-9]+\\.{rest}$={type_name(types.pop())}")
        else:
            lines.extend(f"^{re.escape(d.name)}$={type_name(d.final_type)}" for d in ds)
    return lines


# ---------------------------------------------------------------------------------------------
# running llama-quantize
# ---------------------------------------------------------------------------------------------

def quantize_command(tool: Path, src: Path, dst: Path, rules: Path, expert_type: Q, imatrix: Path | None,
                     threads: int) -> list[str]:
    # llama-quantize's file type of that name (Q4_K: its alias for Q4_K_M) only labels the output
    # (general.file_type) and picks its default type, which no tensor gets: every one is pinned.
    ftype = expert_type.name
    cmd = [str(tool), "--allow-requantize", "--tensor-type-file", str(rules)]
    if imatrix is not None:
        cmd += ["--imatrix", str(imatrix)]
    return cmd + [str(src), str(dst), ftype, str(threads)]


def _failure(log: str, code: int) -> str:
    """llama-quantize's own reason, from its log."""
    lines = [l.strip() for l in log.splitlines() if l.strip()]
    reason = next((l for l in lines if "failed to quantize:" in l), None)
    reason = reason or next((l for l in reversed(lines) if "error" in l.lower()), None)
    return (reason or (lines[-1] if lines else "no output"))[:500] + f" (exit code {code})"


def run_llama_quantize(cmd: list[str]) -> None:
    """Run llama-quantize to completion; a Ctrl-C stops it before KeyboardInterrupt goes on."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            text=True, errors="replace")
    try:
        log, _ = proc.communicate()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    if proc.returncode != 0:
        raise ToolError(f"llama-quantize failed: {_failure(log, proc.returncode)}")


def check_output(path: Path, resolution: Resolution) -> None:
    """llama-quantize's output holds exactly the planned tensors at the planned types."""
    try:
        got = {t.name: t.contract_type for t in read_gguf_tensors(path)}
    except GGUFError as exc:
        raise ToolError(f"llama-quantize's output is not a readable GGUF: {exc}") from None
    for d in resolution.decisions:
        if got.get(d.name) != d.final_type:
            found = "missing" if d.name not in got else type_name(got[d.name])
            raise ToolError(f"llama-quantize wrote {d.name} as {found}, planned {type_name(d.final_type)}")


def quantize(src: Path, out: Path, resolution: Resolution, expert_type: Q, imatrix: Path | None, threads: int,
             accept: Callable[[Path], None]) -> None:
    """Have llama-quantize write OUT as planned: into a temporary directory beside OUT, checked
    (check_output, then `accept`, which raises to refuse it), then renamed; nothing is left under
    OUT otherwise, Ctrl-C included."""
    tool = find_tool("llama-quantize")
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as tmp:
        rules, partial = Path(tmp) / "rules.txt", Path(tmp) / out.name
        rules.write_text("".join(line + "\n" for line in pin_rules(resolution)), encoding="utf-8")
        run_llama_quantize(quantize_command(tool, src, partial, rules, expert_type, imatrix, threads))
        check_output(partial, resolution)
        accept(partial)
        os.replace(partial, out)


def options_for(rules: Sequence[str], files: Sequence[Path], output_tensor_type: str | None,
                token_embedding_type: str | None) -> QuantOptions:
    """QuantOptions from the --tensor-type rules and files and the two named-tensor types."""
    parsed = [parse_tensor_type(r, allowed=RULE_TYPES) for r in rules]
    for path in files:
        parsed.extend(read_tensor_type_file(path, RULE_TYPES))
    pick = lambda text, what: None if text is None else parse_type(text, RULE_TYPES, what)  # noqa: E731
    return QuantOptions(tensor_types=tuple(parsed),
                        output_tensor_type=pick(output_tensor_type, "--output-tensor-type"),
                        token_embedding_type=pick(token_embedding_type, "--token-embedding-type"))


def routed_experts(resolution: Resolution, protected: ProtectedSet | None = None) -> list[Decision]:
    _, experts = _without_experts(protected or load_protected_set())
    return [d for d in resolution.decisions if re.search(experts, d.name)]


def bits_per_weight(decisions: Sequence[Decision]) -> float:
    return 8 * sum(d.nbytes for d in decisions) / sum(math.prod(d.shape) for d in decisions)


def summary_line(out: Path, resolution: Resolution) -> str:
    experts = routed_experts(resolution)
    types = "/".join(sorted({type_name(d.final_type) for d in experts}))
    return (f"wrote {out}: {out.stat().st_size:,} bytes; routed experts {types}, "
            f"{bits_per_weight(experts):.4g} bits per weight")
