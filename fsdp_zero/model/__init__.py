"""What is trained: construction, the built-in transformer, tasks, initialisation, LoRA, Hugging Face in."""
