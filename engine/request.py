"""A request as the scheduler sees it: token ids, how many of them have KV, and why it ended.

There are no prefill/decode phases: a request is `num_computed_tokens` catching up to
`num_tokens`. A prompt is the first `num_prompt_tokens`; every sampled token is appended.

With async scheduling (engine/engine_core.py) a step is planned while the previous one still
runs: a token being sampled there counts as an output placeholder, already scheduled as the
next step's input (the runner takes it from the GPU), appended once it reaches the host.
"""
from __future__ import annotations

import enum

import numpy as np

from engine.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


def check_request(prompt_token_ids, params: SamplingParams, max_model_len: int,
                  vocab_size: int) -> None:
    """Raises ValueError naming what in a request this engine cannot serve. Token ids may be a
    list or a numpy array (long prompts are checked without a Python loop). Served, given
    token ids are the `input_ids` input. The parameters are those checked when the request
    was taken: AsyncEngine and LLM.generate keep their own copy (SamplingParams.clone), which
    no caller can change afterwards."""
    if params.n != 1:
        raise ValueError(f"n must be 1 here, got {params.n}: an engine request is one "
                         f"completion (LLM.generate and the served models fan n completions "
                         f"out; here send n requests with different seeds)")
    n = len(prompt_token_ids)
    if n == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if n > max_model_len:
        raise ValueError(f"the prompt is {n} tokens long, more than max_model_len "
                         f"({max_model_len})")
    try:
        ids = np.asarray(prompt_token_ids, dtype=np.int64)
    except OverflowError:
        ids = None
    if ids is None or ids.ndim != 1:
        raise ValueError(f"prompt token ids (input_ids) must be integers in [0, {vocab_size})")
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise ValueError(f"prompt token ids (input_ids) must be in [0, {vocab_size}), got "
                         f"{bad[:5].tolist()}")
    for name, ids in (("stop_token_ids", params.stop_token_ids),
                      ("logit_bias keys", params.logit_bias or ()),
                      ("allowed_token_ids", params.allowed_token_ids or ())):
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise ValueError(f"{name} must be in [0, {vocab_size}), got {bad[:5]}")
    if params.bad_words and params.bad_words_token_ids is None:
        raise ValueError("bad_words were not tokenized (SamplingParams.tokenize_bad_words)")
    bad = [t for w in params.bad_words_token_ids or () for t in w if t >= vocab_size]
    if bad:
        raise ValueError(f"bad_words give token ids beyond the model's vocabulary "
                         f"[0, {vocab_size}): {bad[:5]}")


class Request:
    def __init__(self, request_id: int | str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams, eos_token_ids: list[int]) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.num_prompt_tokens = len(prompt_token_ids)
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0      # tokens sampled in a step not yet collected
        self.status = RequestStatus.WAITING
        # Stopping: EOS does not stop an ignore_eos request; stop_token_ids always do. The
        # first EOS id is the primary one (stop_reason None); another, as vLLM reads the
        # generation config's extra EOS ids, is the stop_reason.
        self.eos_token_ids = frozenset() if sampling_params.ignore_eos else frozenset(eos_token_ids)
        self.primary_eos = eos_token_ids[0] if eos_token_ids else None
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids)
        self.stop_reason: int | str | None = None
        # Bookkeeping the KV cache manager fills in.
        self.block_hashes: list[bytes] = []
        self.num_cached_tokens = -1           # prefix-cache hit at first schedule; -1 = not yet
        self.num_preemptions = 0
        self.arrival_step = 0                 # the scheduler's step count when it came in

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        """Tokens whose KV may be computed: the known ones and the ones being sampled."""
        return len(self.all_token_ids) + self.num_output_placeholders

    def reaches_limit(self, max_model_len: int) -> bool:
        """True when the tokens being sampled already end the request by length, so no
        further step is wanted (async scheduling)."""
        if not self.num_output_placeholders:
            return False
        return self._length_reached(self.num_tokens_with_placeholders, max_model_len)

    def _length_reached(self, num_tokens: int, max_model_len: int) -> bool:
        """With num_tokens tokens the request has all the output it may have."""
        max_tokens = self.sampling_params.max_tokens
        return (num_tokens >= max_model_len
                or max_tokens is not None and num_tokens - self.num_prompt_tokens >= max_tokens)

    @property
    def num_cached_prompt_tokens(self) -> int:
        """Prompt tokens the prefix cache held at the first admission (0 before it)."""
        return max(0, min(self.num_cached_tokens, self.num_prompt_tokens))

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.all_token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def append_token(self, token_id: int, max_model_len: int) -> bool:
        """Adds a sampled token; returns True (and sets the status) if the request is done."""
        tokens = self.all_token_ids
        tokens.append(token_id)
        params = self.sampling_params
        num_out = len(tokens) - self.num_prompt_tokens
        if num_out >= params.min_tokens:
            if token_id in self.eos_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                if token_id != self.primary_eos:
                    self.stop_reason = token_id
                return True
            if token_id in self.stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = token_id
                return True
        if self._length_reached(len(tokens), max_model_len):
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False
