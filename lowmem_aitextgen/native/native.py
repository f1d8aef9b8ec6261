"""lowmem_aitextgen's own C kernels (int8_linear.c: int8_kernels' native product; one_token_attention.c: the
stepping decoder's one-token attention; gpt2_block.c: a step's GPT-2 blocks in one call, and its layer norm;
top_k.c: sampling's top-k and its draw among them; bf16_linear.c: the bf16 view's products), built at first use by
the machine's gcc into one library, called through ctypes by native_int8.py, native_attention.py, native_block.py,
native_top_k.py and native_bf16.py.

| what          | how                                                                                           |
|---------------|-----------------------------------------------------------------------------------------------|
| build         | `gcc -O3 -fopenmp -ffp-contract=off -shared ... -lm`, each path's instructions by target       |
|               | attributes (no -march: the library runs on any x86-64 CPU), once a machine: into the user's    |
|               | cache, named by a hash of the sources, the compiler and its flags, written atomically (KERNELS) |
| threads       | OpenMP, `torch.get_num_threads()` of them; the library links libgomp.so.1, which resolves to   |
|               | the copy torch loaded (the same soname): one thread pool with torch's                          |
| instructions  | each caller checks the CPU's flags (`cpu_flags`) before a path runs: read from the CPU itself,  |
|               | not hardware.cpu(), as fbgemm and oneDNN choose their own kernels (a presented CPU must not run |
|               | instructions the real one lacks)                                                               |
| not built     | not Linux on x86-64, a CPU without AVX2, no gcc, a failed build (said once, INFO): torch's      |
|               | kernels (int8_kernels.product_kernel, stepping.Step's attention and calls one by one, sampling's |
|               | top-k and draw)                                                                                 |
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .. import hardware

logger = logging.getLogger("lowmem_aitextgen")

HERE = Path(__file__).parent / "csrc"  # the C sources and their headers
SOURCES = (HERE / "int8_linear.c", HERE / "one_token_attention.c", HERE / "gpt2_block.c", HERE / "bf16_linear.c",
           HERE / "top_k.c")
HEADERS = (HERE / "lowmem_kernels.h", HERE / "native_math.h")  # (their bytes are in the library's name too: a changed header rebuilds it)
FLAGS = ("-O3", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off")
LIBRARIES = ("-lm",)  # (sqrtf, exp: named, not left to the process to have loaded)
KERNELS = "kernels"  # the cache's folder for built libraries


@functools.cache
def built() -> ctypes.CDLL | None:
    """The library, built once a machine (module docstring); None where it cannot be (said once, why)."""
    why = _not_buildable()
    if why is None:
        try:
            return _loaded(_library_file())
        except (OSError, subprocess.SubprocessError) as error:
            said = (str(error).strip().splitlines() or [""])[-1]
            why = f"building it failed ({type(error).__name__}: {said})"
    logger.info(f"int8 products, attention and top-k on torch's kernels: lowmem_aitextgen's own kernels are not used "
                f"here: {why}.")
    return None


# LOWMEM_AITEXTGEN_MAX_ISA=avx2 holds our kernels to AVX2 on a CPU that has more (as ONEDNN_MAX_CPU_ISA=AVX2 holds
# oneDNN's, ATEN_CPU_CAPABILITY=avx2 torch's): an AVX-512 machine then runs the paths an AVX2-only CPU takes
MAX_ISA = "LOWMEM_AITEXTGEN_MAX_ISA"
ABOVE_AVX2 = ("avx512", "amx")  # the prefixes of the flags an AVX2 cap leaves out


def cpu_flags() -> set[str]:
    """The CPU's flags as Linux lists them (/proc/cpuinfo), less those above the cap MAX_ISA names."""
    flags = set((hardware.cpuinfo("flags") or "").split())
    cap = os.environ.get(MAX_ISA, "").strip().lower()
    if cap == "avx2":
        flags = {flag for flag in flags if not flag.startswith(ABOVE_AVX2)}
    elif cap:
        raise ValueError(f"{MAX_ISA}={cap!r}: the one cap taken is avx2 (our kernels held to AVX2); unset it for "
                         "every path this CPU has.")
    return flags


# The CPU flags (Linux's names) each path of our kernels needs: one table, read by cpu_runs
PATH_FLAGS = {
    "any": ("avx2",),  # the library itself (top_k.c, every kernel's AVX2 code)
    "attention": ("avx512f",),  # one_token_attention.c, and so gpt2_block.c's call
    "bf16": ("avx512f", "avx512bw", "avx512vl", "avx512_bf16"),  # bf16_linear.c
    "int8 avx2": ("avx2",),  # int8_linear.c's paths
    "int8 vnni": ("avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
    "int8 amx": ("amx_tile", "amx_int8"),  # (and Linux's grant of the tile state: native_int8.cpu_paths)
}


@functools.cache
def cpu_runs(path: str) -> bool:
    """Whether this CPU (its flags, less those MAX_ISA caps) runs `path` of our kernels (PATH_FLAGS); whether they
    are built is built()'s to say."""
    flags = cpu_flags()
    return all(flag in flags for flag in PATH_FLAGS[path])


def _not_buildable() -> str | None:
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "AMD64"):
        return f"they are built for Linux on x86-64, not {sys.platform} on {platform.machine()}"
    if not cpu_runs("any"):
        return "this CPU has no AVX2"
    if shutil.which("gcc") is None:
        return "no gcc on the PATH"
    return None


def _library_file() -> Path:
    """The built library's path, building it where it is not in the cache yet."""
    version = subprocess.run(["gcc", "--version"], capture_output=True, text=True, check=True).stdout
    texts = b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    key = hashlib.sha256(texts + version.encode() + " ".join(FLAGS + LIBRARIES).encode()).hexdigest()[:16]
    folder = _cache_folder()
    target = folder / f"lowmem_kernels-{key}.so"
    if not target.exists():
        fd, partial = tempfile.mkstemp(suffix=".so", dir=folder)
        os.close(fd)
        try:
            subprocess.run(["gcc", *FLAGS, "-I", str(HERE), *map(str, SOURCES), *LIBRARIES, "-o", partial],
                           capture_output=True, text=True, check=True)
            os.replace(partial, target)  # another process building it at once writes the same bytes
        except subprocess.CalledProcessError as error:
            raise subprocess.SubprocessError(error.stderr.strip() or f"gcc exited with {error.returncode}") from None
        finally:
            if os.path.exists(partial):
                os.remove(partial)
    return target


def _cache_folder() -> Path:
    """The user's cache folder for built libraries (XDG_CACHE_HOME's), else a temporary one for this process."""
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    folder = Path(home) / "lowmem_aitextgen" / KERNELS
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if os.access(folder, os.W_OK):
            return folder
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix="lowmem_aitextgen-kernels-"))


def _loaded(path: Path) -> ctypes.CDLL:
    return ctypes.CDLL(str(path))


# A function's signature as ctypes takes it, (restype, argtypes), in the kinds lowmem_kernels.h's C types are: every
# pointer POINTER, int INT, long LONG, float FLOAT, double DOUBLE (tests/test_native_boundary.py reads the header)
Signature = tuple[Any, list[Any]]
POINTER, INT, LONG, FLOAT, DOUBLE = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float, ctypes.c_double
_declared: dict[int, tuple[ctypes.CDLL, set[int]]] = {}  # a library's id -> it, and the signatures declared on it


def bound(signatures: Mapping[str, Signature]) -> ctypes.CDLL | None:
    """The library (built()) with `signatures`, a wrapper module's SIGNATURES, declared on its functions (once a
    library); None where it is not built."""
    library = built()
    if library is None:
        return None
    held = _declared.setdefault(id(library), (library, set()))[1]
    if id(signatures) not in held:
        for name, (restype, argtypes) in signatures.items():
            function = getattr(library, name)
            function.restype, function.argtypes = restype, argtypes
        held.add(id(signatures))
    return library
