"""Memory in transparent huge pages for what a decoding step reads whole every token: our kernels' packed weights
(native_int8.pack, native_bf16.pack).

Why: a step streams every weight from memory, and from 4 KiB pages the CPU's prefetchers stop at each page's end
and each page costs a TLB miss.  One core read 16-18 GB/s from 4 KiB pages here and 28-31 GB/s from 2 MiB ones,
two cores 24-26 and 32-34; a 355M token on our int8 kernel was 1.09-1.10x quicker (HISTORY.md, twenty-sixth
session).  torch's allocator does not ask for huge pages, and Linux's THP mode "madvise" (Debian's and Ubuntu's
default) gives them only to memory asked for them (madvise MADV_HUGEPAGE) before it is first written.

| where                                       | memory                                                             |
|---------------------------------------------|--------------------------------------------------------------------|
| Linux, THP "always" or "madvise"            | private anonymous mappings of CHUNK bytes (a tensor larger than    |
|                                             | CHUNK: one of its own) asked for huge pages; each tensor a slice   |
|                                             | of one, ALIGN-aligned, from the first 2 MiB boundary in it         |
| elsewhere (THP "never", no madvise, a       | torch.empty                                                        |
| mapping refused)                            |                                                                    |

Memory: a mapping's pages are resident only once written (what no tensor took is not, but for the rest of the
last huge page written); each tensor holds its mapping, and a mapping is unmapped when the last tensor in it is
freed (the module keeps only a weak reference to the mapping it is filling), so a view let go gives its weights'
memory back as torch's would.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import threading
import weakref

import torch

CHUNK = 64 << 20  # a mapping's bytes: a 355M view's ~350 MB of packed weights in six
HUGE = 2 << 20  # a huge page on x86-64
ALIGN = 64  # each tensor's start: a cache line (our kernels' 64-byte loads)
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


class _Mapping(mmap.mmap):
    """An anonymous mapping a weak reference can be held to (mmap.mmap's own cannot)."""


@functools.cache
def available() -> bool:
    """Whether Linux gives huge pages to memory that asks for them here (module docstring)."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or not hasattr(mmap, "MAP_PRIVATE"):
        return False
    try:
        with open(THP_MODE, encoding="ascii") as file:
            mode = file.read()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized contiguous CPU tensor of `shape` and `dtype`, in huge pages where they are available
    (module docstring), else torch's."""
    size = torch.Size(shape).numel() * dtype.itemsize
    if not available() or size == 0:
        return torch.empty(shape, dtype=dtype)
    try:
        mapping, offset = _place(size)
    except (OSError, ValueError):  # (a mapping refused: memory is short, or the system's map count reached)
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(mapping, dtype=torch.uint8, count=size, offset=offset).view(dtype).view(shape)


def copy_of(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of `tensor` (a layout made by a view of it: a packing), in huge pages where they are
    available."""
    return empty(tuple(tensor.shape), tensor.dtype).copy_(tensor)


_lock = threading.Lock()
_filling: weakref.ref[_Mapping] | None = None  # the mapping tensors are placed in now
_used = 0  # its bytes given, from its start


def _place(size: int) -> tuple[_Mapping, int]:
    """A mapping and the offset in it of `size` bytes no other tensor holds, ALIGN-aligned."""
    global _filling, _used
    with _lock:
        mapping = None if _filling is None else _filling()
        start = -(-_used // ALIGN) * ALIGN
        if mapping is not None and start + size <= len(mapping):
            _used = start + size
            return mapping, start
        mapping, start = _mapped(max(size, CHUNK))
        _filling, _used = weakref.ref(mapping), start + size
        return mapping, start


def _mapped(size: int) -> tuple[_Mapping, int]:
    """A private anonymous mapping asked for huge pages before any write, with `size` bytes from its first 2 MiB
    boundary on, and that boundary's offset."""
    mapping = _Mapping(-1, size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    return mapping, -address % HUGE
