"""aitextgen.utils under its old import path; these helpers work unchanged on today's stack (download_gpt2
fetches OpenAI's TensorFlow checkpoints, which nothing here reads any more: tf_gpt2= loads the hub's copy)."""

from aitextgen.utils import (  # noqa: F401  (re-exported)
    GPT2ConfigCPU,
    GPTNeoConfigCPU,
    build_gpt2_config,
    download_file_with_progress,
    download_gpt2,
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
    "download_file_with_progress",
    "download_gpt2",
    "find_index_of_subset",
    "model_max_length",
    "reset_seed",
    "set_seed",
    "skip_special_tokens",
]
