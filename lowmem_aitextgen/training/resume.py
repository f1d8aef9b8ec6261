"""Resumable training: the checkpoint in output_dir, its checks before a resumed run, the random-number
states, and the signals that stop a run (Ctrl-C, SIGTERM).

A checkpoint is Lightning's own (weights that train, optimizer, scheduler, loop counters, callback
states) plus the random-number states and a description of the run that wrote it, written between
optimizer steps straight to a temporary name in output_dir and renamed, so a crash or a full disk
leaves the previous one whole.  Before a resumed run trains, the checkpoint is read and compared with
the run (model, LoRA, optimizer, effective batch, steps left), each mismatch one message.  What order
the data comes in, and where to pick it up, is data.py's.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import signal
import threading
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from lightning_fabric.plugins import TorchCheckpointIO
from torch import nn

from ..saving import STAGING_PREFIX, apply_umask, write_error
from .adapter_settings import AdapterSettings, from_description
from .adapters import base_matches, base_weights
from .callbacks import OptimizerStepCallback, UndoneWhenTrainingEnds
from .plan import CHECKPOINT_NAME, RunSettings, TrainPlan
from .storage16 import is_quantized

logger = logging.getLogger("lowmem_aitextgen")

RUN_KEY = "lowmem_aitextgen"  # the checkpoint's description of the run that wrote it


# --- writing -------------------------------------------------------------------------


class DiskCheckpointIO(TorchCheckpointIO):
    """torch.save straight into the file Lightning names.  Lightning's own first serialises the whole
    checkpoint into memory (a second copy of weights and optimizer: 4 GB for a 355M full fine-tune) and
    stages it in the system's temporary folder, where a small /tmp fails it with no path named."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        path = os.fspath(path)
        try:
            # through a Python file: a failed write (a full disk) then surfaces as its OSError, which torch's
            # own writer reports only as "unexpected pos"
            with open(path, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
        except BaseException as error:
            if os.path.exists(path):
                os.remove(path)  # a full disk leaves no partial file behind
            failed = write_error(error)  # torch's own writer reports the file's OSError as "unexpected pos"
            if failed is not None:
                raise OSError(failed.errno, failed.strerror) from error
            raise


def save_checkpoint(trainer: pl.Trainer, path: str) -> None:
    """trainer.save_checkpoint (on every rank, as Lightning requires), made atomic: written under a
    staging name in the same folder, then renamed; on any failure the staging file is removed."""
    staging = os.path.join(os.path.dirname(path), f"{STAGING_PREFIX}{os.path.basename(path)}")
    try:
        trainer.save_checkpoint(staging)
        if trainer.is_global_zero:
            apply_umask(staging)
            if os.path.isdir(staging):  # sharded strategies write a folder
                shutil.rmtree(path, ignore_errors=True)
            os.replace(staging, path)
    except BaseException as error:
        if trainer.is_global_zero:
            discard_checkpoint(staging)
        failed = write_error(error) if isinstance(error, Exception) else None
        if failed is not None:
            raise OSError(failed.errno, f"The checkpoint {path} could not be written ({failed.strerror or failed}); "
                                        "the files already in its folder are untouched. Free some disk space (or "
                                        "choose an output_dir on another disk) and train again.") from error
        raise
    trainer.strategy.barrier("lowmem_aitextgen.save_checkpoint")


def discard_checkpoint(path: str) -> None:
    """A finished run's checkpoint: of no further use (the model is saved), it would cost the disk
    a second copy of weights and optimizer, and resume=True from it would repeat finished steps."""
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.remove(path)


def base_parameters(model: nn.Module) -> dict[str, list[int]]:
    """The model's own parameters (a LoRA wrapper's base, without adapters) and their shapes."""
    return {name: list(param.shape) for name, param in base_weights(model).items()}


def run_description(plan: TrainPlan, settings: RunSettings, base: dict[str, list[int]],
                    base_record: dict[str, str] | None = None) -> dict[str, Any]:
    """What a resumed run must share with the one that wrote the checkpoint; `base_record`: an adapter run's
    fingerprint of the base its adapter trains on (adapters.base_fingerprint), which the checkpoint holds none of."""
    return {"run_id": plan.run_id, "base_parameters": base,
            "base_fingerprint": base_record,
            "adapter": plan.adapter.settings if plan.adapter is not None else None,
            "optimizer": plan.optimizer, "step_in_backward": plan.step_in_backward,
            "four_bit_base": plan.four_bit_base,
            "effective_batch_size": plan.effective_batch_size,
            "frozen_layers": plan.num_layers_freeze if plan.freeze_layers and not plan.trains_adapter else None,
            "validation": held_out(settings)}


def held_out(settings: RunSettings) -> dict[str, Any] | None:
    """What a run evaluates on: None without val_data; the fraction of train_data it holds out (None for a
    file or TokenDataset).  A resumed run must hold out the same blocks, or they would be trained on."""
    return {"held_out_fraction": settings.held_out_fraction} if settings.validates else None


def upgraded(saved: dict[str, Any], model_type: str) -> dict[str, Any]:
    """A run description as this version writes it: the adapter of one written while LoRA had an entry of
    its own ("lora" beside "adapter") in the one "adapter" entry."""
    adapter = from_description(saved, model_type)
    described = {key: value for key, value in saved.items() if key != "lora"}
    return {"step_in_backward": False, "four_bit_base": False,  # written before either existed
            **described,
            "adapter": adapter.settings if adapter is not None else None}


# --- which checkpoint, and whether it fits ---------------------------------------------


def checkpoint_to_resume(resume: bool | str | os.PathLike, output_dir: str) -> str | None:
    """The checkpoint train(resume=...) names: True means output_dir's, if there is one.

    resume=True where output_dir holds a finished model but no checkpoint (a finished run removes it)
    refuses: starting over would write a new model over the finished one."""
    if resume is False or resume is None:
        return None
    if resume is True:
        path = os.path.join(output_dir, CHECKPOINT_NAME)
        if os.path.exists(path):
            return path
        if os.path.isfile(os.path.join(output_dir, "config.json")):
            raise FileExistsError(
                f"resume=True, but output_dir={output_dir!r} holds a finished model and no {CHECKPOINT_NAME} (a run "
                f"that reaches num_steps removes it), so there is nothing to resume. To train that model further, "
                f"construct aitextgen(model_folder={output_dir!r}) and call train() without resume; to start over "
                "from the model you constructed and replace it, pass resume=False.")
        logger.warning(f"resume=True, but {output_dir!r} has no {CHECKPOINT_NAME}: training starts from the beginning.")
        return None
    if not os.path.exists(resume):
        raise FileNotFoundError(
            f"resume={str(resume)!r} does not exist; pass resume=True to continue from output_dir's "
            f"{CHECKPOINT_NAME}, or the path of one."
        )
    return os.fspath(resume)


def read_run_description(path: str | None) -> dict[str, Any] | None:
    """The description a checkpoint holds of the run that wrote it; every failure names the file."""
    if path is None:
        return None
    if os.path.isdir(path):  # a sharded strategy's folder: Lightning checks it when it loads
        return None
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:  # torch raises RuntimeError, pickle and zipfile errors alike
        raise ValueError(f"resume={path!r} cannot be read as a checkpoint ({type(error).__name__}: {error}); it is "
                         "damaged or not a lowmem_aitextgen checkpoint. Pass resume=False to start over.") from error
    if not isinstance(checkpoint, dict) or RUN_KEY not in checkpoint or "global_step" not in checkpoint:
        raise ValueError(f"resume={path!r} is not a checkpoint written by this version of lowmem_aitextgen's "
                         "train(); pass resume=False to start over.")
    return {**checkpoint[RUN_KEY], "global_step": checkpoint["global_step"]}


def check_resumable(path: str, saved: dict[str, Any], plan: TrainPlan, settings: RunSettings,
                    model: nn.Module) -> None:
    """The checkpoint fits this run: same model, adapter, optimizer and effective batch, steps left."""
    saved = upgraded(saved, getattr(model.config, "model_type", ""))
    ours = run_description(plan, settings, base_parameters(model))
    mismatch = next((key for key in ("base_parameters", "adapter", "frozen_layers", "optimizer",
                                     "step_in_backward", "four_bit_base", "effective_batch_size", "validation")
                     if saved.get(key) != ours[key] and not (key == "adapter" and _same_adapter(saved, ours))),
                    None)
    fixes = {
        "base_parameters": "construct aitextgen with the same model as the interrupted run",
        "lora": "call train() with the same lora, lora_r, lora_alpha, lora_dropout and lora_target_modules",
        "adapter": "call train() with the same peft_config or adapter",
        "frozen_layers": "call train() with the same freeze_layers and num_layers_freeze",
        "optimizer": f"pass optimizer={saved.get('optimizer')!r}",
        "step_in_backward": ("call train() without gradient_accumulation_steps= (the interrupted run updated each "
                             "weight inside backward, which accumulates nothing)" if saved.get("step_in_backward")
                             else "call train() with the interrupted run's max_memory="),
        "four_bit_base": ("call train() with base_bits=4 (the interrupted run's adapter trained on a 4-bit base)"
                          if saved.get("four_bit_base") else "call train() with the interrupted run's max_memory= "
                          "and without base_bits="),
        "effective_batch_size": (f"pass batch_size and gradient_accumulation_steps whose product is "
                                 f"{saved.get('effective_batch_size')}"),
        "validation": ("call train() with the same val_data (a held-out fraction of train_data must be the same, "
                       "or blocks trained on would be evaluated)"),
    }
    if mismatch == "adapter" and any((d or {}).get("peft_type") == "LORA" for d in (saved["adapter"], ours["adapter"])):
        mismatch = "lora"  # the arguments to change are LoRA's
        saved, ours = ({**d, "lora": _described(d["adapter"])} for d in (saved, ours))
    if mismatch is not None:
        difference = _difference(saved.get(mismatch), ours[mismatch])
        raise ValueError(f"resume={path!r} was written by a run with another {mismatch.replace('_', ' ')} "
                         f"({difference}); {fixes[mismatch]}, or pass resume=False to start over.")
    if saved["global_step"] >= settings.num_steps:
        raise ValueError(f"resume={path!r} is at step {saved['global_step']:,}, and num_steps={settings.num_steps:,} "
                         f"asks for no more; pass num_steps above {saved['global_step']:,} to train further.")


def check_resumed_base(path: str | None, saved: dict[str, Any] | None, base_record: dict[str, str] | None,
                       model: nn.Module) -> None:
    """The base an adapter resumes on is the one the checkpoint's adapter was trained on: same fingerprint, as
    read (`base_record`) or as `model` holds it cast to the checkpoint's dtype.  A checkpoint written before
    bases were recorded is not checked."""
    recorded = (saved or {}).get("base_fingerprint")
    if path is None or recorded is None:
        return
    if base_record is not None and base_record.get("sha256") == recorded.get("sha256"):
        return
    held_in_another_dtype = base_record is not None and base_record.get("dtype") != recorded.get("dtype")
    if held_in_another_dtype and not any(is_quantized(p) for p in model.parameters()) and base_matches(recorded, model):
        return  # (a plan of this machine holds the base in another dtype than the interrupted run's)
    raise ValueError(f"resume={path!r}: its adapter was trained on other base weights than this model holds "
                     f"(the checkpoint's base: {recorded.get('dtype')} sha256 {str(recorded.get('sha256'))[:12]}…). "
                     "Resuming would put the adapter on the wrong model. Construct aitextgen(model_folder=...) with "
                     "the model the interrupted run started from (not its output_dir, which holds the adapter "
                     "merged in), or pass resume=False to start over.")


def _same_adapter(saved: dict[str, Any], ours: dict[str, Any]) -> bool:
    """The checkpoint's adapter is this run's, though one config holds what peft filled in from the model and
    the other not (a run resumed on the model its output_dir holds, its adapter loaded with it)."""
    return None not in (saved["adapter"], ours["adapter"]) and \
        AdapterSettings.of(saved["adapter"]).same_as(AdapterSettings.of(ours["adapter"]))


def _described(adapter: dict[str, Any] | None) -> dict[str, Any] | None:
    """LoRA's settings by train()'s names, any other adapter's as peft's."""
    if adapter is None:
        return None
    settings = AdapterSettings.of(adapter)
    return settings.lora_fields() or settings.settings


def _difference(saved: Any, ours: Any) -> str:
    if isinstance(saved, dict) and isinstance(ours, dict):
        keys = sorted(set(saved) ^ set(ours)) or sorted(k for k in saved if saved[k] != ours[k])
        key = keys[0]
        return f"{key}: checkpoint {saved.get(key, 'absent')}, now {ours.get(key, 'absent')}"
    return f"checkpoint {saved}, now {ours}"


# --- random-number states ---------------------------------------------------------------


def random_states() -> dict[str, Any]:
    """Every random-number state training draws from (dropout, shuffling), as plain tensors and lists
    so that the checkpoint loads with torch.load(weights_only=True)."""
    numpy_state = np.random.get_state()
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [numpy_state[0], torch.from_numpy(numpy_state[1].copy()), *numpy_state[2:]],
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_random_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(tuple(tuple(x) if isinstance(x, list) else x for x in states["python"]))
    name, keys, *rest = states["numpy"]
    np.random.set_state((name, keys.numpy(), *rest))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


# --- Lightning's loop counters ------------------------------------------------------------


def align_to_step(loops: dict, global_step: int, accumulation: int) -> None:
    """Rewrite Lightning's loop progress in a checkpoint as if it had been written at the end of
    optimizer step `global_step` with this accumulation: a checkpoint from the middle of a step
    (out of memory), or a resumed run with another micro-batch, would otherwise count micro-batches
    in the old unit and misplace the accumulation boundaries (Lightning's loop-state format, 2.x)."""
    fit_loop = loops.get("fit_loop", {})
    batches = global_step * accumulation
    step = fit_loop.get("epoch_loop.automatic_optimization.optim_progress", {}).get("optimizer", {}).get("step")
    for scope in ("total", "current"):
        counters = fit_loop.get("epoch_loop.batch_progress", {}).get(scope)
        if counters:
            counters.update(ready=batches, started=batches, processed=batches, completed=max(0, batches - 1))
        if step and scope in step:
            step[scope].update(ready=global_step, completed=global_step)
    if "epoch_loop.state_dict" in fit_loop:
        fit_loop["epoch_loop.state_dict"]["_batches_that_stepped"] = global_step


# --- signals ---------------------------------------------------------------------------


SIGNAL_NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}


class StopOnSignal(OptimizerStepCallback, UndoneWhenTrainingEnds):
    """Ctrl-C and SIGTERM stop training after the current optimizer step instead of killing it.

    The first signal asks to stop: the checkpoint and a loadable model are saved as at the end of
    training.  After Ctrl-C train() returns, as Lightning users expect of an interrupted fit; after
    SIGTERM (docker stop, Kubernetes, SLURM pre-emption) train() then exits the process with status
    143 (128 + SIGTERM), so a scheduler sees the job did not finish and at most one step is lost.  A
    second signal acts at once.  Lightning's own handling would exit with status 1 after Ctrl-C, and
    with status 0 and no checkpoint after SIGTERM.
    """

    carried_fields = ("received", "reason")  # what run.py brings back from spawned training processes

    def __init__(self) -> None:
        super().__init__()
        self.received: int | None = None
        self.reason: str | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = self.received or signum
        signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))  # a second one acts at once
        again = "press Ctrl-C again" if signum == signal.SIGINT else "send SIGTERM again"
        print(f"\n{SIGNAL_NAMES[signum]}: stopping after this step and saving; {again} to stop at once.", flush=True)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)  # steps are counted from the step a resumed run starts at
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNAL_NAMES:
                self._previous[signum] = signal.signal(signum, self._handle)

    def undo(self) -> None:
        """The handlers in place before training, back."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    @property
    def terminated(self) -> bool:
        return self.received == signal.SIGTERM

    def on_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: float) -> None:
        # every rank must stop at the same step, whichever received the signal
        if trainer.strategy.reduce_boolean_decision(self.received is not None, all=False):
            name = SIGNAL_NAMES.get(self.received, "a signal on another process")
            self.reason = (f"interrupted ({name}) at step {trainer.global_step:,}; "
                           "train again with resume=True to continue")
            trainer.should_stop = True
