"""The repository is self-contained: no file it runs reaches outside the clone.

A user's clone has nothing beside it (no ../shared, no sibling checkout), so a test, script,
benchmark or package module that reads the workspace's shared folder (reference docs and fixtures
beside the clone on the developers' machines) would pass here and fail there. This scans every
tracked source file for such paths, spelled as a shell string or as pathlib climbs. (Hostile
inputs such as a "../outside.safetensors" shard name are test data, not paths read.)
"""
from __future__ import annotations

import re
import subprocess

from tests.support.paths import REPO

_SOURCES = (".py", ".sh", ".cfg", ".toml")
_SIBLINGS = r"(shared|fixtures|reference|docs)"
# "../shared/..." in a string or a shell line, or pathlib's  ".." / "shared".
_OUTSIDE = re.compile(r"\.\./" + _SIBLINGS + r"\b|[\"']\.\.[\"']\s*/\s*[\"']" + _SIBLINGS)


def _tracked_sources() -> list[str]:
    """git's file list (tracked and not ignored); outside a checkout (an unpacked tarball) every file."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        out = [str(p.relative_to(REPO)) for p in REPO.rglob("*") if ".venv" not in p.parts]
    return [f for f in out if f.endswith(_SOURCES) or f.startswith((".ci/", "scripts/"))]


def test_no_source_file_names_a_path_outside_the_repository():
    offenders = []
    for rel in _tracked_sources():
        path = REPO / rel
        if not path.is_file():
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if _OUTSIDE.search(line) and rel != "tests/test_self_contained.py":
                offenders.append(f"{rel}:{n}: {line.strip()}")
    assert not offenders, "paths outside the repository:\n" + "\n".join(offenders)


def test_the_fixtures_are_in_the_repository():
    for name in ("k3-tiny", "k31pro-tiny"):
        model = REPO / "tests" / "fixtures" / name
        for needed in ("config.json", "model.safetensors.index.json", "reference.npz", "tiktoken.model",
                       "tokenizer_config.json", "model-00016-of-000016.safetensors"):
            assert (model / needed).is_file(), f"{model / needed} missing"
    reference = REPO / "tests" / "fixtures" / "reference"
    assert (reference / "kimi-k3-config.json").is_file()
    assert (reference / "kimi-k3-model.safetensors.index.json.gz").is_file()
