"""What bf16 costs on this CPU: one training step with and without bf16 autocast, and the estimator's
probes in each precision (train()'s planner runs them before training, GPU plans included).

    python benchmarks/bf16_on_cpu.py

A CPU without native bf16 (no AVX512-BF16/AMX) emulates bf16 matmuls: far slower than fp32, which is why
fp16=True trains in fp32 there and the estimator's probes make their matmuls as zeros (estimate.py).
"""

from __future__ import annotations

import dataclasses
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def step_seconds(bf16: bool) -> float:
    """One forward and backward of GPT-2's width (768), 2 blocks and 50,257 words, at block 128."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=768, n_head=12))
    ids = torch.randint(50257, (1, 128))

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()

    step()  # warm-up
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def probe_seconds(size: str, precision: str) -> float:
    """The estimator's probes for one plan of a GPT-2 size (every block checkpointed and not)."""
    from lowmem_aitextgen.training.estimate import (
        _per_block_and_rest,
        config_jsons,
        memory_plan,
        model_config,
        probe_plan,
    )

    config = model_config(size)
    start = time.perf_counter()
    for blocks in (0, 1):  # the probes of a plan that checkpoints nothing, and of one that checkpoints every block
        plan = dataclasses.replace(probe_plan(memory_plan(precision, False, None, 1, "adamw", True, "cuda")),
                                   n_layer=blocks, checkpointed_blocks=blocks)
        _per_block_and_rest(config_jsons(config, "gpu")[1], plan)
    return time.perf_counter() - start


def main() -> None:
    from lowmem_aitextgen import hardware

    print(f"CPU: {hardware.cpu()}")
    fp32, bf16 = step_seconds(False), step_seconds(True)
    print(f"training step, width 768, 2 blocks, block 128: fp32 {fp32:.2f} s, bf16 autocast {bf16:.2f} s "
          f"({bf16 / fp32:.1f}x)")
    for precision in ("32-true", "bf16-mixed", "16-mixed", "bf16-true"):
        print(f"estimator probes, 355M, {precision}: {probe_seconds('355M', precision):.2f} s")


if __name__ == "__main__":
    main()
