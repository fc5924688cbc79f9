"""The GGML types llama.cpp's `llama-quantize` writes that this project offers for the routed experts.

`kimi-k3-quantize` (quant_rules/llama_quantize.py) offers exactly these, and the graph's loader
(ggml_graph_spec/loader.py) accepts them for the routed experts and the trunk's matrices: ggml
0.15.3's CPU backend (ggml-python 0.0.45) has get_rows and mul_mat_id for each of them
(tests/quant_rules/test_llama_types.py), and bench/tiers.py measures every one of them on a
generated model (tests/interop/test_tiers.py runs each tier in the graph and in llama-cli).
Left out: the legacy Q4_0/Q4_1/Q5_0/Q5_1 (the K-quants of the same size are better), the 1-bit
IQ1_S/IQ1_M (ggml builds their 2048-entry grids for 10-40 s per process here, and at 1.6-1.8
bits the requantized MXFP4 weights keep little), the ternary TQ1_0/TQ2_0 (for models trained
ternary), and the types llama.cpp 0.25.3 has but ggml 0.15.3 lacks (Q1_0, Q2_0).
"""
from __future__ import annotations

from gguf import GGMLQuantizationType as Q

# Widest first: the order kimi-k3-quantize lists them in.
LLAMA_QUANTIZE_TYPES: tuple[Q, ...] = (
    Q.Q8_0, Q.Q6_K, Q.Q5_K, Q.Q4_K, Q.IQ4_XS, Q.Q3_K, Q.IQ3_S, Q.IQ3_XXS, Q.Q2_K, Q.IQ2_S, Q.IQ2_XS, Q.IQ2_XXS,
)

# llama-quantize refuses these without an importance matrix (tensor_requires_imatrix in
# src/llama-quant.cpp of llama.cpp 0.25.3: "Missing importance matrix for tensor ... in a very
# low-bit quantization").
NEEDS_IMATRIX: frozenset[Q] = frozenset({Q.IQ3_XXS, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ1_M, Q.IQ1_S})
