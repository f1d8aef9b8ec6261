"""glibc's heap: the allocator policy big tensors need, as changes that carry their own undo.

glibc serves big allocations with mmap, but each time such a block is freed it raises that threshold
(up to 32 MiB) and serves later tensors of that size from its heap, where freed memory stays resident
and fragments; pinning the threshold keeps big tensors going back to the OS.  Once pinned, glibc also
gives the heap's top back on every free, so holding the freed heap and releasing it at chosen moments
avoids faulting fresh pages in (cpu.ReleaseFreedHeap decides those moments while training).

| change                   | saves                                   | costs                               |
|--------------------------|-----------------------------------------|-------------------------------------|
| pin_mmap_threshold       | heap fragmentation in peak RSS          | page faults on big tensors          |
| hold_freed_heap          | page faults: freed memory reused        | freed memory resident until         |
|   + release_freed_heap   |                                         | released, then refaulted            |
| freed_tensors_unmapped   | a save's or merge's heap growth         | a page fault per big tensor made    |

glibc has no getter for these settings: an undo sets back what was in force as far as it can be known
(what this module set before, the MALLOC_*_ / GLIBC_TUNABLES environment, else glibc's initial 128 KiB).
There is no torch or Python API for any of this, hence ctypes.  Nothing here imports the package: the
planner (budget.py), saving and training all use it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import sys
from collections.abc import Callable, Iterator

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameter numbers, from glibc's malloc.h
GLIBC_INITIAL_THRESHOLD = 128 * 1024  # both thresholds' glibc default
# One page above 8 MiB: big tensors (logits, attention probabilities, weight casts) go back to the OS,
# small ones reuse the heap; tensors of exactly 8 MiB are common at block 512 (512x4096 fp32, 16x512x512
# bf16) and are reused from the heap instead of page-faulting fresh memory.
PINNED_MMAP_THRESHOLD = 8 * 2**20 + 4096
HELD_HEAP_BYTES = 2**31 - 1  # mallopt takes an int: "never trim on free"
_ENVIRONMENT_NAMES = {M_TRIM_THRESHOLD: ("MALLOC_TRIM_THRESHOLD_", "glibc.malloc.trim_threshold"),
                      M_MMAP_THRESHOLD: ("MALLOC_MMAP_THRESHOLD_", "glibc.malloc.mmap_threshold")}
_in_force: dict[int, int] = {}  # what this module last set, per option


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (e.g. musl)
        return None
    return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


def _setting_before_us(option: int) -> int:
    """What glibc started with for `option`: the environment's setting, else its default."""
    variable, tunable = _ENVIRONMENT_NAMES[option]
    tunables = dict(item.split("=", 1) for item in os.environ.get("GLIBC_TUNABLES", "").split(":") if "=" in item)
    for value in (os.environ.get(variable), tunables.get(tunable)):
        if value and value.isdigit():
            return int(value)
    return GLIBC_INITIAL_THRESHOLD


def set_malloc_option(option: int, value: int) -> Callable[[], None] | None:
    """glibc's mallopt(option, value); returns its undo, or None where glibc is not the allocator."""
    libc = _glibc()
    if libc is None:
        return None
    previous = _in_force.get(option, _setting_before_us(option))
    if not libc.mallopt(option, value):
        return None
    _in_force[option] = value

    def undo() -> None:
        libc.mallopt(option, previous)
        _in_force[option] = previous

    return undo


def pin_mmap_threshold(threshold: int = PINNED_MMAP_THRESHOLD) -> Callable[[], None] | None:
    """Hand freed tensors of `threshold` bytes and more back to the OS at once; returns the undo."""
    return set_malloc_option(M_MMAP_THRESHOLD, threshold)


def hold_freed_heap() -> Callable[[], None] | None:
    """Keep the freed top of glibc's heap for the next tensors until release_freed_heap; returns the undo."""
    return set_malloc_option(M_TRIM_THRESHOLD, HELD_HEAP_BYTES)


def release_freed_heap() -> bool:
    """Give the pages of freed heap memory back to the OS now (glibc only; returns whether any went).
    The cost is a page fault for each page the next tensors there touch again."""
    libc = _glibc()
    return libc is not None and bool(libc.malloc_trim(0))


@contextlib.contextmanager
def freed_tensors_unmapped() -> Iterator[None]:
    """For work that makes and frees one large tensor after another outside training (a streamed save, a
    LoRA merge): glibc's dynamic mmap threshold rises to the size of each freed tensor and keeps the next
    ones in the heap, which grew a save of a 150M model by 66 MB and its merge by 57 MB.  Fixed at glibc's
    initial 128 KiB, each tensor goes back to the OS when freed (a page fault each time it is made, small
    beside writing it); then the settings in force before, and the freed heap handed back."""
    undo = pin_mmap_threshold(GLIBC_INITIAL_THRESHOLD)
    try:
        yield
    finally:
        if undo is not None:
            undo()
        release_freed_heap()


def glibc_heap_available() -> bool:
    """Whether glibc is the allocator, so that the settings here act."""
    return _glibc() is not None
