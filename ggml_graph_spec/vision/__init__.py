"""Kimi K3's vision tower (MoonViT) and projector on the ggml graph: images read and preprocessed as
Moonshot's processor does (`preprocess`), the mmproj GGUF loaded (`weights`), the tower built and
run (`tower`, `encode`), and the prompt's media markers expanded (`prompt`)."""
