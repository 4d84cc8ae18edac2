"""Fixtures for the vision-processor tests: tiny checkpoints (built once per session) and test images."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest


def _load_builders():
    """vl_checkpoints.py sits next to this file; load it by path (pytest may not put this folder on
    sys.path, e.g. when run from the repository root or with --import-mode=importlib)."""
    path = Path(__file__).with_name("vl_checkpoints.py")
    spec = importlib.util.spec_from_file_location("core_vl_models_test_checkpoints", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


vl_checkpoints = _load_builders()


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory):
    """Build (once) and return the tiny checkpoint folder of an architecture."""
    built: dict = {}

    def get(architecture: str):
        if architecture not in built:
            builder = vl_checkpoints.BUILDERS.get(architecture)
            if builder is None:
                pytest.skip(vl_checkpoints.SKIPPED.get(architecture, f"no tiny checkpoint for {architecture}"))
            built[architecture] = builder(tmp_path_factory.mktemp(architecture))
        return built[architecture]

    return get


@pytest.fixture(scope="session")
def images():
    """Three deterministic RGB images: two different, one a pixel-equal copy of the first."""
    from PIL import Image

    def pattern(seed: int, size: tuple[int, int]) -> Image.Image:
        import random

        rng = random.Random(seed)
        image = Image.new("RGB", size)
        image.putdata([(rng.randrange(256), rng.randrange(256), rng.randrange(256))
                       for _ in range(size[0] * size[1])])
        return image

    first = pattern(1, (80, 60))
    return {"a": first, "b": pattern(2, (64, 96)), "a_copy": first.copy()}
