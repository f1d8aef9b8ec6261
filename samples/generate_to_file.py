"""Generate texts from a trained model folder into a file.

    python samples/generate_to_file.py model_folder [n] [destination]

LOWMEM_AITEXTGEN_TINY=1 without a model_folder saves a tiny random model first.
"""

import sys

from _sample_data import TINY, base_model

from lowmem_aitextgen import aitextgen


def main(model_folder: str | None = None, n: str = "20", destination: str = "generated.txt") -> None:
    if model_folder is None:
        if not TINY:
            sys.exit(__doc__)
        model_folder = "tiny_model"
        base_model("124M").save_for_upload(model_folder)
    ai = aitextgen(model_folder=model_folder)
    ai.generate_to_file(n=int(n), batch_size=min(int(n), 5), destination_path=destination,
                        max_length=40 if TINY else 200, seed=42)
    print(f"{n} texts written to {destination}")


if __name__ == "__main__":
    main(*sys.argv[1:])
