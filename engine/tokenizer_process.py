"""Prompt tokenization in a process of its own, at a lower CPU priority:
`python -m engine.tokenizer_process --fd N --priority idle|low|normal`.

Started by `TokenizerProcess` (engine/tokenize.py) with one end of a socket pair. It lowers its
own priority (idle: Linux SCHED_IDLE; low: niceness 10), takes the tokenizer (the Rust `tokenizers` JSON, sent in a LOAD_TOKENIZER frame:
no transformers import here), says TOKENIZER_READY, then answers each TOKENIZE frame with one
TOKENS frame. A prompt longer than the limit comes back as its length only. It exits at end
of stream (or when it finds the socket closed: after the batch it is busy with), or on a
malformed frame after an ERROR frame. It ignores SIGINT and SIGTERM and has a session of its
own: its parent stops it (engine/child_process.py).

Why a process: the serving process's event loop sends every response. Tokenizing a 300k-
character prompt there, even on another thread, takes CPU time and the GIL from it; in a
process of its own, at a lower priority, it takes only what the loop and the engine core leave.
SCHED_IDLE does that best: measured on 2 cores (benchmarks/loop_lag.md), a niceness of 10 or 19
still let it take CPU time from them, as a CPU running only SCHED_IDLE work counts as free
when the kernel places a waking task.
"""
from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

from engine import child_process, wire

logger = logging.getLogger("engine.tokenizer_process")

RECV_BYTES = 1 << 20


def tokenize(backend, texts: list[str], max_num_tokens: int) -> list[wire.TokensItem]:
    """Each text's ids; a text the tokenizer refuses (an error, or a panic of the tokenizers
    library, a BaseException) fails alone, not the batch it came in: the batch call raising,
    each text is encoded on its own."""
    try:
        encodings = backend.encode_batch_fast(texts, add_special_tokens=True)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException:  # noqa: BLE001 - the process carries on; found text by text
        encodings = []
        for text in texts:
            try:
                encodings.append(backend.encode(text, add_special_tokens=True))
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # noqa: BLE001 - that text's caller hears of it
                encodings.append(e)
    items: list[wire.TokensItem] = []
    for enc in encodings:
        if isinstance(enc, BaseException):
            items.append((wire.TOKENS_FAILED, f"tokenization failed: {enc}"))
            continue
        ids = enc.ids
        if len(ids) > max_num_tokens:
            items.append((wire.TOKENS_TOO_LONG, len(ids)))
        else:
            items.append((wire.TOKENS_OK, ids))
    return items


def set_priority(priority: str) -> None:
    if priority == "idle" and hasattr(os, "SCHED_IDLE"):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    elif priority == "idle":
        os.nice(19)                             # no SCHED_IDLE on this platform: the nearest
    elif priority == "low":
        os.nice(10)


def serve(sock: socket.socket) -> None:
    from tokenizers import Tokenizer

    reader = wire.FrameReader()
    backend, max_num_tokens = None, 0
    while True:
        data = sock.recv(RECV_BYTES)
        if not data:
            # The front end closed: at its end, or stopping mid-send (close() cuts off a batch
            # nobody wants any more). Either way it has gone, as in PEER_GONE.
            if reader.mid_frame:
                logger.info("the front end closed the connection in the middle of a frame")
            return
        for kind, payload in reader.feed(data):
            if kind == wire.LOAD_TOKENIZER and backend is None:
                max_num_tokens, tokenizer_json, special = wire.decode_load_tokenizer(payload)
                try:
                    backend = Tokenizer.from_str(tokenizer_json)
                except Exception as e:  # noqa: BLE001
                    raise wire.FrameError(f"LOAD_TOKENIZER: not a tokenizer: {e}") from None
                backend.encode_special_tokens = special     # split_special_tokens
                sock.sendall(wire.frame(wire.TOKENIZER_READY))
            elif kind == wire.TOKENIZE and backend is not None:
                texts = wire.decode_tokenize(payload)
                sock.sendall(wire.encode_tokens(tokenize(backend, texts, max_num_tokens)))
                del texts
            else:
                raise wire.FrameError(f"the tokenizer process does not take a "
                                      f"{wire.KIND_NAMES[kind]} frame here")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fd", type=int, required=True, help="socket to the front end")
    ap.add_argument("--priority", choices=("idle", "low", "normal"), default="normal")
    args = ap.parse_args(argv)
    child_process.ignore_stop_signals()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"tokenizer[{os.getpid()}] %(levelname)s %(name)s: %(message)s")
    set_priority(args.priority)
    sock = socket.socket(fileno=args.fd)
    try:
        serve(sock)
        return 0
    except child_process.PEER_GONE:
        return 0                                # the front end went away mid-batch
    except wire.FrameError as e:
        logger.error("malformed frame: %s", e)
        try:
            sock.sendall(wire.encode_error(f"the tokenizer process got a malformed frame: {e}"))
        except OSError:
            pass
        return 2
    finally:
        sock.close()


if __name__ == "__main__":
    sys.exit(main())
