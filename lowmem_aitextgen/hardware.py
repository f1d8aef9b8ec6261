"""The machine a run is planned for, read in one place.

Every decision that depends on the hardware (the accelerator and precision in plan.py, the memory budget
in budget.py, the step-time model's bf16 speed) asks `gpu()` and `cpu()` here, never torch.cuda or /proc
directly.  `presenting(...)` puts any card or CPU in their place for the length of a `with`: the tests
present the cards users have (`CARDS`) and both kinds of CPU to the same planner that runs on a real
machine, and docs/memory.md's card table is made that way on a machine without a GPU.

What is read, and why each fact matters:

| fact                         | read from                                  | decides                         |
|------------------------------|--------------------------------------------|---------------------------------|
| a CUDA GPU, how many         | torch.cuda.is_available, device_count      | accelerator, processes          |
| free and total memory        | torch.cuda.mem_get_info (every process's   | the GPU budget                  |
|                              | use, this one's context included)          |                                 |
| this process's cache         | memory_reserved - memory_allocated: free   | counted as available            |
|                              | to this process, not to others             |                                 |
| this process's tensors       | memory_allocated                           | named when nothing fits (an     |
|                              |                                            | earlier model in a notebook)    |
| native bf16 / fp16 (GPU)     | capability: bf16 from 8.0, fp16 from 5.3   | mixed precision and which dtype |
| native bf16 (CPU)            | oneDNN's AVX512-BF16/AMX check             | bf16 autocast, or fp32          |
| int8 kernels (CPU)           | supported_engines, fbgemm's and oneDNN's   | decoding in int8 (decoding.py), |
|                              | ops (missing_*int8_kernels)                | on which kernel (int8_kernels)  |
| available memory (CPU)       | MemAvailable, a cgroup's limit less usage, | the CPU budget                  |
|                              | and this process's resident size           |                                 |

Native bf16 on a GPU is read from the capability, not from torch.cuda.is_bf16_supported(): by default that
also answers True where bf16 is only emulated (a T4, a V100), where fp16 is the faster choice.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

GIB = 2**30
# bf16 autocast against fp32 on a CPU, by native bf16: with AVX512-BF16/AMX measured 1.4-3x faster at widths
# 64-1024; emulated (AVX2 only), GPT-2 124M at block 256 measured 20x slower (benchmarks/RESULTS.md).
CPU_BF16_SPEED = {True: 1.9, False: 0.05}
# What reading a card's memory costs a process that has no CUDA context yet: the context, counted as used
# by the time mem_get_info answers.  Used only to describe CARDS' free memory as a fresh process sees it.
CUDA_CONTEXT_BYTES = 450 * 2**20


@dataclass(frozen=True)
class GPU:
    """One CUDA device as this process sees it (bytes)."""

    name: str
    total: int
    free: int  # free on the card now: what every process, this one included, has left
    capability: tuple[int, int]
    reserved: int = 0  # this process's caching allocator: its tensors and its cache
    allocated: int = 0  # this process's tensors
    count: int = 1  # CUDA devices visible to this process

    @property
    def bf16(self) -> bool:
        """Native bf16 math (Ampere, capability 8.0, and later)."""
        return self.capability >= (8, 0)

    @property
    def fp16(self) -> bool:
        """Native half-precision math (capability 5.3 and later)."""
        return self.capability >= (5, 3)

    @property
    def cached(self) -> int:
        """Memory this process's allocator holds but no tensor uses: free to this process, not to others."""
        return max(0, self.reserved - self.allocated)

    @property
    def held_elsewhere(self) -> int:
        """What other processes (and the driver) hold on the card."""
        return max(0, self.total - self.free - self.reserved)

    def __str__(self) -> str:
        return f"{self.name} ({self.total / GIB:.1f} GiB, capability {self.capability[0]}.{self.capability[1]})"


@dataclass(frozen=True)
class CPU:
    """The CPU and the memory this process may take (bytes; None where it cannot be read)."""

    name: str
    bf16_native: bool  # AVX512-BF16 or AMX: without them bf16 math is emulated, slower than fp32
    available: int | None = None  # MemAvailable, at most a cgroup's limit less its usage
    resident: int | None = None  # this process's resident size
    int8_kernels: bool = True  # torch's int8 matmul: fbgemm's or oneDNN's (int8_kernels.py; AVX2 suffices)

    def __str__(self) -> str:
        return f"{self.name} ({'native' if self.bf16_native else 'no native'} bf16)"


@dataclass(frozen=True)
class Hardware:
    """What `presenting` puts in place of the machine; gpu=None: no CUDA GPU."""

    cpu: CPU
    gpu: GPU | None = None


_presented: list[Hardware] = []


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


@contextlib.contextmanager
def presenting(hardware: Hardware) -> Iterator[Hardware]:
    """Answer gpu() and cpu() with `hardware` inside the `with`, whatever the machine is."""
    _presented.append(hardware)
    try:
        yield hardware
    finally:
        _presented.remove(hardware)


def gpu() -> GPU | None:
    """The CUDA GPU this process trains on (LOCAL_RANK's under DDP, else the first), or None."""
    if _presented:
        return _presented[-1].gpu
    if not torch.cuda.is_available():
        return None
    count = torch.cuda.device_count()
    index = int(os.environ.get("LOCAL_RANK", 0)) % count
    free, total = torch.cuda.mem_get_info(index)
    properties = torch.cuda.get_device_properties(index)
    return GPU(name=properties.name, total=total, free=free, capability=(properties.major, properties.minor),
               reserved=torch.cuda.memory_reserved(index), allocated=torch.cuda.memory_allocated(index), count=count)


def cpu() -> CPU:
    """This machine's CPU, with the memory this process may take as of now."""
    if _presented:
        return _presented[-1].cpu
    return CPU(name=_cpu_name(), bf16_native=_cpu_bf16_native(), available=_available_bytes(),
               resident=_resident_bytes(), int8_kernels=_int8_kernels())


def native_half_precision(accelerator: str) -> bool:
    """Whether the device computes some 16-bit float natively (mixed precision is a speed-up there)."""
    if accelerator == "gpu":
        card = gpu()
        return card is not None and card.fp16
    return cpu().bf16_native


def bf16_native(accelerator: str) -> bool:
    """Whether the device computes bf16 natively."""
    if accelerator == "gpu":
        card = gpu()
        return card is not None and card.bf16
    return cpu().bf16_native


def emulated_cost(accelerator: str) -> str:
    """What emulated 16-bit math costs on this kind of device, in words."""
    if accelerator == "cpu":
        return f"about {1 / CPU_BF16_SPEED[False]:.0f}x the time of an fp32 step"
    return "no faster than fp32"


INSTALL_TORCHAO = "pip install 'lowmem_aitextgen[8bit]' (torchao)"  # 8-bit AdamW, the 16-bit and 4-bit tiers


def eight_bit_available() -> bool:
    """Whether 8-bit AdamW can run here (torchao installed: its AdamW8bit runs on CPU and CUDA)."""
    try:
        from torchao.optim import AdamW8bit  # noqa: F401
    except ImportError:
        return False
    return True


def _cpu_bf16_native() -> bool:
    # No public API tells whether oneDNN has native bf16 kernels (AVX512-BF16/AMX).
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def _int8_kernels() -> bool:
    return not missing_int8_kernels() or not missing_onednn_int8_kernels()


# What int8_kernels.py's fbgemm kernel and decoding.py's batch-range form call.  torch.ao.quantization is deprecated
# (torch 2.13 warns that it will be removed); where any of these is gone, int8 decodes on oneDNN's ops below, and
# tests/test_decoding.py fails on that torch naming what went.
INT8_OPS = ("linear_dynamic", "linear_prepack", "linear_with_input_q_dq_qweight_dq_output_fp32")
# What int8_kernels.py's oneDNN kernel calls (torch.ops.onednn): the ops torchao's x86 int8 path lowers to.
ONEDNN_INT8_OPS = ("qlinear_prepack", "qlinear_pointwise")


def missing_int8_kernels() -> list[str]:
    """The fbgemm kernels and torch.ao functions decoding.py calls that this torch lacks (empty: they are here)."""
    missing = [f"torch.ops.quantized.{name}" for name in INT8_OPS if not _has_op("quantized", name)]
    if not callable(getattr(getattr(torch.ao, "quantization", None), "quantize_dynamic", None)):
        missing.append("torch.ao.quantization.quantize_dynamic")
    if not {"x86", "fbgemm"} & set(torch.backends.quantized.supported_engines):
        missing.append("fbgemm (torch.backends.quantized.supported_engines)")
    return missing


def missing_onednn_int8_kernels() -> list[str]:
    """The oneDNN int8 ops int8_kernels.py calls that this torch lacks (empty: int8 decodes here without
    torch.ao's)."""
    missing = [f"torch.ops.onednn.{name}" for name in ONEDNN_INT8_OPS if not _has_op("onednn", name)]
    if not torch.backends.mkldnn.is_available() or "onednn" not in torch.backends.quantized.supported_engines:
        missing.append("oneDNN (torch.backends.quantized.supported_engines)")
    return missing


# What packed16.py's PackedLinear calls (torch.ops.mkldnn): private ops, so where one is gone a CPU's bf16 view
# keeps its modules (slower), and tests/test_decoding.py fails on that torch naming what went.
PACKED_OPS = ("_reorder_linear_weight", "_linear_pointwise")


def missing_packed_kernels() -> list[str]:
    """The ops packed16.py calls that this torch lacks (empty: a CPU's bf16 view packs its projections here)."""
    return [f"torch.ops.mkldnn.{name}" for name in PACKED_OPS if not _has_op("mkldnn", name)]


def _has_op(namespace: str, name: str) -> bool:
    try:
        getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return False
    return True


def cpuinfo(field: str) -> str | None:
    """`field`'s value in this machine's /proc/cpuinfo (its first processor's; never a presented CPU's), or None."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(field):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _cpu_name() -> str:
    name = cpuinfo("model name")
    if name:
        return name
    import platform

    return platform.processor() or platform.machine() or "CPU"


def _read_int(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().split()[0]
    except (OSError, IndexError):
        return None
    return int(text) if text.isdigit() else None


def _available_bytes() -> int | None:
    """MemAvailable, and at most a cgroup's limit less its usage."""
    available = None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        return None
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is not None and usage is not None and limit < 2**60:  # v1 says "no limit" with a huge one
            available = min(available, limit - usage) if available is not None else limit - usage
    return available


def _resident_bytes() -> int | None:
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


# --- the cards and CPUs users have, as data ----------------------------------------------------


def card(name: str, gib: float, capability: tuple[int, int], free_gib: float | None = None) -> GPU:
    """A card as a fresh process sees it: its memory less the CUDA context, or `free_gib` where other
    processes hold the rest."""
    total = int(gib * GIB)
    free = int(free_gib * GIB) if free_gib is not None else total - CUDA_CONTEXT_BYTES
    return GPU(name=name, total=total, free=free, capability=capability)


CARDS = {
    "4 GiB": card("GeForce GTX 1650 (laptop)", 4, (7, 5)),
    "6 GiB": card("GeForce GTX 1660", 6, (7, 5)),
    "8 GiB": card("GeForce RTX 3070", 8, (8, 6)),
    "12 GiB": card("GeForce RTX 3060", 12, (8, 6)),
    "T4": card("Tesla T4", 15, (7, 5)),
    "V100": card("Tesla V100", 16, (7, 0)),
    "24 GiB": card("GeForce RTX 4090", 24, (8, 9)),
    "80 GiB": card("H100", 80, (9, 0)),
}
# Cards others share: a lab server's H100 with 8 or 4 GiB left by other processes.
SHARED_CARDS = {
    "80 GiB, 8 GiB free": card("H100", 80, (9, 0), free_gib=8),
    "80 GiB, 4 GiB free": card("H100", 80, (9, 0), free_gib=4),
}


def notebook_with_earlier_model(gpu: GPU, held: int) -> GPU:
    """`gpu` in a notebook whose earlier cell left `held` bytes of tensors (a model) in this process."""
    return replace(gpu, free=gpu.free - held, reserved=gpu.reserved + held, allocated=gpu.allocated + held)


CPUS = {
    "native bf16": CPU(name="CPU with AVX512-BF16", bf16_native=True, available=20 * GIB, resident=GIB // 2),
    "no native bf16": CPU(name="CPU with AVX2 only", bf16_native=False, available=20 * GIB, resident=GIB // 2),
}
# Machines without a GPU that users train on: a desktop's RAM less what its system and desktop hold (1.5 GiB).
MACHINES = {
    f"{ram} GB RAM": CPU(name=f"CPU with AVX2 only, {ram} GB RAM", bf16_native=False,
                         available=ram * 10**9 - 3 * GIB // 2, resident=GIB // 2)
    for ram in (8, 16)
}
