"""Vision processors for core, one module per model family over a shared Hugging Face base."""
