"""Shared by the fuzz suites: the bounded, reproducible hypothesis settings and the clean-error check.

CI runs every suite derandomized (the same examples on every run, no example database) with an
explicit example count and no per-example deadline (a 2-core CI box is slow and noisy). Set
KIMI_FUZZ_EXAMPLES to fuzz longer locally; crashers found that way go into corpus/.
"""
from __future__ import annotations

import os
from pathlib import Path

from hypothesis import HealthCheck, settings

from gguf_arch.errors import KimiError

CORPUS = Path(__file__).resolve().parent / "corpus"
EXAMPLES = int(os.environ.get("KIMI_FUZZ_EXAMPLES", "150"))

FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large, HealthCheck.large_base_example])


def assert_clean(exc: BaseException, kind: type[KimiError] = KimiError) -> str:
    """The error is the expected KimiError subclass and reads as exactly one non-empty line."""
    assert isinstance(exc, kind), f"{type(exc).__name__} instead of {kind.__name__}: {exc}"
    msg = str(exc)
    assert msg and msg.splitlines() == [msg], repr(msg)
    return msg


def corpus_files(target: str) -> list[Path]:
    return sorted((CORPUS / target).glob("*"))
