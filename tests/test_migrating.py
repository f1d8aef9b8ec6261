"""MIGRATING.md names every argument of aitextgen 0.6.0 and every new one, so it cannot drift."""

import inspect
import os
import re

import pytest
from aitextgen.aitextgen import aitextgen as original

from lowmem_aitextgen import aitextgen

GUIDE = os.path.join(os.path.dirname(__file__), os.pardir, "MIGRATING.md")
METHODS = ("__init__", "train", "generate", "generate_one", "generate_samples", "generate_to_file")


def parameters(cls, method: str) -> list[str]:
    return [name for name, p in inspect.signature(getattr(cls, method)).parameters.items()
            if name != "self" and p.kind is not p.VAR_KEYWORD]


def documented_names() -> set[str]:
    with open(GUIDE, encoding="utf-8") as f:
        text = f.read()
    names = set(re.findall(r"`(\w+)`", text))
    for call in re.findall(r"`\w+\(([^)]*)\)`", text):  # generate_to_file(n, batch_size, ...)
        names.update(re.findall(r"\w+", call))
    return names


@pytest.mark.parametrize("method", METHODS)
def test_every_aitextgen_argument_is_in_the_guide(method):
    missing = set(parameters(original, method)) - documented_names()
    assert not missing, f"MIGRATING.md lacks aitextgen.{method} arguments {sorted(missing)}"


def test_every_new_argument_is_in_the_guide():
    new = set(parameters(aitextgen, "train")) - set(parameters(original, "train"))
    assert new, "lowmem_aitextgen.train has new arguments"
    assert not new - documented_names()
