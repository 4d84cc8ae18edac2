"""Quantized weights: the affine code form, GGUF's block layouts, and how a model keeps them packed."""
