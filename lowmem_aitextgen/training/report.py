"""What training did, shown to the user.

`RunRecorder` (a callback) keeps one record per optimizer step — loss, its
moving average, learning rate, tokens/s, peak memory — and gives the same
numbers to the Lightning loggers; `StepProgressBar` shows the latest of them.  From it come the run summary (logged, and
written as training_summary.json) and, when matplotlib is installed, loss.png
and memory.png.  All three are rewritten at every save, so an interrupted run
still has them.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks.progress import ProgressBar
from pytorch_lightning.loggers import CSVLogger, Logger, TensorBoardLogger
from tqdm.auto import tqdm

from .._compat import importable
from ..hardware import format_bytes
from ..saving import atomic_write_bytes
from .callbacks import OptimizerStepCallback
from .counting import peak_memory_bytes, trainable_parameters, unique_tensor_bytes
from .four_bit import Rounding
from .in_backward import StepInBackward
from .plan import TrainPlan, describe_checkpointing

logger = logging.getLogger("lowmem_aitextgen")

SUMMARY_FILE = "training_summary.json"
LOSS_PLOT = "loss.png"
MEMORY_PLOT = "memory.png"
PNG_DATA_KEY = "lowmem_aitextgen"  # the plotted numbers, as JSON in a PNG text chunk
LOGS_SUBFOLDER = "logs"


@dataclass
class StepRecord:
    """One optimizer step as the user sees it."""

    step: int
    loss: float
    avg_loss: float | None
    learning_rate: float
    tokens_per_s: float
    peak_memory_bytes: int


def memory_kind(accelerator: str) -> str:
    return "GPU peak allocated" if accelerator == "gpu" else "CPU peak RSS"


def exact_parts(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """The parts of training memory known exactly: weights, gradients, optimizer states."""
    return {
        "weights": unique_tensor_bytes(model.parameters()),
        "gradients": unique_tensor_bytes(p for p in model.parameters() if p.requires_grad),
        "optimizer_states": unique_tensor_bytes(v for state in optimizer.state.values() for v in state.values()
                                                if isinstance(v, torch.Tensor)),
    }


class RunRecorder(OptimizerStepCallback):
    """Records every optimizer step and logs it to the Trainer's loggers."""

    # what run.py brings back from spawned training processes
    carried_fields = ("records", "tokens", "wall_time", "learning_rate", "exact_parts", "optimizer_name",
                      "skipped_tensor_updates")

    def __init__(self, plan: TrainPlan, avg_loss_smoothing: float, max_grad_norm: float = 0.0) -> None:
        super().__init__()
        self.plan = plan
        self.smoothing = avg_loss_smoothing  # the weight of each new loss in the average (aitextgen's)
        self.max_grad_norm = max_grad_norm  # 0: no clipping
        self.records: list[StepRecord] = []
        self.tokens = 0
        self.started = time.perf_counter()
        self.wall_time = 0.0
        self.learning_rate = float("nan")
        self.exact_parts: dict[str, int] = {}  # measured once, after the first step created the states
        self.optimizer_name = ""
        self.skipped_tensor_updates = 0  # updates inside backward left out for a gradient that was not finite
        self.base_rounding = Rounding()  # what a 4-bit base rounded (four_bit.py), added as it is quantized
        self._optimizer: torch.optim.Optimizer | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self.started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.tokens += batch.numel() * trainer.world_size
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        self.learning_rate = optimizer.param_groups[0]["lr"]  # the rate this step uses
        self.optimizer_name = optimizer.stepping if isinstance(optimizer, StepInBackward) else type(optimizer).__name__
        self._optimizer = optimizer

    def on_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: float) -> None:
        previous = self.records[-1].avg_loss if self.records else None
        avg = previous
        if math.isfinite(loss):
            avg = loss if previous is None else self.smoothing * loss + (1 - self.smoothing) * previous
        self.wall_time = time.perf_counter() - self.started
        if isinstance(self._optimizer, StepInBackward):
            self.skipped_tensor_updates = self._optimizer.skipped_tensors
        record = StepRecord(trainer.global_step, loss, avg, self.learning_rate,
                            self.tokens / max(self.wall_time, 1e-9), peak_memory_bytes(self.plan.accelerator))
        self.records.append(record)
        if not self.exact_parts and self._optimizer is not None:
            self.exact_parts = exact_parts(pl_module.model, self._optimizer)
        metrics = {k: v for k, v in asdict(record).items() if k != "step" and v is not None}
        for lightning_logger in trainer.loggers:
            lightning_logger.log_metrics(metrics, step=record.step)

    @property
    def latest(self) -> StepRecord | None:
        return self.records[-1] if self.records else None

    # --- the summary and the pictures ----------------------------------------

    def summary(self, model: torch.nn.Module, output_dir: str, **extra: Any) -> dict[str, Any]:
        """Everything the user wants to know about the run, JSON-ready."""
        plan = self.plan
        averages = [r.avg_loss for r in self.records if r.avg_loss is not None]
        trainable, total = trainable_parameters(model)
        last = self.latest
        peak = last.peak_memory_bytes if last else peak_memory_bytes(plan.accelerator)
        # where the peak went: the exact parts, and the rest (activations, logits, runtime)
        breakdown = dict(self.exact_parts)
        if breakdown:
            breakdown["activations_logits_and_runtime"] = max(peak - sum(breakdown.values()), 0)
        return {
            "steps": last.step if last else 0,
            "tokens": self.tokens,
            "wall_time_s": self.wall_time,
            "tokens_per_s": self.tokens / self.wall_time if self.wall_time else None,
            "final_loss": last.loss if last else None,
            "final_avg_loss": averages[-1] if averages else None,
            "best_avg_loss": min(averages) if averages else None,
            "peak_memory_bytes": peak,
            "peak_memory_kind": memory_kind(plan.accelerator),
            "memory_breakdown_bytes": breakdown,
            "plan": {
                "device": plan.accelerator,
                "precision": plan.precision,
                "gradient_checkpointing": plan.gradient_checkpointing,
                "checkpointed_blocks": plan.checkpointed_blocks,
                "blocks": plan.n_layer,
                "lora": plan.adapter.lora_fields() if plan.adapter is not None else None,
                "adapter": plan.adapter.settings if plan.adapter is not None else None,
                "upcast_bf16_weights": plan.bf16_weights_computed_in_fp32,  # stored in bf16, computed in fp32 (storage16.py)
                # the adapter's base in NF4 (four_bit.py); the merged model then differs from the adapter on the
                # original base by the base's rounding: relative_distance = |W_nf4 - W| / |W| over its matrices
                "four_bit_base": ({"relative_distance": self.base_rounding.relative,
                                   "quantized_weights": self.base_rounding.weights} if plan.four_bit_base else None),
                "chunked_loss": plan.loss_chunk_tokens is not None,
                "micro_batch_size": plan.micro_batch_size,
                "gradient_accumulation_steps": plan.accumulation,
                "effective_batch_size": plan.effective_batch_size,
                "optimizer": self.optimizer_name,
                "step_in_backward": plan.step_in_backward,  # each weight updated as its gradient completes
                "clipping": ("per tensor" if plan.step_in_backward else "global norm") if self.max_grad_norm else None,
                # inside backward a gradient that is not finite skips its own tensor's update, not the step
                "skipped_tensor_updates": self.skipped_tensor_updates if plan.step_in_backward else None,
                "shards": plan.shards,  # processes the model is sharded across (strategy="fsdp")
                "offload": plan.offload,  # weights, gradients and AdamW states in host memory
                "gathered_for": plan.gathered_for if plan.sharded else None,  # what a sharded process holds whole
                "held_heap": plan.hold_freed_heap,  # glibc's heap held and released at every block (heap.py)
                "compiled": plan.torch_compile,  # torch.compile while training (compiling.py)
                "trainable_parameters": trainable,
                "parameters": total,
                "budget_bytes": plan.budget.bytes if plan.budget else None,
                "budget": asdict(plan.budget) if plan.budget else None,  # the device and margin it came from
                "chosen_because": plan.chosen_because or None,
            },
            "output_dir": os.path.abspath(output_dir),
            **extra,
        }

    def write(self, output_dir: str, summary: dict[str, Any]) -> list[str]:
        """training_summary.json, and loss.png/memory.png if matplotlib is installed; returns paths."""
        path = os.path.join(output_dir, SUMMARY_FILE)
        atomic_write_bytes(path, json.dumps(summary, indent=2).encode())
        written = [path]
        if matplotlib_available() and self.records:
            data = loss_plot_data(self.records, summary.get("validation"))
            written.append(save_png(loss_figure(data), os.path.join(output_dir, LOSS_PLOT), data))
            data = memory_plot_data(summary)
            written.append(save_png(memory_figure(data), os.path.join(output_dir, MEMORY_PLOT), data))
        return written


class StepProgressBar(ProgressBar):
    """aitextgen's tqdm bar: step, loss, average loss, tokens/s and peak memory.

    It shows what `recorder` (a RunRecorder, listed before it) recorded for the last optimizer step.
    """

    def __init__(self, recorder: RunRecorder, total_steps: int, refresh_rate: int, accelerator: str) -> None:
        super().__init__()
        self.recorder = recorder
        self.total_steps = total_steps
        self.refresh_rate = refresh_rate
        self.accelerator = accelerator
        self.enabled = True
        self.bar: tqdm | None = None

    def disable(self) -> None:
        self.enabled = False

    def enable(self) -> None:
        self.enabled = True

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.bar = tqdm(total=self.total_steps, initial=trainer.global_step, disable=not self.enabled,
                        smoothing=0, leave=True, dynamic_ncols=True, file=sys.stdout)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        record = self.recorder.latest
        if self.bar is None or record is None or record.step == self.bar.n:
            return
        if record.step % self.refresh_rate == 0 or record.step == self.total_steps:
            self.bar.update(record.step - self.bar.n)
            self.bar.set_description(self.description(record, trainer.progress_bar_metrics.get("val_loss")))

    def description(self, record: Any, val_loss: float | None = None) -> str:
        """The bar's text; val_loss is the latest evaluation's (logged by evaluation.ValidatedModule)."""
        memory = "GPU peak" if self.accelerator == "gpu" else "RSS peak"
        avg = float("nan") if record.avg_loss is None else record.avg_loss
        val = "" if val_loss is None else f" — Val: {float(val_loss):.3f}"
        return (
            f"Loss: {record.loss:.3f} — Avg: {avg:.3f}{val} — {record.tokens_per_s:,.0f} tok/s — "
            f"{memory}: {format_bytes(record.peak_memory_bytes)}"
        )

    def write(self, text: str) -> None:
        (self.bar.write if self.bar is not None else print)(text)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.bar is not None:
            self.bar.close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.on_train_end(trainer, pl_module)  # a run continued after out-of-memory opens a new bar


def describe_summary(summary: dict[str, Any]) -> str:
    """The summary as the few lines logged at the end of train()."""
    plan = summary["plan"]
    lora = "full fine-tune"
    if plan.get("adapter"):
        lora = f"LoRA r={plan['lora']['r']}" if plan["lora"] else plan["adapter"]["peft_type"].lower().replace("_", " ")
    if plan.get("four_bit_base"):
        lora += (f" (base's block matrices in 4-bit NF4, {plan['four_bit_base']['relative_distance']:.1%} from the "
                 "original's)")
    elif plan.get("upcast_bf16_weights"):
        lora += f" ({'base' if plan['adapter'] else 'weights'} in bf16, computed in fp32)"

    def loss(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.3f}"

    validation = ""
    if summary.get("best_step") is not None:
        validation = (f"  validation: best {loss(summary['best_val_loss'])} at step {summary['best_step']:,} "
                      f"(the model saved), {len(summary['validation'])} evaluations\n")
    return (
        f"Training summary: {summary['steps']:,} steps, {summary['tokens']:,} tokens in "
        f"{summary['wall_time_s']:.0f} s ({summary['tokens_per_s'] or 0:,.0f} tokens/s)\n"
        f"  loss: final {loss(summary['final_loss'])}, average {loss(summary['final_avg_loss'])}, "
        f"best average {loss(summary['best_avg_loss'])}\n{validation}"
        f"  memory: {summary['peak_memory_kind']} {format_bytes(summary['peak_memory_bytes'])}\n"
        f"  plan: {plan['precision']}, checkpointing "
        f"{describe_checkpointing(plan['checkpointed_blocks'], plan['blocks'])}, "
        f"{lora}, chunked loss {'on' if plan['chunked_loss'] else 'off'}, batch "
        f"{plan['micro_batch_size']}x{plan['gradient_accumulation_steps']}, {plan['optimizer']}\n"
        f"  saved to {summary['output_dir']}"
    )


# --- plots (matplotlib is optional: pip install lowmem_aitextgen[plots]) -------


def matplotlib_available() -> bool:
    return importable("matplotlib")


def say_what_is_not_drawn() -> None:
    """One line before training where matplotlib, which draws loss.png and memory.png, is not installed."""
    if not matplotlib_available():
        logger.info(f"{LOSS_PLOT} and {MEMORY_PLOT} will not be drawn: matplotlib is not installed "
                    "(pip install matplotlib); training_summary.json holds the same numbers.")


def loss_plot_data(records: list[StepRecord], validation: list[dict] | None = None) -> dict[str, list]:
    """The training loss per step, and the validation loss at each evaluation when there is one."""
    data = {
        "step": [r.step for r in records],
        "loss": [r.loss for r in records],
        "avg_loss": [r.avg_loss for r in records],
    }
    if validation is not None:
        data["val_step"] = [e["step"] for e in validation]
        data["val_loss"] = [e["loss"] for e in validation]
    return data


def memory_plot_data(summary: dict[str, Any]) -> dict[str, Any]:
    parts = summary["memory_breakdown_bytes"]
    return {"labels": [name.replace("_", " ") for name in parts], "bytes": list(parts.values()),
            "peak_bytes": summary["peak_memory_bytes"], "peak_kind": summary["peak_memory_kind"]}


def _figure():
    # The object-oriented API with no pyplot: no global state, no GUI backend,
    # nothing changed in a notebook that imported us.
    from matplotlib.figure import Figure

    return Figure(figsize=(7, 4), dpi=100)


def loss_figure(data: dict[str, list]):
    figure = _figure()
    axes = figure.add_subplot()
    axes.plot(data["step"], data["loss"], alpha=0.35, label="loss per step")
    axes.plot(data["step"], [math.nan if v is None else v for v in data["avg_loss"]], label="moving average")
    if "val_loss" in data:
        axes.plot(data["val_step"], data["val_loss"], marker="o", label="validation loss")
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("loss")
    axes.legend()
    figure.tight_layout()
    return figure


def memory_figure(data: dict[str, Any]):
    figure = _figure()
    axes = figure.add_subplot()
    gib = [b / 2**30 for b in data["bytes"]]
    bottom = 0.0
    for label, value in zip(data["labels"], gib):
        axes.bar("breakdown", value, bottom=bottom, label=label)
        bottom += value
    axes.bar(data["peak_kind"], data["peak_bytes"] / 2**30, color="black", label="measured peak")
    axes.set_ylabel("GiB")
    axes.legend(fontsize="small")
    figure.tight_layout()
    return figure


def save_png(figure, path: str, data: dict[str, Any]) -> str:
    """Write the figure atomically, with the plotted numbers as JSON in its metadata."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", metadata={PNG_DATA_KEY: json.dumps(data)})
    atomic_write_bytes(path, buffer.getvalue())
    return path


# --- loggers -----------------------------------------------------------------


def make_loggers(loggers: Any, output_dir: str) -> list[Logger]:
    """aitextgen's `loggers=`: Lightning loggers, or "csv"/"tensorboard" (written under output_dir/logs)."""
    if loggers is None or loggers is False:
        return []
    made = []
    for item in loggers if isinstance(loggers, (list, tuple)) else [loggers]:
        if isinstance(item, Logger):
            made.append(item)
        elif item == "csv":
            made.append(CSVLogger(output_dir, name=LOGS_SUBFOLDER))
        else:  # "tensorboard": arguments.loggers checked the names and that TensorBoard is installed
            made.append(TensorBoardLogger(output_dir, name=LOGS_SUBFOLDER))
    return made
