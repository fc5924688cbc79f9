"""Running a GGUF bigger than the memory budget: the budget's plan and the layer streamer."""
