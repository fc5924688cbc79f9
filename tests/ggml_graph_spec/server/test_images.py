"""kimi-k3-server --mmproj: OpenAI `image_url` content parts as data: URIs reproduce the reference's
greedy tokens (a chat template that renders the parts as they are gives the reference's prompt),
never reuse a cached prefix, and every bad image or URL is one 400 with the server serving on;
nothing is ever fetched."""
from __future__ import annotations

import base64
import io
import subprocess
import sys

import numpy as np
import openai
import pytest
from gguf import GGUFValueType as T
from PIL import Image

from gguf_arch.errors import EXIT_BAD_INPUT
from ggml_graph_spec.server.errors import ApiError
from ggml_graph_spec.server.protocol import chat_prompt
from ggml_graph_spec.text.chat_template import ChatTemplate
from tests.support.reply_filter import ReplyFilter
from ggml_graph_spec.text.tokenizer import BPETokenizer

from tests.ggml_graph_spec.vision.conftest import files
from tests.ggml_graph_spec.vision.test_cli_images import AS_IS
from tests.support.gguf_edit import rewritten_copy
from tests.support.paths import REPO
from tests.support.server import WAIT_S, LiveServer

N_CTX_SLOT = 128


def data_uri(path, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode()}"


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture(scope="module")
def server(tmp_path_factory, k31pro_tiny_gguf, k31pro_tiny_mmproj):
    template = tmp_path_factory.mktemp("template") / "as-is.jinja"
    template.write_text(AS_IS, encoding="utf-8")
    s = LiveServer(k31pro_tiny_gguf, "--mmproj", k31pro_tiny_mmproj, "-np", 2, "-c", 2 * N_CTX_SLOT,
                   "--exact-experts", "--chat-template-file", template)
    yield s
    s.close()


@pytest.fixture(scope="module")
def shown(k31pro_tiny_gguf):
    """The text a chat reply shows for token ids (special tokens hidden)."""
    tokenizer = BPETokenizer.from_gguf(k31pro_tiny_gguf)

    def text(ids) -> str:
        keep = ReplyFilter(tokenizer)
        return tokenizer.decode([int(t) for t in ids if keep(int(t))])
    return text


def _ask(client, content: list, n: int = 8, **extra):
    return client.chat.completions.create(model="k3", messages=[{"role": "user", "content": content}],
                                          max_tokens=n, temperature=0, **extra)


E2E1 = [image_part(data_uri(files("img_48x32")[0])), {"type": "text", "text": "The picture shows"}]
E2E2 = [image_part(data_uri(files("img_24x24")[0])), {"type": "text", "text": " and "},
        image_part(data_uri(files("img_37x21")[0])), {"type": "text", "text": " show"}]


def test_image_url_parts_give_the_reference_tokens(client, ref, shown):
    for case, content in (("e2e1", E2E1), ("e2e2", E2E2)):
        r = _ask(client, content)
        assert r.choices[0].message.content == shown(ref[f"{case}/greedy_ids"]), case
        assert r.usage.prompt_tokens == len(ref[f"{case}/logits"])  # the merged prompt: the rows count
        assert r.usage.prompt_tokens_details.cached_tokens == 0
    chunks = list(_ask(client, E2E1, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == shown(ref["e2e1/greedy_ids"])


def test_a_prompt_with_images_is_never_served_from_the_cache(server, client, ref, shown, tmp_path):
    """A first request with another image of the same size and the start of the text: its prompt's
    ids (-1 at the rows) are a prefix of the second's, which must still be computed from scratch."""
    flipped = tmp_path / "flipped.png"
    Image.open(files("img_48x32")[0]).transpose(Image.Transpose.FLIP_LEFT_RIGHT).save(flipped)
    first = [image_part(data_uri(flipped)), {"type": "text", "text": "The picture"}]
    tok = server.model.tokenizer
    assert tok.encode("[BOS]The picture shows")[:len(tok.encode("[BOS]The picture"))] == tok.encode("[BOS]The picture")
    _ask(client, first)
    again = _ask(client, E2E1)
    assert again.choices[0].message.content == shown(ref["e2e1/greedy_ids"])
    assert again.usage.prompt_tokens_details.cached_tokens == 0


@pytest.mark.parametrize("url, needle", [
    ("https://example.com/cat.png", "is not a data: URI: this server never fetches a URL"),
    ("file:///etc/passwd", "is not a data: URI"),
    ("data:image/png,rawbytes", "must be a base64 data: URI"),
    ("data:image/png;base64,@@@@", "not valid base64"),
    ("data:image/png;base64," + base64.b64encode(b"not an image").decode(), "not a PNG, JPEG or WebP image"),
    ("gif", "not a PNG, JPEG or WebP image"),
    ("cut", "cannot be decoded"),
])
def test_a_bad_image_is_one_400_and_the_server_serves_on(server, client, ref, shown, url, needle):
    if url in ("gif", "cut"):
        buf = io.BytesIO()
        if url == "gif":
            Image.new("RGB", (8, 8)).save(buf, format="GIF")
        else:
            buf.write(files("img_48x32")[0].read_bytes()[:1000])
        url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    with pytest.raises(openai.BadRequestError) as exc:
        _ask(client, [{"type": "text", "text": "look"}, image_part(url)])
    assert exc.value.status_code == 400 and needle in exc.value.message
    assert "messages[0].content[1]" in exc.value.message


def test_other_refusals(server, client, k31pro_tiny_gguf):
    with pytest.raises(openai.BadRequestError, match="'messages.0..content.0..image_url.url' must be a string"):
        _ask(client, [{"type": "image_url", "image_url": "data:image/png;base64,AAAA"}])
    too_many = [image_part(data_uri(files("img_48x32")[0]))] * 6  # 6 x 24 rows > the slot's 128 positions
    with pytest.raises(openai.BadRequestError, match="exceeds the available context size"):
        _ask(client, too_many)
    tokenizer = BPETokenizer.from_gguf(k31pro_tiny_gguf)
    template = ChatTemplate(AS_IS, "as-is", tokenizer, {})
    with pytest.raises(ApiError, match="this server has no vision encoder .start it with --mmproj"):
        chat_prompt({"messages": [{"role": "user", "content": E2E1}]}, template, tokenizer, None)
    assert server.idle()


def test_another_models_mmproj_is_refused_before_loading(tmp_path, k31pro_tiny_gguf, k31pro_tiny_mmproj):
    other = rewritten_copy(k31pro_tiny_mmproj, tmp_path / "other.gguf",
                           keys={"clip.vision.kimik3.media_placeholder_token_id": (600, T.UINT32)})
    r = subprocess.run([sys.executable, "-m", "ggml_graph_spec.server.cli", "-m", str(k31pro_tiny_gguf), "--port", "0",
                        "--mmproj", str(other)], cwd=REPO, capture_output=True, text=True, timeout=WAIT_S)
    assert r.returncode == EXIT_BAD_INPUT
    assert r.stderr.splitlines()[-1].startswith("error: ") and "an mmproj of another model" in r.stderr
    assert "loading" not in r.stderr


@pytest.fixture(scope="module")
def ref():
    from tests.support.paths import VISION
    with np.load(VISION / "vision_reference.npz") as z:
        return {k: z[k] for k in z.files}
