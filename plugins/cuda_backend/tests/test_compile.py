"""The kernels compile with nvcc for sm_80 and sm_90 (no GPU needed), the C ABI matches the ctypes
bindings, the library's host-side argument checks answer with clear statuses, and the build cache and
its errors behave. Skipped only where nvcc is missing (CI has it)."""

from __future__ import annotations

import re
import shutil

import pytest

from core_cuda_backend import build
from core_cuda_backend.availability import find_nvcc
from core_cuda_backend.library import SIGNATURES, CudaKernelError, KernelLibrary

needs_nvcc = pytest.mark.skipif(find_nvcc() is None, reason="nvcc is not installed (set CUDA_HOME or PATH)")
EXPORT = re.compile(r"CORE_EXPORT\s+[\w\s\*]+?\b(core_\w+)\(([^)]*)\)", re.S)
KERNEL_FILES = {"store_kv_cache", "paged_decode_attention", "paged_prefill_attention", "rms_norm", "rotary",
                "silu_and_mul", "sampling"}


def exported_functions() -> dict[str, int]:
    """Every ``CORE_EXPORT`` function of csrc/ and its parameter count."""
    found = {}
    for source in build.sources():
        for name, params in EXPORT.findall(source.read_text()):
            found[name] = 0 if not params.strip() or params.strip() == "void" else params.count(",") + 1
    return found


def test_one_source_file_per_kernel():
    assert KERNEL_FILES <= {path.stem for path in build.sources()}


def test_bindings_match_the_c_abi():
    exported = exported_functions()
    for name, argtypes in SIGNATURES.items():
        assert name in exported, f"{name} is bound in library.py but not exported by csrc/"
        assert exported[name] == len(argtypes), f"{name}: C takes {exported[name]} arguments, ctypes {len(argtypes)}"
    helpers = {"core_abi_version", "core_status_string", "core_paged_decode_partition_size"}
    assert set(exported) == set(SIGNATURES) | helpers


def test_gencode_flags_validate_architectures():
    assert build.gencode_flags(["sm_80", "sm_90a"]) == [
        "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90a,code=sm_90a"]
    with pytest.raises(ValueError, match="archs: '90'"):
        build.gencode_flags(["90"])
    with pytest.raises(ValueError, match="non-empty sequence"):
        build.gencode_flags("sm_90")


def test_cache_dir_follows_core_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("CORE_CACHE_DIR", str(tmp_path))
    assert build.cache_dir() == tmp_path / "cuda"


@needs_nvcc
def test_build_key_changes_with_sources_and_targets(monkeypatch, tmp_path):
    nvcc = find_nvcc()
    csrc = tmp_path / "csrc"
    shutil.copytree(build.CSRC, csrc)
    monkeypatch.setattr(build, "CSRC", csrc)
    before = build.build_key(("sm_90",), nvcc)
    assert build.build_key(("sm_80",), nvcc) != before
    (csrc / "rms_norm.cu").write_text((csrc / "rms_norm.cu").read_text() + "\n// edited\n")
    assert build.build_key(("sm_90",), nvcc) != before


@needs_nvcc
def test_compile_all_for_sm80_and_sm90_and_load_the_library():
    """The CI check: every kernel for both architectures (cached by source hash, so a rerun is instant)."""
    path = build.compile_all(("sm_80", "sm_90"))
    assert path.exists() and path.parent == build.cache_dir()
    assert build.compile_all(("sm_80", "sm_90")) == path  # from the cache
    library = KernelLibrary(path)  # loads without a GPU: the CUDA runtime is linked statically
    assert library.partition_size == 512
    assert library.status_string(-2) == "unsupported head size (64 or 128)"
    # Argument checks run on the host before any launch, so they answer here too.
    null = [None, 0, 0, None, None, None, 0, None, None, None, None, None]  # pointers and strides
    with pytest.raises(CudaKernelError, match="core_paged_decode_attention: query heads must be a multiple"):
        library.call("core_paged_decode_attention", *null, 1, 34, 2, 128, 16, 1.0, 0, 1, 2, None)
    with pytest.raises(CudaKernelError, match="unsupported head size"):
        library.call("core_paged_decode_attention", *null, 1, 8, 2, 96, 16, 1.0, 0, 1, 2, None)
    with pytest.raises(CudaKernelError, match="core_rms_norm: unsupported dtype"):
        library.call("core_rms_norm", None, None, None, None, None, 4, 64, 64, 0, 1e-6, 7, None)
    library.call("core_silu_and_mul", None, None, 0, 64, 128, 2, None)  # nothing to do: no launch, status 0


@needs_nvcc
def test_a_compile_error_shows_nvccs_message(monkeypatch, tmp_path):
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    (csrc / "broken.cu").write_text("__global__ void k() { undeclared_name = 1; }\n")
    monkeypatch.setattr(build, "CSRC", csrc)
    monkeypatch.setenv("CORE_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(build.CudaBuildError, match=r"(?s)compiling broken\.cu for sm_90.*undeclared_name"):
        build.build_library(("sm_90",))
    assert not list((tmp_path / "cache" / "cuda").glob("*.so"))  # nothing half-built is left behind


def test_a_missing_nvcc_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(build, "find_nvcc", lambda: None)
    with pytest.raises(build.CudaBuildError, match="nvcc was not found"):
        build.build_library(("sm_90",))
