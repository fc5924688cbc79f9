"""Everything the runner's command line asks for, checked before any ggml object exists.

A value ggml cannot take aborts the whole process (GGML_ASSERT, SIGABRT) and a value numpy cannot
take ends in a traceback ("Probabilities contain NaN" for --min-p 2, ZeroDivisionError for
--chunks 0 or an indexer top_k of 0), so each option and each --override-kv value is checked here
against what it becomes, with one `error:` line and exit 2:

* sampling and run options (`check_options`): their ranges, finite floats, and -t capped at the
  CPUs this process may use (more threads than cores only make each token slower);
* the load options (engine/options.py, `LoadOptions.check` and `resolve`) and --override-kv
  (weights/overrides.py), which every runner shares, are checked by the load path itself before
  it maps a byte.
"""
from __future__ import annotations

import argparse
import math
from typing import Any


from gguf_arch.io.console import UsageError, cpu_count

from ..generation.perplexity import MIN_PERPLEXITY_CTX
from .chat import check_chat_options

RANDOM_SEED = 0xFFFFFFFF  # llama.cpp's LLAMA_DEFAULT_SEED: draw a seed; the largest 32-bit seed


# (option, attribute, lowest, highest or None); floats must also be finite. --temp <= 0 is greedy,
# as in llama.cpp, so it has no lower bound.
_RANGES = (("-c/--ctx-size", "ctx_size", 0, None), ("-n/--n-predict", "n_predict", -1, None),
           ("--temp", "temp", -math.inf, None), ("--top-k", "top_k", 0, None), ("--top-p", "top_p", 0.0, 1.0),
           ("--min-p", "min_p", 0.0, 1.0), ("--repeat-penalty", "repeat_penalty", -math.inf, None),
           ("--repeat-last-n", "repeat_last_n", -1, None), ("-s/--seed", "seed", -1, None))


def _check_range(option: str, value: Any, low: float, high: float | None) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise UsageError(f"{option} must be a finite number, got {value}")
    if value < low or (high is not None and value > high):
        span = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise UsageError(f"{option} must be {span}, got {value}")


def check_options(a: argparse.Namespace) -> list[str]:
    """Raise UsageError for the first bad option; returns notes to print (-t capped)."""
    if a.perplexity and a.file is None:
        raise UsageError("--perplexity needs -f FILE")
    for option, attr, low, high in _RANGES:
        _check_range(option, getattr(a, attr), low, high)
    if a.chunks != -1 and a.chunks < 1:
        raise UsageError(f"--chunks must be -1 (all) or >= 1, got {a.chunks}")
    if a.chunks != -1 and not a.perplexity:
        raise UsageError("--chunks applies to --perplexity only")
    if not a.repeat_penalty > 0:
        raise UsageError(f"--repeat-penalty must be > 0, got {a.repeat_penalty} (1.0 = off)")
    if a.seed > RANDOM_SEED:
        raise UsageError(f"-s/--seed must be at most {RANDOM_SEED} (a 32-bit seed, as llama.cpp's), got {a.seed}")
    if a.perplexity and 0 < a.ctx_size < MIN_PERPLEXITY_CTX:
        raise UsageError(f"--perplexity: -c {a.ctx_size} is too small: the scored half of a chunk needs "
                         f"-c {MIN_PERPLEXITY_CTX} or more")
    check_chat_options(a)  # the template and its kwargs, before anything is loaded
    return cap_threads(a)


def cap_threads(a: argparse.Namespace) -> list[str]:
    """-t: the CPUs this process may use when not given; more than those capped, with a note."""
    cpus = cpu_count()
    if a.threads is None:
        a.threads = cpus
        return []
    if a.threads < 1:
        raise UsageError(f"-t/--threads must be >= 1, got {a.threads}")
    if a.threads > cpus:
        note = f"note: -t {a.threads} is more than the {cpus} CPU(s) this process may use; using {cpus}"
        a.threads = cpus
        return [note]
    return []


