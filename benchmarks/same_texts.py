"""The texts a fixed set of generate() calls gives in two checkouts, compared: a change that should not change
behaviour (a restructure) shows the same texts, seeded and greedy, in every form this CPU runs.

    git worktree add /tmp/before <commit>
    python benchmarks/same_texts.py /tmp/before .

Each checkout runs in a process of its own (its package first on sys.path) over the same model, made once here:
a 2-layer GPT-2 of GPT-2's vocabulary, random weights spread as a trained model's logits are (seeded), saved to a
temporary folder.  Prints a JSON line a call, then the count of calls whose texts differ.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

# each call: generate()'s keywords (the prompt, the seed and max_length fixed below unless given)
CALLS: list[dict] = [
    {"n": 3},  # the default: int8, top_k 50, temperature 0.7
    {"n": 2, "do_sample": False},
    {"n": 2, "do_sample": False, "decoding": "exact"},
    {"n": 2, "top_k": 0, "top_p": 0.9},
    {"n": 2, "top_k": 0, "temperature": 1.0},
    {"n": 2, "top_k": 5000, "temperature": 1.0},
    {"n": 2, "repetition_penalty": 1.3},
    {"n": 2, "typical_p": 0.9, "top_k": 0},
    {"prompt": ["The first", "A second prompt, longer than the first"], "n": 2},
    {"n": 2, "num_beams": 3, "do_sample": False},
    {"n": 1, "decoding": "exact", "top_k": 0},
]
RUNNER = """
import json, sys
sys.path.insert(0, sys.argv[1])
from lowmem_aitextgen import aitextgen, hardware
ai = aitextgen(model_folder=sys.argv[2])
calls = json.loads(sys.argv[3])
if hardware.cpu().bf16_native:
    calls.append({"n": 2, "do_sample": False, "decoding": "bf16"})
for call in calls:
    kwargs = {"prompt": "The meaning of a word", "max_length": 40, "seed": 7, **call}
    texts = ai.generate(return_as_list=True, nonempty_output=False, **kwargs)
    print(json.dumps({"call": call, "texts": texts}), flush=True)
"""


def saved_model(folder: str) -> None:
    """The model both checkouts decode, saved once (whose logits spread as a trained model's do)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=128))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0, 0.1)
        model.transformer.ln_f.weight.mul_(25)
    model.save_pretrained(folder)


def texts(checkout: str, folder: str) -> list[dict]:
    result = subprocess.run([sys.executable, "-c", RUNNER, os.path.abspath(checkout), folder, json.dumps(CALLS)],
                            capture_output=True, text=True, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", help="a checkout's folder (the commit before the change)")
    parser.add_argument("after", help="a checkout's folder (the change)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        saved_model(folder)
        before, after = texts(args.before, folder), texts(args.after, folder)
    differ = 0
    for old, new in zip(before, after):
        same = old == new
        differ += not same
        print(json.dumps({"call": new["call"], "the same texts": same, **({} if same else {"before": old["texts"],
                                                                                            "after": new["texts"]})}))
    print(json.dumps({"calls": len(after), "differ": differ}))


if __name__ == "__main__":
    main()
