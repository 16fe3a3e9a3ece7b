"""Host memory reused from step to step: big CPU tensors without the kernel zeroing fresh pages each time.

By default glibc's ``malloc`` serves a CPU step's big activations and gradients (up to 35 MiB) with fresh
mappings it unmaps on ``free``, so every step the kernel maps and zeroes the same memory again, a 4 KiB
page fault at a time: ~10 % of the demo's step on a 2-core box (docs/benchmarks.md, "Host memory"). Two
process-wide settings let an allocation reuse a freed one's pages (a step's faults: ~25,000 -> ~130):

- ``THP_MEM_ALLOC_ENABLE=1``, torch's switch for transparent huge pages on blocks of 2 MiB and more, read
  at torch's first CPU allocation: ``train.py`` calls :func:`reuse_host_memory` before importing torch
  (DDP ranks inherit the environment).
- glibc's ``mallopt``: every block from the heap, and freed memory kept (a request of exactly a freed
  block's size may still take fresh pages: the aligned allocation's leftover tail may not fit).

The resident size then stays near its peak. Linux only; ``mallopt`` needs glibc.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

__all__ = ["reuse_host_memory"]

log = logging.getLogger(__name__)

TORCH_HUGE_PAGES = "THP_MEM_ALLOC_ENABLE"
# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
NEVER_TRIM = 2**31 - 1  # mallopt takes an int: only a free top above 2 GiB would go back


def reuse_host_memory() -> list[str]:
    """Apply both settings where the platform has them (a user's own ``THP_MEM_ALLOC_ENABLE`` wins); return
    what was applied, in words (empty off Linux)."""
    if platform.system() != "Linux":
        return []
    applied = []
    if os.environ.setdefault(TORCH_HUGE_PAGES, "1") == "1":
        applied.append(f"huge pages for torch's blocks of 2 MiB and more ({TORCH_HUGE_PAGES}=1)")
    if platform.libc_ver()[0] == "glibc":
        libc = ctypes.CDLL(None)  # the C library this process already runs on
        if libc.mallopt(M_MMAP_MAX, 0) == 1 and libc.mallopt(M_TRIM_THRESHOLD, NEVER_TRIM) == 1:
            applied.append("glibc malloc keeps freed memory for reuse")
    if applied:
        log.info("host memory reused between steps (reuse_host_memory=true): %s", "; ".join(applied))
    return applied
