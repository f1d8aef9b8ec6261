"""The LightningModule: the loss of one micro-batch, the optimizer and the schedule.

Lightning does the rest (precision, accumulation, clipping, devices); saving,
printing and safety checks are callbacks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytorch_lightning as pl
import torch
from torch import nn
from transformers import get_linear_schedule_with_warmup

from . import sharding
from .chunked_loss import causal_lm_loss
from .in_backward import StepInBackward
from .optimizers import (
    build_optimizer,
    optimizer_over,
    parameter_groups,
    portable_optimizer_states,
    restore_optimizer_states,
)
from .plan import RunSettings, TrainPlan
from .resume import RUN_KEY, align_to_step, base_parameters, random_states, run_description, set_random_states


class CausalLMModule(pl.LightningModule):
    """Trains any transformers causal LM (or peft wrapper) on blocks of token ids."""

    def __init__(self, model: nn.Module, plan: TrainPlan, settings: RunSettings) -> None:
        super().__init__()
        self.model = model
        self.plan = plan
        self.settings = settings
        self.base = base_parameters(model)  # what a checkpoint records of the model, for resume's checks
        self.skipped_steps = 0
        self.gradient_norm: torch.Tensor | None = None  # this step's, for clipping (on_before_optimizer_step)
        self.in_backward: StepInBackward | None = None  # the plan steps inside backward (in_backward.py)
        self.base_record: dict[str, str] | None = None  # an adapter's base, for the checkpoint (run.TrainingRun)
        # checkpoints hold only what trains (see on_save_checkpoint); on_load_checkpoint checks the keys
        self.strict_loading = False

    def setup(self, stage: str) -> None:
        agree_on_plan(self.trainer.strategy, self.plan)

    def configure_model(self) -> None:
        """Under strategy="fsdp" or offloading, each process's shard of the model (sharding.py); Lightning
        calls this in every process once the processes have met."""
        if self.plan.sharded and not sharding.is_sharded(self.model):
            sharding.shard(self.model, self.device_mesh["data_parallel"], self.plan)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return causal_lm_loss(self.model, batch, self.plan.loss_chunk_tokens)

    def on_train_end(self) -> None:
        self.stop_stepping()

    def stop_stepping(self) -> None:
        """Hooks that update inside backward off, so no later backward (the user's, an out-of-memory retry's,
        the next train()'s) steps the model with this run's optimizer.  on_train_end is not called where fit
        raised (Ctrl-C, out of memory): run.py calls this then."""
        if self.in_backward is not None:
            self.in_backward.remove_hooks()

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Drop a step whose gradients are NaN/inf, so they never reach the weights.

        fp16's GradScaler skips such steps itself; in fp32/bf16 nothing would.
        (Runs after every callback's hook, so it sees their changes too, and after fp16's
        unscaling.)  The norm is kept for clipping, which Lightning calls next: one pass over
        the gradients instead of two (1.4 GB of them in a 355M full fine-tune).
        """
        grads = [p.grad for p in _parameters(optimizer) if p.grad is not None]
        self.gradient_norm = torch.nn.utils.get_total_norm(grads) if grads else None
        if hasattr(self.gradient_norm, "full_tensor"):  # sharded gradients: the norm of the whole (sharding.py)
            self.gradient_norm = self.gradient_norm.full_tensor()
        if self.gradient_norm is not None and not torch.isfinite(self.gradient_norm):
            self.skipped_steps += 1
            self.gradient_norm = None
            optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer,
                       optimizer_closure: Callable[[], object] | None = None) -> None:
        """Free the gradients as soon as the step has used them.

        Lightning zeroes them in its closure only after the next training_step, so the last
        step's gradients would sit through the next forward: the size of every trainable
        weight (1.3 GiB for a 355M full fine-tune), on top of that forward's activations.
        """
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        optimizer.zero_grad(set_to_none=True)

    def configure_gradient_clipping(
        self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Clip by global norm ourselves: Lightning's AMP plugin refuses any fused
        optimizer (it might unscale internally), yet it has already unscaled the
        gradients when this hook runs, so clipping here is exact.  The norm is the one
        on_before_optimizer_step took of these same gradients (None: nothing to clip)."""
        if gradient_clip_val and self.gradient_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(_parameters(optimizer), gradient_clip_val, self.gradient_norm)

    def _trainable_keys(self) -> set[str]:
        return {name for name, param in self.named_parameters() if param.requires_grad}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Keep what training changes: frozen weights (a LoRA base, frozen layers) are the
        ones the model was built with, so they stay out (a LoRA checkpoint is a few MB)."""
        trainable = self._trainable_keys()
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in trainable}
        checkpoint["random_states"] = random_states()
        checkpoint[RUN_KEY] = run_description(self.plan, self.settings, self.base, self.base_record)
        if "optimizer_states" in checkpoint:
            checkpoint["optimizer_states"] = portable_optimizer_states(checkpoint["optimizer_states"])

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Check what a checkpoint holds and make it loadable; a sharded strategy (sharding.py) has already
        loaded the weights and optimizer states into the shards (resume.check_resumable checked the run)."""
        expected = self._trainable_keys()
        saved = set(checkpoint["state_dict"]) if "state_dict" in checkpoint else expected
        if saved != expected:
            raise ValueError(
                f"The checkpoint to resume from holds {len(saved)} trainable tensors, this model "
                f"{len(expected)} (e.g. {sorted(saved ^ expected)[:3]}); it was written for another model "
                "or plan. Construct aitextgen and call train() with the same model, lora and "
                "freeze_layers arguments as the interrupted run, or pass resume=False."
            )
        if "optimizer_states" in checkpoint:
            checkpoint["optimizer_states"] = restore_optimizer_states(checkpoint["optimizer_states"])
        if "loops" in checkpoint:  # continue at a step boundary, also with another micro-batch
            align_to_step(checkpoint["loops"], checkpoint["global_step"], self.plan.accumulation)
        if self.trainer.world_size == 1:  # one process: continue its random numbers exactly
            set_random_states(checkpoint["random_states"])

    def configure_optimizers(self) -> dict:
        settings = self.settings
        if self.plan.step_in_backward:
            make = functools.partial(optimizer_over, learning_rate=settings.learning_rate,
                                     adam_epsilon=settings.adam_epsilon, optimizer=self.plan.optimizer)
            # 8-bit AdamW rounds 16-bit weights' updates stochastically itself; any other is stepped through fp32
            optimizer = self.in_backward = StepInBackward(parameter_groups(self.model, settings.weight_decay), make,
                                                          settings.learning_rate, settings.max_grad_norm,
                                                          through_fp32=self.plan.optimizer != "adamw8bit")
        else:
            optimizer = build_optimizer(self.model, settings.weight_decay, settings.learning_rate,
                                        settings.adam_epsilon, self.plan.optimizer)
        scheduler = get_linear_schedule_with_warmup(
            optimizer, num_warmup_steps=settings.warmup_steps, num_training_steps=settings.num_steps
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def agree_on_plan(strategy: pl.strategies.Strategy, plan: TrainPlan) -> None:
    """Every process trains by the same decisions (plan.shared_decisions), or none trains: each fitted its
    plan to its own device (a card's free memory, native bf16), and processes that decided otherwise would
    compute different steps, or wait for ever on collectives the others never make."""
    if strategy.world_size == 1:
        return
    mine = plan.shared_decisions()
    first = strategy.broadcast(mine, src=0)
    if strategy.reduce_boolean_decision(mine != first, all=False):
        this = "the same" if mine == first else mine
        raise ValueError(
            f"The training processes planned differently, each for its own device: process 0 decided {first}; "
            f"process {strategy.global_rank} decided {this}. Give the choices that differ (e.g. max_memory=, "
            "precision=, batch_size= with pin_micro_batch=True) so that every process makes the same ones.")


def _parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]
