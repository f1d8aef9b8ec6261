"""aitextgen.tokenizers under its old import path; train_tokenizer works unchanged on tokenizers 0.2x."""

from aitextgen.tokenizers import train_tokenizer  # noqa: F401  (re-exported)

__all__ = ["train_tokenizer"]
