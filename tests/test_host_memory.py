"""reuse_host_memory(): a big CPU tensor allocated again reuses its pages instead of faulting in fresh ones.

The settings are process-wide and cannot be undone, so the allocations run in child processes; the unit
tests below keep the test process's own malloc untouched.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import pytest

from ssd_lightning.cli import host_memory
from ssd_lightning.cli.host_memory import TORCH_HUGE_PAGES, reuse_host_memory
from tests.helpers import run_script

# A 64 MiB tensor, freed, then a 60 MiB one: what the child saw and did, as JSON. The second one is smaller
# so that the freed block always holds it. The same size again is not always served from the freed block:
# glibc's posix_memalign takes size + alignment + 32 bytes from the heap, then frees the spare tail. A tail
# of at most 1032 bytes stays in the thread cache, counted as in use, between the block and the heap's top.
# The freed block then cannot merge with the top, is 4 KiB too small for the next request, and the heap
# grows onto fresh pages. How long that tail is depends on every earlier malloc: the import order, path
# lengths and hash seed.
ALLOCATE_AND_REALLOCATE = """
import json, os, re, resource, sys
applied = []
if sys.argv[1] == "reuse":
    from ssd_lightning.cli.host_memory import reuse_host_memory
    applied = reuse_host_memory()  # before torch, as train.py does
huge_page_env = os.environ.get("THP_MEM_ALLOC_ENABLE")
import torch

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

def mapping(addr):  # the name and VmFlags of the mapping that holds addr, from /proc/self/smaps
    found = None
    for line in open("/proc/self/smaps"):
        head = re.match(r"([0-9a-f]+)-([0-9a-f]+) \\S+ \\S+ \\S+ \\S+ *(.*)", line)
        if head:
            found = head.group(3) if int(head.group(1), 16) <= addr < int(head.group(2), 16) else None
        elif found is not None and line.startswith("VmFlags:"):
            return {"name": found, "flags": line.split()[1:]}

first = torch.empty(16 * 2**20, dtype=torch.float32)  # 64 MiB
first.fill_(1.0)
first_mapping = mapping(first.data_ptr())
del first
before = faults()
again = torch.empty(15 * 2**20, dtype=torch.float32)  # 60 MiB
again.fill_(1.0)
again_faults = faults() - before
print(json.dumps({"applied": applied, "huge_page_env": huge_page_env, "first": first_mapping,
                  "again": mapping(again.data_ptr()), "again_faults": again_faults}))
"""
# a fresh mapping of 60 MiB faults at least once per 2 MiB, even on huge pages
FRESH_60_MIB_MIN_FAULTS = 30
THP_IN_KERNEL = Path("/sys/kernel/mm/transparent_hugepage").is_dir()


def _allocate(mode: str) -> dict:
    result = run_script("-c", ALLOCATE_AND_REALLOCATE, mode, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc on Linux only"
)
def test_a_big_tensor_allocated_again_reuses_its_pages(monkeypatch):
    # the child decides, not this process's environment
    for name in [TORCH_HUGE_PAGES, "GLIBC_TUNABLES", *(n for n in os.environ if n.startswith("MALLOC_"))]:
        monkeypatch.delenv(name, raising=False)
    default, reused = _allocate("default"), _allocate("reuse")
    # glibc's default: a block over 32 MiB is a mapping of its own, unmapped on free; torch advises nothing
    assert default["huge_page_env"] is None and default["applied"] == []
    assert default["first"]["name"] != "[heap]" and "hg" not in default["first"]["flags"], default
    assert default["again_faults"] >= FRESH_60_MIB_MIN_FAULTS, default
    # both settings applied (mallopt returned 1 twice), the variable set before torch ran
    assert reused["huge_page_env"] == "1" and len(reused["applied"]) == 2, reused
    for block in (reused["first"], reused["again"]):
        assert block["name"] == "[heap]", reused  # M_MMAP_MAX=0: from the heap, not a mapping
        assert ("hg" in block["flags"]) == THP_IN_KERNEL, reused  # torch read the variable: MADV_HUGEPAGE
    # the freed block stayed mapped and holds the second one: only pages already faulted in are touched
    assert reused["again_faults"] < FRESH_60_MIB_MIN_FAULTS, reused


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
