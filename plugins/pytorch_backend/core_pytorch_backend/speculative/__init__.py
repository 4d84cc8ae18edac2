"""Speculative decoding in the pytorch backend: proposals each step, verification in the same forward pass
as every other row (decoder.py)."""

from core_pytorch_backend.speculative.decoder import SpeculativeDecoder, make_speculative_decoder

__all__ = ["SpeculativeDecoder", "make_speculative_decoder"]
