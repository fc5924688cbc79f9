"""The measurements of bench/grammar_libs.py on one engine (its docstring says what each one is)."""
from __future__ import annotations

import random
import re
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from bench import grammar_specs as gs
from bench.grammar_vocab import Vocabulary

MAX_WALK_TOKENS = 600
ROLLBACK_TOKENS = 8
CLOSING_BYTES = set(b'"}]')
TAG_NAMES = {b"think", b"tools", b"call", b"argument"}


def new_bitmask(vocab_size: int) -> np.ndarray:
    return np.zeros((1, (vocab_size + 31) // 32), dtype=np.int32)


def allowed_ids(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(bitmask[0].view(np.uint8), count=vocab_size, bitorder="little"))


def is_allowed(bitmask: np.ndarray, token: int) -> bool:
    return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)


def summary(values: list[float]) -> dict:
    """median, p99, mean and max of timings (in the unit given), and how many."""
    ordered = sorted(values)
    return {"n": len(values), "median": statistics.median(ordered), "p99": ordered[min(len(ordered) - 1,
            int(round(0.99 * (len(ordered) - 1))))], "mean": statistics.fmean(ordered), "max": ordered[-1]}


def timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    """(result, wall seconds, this thread's CPU seconds)."""
    w, c = time.perf_counter(), time.thread_time()
    out = fn()
    return out, time.perf_counter() - w, time.thread_time() - c


# ---- compile --------------------------------------------------------------------------------------

def compile_times(engine: Any, grammar: Any, repeats: int) -> tuple[Any, dict]:
    """Cold compiles (no cache) and compiles with whatever cache the library keeps, in ms."""
    cold, cold_cpu, cached = [], [], []
    compiled = None
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()  # process: xgrammar may compile in threads
        compiled = engine.compile(grammar)
        cold.append((time.perf_counter() - w) * 1e3)
        cold_cpu.append((time.process_time() - c) * 1e3)
    for _ in range(repeats):
        _, w, _ = timed(lambda: engine.compile_cached(grammar, compiled))
        cached.append(w * 1e3)
    return compiled, {"cold_ms": statistics.median(cold), "cold_cpu_ms": statistics.median(cold_cpu),
                      "cold_rounds_ms": cold, "cached_ms": statistics.median(cached)}


# ---- masks along valid sequences ------------------------------------------------------------------

def valid_sequences(kind: str, vocab: Vocabulary, tools: list[gs.Tool], steps: int, seed: int) -> list[list[int]]:
    """Seeded texts that follow grammar `kind`, encoded, until they hold `steps` tokens in all."""
    rng = random.Random(seed)
    make = {"json": lambda: gs.json_text(rng, vocab.lexicon), "think": lambda: gs.think_text(rng, vocab.lexicon),
            "tools": lambda: gs.tools_text(rng, vocab.lexicon, tools)}[kind]
    seqs, total = [], 0
    while total < steps:
        seq = vocab.tokenizer.encode(make())[:steps - total]
        seqs.append(seq)
        total += len(seq)
    return seqs


def mask_times(engine: Any, compiled: Any, seqs: list[list[int]], vocab_size: int) -> dict:
    """Per step of each sequence (a fresh matcher each, its making timed too): the mask's wall and
    CPU time, the tokens it allows, and the consume's time; a token the matcher refuses ends the
    measurement."""
    bitmask = new_bitmask(vocab_size)
    wall, cpu, consume, allowed, refused, new = [], [], [], [], None, []
    for seq in seqs:
        m, w, _ = timed(lambda: engine.matcher(compiled))
        new.append(w * 1e6)
        for i, token in enumerate(seq):
            _, w, c = timed(lambda: m.fill(bitmask))
            wall.append(w * 1e6)
            cpu.append(c * 1e6)
            allowed.append(int(np.unpackbits(bitmask.view(np.uint8)).sum()))
            ok, w, _ = timed(lambda: m.consume(token))
            consume.append(w * 1e6)
            if not ok:
                refused = {"sequence": seqs.index(seq), "step": i, "token": token}
                break
        if refused:
            break
    return {"mask_us": summary(wall), "mask_cpu_us": summary(cpu), "consume_us": summary(consume),
            "allowed_tokens": summary([float(a) for a in allowed]), "valid_sequence_refused": refused,
            "sequences": len(seqs), "new_matcher_us": statistics.median(new)}


def rollback_check(engine: Any, compiled: Any, seq: list[int], vocab_size: int) -> dict:
    """At a few points of a valid sequence: the mask, ROLLBACK_TOKENS more tokens, a rollback of
    them, and the mask again; `same` says whether every mask came back identical."""
    m = engine.matcher(compiled)
    before, after = new_bitmask(vocab_size), new_bitmask(vocab_size)
    points = [p for p in range(4, len(seq) - ROLLBACK_TOKENS, max(1, len(seq) // 6))]
    done, times, same = 0, [], True
    for p in points:
        while done < p:
            m.consume(seq[done])
            done += 1
        m.fill(before)
        for t in seq[p:p + ROLLBACK_TOKENS]:
            m.consume(t)
        _, w, _ = timed(lambda: m.rollback(ROLLBACK_TOKENS))
        times.append(w * 1e6)
        m.fill(after)
        same = same and bool(np.array_equal(before, after))
    return {"points": len(points), "tokens": ROLLBACK_TOKENS, "same": same,
            "rollback_us": statistics.median(times) if times else None}


# ---- seeded random walks --------------------------------------------------------------------------

@dataclass(frozen=True)
class Closing:
    """Tokens a walk prefers when it leans towards ending, in tiers: the tag names after <|close|>,
    then the markers that close an element or tokens made only of `"`, `}` and `]`, either first
    half the time (where a library lets markers into text, always preferring them would never
    close a JSON string)."""
    markers: list[int]
    tag_names: list[int]
    brackets: list[int]

    def tiers(self, after_close: bool, rng: random.Random) -> list[list[int]]:
        rest = [self.markers, self.brackets] if rng.random() < 0.5 else [self.brackets, self.markers]
        return [self.tag_names] + rest if after_close else rest


def closing_tokens(vocab: Vocabulary) -> Closing:
    tok = vocab.tokenizer
    normal = [(i, tok.token_bytes(i)) for i in range(tok.vocab_size) if not tok.is_special(i)]
    return Closing([vocab.close_id, vocab.sep_id], [i for i, b in normal if b in TAG_NAMES],
                   [i for i, b in normal if b and set(b) <= CLOSING_BYTES])


def _pick(rng: random.Random, allowed: np.ndarray, bitmask: np.ndarray, tiers: list[list[int]], lean: float) -> int:
    if rng.random() < lean:
        for tier in tiers:
            preferred = [t for t in tier if is_allowed(bitmask, t)]
            if preferred:
                return rng.choice(preferred)
    return int(allowed[rng.randrange(len(allowed))])


def random_walk(engine: Any, compiled: Any, vocab: Vocabulary, closing: Closing, rng: random.Random) -> dict:
    """Tokens drawn uniformly from the allowed ones, leaning more and more towards closing tokens
    (and ending when the end of message is allowed), until the end or MAX_WALK_TOKENS."""
    n, eos = vocab.tokenizer.vocab_size, vocab.eos_id
    m, bitmask, tokens = engine.matcher(compiled), new_bitmask(n), []
    while len(tokens) < MAX_WALK_TOKENS:
        m.fill(bitmask)
        allowed = allowed_ids(bitmask, n)
        lean = min(0.95, len(tokens) / 60)
        if len(allowed) == 0:
            return {"tokens": tokens, "end": "no token allowed"}
        if is_allowed(bitmask, eos) and (len(allowed) == 1 or rng.random() < max(0.5, lean)):
            return {"tokens": tokens, "end": "end of message" if m.accepting() else "end allowed, not accepting"}
        tiers = closing.tiers(bool(tokens) and tokens[-1] == vocab.close_id, rng)
        token = _pick(rng, allowed[allowed != eos], bitmask, tiers, lean)
        if not m.consume(token):
            return {"tokens": tokens + [token], "end": "an allowed token refused"}
        tokens.append(token)
    return {"tokens": tokens, "end": "unfinished"}


def check_output(kind: str, tokens: list[int], vocab: Vocabulary, tools: list[gs.Tool]) -> str | None:
    markers = {vocab.open_id: gs.OPEN, vocab.close_id: gs.CLOSE, vocab.sep_id: gs.SEP}
    segs = gs.segments(tokens, vocab.tokenizer, markers)
    if kind == "json":
        return gs.check_json(segs)
    return gs.check_tools(segs, tools) if kind == "tools" else gs.check_think(segs)


def failure_kind(reason: str) -> str:
    """The kind of a check's failure: a special token where text belongs, a marker written as
    ordinary text (its bytes where the marker belongs), invalid UTF-8, or another."""
    if reason.startswith("special token") or re.search(r"got '<\|", reason):
        return "special token inside text"
    if "got b'<|" in reason or "spelled as text" in reason or re.match(r"tag '.*<\|", reason):
        return "marker spelled as text"
    return "invalid UTF-8" if "invalid UTF-8" in reason else "other"


def spot_checks(engine: Any, compiled: Any, kind: str, vocab: Vocabulary, tools: list[gs.Tool], walks: int,
                seed: int) -> dict:
    """`walks` seeded random walks: how many ended, and how many of those parse (with the first
    reasons they did not)."""
    closing, rng = closing_tokens(vocab), random.Random(seed)
    ended, parsed, failures, ends, kinds = 0, 0, [], {}, {}
    for _ in range(walks):
        walk = random_walk(engine, compiled, vocab, closing, rng)
        ends[walk["end"]] = ends.get(walk["end"], 0) + 1
        if walk["end"] != "end of message":
            continue
        ended += 1
        err = check_output(kind, walk["tokens"], vocab, tools)
        if err is None:
            parsed += 1
            continue
        kinds[failure_kind(err)] = kinds.get(failure_kind(err), 0) + 1
        if len(failures) < 5:
            failures.append({"reason": err, "text": vocab.tokenizer.decode(walk["tokens"])[-160:]})
    return {"walks": walks, "ended": ended, "parsed": parsed, "ends": ends, "failure_kinds": kinds,
            "failures": failures}


# ---- markers: never text, never inside text -------------------------------------------------------

def _consume_text(m: Any, tokens: list[int]) -> bool:
    return all(m.consume(t) for t in tokens)  # stops at the first token refused


def _text_prefix(kind: str, tools: list[gs.Tool]) -> tuple[str, str | None] | None:
    """A valid prefix that ends inside text (a JSON string, a raw string value, the think body),
    and the marker that may legitimately come next there."""
    if kind == "json":
        return '{"id": "ABC-1234", "status": "open", "customer": {"name": "Ann ', None
    if kind == "think":
        return "Some words, then ", gs.CLOSE
    for tool in tools:
        key, schema = next(iter(tool.parameters["properties"].items()))
        if schema == {"type": "string"}:
            return (f'{gs.OPEN}tools{gs.SEP}{gs.OPEN}call tool="{tool.name}" index="1"{gs.SEP}'
                    f'{gs.OPEN}argument key="{key}" type="string"{gs.SEP}Paris, ', gs.CLOSE)
    return None


def markers_in_text(engine: Any, compiled: Any, kind: str, vocab: Vocabulary, tools: list[gs.Tool]) -> list[str]:
    """The markers (as special tokens) a grammar lets through inside text: none is right."""
    prefix = _text_prefix(kind, tools)
    if prefix is None:
        return []
    text, legit = prefix
    m, bitmask = engine.matcher(compiled), new_bitmask(vocab.tokenizer.vocab_size)
    if not _consume_text(m, vocab.tokenizer.encode(text)):
        return ["(the valid prefix was refused)"]
    m.fill(bitmask)
    ids = {gs.OPEN: vocab.open_id, gs.CLOSE: vocab.close_id, gs.SEP: vocab.sep_id, "<|end_of_msg|>": vocab.eos_id}
    return [name for name, tid in ids.items() if name != legit and is_allowed(bitmask, tid)]


def spelled_marker(engine: Any, compiled: Any, kind: str, vocab: Vocabulary) -> bool | None:
    """Whether a marker spelled with ordinary tokens does a marker's work: opens the tools element
    (tools), or ends the think block (think). False is right."""
    tok, m = vocab.tokenizer, engine.matcher(compiled)
    if kind == "tools":
        return _consume_text(m, tok.encode(f"{gs.OPEN}tools{gs.SEP}", allow_special=False))
    if kind == "think":
        return _consume_text(m, tok.encode(f"words{gs.CLOSE}think{gs.SEP}", allow_special=False)) and m.accepting()
    return None
