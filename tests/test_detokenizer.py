"""detokenizer.py: a growing text decoded a line at a time is, at every token, what decoding it whole gives, for a
byte-level tokenizer (lines apart) and for one whose pieces decode otherwise (SentencePiece's: whole, always)."""

import pytest
from transformers import PreTrainedTokenizerFast

from conftest import corpus_text
from lowmem_aitextgen.generation.detokenizer import Detokenizer, splits_at_lines

TEXT = "The first line.\n 's second line, é and 日本語\n\n  indented \u00fc\nlast" * 3

pytestmark = pytest.mark.edges  # transformers' tokenizers' decoding, at the oldest too


def sentencepiece_like() -> PreTrainedTokenizerFast:
    """A real tokenizer of SentencePiece's kind (Metaspace: a piece's leading space dropped where it starts the
    decoding), trained here on Python's documentation."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.train_from_iterator([corpus_text(20_000) + TEXT], trainers.BpeTrainer(vocab_size=600,
                                                                                     special_tokens=["<unk>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>")


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece-like"])
def test_at_every_token_the_text_is_the_whole_decoding(tokenizer_file, kind):
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=tokenizer_file) if kind == "byte-level" else \
        sentencepiece_like()
    assert splits_at_lines(tokenizer) == (kind == "byte-level")
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detokenizer = Detokenizer(tokenizer)
    texts = [detokenizer.text(ids[:end]) for end in range(1, len(ids) + 1)]
    assert texts == [tokenizer.decode(ids[:end], skip_special_tokens=True) for end in range(1, len(ids) + 1)]
    assert "日本語" in texts[-1] and "\n" in texts[-1]
    if kind == "byte-level":  # a character split between tokens shows as U+FFFD until it is whole
        assert any(text.endswith("\ufffd") for text in texts)
    assert (detokenizer.start > 0) == (kind == "byte-level")  # the finished lines kept, not decoded again
