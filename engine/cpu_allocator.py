"""Keep large CPU tensors out of fresh mmap()s.

glibc serves allocations above its mmap threshold with a new mapping each time, and every page of it
faults on first touch. The engine allocates tens of MB of temporaries per layer per step (gathered KV
blocks, activations), so under the default policy page faults take a large share of a CPU decode step.
Applied once, in the engine process, on Linux/glibc only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's upper limit on 64-bit
_TRIM_THRESHOLD = 1 << 30
_done = False


def keep_large_allocations_in_heap() -> bool:
    global _done
    if _done or not sys.platform.startswith("linux"):
        return _done
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) == 1
        ok = libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1 and ok
    except (OSError, AttributeError):  # not glibc (musl, ...): leave the allocator alone
        return False
    _done = ok
    if not ok:
        log.debug("mallopt refused the allocator settings")
    return ok
