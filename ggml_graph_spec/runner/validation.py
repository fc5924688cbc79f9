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

from gguf_arch.io.console import UsageError, cpu_count

from ..generation.perplexity import MIN_PERPLEXITY_CTX
from .chat import check_chat_options
from .sampling_args import RANDOM_SEED, check_sampling  # noqa: F401  (RANDOM_SEED: the runner's import)


def check_options(a: argparse.Namespace) -> list[str]:
    """Raise UsageError for the first bad option; returns notes to print (-t capped)."""
    if a.perplexity and a.file is None:
        raise UsageError("--perplexity needs -f FILE")
    if a.ctx_size < 0:
        raise UsageError(f"-c/--ctx-size must be >= 0, got {a.ctx_size}")
    check_sampling(a)  # their ranges (sampling_args.RANGES)
    if a.chunks != -1 and a.chunks < 1:
        raise UsageError(f"--chunks must be -1 (all) or >= 1, got {a.chunks}")
    if a.chunks != -1 and not a.perplexity:
        raise UsageError("--chunks applies to --perplexity only")
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


