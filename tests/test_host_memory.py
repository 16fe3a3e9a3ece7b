"""reuse_host_memory(): a big CPU tensor allocated again reuses its pages instead of faulting in fresh ones.

The settings are process-wide and cannot be undone, so the allocations run in child processes; the unit
tests below keep the test process's own malloc untouched.
"""

from __future__ import annotations

import json
import platform

import pytest

from ssd_lightning.cli import host_memory
from ssd_lightning.cli.host_memory import TORCH_HUGE_PAGES, reuse_host_memory
from tests.helpers import run_script

ALLOCATE_FOUR_TIMES = """
import json, resource, sys
if sys.argv[1] == "reuse":
    from ssd_lightning.cli.host_memory import reuse_host_memory
    reuse_host_memory()  # before torch, as train.py does
import torch

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

counts = []
for _ in range(4):  # 64 MiB: 16,384 pages of 4 KiB, 32 huge pages
    before = faults()
    block = torch.empty(16 * 2**20, dtype=torch.float32)
    block.fill_(1.0)
    del block
    counts.append(faults() - before)
print(json.dumps(counts))
"""


def _page_faults(mode: str) -> list[int]:
    result = run_script("-c", ALLOCATE_FOUR_TIMES, mode, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc on Linux only"
)
def test_a_big_tensor_allocated_again_reuses_its_pages(monkeypatch):
    monkeypatch.delenv(TORCH_HUGE_PAGES, raising=False)  # the child decides, not this process's environment
    default, reused = _page_faults("default"), _page_faults("reuse")
    # glibc's default maps a fresh 64 MiB block every time: at least one fault per huge page (32)
    assert min(default[1:]) >= 32, default
    # with both settings the third and fourth allocations touch pages already mapped
    assert reused[2] < 32 and reused[3] < 32, reused


def test_nothing_changes_off_linux(monkeypatch):
    monkeypatch.setattr(platform, "system", lambda: "Darwin")
    monkeypatch.delenv(TORCH_HUGE_PAGES, raising=False)
    assert reuse_host_memory() == []
    assert TORCH_HUGE_PAGES not in host_memory.os.environ


def test_a_users_own_huge_page_setting_wins(monkeypatch):
    monkeypatch.setattr(platform, "system", lambda: "Linux")
    monkeypatch.setattr(platform, "libc_ver", lambda: ("musl", ""))  # keeps this process's malloc as it is
    monkeypatch.setenv(TORCH_HUGE_PAGES, "0")
    assert reuse_host_memory() == []
    assert host_memory.os.environ[TORCH_HUGE_PAGES] == "0"
    monkeypatch.delenv(TORCH_HUGE_PAGES)
    assert reuse_host_memory() == [f"huge pages for torch's blocks of 2 MiB and more ({TORCH_HUGE_PAGES}=1)"]
    assert host_memory.os.environ[TORCH_HUGE_PAGES] == "1"
