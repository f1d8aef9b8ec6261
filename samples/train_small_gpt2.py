"""Train a small GPT-2 from scratch on CPU, save it, reload it and generate — offline.

The text is Python's own documentation (the standard library's pydoc_data),
so nothing is downloaded.  5% of it is held out as a validation set: the
progress bar shows its loss, and the model kept is the one with the lowest.
Set LOWMEM_AITEXTGEN_TINY=1 for a seconds-long run.

    python samples/train_small_gpt2.py [output_dir]
"""

import json
import os
import pydoc_data.topics
import sys
import time

from lowmem_aitextgen import aitextgen
from lowmem_aitextgen.TokenDataset import TokenDataset
from lowmem_aitextgen.tokenizers import train_tokenizer
from lowmem_aitextgen.utils import GPT2ConfigCPU

TINY = os.environ.get("LOWMEM_AITEXTGEN_TINY") == "1"


def main(output_dir: str = "trained_model") -> None:
    started = time.time()
    text = "\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    with open("input.txt", "w", encoding="utf-8") as f:
        f.write(text[:50_000] if TINY else text)

    train_tokenizer("input.txt", vocab_size=5000)
    config = GPT2ConfigCPU(vocab_size=5000)
    ai = aitextgen(tokenizer_file="aitextgen.tokenizer.json", config=config)
    data = TokenDataset("input.txt", tokenizer_file="aitextgen.tokenizer.json", block_size=64)
    ai.train(data, output_dir=output_dir, batch_size=16, num_steps=20 if TINY else 1500,
             learning_rate=1e-3, save_every=500, generate_every=500, seed=42,
             val_data=0.05, eval_every=10 if TINY else 100)
    with open(os.path.join(output_dir, "training_summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    losses = ", ".join(f"{evaluation['loss']:.3f}" for evaluation in summary["validation"])
    print(f"\nValidation loss: {losses}; the best, {summary['best_val_loss']:.3f} at step "
          f"{summary['best_step']}, is the model kept.")

    reloaded = aitextgen(model_folder=output_dir)
    print("\nSamples from the reloaded model:")
    reloaded.generate(n=3, prompt="The ", max_length=64, seed=42)
    print(f"\nDone in {time.time() - started:.0f} s; the model is in {output_dir}/.")


if __name__ == "__main__":
    main(*sys.argv[1:])
