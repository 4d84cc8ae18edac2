"""Large CPU tensors on transparent huge pages (core_pytorch_backend/__init__.py), and the lazily zeroed
CPU KV cache kept off them (layers/attention.allocate_kv_caches). Each case runs in a fresh interpreter:
torch reads THP_MEM_ALLOC_ENABLE once, at its first allocation."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _python(code: str, **env: str) -> list[str]:
    environment = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"} | env
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment,
                            timeout=120, check=True)
    return result.stdout.splitlines()


REPORT = "import os, core_pytorch_backend as b; print(os.environ.get('THP_MEM_ALLOC_ENABLE')); print(b.huge_pages())"


def test_the_backend_asks_torch_for_huge_pages_unless_torch_came_first_or_the_user_chose():
    value, said = _python(REPORT)
    assert value == "1" and ("transparent huge pages" in said or "transparent_hugepage=never" in said)
    value, said = _python("import torch; " + REPORT)
    assert value == "None"  # print(None): not set
    assert "torch was imported before core_pytorch_backend" in said
    value, said = _python(REPORT, THP_MEM_ALLOC_ENABLE="0")
    assert value == "0" and said == "4 KiB pages (THP_MEM_ALLOC_ENABLE='0')"


# Allocates a KV cache of 64 MiB the runner's way (zeroed=False) and a plain tensor as large, writes
# both through, and prints the huge pages of the mappings holding each (/proc/self/smaps).
KV_CACHE_PAGES = """
import core_pytorch_backend, torch
from torch import nn
from core_pytorch_backend.layers.attention import Attention, allocate_kv_caches

def huge_kib(tensor):
    address, found, kib = tensor.data_ptr(), False, 0
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            start, end = (int(x, 16) for x in head.split("-"))
            found = start <= address < end
        elif found and line.startswith("AnonHugePages:"):
            kib += int(line.split()[1])
    return kib

model = nn.Module()
model.anchor = nn.Parameter(torch.zeros(1))
model.layers = nn.ModuleList(Attention(8, 8, 128, 0.1, None, layer_index=i) for i in range(2))
(k, v), _ = allocate_kv_caches(model, 256, 16, torch.float32, "cpu", zeroed=False)
plain = torch.empty(k.numel() * 4)
for tensor in (k.reshape(-1), plain):
    tensor.fill_(0)
print(huge_kib(plain), huge_kib(k))
"""


@pytest.mark.skipif(not THP_MODE.exists() or "[never]" in THP_MODE.read_text(), reason="no transparent huge pages")
def test_a_lazily_zeroed_cpu_kv_cache_stays_on_small_pages():
    plain, cache = map(int, _python(KV_CACHE_PAGES)[-1].split())
    if plain == 0:
        pytest.skip("the kernel gave even a plain 64 MiB tensor no huge pages here")
    assert cache == 0, f"the KV cache holds {cache} KiB of huge pages"
