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

With a `TokenizerProcess` the thread only hands its batches to a tokenizer process of its own
(engine/tokenizer_process.py), at a lower CPU priority, and waits on the socket without the
GIL: the serving process then spends no CPU on long prompts but the conversion of the ids of
a prompt that fits. A prompt too long comes back as its length alone. If that process dies,
the thread tokenizes from then on (logged).

A str that is not text (a lone surrogate), or one the tokenizer refuses (an error, or a panic
of the tokenizers library), fails its own request with a ValueError, not the batch call it came
in (`_encode_without_non_text`, `_encode_each_alone`, and the tokenizer process's own).

The process gets the backend's JSON and its `encode_special_tokens` (set by HF's
`split_special_tokens`, which the JSON does not carry); the probe strings it must agree on
include the tokenizer's own special and added tokens, so a setting about them that does not
reach the process sends the work back to the thread. A backend that cannot be written as JSON
(a custom Python pre-tokenizer) has no process either.

Each prompt's result is settled on its own caller's event loop (a later asyncio.run may queue
prompts while the thread still works for an earlier one).

A queued prompt whose request was aborted is dropped unread (its caller gets PromptDropped),
and `close` fails every queued prompt at once and stops the process without waiting for it:
cancelled clients and a stopping server do not wait behind prompts nobody wants.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import subprocess
import threading
from collections.abc import Callable
from concurrent.futures import Executor

import numpy as np

from engine import child_process, wire

logger = logging.getLogger(__name__)

BATCH_MAX_CHARS = 16384      # prompts longer than this are tokenized alone
_PROBES = ["Hello, world!", "  two  spaces\tand a tab\n\nnew lines", "café ☕ 日本語 🙂",
           "<s> special-looking </s> text", "a" * 300, " leading space", ""]

Encoded = tuple[list[int], np.ndarray]       # the ids as a list and as int32
RECV_BYTES = 1 << 20
STOP_WAIT_S = 5.0
STOP_NOW_S = 0.5             # close(): an idle process has exited by then
START_TIMEOUT_S = 60.0


class PromptDropped(Exception):
    """The prompt's request was aborted before it was tokenized."""


class TokenizerClosed(RuntimeError):
    """The tokenizer was closed (the engine is shutting down) before the prompt's turn."""


class BatchTokenizer:
    def __init__(self, tokenizer, executor: Executor | None, max_num_tokens: int,
                 process_priority: str | None = None) -> None:
        """`executor` must have one thread (it owns `tokenizer`); None: only `encode_now`.
        A prompt over `max_num_tokens` is an error, found here, so that its ids are never
        converted or freed on the event loop. `process_priority` (see
        engine.config.TOKENIZER_PRIORITIES): not None, the thread's batches go to a tokenizer
        process at that priority, if the tokenizer has a fast backend and the process gives
        the same ids on the probes."""
        self.tokenizer = tokenizer
        self.max_num_tokens = max_num_tokens
        self._executor = executor
        self._backend = _fast_backend(tokenizer)
        self.process: TokenizerProcess | None = None
        if process_priority is not None and self._backend is not None and executor is not None:
            probes = _PROBES + special_probes(tokenizer)
            self.process = TokenizerProcess.start(self._backend, max_num_tokens, process_priority,
                                                  probes, [tokenizer.encode(p) for p in probes])
        self._lock = threading.Lock()
        # (text, its future, whether its request was aborted meanwhile)
        self._pending: list[tuple[str, asyncio.Future, Callable[[], bool]]] = []
        self._running = False
        self._closed = False
        self._closed_reason = ""

    def encode_now(self, texts: list[str], inline: bool = False) -> list[Encoded | ValueError]:
        """Tokenizes with special tokens (e.g. BOS), like `encode`. `inline`: on the event loop,
        for short prompts: one plain call each, never the batch call, which hands the work to
        the tokenizers library's thread pool and would wait there behind a long prompt."""
        results: list[Encoded | ValueError] = []
        for ids in _encode_each_alone(self._id_lists, texts, inline):
            if isinstance(ids, ValueError):
                results.append(ids)
            elif len(ids) > self.max_num_tokens:
                results.append(self._too_long(len(ids)))
            else:
                results.append((ids, np.asarray(ids, dtype=np.int32)))
        return results

    def _id_lists(self, texts: list[str], inline: bool) -> list[list[int]]:
        if self._backend is None:
            return [self.tokenizer.encode(t) for t in texts]
        if inline:
            return [self._backend.encode(t, add_special_tokens=True).ids for t in texts]
        return [e.ids for e in self._backend.encode_batch_fast(texts, add_special_tokens=True)]

    def close(self, reason: str = "the engine was shut down") -> None:
        """Fails every queued prompt (TokenizerClosed(reason)) and stops the tokenizer process
        at once; a batch the thread is tokenizing itself ends when that call returns."""
        with self._lock:
            if not self._closed:
                self._closed, self._closed_reason = True, reason
            pending, self._pending = self._pending, []
        _settle_threadsafe([f for _, f, _ in pending],
                           [TokenizerClosed(self._closed_reason)] * len(pending))
        process = self.process
        if process is not None:
            process.close(STOP_NOW_S)    # it may be busy with a prompt nobody wants now

    def _too_long(self, num_tokens: int) -> ValueError:
        return ValueError(f"the prompt is {num_tokens} tokens long, more than max_model_len "
                          f"({self.max_num_tokens})")

    def _encode_in_process(self, texts: list[str]) -> list[Encoded | ValueError]:
        try:
            items = _encode_without_non_text(self.process.encode, texts)
        except RuntimeError as e:
            if self._closed:                 # stopped by close(): not a failure to recover from
                return [TokenizerClosed(self._closed_reason)] * len(texts)
            logger.error("the tokenizer process failed (%s): tokenizing on the tokenizer "
                         "thread from now on", e)
            self.process.close()
            self.process = None
            return self.encode_now(texts)
        results: list[Encoded | ValueError] = []
        for item in items:
            if isinstance(item, ValueError):
                results.append(item)
                continue
            status, value = item
            if status == wire.TOKENS_OK:
                results.append((value.tolist(), value))
            elif status == wire.TOKENS_TOO_LONG:
                results.append(self._too_long(value))
            else:
                results.append(ValueError(value))
        return results

    async def encode(self, text: str, dropped: Callable[[], bool] = lambda: False) -> Encoded:
        """Raises ValueError if the prompt is too long, PromptDropped if `dropped()` (any
        thread may make it true) before its turn, TokenizerClosed after close()."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:
            if self._closed:
                raise TokenizerClosed(self._closed_reason)
            self._pending.append((text, fut, dropped))
            start = not self._running
            self._running = True
        if start:
            self._executor.submit(self._drain)
        try:
            return await fut
        finally:    # its error's traceback holds this frame: no cycle back through `fut`
            del fut

    # ------------------------------------------------------------------ tokenizer thread
    def _drain(self) -> None:
        """Short prompts first, all of them in one call; then one long prompt; then look again,
        so a short prompt waits behind at most one long one, however many are queued."""
        while True:
            with self._lock:
                # One look at each flag: it may turn true meanwhile (any thread sets it).
                dropped, kept = [], []
                for p in self._pending:
                    (dropped if p[2]() else kept).append(p)
                self._pending = kept
                group = [p for p in self._pending if len(p[0]) <= BATCH_MAX_CHARS]
                if group:
                    self._pending = [p for p in self._pending if len(p[0]) > BATCH_MAX_CHARS]
                elif self._pending:
                    group = [self._pending.pop(0)]
                else:
                    self._running = False
                if self._closed:             # close() has failed the rest
                    self._running = False
                    return
            if dropped:
                _settle_threadsafe([f for _, f, _ in dropped],
                                   [PromptDropped("the request was aborted")] * len(dropped))
            if not group:
                return
            texts = [t for t, _, _ in group]
            stop = None
            try:
                results = (self._encode_in_process(texts) if self.process is not None
                           else self.encode_now(texts))
            except BaseException as e:  # noqa: BLE001 - each caller hears of it (a panic of
                results = [e] * len(group)  # the tokenizers library is a BaseException)
                stop = e if isinstance(e, (KeyboardInterrupt, SystemExit)) else None
            _settle_threadsafe([f for _, f, _ in group], results)
            if stop is not None:
                with self._lock:
                    self._running = False
                raise stop
            del results, group, texts   # a rejected prompt's ids are freed here, not on the loop


def not_text_error(text: str) -> ValueError | None:
    """The error for a str that is not text (a lone surrogate, as json.loads('"\\ud800"') makes):
    neither UTF-8 nor the tokenizers library take it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return ValueError(f"the prompt is not valid text: {e.reason} at character {e.start} "
                          f"({text[e.start:e.end]!r})")
    return None


def _encode_each_alone(encode: Callable, texts: list[str], *args) -> list:
    """encode(texts, *args); if that raises (a prompt the tokenizer refuses, or a panic of the
    tokenizers library, a BaseException), each text is encoded alone and those that fail get
    a ValueError in their place (a not-text str its not_text_error): a prompt that cannot be
    tokenized fails its own request, not the batch it came in."""
    try:
        return encode(texts, *args)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException:  # noqa: BLE001 - found text by text below
        pass
    out: list = []
    for text in texts:
        error = not_text_error(text)
        if error is None:
            try:
                out.append(encode([text], *args)[0])
                continue
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # noqa: BLE001
                error = ValueError(f"tokenization failed: {e}")
        out.append(error)
    return out


def _encode_without_non_text(encode: Callable, texts: list[str], *args) -> list:
    """encode(texts, *args); if that raises and some of the texts are not text (not_text_error),
    each of those gets its ValueError in its place and the others are encoded without them: a
    prompt that cannot be tokenized fails its own request, not the batch it came in."""
    try:
        return encode(texts, *args)
    except Exception:
        errors = [not_text_error(t) for t in texts]
        if not any(errors):
            raise
    good = iter(encode([t for t, e in zip(texts, errors) if e is None], *args)
                if not all(errors) else [])
    return [e if e is not None else next(good) for e in errors]


class TokenizerProcess:
    """The handle on a tokenizer process. One caller at a time (the tokenizer thread)."""

    def __init__(self, backend, max_num_tokens: int, priority: str) -> None:
        """Starts the process and waits until it has loaded the tokenizer; raises
        RuntimeError if it cannot."""
        try:
            tokenizer_json = backend.to_str()
        except Exception as e:  # noqa: BLE001 - e.g. "Custom PreTokenizer cannot be serialized"
            raise RuntimeError(f"the tokenizer cannot be written as JSON: {e}") from None
        self._sock, self.process = child_process.start("engine.tokenizer_process",
                                                       ["--priority", priority])
        self._reader = wire.FrameReader()
        self._frames: list[tuple[int, memoryview]] = []
        try:
            self._sock.settimeout(START_TIMEOUT_S)      # a process that never answers: OSError
            self._sock.sendall(wire.encode_load_tokenizer(
                max_num_tokens, tokenizer_json, getattr(backend, "encode_special_tokens", False)))
            kind, payload = self._recv()
            if kind != wire.TOKENIZER_READY:
                raise RuntimeError(f"the tokenizer process answered {wire.KIND_NAMES[kind]}")
            wire.decode_empty(kind, payload)
            self._sock.settimeout(None)                 # then a long prompt may take its time
        except BaseException:
            self.close()
            raise

    @classmethod
    def start(cls, backend, max_num_tokens: int, priority: str, probes: list[str],
              expected_probes: list[list[int]]) -> "TokenizerProcess | None":
        """A process whose ids on `probes` are `expected_probes`, or None (logged)."""
        try:
            proc = cls(backend, max_num_tokens, priority)
        except (OSError, RuntimeError, wire.FrameError) as e:
            logger.warning("no tokenizer process (%s): tokenizing on the tokenizer thread", e)
            return None
        try:
            # A probe over the limit comes back as its length.
            got = [v.tolist() if s == wire.TOKENS_OK else v for s, v in proc.encode(probes)]
        except RuntimeError as e:
            got = str(e)
        if got != [e if len(e) <= max_num_tokens else len(e) for e in expected_probes]:
            logger.warning("the tokenizer process disagrees with the tokenizer on probe "
                           "strings: tokenizing on the tokenizer thread")
            proc.close()
            return None
        return proc

    @property
    def pid(self) -> int:
        return self.process.pid

    def encode(self, texts: list[str]) -> list[wire.TokensItem]:
        """One item per text; raises RuntimeError if the process is gone or talks nonsense."""
        try:
            self._sock.sendall(wire.encode_tokenize(texts))
            kind, payload = self._recv()
            if kind != wire.TOKENS:
                raise RuntimeError(f"the tokenizer process answered {wire.KIND_NAMES[kind]}")
            items = wire.decode_tokens(payload)
        except wire.FrameError as e:
            raise RuntimeError(f"the tokenizer process sent a malformed frame: {e}") from None
        except OSError as e:
            raise RuntimeError(f"the tokenizer process {self.pid} is gone: {e}") from None
        if len(items) != len(texts):
            raise RuntimeError(f"the tokenizer process answered {len(items)} of {len(texts)}")
        return items

    def close(self, wait_s: float | None = None) -> None:
        """End of stream tells the process to exit (an idle one does at once); killed if it has
        not within `wait_s` (STOP_WAIT_S)."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        try:
            self.process.wait(STOP_WAIT_S if wait_s is None else wait_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def _recv(self) -> tuple[int, memoryview]:
        while not self._frames:
            data = self._sock.recv(RECV_BYTES)
            if not data:
                code = self.process.poll()
                raise RuntimeError(f"the tokenizer process {self.process.pid} exited"
                                   + (f" (code {code})" if code is not None else ""))
            self._frames.extend(self._reader.feed(data))
        kind, payload = self._frames.pop(0)
        if kind == wire.ERROR:
            raise RuntimeError(wire.decode_error(payload))
        return kind, payload


def _settle_threadsafe(futures: list[asyncio.Future], results: list) -> None:
    """Settles each future on its own loop (callers on several loops may share a batch)."""
    by_loop: dict[asyncio.AbstractEventLoop, tuple[list, list]] = {}
    for fut, result in zip(futures, results):
        pair = by_loop.setdefault(fut.get_loop(), ([], []))
        pair[0].append(fut)
        pair[1].append(result)
    for loop, (futs, res) in by_loop.items():
        try:
            loop.call_soon_threadsafe(_settle, futs, res)
        except RuntimeError:                 # that loop is closed: nobody is waiting there
            pass


def _settle(futures: list[asyncio.Future], results: list) -> None:
    for fut, result in zip(futures, results):
        if fut.done():
            continue
        if isinstance(result, BaseException):
            fut.set_exception(result)
        else:
            fut.set_result(result)


MAX_SPECIAL_PROBES = 256


def special_probes(tokenizer) -> list[str]:
    """Probe strings of the tokenizer's own special and added tokens, written into text (up to
    MAX_SPECIAL_PROBES of them): how they tokenize depends on settings (split_special_tokens)
    that a copy of the tokenizer may not carry."""
    tokens = list(getattr(tokenizer, "all_special_tokens", None) or [])
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    tokens += [str(getattr(t, "content", t)) for t in added.values()]
    tokens = list(dict.fromkeys(t for t in tokens if t))[:MAX_SPECIAL_PROBES]
    return [f"x{' x'.join(tokens)} x"] if tokens else []


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
