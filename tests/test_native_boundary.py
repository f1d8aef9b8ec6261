"""The boundary to C: lowmem_kernels.h declares every function the library exports, once, every C file includes it,
each Python wrapper's ctypes signature is the header's, and the structs Python fills lay out as the C's.  A mismatch
there is undefined behaviour, not an error: these tests are what catches it."""

import ctypes
import pathlib
import re

import pytest

from lowmem_aitextgen.native import native, native_attention, native_bf16, native_block, native_int8, native_top_k

SOURCES = pathlib.Path(native.__file__).parent / "csrc"
HEADER = SOURCES / "lowmem_kernels.h"
WRAPPERS = (native_int8, native_attention, native_bf16, native_block, native_top_k)
KINDS = {"int": native.INT, "long": native.LONG, "float": native.FLOAT, "double": native.DOUBLE}
PROTOTYPE = re.compile(r"^(int|void)\s+(lowmem_\w+)\(([^)]*)\);", re.MULTILINE)
DEFINITION = re.compile(r"^(?:__attribute__\(\(.*?\)\)\s+)?(?:int|void)\s+(lowmem_\w+)\(([^)]*)\)\s*\{", re.MULTILINE)


def ctypes_kind(parameter: str) -> object:
    """The ctypes kind of a C parameter as the header writes it ("const float *x": POINTER)."""
    declared = parameter.rsplit(None, 1)[0] if "*" not in parameter else "*"
    return native.POINTER if "*" in declared else KINDS[declared.replace("const", "").strip()]


def header_signatures() -> dict[str, tuple[object, list[object]]]:
    """Each function lowmem_kernels.h declares, as (restype, argtypes) in ctypes' kinds."""
    found = {}
    for result, name, parameters in PROTOTYPE.findall(HEADER.read_text()):
        listed = [" ".join(p.split()) for p in parameters.split(",") if p.strip() not in ("", "void")]
        found[name] = (None if result == "void" else native.INT, [ctypes_kind(p) for p in listed])
    return found


def test_the_reader_reads_a_prototype_as_ctypes_does():
    assert ctypes_kind("const float *x") is native.POINTER and ctypes_kind("void *const *keys") is native.POINTER
    assert ctypes_kind("long c_row") is native.LONG and ctypes_kind("float eps") is native.FLOAT


def test_each_wrappers_signatures_are_the_headers_and_every_export_has_one():
    declared = header_signatures()
    assert len(declared) >= 10
    wrapped = {}
    for module in WRAPPERS:
        for name, signature in module.SIGNATURES.items():
            assert name not in wrapped, f"{name} declared by two wrappers"
            wrapped[name] = signature
    assert wrapped.keys() == declared.keys()
    for name, (restype, argtypes) in wrapped.items():
        assert (restype, list(argtypes)) == declared[name], name


def test_every_c_file_includes_the_header_defines_what_it_declares_and_declares_nothing_itself():
    declared = set(header_signatures())
    defined = set()
    for source in sorted(SOURCES.glob("*.c")):
        text = source.read_text()
        assert '#include "lowmem_kernels.h"' in text, source.name
        assert not PROTOTYPE.findall(text), f"{source.name} declares a prototype of its own"
        defined |= {name for name, _ in DEFINITION.findall(text)}
    assert defined == declared
    assert native.SOURCES and set(native.SOURCES) == set(SOURCES.glob("*.c")) and HEADER in native.HEADERS


@pytest.mark.skipif(native.built() is None, reason="our kernels need gcc on x86-64 Linux with AVX2")
def test_the_structs_python_fills_lay_out_as_the_cs():
    """sizeof and offsetof of lowmem_product and lowmem_gpt2_block, from the library, against native_block's
    ctypes Structures, field by field in their order."""
    out = (ctypes.c_long * 64)()
    count = native.bound(native_block.SIGNATURES).lowmem_layout(out, 64)
    ours = []
    for struct in (native_block._Product, native_block._Block):
        ours += [ctypes.sizeof(struct)] + [getattr(struct, name).offset for name, _ in struct._fields_]
    assert list(out[:count]) == ours
