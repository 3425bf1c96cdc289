"""What the C allocator does with the memory a slot frees (glibc only; elsewhere nothing).

A slot's forward and backward allocate their activations afresh, megabytes each, and free them at
its end. By glibc's defaults a block that large is mapped for the call and unmapped when freed,
and the free memory at the top of the heap is handed back to the kernel: the next slot faults
every one of those pages in again. Measured on the digits job (a 64-4096-10 network, parts of
40-300 samples), about 300 page faults a slot; in a virtual machine a fault costs from 2 to over
10 microseconds by how busy its host is, so a slot's system time went from nothing to a fifth of
its CPU time and, now and then, to 40 ms in one slot. A sync round waits for its slowest slot:
those were its slowest. The worker keeps what it frees instead (its footprint is its peak, the
figure its memory limits are checked against), and gives it back when its owner comes back.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from typing import Optional

log = logging.getLogger("idlegrad.worker")

# mallopt's parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Blocks up to this size come from the heap: glibc's own maximum for the mmap threshold on 64-bit
# (a larger one is refused); larger blocks are still mapped for the call.
MMAP_THRESHOLD = 32 << 20
# Free memory at the top of the heap is kept up to this (a C int: at most 2 GiB - 1).
TRIM_THRESHOLD = 1 << 30

_libc: Optional[ctypes.CDLL] = None
_looked = False


def _glibc() -> Optional[ctypes.CDLL]:
    global _libc, _looked
    if not _looked:
        _looked = True
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim"):
                _libc = libc
        except OSError:
            _libc = None
    return _libc


def keep_freed_memory() -> bool:
    """Keep the memory freed by one slot for the next (once per process is enough; calling it
    again changes nothing). False where the allocator is not glibc's or refused."""
    libc = _glibc()
    if libc is None:
        return False
    kept = (libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
            and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1)
    if not kept:
        log.debug("the C allocator refused to keep freed memory: slots fault their memory in")
    return kept


def return_freed_memory() -> bool:
    """Hand the memory freed so far back to the kernel (the owner is back: the worker's
    footprint while it sleeps is what it holds, not its peak). True if any was returned."""
    libc = _glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False
