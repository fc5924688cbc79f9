"""Constrained decoding at K3's vocabulary: llguidance against xgrammar, to choose one.

    python bench/grammar_libs.py --steps 300

Run from the repository root with a Python that has both libraries (docs/bench/grammar_libs.md
says how to make that venv; no network is needed at run time). The vocabulary is synthetic, of
K3's real size (163,840: bench/grammar_vocab.py), and the tokenizer is the runtime's own
BPETokenizer; both libraries are built from it (bench/grammar_engines.py). Three grammars
(bench/grammar_specs.py): a nested JSON schema, a 20-tool declaration in K3's XTML tool-call form,
and free text closed by a special-token terminator (K3's think channel). Per library:

  tokenizer   the library's tokenizer built from the runtime's (wall and CPU time);
  compile     each grammar cold (median of --compile-repeats), and again with the library's cache
              (xgrammar's compiler cache; llguidance has none: a copy of the compiled matcher);
  mask        the bitmask of each step along seeded valid texts, --steps steps a grammar, a fresh
              matcher each text: wall and CPU time of this thread (median, p99), allowed tokens;
  rollback    masks before and after rolling ROLLBACK_TOKENS tokens back, at several points;
  spot checks --walks seeded random walks a grammar (tokens uniform among the allowed ones, leaning
              towards closing tokens so that walks end): how many outputs parse (JSON against
              the schema, tool calls against the tools, the think block);
  markers     whether a marker spelled with ordinary tokens does a marker's work, and which
              markers (as special tokens) a grammar lets through inside text; a correct library
              and grammar allow neither;
  apply       setting -inf in a float32 logits row of the vocabulary's size from a bitmask: numpy's
              unpackbits against each library's helper, for a dense and a sparse mask;
  installed   the size of each library's files and of the dependencies it requires, and the time a
              fresh Python takes to import it (the tokenizer's time above leaves the import out).

xgrammar also compiles its own way of writing K3 (structural tags, markers as strings).
Results: bench/results/grammar_libs.json; ratios are xgrammar / llguidance.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.graph import cpu_features  # noqa: E402

try:
    import numpy as np  # noqa: E402
    from bench import grammar_specs as gs  # noqa: E402
    from bench import grammar_walks as gw  # noqa: E402
    from bench.grammar_engines import LLGuidance, XGrammar, require  # noqa: E402
    from bench.grammar_sizes import import_seconds, installed_size  # noqa: E402
    from bench.grammar_vocab import Vocabulary, build_vocabulary  # noqa: E402
except ImportError as e:  # numpy, and the runtime's tokenizer's own dependencies (gguf, regex, jinja2)
    raise SystemExit(f"error: {e.name} is not installed in this Python; see docs/bench/grammar_libs.md") from None

RESULTS = REPO / "bench" / "results"
NEG_INF = np.float32(-np.inf)


def build_engines(vocab: Vocabulary, threads: int) -> tuple[list, dict]:
    """llguidance, xgrammar, and xgrammar with dynamic compilation (sharing xgrammar's tokenizer);
    the time each library takes to build its tokenizer from the runtime's (the libraries are
    imported before: torch's import alone takes seconds)."""
    engines, times = [], {}
    for make in (lambda: LLGuidance(vocab.tokenizer), lambda: XGrammar(vocab.tokenizer, threads)):
        w, c = time.perf_counter(), time.process_time()
        engine = make()
        times[engine.name] = {"wall_s": time.perf_counter() - w, "cpu_s": time.process_time() - c}
        engines.append(engine)
        print(f"  {engine.name} {engine.version}: tokenizer {times[engine.name]['wall_s']:.2f} s", file=sys.stderr)
    return engines + [engines[1].dynamic()], times


def measure_grammar(engine, name: str, grammar, vocab: Vocabulary, tools: list[gs.Tool],
                    a: argparse.Namespace) -> tuple[dict, object]:
    """One grammar on one engine: every figure of the docstring but the apply and the size."""
    kind = name.split()[0]
    compiled, compile_ = gw.compile_times(engine, grammar, a.compile_repeats)
    seqs = gw.valid_sequences(kind, vocab, tools, a.steps, a.seed)
    row = {"grammar": name, "kind": kind, "compile": compile_,
           **gw.mask_times(engine, compiled, seqs, vocab.tokenizer.vocab_size),
           "rollback": gw.rollback_check(engine, compiled, seqs[0], vocab.tokenizer.vocab_size),
           "spot_checks": gw.spot_checks(engine, compiled, kind, vocab, tools, a.walks, a.seed + 1),
           "markers_in_text": gw.markers_in_text(engine, compiled, kind, vocab, tools),
           "spelled_marker_works": gw.spelled_marker(engine, compiled, kind, vocab)}
    sc = row["spot_checks"]
    print(f"  {engine.name} {name}: compile {compile_['cold_ms']:.1f} ms, mask median {row['mask_us']['median']:.1f} us"
          f" p99 {row['mask_us']['p99']:.1f} us, walks parsed {sc['parsed']}/{sc['ended']} ended of {sc['walks']}",
          file=sys.stderr)
    return row, compiled


# ---- applying a mask to logits ------------------------------------------------------------------

# Byte value -> the 8 additive terms of its bits (0 where set, -inf where clear), little-endian.
BYTE_TERMS = np.where(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little") == 1,
                      np.float32(0), NEG_INF).astype(np.float32)


def apply_unpackbits(logits: np.ndarray, bitmask: np.ndarray) -> None:
    """-inf where the bit is clear: one unpackbits and one masked copy."""
    bits = np.unpackbits(bitmask.view(np.uint8), count=logits.shape[-1], bitorder="little").view(bool)
    np.copyto(logits, NEG_INF, where=~bits.reshape(logits.shape))


def apply_byte_table(logits: np.ndarray, bitmask: np.ndarray) -> None:
    """Each byte of the mask looked up as its 8 terms and added: no masked loop, the same cost
    whatever the share of allowed tokens (the vocabulary is a multiple of 32: no tail)."""
    terms = np.take(BYTE_TERMS, bitmask.view(np.uint8).ravel(), axis=0).reshape(-1)[:logits.shape[-1]]
    np.add(logits, terms.reshape(logits.shape), out=logits)


def _apply_time(fn, logits: np.ndarray, bitmask: np.ndarray, repeats: int) -> tuple[float, np.ndarray]:
    work, times = logits.copy(), []
    for _ in range(repeats):
        np.copyto(work, logits)
        _, w, _ = gw.timed(lambda: fn(work, bitmask))
        times.append(w * 1e6)
    return statistics.median(times), work


def measure_apply(engines: list, masks: dict[str, np.ndarray], n: int, repeats: int, seed: int) -> dict:
    """Median µs of each way of applying each mask to a (1, n) float32 row; all must agree."""
    logits = np.random.default_rng(seed).standard_normal((1, n)).astype(np.float32)
    out = {}
    for density, bitmask in masks.items():
        row = {"allowed_tokens": int(np.unpackbits(bitmask.view(np.uint8)).sum())}
        reference = None
        ways = [("numpy unpackbits", apply_unpackbits), ("numpy byte table", apply_byte_table)]
        for label, fn in ways + [(f"{e.name} helper", e.apply) for e in engines]:
            row[label + "_us"], result = _apply_time(fn, logits, bitmask, repeats)
            reference = result if reference is None else reference
            row[label + "_agrees"] = bool(np.array_equal(result, reference))
        out[density] = row
    return out


def sample_masks(engine, compiled: dict, vocab: Vocabulary) -> dict[str, np.ndarray]:
    """A dense mask (inside the think body) and a sparse one (a JSON value's start)."""
    masks = {}
    for density, kind, text in (("dense", "think", "Some words "), ("sparse", "json", '{"id": "ABC-1234", "status": ')):
        m, bitmask = engine.matcher(compiled[kind]), gw.new_bitmask(vocab.tokenizer.vocab_size)
        for t in vocab.tokenizer.encode(text):
            m.consume(t)
        m.fill(bitmask)
        masks[density] = bitmask
    return masks


# ---- the run --------------------------------------------------------------------------------------

def machine() -> dict:
    return {"cpu": cpu_features(), "arch": platform.machine(), "cores": os.cpu_count(),
            "python": platform.python_version(), "load_average_start": os.getloadavg()}


def ratios(rows: dict[str, dict[str, dict]]) -> dict:
    """xgrammar / llguidance (with and without dynamic compilation) for each grammar both compile
    from the same text."""
    llg, out = rows["llguidance"], {}
    for lib in ("xgrammar", "xgrammar dynamic"):
        out[lib] = {name: _ratio(llg[name], rows[lib][name]) for name in llg if name in rows[lib]}
    return out


def _ratio(a: dict, b: dict) -> dict:
    return {"compile_cold": b["compile"]["cold_ms"] / a["compile"]["cold_ms"],
            "mask_median": b["mask_us"]["median"] / a["mask_us"]["median"],
            "mask_p99": b["mask_us"]["p99"] / a["mask_us"]["p99"],
            "mask_cpu_median": b["mask_cpu_us"]["median"] / a["mask_cpu_us"]["median"]}


def run(a: argparse.Namespace) -> dict:
    w = time.perf_counter()
    vocab = build_vocabulary(a.seed)
    print(f"  vocabulary: {vocab.tokenizer.vocab_size} tokens in {time.perf_counter() - w:.1f} s", file=sys.stderr)
    tools = gs.make_tools(a.seed)
    engines, tokenizer_times = build_engines(vocab, a.threads)
    llg_specials = engines[0].check_specials(vocab.tokenizer)
    specials = [i for i in range(vocab.tokenizer.vocab_size) if vocab.tokenizer.is_special(i)]
    if specials != list(range(specials[0], specials[-1] + 1)):
        raise SystemExit("error: the special tokens are not one run of ids: the token-text grammars name them as one")
    lark = gs.lark_grammars(tools, specials[0], specials[-1])
    rows, compiled = {}, {}
    for engine in engines:
        rows[engine.name], compiled[engine.name] = {}, {}
        for name, grammar in engine.grammars(lark, tools).items():
            rows[engine.name][name], compiled[engine.name][name] = measure_grammar(engine, name, grammar, vocab, tools, a)
    masks = sample_masks(engines[0], compiled[engines[0].name], vocab)
    return {"vocabulary": {"size": vocab.tokenizer.vocab_size, "seed": a.seed, "ranks_by_kind": vocab.counts,
                           "normal_tokens_starting_with_0xff": len(vocab.ff_tokens),
                           "llguidance_special_tokens": llg_specials,
                           "special_ids": {"<|open|>": vocab.open_id, "<|close|>": vocab.close_id,
                                           "<|sep|>": vocab.sep_id, "<|end_of_msg|>": vocab.eos_id}},
            "versions": {e.name: e.version for e in engines}, "tokenizer": tokenizer_times,
            "grammars": rows, "ratios": ratios(rows),
            "apply": measure_apply(engines[:2], masks, vocab.tokenizer.vocab_size, a.apply_repeats, a.seed),
            "installed": {e.distribution: {**installed_size(e.distribution), "import_s": import_seconds(e.distribution)}
                          for e in engines[:2]}}


def print_summary(r: dict) -> None:
    t = r["tokenizer"]
    print(f"tokenizer from the runtime's: llguidance {t['llguidance']['wall_s']:.2f} s, "
          f"xgrammar {t['xgrammar']['wall_s']:.2f} s ({t['xgrammar']['wall_s'] / t['llguidance']['wall_s']:.2f}x)")
    for lib, rows in r["grammars"].items():
        for name, row in rows.items():
            sc, c = row["spot_checks"], row["compile"]
            print(f"{lib:16s} {name:22s} compile {c['cold_ms']:8.1f} ms (cached {c['cached_ms']:6.2f}) "
                  f"mask median {row['mask_us']['median']:6.1f} us p99 {row['mask_us']['p99']:8.1f} us; "
                  f"walks parsed {sc['parsed']:2d}/{sc['ended']:2d} ended of {sc['walks']} {sc['failure_kinds'] or ''}; "
                  f"spelled marker works: {row['spelled_marker_works']}, markers in text: {row['markers_in_text']}")
    for lib, rows in r["ratios"].items():
        for name, q in rows.items():
            print(f"{lib} / llguidance, {name}: compile {q['compile_cold']:.1f}x, mask median {q['mask_median']:.2f}x, "
                  f"p99 {q['mask_p99']:.2f}x")
    for density, row in r["apply"].items():
        ways = ", ".join(f"{k[:-3]} {v:.0f} us" for k, v in row.items() if k.endswith("_us"))
        print(f"apply a {density} mask ({row['allowed_tokens']} allowed): {ways}")
    for lib, size in r["installed"].items():
        print(f"installed {lib}: {size['own_mb']:.1f} MB, with its dependencies {size['with_dependencies_mb']:.0f} MB; "
              f"import {size['import_s']:.2f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300, help="mask steps measured a grammar and library")
    ap.add_argument("--walks", type=int, default=20, help="seeded random walks a grammar and library")
    ap.add_argument("--compile-repeats", type=int, default=5, help="cold compiles a grammar (median)")
    ap.add_argument("--apply-repeats", type=int, default=200, help="applications of a mask to logits (median)")
    ap.add_argument("--threads", type=int, default=1, help="xgrammar's compile threads (its max_threads)")
    ap.add_argument("--seed", type=int, default=0, help="vocabulary, tools, texts and walks")
    ap.add_argument("--json", type=Path, default=RESULTS / "grammar_libs.json")
    a = ap.parse_args()
    for module in ("llguidance", "xgrammar", "torch"):  # before the vocabulary's few seconds
        require(module)
    result = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "steps": a.steps, "walks": a.walks,
              "threads": a.threads, **run(a)}
    result["machine"]["load_average_end"] = os.getloadavg()
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(result, indent=1) + "\n")
    print_summary(result)


if __name__ == "__main__":
    main()
