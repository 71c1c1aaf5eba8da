"""llm_bls's requests in flight, in plain Python (no Triton imports): how many may be in a BLS
call to `llm` at once, and a watcher that asks whether their clients cancelled them, a bounded
number per round, in turn.

Why it is built so (Triton 2.51, python_backend r24.10; measured on CPU, README "llm_bls"):

- A BLS call `exec(decoupled=True)` blocks its thread until the called model's first response
  (`InferRequest::Exec`, which releases the GIL while it waits) and returns a blocking
  `ResponseIterator` (later responses arrive in its queue from the stub's parent-to-stub
  thread; `next()` waits without the GIL). `async_exec` is the same call run by
  `loop.run_in_executor(None, ...)`: an asyncio future resolved by a thread of the loop's
  default executor (min(32, cores + 4) threads), whose result is that same blocking iterator.
  There is no awaitable and no callback: a request in a BLS call holds a thread until `llm`
  answers, which for a non-streaming request is the whole generation.
- The server holds a thread of the calling instance's pool (the Python backend's
  `thread-pool-size`, 32 unless `--backend-config=python,thread-pool-size=N`) for each BLS call
  until that first response. Calls beyond it wait for one, and so would the BLS call that
  aborts a cancelled request (3.5 s behind 40 calls of 4 s, against 1 ms with a free thread).
  So at most size - 1 requests are in a call at once; the others wait for a worker, holding
  neither a thread nor a server thread.
- `llm` answering a BLS call at once with an empty response would free the server thread (300
  calls of 2 s at once on one instance with the default 32, in 2.2 s), but the answer would then
  come as a later response, the path that hung llm_bls's stub on the H200
  (benchmarks/h200/serving_1gpu_f9d5fc3.md): not used until that is understood.
- Whether a client cancelled is known only by asking: `is_cancelled()` is a round trip to the
  server (~30 us here) made by the stub's one utility thread, in turn with its other work, and
  must not be asked once the request's final response is sent (the server frees the request).
- That utility thread also drops the stub's own reference to a finished BLS call's
  ResponseIterator (`Stub::SendCleanupId` erases it from `response_iterator_map_`), without
  the GIL. If that is the last reference, the iterator's responses and their numpy arrays are
  freed there, racing the interpreter: llm_bls's stub died in pymalloc after some thousands of
  requests at 256 at once (core: `pymalloc_alloc` under `InferRequest::Exec` ->
  `PbTensor::LoadFromSharedMemory`). So Python must hold a finished call's iterator until an
  ask queued after its clean-up has returned: `finish` asks once more (a request not known
  cancelled is asked for real: Triton caches only True), and what it could not ask for waits
  for a later ask (`keep_until_next_ask`).
"""
from __future__ import annotations

import logging
import threading
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.config import PYTHON_BACKEND_PARAMETERS
from engine.protocol import BLS_REQUEST_ID_PREFIX

logger = logging.getLogger(__name__)

DEFAULT_THREAD_POOL_SIZE = 32   # the Python backend's, without --backend-config
CANCEL_CHECKS_PER_ROUND = 64    # as engine/serving.py: at most 640 round trips a second
CANCEL_ROUND_S = 0.1


@dataclass(frozen=True)
class BlsSettings:
    """llm_bls's `parameters`: `max_concurrency` (requests in a BLS call at once on an
    instance) and `llm_model` (the decoupled model it calls: a repository serving two models
    names each llm_bls's own)."""
    max_concurrency: int = 256
    llm_model: str = "llm"

    @classmethod
    def from_parameters(cls, parameters: dict, own_name: str) -> BlsSettings:
        """From the config's `parameters` (an empty value keeps a default); any other key but
        the Python backend's own is an error naming it."""
        values = {k: v.get("string_value", "").strip() for k, v in parameters.items()}
        unknown = sorted(set(values) - {"max_concurrency", "llm_model",
                                        *PYTHON_BACKEND_PARAMETERS})
        if unknown:
            raise ValueError(f"unknown llm_bls parameter(s) {unknown}; its parameters are "
                             f"max_concurrency (requests in the llm model at once on an "
                             f"instance) and llm_model (the decoupled model it calls)")
        text = values.get("max_concurrency") or str(cls.max_concurrency)
        try:
            max_concurrency = int(text)
        except ValueError:
            max_concurrency = 0
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be an integer >= 1, got {text!r}")
        llm_model = values.get("llm_model") or cls.llm_model
        if llm_model == own_name:
            raise ValueError(f"llm_model must name the decoupled model that llm_bls calls, "
                             f"not llm_bls itself ({own_name!r})")
        return cls(max_concurrency, llm_model)


def python_backend_thread_pool_size(argv: Sequence[str]) -> int:
    """The Python backend's `thread-pool-size` in a tritonserver command line: the last
    `--backend-config=python,thread-pool-size=N` (`=` or a separate argument; the server
    takes the last one too), else the last one for every backend
    (`--backend-config=thread-pool-size=N`: a backend's own setting wins over it, wherever
    it stands), else the backend's default."""
    sizes: dict[str, int] = {}          # "python" / "" (every backend's): the last of each
    args = iter(argv)
    for arg in args:
        if arg == "--backend-config":
            value = next(args, "")
        elif arg.startswith("--backend-config="):
            value = arg.split("=", 1)[1]
        else:
            continue
        backend, _, setting = value.partition(",") if "," in value else ("", "", value)
        key, _, number = setting.partition("=")
        if backend in ("", "python") and key == "thread-pool-size" and number.isdigit():
            sizes[backend] = int(number)
    return sizes.get("python", sizes.get("", DEFAULT_THREAD_POOL_SIZE))


@dataclass(eq=False)
class BlsCall:
    """One llm_bls request, from execute() to its final response."""
    is_cancelled: Callable[[], bool]
    payload: Any = None             # the adapter's (its response sender)
    inner_id: str = field(default_factory=lambda: f"{BLS_REQUEST_ID_PREFIX}{uuid.uuid4().hex}")
    lock: threading.Lock = field(default_factory=threading.Lock)
    started: bool = False           # its BLS call to llm may be under way: a cancel aborts it
    cancelled: bool = False         # its client cancelled it (seen by the watcher)
    done: bool = False              # its final response is sent or about to be: never asked again


class BlsCalls:
    """The requests in flight. A watcher thread asks up to `checks_per_round` of them, in turn,
    every `round_s`, whether they were cancelled, and calls `on_cancel(call, started)` once for
    each that was: `started` False means it never reached llm and is answered by whoever
    handles that (after `finish`); True, that its BLS call must be aborted (it is answered
    when that returns). `round_s=None` starts no thread (tests call `check_round`).

    A call's `is_cancelled` is asked under the call's own lock only, which its start and
    finish take: nothing else waits on a round trip, and none is made once it is finished.
    Every ask is numbered; objects kept "until the next ask" are dropped once an ask numbered
    after them has returned."""

    def __init__(self, on_cancel: Callable[[BlsCall, bool], None],
                 checks_per_round: int = CANCEL_CHECKS_PER_ROUND,
                 round_s: float | None = CANCEL_ROUND_S) -> None:
        self._on_cancel = on_cancel
        self._checks_per_round = checks_per_round
        self._calls: dict[str, BlsCall] = {}
        self._lock = threading.Lock()       # guards _calls, _kept, _num_asks; nothing else
        self._kept: deque[tuple[int, Any]] = deque()     # (number of the next ask, object)
        self._num_asks = 0
        self._cursor = 0
        self._stop = threading.Event()
        self._thread = None
        if round_s is not None:
            self._thread = threading.Thread(target=self._watch, args=(round_s,),
                                            name="llm_bls-cancel", daemon=True)
            self._thread.start()

    def __len__(self) -> int:
        return len(self._calls)

    def add(self, is_cancelled: Callable[[], bool], payload: Any = None) -> BlsCall:
        call = BlsCall(is_cancelled, payload)
        with self._lock:
            self._calls[call.inner_id] = call
        return call

    def start(self, call: BlsCall) -> bool:
        """Before the call's BLS call to llm. False if it was cancelled (or finished) while it
        waited: it must then not be started, and on_cancel has it or will have it."""
        with call.lock:
            if call.cancelled or call.done:
                return False
            call.started = True
            return True

    def finish(self, call: BlsCall, keep: Any = None) -> bool:
        """Before the call's final response is sent: asks once more whether its client
        cancelled it (unless known), and never again; returns whether it was. `keep` is held
        until that ask, or, when none could be made, a later one, has returned."""
        with call.lock:
            asked = not call.done and not call.cancelled and self._ask(call)
            call.done = True
            cancelled = call.cancelled
        with self._lock:
            self._calls.pop(call.inner_id, None)
        if not asked and keep is not None:
            self.keep_until_next_ask(keep)
        return cancelled

    def keep_until_next_ask(self, obj: Any) -> None:
        """Holds `obj` until an ask that begins after this call has returned."""
        with self._lock:
            self._kept.append((self._num_asks, obj))

    def num_kept(self) -> int:
        return len(self._kept)

    def check_round(self) -> None:
        """Asks up to `checks_per_round` calls, those after the last round's first."""
        with self._lock:
            calls = list(self._calls.values())
        if not calls:
            self._cursor = 0
            return
        first = self._cursor % len(calls)
        batch = (calls[first:] + calls[:first])[:self._checks_per_round]
        self._cursor = first + len(batch)
        for call in batch:
            with call.lock:
                if call.done or call.cancelled or not self._ask(call) or not call.cancelled:
                    continue            # finished, told already, the ask failed, or not cancelled
                started = call.started
            try:
                self._on_cancel(call, started)
            except Exception:  # noqa: BLE001
                logger.exception("llm_bls: passing on the cancellation of %s", call.inner_id)

    def _ask(self, call: BlsCall) -> bool:
        """Asks `call` (under its lock; not done, not known cancelled) and records the answer;
        False if the ask failed. Then drops what was kept before this ask began."""
        with self._lock:
            number = self._num_asks
            self._num_asks += 1
        try:
            call.cancelled = bool(call.is_cancelled())
        except Exception:  # noqa: BLE001 - one broken ask must not stop the others
            logger.exception("llm_bls: cancellation check of %s", call.inner_id)
            return False
        released = []
        with self._lock:
            while self._kept and self._kept[0][0] <= number:
                released.append(self._kept.popleft()[1])
        del released                        # dropped here, outside the lock
        return True

    def close(self) -> None:
        """Stops the watcher; on_cancel is not called once this returns. Drops what it kept:
        at the model's finalize every request has its answer, and Triton's objects must go
        while the stub still runs (llm_bls's finalize)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            kept, self._kept = self._kept, deque()
            self._calls.clear()
        del kept                            # dropped here, outside the lock

    def _watch(self, round_s: float) -> None:
        while not self._stop.wait(round_s):
            self.check_round()
