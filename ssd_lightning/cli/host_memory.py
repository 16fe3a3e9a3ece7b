"""Host memory reused from step to step: big CPU tensors without the kernel zeroing fresh pages each time.

glibc's ``malloc`` unmaps big freed blocks, so the kernel zeroes the same memory every step (~10 % of the
demo's step, docs/benchmarks.md). Torch's ``THP_MEM_ALLOC_ENABLE=1`` (set before torch is imported) and
glibc's ``mallopt`` (freed memory kept) cut a step's page faults from ~25,000 to ~130. Linux only.
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
    """Apply both settings where the platform has them; return what was applied, in words."""
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
