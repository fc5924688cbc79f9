"""Output types for the converter: the protected set (protected.json), llama-quantize-style
per-tensor rules, gguf-py quantization in bounded row batches, and the llama-quantize export."""
