"""Prompt tokenization that does not hold up the event loop.

`BatchTokenizer.encode` queues a prompt for the tokenizer thread; the thread tokenizes all the
short prompts queued in one batch call and the long ones one at a time, short ones first: under
a flood of 300k-character prompts a short prompt waits behind at most one of them.

A Hugging Face fast tokenizer drops the GIL inside its Rust `encode_batch*` calls, but building
the Python objects for a long result holds it: for a 1M-character prompt, HF's `encode` holds
the GIL for ~50 ms at the end (offsets, tokens and masks it builds and then throws away), while
`encode_batch_fast` (ids only) holds it for ~15 ms. So the backend's `encode_batch_fast` is
used when it gives exactly what `tokenizer.encode` gives (checked once on probe strings).
The batch calls run on the library's own thread pool, shared by the process: a short prompt
tokenized inline on the event loop uses the single-text call instead, so it never queues there.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import Executor

import numpy as np

logger = logging.getLogger(__name__)

BATCH_MAX_CHARS = 16384      # prompts longer than this are tokenized alone
_PROBES = ["Hello, world!", "  two  spaces\tand a tab\n\nnew lines", "café ☕ 日本語 🙂",
           "<s> special-looking </s> text", "a" * 300, " leading space", ""]

Encoded = tuple[list[int], np.ndarray]       # the ids as a list and as int32


class BatchTokenizer:
    def __init__(self, tokenizer, executor: Executor | None, max_num_tokens: int) -> None:
        """`executor` must have one thread (it owns `tokenizer`); None: only `encode_now`.
        A prompt over `max_num_tokens` is an error, found here, so that its ids are never
        converted or freed on the event loop."""
        self.tokenizer = tokenizer
        self.max_num_tokens = max_num_tokens
        self._executor = executor
        self._backend = _fast_backend(tokenizer)
        self._lock = threading.Lock()
        self._pending: list[tuple[str, asyncio.Future]] = []
        self._running = False
        self.num_batch_calls = 0

    def encode_now(self, texts: list[str], inline: bool = False) -> list[Encoded | ValueError]:
        """Tokenizes with special tokens (e.g. BOS), like `encode`. `inline`: on the event loop,
        for short prompts: one plain call each, never the batch call, which hands the work to
        the tokenizers library's thread pool and would wait there behind a long prompt."""
        self.num_batch_calls += 1
        if self._backend is None:
            lists = [self.tokenizer.encode(t) for t in texts]
        elif inline:
            lists = [self._backend.encode(t, add_special_tokens=True).ids for t in texts]
        else:
            lists = [e.ids for e in self._backend.encode_batch_fast(texts,
                                                                    add_special_tokens=True)]
        results: list[Encoded | ValueError] = []
        for ids in lists:
            if len(ids) > self.max_num_tokens:
                results.append(ValueError(
                    f"the prompt is {len(ids)} tokens long, more than max_model_len "
                    f"({self.max_num_tokens})"))
            else:
                results.append((ids, np.asarray(ids, dtype=np.int32)))
        return results

    async def encode(self, text: str) -> Encoded:
        """Raises ValueError if the prompt is too long."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:
            self._pending.append((text, fut))
            start = not self._running
            self._running = True
        if start:
            self._executor.submit(self._drain, loop)
        return await fut

    # ------------------------------------------------------------------ tokenizer thread
    def _drain(self, loop: asyncio.AbstractEventLoop) -> None:
        """Short prompts first, all of them in one call; then one long prompt; then look again,
        so a short prompt waits behind at most one long one, however many are queued."""
        while True:
            with self._lock:
                group = [p for p in self._pending if len(p[0]) <= BATCH_MAX_CHARS]
                if group:
                    self._pending = [p for p in self._pending if len(p[0]) > BATCH_MAX_CHARS]
                elif self._pending:
                    group = [self._pending.pop(0)]
                else:
                    self._running = False
                    return
            try:
                results = self.encode_now([t for t, _ in group])
            except Exception as e:  # noqa: BLE001 - each caller hears of it
                results = [e] * len(group)
            loop.call_soon_threadsafe(_settle, [f for _, f in group], results)
            del results, group          # a rejected prompt's ids are freed here, not on the loop


def _settle(futures: list[asyncio.Future], results: list) -> None:
    for fut, result in zip(futures, results):
        if fut.done():
            continue
        if isinstance(result, BaseException):
            fut.set_exception(result)
        else:
            fut.set_result(result)


def _fast_backend(tokenizer):
    """The Rust tokenizer behind an HF fast tokenizer, if its ids-only batch call agrees with
    `tokenizer.encode`; else None (then `tokenizer.encode` is used)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_batch_fast"):
        return None
    try:
        fast = [e.ids for e in backend.encode_batch_fast(_PROBES, add_special_tokens=True)]
        single = [backend.encode(p, add_special_tokens=True).ids for p in _PROBES]
    except Exception:  # noqa: BLE001 - any failure: use the plain path
        return None
    expected = [tokenizer.encode(p) for p in _PROBES]
    if fast != expected or single != expected:
        logger.info("encode_batch_fast disagrees with encode for this tokenizer: not used")
        return None
    return backend
