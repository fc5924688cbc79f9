"""The GGML types llama.cpp's `llama-quantize` writes that this project also runs.

`kimi-k3-quantize` (quant_rules/llama_quantize.py) offers exactly these, and the graph's loader
(ggml_graph_spec/loader.py) accepts them for the routed experts and the trunk's matrices: ggml
0.15.3's CPU backend (ggml-python 0.0.45) has get_rows and mul_mat_id for each of them
(tests/quant_rules/test_llama_types.py checks both against gguf-py's dequantization).
Types llama.cpp 0.25.3 has and ggml 0.15.3 lacks (Q1_0, Q2_0) are not offered, and the ternary
TQ1_0/TQ2_0 are left out: they are meant for models trained ternary, not for requantizing.
"""
from __future__ import annotations

from gguf import GGMLQuantizationType as Q

# Widest first: the order kimi-k3-quantize lists them in.
LLAMA_QUANTIZE_TYPES: tuple[Q, ...] = (
    Q.Q8_0, Q.Q6_K, Q.Q5_K, Q.Q5_1, Q.Q5_0, Q.Q4_K, Q.Q4_1, Q.Q4_0, Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4,
    Q.Q3_K, Q.IQ3_S, Q.IQ3_XXS, Q.Q2_K, Q.IQ2_S, Q.IQ2_XS, Q.IQ2_XXS, Q.IQ1_M, Q.IQ1_S,
)

# llama-quantize refuses these without an importance matrix (tensor_requires_imatrix in
# src/llama-quant.cpp of llama.cpp 0.25.3: "Missing importance matrix for tensor ... in a very
# low-bit quantization").
NEEDS_IMATRIX: frozenset[Q] = frozenset({Q.IQ3_XXS, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ1_M, Q.IQ1_S})
