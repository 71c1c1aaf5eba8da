"""Per-request sampling parameters (vLLM names and meanings)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np

# top-k at or below 0 means "no top-k" (vLLM accepts both -1 and 0). One at or above the
# vocabulary size keeps every token too: larger ones are stored as int32's max, which the
# sampler's tensors and the wire hold.
_NO_TOP_K = 0
_MAX_TOP_K = 2**31 - 1
# Limits on what one request may ask for. They bound the work a client can make the server do
# for it: top-n alternatives per token, and stop strings, which are searched for in the new text
# of every step (and the longest is held back from a stream until it cannot be a stop string).
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
MAX_N = 128                  # completions per prompt (LLM.generate)
# logit_bias: as many entries as stop_token_ids, each within the OpenAI API's [-100, 100] (a bias
# of -100 bans a token, +100 all but forces it; larger ones only risk overflow in float32).
MAX_LOGIT_BIAS = 1024
MAX_LOGIT_BIAS_VALUE = 100.0
# allowed_token_ids: up to a whole vocabulary of the largest ones served (Gemma's 256k).
MAX_ALLOWED_TOKEN_IDS = 1 << 18
# bad_words: as many and as long as stop strings; each is banned as one or two id sequences.
MAX_BAD_WORDS = MAX_STOP_STRINGS
MAX_BAD_WORD_CHARS = MAX_STOP_STRING_CHARS
# A word's ids: a character may take up to 4 byte tokens, and a tokenizer adds its own (a
# SentencePiece "▁" before a word): room for twice that.
MAX_BAD_WORD_IDS = 8 * MAX_BAD_WORD_CHARS
# Fields the front end fills in, not a user's keys (from_dict refuses them by name).
INTERNAL_FIELDS = ("bad_words_token_ids",)
# A completion whose seed + k is -1 (read as "no seed") is seeded with this instead (child).
CHILD_SEED_FOR_MINUS_ONE = -(2**63)
# The sampler works in float32: temperature and repetition_penalty must be float32 numbers
# there, not inf (beyond FLOAT32_MAX) or 0 / a denormal (a penalty below FLOAT32_MIN_NORMAL),
# which turn the logits into NaN.
FLOAT32_MAX = 3.4028234663852886e+38
FLOAT32_MIN_NORMAL = 1.1754943508222875e-38


@dataclass
class SamplingParams:
    """How to pick the next token and when to stop.

    temperature 0 is greedy. Penalties follow vLLM: `repetition_penalty` scales the logits of
    every token seen in the prompt or the output (divide if positive, multiply if negative),
    `presence_penalty` / `frequency_penalty` subtract from the logits of tokens seen in the output
    (once / per occurrence). `logprobs=n` returns, for each generated token, its log-probability
    under the raw model distribution and the top-n alternatives.
    """

    max_tokens: int | None = 16         # None: until the context ends (max_model_len)
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
    # Completions per prompt (vLLM's parallel sampling): LLM.generate and the served models run
    # n requests of the prompt, the k-th seeded seed + k when a seed is given (vLLM's rule). An
    # AsyncEngine request is one completion (n 1).
    n: int = 1
    # vLLM's token controls, applied to the logits before the penalties (vLLM V1's order):
    # allowed_token_ids masks every other token to -inf; logit_bias adds its value to its token's
    # logit ({token id: bias}; JSON's string keys are read as ids). logprobs stay the raw model's.
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    # vLLM's bad_words: the last token of a word is never sampled right after the word's other
    # tokens (a one-token word: never). Matched on token ids, in the output only, each word as
    # the tokenizer spells it alone and after a space (tokenize_bad_words, vLLM's rule).
    bad_words: list[str] = field(default_factory=list)
    # bad_words as those id sequences: filled by the front end (LLM, AsyncEngine) before the
    # request goes to the engine core, which reads only these. Not a user's key.
    bad_words_token_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        self.validate()

    def _normalize(self) -> None:
        """vLLM's spellings as this class keeps them, also for a field set after building
        (vLLM's examples change get_default_sampling_params()'s fields)."""
        # NumPy scalars (np.int64(8), np.float32(0.5)) as the Python numbers they are.
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, np.generic):
                setattr(self, f.name, v.item())
        if self.seed == -1 and not isinstance(self.seed, bool):
            self.seed = None                    # vLLM's "no seed"
        if self.logprobs is True:
            self.logprobs = 1                   # vLLM's reading of logprobs=True
        self.stop = _as_list("stop", self.stop, "a string or a list of strings")
        self.stop_token_ids = [t.item() if isinstance(t, np.integer) else t for t in _as_list(
            "stop_token_ids", self.stop_token_ids, "a list of token ids")]
        if self.logit_bias is not None:
            self.logit_bias = _as_bias(self.logit_bias)
        self.bad_words = _as_list("bad_words", self.bad_words, "a list of strings")
        if self.bad_words_token_ids is not None:
            self.bad_words_token_ids = [
                [t.item() if isinstance(t, np.integer) else t for t in
                 _as_list("bad_words_token_ids", w, "a list of lists of token ids")]
                for w in _as_list("bad_words_token_ids", self.bad_words_token_ids,
                                  "a list of lists of token ids")]
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = [t.item() if isinstance(t, np.integer) else t for t in _as_list(
                "allowed_token_ids", self.allowed_token_ids, "a list of token ids")]
        if self.top_k is None:
            self.top_k = _NO_TOP_K
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (no top-k) or a positive integer, "
                             f"got {self.top_k}")
        self.top_k = _NO_TOP_K if self.top_k < 0 else min(self.top_k, _MAX_TOP_K)

    def clone(self) -> SamplingParams:
        """A copy of its own, checked again (vLLM's clone): what a request keeps, so that its
        caller may change or reuse these at once."""
        return replace(self)

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raises ValueError naming a field out of its range, after taking vLLM's spellings
        (top_k -1, stop None, logprobs True, seed -1) as they are meant."""
        self._normalize()
        # max_tokens has no upper bound: a request also ends at the model's max_model_len.
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, lo=1)
        _check_num("temperature", self.temperature, lo=0.0, hi=FLOAT32_MAX)
        _check_num("top_p", self.top_p, lo=0.0, lo_open=True, hi=1.0)
        _check_int("top_k", self.top_k, lo=0)
        _check_num("min_p", self.min_p, lo=0.0, hi=1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, lo=-(2**63), hi=2**63 - 1)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop holds {len(self.stop)} strings; at most {MAX_STOP_STRINGS} "
                             f"are allowed")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be a string or a list of non-empty strings, "
                                 f"got {_short(s)}")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"stop strings must be 1 to {MAX_STOP_STRING_CHARS} characters "
                                 f"long, got one of {len(s)}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids holds {len(self.stop_token_ids)} ids; at most "
                             f"{MAX_STOP_TOKEN_IDS} are allowed")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids must be non-negative integers, got {_short(t)}")
        _check_bool("ignore_eos", self.ignore_eos)
        _check_int("min_tokens", self.min_tokens, lo=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        _check_num("repetition_penalty", self.repetition_penalty, lo=FLOAT32_MIN_NORMAL,
                   hi=FLOAT32_MAX)
        _check_num("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _check_num("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, lo=0, hi=MAX_LOGPROBS)
        _check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        _check_bool("skip_special_tokens", self.skip_special_tokens)
        _check_int("n", self.n, lo=1, hi=MAX_N)
        if self.logit_bias is not None:
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias holds {len(self.logit_bias)} entries; at most "
                                 f"{MAX_LOGIT_BIAS} are allowed")
            for t, b in self.logit_bias.items():
                _check_num(f"logit_bias[{t}]", b, lo=-MAX_LOGIT_BIAS_VALUE, hi=MAX_LOGIT_BIAS_VALUE)
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise ValueError(f"bad_words holds {len(self.bad_words)} strings; at most "
                             f"{MAX_BAD_WORDS} are allowed")
        for w in self.bad_words:
            if not isinstance(w, str) or not w.strip():
                raise ValueError(f"bad_words must be a list of strings that are not blank, got "
                                 f"{_short(w)}")
            if len(w) > MAX_BAD_WORD_CHARS:
                raise ValueError(f"bad_words must be 1 to {MAX_BAD_WORD_CHARS} characters long, "
                                 f"got one of {len(w)}")
        if self.bad_words_token_ids is not None:
            if len(self.bad_words_token_ids) > 2 * MAX_BAD_WORDS:
                raise ValueError(f"bad_words_token_ids holds {len(self.bad_words_token_ids)} "
                                 f"words; at most {2 * MAX_BAD_WORDS} are allowed")
            for w in self.bad_words_token_ids:
                if not w or len(w) > MAX_BAD_WORD_IDS or any(
                        isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in w):
                    raise ValueError(f"bad_words_token_ids must hold 1 to {MAX_BAD_WORD_IDS} "
                                     f"non-negative token ids a word, got {_short(w)}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must hold at least one token id (null: "
                                 "every token is allowed)")
            if len(self.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS:
                raise ValueError(f"allowed_token_ids holds {len(self.allowed_token_ids)} ids; at "
                                 f"most {MAX_ALLOWED_TOKEN_IDS} are allowed")
            for t in self.allowed_token_ids:
                if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                    raise ValueError(f"allowed_token_ids must be non-negative integers, got "
                                     f"{_short(t)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def child(self, k: int) -> "SamplingParams":
        """The k-th of the n completions' own parameters (vLLM's): n 1, seed + k (wrapped
        within int64). Where seed + k is -1, which these parameters read as no seed, the
        completion takes -2**63 instead: it stays seeded, so it comes out the same every time
        (vLLM's sampler takes -1 as a seed there; this one cannot tell it from "none")."""
        seed = None if self.seed is None else (self.seed + k + 2**63) % 2**64 - 2**63
        return replace(self, n=1, seed=CHILD_SEED_FOR_MINUS_ONE if seed == -1 else seed)

    def tokenize_bad_words(self, tokenizer) -> None:
        """Sets bad_words_token_ids from bad_words (vLLM's rule): each word, leading spaces
        dropped, as the tokenizer spells it alone, and as it spells it after a space where that
        starts with another token and takes as many (a word inside a text). A request with
        bad_words and no tokenizer (skip_tokenizer_init) is refused naming bad_words."""
        if not self.bad_words:          # (ids given as they are, from Python, stay)
            return
        if tokenizer is None:
            raise ValueError("bad_words needs the tokenizer, which this engine does not load "
                             "(skip_tokenizer_init)")
        ids = []
        for word in self.bad_words:
            alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if not alone:
                raise ValueError(f"bad_words: {_short(word)} gives no tokens to ban")
            if max(len(alone), len(spaced)) > MAX_BAD_WORD_IDS:
                raise ValueError(f"bad_words: {_short(word)} gives more than "
                                 f"{MAX_BAD_WORD_IDS} tokens")
            ids.append(alone)
            if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
                ids.append(spaced)
        self.bad_words_token_ids = ids
        self.validate()

    # ------------------------------------------------------------------ from user input
    @classmethod
    def field_names(cls) -> list[str]:
        """The keys a user may give (from_dict); INTERNAL_FIELDS are not among them."""
        return [f.name for f in fields(cls) if f.name not in INTERNAL_FIELDS]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SamplingParams":
        """Build from a user's dict (e.g. the `sampling_parameters` JSON); unknown keys are
        errors. A null value is the key's default (as Triton's vLLM backend reads it), but for
        max_tokens, where None means until the context ends (vLLM's meaning)."""
        if not isinstance(d, dict):
            raise ValueError(f"sampling parameters must be a JSON object, got {_json_kind(d)}")
        names = cls.field_names()
        unknown = sorted(str(k) for k in set(d) - set(names))
        if unknown:
            shown = ", ".join(_short(k) for k in unknown[:5])
            more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
            raise ValueError(
                f"unknown sampling parameter(s) [{shown}]{more}; valid keys are {names}")
        return cls(**{k: v for k, v in d.items() if v is not None or k == "max_tokens"})

    @classmethod
    def from_json(cls, text: str) -> "SamplingParams":
        return cls.from_dict(load_json_object(text))


def load_json_object(text: str, name: str = "sampling_parameters") -> dict:
    """A user's JSON object; ValueError naming `name` for anything else. Empty text is {}.
    NaN and Infinity parse here (Python writes them) and are refused per field, by name."""
    try:
        d = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"{name} is not valid JSON: {e}") from None
    except RecursionError:
        raise ValueError(f"{name} is not valid JSON: nested too deeply") from None
    except ValueError as e:             # e.g. an integer of more than 4300 digits
        raise ValueError(f"{name} cannot be read: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{name} must be a JSON object ({{\"key\": value, ...}}), "
                         f"got {_json_kind(d)}")
    return d


def _json_kind(v: Any) -> str:
    if v is None:
        return "null"
    return {list: "an array", str: "a string", bool: "a boolean", int: "a number",
            float: "a number"}.get(type(v), type(v).__name__)


def _as_list(name: str, v: Any, what: str) -> list:
    if v is None:
        return []
    if name == "stop" and isinstance(v, str):
        return [v]
    if not isinstance(v, (list, tuple)):
        raise ValueError(f"{name} must be {what}, got {_short(v)}")
    return list(v)


def _as_bias(v: Any) -> dict[int, float]:
    """logit_bias as {id: bias}: its keys may be ids or their decimal strings (JSON's keys are
    strings, as OpenAI's API sends them); anything else is refused naming the key."""
    if not isinstance(v, dict):
        raise ValueError(f"logit_bias must be an object of token id -> bias, got {_short(v)}")
    out: dict[int, float] = {}
    for k, b in v.items():
        t = k.item() if isinstance(k, np.integer) else k
        if isinstance(t, str) and t.strip().isascii() and t.strip().isdecimal():
            t = int(t.strip())
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"logit_bias keys must be non-negative token ids, got {_short(k)}")
        if t in out:
            raise ValueError(f"logit_bias names token id {t} twice")
        out[t] = b.item() if isinstance(b, np.generic) else b
    return out


def _short(v: Any) -> str:
    """A user's value for an error message, cut to a readable length."""
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_bool(name: str, v: Any) -> None:
    if not isinstance(v, bool):
        raise ValueError(f"{name} must be true or false, got {_short(v)}")


def _check_int(name: str, v: Any, lo: int | None = None, hi: int | None = None) -> None:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{name} must be an integer, got {_short(v)}")
    _check_range(name, v, lo, hi, False)


def _check_num(name: str, v: Any, lo: float | None = None, hi: float | None = None,
               lo_open: bool = False) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{name} must be a number, got {_short(v)}")
    if isinstance(v, float) and not math.isfinite(v):      # JSON's NaN, Infinity
        raise ValueError(f"{name} must be a finite number, got {v!r}")
    _check_range(name, v, lo, hi, lo_open)


def _check_range(name: str, v: Any, lo: Any, hi: Any, lo_open: bool) -> None:
    if (lo is not None and (v <= lo if lo_open else v < lo)) or (hi is not None and v > hi):
        bounds = []
        if lo is not None:
            bounds.append(f"{'>' if lo_open else '>='} {lo}")
        if hi is not None:
            bounds.append(f"<= {hi}")
        raise ValueError(f"{name} must be {' and '.join(bounds)}, got {_short(v)}")
