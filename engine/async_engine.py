"""asyncio front end: `async for out in engine.generate(prompt, params, request_id)`.

The scheduler, KV cache and model run in the engine core process (engine/core_process.py);
this side keeps what needs the tokenizer, and nothing heavy runs on the event loop:
- the loop: checks requests, per-request queues, hands out outputs;
- one tokenizer thread: prompts that arrive together are tokenized in one batch call, in a
  tokenizer process at a lower priority (engine/tokenizer_process.py) or, without one, here
  (the tokenizer drops the GIL while it works, so the loop keeps running);
- the core client's reader thread: each step's token ids become text here (incremental
  detokenization, stop strings), then go to the loop; its sender thread writes the frames.
Each thread that touches a tokenizer has its own copy: HF tokenizers are not thread-safe.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext

import numpy as np

from engine.config import EngineConfig
from engine.core_client import CoreClient, CoreDiedError, PeerCoreClient
from engine.llm import (Prompt, encode_prompt, eos_token_ids, load_tokenizer, token_array,
                        unwrap_prompt)
from engine.output_processor import OutputProcessor, PullOutput
from engine.outputs import CompletionOutput, EngineStats, RequestOutput
from engine.request import check_request
from engine.sampling_params import SamplingParams
from engine.scheduler import EngineCoreOutput
from engine.tokenize import BatchTokenizer, PromptDropped, TokenizerClosed

logger = logging.getLogger(__name__)

STATS_TIMEOUT_S = 10.0

# A tokenized prompt: its text (None when given as token ids), its ids, and the ids packed for
# the core.
Tokenized = tuple[str | None, list[int], np.ndarray]


class EngineDeadError(RuntimeError):
    pass


class _Stream:
    __slots__ = ("queue", "sink", "index", "core", "finished", "abort_requested")

    def __init__(self, sink: Callable[[RequestOutput | BaseException], None] | None = None
                 ) -> None:
        # generate(): outputs go through the loop into the queue; submit(): straight to sink.
        self.queue: asyncio.Queue[RequestOutput | BaseException] | None = (
            asyncio.Queue() if sink is None else None)
        self.sink = sink
        self.index: int | None = None      # the core's id for it, once sent
        self.core: CoreClient | None = None     # the core it was sent to: ours or a peer's
        self.finished = False
        self.abort_requested = False       # abort() was asked (sent on once it is in a core)


class AsyncEngine:
    def __init__(self, config: EngineConfig | None = None,
                 on_dead: Callable[[str], None] | None = None,
                 sink_batch: Callable[[], AbstractContextManager] | None = None,
                 peer_address: str | None = None, **settings) -> None:
        """Starts the engine core process and waits until it has loaded the model (call from a
        thread that does not mind the wait); then use it from one event loop. `on_dead(reason)`
        is called once, from another thread, if the core process dies. `sink_batch()`, if
        given, is entered around each step's calls of the submit() sinks (e.g. Outbox.batch:
        one lock for the step's outputs, not one per request). `peer_address`: other
        engines may run requests on this one's core through it (connect_peer)."""
        self.config = config or EngineConfig(**settings)
        self._on_dead = on_dead
        self._sink_batch = sink_batch or nullcontext
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, _Stream] = {}
        self._ids_by_index: dict[int, str] = {}
        self._indices = itertools.count()
        self._peers: dict[str, PeerCoreClient] = {}
        self._outputs_lock = threading.Lock()     # reader threads: ours and the peers'
        self._dead: str | None = None
        self._stopped = False
        tokenizer = load_tokenizer(self.config)        # detokenizes, on the core reader thread
        self.tokenizer = tokenizer
        self._processor = OutputProcessor(tokenizer, stream_deltas=True)
        self.core = CoreClient(self.config, eos_token_ids(tokenizer), self._process_outputs,
                               self._core_died, peer_address)
        self.info = self.core.info
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        try:
            self._batch_tokenizer = BatchTokenizer(
                load_tokenizer(self.config), self._tokenizer_thread, self.info.max_model_len,
                self.config.tokenizer_process_priority if self.config.tokenizer_process
                else None)
            inline_max = self.config.tokenize_inline_max_chars
            self._inline_tokenizer = (BatchTokenizer(load_tokenizer(self.config), None,
                                                     self.info.max_model_len)
                                      if inline_max and tokenizer is not None else None)
            # bad_words are tokenized on the loop: by the inline tokenizer where there is one
            # (the loop's own), not by the one the reader thread detokenizes with.
            self._words_tokenizer = (self._inline_tokenizer.tokenizer
                                     if self._inline_tokenizer is not None else tokenizer)
        except BaseException:   # the core started: its threads would keep it for good
            self.shutdown()
            raise

    # ------------------------------------------------------------------ public API
    async def generate(self, prompt: Prompt, params: SamplingParams, request_id: str,
                       stream: bool = True) -> AsyncIterator[RequestOutput]:
        """Yields one output per engine step with the new text and token ids; the last has
        `finished=True`. With stream=False, yields only that last one, holding everything
        (and costs no per-step work). Leaving the loop early aborts the request. The request
        keeps its own copy of `params`: the caller may change or reuse them at once."""
        params = params.clone()
        params.tokenize_bad_words(self._words_tokenizer)
        channel = self._open(request_id)
        try:
            text, ids, packed = await self._prepare(prompt, params, channel)
            if channel.abort_requested:
                channel.finished = True
                yield RequestOutput(request_id, text, ids,
                                    [CompletionOutput(0, "", [], "abort")], True)
                return
            self._send_to_core(channel, request_id, text, ids, packed, params, stream)
            while True:
                item = await channel.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    channel.finished = True
                yield item
                if item.finished:
                    return
        finally:
            if self._streams.get(request_id) is channel:    # (a finished one is gone already)
                del self._streams[request_id]
            if not channel.finished:        # a prompt still queued for the tokenizer: dropped
                channel.abort_requested = True
            if channel.index is not None:
                self._ids_by_index.pop(channel.index, None)
                if not channel.finished and self._dead is None and not self._stopped:
                    channel.core.abort([channel.index])
                    self._processor.drop(channel.index)

    async def tokenize(self, prompt: Prompt, dropped: Callable[[], bool] = lambda: False
                       ) -> Tokenized:
        """The prompt tokenized, for `submit(..., tokenized=)`: a prompt several requests share
        (n completions) is tokenized once. Raises ValueError for a prompt this engine cannot
        take, PromptDropped if `dropped()` became true while the prompt waited for the
        tokenizer, EngineDeadError if the engine is gone."""
        try:
            return await self._tokenize(prompt, dropped)
        except TokenizerClosed as e:
            raise EngineDeadError(str(e)) from None

    async def submit(self, prompt: Prompt, params: SamplingParams, request_id: str,
                     sink: Callable[[RequestOutput | PullOutput | BaseException], None],
                     stream: bool = True, pull: bool = False,
                     tokenized: Tokenized | None = None,
                     route: Callable[[np.ndarray], str | None] | None = None) -> None:
        """`generate` without the iterator, for callers that do not want a loop wake-up per
        step: returns once the request is in the engine; then `sink` gets each step's output
        on the engine's reader thread, in order, the last with finished=True, or, if the
        engine fails or shuts down first, that error instead (once). Must not block. Raises
        ValueError / EngineDeadError (and never calls `sink`) for a request refused first.
        pull (streamed requests without stop strings): the sink gets the request's PullOutput
        handle instead, each step, and `render(handle)` gives the output of every step since
        the last render, decoded only then (engine/output_processor.py). tokenized: the
        prompt's `tokenize` (then it is not tokenized again, and this does not wait).
        route(prompt ids): the address of a connected peer core to run it on (connect_peer),
        or None for this engine's own; a peer that is gone means our own. The request keeps
        its own copy of `params`: the caller may change or reuse them once this returns."""
        params = params.clone()
        params.tokenize_bad_words(self._words_tokenizer)
        channel = self._open(request_id, sink)
        try:
            text, ids, packed = await self._prepare(prompt, params, channel, tokenized)
        except BaseException as e:
            channel.abort_requested = True      # cancelled while queued: the prompt is dropped
            if self._streams.get(request_id) is channel:
                del self._streams[request_id]
            elif isinstance(e, Exception):  # the engine failed meanwhile: _fail_all told sink
                return
            raise
        if channel.abort_requested:
            if self._streams.pop(request_id, None) is channel:     # (else told: failed)
                sink(RequestOutput(request_id, text, ids,
                                   [CompletionOutput(0, "", [], "abort")], True))
            return
        core = None
        if route is not None:
            address = route(packed)
            core = self._peers.get(address) if address is not None else None
        try:
            self._send_to_core(channel, request_id, text, ids, packed, params, stream, pull,
                               core)
        except BaseException:
            if self._streams.get(request_id) is channel:    # refused: the id is free again
                del self._streams[request_id]
            raise

    def core_key(self, request_id: str) -> tuple[int, int] | None:
        """(the core's pid, the request's index there) for a request in the engine: its key in
        the core's ENGINE_REQUEST_LOG (engine/core_process.py). None once it has ended."""
        channel = self._streams.get(request_id)
        if channel is None or channel.index is None:
            return None
        return channel.core.pid, channel.index

    def render(self, handle: PullOutput) -> RequestOutput | None:
        """A pull request's output since its last render (see submit). Any thread, one at a
        time per request."""
        return self._processor.render(handle)

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Ends the request (or each of several, as vLLM's): its stream gets a final output
        with finish_reason "abort". An id of no running request is ignored."""
        for one in [request_id] if isinstance(request_id, str) else list(request_id):
            self.abort_nowait(one)

    def abort_nowait(self, request_id: str) -> None:
        """`abort`, from any thread. Another thread's abort can land while the loop sends the
        request to its core: the flag first here, the index last in `_send_to_core` (after the
        ADD is queued), so one side or the other sends the ABORT, never before the ADD."""
        channel = self._streams.get(request_id)
        if channel is None:
            return
        channel.abort_requested = True      # still tokenizing: it will not reach the core
        index, core = channel.index, channel.core
        if index is not None:
            core.abort([index])

    async def stats(self) -> EngineStats:
        return await asyncio.wrap_future(self.core.request_stats())

    def get_stats(self) -> EngineStats:
        """Blocking; not from the event loop (use `await stats()` there)."""
        try:
            return self.core.request_stats().result(timeout=STATS_TIMEOUT_S)
        except CoreDiedError as e:
            raise EngineDeadError(str(e)) from None

    @property
    def is_alive(self) -> bool:
        return self._dead is None and not self._stopped

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    def shutdown(self) -> None:
        """Stops the core process (in-flight requests end with an error) and our threads."""
        if self._stopped:
            return
        self._stopped = True
        for peer in list(self._peers.values()):
            peer.shutdown()
        self.core.shutdown()
        # The queued prompts fail first and the tokenizer process stops: the thread's wait is
        # then for at most the batch it is tokenizing itself, not for every queued prompt.
        if hasattr(self, "_batch_tokenizer"):       # (not when its start-up failed)
            self._batch_tokenizer.close()
        self._tokenizer_thread.shutdown(wait=True)
        self._fail_all(EngineDeadError("the engine was shut down"))

    # ------------------------------------------------------------------ event loop
    def _open(self, request_id: str, sink=None) -> _Stream:
        self._check_alive()
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self._streams:
                raise RuntimeError("this AsyncEngine is serving requests on another event loop")
            self._loop = loop               # e.g. a second asyncio.run() after the first
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        channel = _Stream(sink)
        self._streams[request_id] = channel
        return channel

    async def _prepare(self, prompt: Prompt, params: SamplingParams, channel: _Stream,
                       tokenized: Tokenized | None = None) -> Tokenized:
        if tokenized is not None:
            text, ids, packed = tokenized
        else:
            try:
                text, ids, packed = await self._tokenize(prompt,
                                                         lambda: channel.abort_requested)
            except PromptDropped:               # aborted while queued: never tokenized
                prompt = unwrap_prompt(prompt)
                return (prompt if isinstance(prompt, str) else None), [], np.zeros(0, np.int64)
            except TokenizerClosed as e:         # shut down, or the core died
                raise EngineDeadError(str(e)) from None
        self._check_alive()
        check_request(packed, params, self.info.max_model_len, self.info.vocab_size)
        return text, ids, packed

    def _send_to_core(self, channel: _Stream, request_id: str, text, ids, packed,
                      params: SamplingParams, stream: bool, pull: bool = False,
                      core: CoreClient | None = None) -> None:
        index = next(self._indices) % 2**32   # the wire's u32; wraps after 4G requests
        self._processor.add_request(index, request_id, text, ids, params, stream, pull)
        self._ids_by_index[index] = request_id
        (core or self.core).add(index, packed, params)
        channel.core = core or self.core
        channel.index = index               # last: see abort_nowait
        if channel.abort_requested:         # another thread's abort, as it went in
            channel.core.abort([index])
        if core is not None and core.dead_reason is not None:   # gone as it went in
            self._fail_streams_of(core)

    async def _tokenize(self, prompt: Prompt, dropped: Callable[[], bool]) -> Tokenized:
        prompt = unwrap_prompt(prompt)
        if not isinstance(prompt, str) or self.tokenizer is None:
            _, ids = encode_prompt(self.tokenizer, prompt)    # token ids, or the error
            packed = token_array(ids)
            # An id past int64: the list itself, whose check (check_request) names the ids.
            return None, ids, ids if packed is None else packed
        if self._inline_tokenizer is not None and (
                len(prompt) <= self.config.tokenize_inline_max_chars):
            result = self._inline_tokenizer.encode_now([prompt], inline=True)[0]
            if isinstance(result, ValueError):
                try:
                    raise result
                finally:    # its traceback holds this frame: no cycle back through `result`
                    del result
            return (prompt, *result)
        return (prompt, *await self._batch_tokenizer.encode(prompt, dropped=dropped))

    @staticmethod
    def _dispatch(outputs: list[tuple[_Stream, RequestOutput]]) -> None:
        """To each output's own stream (not by id: the id may be another request's by now,
        its request aborted and the id taken again before this ran)."""
        for channel, out in outputs:
            channel.queue.put_nowait(out)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine is not running: {self._dead}")
        if self._stopped:
            raise EngineDeadError("the engine was shut down")

    def _fail_all(self, exc: BaseException) -> None:
        for request_id, channel in list(self._streams.items()):
            if channel.sink is not None and self._streams.pop(request_id, None) is channel:
                channel.sink(exc)

        def fail() -> None:
            for channel in list(self._streams.values()):
                if channel.queue is not None:
                    channel.queue.put_nowait(exc)
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(fail)
            except RuntimeError:             # closed meanwhile
                pass

    # ------------------------------------------------------------------ peers
    def connect_peer(self, address: str, timeout_s: float = 10.0) -> None:
        """Connects to another engine's core, which takes peers at `address` (blocks until it
        answers; raises OSError or RuntimeError if it does not). Requests routed there
        (submit's route) run on that core; if it goes away, they end with EngineDeadError and
        the peer is forgotten (connect again to use it again). Any thread but the loop's."""
        if address in self._peers:
            return
        holder: list[PeerCoreClient] = []
        peer = PeerCoreClient(address, self._process_outputs,
                              lambda reason: self._peer_died(holder, reason), timeout_s)
        holder.append(peer)
        if (peer.info.model_key, peer.info.max_model_len, peer.info.vocab_size) != (
                self.info.model_key, self.info.max_model_len, self.info.vocab_size):
            peer.shutdown()     # other weights or settings: routing must not change answers
            raise RuntimeError(f"the engine core at {address!r} runs another model")
        if self._stopped or peer.dead_reason is not None:
            peer.shutdown()
            return
        self._peers[address] = peer

    def peers(self) -> list[str]:
        """The addresses of the peer cores connected now."""
        return [a for a, p in list(self._peers.items()) if p.dead_reason is None]

    def _peer_died(self, holder: list[PeerCoreClient], reason: str) -> None:
        """A peer's reader thread: its connection is gone; its requests end with an error.
        `holder`: the peer, once connect_peer has it (before, it has nothing to fail)."""
        if not holder:
            return
        peer = holder[0]
        if self._peers.get(peer.address) is peer:
            del self._peers[peer.address]
        if not self._stopped:
            logger.info("lost the peer engine core %s: %s", peer.address, reason)
            self._fail_streams_of(peer)
        peer.shutdown()     # its other thread and its socket: out of _peers, shutdown() misses it

    def _fail_streams_of(self, peer: PeerCoreClient) -> None:
        error = EngineDeadError(f"the engine core of another instance failed: "
                                f"{peer.dead_reason}")
        with self._outputs_lock:
            for request_id, channel in list(self._streams.items()):
                if channel.core is peer and self._drop_stream(request_id, channel):
                    if channel.sink is not None:
                        channel.sink(error)
                    elif self._loop is not None and not self._loop.is_closed():
                        self._loop.call_soon_threadsafe(channel.queue.put_nowait, error)

    def _drop_stream(self, request_id: str, channel: _Stream) -> bool:
        """Forgets a request the engine still runs (its abort is the caller's): True if
        `channel` was still the stream of `request_id`."""
        if self._streams.pop(request_id, None) is not channel:
            return False
        self._ids_by_index.pop(channel.index, None)
        self._processor.drop(channel.index)
        return True

    # ------------------------------------------------------------------ core reader thread
    def _process_outputs(self, core_outputs: list[EngineCoreOutput]) -> None:
        """Our core's reader thread, or a peer's: one at a time."""
        with self._outputs_lock:
            self._process_outputs_locked(core_outputs)

    def _process_outputs_locked(self, core_outputs: list[EngineCoreOutput]) -> None:
        outputs, to_abort = self._processor.process(core_outputs)
        for index in to_abort:
            channel = self._streams.get(self._ids_by_index.get(index, ""))
            (channel.core if channel is not None and channel.core else self.core).abort([index])
        queued = []
        with self._sink_batch():
            for out in outputs:
                channel = self._streams.get(out.request_id)
                if channel is None:
                    continue
                if out.finished:            # the id is free for a new request at once;
                    channel.finished = True     # a RequestFailed ends its request
                    self._streams.pop(out.request_id, None)
                    self._ids_by_index.pop(channel.index, None)
                if channel.sink is None:
                    queued.append((channel, out))
                    continue
                try:
                    channel.sink(out)
                except Exception:  # noqa: BLE001 - that request's consumer, not the engine
                    logger.exception("request %s: its output sink failed; aborting it",
                                     out.request_id)
                    if not channel.finished:
                        channel.finished = True
                        self._drop_stream(out.request_id, channel)
                        (channel.core or self.core).abort([channel.index])
        if queued and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._dispatch, queued)
            except RuntimeError:             # the loop is closed: nobody is listening
                pass

    def _core_died(self, reason: str) -> None:
        if self._stopped:
            return
        self._dead = reason
        self._fail_all(EngineDeadError(f"the engine core failed: {reason}"))
        if self._on_dead is not None:
            threading.Thread(target=self._on_dead, args=(reason,), name="engine-dead",
                             daemon=True).start()
        # Prompts waiting for the tokenizer end now too, not once they are tokenized.
        self._batch_tokenizer.close(f"the engine core failed: {reason}")
