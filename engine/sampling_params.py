"""Per-request sampling parameters (vLLM names and meanings)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

# top-k at or below 0 means "no top-k" (vLLM accepts both -1 and 0).
_NO_TOP_K = 0
MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """How to pick the next token and when to stop.

    temperature 0 is greedy. Penalties follow vLLM: `repetition_penalty` scales the logits of
    every token seen in the prompt or the output (divide if positive, multiply if negative),
    `presence_penalty` / `frequency_penalty` subtract from the logits of tokens seen in the output
    (once / per occurrence). `logprobs=n` returns, for each generated token, its log-probability
    under the raw model distribution and the top-n alternatives.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = _NO_TOP_K
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k is None or self.top_k < 0:
            self.top_k = _NO_TOP_K
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        _check_int("max_tokens", self.max_tokens, lo=1)
        _check_num("temperature", self.temperature, lo=0.0)
        _check_num("top_p", self.top_p, lo=0.0, lo_open=True, hi=1.0)
        _check_int("top_k", self.top_k, lo=0)
        _check_num("min_p", self.min_p, lo=0.0, hi=1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, lo=-(2**63), hi=2**63 - 1)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop must be a string or a list of non-empty strings")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids must be non-negative integers, got {t!r}")
        _check_bool("ignore_eos", self.ignore_eos)
        _check_int("min_tokens", self.min_tokens, lo=0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        _check_num("repetition_penalty", self.repetition_penalty, lo=0.0, lo_open=True)
        _check_num("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _check_num("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, lo=0, hi=MAX_LOGPROBS)
        _check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        _check_bool("skip_special_tokens", self.skip_special_tokens)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    # ------------------------------------------------------------------ from user input
    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SamplingParams":
        """Build from a user's dict (e.g. the `sampling_parameters` JSON); unknown keys are errors."""
        if not isinstance(d, dict):
            raise ValueError(f"sampling parameters must be a JSON object, got {type(d).__name__}")
        names = cls.field_names()
        unknown = sorted(set(d) - set(names))
        if unknown:
            raise ValueError(
                f"unknown sampling parameter(s) {unknown}; valid keys are {names}")
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> "SamplingParams":
        try:
            d = json.loads(text) if text.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"sampling_parameters is not valid JSON: {e}") from None
        return cls.from_dict(d)


def _check_bool(name: str, v: Any) -> None:
    if not isinstance(v, bool):
        raise ValueError(f"{name} must be true or false, got {v!r}")


def _check_int(name: str, v: Any, lo: int | None = None, hi: int | None = None) -> None:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{name} must be an integer, got {v!r}")
    _check_range(name, v, lo, hi, False)


def _check_num(name: str, v: Any, lo: float | None = None, hi: float | None = None,
               lo_open: bool = False) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
        raise ValueError(f"{name} must be a number, got {v!r}")
    _check_range(name, v, lo, hi, lo_open)


def _check_range(name: str, v: Any, lo: Any, hi: Any, lo_open: bool) -> None:
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise ValueError(f"{name} must be {'>' if lo_open else '>='} {lo}"
                         f"{'' if hi is None else f' and <= {hi}'}, got {v!r}")
    if hi is not None and v > hi:
        raise ValueError(f"{name} must be <= {hi}"
                         f"{'' if lo is None else f' and >= {lo}'}, got {v!r}")
