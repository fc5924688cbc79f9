"""The project's own source as data: its modules, their syntax trees and their import graph.

Read with `ast`, never imported, so a check over the layout cannot be fooled by what importing a
module happens to pull in (or by an import cycle that only shows in some import order). Every
import statement counts, wherever it stands: at the top, inside a function, or under
`if TYPE_CHECKING:`.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from tests.support.paths import REPO

PACKAGES = ("gguf_arch", "quant_rules", "ggml_graph_spec")
SCRIPTS = ("convert_kimi_k3",)  # top-level modules (py_modules in setup.cfg)


@dataclass(frozen=True)
class Module:
    name: str  # dotted, "gguf_arch.io.split"; a package is its __init__
    path: Path
    is_package: bool

    @property
    def tree(self) -> ast.Module:
        return _parse(self.path)


@lru_cache(maxsize=None)
def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@lru_cache(maxsize=None)
def project_modules() -> dict[str, Module]:
    """Every module of the packages (and the top-level scripts), by dotted name."""
    paths = [p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))]
    paths += [REPO / f"{s}.py" for s in SCRIPTS]
    return {_module_name(p): Module(_module_name(p), p, p.name == "__init__.py") for p in paths}


def package_modules() -> list[Module]:
    """The modules of the installable packages (not the scripts)."""
    return [m for m in project_modules().values() if m.name.split(".")[0] in PACKAGES]


def _absolute(module: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.name.split(".")
    if not module.is_package:
        base.pop()
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imported(module: Module) -> set[str]:
    """The project modules `module` imports, anywhere in its file."""
    known = project_modules()
    out: set[str] = set()
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, node)
            # `from pkg import mod` imports the module pkg.mod; `from mod import name` the module.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `import a.b.c` of a name inside a module: its module
                t = t.rpartition(".")[0]
            if t and t != module.name:
                out.add(t)
    return out


def import_graph() -> dict[str, set[str]]:
    return {name: imported(m) for name, m in project_modules().items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


def docstring_nodes(tree: ast.Module) -> set[int]:
    """ids of the string constants that are docstrings (of the module, classes, functions)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def string_literals(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, text) of every string literal but docstrings; an f-string as its template with
    each replacement field written `{}`."""
    skip = docstring_nodes(tree)
    inside_fstrings = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
            out.append((node.lineno, text))
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip
              and id(node) not in inside_fstrings):
            out.append((node.lineno, node.value))
    return out
