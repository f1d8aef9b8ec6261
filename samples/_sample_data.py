"""What the samples share: an example text file and the base model (or its tiny offline stand-in).

LOWMEM_AITEXTGEN_TINY=1 swaps the hub models for tiny random GPT-2s and the
training for a few steps, so CI runs every sample offline in seconds.
"""

import os
import pydoc_data.topics

from transformers import GPT2Config

from lowmem_aitextgen import aitextgen

TINY = os.environ.get("LOWMEM_AITEXTGEN_TINY") == "1"
HUB_IDS = {"124M": "gpt2", "355M": "gpt2-medium", "774M": "gpt2-large", "1558M": "gpt2-xl"}


def example_text_file(path: str = "input.txt", n_chars: int = 200_000) -> str:
    """Python's own documentation as a text file: real prose, no download."""
    text = "\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    with open(path, "w", encoding="utf-8") as f:
        f.write(text[: 20_000 if TINY else n_chars])
    return path


def base_model(size: str) -> aitextgen:
    """OpenAI's GPT-2 of `size` from the hub, or a tiny random GPT-2 with its tokenizer when TINY."""
    if TINY:
        return aitextgen(config=GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=128))
    return aitextgen(model=HUB_IDS[size], to_gpu=True)
