"""checkpointing: gradient checkpointing (its saved bytes, its gradients, on in training and off after)."""

import pytest
import torch
from transformers import GPT2LMHeadModel

from conftest import AtBatchStart, saved_bytes, tiny_gpt2_config
from lowmem_aitextgen import aitextgen
from lowmem_aitextgen.training import checkpointing

pytestmark = pytest.mark.edges  # checkpointing through transformers' GPT-2 blocks


def saved_tensor_bytes(model, batch):
    return saved_bytes(lambda: model(input_ids=batch, labels=batch, use_cache=False).loss)


def test_checkpointing_cuts_saved_activations_and_keeps_gradients():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(tiny_gpt2_config(n_layer=12, n_positions=128, n_embd=128)).train()
    batch = torch.randint(0, 1000, (2, 128))

    plain_bytes, plain_loss = saved_tensor_bytes(model, batch)
    plain_loss.backward()
    plain_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    checkpointing.enable_gradient_checkpointing(model)
    ckpt_bytes, ckpt_loss = saved_tensor_bytes(model, batch)
    ckpt_loss.backward()
    assert ckpt_bytes <= 0.4 * plain_bytes, (ckpt_bytes, plain_bytes)
    torch.testing.assert_close(ckpt_loss, plain_loss)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, plain_grads[name], msg=name)

    checkpointing.disable_gradient_checkpointing(model)
    assert not checkpointing.is_checkpointing(model) and model.config.use_cache


def test_checkpointing_is_on_during_training_and_off_after(tokenizer_file, corpus_file):
    spy = AtBatchStart(checkpointing.is_checkpointing)
    ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config(), gradient_checkpointing=True)
    ai.train(corpus_file, num_steps=2, save_every=0, generate_every=0, callbacks=[spy])
    assert spy.seen == [True, True]
    assert not checkpointing.is_checkpointing(ai.model)
    assert ai.model.config._attn_implementation == "sdpa"


def saved_activation_bytes(model, batch):
    """Bytes autograd keeps that are not the weights (saved views of a weight are no new memory)."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    total = 0

    def pack(tensor):
        nonlocal total
        if tensor.untyped_storage().data_ptr() not in weights:
            total += tensor.numel() * tensor.element_size()
        return tensor.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss
    return total, loss


def test_checkpointing_some_blocks_saves_the_estimated_bytes_with_the_same_loss_and_gradients():
    """The first k of 8 blocks recompute: what autograd keeps falls as the estimator says, and loss
    and gradients are those of checkpointing none or all."""
    import dataclasses

    from lowmem_aitextgen.training.estimate import estimate_plan, memory_plan

    config = tiny_gpt2_config(n_layer=8, n_positions=128, n_embd=128)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).train()
    batch = torch.randint(0, 1000, (1, 128))
    results = {}
    for k in (0, 3, 8):
        checkpointing.disable_gradient_checkpointing(model)
        if k:
            checkpointing.enable_gradient_checkpointing(model, k)
        model.zero_grad()
        kept, loss = saved_activation_bytes(model, batch)
        loss.backward()
        results[k] = kept, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
    plan = dataclasses.replace(memory_plan("32-true", False, None, 1, "adamw", chunked_loss=False), n_layer=8)
    estimated = {k: estimate_plan(config, dataclasses.replace(plan, checkpointed_blocks=k), 128).activations
                 for k in (0, 3, 8)}
    for k in (3, 8):
        saved = results[0][0] - results[k][0]
        assert saved == pytest.approx(estimated[0] - estimated[k], rel=0.05), k
        torch.testing.assert_close(results[k][1], results[0][1])
        for name, grad in results[0][2].items():
            torch.testing.assert_close(results[k][2][name], grad, msg=name)
    assert results[0][0] > results[3][0] > results[8][0]
