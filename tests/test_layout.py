"""The layout is the architecture: the import rules of gguf_arch/__init__.py and README's "Layout",
checked on the source itself (tests/support/source.py reads it with `ast`, TYPE_CHECKING imports
included).

* no import cycle between the project's modules;
* gguf_arch's layers: errors < io < arch < convert | verify | synth, each importing only the
  layers below it (and itself); the three top layers never import one another, so a conversion
  never loads the verifier;
* quant_rules sits between arch and convert: it never imports the converter (nor verify, synth),
  and nothing below convert imports quant_rules;
* ggml_graph_spec's layers, lowest first: text | weights < graph | chat < blocks | backends < engine <
  generation < runner < server | tools; a lower layer never imports a higher one, siblings never
  import one another, and nothing in ggml_graph_spec imports the converter (README's "Layout",
  docs/architecture.md);
* gguf_arch and ggml_graph_spec hold at most 8 modules at their top level; no function is longer
  than 50 lines, no package module longer than 400;
* GGUF tensor names are spelled in at most three package modules (the tensor table's module
  first among them).
"""
from __future__ import annotations

import ast
import importlib
import re

from tests.support.source import (find_cycle, import_graph, package_modules, project_modules,
                                  string_literals)

# gguf_arch's layers, lowest first; a module belongs to the longest prefix that names it.
GGUF_LAYERS = {"gguf_arch.errors": 0, "gguf_arch.io": 1, "gguf_arch.arch": 2,
               "gguf_arch.convert": 3, "gguf_arch.verify": 3, "gguf_arch.synth": 3}
TOP_LAYER = 3
# ggml_graph_spec's layers, lowest first (same rule: a module imports only layers below its own).
GRAPH_LAYERS = {"ggml_graph_spec.text": 0, "ggml_graph_spec.weights": 0, "ggml_graph_spec.graph": 1,
                "ggml_graph_spec.chat": 1,
                "ggml_graph_spec.blocks": 2, "ggml_graph_spec.vision": 2, "ggml_graph_spec.backends": 2,
                "ggml_graph_spec.engine": 3, "ggml_graph_spec.generation": 4, "ggml_graph_spec.runner": 5,
                "ggml_graph_spec.server": 6, "ggml_graph_spec.tools": 6}
# Entry points that only start the runner: above every layer.
GRAPH_ENTRY = {"ggml_graph_spec", "ggml_graph_spec.__main__"}
MAX_TOP_LEVEL_MODULES = 8
MAX_FUNCTION_LINES = 50
MAX_MODULE_LINES = 400
MAX_MODULES_WITH_TENSOR_NAMES = 3


def _layer_of(name: str, layers: dict[str, int] = GGUF_LAYERS) -> str | None:
    hits = [p for p in layers if name == p or name.startswith(p + ".")]
    return max(hits, key=len) if hits else None


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_gguf_arch_layers_import_only_downwards():
    bad = []
    for name, targets in import_graph().items():
        if not name.startswith("gguf_arch"):
            continue
        mine = _layer_of(name)
        for t in sorted(targets):
            if name == "gguf_arch":
                bad.append(f"{name} -> {t} (the package's __init__ states the layers, imports nothing)")
                continue
            if mine is None:
                bad.append(f"{name} is in no layer of gguf_arch ({', '.join(GGUF_LAYERS)})")
                break
            theirs = _layer_of(t)
            if t.startswith("gguf_arch") and theirs is None:
                bad.append(f"{name} -> {t} (not in a layer)")
            elif theirs is not None and theirs != mine and GGUF_LAYERS[theirs] >= GGUF_LAYERS[mine]:
                bad.append(f"{name} -> {t} ({theirs} is not below {mine})")
            elif t.startswith(("quant_rules", "ggml_graph_spec")) and GGUF_LAYERS[mine] < TOP_LAYER:
                bad.append(f"{name} -> {t} (only convert, verify and synth may use quant_rules)")
            elif t.startswith("ggml_graph_spec"):
                bad.append(f"{name} -> {t} (gguf_arch never imports the runner)")
    assert not bad, "\n".join(bad)


def test_quant_rules_and_the_runner_never_import_the_converter():
    upper = [p for p, rank in GGUF_LAYERS.items() if rank == TOP_LAYER]
    bad = [f"{name} -> {t}" for name, targets in import_graph().items()
           if name.startswith(("quant_rules", "ggml_graph_spec"))
           for t in sorted(targets) if _layer_of(t) in upper]
    assert not bad, "\n".join(bad)


def graph_layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """What breaks ggml_graph_spec's layer order in an import graph (module -> modules it imports)."""
    bad = []
    for name, targets in graph.items():
        if not name.startswith("ggml_graph_spec") or name in GRAPH_ENTRY:
            continue
        mine = _layer_of(name, GRAPH_LAYERS)
        if mine is None:
            bad.append(f"{name} is in no layer of ggml_graph_spec ({', '.join(GRAPH_LAYERS)})")
            continue
        for t in sorted(targets):
            theirs = _layer_of(t, GRAPH_LAYERS)
            if t.startswith("ggml_graph_spec") and theirs is None and t not in GRAPH_ENTRY:
                bad.append(f"{name} -> {t} (not in a layer)")
            elif t in GRAPH_ENTRY:
                bad.append(f"{name} -> {t} (the package's entry point is above every layer)")
            elif theirs is not None and theirs != mine and GRAPH_LAYERS[theirs] >= GRAPH_LAYERS[mine]:
                bad.append(f"{name} -> {t} ({theirs} is not below {mine})")
    return bad


def test_ggml_graph_spec_layers_import_only_downwards():
    bad = graph_layer_violations(import_graph())
    assert not bad, "\n".join(bad)


def test_the_graph_layer_check_catches_an_upward_import():
    """The rule itself: an engine module importing the runner, a block importing a backend and a
    module outside every layer are each reported (the flat layout before the engine had all three)."""
    seeded = {"ggml_graph_spec.engine.model": {"ggml_graph_spec.runner.cli"},
              "ggml_graph_spec.blocks.mla": {"ggml_graph_spec.backends.cpu"},
              "ggml_graph_spec.cache": set()}
    bad = graph_layer_violations(seeded)
    assert len(bad) == 3, bad


def test_top_levels_are_small():
    for pkg in ("gguf_arch", "ggml_graph_spec"):
        top = [m.name for m in project_modules().values()
               if m.name.startswith(pkg + ".") and m.name.count(".") == 1 and not m.is_package]
        assert len(top) <= MAX_TOP_LEVEL_MODULES, f"{len(top)} modules at {pkg}'s top level: {sorted(top)}"


def test_no_package_module_is_longer_than_400_lines():
    long = [f"{m.name}: {n} lines" for m in package_modules()
            if (n := len(m.path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES]
    assert not long, "\n".join(long)


def test_no_function_is_longer_than_50_lines():
    long = []
    for m in package_modules():
        for node in ast.walk(m.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{m.name}.{node.name}: {lines} lines")
    assert not long, "\n".join(long)


def _tensor_table():
    """The tensor table's module, wherever the layout puts it."""
    name = next(n for n in project_modules() if n.startswith("gguf_arch") and n.endswith(".tensors"))
    return importlib.import_module(name)


def _gguf_names() -> set[str]:
    """Every GGUF tensor name of the table: the globals whole, the layer tensors after "blk.{l}."."""
    names = set()
    for spec in _tensor_table().TABLE:
        names.add(spec.gguf.split("{l}.", 1)[-1])
    return names


def _spells_a_tensor_name(text: str, names: set[str]) -> bool:
    if "blk." in text or "blk\\." in text:
        return True
    if "{}" in text and re.search("[a-z]{2}", text.replace("{}", " ")):  # an f-string: does it build one?
        pattern = re.compile(".+".join(map(re.escape, text.split("{}"))))
        return any(pattern.fullmatch(n) for n in names)
    return text in names


def test_tensor_names_are_spelled_in_at_most_three_modules():
    names = _gguf_names()
    spelling: dict[str, list[str]] = {}
    for m in package_modules():
        hits = [f"{line}: {text!r}" for line, text in string_literals(m.tree) if _spells_a_tensor_name(text, names)]
        if hits:
            spelling[m.name] = hits
    table = _tensor_table().__name__
    assert table in spelling, "the tensor table itself spells no name: the check is broken"
    assert len(spelling) <= MAX_MODULES_WITH_TENSOR_NAMES, "\n".join(
        f"{name}: {', '.join(hits[:4])}" for name, hits in sorted(spelling.items()))
