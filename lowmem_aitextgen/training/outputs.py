"""What output_dir holds: a model save (plain, or with its peft adapter: the merged model beside it, or the
base it needs), the manifest of which run wrote each file there, so that no file outlives the run it belongs
to, and RunFiles, through which a training run writes every file it writes there.

| in output_dir                          | written                                               |
|----------------------------------------|-------------------------------------------------------|
| config.json, generation_config.json,   | at every model save (save_every, the best model with  |
| model.safetensors, tokenizer files     | val_data, the end of training), and by ai.save()      |
| lora_adapter/ (+ base_weights.json)    | at a LoRA run's model saves (adapter/: another        |
|                                        | mergeable peft method's)                              |
| adapter/ (adapter_config.json,         | at a prefix or prompt tuning run's model saves, beside|
| adapter_model.safetensors, base record)| the base model they need (adapters.py)                |
| training_summary.json, loss.png,       | with each model save, and after each evaluation       |
| memory.png                             |                                                       |
| last.ckpt                              | every save_every steps and at a stop; removed once    |
|                                        | the run is complete                                   |
| logs/version_N/                        | by loggers="csv" / "tensorboard", while training      |
| run_files.json                         | here, with each of the above once the run saved a model|

The rule: a run owns what it writes.  At its first model save (never before: until then output_dir's
model is the earlier run's), the files the earlier run's manifest lists and this run did not write are
removed.  The new manifest lists them as "removing" before they go, so a crash in between leaves them
listed for the next run to finish.  A file no manifest lists (the user's own) is never touched.  A
resumed run carries the interrupted run's id (its checkpoint holds it) and continues its manifest.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import Logger
from torch import nn

from ..saving import LOCK_NAME, NonFiniteWeights, atomic_save, atomic_write_bytes, check_finite, read_json
from .adapters import base_fingerprint, is_adapter_model, write_adapter_model
from .plan import CHECKPOINT_NAME, TrainPlan, new_run_id
from .report import LOGS_SUBFOLDER, RunRecorder
from .resume import discard_checkpoint, save_checkpoint

logger = logging.getLogger("lowmem_aitextgen")

MANIFEST = "run_files.json"


def save_model(output_dir: str, model: nn.Module, tokenizer: Any | None = None,
               merged_dtype: torch.dtype | None = None, base_record: dict[str, Any] | None = None) -> list[str]:
    """The model (+ tokenizer) saved atomically into output_dir; a LoRA model merged (in `merged_dtype`)
    with its adapter and `base_record` (default: its base's fingerprint now).  Returns the names written."""
    if not is_adapter_model(model):
        return atomic_save(output_dir, model, tokenizer)
    record = base_record if base_record is not None else base_fingerprint(model)
    return atomic_save(output_dir, model, write=lambda folder: write_adapter_model(folder, model, tokenizer,
                                                                                  merged_dtype, record))


def read_manifest(folder: str) -> dict[str, Any] | None:
    """output_dir's run_files.json, or None where there is none (or it is not one of ours: then no file
    there is taken for a run's)."""
    path = os.path.join(folder, MANIFEST)
    try:
        manifest = read_json(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        logger.warning(f"{error}; the files in {folder} are all kept.")
        return None
    if not (isinstance(manifest, dict) and isinstance(manifest.get("run"), str)
            and all(isinstance(manifest.get(key, []), list) for key in ("files", "removing"))):
        return None
    return manifest


def run_of(folder: str) -> str | None:
    """The run whose model `folder` holds, by its manifest (None: not a run's output_dir)."""
    manifest = read_manifest(folder)
    return manifest["run"] if manifest is not None and "config.json" in manifest.get("files", []) else None


class History(Protocol):
    """What a summary takes from the validation history (evaluation.ValidationHistory)."""

    def summary_fields(self) -> dict[str, Any]: ...


@dataclass
class RunManifest:
    """The files one run has written into output_dir (paths relative to it)."""

    output_dir: str
    run: str
    files: set[str] = field(default_factory=set)
    claimed: bool = False  # the run has saved a model here, and the earlier run's files are gone

    @classmethod
    def start(cls, output_dir: str, run: str) -> RunManifest:
        """This run's manifest; a resumed run's continues the one its interrupted part wrote."""
        manifest = cls(output_dir, run)
        earlier = read_manifest(output_dir)
        if earlier is not None and earlier["run"] == run:
            manifest._claim()
        return manifest

    def wrote(self, names: Iterable[str]) -> None:
        """Record files this run wrote (listed in run_files.json once the run has saved a model)."""
        self.files.update(os.path.normpath(name) for name in names)
        if self.claimed:
            self._write()

    def removed(self, name: str) -> None:
        """A file of this run's that it removed itself (a complete run's checkpoint)."""
        self.files.discard(name)
        if self.claimed:
            self._write()

    def model_saved(self, names: Iterable[str]) -> None:
        """Record a model save; the first removes the earlier run's files that this run did not write."""
        self.wrote(names)
        if not self.claimed:
            self._claim()

    def _claim(self) -> None:
        """output_dir is this run's from now on: a manifest of this same run (its interrupted part, or its
        processes under strategy="ddp_spawn") is continued; another run's files this run did not write go."""
        earlier = read_manifest(self.output_dir) or {}
        self.claimed = True
        if earlier.get("run") == self.run:
            unlisted = self.files - set(earlier["files"])
            self.files.update(earlier["files"])
            if unlisted:  # nothing to write otherwise: at a resumed run's start, on every rank
                self._write()
            return
        stale = sorted({*earlier.get("files", []), *earlier.get("removing", [])} - self.files)
        self._write(removing=stale)
        removed = [name for name in stale if _remove(self.output_dir, name)]
        self._write()
        if removed:
            logger.info(f"Removed from {self.output_dir} what the earlier run {earlier['run']} wrote there and this "
                        f"run does not replace: {', '.join(removed)}.")

    def _write(self, removing: list[str] | None = None) -> None:
        manifest: dict[str, Any] = {"run": self.run, "files": sorted(self.files)}
        if removing:
            manifest["removing"] = removing
        atomic_write_bytes(os.path.join(self.output_dir, MANIFEST), json.dumps(manifest, indent=1).encode())


def _remove(folder: str, name: str) -> bool:
    """Remove folder/name if it is a path inside `folder` (a manifest names nothing else, but the file can
    be edited) and exists; a symbolic link is removed, never followed, and nothing is reached through one."""
    name = os.path.normpath(name)
    if os.path.isabs(name) or name.split(os.sep)[0] in ("..", ".", MANIFEST, LOCK_NAME):
        return False
    path = os.path.join(folder, name)
    root = os.path.realpath(folder)
    if os.path.realpath(os.path.dirname(path)) != os.path.join(root, os.path.dirname(name)).rstrip(os.sep):
        return False  # a folder on the way is a link (out of output_dir, or anywhere)
    if os.path.islink(path) or os.path.isfile(path):
        os.remove(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)
    else:
        return False
    parent = os.path.dirname(path)
    while os.path.abspath(parent) != os.path.abspath(folder) and not os.listdir(parent):
        os.rmdir(parent)  # logs/ once its last version_N is gone
        parent = os.path.dirname(parent)
    return True


def save_into(folder: str, model: nn.Module, tokenizer: Any | None, origin: tuple[str, str] | None) -> None:
    """ai.save()/save_for_upload(): the model saved into `folder`.  Where `folder` is a run's output_dir,
    the save belongs to that run if the model is that run's (`origin`: the folder and run the model was
    loaded from or trained by), else it is a run of its own that replaces the earlier run's files."""
    names = save_model(folder, model, tokenizer)
    earlier = read_manifest(folder)
    if earlier is None:
        return
    same = origin is not None and origin == (os.path.abspath(folder), earlier["run"])
    manifest = RunManifest.start(folder, earlier["run"] if same else new_run_id())
    manifest.model_saved(names)


class RunFiles:
    """What a run writes into output_dir: the resumable checkpoint, the model (a LoRA model as its
    adapter and the merged model) and the summary with its plots (and the validation history, if any),
    each recorded in the run's manifest."""

    def __init__(self, plan: TrainPlan, tokenizer: Any, base_name: str | None, recorder: RunRecorder,
                 dtype: torch.dtype, history: History | None = None,
                 base_record: dict[str, Any] | None = None, loggers: list[Logger] | None = None) -> None:
        self.plan = plan
        self.tokenizer = tokenizer
        self.base_name = base_name
        self.recorder = recorder
        self.dtype = dtype
        self.history = history
        self.base_record = base_record  # a LoRA run's: the weights its adapter is trained on (lora.py)
        self.loggers = loggers or []
        self.manifest = RunManifest.start(plan.output_dir, plan.run_id)
        self.checkpoint_path = os.path.join(plan.output_dir, CHECKPOINT_NAME)
        self.saved_at: int | None = None  # the step of this run's latest model save
        self.summary_files: list[str] = []

    def discard_checkpoint(self) -> None:
        """A complete run's checkpoint: of no further use (resume.discard_checkpoint)."""
        discard_checkpoint(self.checkpoint_path)
        self.manifest.removed(CHECKPOINT_NAME)

    def kept(self) -> str:
        """What output_dir holds of this run's models, for messages that must be true."""
        if self.saved_at is None:
            return f"this run saved no model in {self.plan.output_dir}"
        return f"{self.plan.output_dir} keeps the model saved at step {self.saved_at:,}"

    def checkpoint(self, trainer: pl.Trainer) -> None:
        """The resumable checkpoint; never one with NaN/inf weights over a good one.  Each process checks its
        own shard and they decide together: one stopping alone would leave the others waiting in the save's
        gather for ever."""
        try:
            check_finite(trainer.lightning_module.model, "The weights to checkpoint")
            bad = None
        except NonFiniteWeights as error:
            bad = error
        if not trainer.strategy.reduce_boolean_decision(bad is None, all=True):
            raise bad or NonFiniteWeights("The weights to checkpoint are not finite (NaN/inf in another process's "
                                          "shard).")
        save_checkpoint(trainer, self.checkpoint_path)
        if trainer.is_global_zero:
            self.manifest.wrote([CHECKPOINT_NAME])

    def save_model(self, model: nn.Module, skipped_steps: int, stopped_because: str | None = None) -> dict:
        """Weights first (a LoRA model merged in the dtype the model was loaded in, with its adapter),
        then the summary and plots that describe them; returns the summary."""
        output_dir = self.plan.output_dir
        record = None
        if is_adapter_model(model):
            model.peft_config[model.active_adapter].base_model_name_or_path = self.base_name
            record = {"base": self.base_name, **(self.base_record or {}), "run": self.plan.run_id}
        names = save_model(output_dir, model, self.tokenizer, merged_dtype=self.dtype, base_record=record)
        summary = self.write_summary(model, skipped_steps, stopped_because, record_files=False)
        self.manifest.model_saved([*names, *self.summary_files, *self.log_dirs()])
        self.saved_at = summary["steps"]
        return summary

    def write_summary(self, model: nn.Module, skipped_steps: int, stopped_because: str | None = None,
                      record_files: bool = True) -> dict:
        """The summary and plots of the run so far, beside the model output_dir holds; returns the summary."""
        extra = self.history.summary_fields() if self.history is not None else {}
        summary = self.recorder.summary(model, self.plan.output_dir, skipped_steps=skipped_steps,
                                        stopped_because=stopped_because, run=self.plan.run_id, **extra)
        self.summary_files = [os.path.relpath(path, self.plan.output_dir)
                              for path in self.recorder.write(self.plan.output_dir, summary)]
        if record_files:
            self.manifest.wrote([*self.summary_files, *self.log_dirs()])
        return summary

    def log_dirs(self) -> list[str]:
        """The folders train(loggers="csv"/"tensorboard") writes in output_dir (logs/version_N)."""
        logs = os.path.join(os.path.abspath(self.plan.output_dir), LOGS_SUBFOLDER)
        folders = [os.path.abspath(logger.log_dir) for logger in self.loggers if getattr(logger, "log_dir", None)]
        return [os.path.relpath(folder, self.plan.output_dir) for folder in folders
                if os.path.commonpath([folder, logs]) == logs and os.path.isdir(folder)]
