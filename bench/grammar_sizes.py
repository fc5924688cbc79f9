"""Installed size of a Python distribution and of the dependencies it requires (extras left out),
read from the installed metadata: what adding the library to the project's install costs; and the
time a fresh Python takes to import it (what it adds to a server's start)."""
from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata

try:
    from packaging.markers import Marker
except ImportError:  # then a dependency with an environment marker is counted (extras still are not)
    Marker = None


def _requirement_name(spec: str) -> str | None:
    """The distribution a Requires-Dist line needs here, or None (an extra's, or another platform's)."""
    name, _, marker = spec.partition(";")
    marker = marker.strip()
    if "extra" in marker:
        return None
    if marker and Marker is not None and not Marker(marker).evaluate():
        return None
    return re.match(r"[A-Za-z0-9._-]+", name.strip()).group(0)


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def dependency_closure(name: str) -> list[str]:
    """The distribution and every distribution it requires, transitively (installed ones only)."""
    seen, todo = [], [name]
    while todo:
        current = _canonical(todo.pop())
        if current in seen:
            continue
        try:
            dist = metadata.distribution(current)
        except metadata.PackageNotFoundError:
            continue
        seen.append(current)
        todo += [n for n in map(_requirement_name, dist.requires or []) if n]
    return seen


def files_size(name: str) -> int:
    dist = metadata.distribution(name)
    total = 0
    for f in dist.files or []:
        path = dist.locate_file(f)
        if path.is_file():
            total += path.stat().st_size
    return total


def installed_size(name: str) -> dict:
    """MB of the distribution alone and with its dependencies; the dependencies' own MB."""
    closure = dependency_closure(name)
    sizes = {d: files_size(d) / 1e6 for d in closure}
    own = sizes.pop(closure[0]) if closure else 0.0
    return {"own_mb": own, "with_dependencies_mb": own + sum(sizes.values()),
            "dependencies_mb": dict(sorted(sizes.items(), key=lambda kv: -kv[1]))}


def import_seconds(module: str, repeats: int = 3) -> float:
    """The least, over `repeats` fresh interpreters, of the time `import module` takes."""
    code = f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    runs = [float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
            for _ in range(repeats)]
    return min(runs)
