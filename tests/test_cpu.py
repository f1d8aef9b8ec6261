"""cpu: the cheap CPU dropout, the one-kernel GELU and the adapters without upcast."""

import pytest
import torch
from transformers import GPT2LMHeadModel
from transformers.activations import ACT2FN, NewGELUActivation

from conftest import AtBatchStart, tiny_gpt2_config
from lowmem_aitextgen import aitextgen
from lowmem_aitextgen.lora import add_lora
from lowmem_aitextgen.plan import LoraSettings
from lowmem_aitextgen.cpu import ATTENTION, CpuDropout, UpcastOutsideAutocast, fast_dropout, gpt2_attention, \
    keep_mask, use_cpu_speedups


@pytest.mark.parametrize("p", [0.05, 0.1, 0.5])
def test_fast_dropout_drops_p_and_keeps_the_expectation(p):
    x = torch.ones(1000, 1000)
    y = fast_dropout(x, p)
    dropped = (y == 0).float().mean().item()
    assert abs(dropped - p) < 0.003  # 1e6 draws: > 6 standard deviations
    kept = y[y != 0]
    assert torch.allclose(kept, torch.full_like(kept, 1 / (1 - p)), rtol=1e-4)
    assert abs(y.mean().item() - 1.0) < 0.01


def test_fast_dropout_is_seeded_and_its_gradient_uses_the_same_mask():
    torch.manual_seed(3)
    x = torch.ones(64, 33, requires_grad=True)  # 2112 elements: not a multiple of the 4 lanes per draw
    y = fast_dropout(x, 0.3)
    y.backward(torch.full_like(y, 2.0))
    assert torch.equal(x.grad, 2 * y.detach())
    torch.manual_seed(3)
    assert torch.equal(fast_dropout(torch.ones(64, 33), 0.3), y.detach())
    assert not torch.equal(fast_dropout(torch.ones(64, 33), 0.3), y.detach())


def test_fast_dropout_near_one_keeps_a_level_and_stays_finite():
    y = fast_dropout(torch.ones(100_000), 0.999999)
    assert torch.isfinite(y).all() and (y == 0).float().mean() > 0.999


def test_fast_dropout_keeps_16_bit_dtypes_and_leaves_eval_alone():
    x = torch.randn(100, 100, dtype=torch.bfloat16)
    y = fast_dropout(x, 0.1)
    assert y.dtype == torch.bfloat16
    kept = y != 0
    assert torch.allclose(y[kept].float(), x[kept].float() / 0.9, rtol=1e-2)
    assert fast_dropout(x, 0.1, training=False) is x
    assert fast_dropout(x, 0.0) is x


def test_gpt2_attention_drops_the_attention_probabilities():
    """softmax(q k^T / sqrt(d) + mask), fast_dropout's mask on the probabilities, times v."""
    module = GPT2LMHeadModel(tiny_gpt2_config(dropout=0.2)).transformer.h[0].attn.train()
    q, k, v = (torch.randn(1, 4, 16, 8) for _ in range(3))
    causal = torch.full((16, 16), torch.finfo(torch.float32).min).triu(1)[None, None]
    probabilities = torch.softmax(q @ k.transpose(-1, -2) / 8**0.5 + causal, dim=-1)
    torch.manual_seed(7)
    keep, scale = keep_mask(probabilities, 0.2)
    expected = (probabilities * keep * scale) @ v
    torch.manual_seed(7)
    output, _ = gpt2_attention(module, q, k, v, causal, dropout=0.2)
    assert torch.allclose(output, expected.transpose(1, 2), atol=1e-6)
    # nothing dropped: SDPA
    no_dropout, _ = gpt2_attention(module, q, k, v, causal, dropout=0.0)
    assert torch.allclose(no_dropout, (probabilities @ v).transpose(1, 2), atol=1e-5)


def test_gpt2_attention_under_autocast_stays_in_bf16():
    """A full fine-tune's mask is fp32: the scores, probabilities and mask stay bf16 anyway (nothing
    (heads x seq x seq) in fp32 is made or saved for backward), and the result is the fp32 math's."""
    module = GPT2LMHeadModel(tiny_gpt2_config(dropout=0.2)).transformer.h[0].attn.train()
    q, k, v = (torch.randn(1, 4, 16, 8, requires_grad=True) for _ in range(3))
    causal = torch.full((16, 16), torch.finfo(torch.float32).min).triu(1)[None, None]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.manual_seed(7)
            output, probabilities = gpt2_attention(module, q.bfloat16(), k.bfloat16(), v.bfloat16(), causal,
                                                   dropout=0.2)
    assert output.dtype == probabilities.dtype == torch.bfloat16
    assert {t.dtype for t in saved if t.shape[-2:] == (16, 16)} == {torch.bfloat16}
    torch.manual_seed(7)
    expected, _ = gpt2_attention(module, q, k, v, causal, dropout=0.2)  # fp32, no autocast: the same mask
    torch.testing.assert_close(output.float(), expected, rtol=0.05, atol=0.05)
    output.float().sum().backward()
    assert all(torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0 for t in (q, k, v))


def test_checkpointing_recomputes_the_same_masks():
    """Checkpointing restores torch's RNG for the recompute, so the recomputed block draws the masks
    the forward drew: loss and gradients equal the run without checkpointing."""
    model = GPT2LMHeadModel(tiny_gpt2_config(n_layer=3, dropout=0.2)).train()
    use_cpu_speedups(model)
    ids = torch.randint(1000, (2, 32))

    def loss_and_gradients(checkpointing: bool):
        model.zero_grad()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        torch.manual_seed(11)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    plain_loss, plain = loss_and_gradients(False)
    checkpointed_loss, checkpointed = loss_and_gradients(True)
    assert torch.equal(plain_loss, checkpointed_loss)
    for a, b in zip(plain, checkpointed):
        assert torch.allclose(a, b, atol=1e-6)


def test_speedups_compute_the_same_function_and_undo_completely():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(tiny_gpt2_config(dropout=0.1)).eval()
    ids = torch.randint(1000, (1, 32))
    with torch.no_grad():
        before = model(ids).logits
    undo = use_cpu_speedups(model)
    block = model.transformer.h[0]
    assert isinstance(block.attn.resid_dropout, CpuDropout) and isinstance(model.transformer.drop, CpuDropout)
    assert not isinstance(block.mlp.act, NewGELUActivation)
    assert model.config._attn_implementation == ATTENTION
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, before, atol=1e-5)  # eval: no dropout; GELU: same formula
        model.train()
        assert not torch.allclose(model(ids).logits, model(ids).logits)  # training: dropout is on
    undo()
    assert type(block.attn.resid_dropout) is torch.nn.Dropout and isinstance(block.mlp.act, NewGELUActivation)
    assert model.config._attn_implementation == "sdpa"


def test_cpu_training_uses_the_speedups_and_gives_the_model_back(tokenizer_file, corpus_file):
    ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config(dropout=0.1))
    spy = AtBatchStart(lambda model: (type(model.transformer.h[0].attn.resid_dropout).__name__,
                                      model.transformer.h[0].attn.resid_dropout.training,
                                      type(model.transformer.h[0].mlp.act).__name__,
                                      model.config._attn_implementation))
    # a sample after step 1 generates with the swaps in place (eval: SDPA, no dropout)
    ai.train(corpus_file, num_steps=2, save_every=0, generate_every=1, callbacks=[spy])
    assert spy.seen == [("CpuDropout", True, type(ACT2FN["gelu_pytorch_tanh"]).__name__, ATTENTION)] * 2
    block = ai.model.transformer.h[0]
    assert type(block.attn.resid_dropout) is torch.nn.Dropout and isinstance(block.mlp.act, NewGELUActivation)
    assert ai.model.config._attn_implementation == "sdpa"


def test_lora_adapters_skip_the_upcast_only_under_autocast(tokenizer_file, corpus_file):
    """Under autocast peft's upcast of adapter inputs is left out; without autocast (a sample
    generated during training, fp32 training) peft upcasts as always; the undo puts peft's flag back."""
    flag = UpcastOutsideAutocast()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not flag
    assert flag
    ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config(dropout=0.1))

    def flags(model):
        return {type(m.cast_input_dtype_enabled).__name__ for m in model.modules()
                if hasattr(m, "cast_input_dtype_enabled")}

    spy = AtBatchStart(flags)
    # the sample after step 1 runs the bf16 base with fp32 adapters outside autocast
    ai.train(corpus_file, num_steps=2, save_every=0, generate_every=1, lora=True, precision="bf16-mixed",
             callbacks=[spy])
    assert spy.seen == [{"UpcastOutsideAutocast"}] * 2
    model = add_lora(GPT2LMHeadModel(tiny_gpt2_config()), LoraSettings())
    undo = use_cpu_speedups(model)
    assert flags(model) == {"UpcastOutsideAutocast"}
    undo()
    assert flags(model) == {"bool"}
