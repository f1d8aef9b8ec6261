"""Chunked LM loss: the standard loss and gradients, without full-sequence logits."""

import json

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import GPT2LMHeadModel

from conftest import saved_bytes, tiny_gpt2_config
from lowmem_aitextgen import aitextgen
from lowmem_aitextgen.training.chunked_loss import body_and_head, causal_lm_loss, chunked_lm_loss

pytestmark = pytest.mark.edges  # the loss reaches into transformers' GPT-2 head and peft's wrapper


def loss_and_grads(model, batch, chunk_tokens):
    model.zero_grad(set_to_none=True)
    loss = causal_lm_loss(model, batch, chunk_tokens)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_chunked_loss_equals_the_models_own_loss_and_gradients():
    model = GPT2LMHeadModel(tiny_gpt2_config(n_positions=128)).train()
    batch = torch.randint(0, 1000, (3, 100))
    batch[1, 50:] = 7  # repeated tokens change nothing about the shift, but make rows differ
    reference, reference_grads = loss_and_grads(model, batch, None)
    for chunk_tokens in (1, 37, 64, 10_000):  # ragged last chunk, exactly one chunk, fewer tokens than a chunk
        loss, grads = loss_and_grads(model, batch, chunk_tokens)
        torch.testing.assert_close(loss, reference, rtol=1e-6, atol=1e-6)
        assert grads.keys() == reference_grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, reference_grads[name], rtol=1e-5, atol=1e-7, msg=name)


class CountedOps(TorchDispatchMode):
    """Counts the ops (aten level, autocast's casts included) for which `counts(func, args, out)`."""

    def __init__(self, counts):
        super().__init__()
        self.counts, self.count = counts, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.count += bool(self.counts(func, args, out))
        return out


def casts_of(shape) -> CountedOps:
    """Dtype casts (aten._to_copy) of tensors shaped like `shape`."""
    return CountedOps(lambda func, args, out: func is torch.ops.aten._to_copy.default and args[0].shape == shape)


def vocab_matmuls(vocab: int) -> CountedOps:
    """Matmuls with a `vocab`-sized dimension in their output: the LM head's."""
    matmuls = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.addmm_.default)
    return CountedOps(lambda func, args, out: func in matmuls and vocab in out.shape)


def test_under_autocast_the_head_is_cast_once_for_all_chunks():
    """Not once per chunk and again per chunk's recompute, with a gradient upcast per chunk: one cast of
    the weight in forward; its gradient is summed in fp32 and given back in the weight's own dtype."""
    model = GPT2LMHeadModel(tiny_gpt2_config(n_positions=128)).train()
    batch = torch.randint(0, 1000, (2, 100))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = model(input_ids=batch, labels=batch).loss
    reference.backward()
    reference_grad = model.lm_head.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    with casts_of(model.lm_head.weight.shape) as casts:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = causal_lm_loss(model, batch, 16)  # 13 chunks
        loss.backward()
    assert casts.count == 1
    torch.testing.assert_close(loss, reference, rtol=1e-2, atol=1e-2)
    # bf16 products summed in fp32 over 13 chunks, against one bf16 matmul over the whole sequence
    assert (model.lm_head.weight.grad - reference_grad).norm() < 0.02 * reference_grad.norm()
    # a hooked head is called as a module (the hook sees every chunk), not bypassed
    calls = []
    model.lm_head.register_forward_hook(lambda module, inputs, output: calls.append(output.shape))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        causal_lm_loss(model, batch, 16)
    assert len(calls) == 13


def test_chunked_loss_reaches_lora_adapters_through_peft():
    model = GPT2LMHeadModel(tiny_gpt2_config())
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True,
                                                  lora_dropout=0.0, init_lora_weights=False,
                                                  task_type="CAUSAL_LM")).train()
    assert body_and_head(peft_model) is not None
    batch = torch.randint(0, 1000, (2, 32))
    reference, reference_grads = loss_and_grads(peft_model, batch, None)
    loss, grads = loss_and_grads(peft_model, batch, 8)
    torch.testing.assert_close(loss, reference)
    assert grads and all("lora_" in name for name in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference_grads[name], msg=name)


def test_chunked_loss_saves_at_least_70_percent_of_the_loss_memory_at_block_1024():
    """GPT-2's vocabulary, block 1024: what the loss keeps for backward (logits, log-softmax)
    is measured as the model's saved bytes minus its body's."""
    model = GPT2LMHeadModel(tiny_gpt2_config(vocab_size=50257, n_layer=1, n_positions=1024, n_embd=32,
                                             n_head=2)).train()
    batch = torch.randint(0, 50257, (1, 1024))
    body = saved_bytes(lambda: model.transformer(input_ids=batch))[0]
    standard = saved_bytes(lambda: causal_lm_loss(model, batch, None))[0] - body
    chunked = saved_bytes(lambda: causal_lm_loss(model, batch, 256))[0] - body
    assert standard > 1024 * 50257 * 4  # at least the fp32 logits
    assert chunked <= 0.3 * standard, (chunked, standard)


class StepLosses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def test_training_uses_the_chunked_loss_by_default_and_can_turn_it_off(tokenizer_file, corpus_file, caplog):
    """Same seed, same data: the chunked and the model's own loss train alike, step for step (each step's
    loss equal; the gradients are equal to rounding, test above: AdamW scales a rounding difference on a
    weight whose gradient is all but zero up to a learning rate's step, so the weights themselves are not
    compared)."""
    losses = []
    with caplog.at_level("INFO"):
        for chunked in (True, False):
            torch.manual_seed(0)
            ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config(n_positions=256))
            steps = StepLosses()
            ai.train(corpus_file, num_steps=4, save_every=0, generate_every=0, precision="32-true", seed=3,
                     chunked_loss=chunked, callbacks=[steps])
            losses.append(steps.losses)
    plans = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Training plan")]
    assert "chunked loss=on" in plans[0] and "chunked loss=off" in plans[1]
    assert len(losses[0]) == 4 and len(set(losses[0])) > 1
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)


def test_a_frozen_head_runs_once_per_chunk_and_backward_recomputes_nothing():
    """Forward makes each chunk's logits and the hidden states' gradient; backward only scales it
    (checkpointed chunks would make every chunk's logits again).  Ignored labels and a head bias
    are handled like F.cross_entropy."""
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 300).requires_grad_(False)
    hidden = torch.randn(2, 40, 16, requires_grad=True)
    labels = torch.randint(0, 300, (2, 40))
    labels[0, 10:20] = -100
    reference = F.cross_entropy(head(hidden[:, :-1]).flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    (expected,) = torch.autograd.grad(3 * reference, hidden)
    with vocab_matmuls(300) as forward_matmuls:
        loss = chunked_lm_loss(hidden, head, labels, chunk_tokens=16)  # 78 tokens: 5 chunks
    with vocab_matmuls(300) as backward_matmuls:
        (grad,) = torch.autograd.grad(3 * loss, hidden)  # the incoming gradient scales what forward made
    assert forward_matmuls.count == 5
    assert backward_matmuls.count == 0
    torch.testing.assert_close(loss, reference)
    torch.testing.assert_close(grad, expected)
    # under autocast (CUDA's bf16/fp16 path is the same code): the head in bf16, the softmax and the
    # hidden states' gradient in fp32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = chunked_lm_loss(hidden, head, labels, chunk_tokens=16)
    (grad,) = torch.autograd.grad(3 * loss, hidden)
    assert loss.dtype == grad.dtype == torch.float32
    torch.testing.assert_close(loss, reference, rtol=1e-2, atol=1e-2)
    assert (grad - expected).norm() < 0.02 * expected.norm()


def test_a_trainable_head_makes_its_gradients_in_forward_and_backward_recomputes_nothing():
    """A trainable head (a full fine-tune's): forward makes each chunk's logits and adds its share of the
    weight's and bias's gradients into one buffer each (two vocabulary-sized matmuls a chunk); backward makes
    no logits again and no weight gradient per chunk, only scales (checkpointed chunks did both)."""
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 300)
    hidden = torch.randn(2, 40, 16, requires_grad=True)
    labels = torch.randint(0, 300, (2, 40))
    labels[1, 5:9] = -100
    reference = F.cross_entropy(head(hidden[:, :-1]).flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    expected = torch.autograd.grad(3 * reference, (hidden, head.weight, head.bias))
    with vocab_matmuls(300) as forward_matmuls:
        loss = chunked_lm_loss(hidden, head, labels, chunk_tokens=16)  # 78 tokens: 5 chunks
    with vocab_matmuls(300) as backward_matmuls:
        grads = torch.autograd.grad(3 * loss, (hidden, head.weight, head.bias))
    assert (forward_matmuls.count, backward_matmuls.count) == (10, 0)
    torch.testing.assert_close(loss, reference)
    for grad, want in zip(grads, expected):
        torch.testing.assert_close(grad, want)
    assert grads[1].dtype == head.weight.dtype == torch.float32


def test_a_frozen_head_trains_under_precision_bf16_true(tokenizer_file, corpus_file):
    """Lightning's "bf16-true" makes bf16 torch's default dtype while training: the frozen-head loss (LoRA's
    path) must not build fp32-only tensors from that default."""
    ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config())
    ai.train(corpus_file, num_steps=2, lora=True, precision="bf16-true", batch_size=2, save_every=0,
             generate_every=0, seed=1, block_size=16)
    with open("trained_model/training_summary.json") as f:
        assert json.load(f)["steps"] == 2
