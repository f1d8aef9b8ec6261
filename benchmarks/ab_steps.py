"""A/B of one change inside one training run: the two variants alternate step by step.

    python benchmarks/ab_steps.py attention --mode full --steps 12
    python benchmarks/ab_steps.py plain_top_blocks --blocks 8 --mode full --steps 12

On the shared 2-core machines here, whole runs of the same code differ by ±15%; the steps of one
run see the same machine, so alternating A and B step by step separates changes of 5-10%.
355M GPT-2 at block 512 on CPU through `ai.train(...)` (our defaults, or `lora=True` with
--mode lora); prints each variant's median step time over the steps after the first two, and
the peak RSS of its steps (the kernel's high-water mark, reset before each step).

Experiments:
  attention         GPT-2's attention as `cpu.gpt2_attention` (compute dtype throughout)
                    against the same math as transformers' eager attention under autocast
                    (the mask's dtype promotes the scores, softmax in fp32, cast back)
  plain_top_blocks  all blocks checkpointed against the top --blocks blocks not checkpointed
  saved_matmuls     plain checkpointing against selective checkpointing (torch's
                    create_selective_checkpoint_contexts) keeping the blocks' addmm outputs
                    (--save all, or only the widening c_attn and c_fc: --save wide)
  held_heap         glibc handing the freed top of its heap back at every free against holding
                    it until the release before the optimizer step (heap.HELD's trim threshold)
  frozen_head_loss  (--mode lora) the chunked loss of a frozen head checkpointed chunk by chunk
                    (its logits made twice) against its gradient made in forward
"""

from __future__ import annotations

import argparse
import functools
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from memory_speed import build_model, dataset, reset_peak_rss, vm_hwm_bytes  # noqa: E402

from lowmem_aitextgen import heap
from lowmem_aitextgen.training import cpu
from lowmem_aitextgen.training.checkpointing import transformer_blocks  # noqa: E402

EAGER_IN_AUTOCAST = "ab_eager_in_autocast"


def eager_in_autocast(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The attention before the compute-dtype change: transformers' eager steps, autocast left on."""
    scaling = cpu._gpt2_scaling(module, query) if scaling is None else scaling
    if dropout == 0.0 or attention_mask is None:
        return cpu.gpt2_attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling + attention_mask
    probabilities = nn.functional.softmax(scores, dim=-1).type(value.dtype)
    probabilities = cpu.fast_dropout(probabilities, dropout, module.training)
    return torch.matmul(probabilities, value).transpose(1, 2), probabilities


def attention_variants(model: nn.Module, args: argparse.Namespace) -> dict:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    AttentionInterface.register(EAGER_IN_AUTOCAST, eager_in_autocast)
    ALL_MASK_ATTENTION_FUNCTIONS.register(EAGER_IN_AUTOCAST, eager_mask)

    def use(name: str):
        return lambda: setattr(model.config, "_attn_implementation", name)

    return {"compute dtype": use(cpu.ATTENTION), "eager in autocast": use(EAGER_IN_AUTOCAST)}


def plain_top_blocks_variants(model: nn.Module, args: argparse.Namespace) -> dict:
    planned: dict[nn.Module, bool] = {}  # what the plan set (checkpointing is on for 355M and up)

    def plain_top(top: int):
        def apply() -> None:
            blocks = transformer_blocks(model)
            for index, block in enumerate(blocks):
                planned.setdefault(block, block.gradient_checkpointing)
                block.gradient_checkpointing = planned[block] and index < len(blocks) - top
        return apply

    return {"all checkpointed": plain_top(0), f"top {args.blocks} plain": plain_top(args.blocks)}


def saved_matmuls_variants(model: nn.Module, args: argparse.Namespace) -> dict:
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    def policy(ctx, op, *op_args, **op_kwargs):
        if op is torch.ops.aten.addmm.default:
            weight = op_args[2]
            if args.save == "all" or weight.shape[1] > weight.shape[0]:
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    plain = functools.partial(checkpoint, use_reentrant=False)
    selective = functools.partial(checkpoint, use_reentrant=False,
                                  context_fn=functools.partial(create_selective_checkpoint_contexts, policy))

    def use(function):
        def apply() -> None:
            for block in transformer_blocks(model):
                block._gradient_checkpointing_func = function
        return apply

    return {"recompute all": use(plain), f"save {args.save} matmuls": use(selective)}


def frozen_head_loss_variants(model: nn.Module, args: argparse.Namespace) -> dict:
    from lowmem_aitextgen.training.chunked_loss import body_and_head

    head = body_and_head(model)[1]
    hooks = []

    def checkpointed() -> None:  # a forward hook sends the loss down the checkpointed-chunks path
        if not hooks:
            hooks.append(head.register_forward_hook(lambda module, inputs, output: None))

    def in_forward() -> None:
        while hooks:
            hooks.pop().remove()

    return {"checkpointed chunks": checkpointed, "gradient in forward": in_forward}


def held_heap_variants(model: nn.Module, args: argparse.Namespace) -> dict:
    undo: list = []

    def not_held() -> None:
        while undo:
            undo.pop()()

    def held() -> None:
        if not undo:
            undo.append(heap.use(heap.HeapSettings("held", trim_threshold=heap.HELD_HEAP_BYTES)))

    return {"heap not held": not_held, "heap held": held}


EXPERIMENTS = {"attention": attention_variants, "plain_top_blocks": plain_top_blocks_variants,
               "saved_matmuls": saved_matmuls_variants, "held_heap": held_heap_variants,
               "frozen_head_loss": frozen_head_loss_variants}


class Alternate(pl.Callback):
    """Applies variant i % 2 before step i; times each step and takes its peak RSS and page faults."""

    def __init__(self, variants: dict) -> None:
        self.variants = variants
        self.times: dict[str, list[float]] = {name: [] for name in variants}
        self.peaks: dict[str, int] = {name: 0 for name in variants}
        self.faults: dict[str, list[int]] = {name: [] for name in variants}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.name = list(self.variants)[batch_idx % 2]
        self.variants[self.name]()
        reset_peak_rss()
        self.start_faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        elapsed = time.perf_counter() - self.start
        if batch_idx >= 2:  # warm-up
            self.times[self.name].append(elapsed)
            self.faults[self.name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - self.start_faults)
            self.peaks[self.name] = max(self.peaks[self.name], vm_hwm_bytes())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("experiment", choices=EXPERIMENTS)
    parser.add_argument("--mode", choices=["full", "lora"], default="full")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--blocks", type=int, default=8, help="plain_top_blocks: how many top blocks")
    parser.add_argument("--save", choices=["all", "wide"], default="wide",
                        help="saved_matmuls: every block matmul's output, or only the widening ones (c_attn, c_fc)")
    args = parser.parse_args()
    ai = build_model("sdpa")
    alternate = Alternate(EXPERIMENTS[args.experiment](ai.model, args))
    with tempfile.TemporaryDirectory() as out:
        ai.train(dataset(512), output_dir=out, num_steps=args.steps, learning_rate=1e-4, save_every=0,
                 generate_every=0, n_gpu=0, callbacks=[alternate], progress_bar_refresh_rate=100,
                 lora=args.mode == "lora")
    for name, times in alternate.times.items():
        print(f"{name}: median step {statistics.median(times):.2f} s, peak RSS "
              f"{alternate.peaks[name] / 2**30:.2f} GiB, median page faults "
              f"{statistics.median(alternate.faults[name]):.0f}; steps: {' '.join(f'{t:.2f}' for t in times)}")


if __name__ == "__main__":
    main()
