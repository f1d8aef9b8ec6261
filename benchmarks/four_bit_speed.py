"""The 4-bit base's speed against the tier above it (the 16-bit base), in one run, steps alternating.

    python benchmarks/four_bit_speed.py --size 355M --block 256 --steps 6

Two copies of one GPT-2 (random weights), each with LoRA on every projection, as the planner's two tiers
hold them on a CPU without native bf16: the base in bf16 computed in fp32 (storage16.py), and the same with
its block matrices in NF4 (four_bit.py); every block checkpointed in both.  A training step of each (forward,
backward, AdamW on the adapters) alternates with the other's, so both see the same machine; the median
step time over the steps after the first, their ratio, and each model's parameter bytes are printed.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from lowmem_aitextgen.training.adapter_settings import AdapterSettings
from lowmem_aitextgen.training.counting import unique_tensor_bytes
from lowmem_aitextgen.training.estimate import GPT2_SIZES
from lowmem_aitextgen.training.plan import TrainPlan
from lowmem_aitextgen.training.techniques import apply_memory_plan


def prepared(config: GPT2Config, four_bit: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    plan = TrainPlan(n_layer=config.n_layer, checkpointed_blocks=config.n_layer, upcast_bf16_weights=True,
                     adapter=AdapterSettings.lora(8, 16, 0.0, None), loss_chunk_tokens=128, four_bit_base=four_bit)
    model, _ = apply_memory_plan(GPT2LMHeadModel(config), plan)
    return model


def size_block_steps(description: str) -> argparse.Namespace:
    """--size, --block and --steps of a speed comparison (also tier_speed.py's)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="355M", choices=list(GPT2_SIZES))
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--steps", type=int, default=6)
    return parser.parse_args()


def alternating_medians(steps: dict[str, Callable[[torch.Tensor], None]], config: GPT2Config, block: int,
                        rounds: int) -> dict[str, float]:
    """Each named training step run `rounds` times on one batch of `block` tokens, alternating with the others
    (all see the same machine); the median seconds of each over the rounds after the first."""
    ids = torch.randint(config.vocab_size, (1, block), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            started = time.perf_counter()
            step(ids)
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(t[1:]) for name, t in times.items()}


def main() -> None:
    args = size_block_steps(__doc__)
    config = GPT2Config(**GPT2_SIZES[args.size])
    models = {"16-bit base": prepared(config, False), "4-bit base": prepared(config, True)}
    steps = {name: adamw_step(model) for name, model in models.items()}
    medians = alternating_medians(steps, config, args.block, args.steps)
    for name, model in models.items():
        print(f"{name:<12} median step {medians[name]:.2f} s  parameters "
              f"{unique_tensor_bytes(model.parameters()) / 2**30:.2f} GiB")
    print(f"4-bit / 16-bit step time: {medians['4-bit base'] / medians['16-bit base']:.2f}x "
          f"({args.size}, block {args.block}, {torch.get_num_threads()} threads)")


def adamw_step(model: torch.nn.Module) -> Callable[[torch.Tensor], None]:
    """A training step of the adapter's weights: forward, backward, AdamW."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def step(ids: torch.Tensor) -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


if __name__ == "__main__":
    main()
