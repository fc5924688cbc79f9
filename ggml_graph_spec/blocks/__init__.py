"""One typed builder per Kimi K3 block, side by side with k3-spec D: `kda` (D.2), `mla` (D.3,
E.5) with `dsa` (the K3.1-Pro indexer), `attn_res` (D.4), `moe` (D.6) and `ffn` (D.5, D.7).

Each builder takes the `GraphBuild` `g`, for per-layer blocks the layer's weights `w`
(`loader.LayerWeights`, names from the tensor table), and F32 activations ne = [width, T].
"""
