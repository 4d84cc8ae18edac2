"""The pytorch backend's factory: an encoder checkpoint gets the pooling-only backend, anything else
the generating one (what `core serve --backend pytorch` builds)."""

from __future__ import annotations

from core.backend import Backend
from core.config import EngineConfig


def make_backend(config: EngineConfig) -> Backend:
    """PytorchEncoderBackend for a BERT-family folder, else PytorchBackend."""
    from core_pytorch_backend.backend import PytorchBackend, architectures_for
    from core_pytorch_backend.encoder_backend import PytorchEncoderBackend, is_encoder_checkpoint

    architectures = architectures_for(PytorchBackend.name)
    if is_encoder_checkpoint(str(config.model) if config.model else None, architectures):
        return PytorchEncoderBackend(config, architectures=architectures)
    return PytorchBackend(config, architectures=architectures)
