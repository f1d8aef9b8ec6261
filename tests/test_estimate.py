"""The memory estimator against measurement: activations within 15% of the bytes autograd keeps in a real
training forward; weights, gradients and optimizer states exact."""

import dataclasses
import gc
import os
import re
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import tiny_gpt2_config
from lowmem_aitextgen import estimate_memory
from lowmem_aitextgen.hardware import format_bytes
from lowmem_aitextgen.training.adapter_settings import AdapterSettings
from lowmem_aitextgen.training.chunked_loss import causal_lm_loss
from lowmem_aitextgen.training.estimate import memory_plan, model_config
from lowmem_aitextgen.training.optimizers import build_optimizer
from lowmem_aitextgen.training.techniques import apply_memory_plan

# tests/test_packaging.py: why .ci/run's oldest-versions pass leaves this file out
NOT_AT_THE_EDGES = ("builds configs for the estimate; the models its probes run are test_checkpointing's")

SMALL = tiny_gpt2_config(n_layer=4, n_positions=512, dropout=0.1, n_embd=128)
MEDIUM = tiny_gpt2_config(vocab_size=50257, n_layer=6, n_positions=1024, dropout=0.1, n_embd=256, n_head=8)


def measured(config, block_size, batch_size, precision, checkpointing, lora, optimizer, chunked):
    """Train one real step as training does; count saved bytes, weights, gradients, optimizer states."""
    plan = memory_plan(precision, checkpointing, AdapterSettings.lora() if lora else None, batch_size, optimizer, chunked,
                       n_layer=config.n_layer)
    torch.manual_seed(0)
    model, _ = apply_memory_plan(AutoModelForCausalLM.from_config(config), plan)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = 0

    def pack(tensor):
        nonlocal saved
        if tensor.untyped_storage().data_ptr() not in weights:
            saved += tensor.numel() * tensor.element_size()
        return tensor.detach()  # kept as given, an output saved would hold its own graph node

    ids = torch.randint(config.vocab_size, (batch_size, block_size))
    autocast = torch.autocast("cpu", dtype=plan.half_dtype, enabled=precision.endswith("-mixed"))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        loss = causal_lm_loss(model, ids, plan.loss_chunk_tokens)
    loss.backward()
    optimizer_ = build_optimizer(model, 0.0, 1e-3, 1e-8, plan.optimizer)
    optimizer_.step()
    params = {id(p): p for p in model.parameters()}.values()
    return {
        "saved": saved,
        "weights": sum(p.numel() * p.element_size() for p in params),
        "gradients": sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None),
        "optimizer_states": sum(allocated_bytes(v) for state in optimizer_.state.values()
                                for v in state.values() if torch.is_tensor(v)),
    }


def allocated_bytes(tensor: torch.Tensor) -> int:
    """What a tensor really holds; a tensor subclass (torchao's 8-bit states) by its inner tensors."""
    if hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        return sum(allocated_bytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()


@pytest.mark.parametrize("config, block_size, batch_size, precision, checkpointing, lora, optimizer, chunked", [
    (SMALL, 256, 2, "32-true", False, False, "adamw", True),
    (SMALL, 512, 1, "32-true", True, False, "adamw", False),
    (SMALL, 384, 2, "bf16-mixed", True, True, "adamw", True),
    (SMALL, 256, 1, "bf16-mixed", False, False, "adafactor", True),
    (SMALL, 256, 1, "32-true", True, False, "adamw8bit", True),
    (MEDIUM, 1024, 1, "32-true", True, False, "adamw", True),
    (MEDIUM, 512, 2, "bf16-mixed", False, True, "adamw", False),
], ids=["small-fp32", "small-ckpt-unchunked", "small-lora-bf16", "small-adafactor", "small-adamw8bit",
        "medium-ckpt-1024",
        "medium-lora-unchunked"])
def test_estimate_matches_measurement(config, block_size, batch_size, precision, checkpointing, lora, optimizer,
                                      chunked):
    estimate = estimate_memory(config, block_size=block_size, batch_size=batch_size, precision=precision,
                               gradient_checkpointing=checkpointing, lora=lora, optimizer=optimizer,
                               chunked_loss=chunked)
    real = measured(config, block_size, batch_size, precision, checkpointing, lora, optimizer, chunked)
    # the issue asks for 15%; measured within 0.2% on these configs
    assert estimate.activations + estimate.logits_loss == pytest.approx(real["saved"], rel=0.05)
    assert estimate.weights == real["weights"]
    assert estimate.gradients == real["gradients"]
    assert estimate.optimizer_states == real["optimizer_states"]
    assert estimate.total > estimate.weights + estimate.activations


def test_size_names_offline_and_the_techniques_each_cut_memory():
    fp32 = estimate_memory("355M", block_size=512)
    assert fp32.weights == 354_823_168 * 4  # GPT-2 355M, lm_head tied to the embeddings
    checkpointed = estimate_memory("355M", block_size=512, gradient_checkpointing=True)
    assert checkpointed.activations < 0.2 * fp32.activations
    lora = estimate_memory("355M", block_size=512, gradient_checkpointing=True, lora=True, precision="bf16-mixed")
    assert lora.gradients < 0.02 * fp32.gradients and lora.weights < 0.55 * fp32.weights
    unchunked = estimate_memory("355M", block_size=512, chunked_loss=False)
    assert unchunked.logits_loss > 512 * 50257 * 4 > fp32.logits_loss
    text = str(lora)
    assert "activations" in text and re.search(r"total +[0-9.]+ [MG]iB", text)
    with pytest.raises(ValueError, match="'3B' is not a GPT-2 size"):
        estimate_memory("3B")


def test_cli_estimate_prints_the_table():
    result = subprocess.run([sys.executable, "-m", "lowmem_aitextgen.cli", "estimate", "124M", "--block_size=128",
                             "--lora", "--gradient_checkpointing"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "Memory estimate" in result.stdout and "optimizer states" in result.stdout and "total" in result.stdout


def test_the_probe_models_are_freed():
    """The probes run forward only, with a counting hook on what autograd saves: a hook that kept the saved
    tensor as it is would tie each output to its own graph node, a cycle no gc can break, and every probe
    model's weights would stay in memory after the estimate (0.74 GiB through a 355M run with max_memory)."""
    config = tiny_gpt2_config(vocab_size=1234, n_embd=96, n_head=4, n_positions=128)  # a shape no other tensor has

    def probe_embeddings() -> int:
        gc.collect()
        return sum(1 for o in gc.get_objects() if torch.is_tensor(o) and tuple(o.shape) == (1234, 96))

    for kwargs in (dict(), dict(precision="bf16-mixed", gradient_checkpointing=True),
                   dict(precision="bf16-mixed", lora=True, chunked_loss=False)):
        estimate_memory(config, block_size=32, **kwargs)
        assert probe_embeddings() == 0, kwargs


def test_an_estimate_leaves_the_random_state_alone():
    """train() estimates before it trains (max_memory, or a GPU's free memory): the run's seed and its
    random data order must not depend on that."""
    torch.manual_seed(5)
    expected = torch.rand(4)
    torch.manual_seed(5)
    estimate_memory(tiny_gpt2_config(n_positions=128), block_size=64, lora=True)
    assert torch.equal(torch.rand(4), expected)


# --- GPT-2 774M and 1558M: estimates from probe models (one or two blocks), nothing full-size built ---------


def test_gpt2_xl_lora_fits_an_8gb_card_with_room():
    lora = estimate_memory("1558M", block_size=1024, precision="bf16-mixed", gradient_checkpointing=True,
                           lora=True, device="cuda")
    assert lora.weights == 1_557_611_200 * 2 + lora.gradients  # a bf16 base; the adapters fp32
    assert lora.total <= 3.6 * 2**30, format_bytes(lora.total)


def test_a_gpu_plan_for_774m_within_6gib_holds_weights_in_16_bits():
    """max_memory="6GiB" on a GPU with bf16 (presented: this machine has none): AdamW, even 8-bit, does not
    fit a full fine-tune of 774M; 16-bit weights with 8-bit AdamW do, and the plan says why."""
    from lowmem_aitextgen import hardware
    from lowmem_aitextgen.training import budget

    config = model_config("774M")
    user = dataclasses.replace(memory_plan("bf16-mixed", False, None, 1, "adamw", True, device="cuda"), n_layer=36)
    with hardware.presenting(hardware.Hardware(hardware.CPUS["native bf16"], hardware.CARDS["24 GiB"])):
        chosen, estimate = budget.fit_plan(config, user, 1024, 6 * 2**30)
    assert (chosen.precision, chosen.optimizer) == ("bf16-true", "adamw8bit")
    assert estimate.total <= 6 * 2**30 and "16-bit weights with 8-bit AdamW" in chosen.chosen_because
    eight_bit = estimate_memory("774M", block_size=1024, precision="bf16-mixed", gradient_checkpointing=True,
                                optimizer="adamw8bit", device="cuda")
    assert eight_bit.total > 6 * 2**30  # why the 16-bit tier was needed


@pytest.mark.parametrize("kwargs, message", [
    ({"block_size": -5}, r"^block_size=-5 must be a positive integer"),
    ({"block_size": 0}, r"^block_size=0 must be a positive integer"),
    ({"batch_size": 0}, r"^batch_size=0 must be a positive integer"),
    ({"block_size": "abc"}, r"^block_size='abc' must be a positive integer"),
    ({"block_size": 2048}, r"^block_size=2048 is above the model's context of 1024 tokens"),
])
def test_the_estimate_checks_its_arguments_by_trains_rules(kwargs, message):
    """estimate_memory() took block_size=-5 and printed a negative overhead: it now refuses what train() refuses,
    with train()'s message."""
    with pytest.raises(ValueError, match=message):
        estimate_memory("124M", **kwargs)


def test_the_estimate_command_refuses_in_one_line(tmp_path):
    """Each refusal of `lowmem_aitextgen estimate` is one line and exit status 2, a config.json that does not
    parse included (it ended in transformers' traceback)."""
    exe = os.path.join(os.path.dirname(sys.executable), "lowmem_aitextgen")
    truncated = tmp_path / "config.json"
    truncated.write_text('{"model_type": "gpt2", "n_layer": ', encoding="utf-8")
    for args, says in ((["355M", "--block_size=-5"], "--block_size=-5 must be a positive integer"),
                       (["355M", "--batch_size=0"], "--batch_size=0 must be a positive integer"),
                       ([str(tmp_path)], "cannot be read as a model config")):
        result = subprocess.run([exe, "estimate", *args], capture_output=True, text=True, timeout=300)
        assert result.returncode == 2 and result.stdout == "", result.stderr[-2000:]
        assert says in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
