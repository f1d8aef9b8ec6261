"""How long an optimizer step of a plan takes, roughly: the cost model budget.py ranks plans by.

Only the ranking matters, so the model counts what differs between the plans the planner weighs, from
the model's shape and a few device constants (measured: benchmarks/RESULTS.md):

| term                          | what changes it                                | where it comes from          |
|-------------------------------|------------------------------------------------|------------------------------|
| matmul work per token         | the model's width, depth, vocabulary, block     | 2 FLOPs a weight, attention  |
| backward                      | 2x forward; LoRA or frozen: 1x (no weight grads)| autograd                     |
| recompute                     | one more forward of each checkpointed block     | checkpointing                |
| throughput                    | device and precision (bf16 is slower than fp32  | DEVICE_FLOPS, hardware.py's  |
|                               | on CPUs without native bf16)                   | CPU_BF16_SPEED               |
| micro-batch                   | tokens per micro-batch below a device's         | SATURATION_TOKENS            |
|                               | saturation leave it partly idle                |                              |
| per micro-batch               | Python, Lightning, kernel launches; each weight | MICRO_BATCH_OVERHEAD_S,      |
|                               | cast or gradient accumulated once more          | MICRO_BATCH_S_PER_PARAMETER  |
| weights in bf16 under fp32    | each weight upcast in forward and backward     | UPCAST_S_PER_PARAMETER       |
|   (storage16.py)              | and each recompute                             |                              |
| a 4-bit base (four_bit.py)    | each block weight dequantized as often         | DEQUANTIZE_S_PER_PARAMETER   |
| optimizer                     | the parameters it updates, and how (8-bit AdamW | OPTIMIZER_S_PER_PARAMETER    |
|                               | quantizes every state: much slower on CPU)     |                              |
| CPU: the held heap            | each block's activations, given back to the OS | REFAULT_S_PER_BYTE           |
|   (plan.hold_freed_heap)      | after it, fault back in at the next block      |                              |
| offloading (plan.offload)     | each weight to the GPU in forward, backward and| OFFLOAD_BYTES_PER_S; AdamW at|
|                               | recompute, each gradient back; AdamW on the CPU| the CPU's rate               |
| sharding (plan.shards > 1)    | the weights all-gathered and the gradients     | SHARD_BYTES_PER_S            |
|                               | reduce-scattered, as often as gathered_for says|                              |

Its error, checked against measured steps on the 2-core CPU here (tests/test_step_time.py holds the
orderings it must get right): the times themselves can be off by tens of percent, the order of plans
that differ in checkpointed blocks, micro-batch or optimizer comes out right.  The GPU constants are
an H100's (benchmarks/gpu_session.sh measures them when a GPU is lent).
"""

from __future__ import annotations

from typing import Any

from ..hardware import CPU_BF16_SPEED
from .plan import TrainPlan

# Matmul throughput in FLOP/s a training step reaches, by device and computing dtype (CPU: fp32; bf16 is
# hardware.CPU_BF16_SPEED times that).
DEVICE_FLOPS = {("gpu", "16"): 250e12, ("gpu", "32"): 40e12, ("cpu", "32"): 110e9}
# Tokens per micro-batch at which the device is half as fast as when saturated (time grows by
# SATURATION_TOKENS / tokens): a GPU needs thousands of rows per matmul, a CPU's few cores far fewer.
SATURATION_TOKENS = {"gpu": 2048, "cpu": 32}
# Each micro-batch: Python/Lightning/kernel launches, and a pass over every weight that trains or is
# cast by autocast (the weights cast to bf16, the gradient accumulated): why fewer, larger micro-batches
# are faster on CPU too.
MICRO_BATCH_OVERHEAD_S = {"gpu": 0.01, "cpu": 0.02}
MICRO_BATCH_S_PER_PARAMETER = {"gpu": 0.002e-9, "cpu": 1.8e-9}
# A bf16 weight upcast to fp32 (storage16.py): memory-bound, measured 1.2-1.5 ns a weight on the 2-core CPU.
UPCAST_S_PER_PARAMETER = {"gpu": 0.002e-9, "cpu": 1.3e-9}
# A 4-bit NF4 weight made dense (four_bit.py): 4-9.5 ns a weight on the 2-core CPU by shape, 8.5 over a block,
# to fp32 or bf16 alike (benchmarks/dequantize.py); the GPU's is a guess until gpu_session.sh measures it.
DEQUANTIZE_S_PER_PARAMETER = {"gpu": 0.02e-9, "cpu": 8.5e-9}
# Seconds per updated parameter for one optimizer step.
OPTIMIZER_S_PER_PARAMETER = {("gpu", "adamw"): 0.4e-9, ("gpu", "adamw8bit"): 0.8e-9, ("gpu", "adafactor"): 0.6e-9,
                             ("cpu", "adamw"): 1.2e-9, ("cpu", "adamw8bit"): 15e-9, ("cpu", "adafactor"): 3e-9}
# CPU, plan.hold_freed_heap: the freed heap given back at every block is faulted back in (kernel-zeroed
# pages) by the next block's activations: seconds per byte.
REFAULT_S_PER_BYTE = 1.0 / 2**30
# Host <-> GPU copies of an offloading plan (sharding.py): PCIe 4.0 x16 moves ~25 GB/s pinned; half of
# it, for pageable buffers and the copies that do not overlap compute.
OFFLOAD_BYTES_PER_S = 12e9
# A sharded plan's collectives (sharding.py), in bytes of the whole tensors gathered or reduced a second:
# gloo over loopback on the 2-core CPU all-gathers or reduce-scatters one 124M block (28 MB) in 55-70 ms, and
# none of it overlaps compute there; NCCL on GPUs overlaps most of it with compute.
SHARD_BYTES_PER_S = {"cpu": 0.5e9, "gpu": 50e9}


def shape(config: Any) -> tuple[int, int, int]:
    """(blocks, width, vocabulary) of a GPT-2-like config."""
    n_layer = getattr(config, "n_layer", None) or config.num_hidden_layers
    width = getattr(config, "n_embd", None) or config.hidden_size
    return n_layer, width, config.vocab_size


def step_seconds(plan: TrainPlan, config: Any, block_size: int, trainable_parameters: int,
                 bf16_native: bool = True, activation_bytes: int = 0, block_bytes: int = 0,
                 sharded_bytes: tuple[int, int] = (0, 0)) -> float:
    """Expected seconds of one optimizer step (plan.micro_batch_size x plan.accumulation sequences);
    activation_bytes: what one micro-batch keeps for backward (the estimate's activations), block_bytes:
    one block's activations (the estimate's block_activations), sharded_bytes: a sharded plan's whole weights
    and gradients (what its collectives move)."""
    n_layer, width, vocab = shape(config)
    block_flops = 24 * width * width + 4 * block_size * width  # per token: matmuls, then attention
    head_flops = 2 * vocab * width
    forward = n_layer * block_flops + head_flops
    frozen_base = plan.trains_adapter
    backward = forward if frozen_base else 2 * forward
    recompute = plan.checkpointed_blocks * block_flops
    # the chunked loss makes its gradients in forward: no more work than the model's own loss (chunked_loss.py)
    flops_per_token = forward + backward + recompute
    tokens_per_micro = plan.micro_batch_size * block_size
    seconds_per_token = flops_per_token / throughput(plan, width, bf16_native)
    seconds_per_token *= 1 + SATURATION_TOKENS[plan.accelerator] / tokens_per_micro
    cast_or_accumulated = trainable_parameters if not frozen_base else 0  # LoRA's base is held in 16 bits
    micro_batch = (tokens_per_micro * seconds_per_token + MICRO_BATCH_OVERHEAD_S[plan.accelerator]
                   + cast_or_accumulated * MICRO_BATCH_S_PER_PARAMETER[plan.accelerator]
                   + upcast_seconds(plan, n_layer, width, vocab))
    optimizer = trainable_parameters * OPTIMIZER_S_PER_PARAMETER[(plan.accelerator, plan.optimizer)]
    if plan.offload:
        optimizer = offload_seconds(plan, n_layer, trainable_parameters)
    refaults = 0.0
    if plan.hold_freed_heap:  # every block's activations, in forward and once more where recomputed
        refaulted = activation_bytes + (n_layer + plan.checkpointed_blocks) * block_bytes
        refaults = plan.accumulation * refaulted * REFAULT_S_PER_BYTE
    return plan.accumulation * micro_batch + optimizer + refaults + shard_seconds(plan, config, *sharded_bytes)


def shard_seconds(plan: TrainPlan, config: Any, weight_bytes: int, gradient_bytes: int) -> float:
    """A sharded plan's collectives in one step: each micro-batch gathers the weights in forward (the blocks'
    once more in backward with gathered_for "block") and reduce-scatters the gradients; with "step", once a
    step.  Each process sends or receives (N-1)/N of each."""
    if plan.shards <= 1:
        return 0.0
    n_layer, width, vocab = shape(config)
    blocks = 12 * n_layer * width * width
    per_micro_batch = weight_bytes + gradient_bytes
    if plan.gathered_for == "block":
        per_micro_batch += weight_bytes * blocks / (blocks + vocab * width)
    moved = per_micro_batch * (1 if plan.gathered_for == "step" else plan.accumulation)
    return moved * (plan.shards - 1) / plan.shards / SHARD_BYTES_PER_S[plan.accelerator]


def offload_seconds(plan: TrainPlan, n_layer: int, parameters: int) -> float:
    """What offloading adds to a step, and its optimizer step: every micro-batch copies each fp32 weight to
    the GPU in forward, backward and a checkpointed block's recompute, and each gradient back; AdamW runs
    on the CPU."""
    recomputed = plan.checkpointed_blocks / max(n_layer, 1)
    copied = plan.accumulation * parameters * 4 * (2 + recomputed + 1)
    return copied / OFFLOAD_BYTES_PER_S + parameters * OPTIMIZER_S_PER_PARAMETER[("cpu", "adamw")]


def upcast_seconds(plan: TrainPlan, n_layer: int, width: int, vocab: int) -> float:
    """A micro-batch's upcasts of a bf16 base computed in fp32, or dequantizations of a 4-bit one: every block
    weight in forward and backward, a checkpointed block's once more (and the bf16 LM head's upcasts)."""
    uses = (2 * n_layer + plan.checkpointed_blocks) * 12 * width * width
    head = 2 * vocab * width * UPCAST_S_PER_PARAMETER[plan.accelerator] if plan.bf16_weights_computed_in_fp32 else 0.0
    if plan.four_bit_base:
        return uses * DEQUANTIZE_S_PER_PARAMETER[plan.accelerator] + head
    return uses * UPCAST_S_PER_PARAMETER[plan.accelerator] + head if plan.bf16_weights_computed_in_fp32 else 0.0


def throughput(plan: TrainPlan, width: int, bf16_native: bool) -> float:
    """FLOP/s of this plan's matmuls on its device."""
    if plan.accelerator == "cpu":
        fp32 = DEVICE_FLOPS[("cpu", "32")]
        return fp32 * CPU_BF16_SPEED[bf16_native] if plan.half_dtype is not None else fp32
    return DEVICE_FLOPS[("gpu", "16" if plan.half_dtype is not None else "32")]
