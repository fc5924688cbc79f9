"""Server benchmark: kimi-k3-server against its own engine, on the graph benchmark's model.

    python bench/server.py --workdir /tmp/kimi-graph-bench

The model is bench/graph.py's (`kimi-k3-synth --preset large --experts 8`: the real widths, 4
layers of which one MLA+DSA, ~6.1 GB; generated and converted once into --workdir). One server
(`kimi-k3-server -np 8`, fast path, --threads threads) serves three measurements, each round of
each taking turns, the best round counting (the machine may be shared):

  clients   aggregate completion tokens/s with 1, 4 and 8 concurrent streaming clients, each its
            own prompt of --prompt tokens and --gen tokens to generate (ignore_eos);
            ratio_to_1 = tokens_per_s / the 1-client tokens_per_s of this run (goals: 2.5 at 4, 4 at 8).
  cache     time to the first token of a chat's second turn on a ~--history-token first turn:
            served from the prompt cache, against the same request with cache_prompt false (a
            fresh prefill); ratio = cached / fresh (goal: at most 0.2).
  overhead  one streaming client's time per token (first token to last) against the engine's own
            decode loop (generation/generate.py, the same options, in a child process after the
            server stopped); overhead = server / engine - 1 (goal: at most 5%). The same child
            measures the engine's own batching (bench/parallel.py's decode steps of 1, 4 and 8
            sequences together): engine_decode_ratio_to_1, what the clients' ratio can reach.

Results: bench/results/server.json and bench/results/server.png (tokens/s and ratio against the
client count; the two times to first token).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.graph import cpu_features, prepare  # noqa: E402
from bench.plotting import pyplot  # noqa: E402

RESULTS = REPO / "bench" / "results"
HISTORY_TEXT = REPO / "tests" / "fixtures" / "text" / "lighthouse.txt"
TIMEOUT = 3600.0

ENGINE_CHILD = """
import json, sys, time
import numpy as np
from ggml_graph_spec.engine.model import Model
from ggml_graph_spec.generation.events import StopRules
from ggml_graph_spec.generation.generate import generate
from ggml_graph_spec.generation.sampling import Sampler, SamplingParams
gguf, threads, gen, prompts, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]), \\
    int(sys.argv[5])
m = Model.load(gguf, n_ctx=8 * 2048, n_seq=8, n_threads=threads, n_batch=2048)
m.decode({0: [1]})
best, together = float("inf"), {}
for _ in range(repeats):
    m.reset()
    stamps = []
    for event in generate(m, prompts[0], Sampler(SamplingParams(temp=0.0)), StopRules(frozenset(), gen)):
        stamps.append(time.perf_counter())
    best = min(best, (stamps[-1] - stamps[0]) / (len(stamps) - 1))
    for n in (1, 4, 8):  # the engine's own batching, as bench/parallel.py: n sequences decoding together
        m.reset()
        out = m.decode({s: prompts[s] for s in range(n)})
        t = time.perf_counter()
        for _ in range(gen):
            out = m.decode({s: [int(np.argmax(out[s]))] for s in range(n)})
        together[n] = max(together.get(n, 0.0), n * gen / (time.perf_counter() - t))
print(json.dumps({"s_per_token": best, "decode_tokens_per_s": together}))
m.close()
"""


def start_server(gguf: Path, a: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "ggml_graph_spec.server.cli", "-m", str(gguf), "-np", "8", "-c", str(8 * 2048),
           "-t", str(a.threads), "--port", "0"]
    proc = subprocess.Popen(cmd, cwd=REPO, stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    for line in proc.stderr:
        print("  server: " + line.rstrip(), file=sys.stderr)
        m = re.search(r"server is listening on (http://\S+)", line)
        if m:
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()  # keep draining
            return proc, m.group(1)
    raise SystemExit(f"error: the server ended before listening (exit {proc.wait()})")


def _prompt(i: int, n: int) -> list[int]:
    return [(31 * i + 7 * k) % 900 + 1 for k in range(n)]


def _stream(http: httpx.Client, path: str, body: dict) -> tuple[float, float, dict]:
    """(seconds to the first chunk with text, seconds to the end, the usage)."""
    t, first, usage = time.perf_counter(), None, {}
    with http.stream("POST", path, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise SystemExit(f"error: the server answered {event['error']}")
            if first is None and event.get("choices"):
                first = time.perf_counter() - t
            usage = event.get("usage") or usage
    return first, time.perf_counter() - t, usage


def clients(http: httpx.Client, n: int, a: argparse.Namespace, round_: int) -> dict:
    out: list = [None] * n

    def run(i: int) -> None:
        body = {"prompt": _prompt(100 * round_ + i, a.prompt), "max_tokens": a.gen, "temperature": 0,
                "ignore_eos": True, "cache_prompt": False}
        out[i] = _stream(http, "/v1/completions", body)
    t = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    seconds = time.perf_counter() - t
    tokens = sum(r[2]["completion_tokens"] for r in out)
    return {"clients": n, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def second_turn(http: httpx.Client, a: argparse.Namespace, round_: int) -> dict:
    words = HISTORY_TEXT.read_text().split()
    history = " ".join(words[:a.history_words])
    first = [{"role": "system", "content": f"Conversation {round_}."}, {"role": "user", "content": history}]
    r = http.post("/v1/chat/completions", json={"messages": first, "max_tokens": 8, "temperature": 0}).json()
    turn = first + [{"role": "assistant", "content": r["choices"][0]["message"]["content"]},
                    {"role": "user", "content": "Say it again, shorter."}]
    body = {"messages": turn, "max_tokens": 2, "temperature": 0}
    cached_ttft, _, cached = _stream(http, "/v1/chat/completions", body)
    fresh_ttft, _, fresh = _stream(http, "/v1/chat/completions", {**body, "cache_prompt": False})
    return {"history_tokens": r["usage"]["prompt_tokens"], "turn_tokens": cached["prompt_tokens"],
            "cached_tokens": cached["prompt_tokens_details"]["cached_tokens"],
            "fresh_cached_tokens": fresh["prompt_tokens_details"]["cached_tokens"],
            "ttft_cached_s": cached_ttft, "ttft_fresh_s": fresh_ttft, "ratio": cached_ttft / fresh_ttft}


def server_per_token(http: httpx.Client, a: argparse.Namespace) -> float:
    stamps = []
    body = {"prompt": _prompt(7, a.prompt), "max_tokens": a.gen, "temperature": 0, "ignore_eos": True,
            "stream": True, "cache_prompt": False}
    with http.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())
    stamps = stamps[:-1]  # the last event is the finish chunk, not a token
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def engine_child(gguf: Path, a: argparse.Namespace) -> dict:
    """The engine's own loop: s_per_token of one generation (the same prompt as server_per_token),
    and decode_tokens_per_s of 1, 4 and 8 sequences decoding together (no server)."""
    prompts = [_prompt(7, a.prompt)] + [_prompt(500 + i, a.prompt) for i in range(7)]
    r = subprocess.run([sys.executable, "-c", ENGINE_CHILD, str(gguf), str(a.threads), str(a.gen),
                        json.dumps(prompts), str(a.repeats)], cwd=REPO, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=TIMEOUT)
    if r.returncode:
        raise SystemExit(f"error: the engine loop failed: {r.stderr.strip()[-400:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def measure(gguf: Path, a: argparse.Namespace) -> dict:
    proc, url = start_server(gguf, a)
    try:
        with httpx.Client(base_url=url, timeout=TIMEOUT) as http:
            best: dict[int, dict] = {}
            caches, per_token = [], []
            for k in range(a.repeats):
                for n in a.clients:
                    row = clients(http, n, a, k)
                    if n not in best or row["tokens_per_s"] > best[n]["tokens_per_s"]:
                        best[n] = row
                    print(f"  {n} client(s): {row['tokens_per_s']:.2f} tokens/s", file=sys.stderr)
                caches.append(second_turn(http, a, k))
                print(f"  second turn: {caches[-1]}", file=sys.stderr)
                per_token.append(server_per_token(http, a))
    finally:
        proc.terminate()
        code = proc.wait(timeout=600)
    base = best[min(a.clients)]["tokens_per_s"]
    rows = [{**best[n], "ratio_to_1": best[n]["tokens_per_s"] / base} for n in a.clients]
    cache = min(caches, key=lambda c: c["ratio"])
    engine = engine_child(gguf, a)
    together = {int(n): v for n, v in engine["decode_tokens_per_s"].items()}
    for row in rows:
        row["engine_decode_ratio_to_1"] = together[row["clients"]] / together[1]
    server = min(per_token)
    return {"clients": rows, "cache": cache, "cache_rounds": caches, "server_exit_code": code,
            "engine_decode_tokens_per_s": together,
            "overhead": {"server_s_per_token": server, "engine_s_per_token": engine["s_per_token"],
                         "overhead": server / engine["s_per_token"] - 1}}


def plot(result: dict, path: Path) -> None:
    plt = pyplot(path)
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    rows = result["clients"]
    n = [r["clients"] for r in rows]
    left.plot(n, [r["ratio_to_1"] for r in rows], "o-", label="server, streaming clients")
    left.plot(n, [r["engine_decode_ratio_to_1"] for r in rows], "s--", label="engine alone, decode steps")
    left.plot([4, 8], [2.5, 4], "x", label="goal")
    left.set(xlabel="concurrent streaming clients", ylabel="aggregate tokens/s, ratio to 1 client", xticks=n)
    left.legend()
    c = result["cache"]
    right.bar(["fresh prefill", "prompt cache"], [c["ttft_fresh_s"], c["ttft_cached_s"]])
    right.set(ylabel="time to first token of the second turn (s)",
              title=f"{c['turn_tokens']}-token prompt, {c['cached_tokens']} from the cache")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, required=True, help="where the generated model is kept")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens of each client")
    ap.add_argument("--gen", type=int, default=32, help="tokens each client generates")
    ap.add_argument("--history-words", type=int, default=350,
                    help="words of the first turn (~1,100 tokens with the template on the bench model's tokenizer)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", type=Path, default=RESULTS / "server.json")
    a = ap.parse_args()
    a.workdir.mkdir(parents=True, exist_ok=True)
    dsa, _no_dsa = prepare(a.workdir)
    result = {"date": time.strftime("%Y-%m-%d"), "machine": {"cpu": cpu_features(), "arch": platform.machine(),
              "cores": os.cpu_count(), "load_average": os.getloadavg()}, "model": dsa.name, "threads": a.threads,
              "prompt": a.prompt, "gen": a.gen, "repeats": a.repeats, **measure(dsa, a)}
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, a.json.with_suffix(".png"))
    for r in result["clients"]:
        print(f"{r['clients']} client(s): {r['tokens_per_s']:.2f} tokens/s, {r['ratio_to_1']:.2f}x")
    print(f"second turn: {result['cache']['ratio']:.3f}x of a fresh prefill; "
          f"overhead per token: {result['overhead']['overhead'] * 100:.1f}%")


if __name__ == "__main__":
    main()
