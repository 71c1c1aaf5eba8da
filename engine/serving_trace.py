"""`LLM_SERVING_TRACE=<file>` in the server's environment: every streamed request's timeline is
appended to the file, a JSON line each once its final response is out (time.monotonic()
seconds): submitted (Triton's execute), serving (the loop took it), in_engine (tokenized, sent
to the core), first_output (its first step came back), first_sent (its first tokens handed to
the server), final_output (its last step came back), final_sent (its final response handed to
the server). For finding where time to first token goes, and how long a closed-loop client
takes from one request's end to its next (scripts/ttft_trace.py reads it). Each line also names
the front end's pid (`front`) and, for a request with one completion, its core's pid and its
index there (`core`, `index`): the key of the core's ENGINE_REQUEST_LOG line
(engine/core_process.py).
"""
from __future__ import annotations

import json
import os
import threading

TRACE_ENV = "LLM_SERVING_TRACE"


class RequestTrace:
    """The trace file; the request records passed in carry the times (`rid`, `submitted`,
    `start` for serving, `in_engine`, `first_output`, `first_sent`, `final_output`,
    `final_sent`) and `core_key` ((core pid, index) or None)."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "a")
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls) -> RequestTrace | None:
        path = os.environ.get(TRACE_ENV)
        return cls(path) if path else None

    # A request's line goes out once it has both its in_engine time (the loop, after the
    # engine took it) and its final_sent time (a sender): its outputs can come back and be
    # sent before the loop gets round to noting in_engine, so whichever is last writes.
    def in_engine(self, r, now: float) -> None:
        with self._lock:
            r.in_engine = now
            if r.final_sent is not None:
                self._write(r)

    def final_sent(self, r, now: float) -> None:
        with self._lock:
            r.final_sent = now
            # A streamed request's outputs are one handle, rendered by the sender: it can send
            # the last step's tokens before the reader thread, which notes final_output, gets
            # to that step (seen once in 10,240 requests). The step came back by now.
            if r.final_output is None:
                r.final_output = now
            if r.in_engine is not None:
                self._write(r)

    def _write(self, r) -> None:
        """Under the lock."""
        if self._file is not None:
            core, index = r.core_key or (None, None)
            self._file.write(json.dumps({
                "rid": r.rid, "submitted": r.submitted, "serving": r.serving,
                "in_engine": r.in_engine, "first_output": r.first_output,
                "first_sent": r.first_sent, "final_output": r.final_output,
                "final_sent": r.final_sent, "front": os.getpid(), "core": core,
                "index": index}) + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
