"""Held-out loss of each decoding form (decoding.py) against fp32, on the quality study's trained model and on
the same model carrying the activation outliers the released GPT-2 has (views.carry_outliers: a few input
channels of every projection that reads a layer norm made `--scale` times larger, the function unchanged).

    python benchmarks/generate_quality.py --seeds 3 --steps 300

The model is benchmarks/quality_tiers.py's (4 blocks, 128 wide, bytes of Python's documentation topics),
teacher-forced over held-out blocks.  int8 is reported with the smoothing decoding.py applies and without it
(per-tensor activation scales, as torch's dynamic quantization alone has them), and in the server's form, each
token's activations quantized alone (int8_kernels.TokenwiseInt8Linear).  The rule: a form more than
decoding.QUALITY_BOUND (1%) above fp32 on either model is not a default.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
from unittest import mock

from quality_tiers import corpora, held_out_loss, pretrained

from lowmem_aitextgen.generation import decoding, views

CHANNELS = [3, 17, 60, 101]  # of 128


def form_losses(model, held, forms) -> dict[str, float]:
    losses = {form: held_out_loss(decoding.decoding_model(model, form), held) for form in forms}
    losses["int8, each token alone"] = held_out_loss(decoding.decoding_model(model, "int8", tokenwise=True), held)
    with mock.patch.object(views, "smooth", lambda norm, linear: (norm, linear)):  # the study's control
        losses["int8 without smoothing"] = held_out_loss(decoding.decoding_model(model, "int8"), held)
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--scale", type=float, default=40.0)
    args = parser.parse_args()
    first, _, held = corpora()
    rows: dict[str, list[float]] = {}
    for seed in range(args.seeds):
        trained = pretrained(seed, first, args.steps).eval()
        fp32 = held_out_loss(trained, held)
        outliers = views.carry_outliers(copy.deepcopy(trained), CHANNELS, args.scale)
        for name, model in (("trained", trained), (f"outliers x{args.scale:g}", outliers)):
            for form, loss in form_losses(model, held, ("fp32", "bf16", "fp16", "int8")).items():
                rows.setdefault(f"{name}, {form}", []).append(loss / fp32 - 1)
    print(json.dumps({row: {"per seed": [round(v, 5) for v in values], "mean": round(statistics.fmean(values), 5),
                            "worst": round(max(values), 5)} for row, values in rows.items()}, indent=1))


if __name__ == "__main__":
    main()
