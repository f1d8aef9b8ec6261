"""memory: checkpointing (its saved bytes, its gradients, on in training and off after)."""

import torch
from transformers import GPT2LMHeadModel

from conftest import AtBatchStart, saved_bytes, tiny_gpt2_config
from lowmem_aitextgen import aitextgen, memory


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

    memory.enable_gradient_checkpointing(model)
    ckpt_bytes, ckpt_loss = saved_tensor_bytes(model, batch)
    ckpt_loss.backward()
    assert ckpt_bytes <= 0.4 * plain_bytes, (ckpt_bytes, plain_bytes)
    torch.testing.assert_close(ckpt_loss, plain_loss)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, plain_grads[name], msg=name)

    memory.disable_gradient_checkpointing(model)
    assert not memory.is_checkpointing(model) and model.config.use_cache


def test_checkpointing_is_on_during_training_and_off_after(tokenizer_file, corpus_file):
    spy = AtBatchStart(memory.is_checkpointing)
    ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config(), gradient_checkpointing=True)
    ai.train(corpus_file, num_steps=2, save_every=0, generate_every=0, callbacks=[spy])
    assert spy.seen == [True, True]
    assert not memory.is_checkpointing(ai.model)
    assert ai.model.config._attn_implementation == "sdpa"
