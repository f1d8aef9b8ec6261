"""run: a training run end to end: accumulation equals a larger batch, mixed precision learns and stays finite."""

import pytest
import pytorch_lightning as pl
import torch

from conftest import tiny_gpt2_config
from lowmem_aitextgen import aitextgen
from lowmem_aitextgen.TokenDataset import TokenDataset

pytestmark = pytest.mark.edges  # Lightning's Trainer, fit and strategies


class GradientRecorder(pl.Callback):
    """Copies the gradients the optimizer is about to apply, per optimizer step."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.steps.append({n: p.grad.detach().clone() for n, p in pl_module.model.named_parameters()
                           if p.grad is not None})


def recorded_gradients(tokenizer_file, corpus_file, **train_kwargs):
    torch.manual_seed(0)
    ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config())
    recorder = GradientRecorder()
    ai.train(corpus_file, num_steps=2, save_every=0, generate_every=0, seed=5, precision="32-true",
             max_grad_norm=0, callbacks=[recorder], **train_kwargs)
    return recorder.steps


def test_accumulation_equals_a_larger_batch(tokenizer_file, corpus_file):
    """4 micro-batches of 1 give the gradients of one batch of 4 (fp32, dropout off; rtol 1e-4)."""
    big = recorded_gradients(tokenizer_file, corpus_file, batch_size=4)
    accumulated = recorded_gradients(tokenizer_file, corpus_file, batch_size=1, gradient_accumulation_steps=4,
                                     pin_micro_batch=True)
    assert len(big) == len(accumulated) == 2  # num_steps counts optimizer steps
    for name, grad in big[0].items():
        torch.testing.assert_close(accumulated[0][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_bf16_mixed_on_cpu_learns_and_stays_finite(tokenizer_file, corpus_file):
    ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config(n_positions=64))
    data = TokenDataset(corpus_file, tokenizer_file=tokenizer_file, block_size=64)
    batch = torch.stack([data[i] for i in range(0, len(data), len(data) // 16)][:16])
    with torch.no_grad():
        before = ai.model(input_ids=batch, labels=batch).loss.item()
    ai.train(data, fp16=True, num_steps=80, batch_size=8, save_every=0, generate_every=0, seed=1)
    with torch.no_grad():
        after = ai.model.eval()(input_ids=batch, labels=batch).loss.item()
    assert after < before - 1.0
    assert all(torch.isfinite(p).all() for p in ai.model.parameters())
    assert next(ai.model.parameters()).dtype == torch.float32  # fp32 master weights




def test_the_plan_regroups_the_micro_batch_with_the_same_gradients(tokenizer_file, corpus_file):
    """batch_size=1 x 4 accumulation, memory to spare: the plan trains micro-batches of 4 in one step,
    whose gradients are the pinned split's (fp32, dropout off; rtol 1e-4)."""
    import json

    pinned = recorded_gradients(tokenizer_file, corpus_file, batch_size=1, gradient_accumulation_steps=4,
                                pin_micro_batch=True, output_dir="pinned")
    regrouped = recorded_gradients(tokenizer_file, corpus_file, batch_size=1, gradient_accumulation_steps=4,
                                   output_dir="regrouped")
    plans = [json.load(open(f"{run}/training_summary.json"))["plan"] for run in ("pinned", "regrouped")]
    assert [(p["micro_batch_size"], p["gradient_accumulation_steps"]) for p in plans] == [(1, 4), (4, 1)]
    for name, grad in pinned[0].items():
        torch.testing.assert_close(regrouped[0][name], grad, rtol=1e-4, atol=1e-6, msg=name)
