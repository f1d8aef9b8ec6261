"""The aitextgen subclass: aitextgen 0.6.0's methods, each checking its arguments before any work.

train() is: arguments checked (arguments.py) -> data (data.py) -> plan (plan.py, budget.py) ->
one training run (run.py) -> its outcome.  Loading is loading.py's, generation generation.py's,
writing files saving.py's.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import pytorch_lightning as pl
import torch
from aitextgen.aitextgen import aitextgen as _aitextgen
from pytorch_lightning.loggers import Logger
from pytorch_lightning.strategies import Strategy
from torch.utils.data import Dataset

from . import arguments, loading, saving
from .generation import generate_options, generation
from .generation.decoding import DecodePlan, DecodingView
from .generation.decoding import plan_decoding as decoding_plan
from .generation.engine import Decoder
from .TokenDataset import TokenDataset
from .training import evaluation, four_bit, outputs
from .training.adapters import base_matches, check_adapter_fits, is_adapter_model
from .training.budget import CallPlan
from .training.callbacks import TrainingDiverged
from .training.data import check_train_data, training_dataset
from .training.four_bit import QuantizedBase
from .training.optimizers import check_optimizer
from .training.plan import RunSettings, TrainPlan, run_settings
from .training.report import make_loggers, say_what_is_not_drawn
from .training.resume import check_resumable, check_resumed_base, checkpoint_to_resume, read_run_description
from .training.run import SIGTERM_EXIT_STATUS, Outcome, TrainingRun, adapter_base_record

logger = logging.getLogger("lowmem_aitextgen")


def _decoding_of(kwargs: Mapping[str, Any], decoding: str) -> str:
    """The decoding form a call asking `kwargs` takes: "exact" where transformers' generate() decodes it (beam search
    and the rest of generate_options.BY_TRANSFORMERS: over the model as held, as in aitextgen), else `decoding`."""
    taken = generate_options.by_transformers(kwargs)
    if taken and decoding != "exact":
        logger.info(f"{taken[0]}={kwargs[taken[0]]!r}: decoded by transformers' generate() over the model as held "
                    f"(decoding='exact'), not in decoding={decoding!r}'s form.")
    return "exact" if taken else decoding


def _configure_logging(verbose: bool) -> None:
    """As aitextgen did: our log lines at INFO, transformers' and Lightning's quiet unless verbose=True."""
    logger.setLevel(logging.INFO)
    if verbose:
        return
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    for name in ("filelock", "pytorch_lightning", "lightning_fabric", "peft"):
        logging.getLogger(name).setLevel(logging.WARNING)


class aitextgen(_aitextgen):
    """aitextgen's main object, fine-tuning in little memory on today's stack.

    Constructor arguments are aitextgen 0.6.0's (MIGRATING.md says what changed), plus gradient_checkpointing.

    Args:
        model: a hub id ("gpt2", "gpt2-medium", ...); left out with no other source: the 124M GPT-2.
        model_folder: a folder a train() or save() wrote (or any transformers model folder); an adapter saved
            beside its base is loaded with it, refused if the base weights are not the ones it was trained on.
        config: a transformers config (or its config.json path): a new, randomly initialised model of it.
        vocab_file, merges_file: a GPT-2 BPE tokenizer's files (vocab.json, merges.txt).
        tokenizer_file: train_tokenizer()'s aitextgen.tokenizer.json.
        schema_tokens, schema_return: aitextgen's schema generation (kept on the model's config).
        cache_dir: where hub downloads are kept (default "aitextgen").
        tf_gpt2: "124M", "355M", "774M" or "1558M": OpenAI's GPT-2 of that size, from the hub.
        to_gpu: move the model to a GPU (said once, and kept on the CPU, where there is none).
        to_fp16: hold the model in fp16 (for generation; train() plans its own precision).
        verbose: transformers' and Lightning's own log lines too.
        gradient_checkpointing: True or False forces it for every train() of this object; None (default): the
            planner checkpoints the blocks memory needs.
        bos_token, eos_token, unk_token: the tokenizer's special tokens (default "<|endoftext|>").
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
        args = arguments.from_call(self.__init__, locals())
        arguments.check_constructor(self.__init__, args)
        model, model_folder, config, vocab_file, merges_file, tokenizer_file, cache_dir = (  # paths as str
            args[name] for name in ("model", "model_folder", "config", "vocab_file", "merges_file", "tokenizer_file",
                                    "cache_dir"))
        _configure_logging(verbose)
        self.openai_tf_gpt2 = tf_gpt2
        for name, value in (("bos_token", bos_token), ("eos_token", eos_token), ("unk_token", unk_token),
                            ("vocab_file", vocab_file), ("merges_file", merges_file)):
            if value is not None:
                setattr(self, name, value)
        loaded, self.model_source = loading.load_model(model, model_folder, config, tf_gpt2, cache_dir)
        run = outputs.run_of(model_folder) if model_folder is not None else None
        self._origin = (os.path.abspath(model_folder), run) if run else None  # the run whose model this is
        self._folder = os.path.abspath(model_folder) if model_folder is not None else None
        if isinstance(loaded, loading.DeferredModel):
            self._deferred = loaded
        else:
            self.model = loaded
        self.tokenizer = loading.load_tokenizer(
            source=self.model_source, tokenizer_file=tokenizer_file, vocab_file=vocab_file,
            merges_file=merges_file, model_folder=model_folder, cache_dir=cache_dir,
            special_tokens=dict(bos_token=self.bos_token, eos_token=self.eos_token,
                                unk_token=self.unk_token, pad_token=self.pad_token))
        self._tokenizer_given = bool(tokenizer_file or vocab_file)
        loading.check_tokenizer_fits(self.tokenizer, self.model_shape, self.model_source, self._tokenizer_given)
        self.tokenizer.padding_side = "left"
        # given: True/False forces every block or none; None: the plan checkpoints what memory needs (aitextgen
        # forced it on for tf_gpt2 355M and up, for the memory of 2020's GPUs)
        self.gradient_checkpointing = gradient_checkpointing
        if schema_tokens:
            self.model_shape.config.schema_tokens = schema_tokens
        if schema_return:
            self.model_shape.config.schema_return = schema_return
        logger.info(self)
        if to_gpu:
            if to_fp16:
                self.to_fp16()
            self.to_gpu()

    _model: torch.nn.Module | None = None
    _fp16_on_gpu = False  # to_fp16() asked before to_gpu()
    _origin: tuple[str, str] | None = None
    _folder: str | None = None  # a folder holding exactly the object's model (model_folder=, or train()'s output_dir)
    _run_base: str | None = None  # the folder holding the model the last train() started from
    _read_back_run: str | None = None  # the run whose output_dir the object reads its model from on first use
    _tokenizer_given = False
    _deferred: loading.DeferredModel | None = None

    @property
    def model(self) -> torch.nn.Module:
        """The model.  A saved one (model_folder=, the hub) is read on first use, as aitextgen read it;
        train() reads it in the dtype its plan holds the weights in (loading.DeferredModel)."""
        if self._deferred is not None:
            self._check_read_back()
            self._model, self._deferred, self._read_back_run = self._deferred.load(), None, None
        return self._model

    @model.setter
    def model(self, model: torch.nn.Module) -> None:
        self._model, self._deferred, self._read_back_run = model, None, None
        self._decoding.forget()

    @property
    def _decoding(self) -> DecodingView:
        """The form generate() decodes the model in (decoding.py), made on first use."""
        if "_view" not in self.__dict__:
            self._view = DecodingView()
        return self._view

    def _plan_decoding(self, decoding: str, length: int | None, tokenwise: bool = False) -> DecodePlan:
        return decoding_plan(self.model_shape, decoding, length=length, read=self._deferred is None,
                             tokenwise=tokenwise)

    def serving_model(self) -> tuple[Decoder | torch.nn.Module, DecodePlan]:
        """The model the server decodes with and its plan (serving.py): the default form, made at once, whole
        contexts, each text the same in any batch (int8_kernels.TokenwiseInt8Linear)."""
        plan = self._plan_decoding("auto", None, tokenwise=True)
        return self._decoding_model(plan, 0, repeatable=True), plan

    def _decoding_model(self, plan: DecodePlan, asked: int, repeatable: bool) -> Decoder | torch.nn.Module:
        """The model generate() runs in `plan` (decoding.py) for a call asking `asked` tokens: the model as held
        while the plan's view does not pay yet for a call that cannot be repeated; an int8 one read straight
        from the folder where the object's model is not read yet (it stays unread: 1558M decodes in 3 GB)."""
        if not repeatable and self._decoding.waits(plan, asked):
            return self.model
        if self._deferred is not None and plan.from_folder:
            self._check_read_back()
            view = self._decoding.model_from_folder(self._deferred, plan)
            if view is not None:
                return view
        return self._decoding.model_for(self.model, plan)

    def _check_read_back(self) -> None:
        """The model a run left in its output_dir for this object (a 4-bit base's, read back on first use) is
        still there: refused, naming the folder and what changed, where another run has written there since or
        the folder is gone, rather than reading another run's model or calling a good one damaged."""
        if self._read_back_run is None:
            return
        folder = self._deferred.folder
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"This object's model is the one train() saved into {folder}, read on first "
                                    "use, and that folder is gone (moved or deleted). Load the model from where "
                                    "it is now: aitextgen(model_folder=<its folder>).")
        now = outputs.run_of(folder)
        if now != self._read_back_run:
            raise ValueError(f"This object's model is the one run {self._read_back_run} saved into {folder}, read "
                             f"on first use, but {'run ' + now if now else 'something else'} has written there "
                             "since, so it is no longer this object's model. Load the model you want with "
                             "aitextgen(model_folder=...), or train again.")

    @property
    def model_shape(self) -> torch.nn.Module:
        """The model, or while its weights are not read yet a weightless copy (config, parameter shapes)."""
        return self._deferred.skeleton if self._deferred is not None else self._model

    def __repr__(self) -> str:
        parameters = sum(p.numel() for p in self.model_shape.parameters())
        return f"{type(self.model_shape.config).__name__.replace('Config', '')} loaded with {parameters // 10**6}M parameters."

    def _check_tokenizer(self, where: str) -> None:
        """Refuse a use that would encode text past the model's embeddings (a model built from config=
        constructs with the default tokenizer; loading.check_tokenizer_fits)."""
        problem = loading.tokenizer_mismatch(self.tokenizer, self.model_shape, self.model_source,
                                             self._tokenizer_given)
        if problem is not None:
            raise ValueError(f"{where}: {problem}")

    def to_fp16(self) -> None:
        """aitextgen's: the model in fp16, for generating on a GPU.  A CPU computes fp16 by emulation, many times
        slower than fp32, and generate() already decodes in the fastest form the CPU has (decoding.py): there the
        model stays as it is, said once; where a GPU is there, it is halved when to_gpu() moves it (aitextgen's
        own order, to_fp16() then to_gpu(), left fp32 on the card)."""
        if next(self.model.parameters()).device.type != "cuda":
            if torch.cuda.is_available():
                self._fp16_on_gpu = True
                logger.info("to_fp16: the model is on the CPU; to_gpu() moves it to the GPU in fp16.")
                return
            logger.warning("to_fp16: the model is on the CPU, which has no fp16 arithmetic; it stays as it is, and "
                           "generate() decodes in the fastest form this CPU computes (int8 or bf16).")
            return
        super().to_fp16()

    def to_gpu(self, index: int = 0) -> None:
        """Moves the model to a GPU; without one it stays on the CPU, said once (aitextgen failed)."""
        if not torch.cuda.is_available():
            logger.warning("to_gpu: no CUDA GPU is available, so the model stays on the CPU.")
            return
        super().to_gpu(index)
        if self._fp16_on_gpu:
            super().to_fp16()

    # --- generation ---------------------------------------------------------

    def generate(self, n: int = 1, prompt: str = "", prepend_bos: bool | None = None, min_length: int | None = None,
                 max_length: int | None = None, temperature: float = 0.7, do_sample: bool = True,
                 return_as_list: bool = False, seed: int | None = None, pad_token_id: int | None = None,
                 schema: bool = False, normalize_key: bool = True, use_cache: bool = True, lstrip: bool = True,
                 nonempty_output: bool = True, skip_special_tokens: bool = True, batch_size: int | None = None,
                 decoding: str = "auto", stream: bool = False, **kwargs: Any) -> Any:
        """aitextgen's generate(): texts from the model, printed (or returned), every argument checked before it
        starts; decoded in the fastest form the device has within the quality bound (int8 or bf16 on a CPU,
        16 bits on a GPU: decoding.py), from a copy made for generation only: the weights train() and save()
        use are never changed by it.

        Args:
            n: how many texts for each prompt (default 1).
            prompt: the text each one starts with, or a list of them (n texts for each, in the prompts' order,
                decoded together: each decodes as it would alone).
            prepend_bos: start from the beginning-of-text token (default: where the model was trained line by line).
            min_length, max_length: tokens to generate, at least and at most (default max: 256, within the context).
            temperature: sampling temperature (default 0.7).
            do_sample: sample (default True), or decode greedily.
            return_as_list: return the texts instead of printing them.
            seed: makes the texts repeat exactly.
            pad_token_id: the padding token (default: the end-of-text token).
            schema, normalize_key: aitextgen's schema generation.
            use_cache: the KV cache (default True).
            lstrip: strip leading whitespace of each text.
            nonempty_output: generate again where a text came out empty (default True).
            skip_special_tokens: leave special tokens out of the texts (default True).
            batch_size: texts made at a time (transformers 5 no longer accepts it as a generation argument).
            decoding: "auto" (default): the plan's form; "exact": the model as held (fp32 on a CPU), token for
                token what transformers' generate() gives; or a form ("int8", "bf16", "fp16") this device runs.
                Per call, not per object: the weights are the same either way (a server may offer both).
            stream: return an iterator of the text's pieces as they are made (one prompt, n=1; the text is shown
                as it comes, so an empty one is not made again).  Leaving it early stops the decoding.
            max_length above the model's context generates past it (engine.window_kept says how).
            **kwargs: transformers' generate() arguments (top_k, top_p, repetition_penalty, max_new_tokens, ...):
                honoured as transformers does, or refused by name (generate_options.py, docs/arguments.md)."""
        args = arguments.from_call(self.generate, locals())
        self._check_tokenizer("generate()")
        generation.check_generate(self.model_shape, self.tokenizer, "generate()", args)
        length = generation.row_length(self.model_shape, args.max_length)
        repeatable = generation.repeatable(args)
        plan = self._plan_decoding(_decoding_of(args, args.decoding), length, tokenwise=repeatable)
        rows = args.n * len(generation.as_prompts(args.prompt))
        call = {k: v for k, v in args.items() if k != "decoding"}
        if args.batch_size is None and plan.max_rows is not None and not args.stream:
            call["batch_size"] = plan.max_rows  # what fits the memory at once (decoding.DecodingMemory)
        model = self._decoding_model(plan, 0 if args.stream else rows * length, repeatable)
        self._decoding.count(rows * length)
        return generation.generate(model, self.tokenizer, **call)

    def generate_one(self, **kwargs: Any) -> str:
        """One text, returned as a string."""
        return self.generate(n=1, return_as_list=True, **kwargs)[0]

    def generate_samples(self, n: int = 3, temperatures: list[float] = [0.7, 1.0, 1.2], **kwargs: Any) -> None:
        """Prints n samples at each temperature; every temperature is checked first."""
        self._check_tokenizer("generate_samples()")
        for temperature in temperatures:
            generation.check_generate(self.model, self.tokenizer, "generate_samples()", arguments.Arguments(
                {"n": n, "temperature": temperature, **kwargs}, {}))
        super().generate_samples(n, temperatures, **kwargs)

    def generate_to_file(self, n: int = 20, batch_size: int | None = None, destination_path: str | None = None,
                         sample_delim: str = "=" * 20 + "\n", seed: int | None = None, decoding: str = "auto",
                         **kwargs: Any) -> str:
        """aitextgen's generate_to_file(): n texts for each prompt (prompt= a text or a list), every argument
        checked before the file is touched, which is replaced only once all are made; returns its path.
        batch_size: texts made at a time (default: the decoding plan's, 8 on a CPU, which makes 4-5x the texts
        a second that one at a time does; aitextgen's default was 1)."""
        self._check_tokenizer("generate_to_file()")
        given = arguments.Arguments({"n": n, "batch_size": batch_size, "seed": seed, "decoding": decoding, **kwargs},
                                    {})
        generation.check_generate(self.model_shape, self.tokenizer, "generate_to_file()", given)
        generation.check_values({**given, "sample_delim": sample_delim}, to_file=True)
        length = generation.row_length(self.model_shape, kwargs.get("max_length"))
        repeatable = generation.repeatable({**kwargs, "seed": seed})
        decoding = _decoding_of(kwargs, decoding)
        plan = self._plan_decoding(decoding, length, tokenwise=repeatable)
        path, seed = generation.destination(destination_path, seed)
        texts = n * len(generation.as_prompts(kwargs.get("prompt", "")))
        at_once = batch_size or min(n, plan.file_batch)
        model = self._decoding_model(plan, texts * length, repeatable)
        generation.generate_to_file(model, self.tokenizer, n, at_once, path, sample_delim, seed, **kwargs)
        return path

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
        lora_alpha: float = 16,
        lora_dropout: float = 0.05,
        lora_target_modules: Sequence[str] | None = None,
        peft_config: Any = None,
        adapter: str | None = None,
        base_bits: int | None = None,
        chunked_loss: bool = True,
        torch_compile: bool | str = False,
        optimizer: str | None = None,
        strategy: str | Strategy = "auto",
        num_nodes: int = 1,
        devices: int | str | list[int] | None = None,
        resume: bool | str = False,
        max_memory: int | str | None = None,
        pin_micro_batch: bool = False,
        callbacks: list[pl.Callback] | None = None,
        val_data: str | TokenDataset | float | None = None,
        eval_every: int | None = None,
        early_stopping_patience: int | None = None,
        **kwargs: Any,
    ) -> None:
        """Fine-tune on a text file or TokenDataset, in the fastest plan that fits the memory, and save the result
        into output_dir (atomically; with val_data, the model with the lowest validation loss).  Every argument
        is checked before any work.  aitextgen 0.6.0's arguments mean what they meant (MIGRATING.md); the
        others are new.  After train() returns, the object holds the model output_dir holds (an adapter that
        merges, merged; after a 4-bit base, read from output_dir on first use), in the dtype it is saved in,
        which is the dtype the object held before train(): ai.generate() and
        aitextgen(model_folder=output_dir).generate() write the same text for a seed.  A base that training
        held in 16 bits is upcast exactly where it was loaded in fp32; one read straight into 16 bits (a
        model_folder, read on first use) stays in 16 bits and is saved so, so a model that fits a card in bf16
        still fits after train().  After a run on a 4-bit base the object reads output_dir on first use, and
        refuses (naming the folder) if another run has saved there since or the folder is gone.  The object
        keeps no unmerged copy of an adapter's base (it would double the memory the plan fitted): a resume=True
        on this object reads the base back from the folder the interrupted run started from, and every resume
        checks that the base's fingerprint is the one the checkpoint's adapter was trained on.

        Args:
            train_data: a text file (or .csv, .gz) or a TokenDataset.
            output_dir: where the model, its tokenizer, the summary and the checkpoint go (default "trained_model").
            fp16: True: mixed precision (bf16 where native, fp16 with loss scaling on GPUs from capability 5.3,
                fp32 with a warning where neither is native); False: fp32; None (default): bf16 where the device
                computes it natively, else fp32.
            fp16_opt_level, tpu_cores, use_deepspeed, save_gdrive, benchmark, run_id: obsolete; accepted, with one
                line each saying what happens instead.
            n_gpu: -1 (default) every GPU, 0 the CPU, or a number of GPUs.
            max_grad_norm: gradient clipping (default 0.5; 0 turns it off).
            gradient_accumulation_steps: micro-batches per optimizer step (default 1).
            seed: makes a run repeat exactly (data order, LoRA's initialisation, dropout).
            learning_rate, weight_decay, adam_epsilon, warmup_steps: AdamW's and its linear schedule's (defaults
                1e-3, 0.05, 1e-8, 0).
            num_steps: optimizer steps (default 5000).
            save_every: steps between saves of the model and the checkpoint (default 1000; 0: only at the end).
            generate_every, n_generate: steps between samples printed while training, and texts per sample.
            loggers: Lightning loggers, "csv" or "tensorboard" (in output_dir/logs), or a list of them.
            batch_size: sequences per optimizer step and micro-batch, before the planner splits it (default 1).
            num_workers: DataLoader workers (default 0: the data is an in-memory array).
            avg_loss_smoothing: the weight of each step's loss in the progress bar's average (default 0.01).
            progress_bar_refresh_rate: steps between progress bar updates (default 20).
            freeze_layers, num_layers_freeze: freeze the first blocks (aitextgen's; 1558M freezes by default).
            precision: a Lightning precision string ("32-true", "bf16-mixed", "16-mixed", ...); wins over fp16.
            gradient_checkpointing: True or False forces it for every block; None (default): the blocks the
                memory budget needs (the planner decides).
            lora: True trains LoRA adapters (merged into the saved model; the adapter in lora_adapter/); "auto":
                only where the memory budget needs it; False (default): every weight.
            lora_r, lora_alpha, lora_dropout, lora_target_modules: LoRA's settings (defaults 8, 16, 0.05, every
                projection of the block).
            peft_config: any peft config for causal LMs (peft.PrefixTuningConfig(...), IA3Config, LoraConfig, ...).
            adapter: "prefix": prefix tuning with 20 virtual tokens.
            base_bits: 4 holds the frozen base the adapter trains on in 4 bits (QLoRA's NF4; torchao); None
                (default): in 16 bits, or in 4 where the memory budget needs it.  A number of bits, not a value
                of lora=, because it holds the base of every adapter alike (peft_config=, adapter=).
            chunked_loss: the loss a chunk of tokens at a time (default True; 256 tokens on a GPU, 128 on CPU).
            torch_compile: True or "blocks" compiles each transformer block while training, "model" the body;
                off by default (for GPUs).
            optimizer: "adamw" (default), "adamw8bit" (torchao) or "adafactor"; the planner may choose 8-bit AdamW
                where the budget needs it, unless given.
            strategy, num_nodes, devices: Lightning's; strategy="fsdp" shards the model (FSDP2, GPUs and CPU).
            resume: True continues from output_dir's checkpoint; or a checkpoint's path.
            max_memory: fit the plan to this budget ("6GiB", "7.5GB" or bytes) instead of the device's memory.
            pin_micro_batch: keep batch_size x gradient_accumulation_steps as given (default: the planner may
                split the same effective batch otherwise).
            callbacks: extra Lightning callbacks.
            val_data: a text file, a TokenDataset, or a fraction of train_data to hold out (e.g. 0.1).
            eval_every: optimizer steps between evaluations (default save_every, or num_steps // 10).
            early_stopping_patience: evaluations without improvement before stopping.
            **kwargs: TokenDataset's arguments (line_by_line=True, block_size=256, ...).

        docs/arguments.md and docs/memory.md say more; docs/runs.md what output_dir holds."""
        args = self._checked_train_arguments(arguments.from_call(self.train, locals()))
        loggers = make_loggers(args.loggers, args.output_dir)
        say_what_is_not_drawn()
        self._decoding.forget()  # generate()'s copies: their memory back to the plan before it is made
        plan, settings, dataset, val_dataset, resumed = self._training_plan(args)
        deferred = self._deferred
        model, quantized, base_record = self._base_to_train(plan, resumed)
        model.config.line_by_line = getattr(dataset, "line_by_line", False)
        run = TrainingRun(model, self.tokenizer, self.model_source.name, plan, settings, dataset, loggers,
                          list(args.callbacks or []), val_dataset, quantized, base_record)
        try:
            outcome = run.run()
        finally:  # however it ended, the object holds the trained model (LoRA merged), ready to generate
            self._hold_after(run, model, deferred if quantized is not None else None)
        _raise_for(outcome)

    def _hold_after(self, run: TrainingRun, model: torch.nn.Module, unread: loading.DeferredModel | None) -> None:
        """After a run however it ended, the model a new object would load from the folder holding it: the run's
        save read back where the run leaves no model in memory (a 4-bit base's, weights that went bad after a
        save), the model the run started from where nothing good was saved, else the trained model (an adapter
        that merges, merged).  `unread`: the base as it was before a 4-bit run read it."""
        plan, self._folder = run.plan, None  # until known: the folder holding exactly the object's model
        if run.read_back_from is not None:
            self._read_from(run.read_back_from, plan.run_id)
        elif run.trained_model is None and unread is not None:  # stopped before training: the base as read
            self._model, self._deferred, self._folder = None, unread, unread.folder
        elif run.weights_went_bad and self._run_base is not None:  # nothing good saved: where the run started
            self._read_from(self._run_base, None)
        else:
            self.model = run.trained_model or model
        if run.files.saved_at is not None:
            self._folder = os.path.abspath(plan.output_dir)
            self._origin = (self._folder, plan.run_id)

    def _read_from(self, folder: str, run_id: str | None) -> None:
        """The object's model: what aitextgen(model_folder=folder) loads (a plain model read on first use,
        checked then to be still run `run_id`'s; a base with its prompt-learning adapter at once)."""
        loaded, _ = loading.load_model(None, os.path.abspath(folder), None, None, None)
        if isinstance(loaded, loading.DeferredModel):
            self._model, self._deferred, self._read_back_run = None, loaded, run_id
        else:
            self.model = loaded
        self._folder = os.path.abspath(folder)

    def _base_to_train(self, plan: TrainPlan, resumed: dict[str, Any] | None
                       ) -> tuple[torch.nn.Module, QuantizedBase | None, dict[str, str] | None]:
        """The model train() trains (_model_for), its adapter base's record (run.adapter_base_record), and the
        base a resumed adapter run's checkpoint names checked against it.

        The object keeps no second copy of the base beside the merged model it holds after an adapter run: on
        train(resume=True) after that run was interrupted, the base is read back from the folder the run
        started from (its model_folder, or the output_dir of the run before), and its fingerprint checked like
        a new object's.  Where that is not possible, or the folder changed, the resume is refused and the
        object keeps the model it had."""
        held = (self._model, self._deferred, self._run_base, self._read_back_run)
        record, folder = (resumed or {}).get("base_fingerprint"), self._run_base
        if record is not None and folder is not None and loading.DeferredModel.possible(folder) \
                and not self._holds_base(record, folder):  # the start folder is no run's output read back
            self._model, self._read_back_run = None, None
            self._deferred = loading.DeferredModel(folder, f"train(resume={plan.resume_from!r})")
        else:
            self._run_base = self._folder
        try:
            model, quantized = self._model_for(plan)
            base_record = adapter_base_record(model, plan, quantized)
            check_resumed_base(plan.resume_from, resumed, base_record, model)
        except BaseException:
            self._model, self._deferred, self._run_base, self._read_back_run = held
            raise
        return model, quantized, base_record

    def _holds_base(self, record: dict[str, str], folder: str) -> bool:
        """Whether the object's model is the base a checkpoint's adapter trained on: a model not read yet is
        where it is read from (the run's start folder, or another: a run's output_dir read back)."""
        if self._deferred is not None:
            return os.path.abspath(self._deferred.folder) == os.path.abspath(folder)
        return base_matches(record, self.model)

    def _model_for(self, plan: TrainPlan) -> tuple[torch.nn.Module, QuantizedBase | None]:
        """The model to train: weights not read yet are read straight into the 16 bits the plan holds them
        in (LoRA's frozen base, bf16-true), never as fp32 first, and a 4-bit base's matrices straight into
        4 bits (then also what was read: four_bit.QuantizedBase)."""
        quantized = None
        if self._deferred is not None and plan.four_bit_base:
            self.model, quantized = self._deferred.load_in_four_bits(plan.weights_dtype)
        elif self._deferred is not None and plan.weights_dtype is not None:
            self.model = self._deferred.load(plan.weights_dtype)
        return self.model, quantized

    def _checked_train_arguments(self, args: arguments.Arguments) -> arguments.Arguments:
        """Every train() argument checked, before any work or any file is written."""
        arguments.check_train(self.train, args)
        arguments.check_model_fits(args, self.model_shape.config)
        arguments.log_obsolete(args, logger)
        args = args.replace(output_dir=saving.check_folder_name("output_dir", args.output_dir))
        saving.check_output_dir(args.output_dir)
        check_train_data(args.train_data, args)
        evaluation.check_arguments(args)
        if any(isinstance(args.get(name), (str, os.PathLike)) for name in ("train_data", "val_data")):
            self._check_tokenizer("train()")  # the text would be encoded past the model's embeddings
        check_optimizer(args.optimizer or "adamw")
        if args.get("base_bits") == 4:
            four_bit.check_available()
        return args

    def _training_plan(self, args: arguments.Arguments
                       ) -> tuple[TrainPlan, RunSettings, Dataset, Dataset | None, dict[str, Any] | None]:
        """The plan (fitted to the memory budget), the run's settings, the training data, the validation
        data (None without val_data) and the description of the checkpoint to resume (checked), or None."""
        resume_from = checkpoint_to_resume(args.resume, args.output_dir)
        resumed = read_run_description(resume_from)
        model = self.model_shape
        call = CallPlan.of(model, args, constructor_checkpointing=self.gradient_checkpointing,
                           freeze_by_default=self.openai_tf_gpt2 == "1558M",  # as aitextgen, to fit 1.5B
                           resume_from=resume_from, resumed=resumed)
        plan, asked = call.built, call.asked
        adapter = plan.adapter or asked.lora_if_needed  # what trains, or what lora="auto" may train
        if adapter is not None and not is_adapter_model(model):
            chosen_by = next((name for name in ("peft_config", "adapter", "lora_target_modules") if args.get(name)),
                             "lora")
            check_adapter_fits(model.config, adapter, chosen_by)
        encode = functools.partial(training_dataset, args=args, tokenizer=self.tokenizer, config=model.config,
                                   special_tokens=dict(bos_token=self.bos_token, eos_token=self.eos_token,
                                                       unk_token=self.unk_token),
                                   reserved=plan.adapter.positions_taken if plan.adapter is not None else 0)
        dataset, val_dataset = evaluation.validation_datasets(encode(args.train_data), args, encode)
        settings = run_settings(args)
        if resumed is not None:  # what the checkpoint holds the run to is said before any planner's refusal
            check_resumable(resume_from, resumed, plan, settings, model)
        plan = call.fitted(dataset.block_size)
        if resumed is not None:  # and the plan fitted to the budget is one the checkpoint can continue in
            check_resumable(resume_from, resumed, plan, settings, model)
        return plan, settings, dataset, val_dataset, resumed

    def cross_train(self, inputs: list, learning_rate: float | list[float] = 1e-4,
                    num_steps: int | list[int] = 4000, run_id: str | None = None, **kwargs: Any) -> None:
        """aitextgen's cross_train(): each input in turn, learning rate and steps halving each time;
        file inputs are encoded with this model's tokenizer and context (and the TokenDataset options given)."""
        if not all(isinstance(x, TokenDataset) for x in inputs):
            self._check_tokenizer("cross_train()")
        dataset_kwargs = {k: v for k, v in kwargs.items() if k in arguments.token_dataset_names()}
        dataset_kwargs.setdefault("block_size", arguments.context_length(self.model_shape.config))
        datasets = [x if isinstance(x, TokenDataset) else TokenDataset(file_path=x, tokenizer=self.tokenizer,
                                                                        **dataset_kwargs) for x in inputs]
        train_kwargs = {k: v for k, v in kwargs.items() if k not in dataset_kwargs}
        super().cross_train(datasets, learning_rate=learning_rate, num_steps=num_steps, run_id=run_id, **train_kwargs)

    # --- saving ---------------------------------------------------------------

    def save(self, target_folder: str | None = None) -> None:
        """Saves the model into target_folder (default: the working folder), atomically; weights that
        are not finite are refused."""
        folder = saving.check_folder_name("target_folder", os.getcwd() if target_folder is None else target_folder)
        outputs.save_into(folder, self.model, None, self._origin)

    def save_for_upload(self, target_folder: str = "my-model") -> None:
        """Saves the model and tokenizer, atomically, ready for the hub."""
        folder = saving.check_folder_name("target_folder", target_folder)
        outputs.save_into(folder, self.model, self.tokenizer, self._origin)


def _raise_for(outcome: Outcome) -> None:
    """A run that did not finish as asked: the error that says why and what was kept."""
    plan = outcome.plan
    if outcome.diverged:
        raise TrainingDiverged(outcome.diverged)
    if outcome.out_of_memory is not None:
        raise MemoryError(
            f"Out of memory in step {outcome.out_of_memory_at} with the smallest plan left "
            f"(micro-batch 1, precision={plan.precision}, checkpointing={plan.gradient_checkpointing}, "
            f"chunked loss={bool(plan.loss_chunk_tokens)}). The weights after step {outcome.steps} are "
            f"saved in {plan.output_dir} with a checkpoint (resume=True). Use a smaller block_size, "
            "lora=True, or optimizer='adamw8bit'."
        ) from outcome.out_of_memory
    if outcome.save_error is not None:
        error = outcome.save_error
        where = f"{error.filename}: " if error.filename else ""  # a plain write's (the summary's) path
        raise OSError(error.errno, f"{where}{error.strerror} The trained model is still in this "
                      "aitextgen object: save it with ai.save_for_upload('another/folder'), or free some space and "
                      f"call ai.save_for_upload({plan.output_dir!r}).") from error
    if outcome.terminated:
        logger.warning(f"SIGTERM: training stopped at step {outcome.steps:,} with a checkpoint in {plan.output_dir}; "
                       f"exiting with status {SIGTERM_EXIT_STATUS} (train again with resume=True to continue).")
        raise SystemExit(SIGTERM_EXIT_STATUS)
