"""Turns the core's token ids into text: incremental detokenization, stop strings, logprobs.

`process` runs on one thread (the core client's reader). A stop string ends a request here,
not in the core: `process` returns those ids so the caller aborts them in the core. A
request nobody watches step by step (not streamed, no stop strings) is decoded once, at the
end: no per-step work for it here or downstream.

A streamed request added with `pull=True` and no stop strings is not decoded per step
either: `process` only collects its token ids and hands out its `PullOutput` handle, and
whoever sends the request's next response calls `render(handle)`, which decodes everything
collected since the last call into one RequestOutput. Under load one render covers several
steps, so the text is decoded per response, not per token (the serving reader thread spent
most of its time decoding and building an output per request per step). Each handle is
rendered by one thread at a time; different handles may render on different threads: they
only decode with the tokenizer (it holds the GIL throughout and changes nothing; encoding is
what needs a tokenizer of its own per thread).
"""
from __future__ import annotations

import time

from engine.detokenizer import IncrementalDetokenizer, StopStringMatcher, batch_decoder
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import EngineCoreOutput


class _RequestState:
    def __init__(self, tokenizer, request_id: str, prompt: str | None,
                 prompt_token_ids: list[int], params: SamplingParams, stream: bool,
                 pull: bool = False) -> None:
        self.request_id = request_id
        self.stream = stream
        # Decoded when rendered, not per step (no stop string to look for as tokens come).
        self.handle = PullOutput(self) if pull and stream and not params.stop else None
        # Not streamed and no stop string to look for: decode once when it finishes.
        self.final_only = not stream and not params.stop
        self.num_decoded = 0                # token ids already passed to the detokenizer
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        if tokenizer is None and params.stop:
            raise ValueError("stop strings need a tokenizer, and skip_tokenizer_init is set: "
                             "use stop_token_ids")
        self.detok = (IncrementalDetokenizer(tokenizer, prompt_token_ids,
                                             params.skip_special_tokens)
                      if tokenizer is not None else None)
        self.stop = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        self.text = ""
        self.num_sent_chars = 0
        self.token_ids: list[int] = []
        self.num_sent_tokens = 0
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.num_sent_logprobs = 0
        self.sum_logprob = 0.0              # the sampled tokens' logprobs, the first num_summed
        self.num_summed = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0          # told with the first token
        # The tokens whose text the output carries; None: all. Set before the last token is
        # added when the core ended the request on a stop token or EOS: as in vLLM, that
        # token's text is left out unless include_stop_str_in_output (it stays in token_ids).
        self.num_text_tokens: int | None = None

    def ids_to_decode(self, end: int) -> list[int]:
        """The token ids from num_decoded up to `end` whose text the output carries."""
        if self.num_text_tokens is not None:
            end = min(end, self.num_text_tokens)
        return self.token_ids[self.num_decoded:end]

    def cumulative_logprob(self, end: int) -> float | None:
        """The sum of the first `end` sampled tokens' logprobs (each step's dict holds the
        sampled token first), kept as a running sum; None without logprobs."""
        if self.logprobs is None:
            return None
        for step in self.logprobs[self.num_summed:end]:
            self.sum_logprob += next(iter(step.values())).logprob
        self.num_summed = max(self.num_summed, min(end, len(self.logprobs)))
        return self.sum_logprob


class RequestFailed(RuntimeError):
    """One request's output could not be made (its tokens' decoding, its logprobs' tokens or
    its stop strings raised: a tokenizer that cannot decode an id the model sampled). That
    request alone ends with this error; `process` hands it out in the request's place (its
    `request_id`) and names it among those the core must abort."""

    def __init__(self, request_id, cause: BaseException) -> None:
        super().__init__(f"making the request's output failed: {cause!r}")
        self.request_id = request_id
        self.finished = True


class PullOutput:
    """What `process` hands out for a pull request, the same object every step: new tokens
    are waiting; `OutputProcessor.render(handle)` gives them as one RequestOutput."""
    __slots__ = ("state", "request_id", "finished")

    def __init__(self, state: _RequestState) -> None:
        self.state = state
        self.request_id = state.request_id
        self.finished = False        # set by process once the last token is in


class OutputProcessor:
    def __init__(self, tokenizer, stream_deltas: bool) -> None:
        """stream_deltas: one output per step with only the new part (AsyncEngine), or one
        output per request at the end with everything (LLM)."""
        self.tokenizer = tokenizer
        self.stream_deltas = stream_deltas
        self.states: dict[str, _RequestState] = {}
        self._decode_many = batch_decoder(tokenizer) if tokenizer is not None else None

    def add_request(self, key, request_id: str, prompt: str | None,
                    prompt_token_ids: list[int], params: SamplingParams,
                    stream: bool = True, pull: bool = False) -> None:
        """`key` is the core's id for the request (what its outputs carry), `request_id` the
        caller's. stream=False: only the finished output is wanted (always so without
        stream_deltas). pull: see the module docstring. Safe to call from another thread
        than `process`."""
        self.states[key] = _RequestState(self.tokenizer, request_id, prompt, prompt_token_ids,
                                         params, stream and self.stream_deltas, pull)

    def drop(self, key) -> None:
        """Forgets a request that ended elsewhere (aborted by its caller)."""
        self.states.pop(key, None)

    def has_unfinished(self) -> bool:
        return bool(self.states)

    def process(self, core_outputs: list[EngineCoreOutput]
                ) -> tuple[list[RequestOutput | PullOutput | RequestFailed], list[str]]:
        """Returns the outputs to hand out and the keys of the requests the core must abort
        (stop string found, or the request's output failed: a RequestFailed in its place)."""
        outputs: list[RequestOutput | PullOutput | RequestFailed] = []
        to_abort: list[str] = []
        # First every request's new tokens, then one decode for all their windows, then the
        # rest per request. A request whose part raises ends alone (_failed).
        todo: list[list] = []               # [core output, state, its windows or None, texts]
        windows: dict[bool, list[list[int]]] = {True: [], False: []}
        for co in core_outputs:
            st = self.states.get(co.request_id)
            if st is None:
                continue                    # already ended here by a stop string
            try:
                entry = self._take(co, st, outputs)
            except Exception as e:  # noqa: BLE001 - that request's fault, not the step's
                self._failed(co, st, e, outputs, to_abort)
                continue
            if entry is not None:
                todo.append(entry)
                if entry[2] is not None:
                    windows[st.detok.skip_special_tokens].extend(entry[2])
        try:
            texts = {skip: iter(self._decode_many(seqs, skip)) if seqs else iter(())
                     for skip, seqs in windows.items()}
            for entry in todo:
                if entry[2] is not None:
                    it = texts[entry[1].detok.skip_special_tokens]
                    entry[3] = [next(it) for _ in entry[2]]
        except Exception:  # noqa: BLE001 - some request's ids: decode each alone to find it
            for entry in todo:
                if entry[2] is not None:
                    try:
                        entry[3] = self._decode_many(entry[2], entry[1].detok.skip_special_tokens)
                    except Exception as e:  # noqa: BLE001
                        self._failed(entry[0], entry[1], e, outputs, to_abort)
                        entry[1] = None
        for co, st, wins, texts in todo:
            if st is None:
                continue                    # failed in its decode
            try:
                out = self._finish_step(co, st, texts, to_abort)
            except Exception as e:  # noqa: BLE001
                self._failed(co, st, e, outputs, to_abort)
                continue
            if out is not None:
                outputs.append(out)
        return outputs, to_abort

    def _take(self, co: EngineCoreOutput, st: _RequestState, outputs: list) -> list | None:
        """A step's new tokens into the request's state; its todo entry (windows to decode),
        or None where nothing more is done this step (a pull request's handle is out)."""
        if co.new_token_ids:
            st.last_token_time = time.monotonic()
            if st.first_token_time is None:
                st.first_token_time = st.last_token_time
        if co.num_cached_tokens is not None:
            st.num_cached_tokens = co.num_cached_tokens
        if st.logprobs is not None and co.new_logprobs:
            st.logprobs.extend(self._logprobs(lp) for lp in co.new_logprobs)
        if (co.finished and co.finish_reason == "stop" and co.new_token_ids
                and not st.params.include_stop_str_in_output):
            st.num_text_tokens = len(st.token_ids) + len(co.new_token_ids) - 1
        handle = st.handle
        if handle is not None:
            # Tokens first, the finish after: render reads them in the other order.
            st.token_ids.extend(co.new_token_ids)
            if co.finished:
                st.stop_reason = co.stop_reason
                st.finish_reason = co.finish_reason
                handle.finished = True
                self.states.pop(co.request_id, None)
            outputs.append(handle)
            return None
        st.token_ids.extend(co.new_token_ids)
        if st.final_only and not co.finished:
            return None
        wins = None
        if st.detok:
            wins = list(st.detok.windows(st.ids_to_decode(len(st.token_ids))))
        st.num_decoded = len(st.token_ids)
        return [co, st, wins, None]

    def _finish_step(self, co: EngineCoreOutput, st: _RequestState, texts: list[str] | None,
                     to_abort: list[str]) -> RequestOutput | None:
        """The step's new text, the stop strings, and the request's output (if any)."""
        finished = co.finished
        new_text = ""
        if texts is not None:
            new_text = st.detok.complete(texts[0], texts[1], final=finished)
        st.text += new_text
        if finished:
            st.finish_reason, st.stop_reason = co.finish_reason, co.stop_reason
        # As vLLM: the text of the first min_tokens tokens is not searched.
        if st.stop.stop and new_text and len(st.token_ids) > st.params.min_tokens:
            hit = st.stop.find(st.text, len(new_text))
            if hit is not None:
                st.stop_reason, cut = hit
                st.text = st.text[:cut]
                st.finish_reason = "stop"
                if not finished:
                    to_abort.append(co.request_id)
                finished = True
        if finished:
            self.states.pop(co.request_id, None)
        return self._make_output(st, finished)

    def _failed(self, co: EngineCoreOutput, st: _RequestState, e: Exception, outputs: list,
                to_abort: list[str]) -> None:
        self.states.pop(co.request_id, None)
        if not co.finished:
            to_abort.append(co.request_id)
        outputs.append(RequestFailed(st.request_id, e))

    def render(self, handle: PullOutput) -> RequestOutput | None:
        """Everything a pull request produced since its last render, decoded, as one output;
        None if nothing new is visible yet (a partial character held back). Any thread,
        one at a time per handle; once it has returned a finished output, never again."""
        st = handle.state
        finished = st.finish_reason is not None       # before the tokens: see process
        n = len(st.token_ids)
        new_ids = st.ids_to_decode(n)
        st.num_decoded = n
        if st.detok is not None and (new_ids or finished):
            skip = st.detok.skip_special_tokens
            prefix, full = self._decode_many(list(st.detok.windows(new_ids)), skip)
            st.text += st.detok.complete(prefix, full, final=finished)
        if not finished and len(st.text) == st.num_sent_chars and n == st.num_sent_tokens:
            return None
        return self._make_output(st, finished, n)

    def _logprobs(self, lp: tuple[list[int], list[float], int]) -> dict[int, Logprob]:
        ids, values, sampled_rank = lp
        d: dict[int, Logprob] = {}
        for i, (tid, v) in enumerate(zip(ids, values)):
            rank = sampled_rank if i == 0 else i
            # The sampled token also among the top-n takes its place there (its rank by
            # position, as vLLM's: a tie ranks 1..n once each), and stays first in the dict.
            text = (d[tid].decoded_token if tid in d else
                    self.tokenizer.decode([tid]) if self.tokenizer is not None else "")
            d[tid] = Logprob(v, rank, text)
        return d

    def _make_output(self, st: _RequestState, finished: bool,
                     num_tokens: int | None = None) -> RequestOutput | None:
        """num_tokens: the request's tokens up to which to send (render's snapshot: the
        reader thread may have added more since, not yet decoded); default all."""
        if not st.stream:
            if not finished:
                return None
            comp = CompletionOutput(0, st.text, list(st.token_ids), st.finish_reason,
                                    st.stop_reason, st.logprobs,
                                    st.cumulative_logprob(len(st.token_ids)))
        else:
            visible = len(st.text) if finished else max(st.num_sent_chars,
                                                         len(st.text) - st.stop.holdback)
            text = st.text[st.num_sent_chars:visible]
            st.num_sent_chars = visible
            end = len(st.token_ids) if num_tokens is None else num_tokens
            token_ids = st.token_ids[st.num_sent_tokens:end]
            st.num_sent_tokens = end
            logprobs = None
            if st.logprobs is not None:         # one per token
                end_lp = len(st.logprobs) if num_tokens is None else num_tokens
                logprobs = st.logprobs[st.num_sent_logprobs:end_lp]
                st.num_sent_logprobs = end_lp
            comp = CompletionOutput(0, text, token_ids, st.finish_reason if finished else None,
                                    st.stop_reason if finished else None, logprobs,
                                    st.cumulative_logprob(end))
        return RequestOutput(st.request_id, st.prompt, st.prompt_token_ids, [comp], finished,
                             num_cached_tokens=st.num_cached_tokens,
                             metrics={"first_token_time": st.first_token_time,
                                      "last_token_time": st.last_token_time})
