"""Fuzz the other files of a checkpoint directory: model.safetensors.index.json (no read may leave
the model directory), config.json and the tokenizer (tiktoken.model, tokenizer_config.json).
Each input either parses or fails with one line of the module's KimiError subclass."""
from __future__ import annotations

import base64
import json
import os
import shutil
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gguf_arch.io import safetensors as st_reader
from gguf_arch.arch.config import load_config, parse_config
from gguf_arch.errors import CheckpointError, ConfigError, TokenizerError
from gguf_arch.arch.tensors import plan_tensors
from gguf_arch.arch.tokenizer import read_ranks, read_special_tokens, tokenizer_metadata

from .harness import FUZZ, assert_clean, corpus_files
from tests.support.paths import K3_TINY as FIXTURE

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
                    max_leaves=10)
BIG_DECIMAL = st.integers(4300, 6000).map(lambda n: "9" * n)


def _raises_cleanly(kind, fn, *args):
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - which exception it is, is the point
        assert_clean(exc, kind)
        return None


# ---- model.safetensors.index.json ------------------------------------------------------------

HOSTILE_SHARDS = st.sampled_from(["..", ".", "../outside.safetensors", "/etc/passwd", "sub/x.safetensors",
                                  "..\\outside.safetensors", "", "x\0y", "C:\\x", "~", "inside.safetensors"])
INDEX = (st.fixed_dictionaries({"weight_map": st.dictionaries(st.text(max_size=6), HOSTILE_SHARDS | st.text(max_size=8),
                                                              max_size=4)})
         | st.fixed_dictionaries({"weight_map": JSON}) | JSON)


@pytest.fixture
def model_dir(tmp_path) -> Path:
    """A model dir holding one valid shard, next to one outside it that a hostile index names."""
    shard = FIXTURE / "model-00001-of-000016.safetensors"
    shutil.copyfile(shard, tmp_path / "outside.safetensors")
    (tmp_path / "model").mkdir()
    shutil.copyfile(shard, tmp_path / "model" / "inside.safetensors")
    return tmp_path / "model"


def _check_index(model_dir: Path, monkeypatch, blob: bytes) -> None:
    (model_dir / st_reader.INDEX_FILE).write_bytes(blob)
    opened: list[Path] = []

    def recording(real):
        def opener(p, *a, **k):
            if not isinstance(p, int):  # a file descriptor was recorded when it was opened
                opened.append(Path(p))
            return real(p, *a, **k)
        return opener
    monkeypatch.setattr(st_reader, "open", recording(open), raising=False)
    monkeypatch.setattr(st_reader.os, "open", recording(os.open))
    ckpt = _raises_cleanly(CheckpointError, st_reader.open_checkpoint, model_dir)
    root = model_dir.resolve()
    assert all(p.resolve().parent == root for p in opened), opened
    if ckpt is not None:
        for name in ckpt.entries:
            ckpt.array(name)
        ckpt.close()


@FUZZ
@given(doc=INDEX)
def test_index(model_dir, monkeypatch, doc):
    _check_index(model_dir, monkeypatch, json.dumps(doc).encode())


@FUZZ
@given(blob=st.binary(max_size=40) | st.just(b"[" * 100_000))
def test_index_bytes(model_dir, monkeypatch, blob):
    _check_index(model_dir, monkeypatch, blob)


# ---- config.json -----------------------------------------------------------------------------

BASE_CONFIG = json.loads((FIXTURE / "config.json").read_text())


@st.composite
def mutated_config(draw) -> dict:
    """The fixture's config with a few fields replaced by junk, deleted, or set to edge values."""
    cfg = json.loads(json.dumps(BASE_CONFIG))
    for _ in range(draw(st.integers(1, 3))):
        node = cfg
        while True:
            keys = list(node) if isinstance(node, dict) else list(range(len(node)))
            if not keys:
                break
            key = draw(st.sampled_from(keys))
            if isinstance(node[key], (dict, list)) and node[key] and draw(st.booleans()):
                node = node[key]
                continue
            edge = st.sampled_from([0, -1, 1, 2 ** 31, 2 ** 63, 10 ** 400, 0.5, float("nan"), float("inf"), "",
                                    "1", True, None, [], {}, [0] * 3])
            if isinstance(node, dict) and draw(st.integers(0, 4)) == 0:
                del node[key]
            else:
                node[key] = draw(edge | JSON)
            break
    return cfg


def _check_config(raw) -> None:
    cfg = _raises_cleanly(ConfigError, parse_config, raw)
    if cfg is not None:
        for _ in plan_tensors(cfg):
            pass


@FUZZ
@given(raw=mutated_config())
def test_config_fields(raw):
    _check_config(raw)


@FUZZ
@given(raw=JSON)
def test_config_any_json(raw):
    _check_config(raw)


@FUZZ
@given(blob=st.binary(max_size=40) | st.sampled_from([b"[" * 100_000, b"\xff\xfe{}", b'{"a": 1e999999}']))
def test_config_bytes(tmp_path, blob):
    (tmp_path / "config.json").write_bytes(blob)
    _raises_cleanly(ConfigError, load_config, tmp_path)


# ---- tiktoken.model and tokenizer_config.json ------------------------------------------------

BYTE_LINES = [f"{base64.b64encode(bytes([b])).decode()} {b}" for b in range(256)]
RANK_LINE = (st.builds(lambda tok, rank: f"{base64.b64encode(tok).decode()} {rank}", st.binary(max_size=4),
                       st.integers(0, 300) | BIG_DECIMAL | st.sampled_from(["-1", "²", "1.0", "0x10", "", "1 2"]))
             | st.text(max_size=12))


@FUZZ
@given(extra=st.lists(RANK_LINE, max_size=4), drop=st.integers(0, 300), blob=st.binary(max_size=8))
def test_tiktoken_model(tmp_path, extra, drop, blob):
    lines = [l for i, l in enumerate(BYTE_LINES) if i != drop] + extra
    path = tmp_path / "tiktoken.model"
    path.write_bytes("\n".join(lines).encode() + blob)
    ranks = _raises_cleanly(TokenizerError, read_ranks, path)
    if ranks is not None:
        assert len(set(ranks)) == len(ranks) and all(bytes([b]) in ranks for b in range(256))


BASE_TOKENIZER_CONFIG = json.loads((FIXTURE / "tokenizer_config.json").read_text())
SPECIAL_KEY = st.sampled_from(["0", "255", "656", "700", "-1", "²", "1e3"]) | BIG_DECIMAL | st.text(max_size=4)


@FUZZ
@given(key=SPECIAL_KEY, entry=JSON | st.fixed_dictionaries({"content": JSON}),
       field=st.sampled_from(["bos_token", "eos_token", "pad_token", "unk_token", "add_bos_token", "add_eos_token"]),
       value=JSON)
def test_tokenizer_config(tmp_path, key, entry, field, value):
    doc = json.loads(json.dumps(BASE_TOKENIZER_CONFIG))
    doc["added_tokens_decoder"][key] = entry
    doc[field] = value
    path = tmp_path / "tokenizer_config.json"
    path.write_text(json.dumps(doc))
    _raises_cleanly(TokenizerError, read_special_tokens, path, 656, 1024)


@FUZZ
@given(line=st.integers(0, 655), replacement=RANK_LINE)
def test_tokenizer_end_to_end(tmp_path, line, replacement):
    """One line of the fixture's tiktoken.model replaced: the whole GGUF tokenizer build."""
    cfg = load_config(FIXTURE)
    for name in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copyfile(FIXTURE / name, tmp_path / name)
    lines = (tmp_path / "tiktoken.model").read_text().splitlines()
    lines[line] = replacement
    (tmp_path / "tiktoken.model").write_text("\n".join(lines))
    _raises_cleanly(TokenizerError, tokenizer_metadata, tmp_path, cfg)


@pytest.mark.parametrize("path", corpus_files("index"), ids=lambda p: p.name)
def test_index_corpus(model_dir, monkeypatch, path):
    _check_index(model_dir, monkeypatch, path.read_bytes())


@pytest.mark.parametrize("path", corpus_files("config"), ids=lambda p: p.name)
def test_config_corpus(tmp_path, path):
    shutil.copyfile(path, tmp_path / "config.json")
    _raises_cleanly(ConfigError, load_config, tmp_path)


@pytest.mark.parametrize("path", corpus_files("tiktoken"), ids=lambda p: p.name)
def test_tiktoken_corpus(tmp_path, path):
    shutil.copyfile(path, tmp_path / "tiktoken.model")
    _raises_cleanly(TokenizerError, read_ranks, tmp_path / "tiktoken.model")


@pytest.mark.parametrize("path", corpus_files("tokenizer_config"), ids=lambda p: p.name)
def test_tokenizer_config_corpus(tmp_path, path):
    shutil.copyfile(path, tmp_path / "tokenizer_config.json")
    _raises_cleanly(TokenizerError, read_special_tokens, tmp_path / "tokenizer_config.json", 656, 1024)


@pytest.mark.parametrize("field", ["activation_situ_beta", "activation_situ_linear_beta"])
def test_a_zero_situ_cap_is_refused_at_conversion(field):
    """Found by the GGUF fuzz: SiTU divides by its betas, so the runner refused 0; the converter
    must not write a GGUF the runner refuses."""
    raw = json.loads(json.dumps(BASE_CONFIG))
    raw["text_config"][field] = 0.0
    with pytest.raises(ConfigError, match=f"text_config.{field} must be > 0, got 0.0"):
        parse_config(raw)


# ---- files that are not regular files --------------------------------------------------------

@pytest.mark.parametrize("name", ["config.json", st_reader.INDEX_FILE, "tiktoken.model", "tokenizer_config.json"])
@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_checkpoint_file_that_is_not_a_regular_file(tmp_path, name, kind):
    """A FIFO planted under one of the checkpoint's own file names would block a plain open()
    until a writer comes (forever): the converter refuses it at once, one line, exit 2. Run in a
    child process with a timeout, so a regression fails instead of hanging the suite."""
    from tests.support.cli import run_cli
    model = tmp_path / "model"
    shutil.copytree(FIXTURE, model)
    (model / name).unlink()
    os.mkfifo(model / name) if kind == "fifo" else (model / name).mkdir()
    res = run_cli(model, tmp_path / "out.gguf", "--quiet", timeout=60)
    res.one_error_line(2, str(model / name), "not a regular file" if kind == "fifo" else "is a directory")
    assert not (tmp_path / "out.gguf").exists()
