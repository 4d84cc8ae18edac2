"""The cache folder rule that core's plugins share (core/cache_folder.py)."""

from pathlib import Path

from core.cache_folder import CACHE_VARIABLE, cache_folder


def test_cache_folder_follows_the_variable_at_each_call(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_VARIABLE, str(tmp_path))
    assert cache_folder("cpu") == tmp_path / "cpu"
    monkeypatch.setenv(CACHE_VARIABLE, str(tmp_path / "other"))
    assert cache_folder("gguf") == tmp_path / "other" / "gguf"
    assert not (tmp_path / "other").exists()  # named, not created


def test_cache_folder_defaults_to_the_home_cache(monkeypatch, tmp_path):
    monkeypatch.delenv(CACHE_VARIABLE, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_folder("cuda") == tmp_path / ".cache" / "core" / "cuda"
    monkeypatch.setenv(CACHE_VARIABLE, "")  # empty: as unset
    assert cache_folder("cuda") == Path(tmp_path) / ".cache" / "core" / "cuda"


def test_the_plugins_use_the_shared_rule(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_VARIABLE, str(tmp_path))
    from core_cuda_backend import build as cuda_build
    from core_pytorch_backend import loader
    from core_pytorch_backend.native import build

    assert build.cache_dir() == tmp_path / "cpu"
    assert cuda_build.cache_dir() == tmp_path / "cuda"
    assert loader.default_cache_dir() == tmp_path / "gguf"
