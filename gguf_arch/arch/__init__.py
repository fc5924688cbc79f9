"""What Kimi K3 / K3.1-Pro is, as data: the config reader, the GGUF key table, the tensor table,
the transforms between checkpoint and GGUF tensors, MXFP4 and the tokenizer."""
