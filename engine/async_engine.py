"""asyncio front end: `async for out in engine.generate(prompt, params, request_id)`.

Three threads, none of them doing heavy work on the event loop:
- the loop: per-request queues, hands out outputs;
- one tokenizer thread (HF fast tokenizers are not thread-safe): tokenizes prompts and
  detokenizes outputs, in arrival order;
- the core thread: schedule / execute / update, fed by a thread-safe inbox.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from collections.abc import AsyncIterator

from engine.config import EngineConfig
from engine.engine_core import EngineCore, EngineStats
from engine.llm import Prompt, encode_prompt, eos_token_ids, load_tokenizer
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import EngineCoreOutput

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


class _Stream:
    __slots__ = ("queue", "abort_requested", "finished")

    def __init__(self) -> None:
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.abort_requested = False
        self.finished = False


class AsyncEngine:
    def __init__(self, config: EngineConfig | None = None, **settings) -> None:
        """Builds the engine (model load, KV cache) on the calling thread; call from the thread
        that will not mind the wait, then use it from one event loop."""
        self.config = config or EngineConfig(**settings)
        self.tokenizer = load_tokenizer(self.config)
        self.core = EngineCore(self.config, eos_token_ids(self.tokenizer))
        self._processor = OutputProcessor(self.tokenizer, stream_deltas=True)
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead: BaseException | None = None
        self._stopped = False
        self._core_thread = threading.Thread(target=self._core_loop, name="engine-core",
                                             daemon=True)
        self._core_thread.start()

    # ------------------------------------------------------------------ public API
    async def generate(self, prompt: Prompt, params: SamplingParams, request_id: str,
                       stream: bool = True) -> AsyncIterator[RequestOutput]:
        """Yields one output per engine step with the new text and token ids; the last has
        `finished=True`. With stream=False, yields only that last one, holding everything
        (and costs no per-step work). Leaving the loop early aborts the request."""
        self._check_alive()
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        channel = _Stream()
        self._streams[request_id] = channel
        try:
            await self._loop.run_in_executor(self._tokenizer_thread, self._add_request,
                                             prompt, params, request_id, stream)
            if channel.abort_requested:            # abort() came while we were tokenizing
                self._inbox.put(("abort", [request_id]))
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
            self._streams.pop(request_id, None)
            if not channel.finished and not self._stopped:
                self._inbox.put(("abort", [request_id]))

    async def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.abort_requested = True
        self._inbox.put(("abort", [request_id]))

    def get_stats(self) -> EngineStats:
        return self.core.get_stats()

    @property
    def is_alive(self) -> bool:
        return self._dead is None and not self._stopped

    def shutdown(self) -> None:
        """Stops the core thread (in-flight requests end with an error) and the tokenizer."""
        if self._stopped:
            return
        self._stopped = True
        self._inbox.put(("stop", None))
        self._core_thread.join()
        self._tokenizer_thread.shutdown(wait=True)
        self._fail_all(EngineDeadError("the engine was shut down"))
        self.core.shutdown()

    # ------------------------------------------------------------------ tokenizer thread
    def _add_request(self, prompt: Prompt, params: SamplingParams, request_id: str,
                     stream: bool) -> None:
        text, ids = encode_prompt(self.tokenizer, prompt)
        req = self.core.make_request(request_id, ids, params)
        self._processor.add_request(request_id, text, req.prompt_token_ids, params, stream)
        self._inbox.put(("add", req))

    def _process_outputs(self, core_outputs: list[EngineCoreOutput]) -> None:
        outputs, to_abort = self._processor.process(core_outputs)
        if to_abort:
            self._inbox.put(("abort", to_abort))
        if outputs and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._dispatch, outputs)
            except RuntimeError:             # the loop is closed: nobody is listening
                pass

    # ------------------------------------------------------------------ event loop
    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.queue.put_nowait(out)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine has stopped: {self._dead!r}")
        if self._stopped:
            raise EngineDeadError("the engine was shut down")

    def _fail_all(self, exc: BaseException) -> None:
        def fail() -> None:
            for stream in list(self._streams.values()):
                stream.queue.put_nowait(exc)
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fail)

    # ------------------------------------------------------------------ core thread
    def _core_loop(self) -> None:
        core = self.core
        try:
            while True:
                block = not core.has_unfinished_requests()
                while True:
                    try:
                        kind, arg = self._inbox.get(block=block)
                    except queue.Empty:
                        break
                    block = False
                    if kind == "stop":
                        return
                    if kind == "add":
                        core.add_request(arg)
                    else:
                        self._submit(core.abort_requests(arg))
                if core.has_unfinished_requests():
                    self._submit(core.step())
        except BaseException as e:  # the engine is unusable: every stream must hear of it
            logger.exception("engine core died")
            self._dead = e
            self._fail_all(EngineDeadError(f"the engine core failed: {e!r}"))

    def _submit(self, outputs: list[EngineCoreOutput]) -> None:
        if outputs:
            self._tokenizer_thread.submit(self._process_outputs, outputs)
