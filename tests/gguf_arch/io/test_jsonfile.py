"""JSON given by the user: a string that is not text (half a surrogate pair) is found by name."""
from __future__ import annotations

import json
import shutil

import pytest

from gguf_arch.io.jsonfile import not_unicode
from tests.support.cli import run_cli
from tests.support.paths import FIXTURES


@pytest.mark.parametrize("value, where", [
    ({"a": ["x", {"b": "\ud800"}]}, "a[1].b"),
    ({"\udfff": 1}, "\\udfff"),
    (["ok", "\udc80"], "[1]"),
    ("\ud800", ""),
    ({"a": ["x", {"b": "\u00e9\U0001f600"}]}, None),  # text, a pair spelled whole included
])
def test_not_unicode_names_the_first_string_that_is_not_text(value, where):
    assert not_unicode(value) == where


def test_the_converter_refuses_a_tokenizer_config_that_is_not_text(tmp_path):
    """A chat template spelled with half a surrogate pair was a UnicodeEncodeError traceback from
    gguf-py's writer; now one line naming the file and key, exit 2, nothing written."""
    model = tmp_path / "model"
    shutil.copytree(FIXTURES / "k3-tiny", model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{{ 'x' }}\ud800"}))
    res = run_cli(model, tmp_path / "out.gguf")
    res.one_error_line(2, "tokenizer_config.json: 'chat_template' is not valid Unicode")
    assert not list(tmp_path.glob("out.gguf*"))
