"""Give the C heap's free pages back to the operating system between the phases of a step.

On CPU, torch allocates tensors with glibc ``malloc``. Once a large block has been freed, glibc
raises its mmap threshold (up to 32 MiB), so later activations come from the heap, and freed
heap memory stays in the process: a GRPO step's micro-batches of different widths leave their
activations' pages resident and fragmented. ``malloc_trim(0)`` returns every free page
(``MADV_DONTNEED``) for the cost of faulting them in again. In the SmolLM2 step benchmark,
calling it once per micro-batch lowered the peak from 5.90 to 5.73 GiB at no measurable time
cost; routing every tensor above 1 MiB through ``mmap`` instead saved more but made steps 22%
slower (BENCHMARKS.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to do
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim  # type: ignore[no-any-return]


def release_free_memory() -> bool:
    """Return free heap pages to the OS; False where the C library cannot (not glibc)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
