"""lowmem_aitextgen: aitextgen's API on today's stack, fine-tuning GPT-2 in little memory."""

from . import _compat

_compat.install()

from .aitextgen import aitextgen  # noqa: E402
from .TokenDataset import TokenDataset, merge_datasets  # noqa: E402
from .tokenizers import train_tokenizer  # noqa: E402
from .training.estimate import MemoryEstimate, estimate_memory  # noqa: E402

__version__ = "0.1.0"
__all__ = ["aitextgen", "TokenDataset", "merge_datasets", "train_tokenizer", "estimate_memory", "MemoryEstimate"]
