"""Kimi K3 / K3.1-Pro on a ggml graph built from Python: GGUF loader, block builders, caches, Model."""
