"""A small fine-tune's speed, the whole train() call and the tokens/s its summary reports: a 2-layer GPT-2 (256
wide) with GPT-2's 50,257-token vocabulary, 30 steps of 4 x 128 tokens on Python's own documentation text.  The
vocabulary's projection (50,257 x 256, forward and backward) is most of a step at this size, so tokens/s here is
far below the README main job's (a 1,000-token vocabulary).  Run it on each CPU kind; held to AVX2 on an AVX-512
machine with:

    LOWMEM_AITEXTGEN_MAX_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 \\
        FBGEMM_ENABLE_INSTRUCTIONS=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 python benchmarks/tiny_fine_tune_speed.py
"""

import json
import os
import pydoc_data.topics
import tempfile
import time

from transformers import GPT2Config

from lowmem_aitextgen import aitextgen, hardware


def main() -> None:
    root = tempfile.mkdtemp()
    text = "\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))[:60_000]
    with open(os.path.join(root, "input.txt"), "w", encoding="utf-8") as f:
        f.write(text)
    ai = aitextgen(config=GPT2Config(n_layer=2, n_embd=256, n_head=4, n_positions=256))
    started = time.monotonic()
    ai.train(os.path.join(root, "input.txt"), output_dir=os.path.join(root, "out"), num_steps=30, batch_size=4,
             block_size=128, save_every=0, generate_every=0, seed=1)
    whole = time.monotonic() - started
    with open(os.path.join(root, "out", "training_summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    print(json.dumps({"cpu": str(hardware.cpu()), "precision": summary["plan"]["precision"],
                      "whole_train_s": round(whole, 1), "steps_s": round(summary["wall_time_s"], 1),
                      "tokens_per_s": round(summary["tokens_per_s"], 1)}))


if __name__ == "__main__":
    main()
