"""A GGUF tensor name's layer and kind, as the runner's streaming and the dry-run listing read
them (gguf_layer, gguf_kind): every per-layer template of the table, filled for a layer, gives
that layer and its kind back; a global, or a name that only looks like a layer's, has no kind."""
from __future__ import annotations

import pytest

from gguf_arch.arch import tensors as T
from gguf_arch.arch.tensors import gguf_kind, gguf_layer, layer_name

TEMPLATES = sorted({v for v in vars(T).values() if isinstance(v, str) and v.startswith(T.LAYER) and v != T.LAYER})


@pytest.mark.parametrize("template", TEMPLATES)
def test_a_layer_tensor_gives_its_layer_and_kind(template):
    kind = template[len(T.LAYER):].split(".", 1)[0]
    for layer in (0, 7, 92):
        name = layer_name(template, layer)
        assert (gguf_layer(name), gguf_kind(name)) == (layer, kind)


@pytest.mark.parametrize("name, layer", [("token_embd.weight", None), ("output.weight", None),
                                         ("blk.x.ffn_gate_exps.weight", None), ("blk", None), ("blk.7", 7)])
def test_a_global_or_a_name_without_a_kind_has_none(name, layer):
    assert (gguf_layer(name), gguf_kind(name)) == (layer, "")
