"""One typed builder per Kimi K3 block, side by side with docs/reference/forward.md: `kda` (KDA), `mla`
(MLA, llama.cpp's graph) with `dsa` (the K3.1-Pro indexer, docs/reference/dsa.md), `attn_res` (AttnRes),
`moe` (LatentMoE) and `ffn` (SiTU, Output head).

Each builder takes the `GraphBuild` `g`, for per-layer blocks the layer's weights `w`
(`loader.LayerWeights`, names from the tensor table), and F32 activations ne = [width, T].
"""
