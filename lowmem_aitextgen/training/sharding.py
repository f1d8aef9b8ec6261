"""Sharding the model across processes: strategy="fsdp" as torch's FSDP2 (fully_shard) through Lightning's
ModelParallelStrategy, one GPT-2 block per shard unit.

| strategy               | each process holds                          | costs                                 |
|------------------------|---------------------------------------------|---------------------------------------|
| "ddp"                  | every weight, gradient and optimizer state  | one all-reduce of the gradients       |
| "fsdp" (this file)     | 1/N of them, and one or two blocks' whole   | each block's weights all-gathered in  |
|                        | weights while they compute                  | forward and again in backward, its    |
|                        |                                             | gradients reduce-scattered            |

How long a process holds what it gathered (plan.gathered_for, the planner's choice: budget.py weighs the
memory, step_time.py the collectives they save, which on a CPU do not overlap compute):

| gathered_for  | held whole                                   | collectives a step (k micro-batches)          |
|---------------|----------------------------------------------|-----------------------------------------------|
| "block"       | a block's weights while it computes          | k x (weights gathered twice, gradients        |
|               |                                              | reduce-scattered): the least memory           |
| "micro-batch" | every block's weights from its forward to    | k x (weights gathered once, gradients         |
|               | its backward (reshard_after_forward=False)   | reduce-scattered)                             |
| "step"        | the weights and their unreduced gradients    | weights gathered once, gradients reduce-      |
|               | over a step's micro-batches (FSDP2's         | scattered once: DDP's traffic, with the       |
|               | set_requires_gradient_sync, as DDP no_sync)  | optimizer's states still sharded              |

Why FSDP2 and not Lightning's strategy="fsdp" (FSDP1): Lightning's refuses any accelerator but a GPU, and
FSDP1 itself refuses a CPU; FSDP2 runs on both (gloo on CPU), keeps each parameter's name, mixes frozen and
trainable parameters (LoRA) in one unit, and is what torch recommends now.  Lightning's ModelParallelStrategy
calls LightningModule.configure_model in each process, where shard() divides the model.

Offloading (plan.offload, GPU only): the same units with FSDP2's CPUOffloadPolicy, in one process or
several.  The fp32 weights, their gradients and AdamW's states live in host memory; each block's weights
are copied to the GPU while it computes, its gradients back, and AdamW steps on the CPU.  Chosen over
torchao's CPUOffloadOptimizer, which keeps the weights on the GPU in the training dtype (1558M's fp32
weights alone are 6.2 GB: more than an 8 GiB card has for them) and keeps no fp32 master copy of 16-bit
weights; and over DeepSpeed's ZeRO-Offload, which is another engine to install (strategy=
"deepspeed_stage_2_offload" still passes through to it).  The cost: every step moves each weight to the GPU
and each gradient back (8 bytes a parameter over PCIe) and runs AdamW on the CPU (step_time.py).

Saving: the checkpoint (last.ckpt) is gathered whole on rank 0 by Lightning (save_distributed_checkpoint=
False), so that it is the same file as a one-process run's and resumes in any number of processes; the model
is gathered whole on rank 0 by full_model(), rebuilt as a plain model (the adapter kept), and saved by the
same atomic saver as every run.  Gathering is collective: every process calls full_model() together.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from pytorch_lightning.strategies import ModelParallelStrategy
from torch import nn

from .plan import TrainPlan


def lightning_strategy(plan: TrainPlan) -> Any:
    """The Lightning strategy for the plan: a sharded plan (strategy="fsdp", or offloading) as
    ModelParallelStrategy over its processes (data parallel only: every process a shard), anything else as
    given."""
    if not plan.sharded:
        return plan.strategy
    return ShardingStrategy(
        data_parallel_size=plan.shards // plan.num_nodes, tensor_parallel_size=1, save_distributed_checkpoint=False,
        # offloaded: the gradients' norm (clipping) is reduced over shards that live in host memory, by gloo
        **({"process_group_backend": "cuda:nccl,cpu:gloo"} if plan.offload else {}),
        offload=plan.offload, defer_reduction=plan.gathered_for == "step")


class ShardingStrategy(ModelParallelStrategy):
    """ModelParallelStrategy, and what it leaves to the module: offloaded shards stay in host memory, and
    (defer_reduction) a step's micro-batches but the last neither reduce their gradients nor reshard."""

    def __init__(self, *args: Any, offload: bool = False, defer_reduction: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.offload = offload
        self.defer_reduction = defer_reduction

    def model_to_device(self) -> None:
        """Offloaded: only buffers go to the GPU (Lightning's model_to_device, which runs after configure_model
        has sharded, would move every shard)."""
        if not self.offload:
            super().model_to_device()
            return
        for module in self.model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                module._buffers[name] = buffer.to(self.root_device)

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """What Lightning runs a step's micro-batches but the last in (DDP's no_sync): with defer_reduction the
        gradients accumulate whole, and the weights stay gathered for the next micro-batch."""
        model = self.lightning_module.model
        if not self.defer_reduction:
            yield
            return
        model.set_requires_gradient_sync(False)
        model.set_reshard_after_backward(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
            model.set_reshard_after_backward(True)


def shard(model: nn.Module, mesh: Any, plan: TrainPlan) -> None:
    """Each transformer block its own FSDP2 unit, then the rest (embeddings, final norm, head) one more:
    a block's weights are whole only while it computes (or, plan.gathered_for, from its forward to its
    backward); plan.offload: their shards kept in host memory."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    from .checkpointing import transformer_blocks

    policy = CPUOffloadPolicy() if plan.offload else OffloadPolicy()
    for block in transformer_blocks(model):
        fully_shard(block, mesh=mesh, offload_policy=policy, reshard_after_forward=plan.gathered_for == "block")
    # the root's own default: its embeddings and head, used last in forward, stay whole for backward
    fully_shard(model, mesh=mesh, offload_policy=policy)


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def reshard(model: nn.Module) -> None:
    """A sharded model back to its shards alone.  A forward outside training (validation) leaves the blocks
    gathered where the plan holds them from forward to backward (gathered_for), and what reads the model's
    state (a save, the checkpoint) reads the shards.  Local: no collective."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def full_model(model: nn.Module) -> nn.Module | None:
    """A model as a plain one: a sharded model's weights gathered whole on rank 0 into a new plain model
    of the same kind (the adapter kept, each weight in its dtype), None on the other ranks; any other
    model itself.  Collective for a sharded model: every rank calls it."""
    if not is_sharded(model):
        return model
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    reshard(model)
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return None
    return _plain_copy(model, state)


def _plain_copy(model: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    """A new model of `model`'s kind holding `state` (no copy of it), its buffers taken from `model`."""
    from transformers import AutoModelForCausalLM

    from .adapters import add_adapter, is_adapter_model, loaded_adapter

    base = model.get_base_model() if is_adapter_model(model) else model
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(base.config)
        if is_adapter_model(model):
            plain = add_adapter(plain, loaded_adapter(model))
    plain.load_state_dict(state, strict=False, assign=True)
    for name, buffer in model.named_buffers():
        _set_buffer(plain, name, buffer.detach().to("cpu", copy=True))
    (plain.get_base_model() if is_adapter_model(plain) else plain).tie_weights()
    trains = {name: parameter.requires_grad for name, parameter in model.named_parameters()}
    for name, parameter in plain.named_parameters():
        parameter.requires_grad_(trains[name])
    return plain


def _set_buffer(model: nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    module._buffers[leaf] = value
