"""Agents benchmark: what constrained decoding costs against a decode step, in one run.

    python bench/agents.py --workdir /tmp/kimi-graph-bench

The constraint of an agent's request (chat/constraint.py: llguidance's mask of the request's
grammar, applied to its logits row before sampling, told each sampled token after) is computed on
the CPU between two decode steps, one sequence after another (generation/batch.py). This measures
it against the step it delays, at K3's vocabulary of 163,840 tokens (bench/grammar_vocab.py: the
runtime's BPETokenizer, from which the project's chat/vocab.py builds llguidance's tokenizer):

  tokenizer   llguidance's tokenizer built from the runtime's, once (wall and CPU time);
  compile     ConstraintPlan.build, cold (median of --compile-repeats; the first one too), of the
              requests of bench/agents_specs.py, all grammars written by chat/grammar.py: 20 tools
              with tool_choice required (the whole reply: think text, an empty response, the
              calls), the same tools with auto (lazy: free text, then the tools grammar after
              `<|open|>`), a nested JSON schema response;
  per token   Constraint.mask + accept along --replies valid replies of each (bench/agents_walks.py):
              median, p99 and mean per token, wall clock and this thread's CPU time, by section
              (think, response, tools, json; under auto the free text runs no grammar);
  closing     the same within the last 256 tokens of a limit: from the middle of the tools
              section or the JSON, random logits (a model that does not end by itself) and a room
              that runs down to 1; closing.py's look-ahead must end each reply valid, and it is
              checked; --closing-walks of them;
  split       where a mask's CPU time goes: llguidance's mask, the closing look-ahead (the masks
              of its copies), numpy's application to the row;
  8 sequences 8 requests, each with its own grammar (3 declarations of 20 tools required, 3 auto,
              2 JSON schemas), --steps8 steps of all 8 in batch.py's order, each request starting
              a new reply when one ends; per step the sum of the 8 masks and accepts; again with
              all 8 in their last 256 tokens;
  decode      one step of the graph benchmark's model (bench/graph.py: `kimi-k3-synth --preset
              large --experts 8`, the real widths, ~6.1 GB; generated and converted once into
              --workdir, shared with bench/graph.py and bench/parallel.py), fast path, --threads,
              with 1 and with 8 sequences (a step of 8 tokens), timed as bench/parallel.py times
              it (its own `speed`: the best of --rounds rounds of 8 steps, wall and CPU time).

Ratios: the mean mask + accept per token over the decode step of one sequence, and the mean per
step of the 8 constraints over the 8-sequence step; the goal is under 2% for both.
Results: bench/results/agents.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

try:
    import numpy as np  # noqa: F401,E402  (the walks' logits)
    import llguidance  # noqa: F401,E402  (the grammar engine of chat/constraint.py)
    from bench import agents_specs as specs  # noqa: E402
    from bench import agents_walks as walks  # noqa: E402
    from bench.grammar_vocab import build_vocabulary  # noqa: E402
    from bench.grammar_walks import summary  # noqa: E402
    from bench.graph import cpu_features, prepare  # noqa: E402
    from ggml_graph_spec.chat.constraint import ConstraintPlan  # noqa: E402
    from ggml_graph_spec.chat.vocab import ll_tokenizer  # noqa: E402
except ImportError as e:
    raise SystemExit(f"error: {e.name} is not installed in this Python: run the project's setup "
                     "(bash scripts/test.sh makes .venv/) and run this with .venv/bin/python") from None

RESULTS = REPO / "bench" / "results"
GOAL = 0.02  # of a decode step
CHOICES = ("tools required", "tools auto", "json schema")


def clocked(fn) -> tuple[object, float, float]:
    """(result, wall s, this process's CPU s): llguidance may use threads of its own."""
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def compile_times(tok, spec, repeats: int) -> dict:
    """ConstraintPlan.build of `spec`, `repeats` times from the grammar's text: ms."""
    rounds = [clocked(lambda: ConstraintPlan.build(tok, spec)) for _ in range(repeats)]
    wall, cpu = [r[1] * 1e3 for r in rounds], [r[2] * 1e3 for r in rounds]
    return {"cold_ms": statistics.median(wall), "cold_cpu_ms": statistics.median(cpu),
                           "first_ms": wall[0], "rounds_ms": wall}


def split_pass(make, n: int) -> dict:
    """A walk run again with the clock inside the mask: its parts' mean thread CPU µs per token."""
    parts: dict = {}
    with walks.split_clock(parts):
        steps = walks.run_replies(make(), n)
    n_tokens = len(steps.section)
    mask = sum(steps.mask_cpu) / n_tokens
    out = {"tokens": n_tokens, "mask_cpu_us": mask, "llguidance_mask_us": parts["fill"] / n_tokens,
           "lookahead_us": parts["lookahead"] / n_tokens,
           "numpy_and_rest_us": mask - (parts["fill"] + parts["lookahead"]) / n_tokens,
           "accept_cpu_us": sum(steps.accept_cpu) / n_tokens}
    out.update({k: parts[k] for k in ("steers", "lookaheads", "lookahead_masks")})
    return out


def one_sequence(name: str, spec, vocab, a: argparse.Namespace) -> dict:
    """Per token along valid replies, by section, and within the last 256 tokens of a limit."""
    def reply_walk():
        return walks.Walk(spec, vocab.tokenizer, vocab.lexicon, a.seed)

    def closing_walk():
        return walks.ClosingWalk(spec, vocab.tokenizer, vocab.lexicon, a.seed)

    steps = walks.run_replies(reply_walk(), a.replies)
    sections = {s: steps.figures({s}) for s in dict.fromkeys(steps.section)}
    closing = closing_walk()
    closed = walks.run_replies(closing, a.closing_walks)
    row = {"replies": a.replies, "all": steps.figures(), "sections": sections,
           "constrained": steps.figures(walks.CONSTRAINED),
           "closing": {"walks": a.closing_walks, "from_section": closing.lookahead_from[:a.closing_walks],
                       "tokens_per_walk": len(closed.section) / a.closing_walks,
                       "not_ended_valid": len(closing.failures), "failures": closing.failures[:3], **closed.figures()},
           "split": {"replies": split_pass(reply_walk, a.replies), "closing": split_pass(closing_walk, a.closing_walks)}}
    print(f"  {name}: mask+accept mean {row['all']['mask_accept_us']['mean']:.1f} us a token "
          f"(p99 {row['all']['mask_accept_us']['p99']:.1f}); closing mean {row['closing']['mask_accept_us']['mean']:.1f} "
          f"us (p99 {row['closing']['mask_accept_us']['p99']:.1f})", file=sys.stderr, flush=True)
    return row


def eight_specs(seed: int) -> list[tuple[str, object]]:
    """8 requests, each its own grammar: three 20-tool declarations required, three auto, two JSON."""
    out = []
    for i in range(3):
        out.append(("tools required", specs.specs(seed + 1 + i)["tools required"]))
    for i in range(3):
        out.append(("tools auto", specs.specs(seed + 4 + i)["tools auto"]))
    return out + [("json schema", specs.specs(seed)["json schema"])] * 2


def eight_sequences(vocab, a: argparse.Namespace) -> dict:
    """The 8 constraints' sum per step, along valid replies and all 8 near their limit."""
    tok, lexicon = vocab.tokenizer, vocab.lexicon
    requests = eight_specs(a.seed)
    out = {"requests": [name for name, _ in requests], "steps": a.steps8}
    for kind, make in (("replies", walks.Walk), ("closing", walks.ClosingWalk)):
        seqs = [make(spec, tok, lexicon, a.seed + 10 + i) for i, (_, spec) in enumerate(requests)]
        steps, per_wall, per_cpu = walks.run_steps(seqs, a.steps8)
        out[kind] = {"per_step_us": summary(per_wall), "per_step_cpu_us": summary(per_cpu),
                     "per_token": steps.figures()}
        if kind == "closing":
            out[kind]["walks"] = sum(s.walks - 1 for s in seqs)  # the last one of each is unfinished
            out[kind]["not_ended_valid"] = sum(len(s.failures) for s in seqs)
        print(f"  8 sequences, {kind}: {out[kind]['per_step_us']['mean']:.0f} us a step "
              f"(p99 {out[kind]['per_step_us']['p99']:.0f})", file=sys.stderr, flush=True)
    return out


def decode_step(a: argparse.Namespace) -> dict:
    """One decode step of the graph benchmark's model with 1 and with 8 sequences (bench/parallel.py)."""
    from bench.parallel import speed
    try:
        dsa, _ = prepare(a.workdir)
    except (subprocess.CalledProcessError, OSError) as e:
        raise SystemExit(f"error: the graph benchmark's model could not be made in {a.workdir}: {e}") from None
    ns = argparse.Namespace(sequences=[1, 8], prompt=16, steps=8, repeats=a.rounds, threads=a.threads)
    print(f"decode on {dsa.name}, {a.threads} threads", file=sys.stderr, flush=True)
    rows, _ = speed(dsa, ns)
    return {"model": dsa.name, "threads": a.threads, "rounds": a.rounds, "steps_per_round": ns.steps,
            **{str(r["sequences"]): {"step_ms": r["decode_s"] / ns.steps * 1e3,
                                     "step_cpu_ms": r["sequences"] / r["tokens_per_cpu_s"] * 1e3}
               for r in rows}}


def ratios(r: dict) -> dict:
    """Constraint cost over the step it delays: the mean per token (1 sequence) and the mean per
    step of 8 constraints (8 sequences); wall over wall, and the p99 token or step too."""
    one, eight = r["decode"]["1"]["step_ms"] * 1e3, r["decode"]["8"]["step_ms"] * 1e3
    out = {}
    for name, row in r["grammars"].items():
        for part in ("all", "closing"):
            t = row[part]["mask_accept_us"]
            out[f"{name}, {part}"] = {"mean": t["mean"] / one, "p99": t["p99"] / one}
    for kind in ("replies", "closing"):
        t = r["eight"][kind]["per_step_us"]
        out[f"8 sequences, {kind}"] = {"mean": t["mean"] / eight, "p99": t["p99"] / eight}
    for q in out.values():
        q["goal_met"] = q["mean"] < GOAL
    return out


def versions() -> dict:
    out = {"python": platform.python_version()}
    for dist in ("llguidance", "numpy", "ggml-python"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def run(a: argparse.Namespace) -> dict:
    (vocab, w, _) = clocked(lambda: build_vocabulary(a.seed))
    print(f"  vocabulary: {vocab.tokenizer.vocab_size} tokens in {w:.1f} s", file=sys.stderr, flush=True)
    _, w, c = clocked(lambda: ll_tokenizer(vocab.tokenizer))
    result = {"vocabulary": vocab.tokenizer.vocab_size, "tokenizer": {"wall_s": w, "cpu_s": c},
              "compile": {}, "grammars": {}}
    for name, spec in specs.specs(a.seed).items():
        result["compile"][name] = compile_times(vocab.tokenizer, spec, a.compile_repeats)
        result["grammars"][name] = one_sequence(name, spec, vocab, a)
    result["eight"] = eight_sequences(vocab, a)
    result["machine"] = {"load_average_before_decode": os.getloadavg()}
    result["decode"] = decode_step(a)
    result["ratios"] = ratios(result)
    return result


def print_summary(r: dict) -> None:
    d = r["decode"]
    print(f"llguidance tokenizer from the runtime's ({r['vocabulary']} tokens): {r['tokenizer']['wall_s']:.2f} s")
    print(f"decode step ({d['threads']} threads): 1 sequence {d['1']['step_ms']:.1f} ms "
          f"(CPU {d['1']['step_cpu_ms']:.1f}), 8 sequences {d['8']['step_ms']:.1f} ms (CPU {d['8']['step_cpu_ms']:.1f})")
    for name, row in r["grammars"].items():
        c = r["compile"][name]
        secs = ", ".join(f"{s} {f['mask_accept_us']['mean']:.1f}" for s, f in row["sections"].items())
        sp = row["split"]["closing"]
        print(f"{name:15s} compile {c['cold_ms']:6.1f} ms; mask+accept us a token: mean {row['all']['mask_accept_us']['mean']:6.1f}"
              f" median {row['all']['mask_accept_us']['median']:6.1f} p99 {row['all']['mask_accept_us']['p99']:7.1f}"
              f" ({secs}); closing mean {row['closing']['mask_accept_us']['mean']:.1f} p99"
              f" {row['closing']['mask_accept_us']['p99']:.1f} (llguidance {sp['llguidance_mask_us']:.1f},"
              f" look-ahead {sp['lookahead_us']:.1f}, numpy {sp['numpy_and_rest_us']:.1f})")
    for kind in ("replies", "closing"):
        e = r["eight"][kind]["per_step_us"]
        print(f"8 sequences, {kind}: {e['mean']:.0f} us a step (median {e['median']:.0f}, p99 {e['p99']:.0f})")
    for what, q in r["ratios"].items():
        print(f"ratio {what:28s}: mean {q['mean'] * 100:.3f}% of a step, p99 {q['p99'] * 100:.3f}% "
              f"(goal {GOAL * 100:.0f}%: {'met' if q['goal_met'] else 'NOT met'})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, required=True, help="where the graph benchmark's model is kept")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="the decode step's threads")
    ap.add_argument("--rounds", type=int, default=3, help="decode rounds of 8 steps (the best counts)")
    ap.add_argument("--replies", type=int, default=12, help="valid replies walked a grammar")
    ap.add_argument("--closing-walks", type=int, default=8, help="walks to the end within 256 tokens a grammar")
    ap.add_argument("--steps8", type=int, default=400, help="steps of the 8 sequences together")
    ap.add_argument("--compile-repeats", type=int, default=5, help="cold compiles a grammar (median)")
    ap.add_argument("--seed", type=int, default=0, help="vocabulary, tools, replies and walks")
    ap.add_argument("--json", type=Path, default=RESULTS / "agents.json")
    a = ap.parse_args()
    a.workdir.mkdir(parents=True, exist_ok=True)
    start = {"date": time.strftime("%Y-%m-%d"), "load_average_start": os.getloadavg()}
    try:
        r = run(a)
    except walks.WalkError as e:
        raise SystemExit(f"error: {e}") from None
    r["machine"].update(cpu=cpu_features(), arch=platform.machine(), cores=os.cpu_count(),
                        load_average_start=start["load_average_start"], load_average_end=os.getloadavg())
    result = {"date": start["date"], "machine": r.pop("machine"), "versions": versions(), "seed": a.seed, **r}
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(result, indent=1) + "\n")
    print_summary(result)


if __name__ == "__main__":
    main()
