"""lightning_module: the loss of a micro-batch, the non-finite gradient guard, clipping, gradients freed after each step."""

import pytest
import pytorch_lightning as pl
import torch

from conftest import AtBatchStart, tiny_gpt2_config
from lowmem_aitextgen import aitextgen

pytestmark = pytest.mark.edges  # Lightning's module hooks, checkpoint hooks and loop


def test_nonfinite_gradients_are_dropped(tokenizer_file, corpus_file):
    """A step whose gradients are NaN leaves the weights untouched."""

    class Poison(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if trainer.global_step == 1:
                next(pl_module.model.parameters()).grad.fill_(float("nan"))

    class Snapshot(pl.Callback):
        def __init__(self):
            self.weights = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.weights.append(pl_module.model.lm_head.weight.detach().clone())

    snapshot = Snapshot()
    ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config())
    ai.train(corpus_file, num_steps=3, save_every=0, generate_every=0, precision="32-true",
             callbacks=[Poison(), snapshot])
    assert torch.equal(snapshot.weights[0], snapshot.weights[1])  # the poisoned step was skipped
    assert not torch.equal(snapshot.weights[1], snapshot.weights[2])
    assert all(torch.isfinite(p).all() for p in ai.model.parameters())


class GradientNormAtStep(pl.Callback):
    """The global gradient norm the optimizer stepped with (after clipping; the closure that makes the
    gradients runs inside step(), so a pre-hook would see none)."""

    def __init__(self):
        self.norms = []

    def on_train_start(self, trainer, pl_module):
        def record(optimizer, args, kwargs):
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            self.norms.append(torch.nn.utils.get_total_norm(grads).item())

        trainer.optimizers[0].register_step_post_hook(record)


@pytest.mark.parametrize("max_grad_norm", [1e-3, 1e6])
def test_max_grad_norm_clips_the_global_norm(tokenizer_file, corpus_file, max_grad_norm):
    norms = GradientNormAtStep()
    ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config())
    ai.train(corpus_file, num_steps=2, save_every=0, generate_every=0, precision="32-true",
             max_grad_norm=max_grad_norm, callbacks=[norms])
    assert len(norms.norms) == 2
    if max_grad_norm < 1:  # a fresh model's gradients are far larger: clipped to the limit
        assert norms.norms == pytest.approx([max_grad_norm] * 2, rel=1e-3)
    else:
        assert all(1e-3 < norm < max_grad_norm for norm in norms.norms)


def test_gradients_are_freed_after_each_optimizer_step(tokenizer_file, corpus_file):
    """Lightning zeroes gradients only after the next forward; ours are gone before it, and
    still add up within an accumulation window."""
    ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config())
    seen = AtBatchStart(lambda model: any(p.grad is not None for p in model.parameters()))
    ai.train(corpus_file, num_steps=2, batch_size=1, gradient_accumulation_steps=2, save_every=0, pin_micro_batch=True,
             generate_every=0, callbacks=[seen])
    assert seen.seen == [False, True, False, True]
