"""The full fine-tune's tiers that update inside backward, each against the tier above it, in one run, steps
alternating.

    python benchmarks/tier_speed.py --size 355M --block 256 --steps 6

Three copies of one GPT-2 (random weights), held as the planner's 16-bit tiers hold them on a CPU without
native bf16: every weight in bf16, computed in fp32 (storage16.py), every block checkpointed.  The tiers (each
stepped as quality_tiers.py steps it): 8-bit AdamW stepped after backward (the gradients whole, clipped
globally), the same stepped inside backward (in_backward.py: each tensor as its gradient completes, clipped
alone), and Adafactor inside backward (stepped through fp32, a large matrix in slices of rows).  A training
step of each alternates with the others', so all see the same machine; prints the median step time over the
steps after the first (8-bit AdamW compiles its update in the first) and each tier's ratio to the tier above.
"""

from __future__ import annotations

import torch
from four_bit_speed import alternating_medians, size_block_steps
from quality_tiers import FULL_TIERS, tier_step
from transformers import GPT2Config, GPT2LMHeadModel

from lowmem_aitextgen.training.estimate import GPT2_SIZES
from lowmem_aitextgen.training.plan import TrainPlan
from lowmem_aitextgen.training.techniques import apply_memory_plan

TIERS = FULL_TIERS[2:]  # from "bf16 weights, 8-bit AdamW", the tier the two inside backward come below


def held_as_the_tiers_hold_it(config: GPT2Config) -> torch.nn.Module:
    torch.manual_seed(0)
    plan = TrainPlan(n_layer=config.n_layer, checkpointed_blocks=config.n_layer, upcast_bf16_weights=True)
    model, _ = apply_memory_plan(GPT2LMHeadModel(config), plan)
    return model


def main() -> None:
    args = size_block_steps(__doc__)
    config = GPT2Config(**GPT2_SIZES[args.size])
    steps = {tier: tier_step(held_as_the_tiers_hold_it(config), tier) for tier in TIERS}
    medians = alternating_medians(steps, config, args.block, args.steps)
    for above, tier in zip((None, *TIERS), TIERS):
        ratio = f"  {medians[tier] / medians[above]:.2f}x the tier above" if above else ""
        print(f"{tier:<45} median step {medians[tier]:.2f} s{ratio}")
    print(f"({args.size}, block {args.block}, {torch.get_num_threads()} threads, {args.steps} steps each)")


if __name__ == "__main__":
    main()
