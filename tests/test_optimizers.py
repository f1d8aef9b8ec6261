"""optimizers: Adafactor's small state, torchao's 8-bit AdamW (its loss curve, its update compiled once)."""

import pytest
import pytorch_lightning as pl
import torch

from conftest import tiny_gpt2_config
from lowmem_aitextgen import TokenDataset, aitextgen

pytestmark = pytest.mark.edges  # Lightning's optimizer hooks and transformers' Adafactor


def test_adafactor_trains_with_little_optimizer_state(corpus_file, tokenizer_file):
    ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config())
    states = []

    class OptimizerState(pl.Callback):
        def on_train_end(self, trainer, pl_module):
            optimizer = trainer.optimizers[0]
            states.append((type(optimizer).__name__, sum(v.numel() for s in optimizer.state.values()
                                                          for v in s.values() if torch.is_tensor(v))))

    data = TokenDataset(corpus_file, tokenizer_file=tokenizer_file, block_size=32)
    batch = torch.stack([data[i] for i in range(0, len(data), max(1, len(data) // 32))])
    before = ai.model(input_ids=batch, labels=batch).loss.item()
    ai.train(data, num_steps=30, learning_rate=1e-2, batch_size=8, save_every=0, generate_every=0,
             optimizer="adafactor", callbacks=[OptimizerState()])
    with torch.no_grad():
        after = ai.model(input_ids=batch, labels=batch).loss.item()
    assert after < before - 0.5
    name, state_numel = states[0]
    assert name == "Adafactor" and state_numel < 0.1 * sum(p.numel() for p in ai.model.parameters())


class LossRecorder(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.optimizer: torch.optim.Optimizer | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"].item())

    def on_train_end(self, trainer, pl_module) -> None:
        self.optimizer = trainer.optimizers[0]


def test_adamw8bit_follows_the_fp32_adamw_loss_curve(corpus_file, tokenizer_file):
    """Same data, seed and start: torchao's 8-bit AdamW keeps its states in 8 bits, and its
    losses stay within 3% of fp32 AdamW's at every one of 40 steps (measured: within 0.05%)."""
    from torchao.optim.subclass_8bit import OptimState8bit

    data = TokenDataset(corpus_file, tokenizer_file=tokenizer_file, block_size=32)
    config = tiny_gpt2_config(n_embd=128)
    curves = {}
    for optimizer in ("adamw", "adamw8bit"):
        torch.manual_seed(0)
        ai = aitextgen(tokenizer_file=tokenizer_file, config=config)
        recorder = LossRecorder()
        ai.train(data, num_steps=40, learning_rate=3e-3, batch_size=4, save_every=0, generate_every=0,
                 seed=3, optimizer=optimizer, precision="32-true", callbacks=[recorder])
        curves[optimizer] = recorder.losses
    states = [v for s in recorder.optimizer.state.values() for v in s.values()]
    assert sum(isinstance(v, OptimState8bit) for v in states) >= 2 * 2 * 4  # 2 blocks x 4 matrices x 2 moments
    assert curves["adamw8bit"][-1] < curves["adamw8bit"][0] - 0.5  # it learns
    for step, (full, eight) in enumerate(zip(curves["adamw"], curves["adamw8bit"])):
        assert eight == pytest.approx(full, rel=0.03), step


def test_adamw8bit_is_torchaos_update_with_its_wrapper_built_once(monkeypatch):
    """The same weights and states as torchao's own AdamW8bit, bit for bit, with a learning-rate change
    between steps; its steps call torch.compile for every tensor, ours never (the wrapper is built once)."""
    from torchao.optim import AdamW8bit

    from lowmem_aitextgen.training.optimizers import build_optimizer, parameter_groups

    compile_calls = []
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda *args, **kwargs: compile_calls.append(1) or compile_(*args, **kwargs))
    models, optimizers = [], []
    for make in (lambda m: AdamW8bit(parameter_groups(m, 0.05), lr=1e-3, eps=1e-8, block_size=256),
                 lambda m: build_optimizer(m, 0.05, 1e-3, 1e-8, "adamw8bit")):
        torch.manual_seed(0)
        models.append(torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.LayerNorm(128), torch.nn.Linear(128, 64)))
        optimizers.append(make(models[-1]))
    calls_in_steps = [[], []]
    for step in range(3):
        torch.manual_seed(step)
        gradients = [torch.randn_like(p) for p in models[0].parameters()]
        for model, optimizer, calls in zip(models, optimizers, calls_in_steps):
            for param, gradient in zip(model.parameters(), gradients):
                param.grad = gradient.clone()
            optimizer.param_groups[0]["lr"].fill_(1e-3 / (step + 1))
            before = len(compile_calls)
            optimizer.step()
            calls.append(len(compile_calls) - before)
    for reference, ours in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(reference, ours)
    for reference, ours in zip(*(list(o.state.values()) for o in optimizers)):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(reference[key].dequantize(), ours[key].dequantize())
    assert calls_in_steps == [[6, 6, 6], [0, 0, 0]]  # torchao: one per tensor (2 weights, 2 biases, LayerNorm's 2)


def test_adamw8bit_falls_back_to_torchaos_own_step_when_its_update_changes(monkeypatch):
    """The compiled-once step calls torchao's update by its 0.18 arguments: another torchao's gets its own loop."""
    import torchao.optim.adam
    from torchao.optim import AdamW8bit

    from lowmem_aitextgen.training import optimizers

    monkeypatch.setattr(torchao.optim.adam, "single_param_adam", lambda p, grad, state: None)
    optimizers._adamw8bit_compiled_once.cache_clear()
    try:
        optimizer = optimizers.build_optimizer(torch.nn.Linear(64, 64), 0.0, 1e-3, 1e-8, "adamw8bit")
        assert type(optimizer) is AdamW8bit
    finally:
        monkeypatch.undo()
        optimizers._adamw8bit_compiled_once.cache_clear()
    assert type(optimizers.build_optimizer(torch.nn.Linear(64, 64), 0.0, 1e-3, 1e-8, "adamw8bit")) is not AdamW8bit


def losses_of(corpus_file, tokenizer_file, seed, precision, optimizer, learning_rate, steps=60, **options):
    """(the losses, the object) of a tiny model's run; precision/optimizer None: left to the planner."""
    data = TokenDataset(corpus_file, tokenizer_file=tokenizer_file, block_size=32)
    torch.manual_seed(0)  # the same initial weights every time; `seed` draws the data order and dropout
    ai = aitextgen(tokenizer_file=tokenizer_file, config=tiny_gpt2_config(n_embd=128, dropout=0.1))
    recorder = LossRecorder()
    chosen = {"optimizer": optimizer, "precision": precision}
    ai.train(data, num_steps=steps, learning_rate=learning_rate, batch_size=4, save_every=0, generate_every=0,
             seed=seed, gradient_checkpointing=False, pin_micro_batch=True, callbacks=[recorder],
             output_dir=f"run_{seed}_{precision}", **{k: v for k, v in chosen.items() if v is not None}, **options)
    return recorder.losses, ai


def tail_mean(losses, n=15):
    return sum(losses[-n:]) / n


def test_bf16_weights_with_stochastic_rounding_follow_fp32_adamw_within_seed_noise(corpus_file, tokenizer_file):
    """Weights and gradients held in bf16 (no fp32 copy) with 8-bit AdamW's stochastically rounded updates
    learn as fp32 AdamW does: the last steps' mean loss is as close to fp32's as two fp32 seeds are."""
    fp32 = [tail_mean(losses_of(corpus_file, tokenizer_file, seed, "32-true", "adamw", 3e-3)[0]) for seed in (1, 2)]
    sixteen, ai = losses_of(corpus_file, tokenizer_file, 1, "bf16-true", "adamw8bit", 3e-3)
    assert next(ai.model.parameters()).dtype == torch.bfloat16  # trained in bf16 throughout
    seed_noise = abs(fp32[0] - fp32[1])
    assert tail_mean(sixteen) < sixteen[0] - 0.5  # it learns (fp32 goes from 6.9 to 5.9 here)
    assert abs(tail_mean(sixteen) - fp32[0]) <= 2 * seed_noise + 0.02, (tail_mean(sixteen), fp32)


def test_without_stochastic_rounding_small_updates_vanish_in_bf16():
    """Updates far under half a bf16 step: rounded to nearest, most weights never move; rounded
    stochastically (what build_optimizer sets), the weights move as far as the updates add up to."""
    from lowmem_aitextgen.training.optimizers import build_optimizer

    learning_rate, steps = 1e-5, 20
    moved = {}
    for stochastic in (True, False):
        torch.manual_seed(0)
        layer = torch.nn.Linear(256, 256, bias=False).to(torch.bfloat16)
        start = layer.weight.detach().float().clone()
        optimizer = build_optimizer(layer, 0.0, learning_rate, 1e-8, "adamw8bit")
        assert optimizer.bf16_stochastic_round
        optimizer.bf16_stochastic_round = stochastic
        for _ in range(steps):
            layer.weight.grad = torch.ones_like(layer.weight)  # Adam's step is then -learning_rate each time
            optimizer.step()
        moved[stochastic] = (start - layer.weight.detach().float()).mean().item()
    expected = learning_rate * steps
    assert abs(moved[True] - expected) < 0.1 * expected, moved
    assert moved[False] < 0.5 * expected, moved
