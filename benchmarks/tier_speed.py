"""The full fine-tune's tiers that update inside backward, each against the tier above it, in one run, steps
alternating.

    python benchmarks/tier_speed.py --size 355M --block 256 --steps 6

Three copies of one GPT-2 (random weights), held as the planner's 16-bit tiers hold them on a CPU without
native bf16: every weight in bf16, computed in fp32 (storage16.py), every block checkpointed.  The tiers: 8-bit AdamW stepped after backward (the gradients whole, clipped globally), the same
stepped inside backward (in_backward.py: each tensor as its gradient completes, clipped alone), and
Adafactor inside backward (stepped through fp32, a large matrix in slices of rows).  A training step of each
alternates with the others', so all see the same machine; prints the median step time over the steps after
the first (8-bit AdamW compiles its update in the first) and each tier's ratio to the tier above.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from lowmem_aitextgen.estimate import GPT2_SIZES
from lowmem_aitextgen.in_backward import StepInBackward
from lowmem_aitextgen.memory import apply_memory_plan
from lowmem_aitextgen.optimizers import optimizer_over, parameter_groups
from lowmem_aitextgen.plan import TrainPlan

TIERS = ("bf16 weights, 8-bit AdamW", "8-bit AdamW inside backward", "Adafactor inside backward")
LR, CLIP = 1e-4, 0.5


def stepper(config: GPT2Config, tier: str) -> Callable[[torch.Tensor], None]:
    """A function that trains one step of this tier's model on a batch."""
    torch.manual_seed(0)
    plan = TrainPlan(n_layer=config.n_layer, checkpointed_blocks=config.n_layer, upcast_bf16_weights=True)
    model, _ = apply_memory_plan(GPT2LMHeadModel(config), plan)
    name = "adafactor" if tier.startswith("Adafactor") else "adamw8bit"
    groups = parameter_groups(model, 0.0)
    if tier.endswith("inside backward"):
        make = functools.partial(optimizer_over, learning_rate=LR, adam_epsilon=1e-8, optimizer=name)
        inside = StepInBackward(groups, make, LR, max_grad_norm=CLIP, through_fp32=name != "adamw8bit")
        return lambda ids: inside.step(closure=lambda: model(input_ids=ids, labels=ids).loss.backward())
    optimizer = optimizer_over(groups, LR, 1e-8, name)

    def step(ids: torch.Tensor) -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="355M", choices=list(GPT2_SIZES))
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    config = GPT2Config(**GPT2_SIZES[args.size])
    steps = {tier: stepper(config, tier) for tier in TIERS}
    times: dict[str, list[float]] = {tier: [] for tier in TIERS}
    ids = torch.randint(config.vocab_size, (1, args.block), generator=torch.Generator().manual_seed(0))
    for _ in range(args.steps):
        for tier, step in steps.items():
            started = time.perf_counter()
            step(ids)
            times[tier].append(time.perf_counter() - started)
    medians = {tier: statistics.median(t[1:]) for tier, t in times.items()}
    for above, tier in zip((None, *TIERS), TIERS):
        ratio = f"  {medians[tier] / medians[above]:.2f}x the tier above" if above else ""
        print(f"{tier:<28} median step {medians[tier]:.2f} s{ratio}")
    print(f"({args.size}, block {args.block}, {torch.get_num_threads()} threads, {args.steps} steps each)")


if __name__ == "__main__":
    main()
