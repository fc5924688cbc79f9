"""llama.cpp's tokenizer on our GGUFs gives the ids ours and tiktoken give, on multilingual text."""
from __future__ import annotations

import pytest
import tiktoken
from gguf import GGUFReader, GGUFValueType, GGUFWriter, TokenType

from gguf_arch.arch.keys import ARCH
from gguf_arch.arch.tokenizer import KIMI_K2_PATTERN, bytes_to_token_text, recover_merges
from ggml_graph_spec.text.tokenizer import BPETokenizer
from tests.support.bpe import kimi_bpe, multilingual_corpus
from tests.ggml_graph_spec.test_tokenizer import MULTILINGUAL, fixture_encoding

from .conftest import llama_run, requires_llama_cpp

pytestmark = requires_llama_cpp

TEXT = "[BOS]" + MULTILINGUAL + "<|end_of_msg|><|open|>x"
SPECIALS = ("[BOS]", "<|end_of_msg|>", "<|open|>")


def _llama_tokens(gguf, tmp_path) -> tuple[list[int], bytes]:
    """llama.cpp's ids for TEXT (specials parsed, no BOS added) and its detokenization of them."""
    [ids] = llama_run(gguf, [("tokenize", TEXT)], tmp_path, vocab_only=True)
    [back] = llama_run(gguf, [("detokenize", ids)], tmp_path, vocab_only=True)
    return ids, back


def test_fixture_gguf_tokenizes_like_ours_and_tiktoken(tmp_path, k3_tiny_gguf, k3_tiny_dir):
    theirs, back = _llama_tokens(k3_tiny_gguf, tmp_path)
    ours = BPETokenizer.from_gguf(k3_tiny_gguf).encode(TEXT, add_bos=False)
    assert theirs == ours == fixture_encoding(k3_tiny_dir).encode(TEXT, allowed_special="all")
    assert back == TEXT.encode("utf-8")


@pytest.fixture(scope="module")
def multilingual_vocab(tmp_path_factory, k3_tiny_gguf) -> tuple:
    """A vocabulary-only kimi-k3 GGUF whose 3000 merges were learned on seven scripts (the
    fixture's 400 merges are English only, so there CJK text is mostly single bytes)."""
    ranks = kimi_bpe(multilingual_corpus(12000), 3000)
    specials = {name: len(ranks) + i for i, name in enumerate(SPECIALS)}
    path = tmp_path_factory.mktemp("vocab") / "multilingual-vocab.gguf"
    w = GGUFWriter(path, ARCH)
    for key, field in GGUFReader(k3_tiny_gguf).fields.items():  # the model keys, not its tensors
        if key.startswith(("GGUF.", "tokenizer.", "general.architecture")):
            continue
        if field.types[0] == GGUFValueType.ARRAY:
            w.add_array(key, field.contents())
        else:
            w.add_key_value(key, field.contents(), field.types[0])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("kimi-k2")
    w.add_token_list([bytes_to_token_text(r) for r in ranks] + list(specials))
    w.add_token_types([TokenType.NORMAL] * len(ranks) + [TokenType.CONTROL] * len(specials))
    w.add_token_merges([f"{bytes_to_token_text(a)} {bytes_to_token_text(b)}" for a, b in recover_merges(ranks)])
    w.add_bos_token_id(specials["[BOS]"])
    w.add_eos_token_id(specials["<|end_of_msg|>"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    enc = tiktoken.Encoding("multilingual", pat_str=KIMI_K2_PATTERN,
                            mergeable_ranks={r: i for i, r in enumerate(ranks)}, special_tokens=specials)
    return path, enc


def test_multilingual_vocab_tokenizes_like_ours_and_tiktoken(tmp_path, multilingual_vocab):
    path, enc = multilingual_vocab
    theirs, back = _llama_tokens(path, tmp_path)
    ours = BPETokenizer.from_gguf(path).encode(TEXT, add_bos=False)
    assert theirs == ours == enc.encode(TEXT, allowed_special="all")
    assert len(theirs) < 0.8 * len(TEXT.encode("utf-8"))  # the merges did apply across scripts
    assert back == TEXT.encode("utf-8")
