"""Memory in transparent huge pages for the packed weights a step reads every token (huge_pages.py): tensors of
their own that hold what is written, in mappings asked for huge pages before any write, given back with their last
tensor; torch's memory where Linux gives no huge pages; our kernels' packed weights placed there."""

import gc

import pytest
import torch

from lowmem_aitextgen.generation import huge_pages
from lowmem_aitextgen.native import native_int8

here = pytest.mark.skipif(not huge_pages.available(), reason="Linux gives no transparent huge pages here")


def mapping_of(address: int) -> dict[str, str] | None:
    """/proc/self/smaps' fields of the mapping holding `address`, its bounds as "range" (None: not mapped)."""
    fields, inside = {}, False
    with open("/proc/self/smaps", encoding="ascii") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                if inside:
                    return fields
                low, high = (int(bound, 16) for bound in head.split("-"))
                inside, fields = low <= address < high, {"range": head}
            elif inside:
                name, _, value = line.partition(":")
                fields[name] = value.strip()
    return fields if inside else None


@here
def test_tensors_are_their_own_aligned_memory_in_a_mapping_asked_for_huge_pages():
    """Tensors of several dtypes and sizes (one past CHUNK) hold what is written to each, start 64-byte aligned,
    overlap no other, and lie in mappings Linux was asked to give huge pages (VmFlags "hg")."""
    shapes = [((1000, 3), torch.int8), ((7,), torch.bfloat16), ((33, 5), torch.float32),
              ((huge_pages.CHUNK + 5,), torch.int8), ((2, 2), torch.float32)]
    tensors = [huge_pages.empty(shape, dtype) for shape, dtype in shapes]
    for number, (tensor, (shape, dtype)) in enumerate(zip(tensors, shapes)):
        assert tensor.shape == shape and tensor.dtype == dtype and tensor.is_contiguous()
        assert tensor.data_ptr() % huge_pages.ALIGN == 0
        tensor.fill_(number + 1)
        assert "hg" in mapping_of(tensor.data_ptr())["VmFlags"].split()
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    assert all(bool((tensor == number + 1).all()) for number, tensor in enumerate(tensors))


@here
def test_a_mapping_is_given_back_with_its_last_tensor(monkeypatch):
    """Two tensors in one mapping: it stays while either does, and is unmapped once both are freed (a view let
    go gives its packed weights' memory back)."""
    monkeypatch.setattr(huge_pages, "_filling", None)  # (a mapping of their own: not another test's last one)
    first, second = huge_pages.empty((1000,), torch.int8), huge_pages.empty((1000,), torch.int8)
    address = first.data_ptr()
    assert mapping_of(address)["range"] == mapping_of(second.data_ptr())["range"]
    del first
    gc.collect()
    assert mapping_of(address) is not None and bool((second.fill_(2) == 2).all())
    del second
    gc.collect()
    assert mapping_of(address) is None


def test_where_linux_gives_no_huge_pages_it_is_torchs_memory(monkeypatch):
    monkeypatch.setattr(huge_pages, "available", lambda: False)
    tensor = huge_pages.empty((4, 4), torch.float32)
    assert tensor.shape == (4, 4) and mapping_of(tensor.data_ptr()) is not None
    assert "hg" not in mapping_of(tensor.data_ptr()).get("VmFlags", "").split()


@here
def test_a_packed_int8_weight_lies_in_huge_pages_and_is_the_weight_given():
    weight = torch.randint(-128, 128, (70, 96), dtype=torch.int8)
    packed = native_int8.pack(weight, 0.5, 3)
    assert "hg" in mapping_of(packed.weights.data_ptr())["VmFlags"].split()
    assert torch.equal(packed.int8(), weight)
