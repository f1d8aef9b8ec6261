"""train(torch_compile=): the blocks (or the whole model) compiled while training, eager again after.

torch.compile's default backend builds C++ on CPU (minutes for a first step here); these tests use
"aot_eager" (compiling.BACKEND): the same graph capture by dynamo and AOT autograd, run by eager kernels.
benchmarks/gpu_session.sh's compile group measures inductor on a GPU."""

import pytest
import torch

from conftest import AtBatchStart, snapshot, tiny_gpt2_config
from lowmem_aitextgen import aitextgen
from lowmem_aitextgen.training import compiling
from lowmem_aitextgen.training.checkpointing import transformer_blocks


@pytest.fixture
def traced(monkeypatch):
    monkeypatch.setattr(compiling, "BACKEND", "aot_eager")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compiled_parts(model):
    """Which of (each block, the model's body) run a compiled forward now."""
    return [block._compiled_call_impl is not None for block in transformer_blocks(model)], \
        model.transformer._compiled_call_impl is not None


def graphs_captured() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("how, expected", [(True, ([True, True], False)), ("model", ([False, False], True))])
def test_a_compiled_run_trains_as_the_eager_one_and_leaves_an_eager_model(traced, base_folder, tokenizer_file,
                                                                           small_data, how, expected):
    """The same seed and data: a compiled run reaches the eager run's weights (the same math, traced and
    decomposed: rounding apart); while training the plan's parts are compiled, after it none, and the model
    generates."""
    weights = {}
    for compile_ in (False, how):
        ai = aitextgen(model_folder=base_folder, tokenizer_file=tokenizer_file)
        seen = AtBatchStart(compiled_parts)
        torch._dynamo.utils.counters.clear()
        ai.train(small_data, output_dir=f"out_{compile_}", num_steps=3, save_every=0, generate_every=0, seed=1,
                 batch_size=2, torch_compile=compile_, callbacks=[seen], learning_rate=1e-3)
        assert seen.seen == [expected if compile_ else ([False, False], False)] * 3
        assert (graphs_captured() > 0) == bool(compile_)  # the step ran what was compiled
        assert compiled_parts(ai.model) == ([False, False], False)
        assert ai.generate_one(max_length=12, seed=1)
        weights[compile_] = {name: value.clone() for name, value in ai.model.state_dict().items()}
    before = aitextgen(model_folder=base_folder, tokenizer_file=tokenizer_file).model.state_dict()
    assert any(not torch.equal(before[name], value) for name, value in weights[how].items())  # it trained
    for name, value in weights[how].items():
        torch.testing.assert_close(value, weights[False][name], rtol=1e-4, atol=1e-5, msg=name)


def test_torch_compile_is_refused_with_a_sharded_model_and_a_value_it_does_not_know(finished, tokenizer_file,
                                                                                    small_data):
    before = snapshot(finished)
    ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config())
    with pytest.raises(ValueError, match="torch_compile='fast' must be one of True, False, 'blocks', 'model'"):
        ai.train(small_data, output_dir=finished, num_steps=1, torch_compile="fast")
    with pytest.raises(ValueError, match="torch_compile=True cannot be used with strategy='fsdp'.*strategy='ddp'"):
        ai.train(small_data, output_dir=finished, num_steps=1, torch_compile=True, strategy="fsdp", devices=2)
    assert snapshot(finished) == before
