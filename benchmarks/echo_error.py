"""How far the server's echoed log-probabilities are from the trained model's own (fp32, teacher-forced), over many
prompts and lengths: the serving form's view (int8 on a CPU) scoring prompts as `echo` with `logprobs` does
(engine.Engine's scored prompt), against the model's forward.  The tiny GPT-2 of tests/test_serve_protocol.py
(2 layers, 64 wide, 128 positions, a trained model's biases and norms) on Python's documentation text, and the
same architecture trained a few steps; prompts of 8 to 127 tokens from the text.

    python benchmarks/echo_error.py --prompts 200

Prints, per length bucket, the largest error of a log-probability and of a logit, and the largest over all; the
documented bound is forms.Form.score_error (logits) and twice it (log-probabilities).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "tests"))

from transformers import GPT2LMHeadModel  # noqa: E402

from conftest import corpus_text, realistic, tiny_gpt2_config  # noqa: E402
from lowmem_aitextgen import aitextgen, hardware  # noqa: E402
from lowmem_aitextgen.generation.engine import Engine  # noqa: E402
from lowmem_aitextgen.generation.forms import FORM_RECORDS  # noqa: E402
from lowmem_aitextgen.generation.sampling import Row, RowSettings  # noqa: E402
from lowmem_aitextgen.tokenizers import train_tokenizer  # noqa: E402


def errors(ai: aitextgen, prompts: list[torch.Tensor]) -> list[tuple[int, float, float]]:
    """(length, the largest log-probability error, the largest logit error) of each prompt."""
    view, plan = ai.serving_model()
    model = ai.model.eval()
    found = []
    for ids in prompts:
        row = Row(ids, RowSettings(max_new=0, temperature=0, logprobs=0, score_prompt=True))
        engine = Engine(view, ai.tokenizer, (-1,))
        engine.join([row])
        served = torch.tensor([p for _, p, _ in row.prompt_scored])
        engine.close()
        with torch.no_grad():
            logits = model(ids[None]).logits[0, :-1].float()
            ours = view.model(ids[None]).logits[0, :-1].float() if hasattr(view, "model") else logits
        truth = logits.log_softmax(-1).gather(-1, ids[1:, None])[:, 0]
        found.append((len(ids), float((served - truth).abs().max()), float((ours - logits).abs().max())))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=200)
    args = parser.parse_args()
    folder = tempfile.mkdtemp()
    text = os.path.join(folder, "input.txt")
    with open(text, "w", encoding="utf-8") as f:
        f.write(corpus_text(60_000))
    train_tokenizer(text, vocab_size=1000, prefix=os.path.join(folder, "aitextgen"))
    tokenizer = os.path.join(folder, "aitextgen.tokenizer.json")
    torch.manual_seed(0)
    realistic(GPT2LMHeadModel(tiny_gpt2_config(n_positions=128))).save_pretrained(os.path.join(folder, "model"))
    ai = aitextgen(model_folder=os.path.join(folder, "model"), tokenizer_file=tokenizer)
    trained = aitextgen(model_folder=os.path.join(folder, "model"), tokenizer_file=tokenizer)
    trained.train(text, output_dir=os.path.join(folder, "trained"), num_steps=30, batch_size=4, block_size=64,
                  save_every=0, generate_every=0, seed=1)
    ids = torch.tensor(ai.tokenizer(corpus_text(60_000))["input_ids"])
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(8, 128, (args.prompts,), generator=generator).tolist()
    starts = torch.randint(0, len(ids) - 128, (args.prompts,), generator=generator).tolist()
    prompts = [ids[s:s + n] for s, n in zip(starts, lengths)]
    print(json.dumps({"cpu": str(hardware.cpu()), "form": ai.serving_model()[1].form,
                      "SCORE_ERROR": FORM_RECORDS[ai.serving_model()[1].form].score_error}))
    for name, model in (("realistic random", ai), ("trained 30 steps", trained)):
        found = errors(model, prompts)
        for low in range(0, 128, 32):
            bucket = [f for f in found if low <= f[0] < low + 32]
            if bucket:
                print(json.dumps({"model": name, "lengths": f"{low}-{low + 31}", "prompts": len(bucket),
                                  "logprob error": round(max(f[1] for f in bucket), 4),
                                  "logit error": round(max(f[2] for f in bucket), 4)}))
        print(json.dumps({"model": name, "largest logprob error": round(max(f[1] for f in found), 4),
                          "largest logit error": round(max(f[2] for f in found), 4)}), flush=True)


if __name__ == "__main__":
    main()
