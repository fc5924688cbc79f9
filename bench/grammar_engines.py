"""llguidance and xgrammar behind one small interface, for bench/grammar_libs.py.

Each engine is built from the runtime's tokenizer (`BPETokenizer`: token_bytes, is_special), the
way the server would build it, compiles the grammars of bench/grammar_specs.py, and makes matchers
that fill a numpy int32 bitmask (bit i of word i // 32 set: token i allowed), consume a token, roll
back and say whether the output may end there.
"""
from __future__ import annotations

import importlib
import json
from typing import Any, Protocol

import numpy as np

from bench import grammar_specs as gs

LLG_SPECIAL = b"\xff"  # llguidance reads a token whose bytes start with 0xFF as a special token
FF_STANDIN = b"\xfe"  # for a normal token starting with 0xFF: also never UTF-8, so no grammar can tell


class Tokenizer(Protocol):
    """What the engines need of the runtime's tokenizer (ggml_graph_spec/text/tokenizer.py)."""

    vocab_size: int
    eos_id: int | None

    def token_bytes(self, token_id: int) -> bytes: ...
    def is_special(self, token_id: int) -> bool: ...
    def encode(self, text: str, *, add_bos: bool | None = None, allow_special: bool = True) -> list[int]: ...


def require(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise SystemExit(f"error: {module} is not installed in this Python ({e}); "
                         "see docs/bench/grammar_libs.md for the venv") from None


class Matcher(Protocol):
    def fill(self, bitmask: np.ndarray) -> None: ...
    def consume(self, token: int) -> bool: ...
    def rollback(self, n: int) -> None: ...
    def accepting(self) -> bool: ...


# ---- llguidance ---------------------------------------------------------------------------------

class _LLGVocabulary:
    """What llguidance.TokenizerWrapper reads: tokens as bytes, special ones behind 0xFF."""

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok
        self.tokens = [self._entry(i) for i in range(tok.vocab_size)]
        self.eos_token_id = tok.eos_id
        self.bos_token_id = None
        self.special_token_ids = [i for i in range(tok.vocab_size) if tok.is_special(i)]

    def _entry(self, i: int) -> bytes:
        raw = self._tok.token_bytes(i)
        if self._tok.is_special(i):
            return LLG_SPECIAL + raw
        if raw[:1] == LLG_SPECIAL and len(raw) > 1:  # not a marker: llguidance would take it for one
            return FF_STANDIN + raw[1:]
        return raw

    def __call__(self, text: bytes) -> list[int]:
        # Text is text: a marker spelled in it stays ordinary tokens, as the grammar must see it.
        return self._tok.encode(text.decode("utf-8", errors="replace"), add_bos=False, allow_special=False)


class _LLGMatcher:
    def __init__(self, llg_numpy: Any, matcher: Any) -> None:
        self._np, self.m = llg_numpy, matcher

    def fill(self, bitmask: np.ndarray) -> None:
        self._np.fill_next_token_bitmask(self.m, bitmask, 0)

    def consume(self, token: int) -> bool:
        return self.m.consume_token(token)

    def rollback(self, n: int) -> None:
        if not self.m.rollback(n):
            raise RuntimeError(f"llguidance could not roll back {n} tokens: {self.m.get_error()[:200]}")

    def accepting(self) -> bool:
        return self.m.is_accepting()


class LLGuidance:
    name = "llguidance"
    distribution = "llguidance"

    def __init__(self, tok: Tokenizer) -> None:
        self.llg = require("llguidance")
        self.np = require("llguidance.numpy")
        self.version = self.llg.__version__
        self.tokenizer = self.llg.LLTokenizer(self.llg.TokenizerWrapper(_LLGVocabulary(tok)))

    def check_specials(self, tok: Tokenizer) -> dict:
        """What llguidance counts as special: the runtime's special tokens, and besides them only
        the lone byte 0xFF (a byte-level vocabulary's token 255, which no UTF-8 text holds)."""
        special = [i for i in range(tok.vocab_size) if self.tokenizer.is_special_token(i)]
        extra = [i for i in special if not tok.is_special(i)]
        if any(tok.token_bytes(i) != LLG_SPECIAL for i in extra) or len(special) - len(extra) != \
                sum(tok.is_special(i) for i in range(tok.vocab_size)):
            raise SystemExit(f"error: llguidance's special tokens differ from the runtime's: {extra[:8]} ...")
        return {"count": len(special), "not_special_in_the_runtime": extra}

    def grammars(self, lark: dict[str, str], tools: list[gs.Tool]) -> dict[str, str]:
        """Grammar name -> llguidance's grammar text (compiled by `compile`)."""
        g = self.llg.LLMatcher
        return {"json": g.grammar_from_json_schema(json.dumps(gs.JSON_SCHEMA)),
                **{name: g.grammar_from_lark(text) for name, text in lark.items()}}

    def compile(self, grammar: str) -> Any:
        m = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise RuntimeError(f"llguidance refused the grammar: {m.get_error()[:300]}")
        return m

    def compile_cached(self, grammar: str, compiled: Any) -> Any:
        """llguidance keeps no compile cache: a server keeps the compiled matcher and copies it."""
        return compiled.deep_copy()

    def matcher(self, compiled: Any) -> _LLGMatcher:
        return _LLGMatcher(self.np, compiled.deep_copy())

    def apply(self, logits: np.ndarray, bitmask: np.ndarray) -> None:
        self.np.apply_token_bitmask_inplace(logits, bitmask)


# ---- xgrammar -----------------------------------------------------------------------------------

class _XGRMatcher:
    def __init__(self, matcher: Any) -> None:
        self.m = matcher

    def fill(self, bitmask: np.ndarray) -> None:
        self.m.fill_next_token_bitmask(bitmask, 0)

    def consume(self, token: int) -> bool:
        return self.m.accept_token(token)

    def rollback(self, n: int) -> None:
        self.m.rollback(n)

    def accepting(self) -> bool:
        return self.m.is_completed() or self.m.is_terminated()


class XGrammar:
    name = "xgrammar"
    distribution = "xgrammar"

    def __init__(self, tok: Tokenizer, threads: int) -> None:
        self.xgr = require("xgrammar")
        self.torch = require("torch")
        self.version = self.xgr.__version__ if hasattr(self.xgr, "__version__") else _dist_version("xgrammar")
        # RAW: the bytes as they are. A special token keeps its text: given as b"" xgrammar would
        # never accept it, not even where the grammar names it.
        vocab = [tok.token_bytes(i) for i in range(tok.vocab_size)]
        self.info = self.xgr.TokenizerInfo(vocab, self.xgr.VocabType.RAW, vocab_size=tok.vocab_size,
                                           stop_token_ids=[tok.eos_id])
        self.threads = threads
        self.compiler = self.xgr.GrammarCompiler(self.info, max_threads=threads)

    def dynamic(self) -> "XGrammar":
        """The same tokenizer with a compiler that builds its token masks on first use instead of
        while compiling (`enable_dynamic_compilation`): xgrammar's answer to slow compiles."""
        other = object.__new__(XGrammar)
        other.__dict__.update(self.__dict__)
        other.name = "xgrammar dynamic"
        other.compiler = self.xgr.GrammarCompiler(self.info, max_threads=self.threads, enable_dynamic_compilation=True)
        return other

    def grammars(self, lark: dict[str, str], tools: list[gs.Tool]) -> dict[str, Any]:
        """Grammar name -> what `compile` compiles: the JSON schema, the shared Lark, and
        xgrammar's own way of writing K3 (structural tags, markers as strings)."""
        return {"json": ("json", json.dumps(gs.JSON_SCHEMA)), **{name: ("lark", text) for name, text in lark.items()},
                "tools (structural tag)": ("tag", self._tools_tag(tools)), "think (structural tag)": ("tag", self._think_tag())}

    def _tools_tag(self, tools: list[gs.Tool]) -> Any:
        st = self.xgr.structural_tag
        calls = [st.TagFormat(begin=f'{gs.OPEN}call tool="{t.name}" index="', end=f"{gs.CLOSE}call{gs.SEP}",
                              content=st.SequenceFormat(elements=[
                                  st.RegexFormat(pattern=r"[1-9][0-9]{0,2}"), st.ConstStringFormat(value=f'"{gs.SEP}'),
                                  st.JSONSchemaFormat(json_schema=t.parameters, style="kimi_k3_xml",
                                                      excludes=list(gs.MARKERS))]))
                 for t in tools]
        return st.StructuralTag(format=st.TagFormat(
            begin=f"{gs.OPEN}tools{gs.SEP}", end=f"{gs.CLOSE}tools{gs.SEP}",
            content=st.TagsWithSeparatorFormat(tags=calls, separator="", at_least_one=True)))

    def _think_tag(self) -> Any:
        st = self.xgr.structural_tag
        return st.StructuralTag(format=st.TagFormat(begin="", content=st.AnyTextFormat(excludes=list(gs.MARKERS)),
                                                    end=f"{gs.CLOSE}think{gs.SEP}"))

    def compile(self, grammar: tuple[str, Any]) -> Any:
        self.compiler.clear_cache()
        return self.compile_cached(grammar, None)

    def compile_cached(self, grammar: tuple[str, Any], compiled: Any) -> Any:
        kind, body = grammar
        if kind == "json":
            return self.compiler.compile_json_schema(body)
        if kind == "tag":
            return self.compiler.compile_structural_tag(body)
        return self.compiler.compile_grammar(self.xgr.Grammar.from_lark(body, tokenizer_info=self.info))

    def matcher(self, compiled: Any) -> _XGRMatcher:
        return _XGRMatcher(self.xgr.GrammarMatcher(compiled))

    def apply(self, logits: np.ndarray, bitmask: np.ndarray) -> None:
        self.xgr.apply_token_bitmask_inplace(self.torch.from_numpy(logits), self.torch.from_numpy(bitmask))


def _dist_version(name: str) -> str:
    from importlib.metadata import version
    return version(name)
