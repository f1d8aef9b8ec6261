"""glibc's heap: one policy for the whole training run, and phases that give memory back without changing it.

glibc serves a big allocation with mmap (faulted in page by page, unmapped when freed) and a smaller one
from its heap (reused, resident until trimmed).  Its mmap threshold is dynamic: each freed mmapped block
raises it to that block's size (up to 32 MiB, trimming at twice that), so the tensors a training step makes
and frees come from the heap from the second step on.  The first mallopt of M_MMAP_THRESHOLD,
M_TRIM_THRESHOLD, M_TOP_PAD or M_MMAP_MAX turns that off for the rest of the process, and no call turns it
back on.  Hence two rules:
- glibc's settings are the training run's, chosen once by the plan (TrainPlan.hold_freed_heap) and put in
  force by `use` for the length of training (heap_callbacks.GlibcHeap).  Nothing else here calls mallopt.
- A phase before or between steps that makes and frees big tensors (the planner's probes, a save, a LoRA
  merge) gives its freed memory back with malloc_trim (`freed_memory_returned`), which changes no setting.

| settings (what is set)          | saves                                     | costs                                  |
|---------------------------------|-------------------------------------------|----------------------------------------|
| GLIBC_OWN (nothing)             | page faults: a step's tensors up to 32 MiB| freed heap resident, fragmented        |
|                                 | reused from the heap                      | (counted in the CPU budget, budget.py) |
| SETTLED (mmap 32 MiB, trim      | the same, where the dynamic threshold is  | the same                               |
|   64 MiB)                       | already off: where glibc's would settle   |                                        |
| HELD (mmap 8 MiB + 4 KiB, trim  | fragmentation: big tensors go back to the | the activations faulted in again at    |
|   never) + release_freed_heap   | OS, the rest at each block's edges        | every block (step_time.py counts it)   |
| freed_memory_returned (a phase) | the phase's freed heap, given back after  | the next step faults that back in once |
|                                 | it                                        |                                        |
| (gone) mmap 128 KiB for a phase | the phase's growth while it ran           | every tensor over 128 KiB mmapped for  |
|                                 |                                           | the rest of the process: steps 1.2-1.8x|
|                                 |                                           | slower (benchmarks/RESULTS.md)         |

An explicit mmap threshold needs its trim threshold beside it: alone, glibc's 128 KiB trim threshold hands
the heap's top back on every free, and each step faults it in again (measured: thousands of faults a step).
glibc has no getter for these settings: an undo sets back what was in force as far as it can be known (what
this module set before, the MALLOC_*_ / GLIBC_TUNABLES environment, else SETTLED, since glibc's own dynamic
values cannot be restored).  There is no torch or Python API for any of this, hence ctypes.  Nothing here
imports the package: the planner (budget.py), saving and training all use it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameter numbers, from glibc's malloc.h
# One page above 8 MiB: big tensors (logits, attention probabilities, weight casts) go back to the OS,
# small ones reuse the heap; tensors of exactly 8 MiB are common at block 512 (512x4096 fp32, 16x512x512
# bf16) and are reused from the heap instead of page-faulting fresh memory.
PINNED_MMAP_THRESHOLD = 8 * 2**20 + 4096
HELD_HEAP_BYTES = 2**31 - 1  # mallopt takes an int: "never trim on free"
# Where glibc's dynamic threshold stops rising on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX), and the trim threshold
# it then sets (twice the mmap threshold).
SETTLED_MMAP_THRESHOLD = 32 * 2**20
SETTLED_TRIM_THRESHOLD = 2 * SETTLED_MMAP_THRESHOLD
_ENVIRONMENT_NAMES = {M_TRIM_THRESHOLD: ("MALLOC_TRIM_THRESHOLD_", "glibc.malloc.trim_threshold"),
                      M_MMAP_THRESHOLD: ("MALLOC_MMAP_THRESHOLD_", "glibc.malloc.mmap_threshold")}
_in_force: dict[int, int] = {}  # what this module last set, per option


@dataclass(frozen=True)
class HeapSettings:
    """glibc's two thresholds (bytes); None leaves that one as it is."""

    name: str
    mmap_threshold: int | None = None
    trim_threshold: int | None = None

    def options(self) -> dict[int, int]:
        """mallopt's option numbers and the values to set (the thresholds left as they are: none)."""
        values = {M_MMAP_THRESHOLD: self.mmap_threshold, M_TRIM_THRESHOLD: self.trim_threshold}
        return {option: value for option, value in values.items() if value is not None}


GLIBC_OWN = HeapSettings("glibc's own (dynamic threshold)")
SETTLED = HeapSettings("glibc's settled values", SETTLED_MMAP_THRESHOLD, SETTLED_TRIM_THRESHOLD)
HELD = HeapSettings("held, released at every block", PINNED_MMAP_THRESHOLD, HELD_HEAP_BYTES)


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (e.g. musl)
        return None
    return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


def _environment_setting(option: int) -> int | None:
    """What the environment set `option` to at the process's start, if anything."""
    variable, tunable = _ENVIRONMENT_NAMES[option]
    tunables = dict(item.split("=", 1) for item in os.environ.get("GLIBC_TUNABLES", "").split(":") if "=" in item)
    for value in (os.environ.get(variable), tunables.get(tunable)):
        if value and value.isdigit():
            return int(value)
    return None


def training_settings(hold: bool) -> HeapSettings:
    """The settings a run trains under: HELD, or glibc's own, which are its settled values where this module
    has already turned its dynamic threshold off (an earlier run in this process held the heap)."""
    if hold:
        return HELD
    return SETTLED if _in_force else GLIBC_OWN


def use(settings: HeapSettings) -> Callable[[], None] | None:
    """Put `settings` in force; returns the undo, or None where glibc is not the allocator.  The undo sets
    back what was in force before: this module's or the environment's values, else SETTLED (glibc's dynamic
    threshold cannot come back)."""
    libc = _glibc()
    if libc is None:
        return None
    wanted = settings.options()
    settled = SETTLED.options()
    previous = {option: _in_force.get(option, _environment_setting(option) or settled[option]) for option in wanted}
    _set(libc, wanted)

    def undo() -> None:
        _set(libc, previous)

    return undo


def _set(libc: ctypes.CDLL, values: dict[int, int]) -> None:
    for option, value in values.items():
        if libc.mallopt(option, value):
            _in_force[option] = value


def release_freed_heap() -> bool:
    """Give the pages of freed heap memory back to the OS now (glibc only; returns whether any went).
    The cost is a page fault for each page the next tensors there touch again."""
    libc = _glibc()
    return libc is not None and bool(libc.malloc_trim(0))


@contextlib.contextmanager
def freed_memory_returned() -> Iterator[None]:
    """For work outside the steps that makes and frees one big tensor after another (the planner's probes, a
    streamed save, a LoRA merge): what it freed into glibc's heap goes back to the OS when it ends, under the
    settings training runs with (no mallopt: see the module docstring)."""
    try:
        yield
    finally:
        release_freed_heap()


def glibc_heap_available() -> bool:
    """Whether glibc is the allocator, so that the settings here act."""
    return _glibc() is not None
