"""tiktoken.model + tokenizer_config.json -> tokenizer.ggml.* (gguf_arch/arch/tokenizer.py)."""
from __future__ import annotations

import base64
import dataclasses
import json
import random
import shutil
from pathlib import Path

import pytest
from gguf import GGUFValueType as T
from gguf import TokenType

from gguf_arch.arch.config import K3Config, load_config
from gguf_arch.errors import TokenizerError
from gguf_arch.arch.tokenizer import (byte_to_unicode, bytes_to_token_text, read_ranks, recover_merges,
                                 tokenizer_metadata)
from tests.support.bpe import kimi_bpe, multilingual_corpus
from tests.support.paths import K3_TINY as FIXTURE

N_RANKS = 656  # fixture README: 256 bytes + 400 merges


@pytest.fixture(scope="module")
def cfg() -> K3Config:
    return load_config(FIXTURE)


@pytest.fixture(scope="module")
def meta(cfg: K3Config) -> dict:
    return {key: (value, vtype, sub) for key, value, vtype, sub in tokenizer_metadata(FIXTURE, cfg)}


@pytest.fixture(scope="module")
def trained_ranks() -> list[bytes]:
    return kimi_bpe(multilingual_corpus(12000), 3000)


def naive_bpe(rank_of: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """Textbook BPE (rescan every pair after every merge), the oracle for recover_merges."""
    parts = [bytes([b]) for b in token]
    while True:
        found = [(rank_of[a + b], i) for i, (a, b) in enumerate(zip(parts, parts[1:]))
                 if rank_of.get(a + b, max_rank) < max_rank]
        if not found:
            return parts
        _, i = min(found)
        parts[i:i + 2] = [parts[i] + parts[i + 1]]


def expected_merges(ranks: list[bytes]) -> list[tuple[bytes, bytes]]:
    rank_of = {t: r for r, t in enumerate(ranks)}
    splits = (naive_bpe(rank_of, t, r) for r, t in enumerate(ranks) if len(t) > 1)
    return [tuple(s) for s in splits if len(s) == 2]


# --- the written metadata ------------------------------------------------------------------------

def test_model_pre_and_types(meta: dict) -> None:
    assert meta["tokenizer.ggml.model"] == ("gpt2", T.STRING, None)
    assert meta["tokenizer.ggml.pre"] == ("kimi-k2", T.STRING, None)
    assert meta["tokenizer.ggml.tokens"][1:] == (T.ARRAY, T.STRING)
    assert meta["tokenizer.ggml.token_type"][1:] == (T.ARRAY, T.INT32)
    assert meta["tokenizer.ggml.merges"][1:] == (T.ARRAY, T.STRING)


def test_tokens_are_ranks_in_byte_to_unicode_form_then_specials(meta: dict, cfg: K3Config) -> None:
    tokens, types = meta["tokenizer.ggml.tokens"][0], meta["tokenizer.ggml.token_type"][0]
    ranks = read_ranks(FIXTURE / "tiktoken.model")
    assert len(tokens) == len(types) == cfg.vocab_size == 912
    assert tokens[:N_RANKS] == [bytes_to_token_text(t) for t in ranks]
    assert tokens[ranks.index(b" the")] == "\u0120the"  # GPT-2 spells the space as U+0120
    assert set(types[:N_RANKS]) == {TokenType.NORMAL}
    assert set(types[N_RANKS:]) == {TokenType.CONTROL}
    readme_table = {656: "[BOS]", 657: "[EOS]", 658: "<|end_of_msg|>", 659: "<|open|>", 660: "<|close|>",
                    661: "<|sep|>", 662: "[start_header_id]", 663: "[end_header_id]", 665: "[EOT]",
                    674: "<|media_begin|>", 675: "<|media_content|>", 676: "<|media_end|>",
                    677: "<|media_pad|>", 721: "<osagent_mode>", 910: "[UNK]", 911: "[PAD]"}
    assert {i: tokens[i] for i in readme_table} == readme_table
    assert tokens[664] == "<|reserved_token_664|>"


def test_special_ids_eos_from_config(meta: dict) -> None:
    assert meta["tokenizer.ggml.bos_token_id"] == (656, T.UINT32, None)
    assert meta["tokenizer.ggml.eos_token_id"] == (658, T.UINT32, None)  # config's <|end_of_msg|>, not [EOS] 657
    assert meta["tokenizer.ggml.padding_token_id"] == (911, T.UINT32, None)
    assert meta["tokenizer.ggml.unknown_token_id"] == (910, T.UINT32, None)


def test_add_bos_follows_tokenizer_config_default_false(meta: dict, cfg: K3Config, tmp_path: Path) -> None:
    assert meta["tokenizer.ggml.add_bos_token"] == (False, T.BOOL, None)
    assert meta["tokenizer.ggml.add_eos_token"] == (False, T.BOOL, None)
    model = _copy_tokenizer(tmp_path)
    _edit_config(model, lambda c: c.update(add_bos_token=True))
    got = {k: v for k, v, _, _ in tokenizer_metadata(model, cfg)}
    assert got["tokenizer.ggml.add_bos_token"] is True


def test_ids_without_a_token_become_unused_pad(cfg: K3Config, tmp_path: Path) -> None:
    model = _copy_tokenizer(tmp_path)
    bigger = dataclasses.replace(cfg, vocab_size=cfg.vocab_size + 3)
    got = {k: v for k, v, _, _ in tokenizer_metadata(model, bigger)}
    assert got["tokenizer.ggml.tokens"][-3:] == ["[PAD912]", "[PAD913]", "[PAD914]"]
    assert got["tokenizer.ggml.token_type"][-3:] == [TokenType.UNUSED] * 3


def test_byte_to_unicode_is_gpt2s_map() -> None:
    table = byte_to_unicode()
    assert len(set(table.values())) == 256
    assert all(table[b] == chr(b) for b in b"!~AZaz09\xa1\xac\xae\xff")
    # The 68 bytes outside the kept ranges go to U+0100.. in byte order.
    assert (table[0], table[0x20], table[0x0A], table[0x7F], table[0xA0], table[0xAD]) == \
        ("\u0100", "\u0120", "\u010a", "\u0121", "\u0142", "\u0143")


# --- merges ----------------------------------------------------------------------------------------

def test_fixture_merges_are_the_two_part_bpe_splits(meta: dict) -> None:
    ranks = read_ranks(FIXTURE / "tiktoken.model")
    want = [f"{bytes_to_token_text(a)} {bytes_to_token_text(b)}" for a, b in expected_merges(ranks)]
    assert len(want) == 400
    assert meta["tokenizer.ggml.merges"][0] == want


def test_merges_of_a_3000_merge_trained_vocab(trained_ranks: list[bytes]) -> None:
    assert len(trained_ranks) == 256 + 3000
    assert any(len(t.decode("utf-8", "ignore")) > 1 and t[0] > 0x7F for t in trained_ranks)  # non-ASCII merges
    got = recover_merges(trained_ranks)
    assert got == expected_merges(trained_ranks)
    assert len(got) == 3000
    assert [a + b for a, b in got] == trained_ranks[256:]


def test_token_without_a_two_part_split_gets_no_merge() -> None:
    ranks = [bytes([b]) for b in range(256)] + [b"xy", b"abc", b"xyz"]
    # "abc": neither "ab" nor "bc" is a token, so BPE stops at three parts.
    assert recover_merges(ranks) == [(b"x", b"y"), (b"xy", b"z")]


def test_merge_recovery_on_a_163k_vocab() -> None:
    """Runs to the end at the real vocabulary's size (its time: bench/planning.py)."""
    rng = random.Random(1)
    ranks = [bytes([b]) for b in range(256)]
    seen = set(ranks)
    while len(ranks) < 163_584:  # a random merge tree with real-vocabulary token lengths (mean ~8 bytes)
        n = len(ranks)
        token = ranks[int(n * rng.random() ** 5)] + ranks[int(n * rng.random() ** 5)]
        if len(token) <= 24 and token not in seen:
            seen.add(token)
            ranks.append(token)
    merges = recover_merges(ranks)
    assert len(merges) > 100_000


# --- bad input -------------------------------------------------------------------------------------

def _copy_tokenizer(tmp_path: Path) -> Path:
    for name in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copy(FIXTURE / name, tmp_path / name)
    return tmp_path


def _edit_ranks(model: Path, edit) -> None:
    path = model / "tiktoken.model"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(edit(lines)) + "\n")


def _edit_config(model: Path, edit) -> None:
    path = model / "tokenizer_config.json"
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw))


def _b64(token: bytes) -> str:
    return base64.b64encode(token).decode()


BAD_INPUTS = {
    "missing tiktoken.model": (lambda m: (m / "tiktoken.model").unlink(), "tiktoken.model: not found"),
    "bad base64": (lambda m: _edit_ranks(m, lambda ls: ls[:300] + ["@@notbase64 300"] + ls[301:]),
                   "line 301: '@@notbase64' is not valid base64"),
    "wrong field count": (lambda m: _edit_ranks(m, lambda ls: ls + ["QUJD"]), "expected 'base64-token rank'"),
    "rank not a number": (lambda m: _edit_ranks(m, lambda ls: ls[:-1] + [f"{_b64(b'qqq')} x"]),
                          "rank must be a non-negative integer"),
    "rank a superscript digit": (lambda m: _edit_ranks(m, lambda ls: ls[:-1] + [f"{_b64(b'qqq')} 6\u00b2"]),
                                 "rank must be a non-negative integer, got '6\u00b2'"),
    "special id not decimal": (
        lambda m: _edit_config(m, lambda c: c["added_tokens_decoder"].update({"9\u00b2": {"content": "<x>"}})),
        "added_tokens_decoder key '9\u00b2' is not a token id"),
    "duplicate rank": (lambda m: _edit_ranks(m, lambda ls: ls + [f"{_b64(b'zzzq')} 655"]), "rank 655 appears twice"),
    "duplicate token": (lambda m: _edit_ranks(m, lambda ls: ls + [f"{ls[300].split()[0]} 656"]), "appears twice"),
    "gap in ranks": (lambda m: _edit_ranks(m, lambda ls: ls[:400] + ls[401:]),
                     "ranks must be contiguous from 0; 1 missing, the first is 400"),
    "missing single byte": (lambda m: _edit_ranks(m, lambda ls: [f"{_b64(b'zq')} 65"] + ls[:65] + ls[66:]),
                            "needs all 256 single-byte tokens; 1 missing, e.g. byte 0x41"),
    "more ranks than vocab_size": (
        lambda m: _edit_ranks(m, lambda ls: ls + [f"{_b64(('%04d' % i).encode())} {656 + i}" for i in range(300)]),
        "956 ranks, more than config.json vocab_size 912"),
    "missing tokenizer_config.json": (lambda m: (m / "tokenizer_config.json").unlink(),
                                      "tokenizer_config.json: not found"),
    "malformed tokenizer_config.json": (lambda m: (m / "tokenizer_config.json").write_text("{\"bos_token\": "),
                                        "tokenizer_config.json: not valid JSON"),
    "deeply nested tokenizer_config.json": (lambda m: (m / "tokenizer_config.json").write_text("[" * 100_000),
                                            "tokenizer_config.json: JSON nested too deeply"),
    "no added_tokens_decoder": (lambda m: _edit_config(m, lambda c: c.pop("added_tokens_decoder")),
                                "added_tokens_decoder must be a non-empty object"),
    "special id outside vocab": (
        lambda m: _edit_config(m, lambda c: c["added_tokens_decoder"].update({"912": {"content": "<x>"}})),
        "special token '<x>' has id 912, expected an id in 656..911"),
    "special id on a rank": (
        lambda m: _edit_config(m, lambda c: c["added_tokens_decoder"].update({"10": {"content": "<x>"}})),
        "special token '<x>' has id 10"),
    "special with a lone surrogate": (
        lambda m: (m / "tokenizer_config.json").write_text(
            (m / "tokenizer_config.json").read_text().replace('"[EOT]"', '"\\ud800"')),
        "added_tokens_decoder[665] needs a non-empty 'content' string of valid Unicode"),
    "empty tiktoken.model": (lambda m: (m / "tiktoken.model").write_text("\n"), "tiktoken.model: holds no ranks"),
    "special listed twice": (
        lambda m: _edit_config(m, lambda c: c["added_tokens_decoder"]["700"].update(content="[BOS]")),
        "special token '[BOS]' is listed under more than one id"),
    "bos name not a special": (lambda m: _edit_config(m, lambda c: c.update(bos_token="<s>")),
                               "bos_token '<s>' is not in added_tokens_decoder"),
    "add_bos_token not a bool": (lambda m: _edit_config(m, lambda c: c.update(add_bos_token="yes")),
                                 "add_bos_token must be true or false"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_tokenizer_input_is_one_clear_line(case: str, cfg: K3Config, tmp_path: Path) -> None:
    break_it, message = BAD_INPUTS[case]
    model = _copy_tokenizer(tmp_path)
    break_it(model)
    with pytest.raises(TokenizerError) as err:
        tokenizer_metadata(model, cfg)
    text = str(err.value)
    assert "\n" not in text
    assert message in text
    assert isinstance(err.value.exit_code, int) and err.value.exit_code == 2


def test_eos_on_an_unused_slot_is_rejected(cfg: K3Config, tmp_path: Path) -> None:
    model = _copy_tokenizer(tmp_path)
    bigger = dataclasses.replace(cfg, vocab_size=cfg.vocab_size + 1, eos_token_id=cfg.vocab_size)
    with pytest.raises(TokenizerError, match=r"eos_token_id 912 is not a token of the vocabulary"):
        tokenizer_metadata(model, bigger)
