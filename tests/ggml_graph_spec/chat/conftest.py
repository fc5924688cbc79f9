"""The tiny model's tokenizer (K3's markers as special tokens) for the agent modules' tests."""
from __future__ import annotations

import pytest

from ggml_graph_spec.text.tokenizer import BPETokenizer


@pytest.fixture(scope="session")
def tok(k31pro_tiny_gguf) -> BPETokenizer:
    return BPETokenizer.from_gguf(k31pro_tiny_gguf)
