"""data: train_data checked against the model, and the resumable order blocks come in."""

import pytest

from conftest import corpus_text, tiny_gpt2_config
from lowmem_aitextgen.TokenDataset import TokenDataset
from lowmem_aitextgen.training.data import ResumableOrder, check_tokens


def test_an_order_is_a_pure_function_of_seed_epoch_and_rank():
    order = ResumableOrder(10, seed=3)
    first = list(iter_n(order, 25))
    assert sorted(first[:10]) == list(range(10)) and sorted(first[10:20]) == list(range(10))
    assert first[:10] != first[10:20]  # each epoch its own permutation
    assert list(iter_n(ResumableOrder(10, seed=3), 25)) == first
    resumed = ResumableOrder(10, seed=3)
    resumed.start = 13
    assert list(iter_n(resumed, 12)) == first[13:25]  # picks up exactly where 13 items were trained


def test_ranks_share_every_epoch():
    ranks = []
    for rank in range(3):
        order = ResumableOrder(10, seed=1)
        order.rank, order.world_size = rank, 3
        ranks.append(list(iter_n(order, 4)))  # 10 items over 3 ranks: 4 each, padded
    everything = sum(ranks, [])
    assert set(everything) == set(range(10)) and len(everything) == 12  # two repeated to even out the ranks


def iter_n(order, n):
    iterator = iter(order)
    return [next(iterator) for _ in range(n)]


def test_token_ids_beyond_the_vocabulary_and_blocks_beyond_the_context_are_refused():
    data = TokenDataset(texts=[corpus_text(3_000)], block_size=16)  # GPT-2's tokenizer
    with pytest.raises(ValueError, match="but the model's vocabulary has 1,000 tokens"):
        check_tokens(data, tiny_gpt2_config(vocab_size=1000))
    with pytest.raises(ValueError, match="block_size=16 is above the model's context of 8"):
        check_tokens(data, tiny_gpt2_config(vocab_size=50257, n_positions=8))
    check_tokens(data, tiny_gpt2_config(vocab_size=50257, n_positions=16))


def test_an_empty_order_is_an_error():
    with pytest.raises(ValueError, match="empty"):
        ResumableOrder(0, seed=1)
