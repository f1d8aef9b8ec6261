"""Fine-tune GPT-2 355M with LoRA adapters on a text file, on a small GPU.

    python samples/finetune_355m_lora.py [text_file] [output_dir]

Downloads gpt2-medium the first time; without text_file it trains on Python's
documentation.  output_dir gets the merged model (load it with
aitextgen(model_folder=...)) and the adapter alone in output_dir/lora_adapter.
LOWMEM_AITEXTGEN_TINY=1 runs it offline on a tiny stand-in.
"""

import sys

from _sample_data import TINY, base_model, example_text_file

from lowmem_aitextgen import aitextgen


def main(text_file: str | None = None, output_dir: str = "trained_lora") -> None:
    text_file = text_file or example_text_file()
    ai = base_model("355M")
    ai.train(text_file, output_dir=output_dir, lora=True, lora_r=8, fp16=True, learning_rate=3e-4,
             num_steps=6 if TINY else 2000, save_every=3 if TINY else 500, generate_every=0 if TINY else 500,
             loggers="csv", seed=42)
    tuned = aitextgen(model_folder=output_dir)
    tuned.generate(n=2, max_length=40 if TINY else 120, seed=42)


if __name__ == "__main__":
    main(*sys.argv[1:])
