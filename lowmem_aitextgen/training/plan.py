"""The training plan: every decision of one train() call, each made by one function, once.

The plan is built from the call's validated arguments (arguments.py) and the model; budget.py and
oom.py only replace fields of it.  Beside it, two values read from the same arguments once: what the call
asks of the planner (PlannerInputs: the budget, a pinned micro-batch, lora="auto") and the run's own
settings (RunSettings: steps, schedule, seed, optimizer hyper-parameters, clipping, samples); after
planning nothing reads the arguments.  The Lightning module, the callbacks and the memory techniques read
the plan and decide nothing themselves.  No file is read or written here, and no torch work happens
beyond asking what the hardware supports.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .. import hardware
from ..arguments import Arguments, parse_bytes
from ..hardware import format_bytes
from .adapter_settings import AdapterSettings, from_description

logger = logging.getLogger("lowmem_aitextgen")

# Lightning's precision strings (and the short aliases Lightning also accepts).
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")
PRECISION_ALIASES = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}
HALF_DTYPES = {"bf16": torch.bfloat16, "16-": torch.float16}

CHECKPOINT_NAME = "last.ckpt"  # in output_dir, for train(resume=True)
# what a sharded process holds whole (TrainPlan.gathered_for), from the least memory to the fewest collectives
GATHERED_FOR = ("block", "micro-batch", "step")

# aitextgen intended checkpointing for 355M and larger (tf_gpt2 in 355M/774M/1558M).
CHECKPOINTING_MIN_PARAMS = 300_000_000
# The memory choices max_memory and out-of-memory recovery may make, and the argument that fixes each.
FITTED_CHOICES = ("gradient_checkpointing", "fp16", "precision", "chunked_loss", "optimizer", "base_bits")
EVALUATIONS_BY_DEFAULT = 10  # with val_data and save_every=0: eval_every = num_steps // 10
# what the plan line and the planner say of a plan that steps inside backward (in_backward.py)
IN_BACKWARD = "stepped inside backward (no accumulation, no gradient copy, each tensor's gradient clipped alone)"
# What 16-bit storage (storage16.py) holds weights in: bf16, not fp16, for fp32's exponent range, so no
# weight overflows.
STORAGE_DTYPE = torch.bfloat16
# The loss chunk's size is a plan decision (TrainPlan.loss_chunk_tokens), so it lives here, below chunked_loss.py,
# which reads it.
DEFAULT_CHUNK_TOKENS = 256  # chunked loss: 256 x 50,257 fp32 logits = 51 MB per chunk
# Smaller on CPU, where the loss's backward sets a LoRA step's peak and matmuls gain little from size;
# GPUs want fewer, larger matmuls (benchmarks/RESULTS.md has both measurements).
CPU_CHUNK_TOKENS = 128


def default_chunk_tokens(device: str) -> int:
    """Tokens per loss chunk on `device` ("cpu", or "gpu"/"cuda")."""
    return CPU_CHUNK_TOKENS if device == "cpu" else DEFAULT_CHUNK_TOKENS


@dataclass(frozen=True)
class Schedule:
    """When a run evaluates, saves and samples, in optimizer steps: decided here once, asked by the
    callbacks (callbacks.SaveAndSample, evaluation.EvaluateLastStep) and Lightning's validation loop."""

    num_steps: int
    save_every: int = 0
    generate_every: int = 0
    eval_every: int = 0  # 0: no validation

    def saves_at(self, step: int) -> bool:
        """A periodic save: the checkpoint, and the model where no validation keeps the best one.  The
        last step has none: the run saves its model once training has ended."""
        return bool(self.save_every) and step % self.save_every == 0 and step < self.num_steps

    def samples_at(self, step: int) -> bool:
        return bool(self.generate_every) and step % self.generate_every == 0 and step < self.num_steps

    def evaluates_at(self, step: int, stopping: bool = False) -> bool:
        """Every eval_every steps, the last step, and any step training stops at."""
        return bool(self.eval_every) and (step % self.eval_every == 0 or stopping or step >= self.num_steps)

    def must_ask_evaluation_at(self, step: int) -> bool:
        """The last step when it is off the interval: Lightning evaluates it only when asked to stop."""
        return bool(self.eval_every) and step >= self.num_steps and step % self.eval_every != 0

    def lightning_validation(self, accumulation: int) -> dict[str, Any]:
        """The Trainer's arguments for evaluating every eval_every optimizer steps (counted in micro-batches,
        across epochs)."""
        if not self.eval_every:
            return {}
        return {"val_check_interval": self.eval_every * accumulation, "check_val_every_n_epoch": None}


@dataclass(frozen=True)
class RunSettings:
    """What a run does that memory does not decide: train()'s own values, checked (arguments.py) and read
    once here, which the run (run.py), the Lightning module, the callbacks and the recorder are given."""

    schedule: Schedule
    seed: int | None  # None: not seeded
    learning_rate: float
    weight_decay: float
    adam_epsilon: float
    warmup_steps: int
    max_grad_norm: float  # 0: no clipping
    n_generate: int  # texts per sample during training
    avg_loss_smoothing: float
    progress_bar_refresh_rate: int
    early_stopping_patience: int | None = None  # evaluations without improvement before stopping
    held_out_fraction: float | None = None  # val_data as a fraction of train_data (resume.py checks it)

    @property
    def num_steps(self) -> int:
        return self.schedule.num_steps

    @property
    def validates(self) -> bool:
        return bool(self.schedule.eval_every)


@dataclass(frozen=True)
class PlannerInputs:
    """What the user asked of the planner (budget.py) that is not itself a decision: the memory to fit, the
    micro-batch kept as given, LoRA allowed where nothing else fits, and fp32 weights asked for.  The
    choices the user made are the plan's `fixed`."""

    max_memory: int | None = None  # bytes; None: the device's own
    pin_micro_batch: bool = False
    lora_if_needed: AdapterSettings | None = None  # lora="auto": this LoRA, only where the budget needs it
    fp32_asked: bool = False  # fp16=False given: weights held in fp32 (so is any precision= given)
    accumulation_pinned: bool = False  # gradient_accumulation_steps > 1 given: no updates inside backward
    four_bit_asked: bool = False  # base_bits=4 given: the LoRA lora="auto" may choose is on a 4-bit base too


def new_run_id() -> str:
    """A run's name: when it started, and six hex digits so that two runs in one second differ."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


@dataclass(frozen=True)
class Budget:
    """The memory a plan is fitted to (budget.py), and what it was made of (bytes)."""

    bytes: int
    source: str  # "max_memory", "free GPU memory" or "available memory"
    device: str = ""  # the card or CPU it was read from
    available: int | None = None  # what the device had for this run, before the margin
    margin: int = 0  # left unused (budget.py says why)
    this_process_elsewhere: int = 0  # GPU tensors this process holds besides the model (an earlier run)
    other_processes: int = 0  # GPU memory other processes hold
    host_bytes: int | None = None  # on a GPU: what host memory an offloading plan may use (None: not known)
    processes: int = 1  # training processes on this machine, which share its host memory equally

    def __str__(self) -> str:
        if self.source == "max_memory":
            return f"max_memory={format_bytes(self.bytes)}"
        shared = f", shared by {self.processes} processes" if self.processes > 1 and self.source == \
            "available memory" else ""
        return (f"{format_bytes(self.bytes)} ({self.source} on {self.device}: {format_bytes(self.available or 0)}, "
                f"less a margin of {format_bytes(self.margin)}{shared})")


@dataclass(frozen=True)
class TrainPlan:
    """How one train() call runs: every decision of it that memory, speed or the devices bear on."""

    accelerator: str = "cpu"  # "cpu" or "gpu"
    devices: int | str | tuple[int, ...] = 1
    num_nodes: int = 1
    strategy: Any = "auto"  # a Lightning strategy name or object
    shards: int = 1  # processes the model is sharded across (strategy="fsdp", sharding.py); 1: not sharded
    offload: bool = False  # fp32 weights, gradients and optimizer states in host memory (GPU only, sharding.py)
    # a sharded plan: what each process holds whole, for how long ("block", "micro-batch", "step": sharding.py)
    gathered_for: str = "block"
    precision: str = "32-true"  # a Lightning precision string
    checkpointed_blocks: int = 0  # the first k of the model's n_layer blocks recompute in backward (k <= n_layer)
    n_layer: int = 0  # the model's transformer blocks (0: not known, and then nothing is checkpointed)
    adapter: AdapterSettings | None = None  # the peft method that trains (LoRA or any other); None: every weight
    upcast_bf16_weights: bool = False  # weights held in bf16 though the plan computes in fp32 (storage16.py)
    freeze_layers: bool = False
    num_layers_freeze: int | None = None
    micro_batch_size: int = 1
    accumulation: int = 1
    loss_chunk_tokens: int | None = None  # None: the model's own (unchunked) loss
    optimizer: str = "adamw"
    step_in_backward: bool = False  # each tensor stepped as its gradient completes, no gradient copy (in_backward.py)
    four_bit_base: bool = False  # the adapter's frozen base in 4 bits (NF4, four_bit.py), the rest in 16
    cpu_speedups: bool = False  # cpu.py's swaps while training
    torch_compile: str | None = None  # compiling.py: "blocks" or "model" compiled while training; None: eager
    hold_freed_heap: bool = False  # heap_callbacks.py's glibc heap policy while training (False: glibc left alone)
    num_workers: int = 0
    output_dir: str = ""
    data_seed: int = 0  # the order of the blocks; the seed when given, else drawn once
    resume_from: str | None = None  # a checkpoint written by an earlier run
    budget: Budget | None = None  # what the plan was fitted to (budget.py), None if nothing could be read
    chosen_because: str = ""  # what the planner weighed (budget.py), for the plan line and the summary
    fixed: frozenset[str] = frozenset()  # memory choices the user made (FITTED_CHOICES), and those below
    # what a checkpoint being resumed fixes that the user did not (its optimizer's state, updates inside
    # backward, a 4-bit base), said apart from the user's in a refusal (budget.nothing_fits)
    checkpoint_fixes: frozenset[str] = frozenset()
    # names this run's files (outputs.py); a resumed run keeps the interrupted run's.  Not a decision: two
    # plans that decide alike are equal whatever their runs are called
    run_id: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not 0 <= self.checkpointed_blocks <= self.n_layer:
            raise ValueError(f"checkpointed_blocks={self.checkpointed_blocks} must be between 0 and the model's "
                             f"n_layer={self.n_layer}.")
        if self.four_bit_base and not (self.trains_adapter and not self.sharded and self.weights_dtype is not None):
            raise ValueError("A 4-bit base (base_bits=4) is the frozen base of an adapter in one unsharded process, "
                             f"its other weights in 16 bits; this plan has adapter={self.adapter}, shards="
                             f"{self.shards}, offload={self.offload}, weights in {self.weights_dtype or 'fp32'}.")
        if self.step_in_backward and not can_step_in_backward(self.accumulation, self.sharded, self.precision):
            raise ValueError("Updates inside backward need one micro-batch per step, one unsharded model and no "
                             f"fp16 loss scaling; this plan has batch {self.micro_batch_size}x{self.accumulation}, "
                             f"shards={self.shards}, offload={self.offload}, precision={self.precision}.")

    @property
    def sharded(self) -> bool:
        """The model is divided by FSDP2 (sharding.py): across processes, or into host memory."""
        return self.shards > 1 or self.offload

    def on_four_bit_base(self) -> TrainPlan:
        """This plan with the adapter's base in 4 bits (four_bit.py), the rest of it in 16: in bf16 upcast
        layer by layer (storage16.py) where the plan computes in fp32."""
        return replace(self, four_bit_base=True, upcast_bf16_weights=self.upcast_bf16_weights or self.half_dtype is None)

    @property
    def trains_adapter(self) -> bool:
        """Only an adapter trains (LoRA or another peft method); the base is frozen."""
        return self.adapter is not None

    @property
    def trains_lora(self) -> bool:
        return self.adapter is not None and self.adapter.is_lora

    @property
    def gradient_checkpointing(self) -> bool:
        return self.checkpointed_blocks > 0

    @property
    def checkpoints_every_block(self) -> bool:
        return self.checkpointed_blocks == self.n_layer > 0

    def checkpointing_all(self) -> TrainPlan:
        return replace(self, checkpointed_blocks=self.n_layer)

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

    @property
    def weights_dtype(self) -> torch.dtype | None:
        """The 16-bit dtype every weight of the model is held in while training (LoRA's frozen base under
        mixed precision, or 16-bit "-true" precision), or None where the trained weights stay fp32."""
        if self.bf16_weights_computed_in_fp32:
            return STORAGE_DTYPE
        if self.trains_adapter or self.precision.endswith("-true"):
            return self.half_dtype
        return None

    @property
    def bf16_weights_computed_in_fp32(self) -> bool:
        """The weights (LoRA's frozen base, or all of them with 8-bit AdamW's stochastic rounding) held in bf16
        and upcast layer by layer to compute in fp32 (storage16.py)."""
        return self.upcast_bf16_weights and self.half_dtype is None

    def shared_decisions(self) -> str:
        """What every process of one run must decide alike (what a step computes, and when processes meet
        in collectives), in words to compare across processes; each fits its plan to its own device, so
        the rest (checkpointing, the heap) may differ."""
        adapter = self.adapter.settings_json if self.adapter is not None else None
        return (f"precision={self.precision}, batch={self.micro_batch_size}x{self.accumulation}, optimizer="
                f"{self.optimizer}, in backward={self.step_in_backward}, adapter={adapter}, bf16 weights="
                f"{self.bf16_weights_computed_in_fp32}, 4-bit base={self.four_bit_base}, "
                f"offload={self.offload}, gathered for={self.gathered_for if self.sharded else None}")

    def describe(self, trainable: int, total: int, state_bytes: int) -> str:
        """The one-line summary logged when training starts (state_bytes: weights, gradients, AdamW)."""
        stored = " (base stored in bf16, computed in fp32)" if self.bf16_weights_computed_in_fp32 and self.trains_adapter else ""
        if self.four_bit_base:
            stored = f" (base's block matrices in 4-bit NF4, the rest in {str(self.weights_dtype).removeprefix('torch.')})"
        lora = f"{self.adapter.describe()}{stored}" if self.trains_lora else "off"
        adapter = f"adapter={self.adapter.describe()}{stored}, " if self.trains_adapter and not self.trains_lora else ""
        precision = self.precision
        if self.bf16_weights_computed_in_fp32 and not self.trains_adapter:
            precision += " (weights stored in bf16)"
        scale_out = self.strategy != "auto" or self.num_nodes > 1 or self.devices not in (1, "auto")
        return (
            f"Training plan: device={self.accelerator}, precision={precision}, "
            f"checkpointing={describe_checkpointing(self.checkpointed_blocks, self.n_layer)}, LoRA={lora}, {adapter}"
            f"chunked loss={'on' if self.loss_chunk_tokens else 'off'}, optimizer={self.optimizer}"
            + (f" {IN_BACKWARD}" if self.step_in_backward else "") + ", "
            + (f"strategy={self.strategy}, nodes={self.num_nodes}, devices={self.devices}, " if scale_out else "")
            + ("offload=fp32 weights, gradients and AdamW states in host memory, " if self.offload else "")
            + (f"gathered whole for a {self.gathered_for}, " if self.shards > 1 else "")
            + (f"compiled={self.torch_compile}, " if self.torch_compile else "")
            + f"batch={self.micro_batch_size}x{self.accumulation} (micro-batch x accumulation), "
            f"trainable parameters={trainable:,} of {total:,}, "
            f"weights+gradients+AdamW={state_bytes / 2**30:.2f} GiB before activations"
            + (f"; {self.chosen_because}" if self.chosen_because else "")
        )


def can_step_in_backward(accumulation: int, sharded: bool, precision: str) -> bool:
    """What updates inside backward (in_backward.py) need of a plan: one micro-batch a step, one unsharded
    model, and no fp16 loss scaling (its hooks would step with scaled gradients)."""
    return accumulation == 1 and not sharded and precision != "16-mixed"


def describe_checkpointing(blocks: int, n_layer: int) -> str:
    """'off', 'on' (every block) or 'k of n blocks'."""
    if blocks == 0:
        return "off"
    return "on" if blocks == n_layer else f"{blocks} of {n_layer} blocks"


# --- one function per decision ------------------------------------------------------


def mixed_precision(accelerator: str) -> str | None:
    """The mixed precision this device computes natively: bf16 where it has bf16 (no loss scaling needed),
    else fp16 with dynamic loss scaling on a GPU from capability 5.3; None where neither is native (a CPU
    without AVX512-BF16/AMX, an older GPU), where 16-bit math is emulated and slower than fp32."""
    if hardware.bf16_native(accelerator):
        return "bf16-mixed"
    if accelerator == "gpu" and hardware.native_half_precision("gpu"):
        return "16-mixed"
    return None


def resolve_precision(fp16: bool | None, precision: str | None, accelerator: str) -> str:
    """Lightning precision string for aitextgen's `fp16` flag or an explicit `precision`.

    fp16=True means "mixed precision, for speed and memory": the device's native mixed precision
    (mixed_precision), and fp32 where it has none (precision_note says why).  fp16=None (not given) picks
    bf16-mixed where the device computes bf16 natively, else fp32.  An explicit precision is kept.
    """
    if precision is not None:
        resolved = PRECISION_ALIASES.get(str(precision), str(precision))
        if resolved not in PRECISIONS:
            raise ValueError(
                f"precision={precision!r} is not supported; use one of {', '.join(PRECISIONS)} "
                "(or fp16=True to let lowmem_aitextgen choose)."
            )
        if resolved.startswith("16") and accelerator == "cpu":
            raise ValueError(f"precision={precision!r} needs a CUDA GPU; on CPU use precision='bf16-mixed'.")
        return resolved
    if fp16 is False:
        return "32-true"
    if fp16 is None:
        return "bf16-mixed" if hardware.bf16_native(accelerator) else "32-true"
    return mixed_precision(accelerator) or "32-true"


def precision_note(fp16: bool | None, precision: str | None, accelerator: str) -> str | None:
    """The one line train() warns with where the 16-bit math asked for is not native on this device:
    fp16=True then trains in fp32, an explicit precision is kept; each says what 16 bits cost here."""
    device = hardware.gpu() if accelerator == "gpu" else hardware.cpu()
    cost = hardware.emulated_cost(accelerator)
    if precision is None:
        if fp16 and mixed_precision(accelerator) is None:
            return (f"fp16=True: {device} has no native 16-bit math, where mixed precision is emulated ({cost}); "
                    "training in fp32. To save memory use max_memory=, lora=True or gradient_checkpointing=True; "
                    "precision='bf16-mixed' forces 16 bits.")
        return None
    resolved = resolve_precision(None, precision, accelerator)
    if resolved.startswith("bf16") and not hardware.bf16_native(accelerator):
        half = "bf16"
    elif resolved.startswith("16") and not hardware.native_half_precision(accelerator):
        half = "fp16"
    else:
        return None
    return (f"precision={precision!r}: {device} computes {half} only emulated ({cost}); kept as asked. "
            "Leave precision out, or use fp16=True, for what this device computes natively.")


def resolve_accelerator(n_gpu: int, devices: int | str | list[int] | None) -> tuple[str, int | str | tuple[int, ...]]:
    """aitextgen's n_gpu (-1 = all GPUs, 0 = CPU) as Lightning accelerator/devices;
    `devices` (Lightning's argument) wins, and on CPU counts processes."""
    accelerator = "cpu" if n_gpu == 0 or hardware.gpu() is None else "gpu"
    if devices is not None:
        check_devices(devices, accelerator)
        return accelerator, tuple(devices) if isinstance(devices, list) else devices
    if accelerator == "cpu":
        return "cpu", 1
    return "gpu", "auto" if n_gpu < 0 else n_gpu


def check_devices(devices: Any, accelerator: str) -> None:
    """Lightning's own parsing of `devices` for this accelerator, its complaint naming the argument."""
    from pytorch_lightning.accelerators import CPUAccelerator, CUDAAccelerator

    if devices == "auto":
        return
    try:
        (CPUAccelerator if accelerator == "cpu" else CUDAAccelerator).parse_devices(devices)
    except Exception as error:  # Lightning's MisconfigurationException and ValueError/TypeError alike
        raise ValueError(f"devices={devices!r} does not work on this {accelerator.upper()} ({error}); use a number "
                         "of devices, e.g. devices=2, or devices='auto'.") from error


def processes_here(accelerator: str, devices: Any) -> int:
    """How many training processes this machine runs for `devices` (Lightning's parsing)."""
    from pytorch_lightning.accelerators import CPUAccelerator, CUDAAccelerator

    if accelerator == "cpu":
        return 1 if devices == "auto" else int(CPUAccelerator.parse_devices(devices))
    if devices == "auto":
        card = hardware.gpu()
        return card.count if card is not None else 0
    parsed = CUDAAccelerator.parse_devices(devices)
    return len(parsed) if isinstance(parsed, (list, tuple)) else int(parsed or 1)


def check_launchable(accelerator: str, devices: Any, strategy: Any) -> None:
    """Lightning starts the other processes of a ddp run by running this script again: from
    `python -c` or a prompt there is no script, and the first process would wait for them for ever."""
    import sys

    relaunches = strategy in ("auto", "ddp", "fsdp", "fsdp_cpu_offload") and "LOCAL_RANK" not in os.environ
    if relaunches and processes_here(accelerator, devices) > 1 and not os.path.isfile(sys.argv[0]):
        raise ValueError(
            f"devices={devices!r} starts {processes_here(accelerator, devices)} processes by running this script "
            f"again, but it was not started from a script file (sys.argv[0]={sys.argv[0]!r}); save the code in a .py "
            "file and run that (python train.py, or torchrun train.py).")


def default_checkpointing(model: torch.nn.Module) -> bool:
    """Checkpointing pays for itself from 355M parameters up."""
    return sum(p.numel() for p in model.parameters()) >= CHECKPOINTING_MIN_PARAMS


def decide_checkpointing(args: Arguments, constructor_setting: bool | None, model: torch.nn.Module,
                         adapter: AdapterSettings | None = None) -> int:
    """How many blocks recompute: train()'s gradient_checkpointing, else the constructor's, forces all or
    none; else every block from 300M parameters, which budget.py lowers to what the memory needs.  None
    under an adapter that reaches the blocks through the KV cache (prefix tuning: adapters.py says why)."""
    n_layer = block_count(model.config)
    if adapter is not None and not adapter.checkpointable:
        if args.gradient_checkpointing:
            raise ValueError(f"gradient_checkpointing=True cannot be used with {adapter.describe()}: its keys and "
                             "values reach each block through the KV cache, which a recomputed block does not get. "
                             "Leave gradient_checkpointing out, or use lora=True (which checkpoints).")
        return 0
    for setting in (args.gradient_checkpointing, constructor_setting):
        if setting is not None:
            return n_layer if setting else 0
    return n_layer if default_checkpointing(model) else 0


def block_count(config: Any) -> int:
    return getattr(config, "n_layer", None) or getattr(config, "num_hidden_layers", 0)


def decide_adapter(args: Arguments, loaded: AdapterSettings | None, resumed: dict | None,
                   model_type: str | None) -> AdapterSettings | None:
    """The peft method that trains: the one a loaded model already has (it keeps training; asked for again with
    the same settings, as the call that made it repeated with resume=True asks, it is that one), else train()'s
    lora=True, peft_config (any method, LoRA too) or adapter=, else with lora="auto" the LoRA of the run being
    resumed; None for full fine-tuning (lora="auto" is then budget.py's to decide)."""
    asked, given = asked_adapter(args, model_type)
    if loaded is not None:
        if asked is not None and not loaded.same_as(asked) \
                and not (asked.is_lora and loaded.is_lora and given == "lora=True"):
            raise ValueError(f"{given}: this model already has a {loaded.describe()} adapter (loaded with it), which "
                             f"keeps training; leave {given.split('=')[0]} out, or load the model without its adapter.")
        return loaded
    if asked is None and args.lora == "auto" and resumed is not None:
        saved = from_description(resumed, model_type or "")
        return saved if saved is not None and saved.is_lora else None
    return asked


def lora_of_call(args: Arguments) -> AdapterSettings:
    """The LoRA train()'s lora_r, lora_alpha, lora_dropout and lora_target_modules describe."""
    return AdapterSettings.lora(args.lora_r, args.lora_alpha, args.lora_dropout, args.lora_target_modules)


def asked_adapter(args: Arguments, model_type: str | None) -> tuple[AdapterSettings | None, str]:
    """The adapter train()'s arguments choose (arguments.check_adapter_choice allows one way), and which."""
    if args.lora is True:
        return lora_of_call(args), "lora=True"
    if args.get("peft_config") is not None:
        return AdapterSettings.of(args.peft_config, model_type), "peft_config"
    if args.get("adapter") is not None:
        return AdapterSettings.short_form(args.adapter), f"adapter={args.adapter!r}"
    return None, ""


def decide_sharding(args: Arguments, accelerator: str, optimizer: str) -> tuple[Any, bool]:
    """(strategy, offload): Lightning's "fsdp_cpu_offload" is "fsdp" with the shards in host memory, which only
    a GPU can use; a sharded model cannot train with 8-bit AdamW (sharding.py)."""
    strategy, offload = args.strategy, args.strategy == "fsdp_cpu_offload"
    if offload and accelerator == "cpu":
        raise ValueError("strategy='fsdp_cpu_offload' keeps the weights in host memory while a GPU computes; on a "
                         "CPU they are there already. Use strategy='fsdp' (or 'ddp').")
    if offload:
        strategy = "fsdp"
    if strategy == "fsdp" and optimizer == "adamw8bit":
        raise ValueError(f"optimizer='adamw8bit' cannot be used with strategy={args.strategy!r}: its 8-bit states "
                         "are not ones the sharded checkpoint gathers. Use optimizer='adamw' (sharding already "
                         "divides AdamW's states by the number of processes), or strategy='ddp'.")
    return strategy, offload


def decide_compile(args: Arguments, accelerator: str, strategy: Any) -> str | None:
    """What torch.compile compiles while training (compiling.py): only what the user asked for, never on a
    sharded model."""
    how = {True: "blocks", "blocks": "blocks", "model": "model"}.get(args.get("torch_compile", False))
    if how and strategy == "fsdp":
        raise ValueError(f"torch_compile={args.torch_compile!r} cannot be used with strategy={args.strategy!r}: a "
                         "sharded model is not compiled here. Leave torch_compile out, or use strategy='ddp'.")
    if how and accelerator == "cpu":
        logger.warning(f"torch_compile={args.torch_compile!r} on CPU: compiling measured slower than eager on CPUs "
                       "(benchmarks/RESULTS.md), and the first step waits for the compiler.")
    return how


def validation_interval(args: Arguments) -> int:
    """Optimizer steps between evaluations: eval_every, else save_every, else num_steps // 10; 0 without
    val_data."""
    if args.get("val_data") is None:
        return 0
    if args.get("eval_every") is not None:
        return args.eval_every
    return args.save_every or max(1, args.num_steps // EVALUATIONS_BY_DEFAULT)


def decide_optimizer(args: Arguments, resumed: dict | None) -> str:
    """The user's, else the resumed run's (its state is in the checkpoint), else AdamW."""
    return args.optimizer or (resumed or {}).get("optimizer") or "adamw"


def checkpoint_fixes(args: Arguments, resumed: dict | None) -> frozenset[str]:
    """The memory choices a checkpoint being resumed holds the run to, where the call did not name them."""
    if resumed is None:
        return frozenset()
    held = {"optimizer"} | {name for name in ("step_in_backward", "four_bit_base") if resumed.get(name)}
    return frozenset(held - args.given())


def fixed_choices(args: Arguments, constructor_checkpointing: bool | None, resumed: dict | None,
                  adapter: AdapterSettings | None = None) -> frozenset[str]:
    """The memory choices the user made, which max_memory and out-of-memory recovery keep (and a resumed
    run's optimizer, whose state the checkpoint holds, and no checkpointing where the adapter forbids it)."""
    fixed = set(FITTED_CHOICES) & args.given()
    if constructor_checkpointing is not None or (adapter is not None and not adapter.checkpointable):
        fixed.add("gradient_checkpointing")
    if args.strategy in ("fsdp", "fsdp_cpu_offload"):  # 8-bit AdamW cannot shard (decide_sharding)
        fixed.add("optimizer")
    if resumed is not None:
        fixed.add("optimizer")
    return frozenset(fixed)


def check_four_bit_unsharded(args: Arguments, shards: int, offload: bool) -> None:
    """TrainPlan's invariant that a 4-bit base is held whole in one process, refused at the argument."""
    if shards > 1 or offload:
        asked = ("base_bits=4" if args.get("base_bits") == 4
                 else "the checkpoint to resume (its adapter trained on a 4-bit base)")
        raise ValueError(f"{asked} cannot be used with strategy={args.strategy!r}, which "
                         f"{'offloads' if offload else f'shards across {shards} processes'} the model: a 4-bit base "
                         "is held whole in one process. Use strategy='ddp' (each process holds the 4-bit base), or "
                         "leave base_bits out.")


def resumed_in_backward(args: Arguments, resumed: dict | None, sharded: bool, precision: str) -> bool:
    """A resumed run that updated inside backward goes on so (its checkpoint holds no gradient state to go
    back); TrainPlan's invariant for it refused at the argument that breaks it.  An accumulation is
    resume.check_resumable's to refuse, with the checkpoint's other settings."""
    if not (resumed or {}).get("step_in_backward") or args.gradient_accumulation_steps != 1:
        return False
    asked = (f"strategy={args.strategy!r}" if sharded else f"precision={args.precision!r}" if args.precision
             else f"fp16={args.fp16!r}")
    if not can_step_in_backward(1, sharded, precision):
        raise ValueError(f"{asked}: the checkpoint to resume updated each weight inside backward, which needs one "
                         "unsharded model and no fp16 loss scaling; resume without it (strategy='ddp' or 'auto', "
                         "precision='bf16-mixed' or '32-true'), or pass resume=False to start over.")
    return True


def build_plan(model: torch.nn.Module, args: Arguments, *, constructor_checkpointing: bool | None,
               freeze_by_default: bool, loaded_adapter: AdapterSettings | None, resume_from: str | None,
               resumed: dict | None) -> TrainPlan:
    """Every decision not fixed by an argument, before any memory budget is applied (`resumed`: the
    description of the run a checkpoint being resumed came from)."""
    accelerator, devices = resolve_accelerator(args.n_gpu, args.devices)
    check_launchable(accelerator, devices, args.strategy)
    on_cpu = accelerator == "cpu"
    adapter = decide_adapter(args, loaded_adapter, resumed, getattr(model.config, "model_type", None))
    strategy, offload = decide_sharding(args, accelerator, decide_optimizer(args, resumed))
    shards = processes_here(accelerator, devices) * args.num_nodes if strategy == "fsdp" else 1
    if strategy == "fsdp" and shards == 1 and not offload:
        logger.info("strategy='fsdp' with one process: there is nothing to shard the model across; training as one "
                    "process (devices= sets how many).")
        strategy = "auto"
    note = precision_note(args.fp16, args.precision, accelerator)
    if note:
        logger.warning(note)
    # base_bits=4 asks for it (with lora="auto", for the LoRA the planner may choose: budget.tiers); a resumed
    # run's adapter goes on training on the base it was trained on
    four_bit_base = adapter is not None and (args.get("base_bits") == 4 or bool((resumed or {}).get("four_bit_base")))
    if four_bit_base:
        check_four_bit_unsharded(args, shards, offload)
    precision = resolve_precision(args.fp16, args.precision, accelerator)
    plan = TrainPlan(
        output_dir=os.fspath(args.output_dir),
        accelerator=accelerator,
        devices=devices,
        num_nodes=args.num_nodes,
        strategy=strategy,
        shards=shards,
        offload=offload,
        precision=precision,
        checkpointed_blocks=decide_checkpointing(args, constructor_checkpointing, model, adapter),
        n_layer=block_count(model.config),
        adapter=adapter,
        freeze_layers=args.freeze_layers or freeze_by_default,
        num_layers_freeze=args.num_layers_freeze,
        micro_batch_size=args.batch_size,
        accumulation=args.gradient_accumulation_steps,
        loss_chunk_tokens=default_chunk_tokens(accelerator) if args.chunked_loss else None,
        optimizer=decide_optimizer(args, resumed),
        step_in_backward=resumed_in_backward(args, resumed, shards > 1 or offload, precision),
        cpu_speedups=on_cpu,
        torch_compile=decide_compile(args, accelerator, strategy),
        hold_freed_heap=False,  # budget.py holds the heap where the memory needs it
        # The DataLoader only slices an in-memory array: worker processes cost
        # start-up time and crash scripts without a `__main__` guard.
        num_workers=args.num_workers or 0,
        # a seed for the data order even without seed=, so that a resumed run keeps the order
        data_seed=args.seed if args.seed is not None else int(torch.randint(2**31, ())),
        resume_from=resume_from,
        fixed=fixed_choices(args, constructor_checkpointing, resumed, adapter),
        checkpoint_fixes=checkpoint_fixes(args, resumed),
        run_id=(resumed or {}).get("run_id") or new_run_id(),
    )
    return plan.on_four_bit_base() if four_bit_base else plan


def run_settings(args: Arguments) -> RunSettings:
    """The run's own settings from train()'s checked arguments."""
    val_data = args.get("val_data")
    return RunSettings(
        schedule=Schedule(args.num_steps, args.save_every or 0, args.generate_every or 0, validation_interval(args)),
        seed=args.seed, learning_rate=args.learning_rate, weight_decay=args.weight_decay,
        adam_epsilon=args.adam_epsilon, warmup_steps=args.warmup_steps, max_grad_norm=args.max_grad_norm or 0,
        n_generate=args.n_generate, avg_loss_smoothing=args.avg_loss_smoothing,
        progress_bar_refresh_rate=args.progress_bar_refresh_rate,
        early_stopping_patience=args.get("early_stopping_patience"),
        held_out_fraction=val_data if isinstance(val_data, float) else None,
    )


def planner_inputs(args: Arguments) -> PlannerInputs:
    """What train()'s arguments ask of the planner beyond the plan (PlannerInputs)."""
    max_memory = args.get("max_memory")
    lora_if_needed = lora_of_call(args) if args.get("lora") == "auto" else None
    return PlannerInputs(max_memory=parse_bytes(max_memory) if max_memory is not None else None,
                         pin_micro_batch=bool(args.get("pin_micro_batch", False)), lora_if_needed=lora_if_needed,
                         fp32_asked=args.get("fp16") is False,
                         accumulation_pinned=args.gradient_accumulation_steps > 1,
                         four_bit_asked=args.get("base_bits") == 4)
