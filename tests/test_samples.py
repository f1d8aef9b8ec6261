"""Every sample script runs offline on its tiny stand-in (LOWMEM_AITEXTGEN_TINY=1), so none can rot."""

import json
import os
import subprocess
import sys

from lowmem_aitextgen import aitextgen

SAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "samples")


def run_sample(name: str, *args: str) -> str:
    env = dict(os.environ, LOWMEM_AITEXTGEN_TINY="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, os.path.join(SAMPLES, name), *args], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout + proc.stderr


def test_train_small_gpt2_from_scratch():
    output = run_sample("train_small_gpt2.py", "small")
    assert aitextgen(model_folder="small").generate_one(max_length=10, seed=1)
    with open("small/training_summary.json") as f:
        summary = json.load(f)
    assert [e["step"] for e in summary["validation"]] == [10, 20]  # evaluated, and the best model kept
    assert f"the best, {summary['best_val_loss']:.3f} at step {summary['best_step']}, is the model kept" in output


def test_finetune_355m_lora():
    run_sample("finetune_355m_lora.py")
    assert os.path.isfile("trained_lora/lora_adapter/adapter_config.json")
    with open("trained_lora/training_summary.json") as f:
        summary = json.load(f)
    assert summary["steps"] == 6 and summary["plan"]["lora"]["r"] == 8
    assert aitextgen(model_folder="trained_lora").generate_one(max_length=10, seed=1)


def test_finetune_355m_full_prints_the_memory_plan_first():
    output = run_sample("finetune_355m_full.py")
    plan_line = next(line for line in output.splitlines() if line.startswith("Training plan"))
    assert "checkpointing=on" in plan_line and "GiB before activations" in plan_line
    assert output.index("Training plan") < output.index("Training summary")
    with open("trained_full/training_summary.json") as f:
        assert json.load(f)["plan"]["lora"] is None


def test_generate_to_file():
    run_sample("generate_to_file.py")
    with open("generated.txt", encoding="utf-8") as f:
        texts = f.read().split("\n" + "=" * 20 + "\n")  # aitextgen's delimiter after each text
    assert texts[-1] == ""
    # aitextgen drops empty generations (nonempty_output=True), so up to 20 texts, none empty.
    assert 10 <= len(texts[:-1]) <= 20 and all(text.strip() for text in texts[:-1])


def test_the_notebook_runs_end_to_end_on_a_tiny_model(tmp_path, monkeypatch):
    """samples/finetune_notebook.ipynb (install, estimate, fine-tune with LoRA within max_memory and val_data,
    generate, reload), executed cell by cell in a Jupyter kernel with its parameters cell set to a tiny model."""
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    notebook = nbformat.read(os.path.join(SAMPLES, "finetune_notebook.ipynb"), as_version=4)
    parameters = next(cell for cell in notebook.cells if "parameters" in cell.metadata.get("tags", []))
    parameters.source += "\nTINY = True\nNUM_STEPS = 8\nMAX_MEMORY = '4GiB'\n"
    NotebookClient(notebook, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    printed = "".join(output.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                      for output in cell.get("outputs", []))
    assert "same text after reloading: True" in printed and "best validation loss" in printed
    with open(tmp_path / "trained_model" / "training_summary.json", encoding="utf-8") as f:
        summary = json.load(f)
    assert summary["steps"] == 8 and summary["plan"]["lora"]["r"] == 8 and summary["best_step"] is not None
    assert summary["plan"]["budget_bytes"] == 4 * 2**30  # max_memory
