"""The model summary every runner prints at start (llama.cpp's `print_info` lines, on stderr)."""
from __future__ import annotations

from collections import Counter

import ggml

from gguf_arch.io.console import human_size

from ..backends.streaming.executor import StreamingExecutor
from ..engine.model import Model


def cache_rows(model: Model) -> list[tuple[str, str]]:
    """Each cache's bytes (ggml's own sizes, which equal graph/cache.py's cache_sizes formula) with
    the factors they are made of, and the total; then the bytes per token of context."""
    c, cfg, n_seq, n_ctx = model.cache, model.cfg, model.n_seq, model.n_ctx
    sizes, per_token, kda = c.sizes(), c.bytes_per_token(), cfg.kda
    seqs = f"{n_seq} seq x {n_ctx} tokens"
    rows = [("cache latent", f"{c.latent_type_name}: {len(cfg.mla_layers)} MLA layer(s) x {seqs} x "
                             f"{per_token['latent'] // max(1, len(cfg.mla_layers))} B = {_bytes(sizes.latent)}")]
    if c.with_indexer:
        n_dsa = len(cfg.indexer.layers)
        rows.append(("cache indexer", f"{c.indexer_type_name}: {n_dsa} DSA layer(s) x {seqs} x "
                                      f"{per_token['indexer'] // n_dsa} B = {_bytes(sizes.indexer)}"))
    rows.append(("cache KDA", f"f32: {len(kda.layers)} KDA layer(s) x {n_seq} seq, conv {_bytes(sizes.kda_conv)}, "
                              f"recurrent {_bytes(sizes.kda_state)}"))
    rows.append(("caches", f"{_bytes(sizes.total)} in all; {human_size(sum(per_token.values()))} per token of "
                           f"context, {human_size(c.bytes_per_sequence())} per sequence"))
    return rows


def _bytes(n: int) -> str:
    return f"{n} bytes ({human_size(n)})"


def summary(model: Model) -> list[str]:
    """llama.cpp-style `print_info` lines about the loaded model (after the overrides)."""
    cfg, w, tokenizer, overrides = model.cfg, model.weights, model.tokenizer, model.options.overrides
    types = Counter(ggml.ggml_type_name(t.contents.type).decode() for t in w.tensors.values())
    dsa = "none (plain kimi-k3)"
    if cfg.indexer is not None:
        state = f"on, top_k {model.top_k}, {model.dsa_path}" if model.top_k is not None else "off: dense MLA"
        dsa = f"{list(cfg.indexer.layers)} ({state})"
    rows = [
        ("file", f"{w.path}"),
        ("arch", w.metadata.get("general.architecture", "?")),
        ("name", w.metadata.get("general.name", "?")),
        ("n_layer", f"{cfg.num_layers} ({len(cfg.kda.layers)} KDA, {len(cfg.mla_layers)} MLA)"),
        ("DSA layers", dsa),
        ("n_embd", cfg.hidden_size),
        ("n_vocab", cfg.vocab_size),
        ("n_expert", f"{cfg.num_experts} ({cfg.num_experts_used} used, {cfg.num_shared_experts} shared, "
                     f"{cfg.first_k_dense_replace} dense layer(s) first)"),
        ("n_ctx", f"{model.n_ctx} (train {cfg.context_length})" + (
            f" per sequence, {model.n_seq} sequences" if model.n_seq > 1 else "")),
        ("tensor types", ", ".join(f"{n} {k}" for k, n in sorted(types.items()))),
        ("path", "exact (F32 activations, F32 caches)" if model.exact else "fast (as llama.cpp: quantized "
                 f"activations for quantized weights, {model.cache.latent_type_name.upper()} latent cache)"),
        ("ggml CPU", f"llamafile sgemm {'on' if ggml.ggml_cpu_has_llamafile() else 'off (slower prompt batches)'}; "
                     + (f"{len(w.repacked)} expert tensors repacked ({human_size(w.repacked_bytes)})"
                        if w.repacked else "weights mapped from the file, none repacked")
                     + (f" ({w.repack_why})" if w.repack_why else "")),
        ("BOS / EOS", f"{tokenizer.bos_id} / {tokenizer.eos_id} (add BOS: {str(tokenizer.add_bos).lower()})"),
    ]
    rows += cache_rows(model)
    if model.devices is not None:
        rows += model.devices.summary(model.cache, model.executor)
    if isinstance(model.executor, StreamingExecutor):
        rows += model.executor.summary()
    rows += [("override", f"{k} = {v!r}") for k, v in overrides.items()] + [("note", n) for n in w.notes]
    return [f"print_info: {k:<16} = {v}" for k, v in rows]
