"""Loading an mmproj: everything checked against the tables before ggml sees a byte; a text GGUF,
another model's mmproj or a damaged one is one GGUFError line."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as T

import convert_kimi_k3
from gguf_arch.errors import GGUFError
from ggml_graph_spec.vision.encode import VisionEncoder, encode_images
from ggml_graph_spec.vision.weights import check_pairing, load_mmproj

from tests.support.gguf_edit import rewritten_copy, tensor_info

from .conftest import files, rel


def _refused(path, *needles: str) -> None:
    with pytest.raises(GGUFError) as exc:
        load_mmproj(path)
    message = str(exc.value)
    assert "\n" not in message and str(path) in message
    for needle in needles:
        assert needle in message, message


def test_a_text_gguf_or_another_models_mmproj_is_refused(tmp_path, k31pro_tiny_gguf, k31pro_tiny_mmproj):
    _refused(k31pro_tiny_gguf, "not a Kimi K3 mmproj", "general.architecture 'kimi-k3'")
    k25 = rewritten_copy(k31pro_tiny_mmproj, tmp_path / "k25.gguf", keys={"clip.projector_type": ("kimik25", T.STRING)})
    _refused(k25, "not a Kimi K3 mmproj", "clip.projector_type 'kimik25'", "expected 'clip' and 'kimik3'")


@pytest.mark.parametrize("edit, needles", [
    (dict(replace={"v.blk.1.ffn_down.weight": None}), ("missing tensor 'v.blk.1.ffn_down.weight'",)),
    (dict(extra={"v.blk.0.attn_qkv.bias": np.zeros(96, np.float32)}), ("not in the kimik3 mmproj table",)),
    (dict(keys={"clip.vision.block_count": (3, T.UINT32)}), ("missing tensor 'v.blk.2.attn_qkv.weight'",)),
    (dict(keys={"clip.vision.attention.head_dim": (10, T.UINT32)}), ("qkv_hidden_size (20) must be",)),
    (dict(keys={"clip.vision.attention.head_dim": (12, T.UINT32)}), ("has ggml ne [32, 96], expected [32, 72]",)),
    (dict(keys={"clip.vision.image_max_pixels": (1000, T.UINT32)}), ("whole number of 4x4 patches",)),
    (dict(keys={"clip.vision.kimik3.pos_emb_interpolation": ("bicubic", T.STRING)}),
     ("pos_emb_interpolation is 'bicubic', expected 'bilinear'",)),
    (dict(keys={"vision.pos_emb_time": None}), ("missing metadata key 'vision.pos_emb_time'",)),
])
def test_inconsistent_mmprojs_are_refused(tmp_path, k31pro_tiny_mmproj, edit, needles):
    _refused(rewritten_copy(k31pro_tiny_mmproj, tmp_path / "bad.gguf", **edit), *needles)


def test_wrong_types_and_shapes_are_refused(tmp_path, k31pro_tiny_mmproj):
    norm = tensor_info(k31pro_tiny_mmproj, "v.blk.0.ln1.weight")
    f16 = rewritten_copy(k31pro_tiny_mmproj, tmp_path / "f16.gguf",
                         replace={norm.name: (np.asarray(norm.data).astype(np.float16), Q.F16)})
    _refused(f16, "'v.blk.0.ln1.weight' has type F16, expected F32")
    up = tensor_info(k31pro_tiny_mmproj, "v.blk.0.ffn_up.weight")
    flipped = np.asarray(up.data).reshape(32, 128)  # the bytes of [64 rows of 32 values] as 32 rows of 64
    shaped = rewritten_copy(k31pro_tiny_mmproj, tmp_path / "shape.gguf", replace={up.name: (flipped, Q.BF16)})
    _refused(shaped, "'v.blk.0.ffn_up.weight' has ggml ne [64, 32], expected [32, 64]")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(k31pro_tiny_mmproj.read_bytes()[:-1000])
    _refused(cut, "cut.gguf")


def test_a_split_or_quantized_mmproj_loads(tmp_path, k31pro_tiny_dir, k31pro_tiny_mmproj, ref):
    """Every type the converter writes loads; the split parts read as one file."""
    one = encode_images(k31pro_tiny_mmproj, [files("img_32x32")], threads=1)[0]
    split = tmp_path / "split.gguf"
    assert convert_kimi_k3.main([str(k31pro_tiny_dir), "--mmproj", str(split), "--mmproj-only", "--quiet",
                                 "--split-max-tensors", "7"]) == 0
    assert np.array_equal(encode_images(tmp_path / "split-00001-of-00003.gguf", [files("img_32x32")], threads=1)[0], one)
    q8 = tmp_path / "q8.gguf"
    assert convert_kimi_k3.main([str(k31pro_tiny_dir), "--mmproj", str(q8), "--mmproj-only", "--quiet",
                                 "--mmproj-tensor-type", "(ffn_|mm\\.)=q8_0"]) == 0
    with VisionEncoder.open(q8, threads=1) as enc:
        assert {enc.weights.tensors[n].contents.type for n in ("mm.1.weight", "v.blk.0.ffn_up.weight")} == {0}
        rows = enc.encode(enc.media(files("img_32x32")))
    assert 0 < rel(rows, ref["img_32x32/image_features"]) < 2.0 ** -6  # Q8_0's rounding, dequantized exactly


def test_the_pairing_with_a_text_model_is_checked(exact_encoder):
    """For the runner: an mmproj whose rows or placeholder are not the text model's is refused."""
    cfg = exact_encoder.cfg
    check_pairing(cfg, "mm.gguf", 64, 677)  # k31pro-tiny's own text model
    with pytest.raises(GGUFError, match="rows are 64 wide .* embeddings 7168: an mmproj of another model"):
        check_pairing(cfg, "mm.gguf", 7168, 677)
    with pytest.raises(GGUFError, match="placeholder token is 677, the text model's <.media_pad.> is None"):
        check_pairing(cfg, "mm.gguf", 64, None)
