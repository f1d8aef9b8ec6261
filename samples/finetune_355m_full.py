"""Full fine-tune of GPT-2 355M on a text file, on a small GPU, with the memory plan printed first.

    python samples/finetune_355m_full.py [text_file] [output_dir]

train() logs its plan before the first step: precision (bf16 or fp16 mixed),
checkpointed blocks, chunked loss, micro-batch x accumulation, and the
weights + gradients + AdamW memory it holds before any activation.  At the
end it logs a summary and writes training_summary.json, loss.png and
memory.png next to the model.  LOWMEM_AITEXTGEN_TINY=1 runs it offline on a
tiny stand-in.
"""

import logging
import sys

from _sample_data import TINY, base_model, example_text_file

logging.basicConfig(level=logging.INFO, format="%(message)s")


def main(text_file: str | None = None, output_dir: str = "trained_full") -> None:
    text_file = text_file or example_text_file()
    ai = base_model("355M")
    ai.train(text_file, output_dir=output_dir, fp16=True, gradient_checkpointing=True,
             batch_size=1, gradient_accumulation_steps=1 if TINY else 8, learning_rate=1e-4,
             num_steps=4 if TINY else 1000, save_every=2 if TINY else 250, generate_every=0 if TINY else 250)
    ai.generate(n=2, max_length=40 if TINY else 120, seed=42)


if __name__ == "__main__":
    main(*sys.argv[1:])
