"""What callers get back (vLLM-shaped)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int                      # 1 = the most likely token
    decoded_token: str


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None       # "stop" | "length" | "abort"
    stop_reason: int | str | None = None   # the stop string or stop token id that ended it
    # One dict per generated token: the sampled token and the top-n alternatives.
    logprobs: list[dict[int, Logprob]] | None = None
    # The sum of the sampled tokens' logprobs so far, all of the request's tokens up to this
    # output's last (vLLM's); None unless logprobs were asked for.
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        """A method, as vLLM's (`RequestOutput.finished` is an attribute)."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """From `LLM.generate`: the whole completion. From `AsyncEngine.generate`: one per step,
    holding only what is new since the last one (text, token ids, logprobs)."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # Prompt tokens found in the prefix cache when the request was first scheduled (not
    # computed for it): a shared prefix or an earlier request's blocks. 0 until its first token.
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    num_cached_kv_blocks: int
    num_steps: int
    num_prompt_tokens: int
    num_computed_prompt_tokens: int
    num_cached_prompt_tokens: int
    num_generated_tokens: int
    num_preemptions: int
    # Query rows (decode rows and prompt tokens) that read a prefix shared with other running
    # requests once per group (cascade attention), since start.
    num_cascade_rows: int = 0
    # Steps run as captured CUDA graphs since start (decode steps whole, steps with prompt
    # chunks cut at attention); the others were launched eagerly (cascade steps with prompt
    # chunks, more tokens than the captured sizes, or CPU).
    num_graph_steps: int = 0
