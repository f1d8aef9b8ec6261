"""Held-out loss through the stepping decoder with its key-value cache in fp32 and in 16 bits (issue 54): what holding
the cache in bf16 or fp16 costs in quality, where a forward's held-out loss cannot show it (a forward keeps its keys
and values in its own dtype, never rounded through a cache).

    python benchmarks/kv_quality.py --seeds 3 --steps 300

The model is benchmarks/quality_tiers.py's (4 blocks, 128 wide, bytes of Python's documentation topics, blocks of
64), and the same model carrying the released GPT-2's activation outliers (views.carry_outliers), as
generate_quality.py has them.  Each held-out block is teacher-forced a token at a time through stepping.Step over
the seeded int8 view (each token's activations quantized alone: the form a seeded call and the server decode in),
eight blocks a step, the cache written as the engine writes it; a 16-bit cache as the engine holds an int8
view's (kv_cache.py: the buffers in that dtype, each query cast to it for the attention and its output back).
Rows: each cache's loss over fp32's forward (the quality bound, decoding.QUALITY_BOUND, is 1%) and its worst
place's KL divergence from the forward's next-token distribution; a 16-bit cache's loss over the fp32 cache's, and
the largest difference of a log-probability between them (forms.Form.score_error bounds a form's scores at a first
step).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
from generate_quality import CHANNELS  # noqa: E402
from quality_tiers import corpora, held_out_loss, pretrained  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from lowmem_aitextgen.generation import decoding, stepping, views  # noqa: E402
from lowmem_aitextgen.generation.kv_cache import new_cache  # noqa: E402

ROWS = 8  # held-out blocks a step
SIXTEEN = {"bf16": torch.bfloat16, "fp16": torch.float16}  # the 16-bit caches --kv names


def stepped_scores(view: torch.nn.Module, blocks: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """The log-probabilities (blocks, places - 1, vocabulary) each of `blocks` (the first 64, as held_out_loss's)
    gets for its next tokens, its tokens fed one a step, the cache in `dtype` (None: fp32, the activations')."""
    step, scores = stepping.Step(view), []
    with torch.inference_mode():
        for ids in blocks[:64].split(ROWS):
            rows, length = ids.shape
            cache, logits = new_cache([], dtype), []
            for place in range(length - 1):
                positions = torch.full((rows, 1), place)
                mask = torch.ones(rows, place + 1, dtype=torch.long)
                logits.append(step(ids[:, place:place + 1], positions, mask, cache)[:, 0])
            scores.append(torch.stack(logits, 1).float().log_softmax(-1))
    return torch.cat(scores)


def forward_scores(model: torch.nn.Module, blocks: torch.Tensor) -> torch.Tensor:
    """The log-probabilities the model's own forward gives the same places as stepped_scores."""
    with torch.no_grad():
        return model(input_ids=blocks[:64]).logits[:, :-1].float().log_softmax(-1)


def kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) of each place, from log-probabilities."""
    return (p.exp() * (p - q)).sum(-1)


def loss_of(scores: torch.Tensor, blocks: torch.Tensor) -> float:
    """held_out_loss's mean of each block's loss, from stepped_scores's `scores` of `blocks`."""
    targets = blocks[:len(scores), 1:]
    return float(F.nll_loss(scores.transpose(1, 2), targets, reduction="none").mean(1).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--scale", type=float, default=40.0)
    parser.add_argument("--kv", choices=sorted(SIXTEEN), nargs="+", default=["bf16", "fp16"],
                        help="the 16-bit caches measured beside fp32's")
    args = parser.parse_args()
    first, _, held = corpora()
    rows: dict[str, list[float]] = {}
    for seed in range(args.seeds):
        trained = pretrained(seed, first, args.steps).eval()
        outliers = views.carry_outliers(copy.deepcopy(trained), CHANNELS, args.scale)
        for name, model in (("trained", trained), (f"outliers x{args.scale:g}", outliers)):
            fp32 = held_out_loss(model, held)
            view = decoding.decoding_model(model, "int8", tokenwise=True).model
            losses, scores = {}, {}
            forward = forward_scores(model, held)
            for kv in ("fp32", *args.kv):
                scores[kv] = stepped_scores(view, held, SIXTEEN.get(kv))
                losses[kv] = loss_of(scores[kv], held)
                rows.setdefault(f"{name}, int8 stepped, {kv} cache, over fp32's forward", []).append(
                    losses[kv] / fp32 - 1)
                rows.setdefault(f"{name}, int8 stepped, {kv} cache, worst KL from fp32's forward", []).append(
                    float(kl(forward, scores[kv]).max()))
                if kv != "fp32":
                    rows.setdefault(f"{name}, {kv} cache over fp32 cache", []).append(losses[kv] / losses["fp32"] - 1)
                    rows.setdefault(f"{name}, largest log-probability apart, {kv} against fp32 cache", []).append(
                        float((scores[kv] - scores["fp32"]).abs().max()))
            print(json.dumps({"seed": seed, "model": name, "fp32 forward": round(fp32, 5),
                              **{k: round(v, 5) for k, v in losses.items()}}), flush=True)
    print(json.dumps({row: {"per seed": [round(v, 5) for v in values], "mean": round(statistics.fmean(values), 5),
                            "worst": round(max(values), 5)} for row, values in rows.items()}, indent=1))


if __name__ == "__main__":
    main()
