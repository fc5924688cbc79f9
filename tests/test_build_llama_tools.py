"""scripts/build_llama_tools.sh: a finished build is reused without any work, a failed one leaves
nothing that could be taken for finished and shows why. (The real build: scripts/setup_env.sh;
the tools it makes are exercised by tests/interop.)"""
from __future__ import annotations

import os
import re
import subprocess

from tests.support.paths import REPO

SCRIPT = REPO / "scripts" / "build_llama_tools.sh"


def _listed(name: str) -> list[str]:
    """A bash array of the script (LLAMA_TOOLS, LLAMA_FILES): what a finished build holds."""
    return re.search(rf"^{name}=\(([^)]*)\)", SCRIPT.read_text(), re.M).group(1).split()


TOOLS = _listed("LLAMA_TOOLS")
FILES = _listed("LLAMA_FILES")


def _run(tmp_path, python: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "KIMI_K3_CACHE": str(tmp_path / "cache"), "LOGS": str(tmp_path / "logs"), "VPY": python}
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=60)


def _python_that_fails(tmp_path) -> str:
    """Stands in for the venv's python: records its arguments, then fails as pip would offline."""
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "calls"}\necho "ERROR: no network" >&2\nexit 1\n')
    fake.chmod(0o755)
    return str(fake)


def test_the_lists_are_read():
    assert "llama-cli" in TOOLS and "llama-server" in TOOLS and "models/templates/Kimi-K3.jinja" in FILES


def test_a_failed_build_says_why_and_leaves_nothing_behind(tmp_path):
    r = _run(tmp_path, _python_that_fails(tmp_path))
    assert r.returncode == 1
    err = r.stderr.splitlines()
    assert err[0].startswith("setup: building llama.cpp's tools from llama-cpp-python 0.3.36 into ")
    assert err[0].endswith("(about 6 minutes on 2 cores): " + " ".join(TOOLS))
    assert err[1].startswith("error: setup step 'llama-tools' failed (exit 1)") and err[-1] == "ERROR: no network"
    assert "pip download -q --disable-pip-version-check --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d " \
        in (tmp_path / "calls").read_text()
    assert list((tmp_path / "cache").iterdir()) == []  # no partial build left to be mistaken for one


def test_a_finished_build_is_reused_without_building(tmp_path):
    failed = _run(tmp_path, _python_that_fails(tmp_path))
    dest = failed.stderr.split(" into ", 1)[1].split(" (about", 1)[0]
    (tmp_path / "calls").unlink()
    os.makedirs(f"{dest}/bin")
    for tool in TOOLS:
        path = f"{dest}/bin/{tool}"
        open(path, "w").close()
        os.chmod(path, 0o755)
    for file in FILES:
        os.makedirs(os.path.dirname(f"{dest}/share/{file}"), exist_ok=True)
        open(f"{dest}/share/{file}", "w").close()
    r = _run(tmp_path, _python_that_fails(tmp_path))
    assert (r.returncode, r.stdout, r.stderr) == (0, f"{dest}/bin\n", "")
    assert not (tmp_path / "calls").exists()  # pip never ran
