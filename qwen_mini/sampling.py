"""Choosing each next token: the sampling pipeline and its settings.

The pipeline, applied to the logits of each new token in this order:

    repetition penalty -> presence penalty -> (greedy: argmax)
        | temperature -> top_k -> top_p -> min_p -> sample

This is the order `transformers` applies its warpers in (Temperature, TopK, TopP, MinP); the
penalties come first, as its processors (repetition_penalty) and vLLM do, so they also act
under greedy decoding. Every filter follows the
semantics of the `transformers` warper of the same name: filtered tokens get logit -inf, ties at
the top_k boundary are kept, and at least one token always survives.

The settings (`Sampling`) come from the arguments of a generate call, else the checkpoint's
generation_config.json; `check_generation_config` refuses a file whose settings could not be
used, and the loader calls it, so a bad file is refused when the model loads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch

from .validation import is_number, is_whole_number

# --- the filters: each takes logits [..., V] and returns new logits [..., V] -------------------


class NonFiniteLogitsError(RuntimeError):
    """The model produced NaN or infinite logits: no token can be chosen from them."""


def apply_presence_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float):
    """Subtract `penalty` once from every token marked in the boolean mask `seen` [V].

    Once, however often the token occurred: that is what makes it a *presence* penalty (a
    frequency penalty would scale with the count).
    """
    return logits - penalty * seen.to(logits.dtype)


def apply_repetition_penalty(logits: torch.Tensor, in_context: torch.Tensor, penalty: float):
    """transformers' `repetition_penalty`: every token marked in the boolean mask `in_context`
    [V] (the prompt's and the generated tokens) has its logit divided by `penalty` where it is
    positive and multiplied by it where it is negative (Keskar et al., 2019)."""
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(in_context, penalised, logits)


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Divide by the temperature: < 1 sharpens the distribution, > 1 flattens it."""
    return logits / temperature


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits (and any tied with the k-th), set the rest to -inf."""
    k = min(k, logits.shape[-1])
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # [..., 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filter: keep the smallest set of most likely tokens whose mass reaches p.

    A token survives when the tokens strictly more likely than it hold less than p of the mass,
    so the most likely token always survives and the token that crosses p is kept too.
    """
    probs, order = torch.softmax(logits.float(), dim=-1).sort(dim=-1, descending=True)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above each one
    drop_sorted = mass_before >= p
    drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
    return logits.masked_fill(drop, float("-inf"))


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the probability of the best token."""
    probs = torch.softmax(logits.float(), dim=-1)
    threshold = min_p * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


def filter_logits(logits, temperature=1.0, top_k=None, top_p=None, min_p=None):
    """Temperature -> top_k -> top_p -> min_p. None (or 0 for top_k/min_p, 1 for top_p) = off."""
    logits = apply_temperature(logits.float(), temperature)
    if top_k:
        logits = top_k_filter(logits, top_k)
    if top_p is not None and top_p < 1.0:
        logits = top_p_filter(logits, top_p)
    if min_p:
        logits = min_p_filter(logits, min_p)
    return logits


# --- settings: explicit argument > the checkpoint's generation_config > greedy --------------


@dataclass(frozen=True)
class Sampling:
    """How each next token is chosen. temperature 0 means greedy (argmax); top_k, top_p and min_p
    only act when sampling (None, or 0 for top_k and min_p, or 1 for top_p: off)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    # transformers' repetition_penalty: > 1 discourages every token of the prompt and the reply
    repetition_penalty: float | None = None

    def __post_init__(self):
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if value is not None and not (is_number(value) and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number, got {value!r}.")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}.")
        if self.top_k is not None and not (
            is_number(self.top_k) and math.isfinite(self.top_k)
            and int(self.top_k) == self.top_k and self.top_k >= 0
        ):  # fmt: skip
            raise ValueError(
                f"top_k must be a whole number >= 0 (0 or None: off), got {self.top_k!r}."
            )
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 or None: off), got {self.top_p}.")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0 or None: off), got {self.min_p}.")
        if self.repetition_penalty is not None and not self.repetition_penalty > 0:
            raise ValueError(
                f"repetition_penalty must be > 0 (1 or None: off), got {self.repetition_penalty}."
            )

    @classmethod
    def for_model(cls, model, **explicit) -> Sampling:
        """Settings given here win key by key; the rest come from `model.generation_config`.

        A checkpoint asks for sampling with `do_sample: true`; without it (or with no
        generation_config at all, as for a model built by hand) the default is greedy decoding.
        Penalties are not sampling filters in transformers: they are taken whatever do_sample says.
        """
        names = [f.name for f in fields(cls)]
        _refuse_unknown(explicit, names)
        gc = getattr(model, "generation_config", None) or {}
        samples = bool(gc.get("do_sample", False))
        chosen = {}
        for name in names:
            if explicit.get(name) is not None:
                chosen[name] = explicit[name]
            elif gc.get(name) is not None and (samples or name.endswith("_penalty")):
                chosen[name] = gc[name]
        if samples and "temperature" not in chosen:
            chosen["temperature"] = 1.0  # do_sample without a temperature samples as is
        return cls(**chosen)

    def with_settings(self, **settings) -> Sampling:
        """These settings with those given replaced; a name that is not a setting is refused."""
        _refuse_unknown(settings, [f.name for f in fields(self)])
        return replace(self, **settings)

    def describe(self) -> str:
        """One line for people: "greedy" or "temperature 0.6, top_k 20, top_p 0.95"."""
        text = "greedy"
        if self.temperature > 0:
            text = f"temperature {self.temperature:g}"
            for name in ("top_k", "top_p", "min_p"):
                if getattr(self, name) is not None:
                    text += f", {name} {getattr(self, name):g}"
        for name, neutral in (("presence_penalty", 0), ("repetition_penalty", 1)):
            value = getattr(self, name)
            if value is not None and value != neutral:  # a penalty that changes nothing: unsaid
                text += f", {name} {value:g}"
        return text


def _refuse_unknown(settings: dict, names: list[str]) -> None:
    """A setting this package does not implement (no_repeat_ngram_size, num_beams...) is
    refused by name, never silently ignored."""
    unknown = sorted(set(settings) - set(names))
    if unknown:
        raise TypeError(
            f"unknown sampling setting {unknown[0]!r}: this package implements {names} only."
        )


# generation_config.json fields that change what transformers generates and that this package
# does not implement, with their neutral values (as transformers' GenerationConfig defaults):
# set to anything else, the file is refused rather than silently decoded another way
NOT_IMPLEMENTED = {
    "num_beams": (1,), "no_repeat_ngram_size": (0,), "typical_p": (1.0,),
    "epsilon_cutoff": (0.0,), "eta_cutoff": (0.0,), "min_new_tokens": (0,),
    "encoder_repetition_penalty": (1.0,), "bad_words_ids": ([],), "suppress_tokens": ([],),
    "begin_suppress_tokens": ([],), "sequence_bias": ({},), "penalty_alpha": (0.0,),
}  # fmt: skip


def check_generation_config(gc: dict) -> None:
    """Raise ValueError if a generation_config.json's values could not be used: every sampling
    setting it gives, whether or not it samples, and its end ids."""
    if "do_sample" in gc and not isinstance(gc["do_sample"], bool):
        raise ValueError(f"do_sample must be true or false, got {gc['do_sample']!r}.")
    names = {f.name for f in fields(Sampling)}
    Sampling(**{k: v for k, v in gc.items() if k in names and v is not None})
    for name, neutral in NOT_IMPLEMENTED.items():
        if gc.get(name) is not None and gc[name] not in neutral:
            raise ValueError(
                f"{name} {gc[name]!r} is not implemented by qwen_mini (transformers would "
                f"decode with it, so the output would differ): remove it, or set it to "
                f"{neutral[0]!r}."
            )
    if gc.get("eos_token_id") is not None:
        eos = gc["eos_token_id"]
        ids = eos if isinstance(eos, list) else [eos]
        if not all(is_whole_number(i) and i >= 0 for i in ids):
            raise ValueError(f"eos_token_id must be a token id or a list of them, got {eos!r}.")


def penalised_logits(
    logits: torch.Tensor, seen: torch.Tensor, s: Sampling, in_context=None
) -> torch.Tensor:
    """One position's logits [V], checked finite, with the penalties of `s` applied: the first
    half of the pipeline (the same for greedy and sampled decoding)."""
    if not torch.isfinite(logits).all():  # NaN or inf would become a token, silently
        raise NonFiniteLogitsError(
            "the model's logits hold NaN or infinite values, so no next token can be chosen. "
            "Either the weights hold such values (check them with `qwen-mini doctor --scan "
            "MODEL`) or the activations overflowed (load the model with dtype=torch.float32)."
        )
    if s.repetition_penalty is not None and s.repetition_penalty != 1:
        context = seen if in_context is None else in_context
        logits = apply_repetition_penalty(logits, context, s.repetition_penalty)
    if s.presence_penalty:
        logits = apply_presence_penalty(logits, seen, s.presence_penalty)
    return logits


def token_probabilities(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """The distribution [V] a sampled token is drawn from: the filters of `s` (temperature > 0),
    then softmax; the second half of the pipeline."""
    filtered = filter_logits(logits, s.temperature, s.top_k, s.top_p, s.min_p)
    probs = torch.softmax(filtered, dim=-1)
    if not torch.isfinite(probs).all():  # a temperature so small that logits / t overflowed:
        # the limit of a vanishing temperature is greedy: all the mass on the argmax
        return torch.nn.functional.one_hot(logits.argmax(), logits.shape[-1]).to(probs.dtype)
    return probs
