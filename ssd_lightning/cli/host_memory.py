"""Host memory reused from step to step: big CPU tensors without the kernel zeroing fresh pages each time.

A CPU training step allocates and frees dozens of activations and gradients of a few MiB each
(SSD300-MobileNetV2 at batch 8: up to 35 MiB). By default glibc's ``malloc`` serves the largest with a fresh
``mmap`` and unmaps them on ``free``, and hands the free top of its heap back to the kernel; torch asks for
no huge pages. So every step the kernel maps and zeroes the same memory again, one 4 KiB page fault at a
time: ~10 % of the demo's step on a 2-core box (docs/benchmarks.md, "Host memory"). Two process-wide
settings, together, let an allocation reuse the pages a freed one left (a training step's faults: ~25,000
-> ~130):

- ``THP_MEM_ALLOC_ENABLE=1``, torch's own switch: blocks of 2 MiB and more are advised onto transparent
  huge pages (page-aligned, not 2 MiB-aligned, in torch 2.14). torch reads it once, at its first CPU
  allocation, so it must be in the environment before torch runs (``train.py`` calls
  :func:`reuse_host_memory` before importing torch; processes it starts, DDP ranks included, inherit it).
- glibc's ``mallopt``: every block from the heap (no ``mmap``), and freed memory kept for the next one.
  A freed block serves a later request that fits in it; a request of exactly its size may not fit (the
  aligned allocation's small leftover tail can sit between the block and the heap's top, depending on the
  heap's earlier history), so such a request can still take fresh pages.

The resident size then stays near its peak instead of shrinking between steps. Linux only; the
``mallopt`` part needs glibc (not musl), elsewhere only what applies is set.
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
    """Apply both settings where the platform has them (a user's own ``THP_MEM_ALLOC_ENABLE`` wins).

    Returns:
        what was applied, in words, for the log (empty off Linux).
    """
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
