"""The sampling flags, as llama.cpp names them, for both runners: kimi-k3-cli samples with them,
kimi-k3-server makes them the defaults of every request that leaves a field out (llama-server's
way). Their ranges are checked here, before anything is loaded, with one `error:` line each."""
from __future__ import annotations

import argparse
import math
from typing import Any

from gguf_arch.io.console import UsageError

from ..generation.sampling import (DEFAULT_MIN_P, DEFAULT_REPEAT_LAST_N, DEFAULT_REPEAT_PENALTY, DEFAULT_TEMP,
                                   DEFAULT_TOP_K, DEFAULT_TOP_P, SamplingParams)

RANDOM_SEED = 0xFFFFFFFF  # llama.cpp's LLAMA_DEFAULT_SEED: draw a seed; the largest 32-bit seed
PENALTY_RANGE = 2.0  # presence and frequency penalties lie in [-2, 2] (OpenAI's range, the server's)

# (option, attribute, lowest, highest or None); floats must also be finite. --temp <= 0 is greedy,
# as in llama.cpp, so it has no lower bound.
RANGES = (("-n/--n-predict", "n_predict", -1, None), ("--temp", "temp", -math.inf, None),
          ("--top-k", "top_k", 0, None), ("--top-p", "top_p", 0.0, 1.0), ("--min-p", "min_p", 0.0, 1.0),
          ("--repeat-penalty", "repeat_penalty", -math.inf, None), ("--repeat-last-n", "repeat_last_n", -1, None),
          ("--presence-penalty", "presence_penalty", -PENALTY_RANGE, PENALTY_RANGE),
          ("--frequency-penalty", "frequency_penalty", -PENALTY_RANGE, PENALTY_RANGE), ("-s/--seed", "seed", -1, None))


def add_sampling_arguments(p: argparse.ArgumentParser, server: bool = False) -> None:
    """-n, --temp, --top-k, --top-p, --min-p, the penalties, -s and --ignore-eos."""
    of = "the default of each request: " if server else ""
    n_help = ("max_tokens of a request that gives none (-1: until EOS or a full slot)" if server else
              "tokens to generate (in a conversation: per reply; -1: until EOS or a full context)")
    p.add_argument("-n", "--predict", "--n-predict", dest="n_predict", type=int, default=-1, help=n_help)
    p.add_argument("--temp", "--temperature", dest="temp", type=float, default=DEFAULT_TEMP,
                   help=f"{of}temperature, <= 0 = greedy (default {DEFAULT_TEMP})")
    for flag, kind, default, off in (("--top-k", int, DEFAULT_TOP_K, "0"), ("--top-p", float, DEFAULT_TOP_P, "1.0"),
                                     ("--min-p", float, DEFAULT_MIN_P, "0.0")):
        p.add_argument(flag, type=kind, default=default, help=f"{of}{flag[2:]} sampling, {off} = off (default {default})")
    p.add_argument("--repeat-penalty", type=float, default=DEFAULT_REPEAT_PENALTY,
                   help=f"{of}penalise repeating the last --repeat-last-n tokens, 1.0 = off (default "
                        f"{DEFAULT_REPEAT_PENALTY})")
    p.add_argument("--repeat-last-n", type=int, default=DEFAULT_REPEAT_LAST_N,
                   help=f"{of}tokens the penalties look back on, 0 = off, -1 = the context size (default "
                        f"{DEFAULT_REPEAT_LAST_N})")
    for flag in ("--presence-penalty", "--frequency-penalty"):
        p.add_argument(flag, type=float, default=0.0,
                       help=f"{of}{flag[2:].replace('-', ' ')} over the last --repeat-last-n tokens, in [-2, 2] "
                            "(default 0.0: off)")
    p.add_argument("-s", "--seed", type=int, default=-1,
                   help=f"{of}RNG seed (-1 or {RANDOM_SEED}: a random one" + ("" if server else
                                                                           ", printed as 'sampler seed: N'") + ")")
    p.add_argument("--ignore-eos", action="store_true",
                   help=f"{of}never sample the end-of-generation token (EOS); go on until -n, a stop or a full context")


def _check_range(option: str, value: Any, low: float, high: float | None) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise UsageError(f"{option} must be a finite number, got {value}")
    if value < low or (high is not None and value > high):
        span = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise UsageError(f"{option} must be {span}, got {value}")


def check_sampling(a: argparse.Namespace) -> None:
    """Raise UsageError for the first sampling flag out of its range."""
    for option, attr, low, high in RANGES:
        _check_range(option, getattr(a, attr), low, high)
    if not a.repeat_penalty > 0:
        raise UsageError(f"--repeat-penalty must be > 0, got {a.repeat_penalty} (1.0 = off)")
    if a.seed > RANDOM_SEED:
        raise UsageError(f"-s/--seed must be at most {RANDOM_SEED} (a 32-bit seed, as llama.cpp's), got {a.seed}")


def sampling_params(a: argparse.Namespace, whole_context: int, suppress: frozenset[int] = frozenset(),
                    seed: int | None = None) -> SamplingParams:
    """The flags' SamplingParams: --repeat-last-n -1 looks back on `whole_context` tokens."""
    return SamplingParams(temp=a.temp, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p, seed=seed,
                          repeat_penalty=a.repeat_penalty,
                          repeat_last_n=whole_context if a.repeat_last_n == -1 else a.repeat_last_n,
                          presence_penalty=a.presence_penalty, frequency_penalty=a.frequency_penalty,
                          suppress=suppress)
