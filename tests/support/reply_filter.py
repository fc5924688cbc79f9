"""What a chat reply's text was before the runtime told its channels apart (and what
reasoning_format none still gives): every token's text but special tokens and K3's tag names and
attributes. The tests compare the runners' plain replies with it."""
from __future__ import annotations

from gguf_arch.arch import xtml
from ggml_graph_spec.text.tokenizer import BPETokenizer


class ReplyFilter:
    """Which tokens of a chat reply are shown: no special tokens, no XTML tag names or attributes."""

    def __init__(self, tokenizer: BPETokenizer) -> None:
        self._tokenizer = tokenizer
        self._starts = {i for i in map(tokenizer.special_id, (xtml.OPEN, xtml.CLOSE)) if i is not None}
        self._end = tokenizer.special_id(xtml.SEP)
        self._in_tag = False

    def __call__(self, token: int) -> bool:
        if token in self._starts:
            self._in_tag = True
        elif token == self._end:
            self._in_tag = False
            return False
        return not (self._in_tag or self._tokenizer.is_special(token))
