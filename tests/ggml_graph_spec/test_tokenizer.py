"""The runtime BPE tokenizer from GGUF metadata (ggml_graph_spec/tokenizer.py) against tiktoken."""
from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
import tiktoken
from gguf import GGUFWriter, TokenType
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gguf_arch.arch.config import load_config
from gguf_arch.errors import GGUFError
from gguf_arch.arch.tokenizer import KIMI_K2_PATTERN, bytes_to_token_text, recover_merges, tokenizer_metadata
from ggml_graph_spec.text.tokenizer import BPETokenizer
from tests.support.bpe import kimi_bpe, multilingual_corpus
from tests.support.paths import FIXTURES

K3_TINY = FIXTURES / "k3-tiny"

MULTILINGUAL = (
    "The quick brown fox jumps over the lazy dog. It's 12:45 -- isn't it? They'll say we'd've gone.\n"
    "中文分词测试：我们在北京吃了烤鸭，价格是１２３元。\n"
    "日本語のテキストとカタカナ、ひらがなの混在。東京タワー！\n"
    "한국어 텍스트입니다. 서울에서 만나요?\n"
    "Привет, мир! Ёжик в тумане, 2024 год.\n"
    "مرحبا بالعالم، كيف حالك؟ ٣٤٥\n"
    "Emoji: 😀👍🏽 👨‍👩‍👧 ❤️ 🇯🇵\n"
    "def f(x):\n    return {'a': [1, 2.5e-3]}  # code\n\tif x != None: pass\r\n"
    '{"key": "value", "n": 1234567, "ok": true, "list": [1,2,3]}\n'
    "   leading and trailing spaces   \t\t\n\n\n  \u00a0nbsp\u3000ideographic space\n"
    "numbers 3.14159 1000000 ０１２ x²\n"
    "APOSTROPHES: DON'T WON'T I'M YOU'RE WE'VE HE'LL SHE'D it’s\n"
    "Mixed中文English日本語한국어Русский"
)


def fixture_encoding(model_dir: Path) -> tiktoken.Encoding:
    """tiktoken on the fixture's own files, read here independently of the product code."""
    ranks = {}
    for line in (model_dir / "tiktoken.model").read_text().splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    block = json.loads((model_dir / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    specials = {entry["content"]: int(i) for i, entry in block.items()}
    return tiktoken.Encoding("k3-tiny", pat_str=KIMI_K2_PATTERN, mergeable_ranks=ranks, special_tokens=specials)


def tokenizer_from_metadata(model_dir: Path) -> BPETokenizer:
    meta = {k: v for k, v, _, _ in tokenizer_metadata(model_dir, load_config(model_dir))}
    return BPETokenizer(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"],
                        meta["tokenizer.ggml.merges"], pre=meta["tokenizer.ggml.pre"],
                        bos_id=meta["tokenizer.ggml.bos_token_id"], eos_id=meta["tokenizer.ggml.eos_token_id"],
                        add_bos=meta["tokenizer.ggml.add_bos_token"])


def tokenizer_from_ranks(ranks: list[bytes]) -> BPETokenizer:
    tokens = [bytes_to_token_text(t) for t in ranks]
    merges = [f"{bytes_to_token_text(a)} {bytes_to_token_text(b)}" for a, b in recover_merges(ranks)]
    return BPETokenizer(tokens, [TokenType.NORMAL] * len(tokens), merges)


@pytest.fixture(scope="module")
def fixture_tok() -> BPETokenizer:
    return tokenizer_from_metadata(K3_TINY)


@pytest.fixture(scope="module")
def fixture_enc() -> tiktoken.Encoding:
    return fixture_encoding(K3_TINY)


@pytest.fixture(scope="module")
def trained() -> tuple[BPETokenizer, tiktoken.Encoding]:
    ranks = kimi_bpe(multilingual_corpus(12000), 3000)
    enc = tiktoken.Encoding("trained", pat_str=KIMI_K2_PATTERN,
                            mergeable_ranks={t: r for r, t in enumerate(ranks)}, special_tokens={})
    return tokenizer_from_ranks(ranks), enc


# --- the pre-tokenizer -----------------------------------------------------------------------------

def test_pattern_is_the_fixture_readme_pat_str() -> None:
    readme = (FIXTURES / "README.md").read_text().splitlines()
    assert [line for line in readme if line.startswith(r"[\p{Han}]+|")] == [KIMI_K2_PATTERN]


def tiktoken_pieces(text: str) -> list[bytes]:
    """How tiktoken splits `text`: with every substring of it in the vocabulary, each piece
    merges into exactly one token, so the tokens are the pieces."""
    raw = text.encode("utf-8")
    ranks = {bytes([b]): b for b in range(256)}
    for sub in sorted({raw[i:j] for i in range(len(raw)) for j in range(i + 2, len(raw) + 1)}, key=len):
        ranks[sub] = len(ranks)
    enc = tiktoken.Encoding("pieces", pat_str=KIMI_K2_PATTERN, mergeable_ranks=ranks, special_tokens={})
    return [enc.decode_single_token_bytes(t) for t in enc.encode_ordinary(text)]


def our_pieces(text: str) -> list[bytes]:
    tokens = [bytes_to_token_text(bytes([b])) for b in range(256)]
    tok = BPETokenizer(tokens, [TokenType.NORMAL] * 256, [])
    return [p.encode("utf-8") for p in tok._pre.findall(text)]


# Characters where regex engines are known to disagree: \s beyond ASCII, Han by script vs script
# extensions, case folding in the (?i:'s...) suffixes, marks, letter-numbers, Lt/Lm letters.
TRICKY = ["中、文", "中々文〇一", "ーカナ", "⼀⼁ 豈 𠀀𠀁 ㄅ", "He'S IT'LL ſ K's ß'S", "a\u00a0b\u2007 c\u202fd",
          "x\x1c\x1dy \x1e\x1f", "a\x85b\u2028c\u2029", "a\u200bb\ufeffc\u180ed", "e\u0301te \u0301x",
          "٣٤٥٦ ０１２３ ²³ Ⅻ", "ǅa ʰb ǈǉ", "👨‍👩‍👧 ❤️ 🇯🇵", "it’s Don't 'S", "  \n\n  x\r\n\t y   ",
          "ABCdef GHI's", "ΣΑΣ Ωmega", "{\"a\": [1, 2.5e-3]}\n\n", "1234567 12.5", "\u3000x\u3000\u3000",
          "...!!!\n\r\n", "ﬆ'ﬅ", "中文English日本語",
          # Unicode 15 and 16 additions (Kawi, CJK Ext H and I, Garay, Todhri): tiktoken 0.14's tables
          # know them too. Unicode 17 additions (CJK Ext J, U+323B0..) are where the two differ.
          ":\U00011F04\U00011F04:", ":\U00031350:", ":\U0002EBF0:", ":\U00010D50:", ":\U000105C0\U000105C0:"]


@pytest.mark.parametrize("text", TRICKY)
def test_pre_tokenizer_splits_like_tiktoken(text: str) -> None:
    assert our_pieces(text) == tiktoken_pieces(text)


@settings(max_examples=150, deadline=None)
@given(st.text(st.characters(exclude_categories=("Cs", "Cn")), max_size=14))  # Cn as of Python's Unicode 14
def test_pre_tokenizer_splits_like_tiktoken_on_any_unicode(text: str) -> None:
    assert our_pieces(text) == tiktoken_pieces(text)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(list("aZ'sSlLtT 1\n\r\t\u00a0中文カ한й٣²\u0301😀.,-_{}\"") + ["'ll", "'re", "'VE"]),
                max_size=20).map("".join))
def test_pre_tokenizer_splits_like_tiktoken_on_dense_edge_cases(text: str) -> None:
    assert our_pieces(text) == tiktoken_pieces(text)


# --- ids equal tiktoken's --------------------------------------------------------------------------

def test_fixture_vocab_encodes_multilingual_text_like_tiktoken(fixture_tok, fixture_enc) -> None:
    assert fixture_tok.encode(MULTILINGUAL, add_bos=False) == fixture_enc.encode_ordinary(MULTILINGUAL)
    with_specials = "[BOS]" + MULTILINGUAL + "<|end_of_msg|><|open|>x<|reserved_token_700|>"
    assert fixture_tok.encode(with_specials) == fixture_enc.encode(with_specials, allowed_special="all")


def test_trained_3000_merge_vocab_encodes_like_tiktoken(trained) -> None:
    tok, enc = trained
    got = tok.encode(MULTILINGUAL)
    assert got == enc.encode_ordinary(MULTILINGUAL)
    assert max(got) > 256 + 1000  # late merges are used, not just bytes and early merges
    held_out = multilingual_corpus(2000, seed=7)
    assert tok.encode(held_out) == enc.encode_ordinary(held_out)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(st.sampled_from(sorted(set(multilingual_corpus(3000, seed=3)))), max_size=60))
def test_trained_vocab_encodes_like_tiktoken_on_random_text(trained, text: str) -> None:
    tok, enc = trained
    assert tok.encode(text) == enc.encode_ordinary(text)


def _tiktoken_and_ours(extra_ranks: list[bytes]) -> tuple[tiktoken.Encoding, BPETokenizer]:
    ranks = [bytes([b]) for b in range(256)] + extra_ranks
    enc = tiktoken.Encoding("t", pat_str=KIMI_K2_PATTERN, mergeable_ranks={t: r for r, t in enumerate(ranks)},
                            special_tokens={})
    return enc, tokenizer_from_ranks(ranks)


def test_a_piece_that_is_a_token_without_a_merge_is_that_token() -> None:
    enc, tok = _tiktoken_and_ours([b"abc"])  # no "ab" or "bc": "abc" has no merge
    assert enc.encode_ordinary("abc abcd") == tok.encode("abc abcd") == [256, 32, 97, 98, 99, 100]


def test_a_vocabulary_not_made_by_bpe_training_shows_the_limit_of_merges() -> None:
    # The module docstring's example: tiktoken builds "ccacb" (258) from "cca" (259) + "cb" (256);
    # merges record "ccacb" nowhere (BPE below rank 258 ends in c|ca|cb), as llama.cpp's would.
    enc, tok = _tiktoken_and_ours([b"cb", b"ca", b"ccacb", b"cca"])
    assert enc.encode_ordinary("ccacbc") == [258, 99]
    assert tok.encode("ccacbc") == [259, 256, 99]


@pytest.mark.parametrize("source", ["metadata", "converted GGUF"])
@pytest.mark.parametrize("fixture", ["k3-tiny", "k31pro-tiny"])
def test_reference_prompts_reencode_exactly(fixture: str, source: str, request: pytest.FixtureRequest) -> None:
    if source == "metadata":
        tok = tokenizer_from_metadata(FIXTURES / fixture)
    else:
        tok = BPETokenizer.from_gguf(request.getfixturevalue(f"{fixture.replace('-', '_')}_gguf"))
    ref = np.load(FIXTURES / fixture / "reference.npz")
    for prompt in ("short", "long"):
        want = ref[f"input_ids_{prompt}"].tolist()
        assert want[0] == 656
        assert tok.encode(str(ref[f"prompt_{prompt}_text"])) == want
        assert tok.decode(want) == str(ref[f"prompt_{prompt}_text"])


def test_gguf_tokenizer_equals_the_metadata_one(k3_tiny_gguf: Path, fixture_tok: BPETokenizer) -> None:
    tok = BPETokenizer.from_gguf(k3_tiny_gguf)
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.vocab_size) == (656, 658, False, 912)
    assert tok.encode(MULTILINGUAL) == fixture_tok.encode(MULTILINGUAL)


# --- special tokens --------------------------------------------------------------------------------

def test_special_tokens_only_when_allowed(fixture_tok: BPETokenizer, fixture_enc) -> None:
    text = "[BOS]hi<|end_of_msg|>"
    assert fixture_tok.encode(text)[0] == 656 and fixture_tok.encode(text)[-1] == 658
    plain = fixture_tok.encode(text, allow_special=False)
    assert plain == fixture_enc.encode_ordinary(text)
    assert 656 not in plain and 658 not in plain


def test_add_bos(fixture_tok: BPETokenizer) -> None:
    assert fixture_tok.encode("hi", add_bos=True)[0] == 656
    assert fixture_tok.encode("hi") == fixture_tok.encode("hi", add_bos=False)  # the GGUF says add_bos false
    forced = BPETokenizer(*_tiny_vocab(), bos_id=256, add_bos=True)
    assert forced.encode("a") == [256, ord("a")]


# --- decoding --------------------------------------------------------------------------------------

def test_decode_inverts_encode(fixture_tok: BPETokenizer, trained) -> None:
    text = MULTILINGUAL + "[BOS]<|sep|>"
    assert fixture_tok.decode(fixture_tok.encode(text)) == text
    assert trained[0].decode(trained[0].encode(text)) == text


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(st.characters(exclude_categories=("Cs",)), max_size=40))
def test_decode_inverts_encode_on_any_text(fixture_tok: BPETokenizer, text: str) -> None:
    assert fixture_tok.decode(fixture_tok.encode(text)) == text


def test_streaming_holds_partial_characters(fixture_tok: BPETokenizer) -> None:
    text = "a中😀é!"
    ids = fixture_tok.encode(text)
    # The fixture's merges are English, so every non-ASCII character here is one token per byte.
    assert len(ids) == 1 + 3 + 4 + 2 + 1
    stream = fixture_tok.stream_decoder()
    assert [stream.push(i) for i in ids] == ["a", "", "", "中", "", "", "", "😀", "", "é", "!"]
    assert stream.flush() == ""


def test_streaming_specials_and_bad_bytes(fixture_tok: BPETokenizer) -> None:
    stream = fixture_tok.stream_decoder()
    a = fixture_tok.encode("a")[0]
    e4 = fixture_tok.encode("中")[0]  # the lead byte 0xE4
    assert stream.push(656) == "[BOS]"
    assert stream.push(e4) == ""
    assert stream.push(a) == "\ufffda"  # the character never completed
    assert stream.push(e4) == ""
    assert stream.flush() == "\ufffd"


def test_special_text_spelled_like_a_normal_token_stays_apart() -> None:
    tokens, types, merges = _tiny_vocab()
    # "<|>" both as a learned (NORMAL) token and as a control token, as a vocabulary could have it.
    tokens += ["<|", "<|>", "<|>"]
    types += [TokenType.NORMAL, TokenType.NORMAL, TokenType.CONTROL]
    tok = BPETokenizer(tokens, types, ["< |", "<| >"])
    assert tok.encode("<|>", allow_special=False) == [258]
    assert tok.encode("<|>") == [259]
    assert tok.decode([258, 259]) == "<|><|>"
    with pytest.raises(GGUFError, match="cannot add a BOS token"):
        tok.encode("a", add_bos=True)


def test_a_repeated_merge_keeps_its_first_rank_and_later_merges_still_apply() -> None:
    tokens, types, _ = _tiny_vocab()
    tokens += ["ab", "abc"]
    types += [TokenType.NORMAL] * 2
    tok = BPETokenizer(tokens, types, ["a b", "a b", "ab c"])
    assert tok.encode("abc") == [258]


def test_unused_slots_decode_to_nothing() -> None:
    tokens, types, merges = _tiny_vocab()
    tok = BPETokenizer(tokens + ["[PAD257]"], types + [TokenType.UNUSED], merges)
    assert tok.decode([ord("a"), 257, ord("b")]) == "ab"
    with pytest.raises(ValueError, match="token id 999 is outside the vocabulary of 258"):
        tok.decode([999])


# --- bad GGUF metadata -----------------------------------------------------------------------------

def _tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    tokens = [bytes_to_token_text(bytes([b])) for b in range(256)] + ["[BOS]"]
    return tokens, [TokenType.NORMAL] * 256 + [TokenType.CONTROL], []


BAD_METADATA = {
    "unknown pre-tokenizer": (lambda t, k, m: (t, k, m, {"pre": "llama3"}), "tokenizer.ggml.pre is 'llama3'"),
    "type count": (lambda t, k, m: (t, k[:-1], m, {}), "tokenizer.ggml.token_type has 256 entries"),
    "merge of non-tokens": (lambda t, k, m: (t, k, ["a b"], {}), "tokenizer.ggml.merges[0] = 'a b'"),
    "merge without a space": (lambda t, k, m: (t + ["ab"], k + [1], ["ab"], {}), "expected 'left right'"),
    "missing byte": (lambda t, k, m: (["x"] + t[1:], k, m, {}), "lacks 1 single-byte token(s), e.g. byte 0x00"),
    "not byte form": (lambda t, k, m: (t + ["a b"], k + [TokenType.NORMAL], m, {}),
                      "tokenizer.ggml.tokens[257] = 'a b' is not in GPT-2 byte-to-unicode form"),
    "bad token type": (lambda t, k, m: (t, k[:-1] + [9], m, {}), "tokenizer.ggml.token_type[256] is 9"),
    "eos out of range": (lambda t, k, m: (t, k, m, {"eos_id": 500}), "eos_token_id 500 is outside the 257 tokens"),
    "add_bos without bos": (lambda t, k, m: (t, k, m, {"add_bos": True}),
                            "tokenizer.ggml.add_bos_token is true but the GGUF has no tokenizer.ggml.bos_token_id"),
}


@pytest.mark.parametrize("case", sorted(BAD_METADATA))
def test_bad_metadata_is_one_clear_line(case: str) -> None:
    make, message = BAD_METADATA[case]
    tokens, types, merges, kwargs = make(*_tiny_vocab())
    with pytest.raises(GGUFError) as err:
        BPETokenizer(tokens, types, merges, **kwargs)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("model, message", [(None, "GGUF has no tokenizer.ggml.model"),
                                            ("llama", "tokenizer.ggml.model is 'llama', expected 'gpt2'")])
def test_gguf_without_a_bpe_vocabulary(tmp_path: Path, model: str | None, message: str) -> None:
    path = tmp_path / "v.gguf"
    writer = GGUFWriter(path, "kimi-k3")
    if model is not None:
        writer.add_tokenizer_model(model)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(GGUFError, match=message):
        BPETokenizer.from_gguf(path)
