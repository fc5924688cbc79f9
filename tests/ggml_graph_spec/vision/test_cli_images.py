"""kimi-k3-cli with --mmproj, --image, --video: the reference's greedy tokens on the exact path (a
completion, a conversation, under --mem-budget, over --rpc), a conversation's later turns with
/image and /video, and bad input refused with one line before any ggml object exists."""
from __future__ import annotations

import io
import json
import math
import subprocess
import sys

import pytest
from gguf import GGUFValueType as T
from PIL import Image

from gguf_arch.errors import EXIT_BAD_INPUT
from ggml_graph_spec.engine.model import Model
from ggml_graph_spec.generation.events import StopRules, Timings
from ggml_graph_spec.generation.sampling import Sampler, SamplingParams
from ggml_graph_spec.runner.chat import Conversation
from tests.support.reply_filter import ReplyFilter
from ggml_graph_spec.runner.cli import main
from ggml_graph_spec.text.chat_template import ChatTemplate
from ggml_graph_spec.text.tokenizer import BPETokenizer
from ggml_graph_spec.vision.encode import VisionEncoder
from ggml_graph_spec.vision.preprocess import MAX_PIXELS
from ggml_graph_spec.vision.prompt import MEDIA_MARKER

from tests.support.cli import NO_GGML
from tests.support.gguf_edit import rewritten_copy
from tests.support.paths import REPO

from .conftest import files
from .test_generation import CASES
from .test_preprocess import _png_header_only

GREEDY = ("-n", "8", "--temp", "0", "-c", "128", "-t", "1", "--exact-experts")
# A chat template that renders the user's parts as they are: the reference's prompt text.
AS_IS = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}{% for p in m.content %}"
         "{% if p.type == 'text' %}{{ p.text }}{% else %}<|media_begin|>image {{ p.width }}x{{ p.height }}"
         "<|media_content|><|media_pad|><|media_end|>{% endif %}{% endfor %}{% endif %}{% endfor %}")


def media_args(case: str) -> list[str]:
    out = []
    for name in CASES[case][1]:
        paths = [str(p) for p in files(name)]
        out += ["--image", paths[0]] if len(paths) == 1 else ["--video", ",".join(paths)]
    return out


def _cli(capsys, *argv, stdin: str | None = None, monkeypatch=None) -> tuple[str, str]:
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return out, err


def _completion(capsys, gguf, mmproj, case: str, *extra) -> str:
    out, _err = _cli(capsys, "-m", gguf, "--mmproj", mmproj, *media_args(case), "-p", CASES[case][0], *GREEDY, *extra)
    return out


@pytest.mark.parametrize("case", ["e2e2", "e2ev"])
def test_a_completion_with_images_or_a_clip_gives_the_reference_tokens(capsys, k31pro_tiny_gguf, k31pro_tiny_mmproj,
                                                                       ref, case):
    """The prompt echoed with its media blocks (the reference's text), then the reference's 8
    greedy tokens."""
    out, err = _cli(capsys, "-m", k31pro_tiny_gguf, "--mmproj", k31pro_tiny_mmproj, *media_args(case),
                    "-p", CASES[case][0], *GREEDY)
    decode = BPETokenizer.from_gguf(k31pro_tiny_gguf).decode
    assert out == str(ref[f"{case}/text"]) + decode(ref[f"{case}/greedy_ids"].tolist()) + "\n"
    assert f"print_info: mmproj           = {k31pro_tiny_mmproj} (2 vision blocks, exact (F32)" in err
    assert "media encode time = " in err and f"/ {len(ref[f'{case}/logits']):5d} tokens" in err


def test_a_memory_budget_and_rpc_give_the_same_tokens(capsys, k31pro_tiny_gguf, k31pro_tiny_mmproj):
    """The rows are an input of the graph's input segment: streamed layers or layers on an RPC
    server compute the same tokens."""
    from tests.support.rpc_servers import RpcServers
    plain = _completion(capsys, k31pro_tiny_gguf, k31pro_tiny_mmproj, "e2e2")
    budget = str(k31pro_tiny_gguf.stat().st_size * 2 // 3)
    assert _completion(capsys, k31pro_tiny_gguf, k31pro_tiny_mmproj, "e2e2", "--mem-budget", budget) == plain
    with RpcServers(1) as servers:
        remote = _completion(capsys, k31pro_tiny_gguf, k31pro_tiny_mmproj, "e2e2", "--rpc", servers.endpoints[0],
                             "-ts", "1,1")
    assert remote == plain


def test_a_conversation_with_the_template_as_is_gives_the_reference_tokens(capsys, monkeypatch, tmp_path,
                                                                          k31pro_tiny_gguf, k31pro_tiny_mmproj, ref):
    """The first turn's image goes through the chat template's own placeholder; rendered as the
    reference's prompt, the reply is the reference's greedy tokens (special tokens hidden, as a
    chat reply shows them)."""
    template = tmp_path / "as-is.jinja"
    template.write_text(AS_IS, encoding="utf-8")
    out, _err = _cli(capsys, "-m", k31pro_tiny_gguf, "--mmproj", k31pro_tiny_mmproj, "-cnv", "--chat-template-file",
                     template, *media_args("e2e1"), "-p", CASES["e2e1"][0].removeprefix("[BOS]"), *GREEDY,
                     stdin="", monkeypatch=monkeypatch)
    tokenizer = BPETokenizer.from_gguf(k31pro_tiny_gguf)
    shown = ReplyFilter(tokenizer)
    assert out == tokenizer.decode([t for t in ref["e2e1/greedy_ids"].tolist() if shown(t)]) + "\n"


def test_later_turns_take_their_own_media_and_bad_media_ends_only_that_turn(capsys, monkeypatch, k31pro_tiny_gguf,
                                                                            k31pro_tiny_mmproj):
    """With the GGUF's K3 template: the command line's image with the first turn, a clip given
    with /video with the second; a missing file and a marker without its image are error lines,
    and the conversation goes on. The replies are the library's Conversation's."""
    clip = ",".join(str(p) for p in files("vid_2x32x24"))
    stdin = f"/image {REPO}/absent.png\n/video {clip}\nAnd {MEDIA_MARKER} then?\n{MEDIA_MARKER} alone\n"
    out, err = _cli(capsys, "-m", k31pro_tiny_gguf, "--mmproj", k31pro_tiny_mmproj, "-cnv", *media_args("e2e1"),
                    "-p", f"What is in {MEDIA_MARKER}?", *GREEDY, "-c", "512", "--reasoning-format", "none",
                    stdin=stdin, monkeypatch=monkeypatch)  # none: the thinking inline, as Reply.text holds it
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 2 and "absent.png: not found" in errors[0] and "1 media marker(s)" in errors[1], errors
    assert out == "".join(r + "\n" for r in _library_replies(k31pro_tiny_gguf, k31pro_tiny_mmproj, clip))


def _library_replies(gguf, mmproj, clip: str) -> list[str]:
    model = Model.load(gguf, n_ctx=512, exact_experts=True, n_threads=1)
    try:
        with VisionEncoder.open(mmproj, exact=True, threads=1) as enc:
            tok = model.tokenizer
            conv = Conversation(model, tok, Sampler(SamplingParams(temp=0)), StopRules(frozenset({tok.eos_id}), 8),
                                ChatTemplate(model.weights.metadata["tokenizer.chat_template"], "gguf", tok, {}),
                                encoder=enc, pending=[enc.media(files("img_48x32"))])
            first = conv.turn(f"What is in {MEDIA_MARKER}?", io.StringIO(), Timings()).text
            conv.attach("/video", clip)
            return [first, conv.turn(f"And {MEDIA_MARKER} then?", io.StringIO(), Timings()).text]
    finally:
        model.close()


# ---- bad input: one line, exit 2, nothing on stdout, no ggml object -----------------------------

# Runs kimi-k3-cli's main for each argv of a JSON list in one interpreter whose ggml_init and
# weight-buffer calls exit 99 (tests/support/cli.py): one JSON line per case.
_MANY = NO_GGML + """
import contextlib, io, json, sys
from ggml_graph_spec.runner.cli import main
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    print(json.dumps([rc, out.getvalue(), err.getvalue()]), flush=True)
"""


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory, k31pro_tiny_mmproj):
    d = tmp_path_factory.mktemp("bad")
    whole = files("img_48x32")[0].read_bytes()
    (d / "cut.png").write_bytes(whole[: len(whole) // 2])
    _png_header_only(d / "huge.png", math.isqrt(MAX_PIXELS) + 1, math.isqrt(MAX_PIXELS) + 1)
    Image.new("RGB", (8, 8)).save(d / "a.gif", format="GIF")
    Image.new("RGB", (8, 16)).save(d / "tall.png")
    rewritten_copy(k31pro_tiny_mmproj, d / "other.gguf",
                   keys={"clip.vision.kimik3.media_placeholder_token_id": (600, T.UINT32)})
    (d / "text.txt").write_text("some text")
    return d


def test_bad_media_input_is_one_line_before_any_ggml_object(bad_inputs, k31pro_tiny_gguf, k31pro_tiny_mmproj):
    good, frame = str(files("img_48x32")[0]), str(files("vid_2x32x24")[0])
    d, mm, m = bad_inputs, str(k31pro_tiny_mmproj), str(k31pro_tiny_gguf)
    cases = [
        (["--image", good, "-p", "x"], "--image and --video need --mmproj"),
        (["--mmproj", m, "--image", good, "-p", "x"], "not a Kimi K3 mmproj"),
        (["--mmproj", str(d / "other.gguf"), "--image", good, "-p", "x"],
         "placeholder token is 600, the text model's <|media_pad|> is 677: an mmproj of another model"),
        (["--mmproj", mm, "--image", good, "-p", MEDIA_MARKER * 2], "2 media marker(s) <__media__> for 1 media item"),
        (["--mmproj", mm, "--image", good, "--image", good, "-p", f"a {MEDIA_MARKER} b"], "1 media marker(s)"),
        (["--mmproj", mm, "-p", f"a {MEDIA_MARKER} b"], "1 media marker(s) <__media__> for 0 media item"),
        (["--mmproj", mm, "--image", str(d / "absent.png"), "-p", "x"], "absent.png: not found"),
        (["--mmproj", mm, "--image", str(d / "cut.png"), "-p", "x"], "cannot be decoded"),
        (["--mmproj", mm, "--image", str(d / "huge.png"), "-p", "x"], "decompression-bomb limit"),
        (["--mmproj", mm, "--image", str(d / "a.gif"), "-p", "x"], "not a PNG, JPEG or WebP image"),
        (["--mmproj", mm, "--video", f"{frame},{d / 'tall.png'}", "-p", "x"], "one size"),
        (["--mmproj", mm, "--video", f"{frame},", "-p", "x"], "expected frame files separated by commas"),
        (["--mmproj", mm, "--perplexity", "-f", str(d / "text.txt")], "not to --perplexity"),
    ]
    argvs = [["-m", m, "-n", "1", "-c", "64", *argv] for argv, _needle in cases]
    res = subprocess.run([sys.executable, "-c", _MANY, json.dumps(argvs)], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    results = [json.loads(line) for line in res.stdout.splitlines()]
    assert len(results) == len(cases), res.stderr[-2000:]  # none reached ggml (exit 99)
    for (argv, needle), (rc, out, err) in zip(cases, results):
        assert (rc, out) == (EXIT_BAD_INPUT, ""), (argv, err)
        assert err.startswith("error: ") and err.count("\n") == 1 and needle in err, (argv, err)
