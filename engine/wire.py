"""The binary messages between the front end, the engine core process and the model runner.

No pickle: every message is a frame of packed little-endian fields and numpy arrays, so a
running request costs a few bytes per step, not a pickled dataclass.

    frame   = header payload
    header  = magic u8 (0xE7) | version u8 | kind u8 | payload_len u32       (7 bytes)

Kinds and payloads (u32 unless said; arrays are packed, no padding):

  front end -> core
    ADD        index, params record, n, token_ids i32[n]            (a request, once)
    ABORT      n, indices[n]
    STATS_REQ  (empty)                                               (answered by STATS)
    SHUTDOWN   (empty)
  core -> front end
    READY      max_model_len, vocab_size, num_kv_blocks, block_size, n, eos_ids i32[n],
               m, the model's key (engine.config.model_key) as utf-8 [m bytes]
    OUTPUTS    one step: n_rows, flags u8, [indices[n_rows] if ROWS], tokens i32[n_rows],
               [n, rows[n], codes u8[n] if FINISHED], [n, indices[n] if ABORTED],
               [n, rows[n], ranks i32[n], counts u8[n], ids i32[sum], logprobs f32[sum]
                if LOGPROBS], [n, rows[n], cached prompt tokens[n] if CACHED: rows whose
                first token this is]
               Without ROWS the rows are the previous frame's: steady-state decode costs
               4 bytes (the token) per running request.
    STATS      EngineStats fields as i64
    ERROR      utf-8 message
  front end -> tokenizer process (engine/tokenizer_process.py)
    LOAD_TOKENIZER  max_num_tokens, encode_special_tokens u8 (0/1: a setting the JSON does
                    not carry), the Rust tokenizer's JSON as utf-8  (answered by
                    TOKENIZER_READY, empty, or ERROR)
    TOKENIZE   n, byte lengths[n], utf-8 texts (concatenated)
  tokenizer process -> front end
    TOKENS     n, then per text: status u8, count, and for status TOKENS_OK ids i32[count],
               for TOKENS_TOO_LONG nothing (count is the prompt's length in tokens),
               for TOKENS_FAILED a utf-8 message of count bytes
  core -> model runner (the tensor-parallel worker boundary)
    SCHED      n_rows, total_tokens, indices[n_rows], num_tokens[n_rows],
               n_new, new requests (index, num_prompt_tokens, num_computed_tokens, params
               record, n, token_ids i32[n], m, block_ids[m]),
               n, indices[n], counts[n], block_ids[sum]       (blocks new this step),
               n, finished indices[n]

Every decoder checks sizes and values and raises `FrameError` (a ValueError) naming what is
wrong; it never reads past its buffer or allocates more than the frame holds.
"""
from __future__ import annotations

import dataclasses
import struct
import numpy as np

from engine.outputs import EngineStats
from engine.sampling_params import MAX_LOGPROBS, SamplingParams
from engine.scheduler import CachedRequestData, EngineCoreOutput, NewRequestData, SchedulerOutput

MAGIC = 0xE7
VERSION = 1
HEADER = struct.Struct("<BBBI")
MAX_PAYLOAD_BYTES = 1 << 30

(ADD, ABORT, STATS_REQ, SHUTDOWN, READY, OUTPUTS, STATS, ERROR, SCHED, LOAD_TOKENIZER,
 TOKENIZER_READY, TOKENIZE, TOKENS) = range(1, 14)
KIND_NAMES = {ADD: "ADD", ABORT: "ABORT", STATS_REQ: "STATS_REQ", SHUTDOWN: "SHUTDOWN",
              READY: "READY", OUTPUTS: "OUTPUTS", STATS: "STATS", ERROR: "ERROR",
              SCHED: "SCHED", LOAD_TOKENIZER: "LOAD_TOKENIZER",
              TOKENIZER_READY: "TOKENIZER_READY", TOKENIZE: "TOKENIZE", TOKENS: "TOKENS"}

# OUTPUTS flags
ROWS, FINISHED, ABORTED, LOGPROBS, CACHED = 1, 2, 4, 8, 16
# TOKENS statuses
TOKENS_OK, TOKENS_TOO_LONG, TOKENS_FAILED = 0, 1, 2
# finish codes
FINISH_EOS, FINISH_STOP_TOKEN, FINISH_LENGTH = 1, 2, 3

_U32 = struct.Struct("<I")
_PARAMS = struct.Struct("<IIddidqdddhBI")   # see _pack_params
_READY = struct.Struct("<IIIII")
_OUT_HEAD = struct.Struct("<IB")
_SCHED_HEAD = struct.Struct("<II")
_NEW_HEAD = struct.Struct("<III")
_STATS_FIELDS = [f.name for f in dataclasses.fields(EngineStats)]
_STATS = struct.Struct("<" + "q" * len(_STATS_FIELDS))
_TOKENS_ITEM = struct.Struct("<BI")
_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1


class FrameError(ValueError):
    """A frame that does not follow this format: the connection cannot be trusted."""


# ---------------------------------------------------------------------------- framing
def frame(kind: int, payload: bytes = b"") -> bytes:
    return HEADER.pack(MAGIC, VERSION, kind, len(payload)) + payload


def parse_header(header: bytes) -> tuple[int, int]:
    """Returns (kind, payload_len) or raises FrameError."""
    if len(header) != HEADER.size:
        raise FrameError(f"truncated frame header: {len(header)} of {HEADER.size} bytes")
    magic, version, kind, n = HEADER.unpack(header)
    if magic != MAGIC:
        raise FrameError(f"bad frame magic 0x{magic:02x} (expected 0x{MAGIC:02x})")
    if version != VERSION:
        raise FrameError(f"unsupported frame version {version} (this side speaks {VERSION})")
    if kind not in KIND_NAMES:
        raise FrameError(f"unknown frame kind {kind}")
    if n > MAX_PAYLOAD_BYTES:
        raise FrameError(f"frame payload of {n} bytes exceeds the {MAX_PAYLOAD_BYTES} limit")
    return kind, n


def split_frame(data: bytes) -> tuple[int, memoryview]:
    """One whole frame -> (kind, payload). Trailing or missing bytes are errors."""
    kind, n = parse_header(bytes(data[:HEADER.size]))
    if len(data) != HEADER.size + n:
        raise FrameError(f"{KIND_NAMES[kind]} frame is {len(data) - HEADER.size} payload bytes,"
                         f" its header says {n}")
    return kind, memoryview(data)[HEADER.size:]


class FrameReader:
    """Cuts a byte stream into frames: `feed` bytes as they arrive, get whole frames back."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._need: tuple[int, int] | None = None     # header of the frame being read

    @property
    def mid_frame(self) -> bool:
        return bool(self._buf) or self._need is not None

    def feed(self, data: bytes) -> list[tuple[int, memoryview]]:
        """Takes the bytes now; returns the frames they complete (maybe none)."""
        self._buf += data
        frames = []
        while True:
            if self._need is None:
                if len(self._buf) < HEADER.size:
                    return frames
                self._need = parse_header(bytes(self._buf[:HEADER.size]))
                del self._buf[:HEADER.size]
            kind, n = self._need
            if len(self._buf) < n:
                return frames
            payload = bytes(self._buf[:n])
            del self._buf[:n]
            self._need = None
            frames.append((kind, memoryview(payload)))

    def eof(self) -> None:
        """The stream ended: a partial frame is an error."""
        if self.mid_frame:
            raise FrameError("the stream ended in the middle of a frame")


class _Cursor:
    """Reads fields off a payload, with bounds checks."""

    def __init__(self, payload: memoryview, what: str) -> None:
        self.buf = payload
        self.pos = 0
        self.what = what

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise FrameError(f"{self.what}: truncated (needs {n} bytes at offset {self.pos}, "
                             f"has {len(self.buf) - self.pos})")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def unpack(self, st: struct.Struct) -> tuple:
        return st.unpack(self.take(st.size))

    def u32(self) -> int:
        return _U32.unpack(self.take(4))[0]

    def array(self, dtype: str, n: int) -> np.ndarray:
        dt = np.dtype(dtype)
        return np.frombuffer(self.take(n * dt.itemsize), dtype=dt)

    def count(self, per_item_bytes: int) -> int:
        """A length prefix, checked against what is left so a bad one cannot allocate."""
        n = self.u32()
        if n * per_item_bytes > len(self.buf) - self.pos:
            raise FrameError(f"{self.what}: count {n} does not fit in the "
                             f"{len(self.buf) - self.pos} bytes left")
        return n

    def done(self) -> None:
        if self.pos != len(self.buf):
            raise FrameError(f"{self.what}: {len(self.buf) - self.pos} unexpected trailing bytes")


def _rows_in(rows: np.ndarray, n: int, what: str) -> None:
    if rows.size and int(rows.max()) >= n:
        raise FrameError(f"{what}: row {int(rows.max())} out of range for {n} rows")


def _u32s(values, what: str) -> bytes:
    arr = np.asarray(values, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() > 2**32 - 1):
        raise ValueError(f"{what} must fit in uint32")
    return arr.astype("<u4").tobytes()


def _text(value: str, what: str) -> bytes:
    """A length-prefixed utf-8 string."""
    data = value.encode("utf-8")
    return _u32(len(data), what) + data


def _u32(value: int, what: str) -> bytes:
    if not 0 <= value <= 2**32 - 1:
        raise ValueError(f"{what} must fit in uint32, got {value}")
    return _U32.pack(value)


def _ids(values) -> bytes:
    arr = np.asarray(values, dtype=np.int64)
    if arr.size and (arr.min() < _I32_MIN or arr.max() > _I32_MAX):
        raise ValueError("token ids must fit in int32")
    return arr.astype("<i4").tobytes()


# ---------------------------------------------------------------------------- sampling params
def _pack_params(p: SamplingParams) -> bytes:
    """The fields the core uses; stop strings, detokenization options stay in the front end."""
    flags = ((1 if p.seed is not None else 0) | (2 if p.ignore_eos else 0)
             | (4 if p.logit_bias is not None else 0) | (8 if p.allowed_token_ids is not None else 0)
             | (16 if p.bad_words_token_ids is not None else 0))
    # Beyond 2**32 - 1 tokens a limit is no limit: max_model_len ends a request first.
    max_tokens = 2**32 - 1 if p.max_tokens is None else min(p.max_tokens, 2**32 - 1)
    return _PARAMS.pack(max_tokens, min(p.min_tokens, max_tokens), p.temperature, p.top_p,
                        min(p.top_k, _I32_MAX),
                        p.min_p, p.seed or 0, p.repetition_penalty, p.presence_penalty,
                        p.frequency_penalty, -1 if p.logprobs is None else p.logprobs, flags,
                        len(p.stop_token_ids)) + _ids(p.stop_token_ids) + _token_controls(p)


def _token_controls(p: SamplingParams) -> bytes:
    """logit_bias (ids, then float64 biases), allowed_token_ids and bad_words_token_ids (the
    words' lengths, then their ids), each count-prefixed."""
    bias = p.logit_bias or {}
    allowed = p.allowed_token_ids or []
    words = p.bad_words_token_ids or []
    return (_U32.pack(len(bias)) + _ids(list(bias)) + np.asarray(list(bias.values()), "<f8").tobytes()
            + _U32.pack(len(allowed)) + _ids(allowed)
            + _U32.pack(len(words)) + _u32s([len(w) for w in words], "bad word lengths")
            + _ids([t for w in words for t in w]))


def _unpack_params(cur: _Cursor) -> SamplingParams:
    (max_tokens, min_tokens, temperature, top_p, top_k, min_p, seed, rep, pres, freq,
     logprobs, flags, n_stop) = cur.unpack(_PARAMS)
    if n_stop * 4 > len(cur.buf) - cur.pos:
        raise FrameError(f"{cur.what}: {n_stop} stop token ids do not fit in the frame")
    stop_ids = cur.array("<i4", n_stop).tolist()
    n_bias = cur.count(12)
    bias = dict(zip(cur.array("<i4", n_bias).tolist(), cur.array("<f8", n_bias).tolist()))
    allowed = cur.array("<i4", cur.count(4)).tolist()
    lengths = cur.array("<u4", cur.count(4)).tolist()
    if sum(lengths) * 4 > len(cur.buf) - cur.pos:
        raise FrameError(f"{cur.what}: bad words of {sum(lengths)} ids do not fit in the frame")
    flat = cur.array("<i4", sum(lengths)).tolist()
    starts = np.cumsum([0] + lengths).tolist()
    words = [flat[a:b] for a, b in zip(starts, starts[1:])]
    if flags & ~31:
        raise FrameError(f"{cur.what}: unknown sampling flags 0x{flags:02x}")
    if not -1 <= logprobs <= MAX_LOGPROBS:
        raise FrameError(f"{cur.what}: logprobs {logprobs} out of range")
    try:
        return SamplingParams(
            max_tokens=max_tokens, min_tokens=min_tokens, temperature=temperature,
            top_p=top_p, top_k=top_k, min_p=min_p, seed=seed if flags & 1 else None,
            stop_token_ids=stop_ids, ignore_eos=bool(flags & 2), repetition_penalty=rep,
            presence_penalty=pres, frequency_penalty=freq,
            logprobs=None if logprobs < 0 else logprobs,
            logit_bias=bias if flags & 4 else None, allowed_token_ids=allowed if flags & 8 else None,
            bad_words_token_ids=words if flags & 16 else None)
    except ValueError as e:
        raise FrameError(f"{cur.what}: bad sampling parameters: {e}") from None


# ---------------------------------------------------------------------------- front end -> core
def encode_add(index: int, token_ids, params: SamplingParams) -> bytes:
    ids = _ids(token_ids)
    return frame(ADD, _u32(index, "request index") + _pack_params(params)
                 + _U32.pack(len(ids) // 4) + ids)


def decode_add(payload: memoryview) -> tuple[int, list[int], SamplingParams]:
    cur = _Cursor(payload, "ADD")
    index = cur.u32()
    params = _unpack_params(cur)
    ids = cur.array("<i4", cur.count(4)).tolist()
    cur.done()
    return index, ids, params


def encode_abort(indices) -> bytes:
    data = _u32s(indices, "request indices")
    return frame(ABORT, _U32.pack(len(data) // 4) + data)


def decode_abort(payload: memoryview) -> list[int]:
    cur = _Cursor(payload, "ABORT")
    out = cur.array("<u4", cur.count(4)).tolist()
    cur.done()
    return out


def decode_empty(kind: int, payload: memoryview) -> None:
    if len(payload):
        raise FrameError(f"{KIND_NAMES[kind]}: expected no payload, got {len(payload)} bytes")


# ---------------------------------------------------------------------------- core -> front end
@dataclasses.dataclass
class CoreInfo:
    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int
    eos_token_ids: list[int]
    model_key: str = ""         # engines of one key give the same answers (prefix routing)


def encode_ready(info: CoreInfo) -> bytes:
    return frame(READY, _READY.pack(info.max_model_len, info.vocab_size, info.num_kv_blocks,
                                    info.block_size, len(info.eos_token_ids))
                 + _ids(info.eos_token_ids) + _text(info.model_key, "model_key"))


def decode_ready(payload: memoryview) -> CoreInfo:
    cur = _Cursor(payload, "READY")
    max_len, vocab, blocks, block_size, n = cur.unpack(_READY)
    if n * 4 > len(cur.buf) - cur.pos:
        raise FrameError(f"READY: {n} eos ids do not fit in the frame")
    eos = cur.array("<i4", n).tolist()
    key = _utf8(cur.take(cur.count(1)), "READY model key")
    cur.done()
    return CoreInfo(max_len, vocab, blocks, block_size, eos, key)


def encode_stats(stats: EngineStats) -> bytes:
    return frame(STATS, _STATS.pack(*(getattr(stats, f) for f in _STATS_FIELDS)))


def decode_stats(payload: memoryview) -> EngineStats:
    cur = _Cursor(payload, "STATS")
    values = cur.unpack(_STATS)
    cur.done()
    return EngineStats(*values)


def encode_error(message: str) -> bytes:
    return frame(ERROR, message.encode("utf-8", errors="replace"))


def decode_error(payload: memoryview) -> str:
    return bytes(payload).decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------- tokenizer process
def encode_load_tokenizer(max_num_tokens: int, tokenizer_json: str,
                          encode_special_tokens: bool = False) -> bytes:
    return frame(LOAD_TOKENIZER, _u32(max_num_tokens, "max_num_tokens")
                 + bytes([bool(encode_special_tokens)]) + tokenizer_json.encode("utf-8"))


def decode_load_tokenizer(payload: memoryview) -> tuple[int, str, bool]:
    """(max_num_tokens, the tokenizer's JSON, encode_special_tokens)"""
    cur = _Cursor(payload, "LOAD_TOKENIZER")
    max_num_tokens = cur.u32()
    flag = cur.take(1)[0]
    if flag > 1:
        raise FrameError(f"LOAD_TOKENIZER: encode_special_tokens is {flag}, not 0 or 1")
    return (max_num_tokens, _utf8(cur.take(len(payload) - cur.pos), "LOAD_TOKENIZER json"),
            bool(flag))


def encode_tokenize(texts: list[str]) -> bytes:
    data = [t.encode("utf-8") for t in texts]
    return frame(TOKENIZE, _U32.pack(len(data)) + _u32s([len(d) for d in data], "text lengths")
                 + b"".join(data))


def decode_tokenize(payload: memoryview) -> list[str]:
    cur = _Cursor(payload, "TOKENIZE")
    lengths = cur.array("<u4", cur.count(4)).astype(np.int64)
    if int(lengths.sum()) != len(payload) - cur.pos:
        raise FrameError(f"TOKENIZE: text lengths add up to {int(lengths.sum())} bytes, the "
                         f"frame holds {len(payload) - cur.pos}")
    return [_utf8(cur.take(int(n)), "TOKENIZE text") for n in lengths]


TokensItem = tuple[int, "np.ndarray | int | str"]    # (status, ids / length / message)


def encode_tokens(items: list[TokensItem]) -> bytes:
    parts = [_U32.pack(len(items))]
    for status, value in items:
        if status == TOKENS_OK:
            ids = _ids(value)
            parts += [_TOKENS_ITEM.pack(status, len(ids) // 4), ids]
        elif status == TOKENS_TOO_LONG:
            parts += [bytes([status]), _u32(value, "token count")]
        elif status == TOKENS_FAILED:
            message = value.encode("utf-8", errors="replace")
            parts += [_TOKENS_ITEM.pack(status, len(message)), message]
        else:
            raise ValueError(f"unknown TOKENS status {status}")
    return frame(TOKENS, b"".join(parts))


def decode_tokens(payload: memoryview) -> list[TokensItem]:
    """TOKENS_OK items hold int32 arrays (copies, not views of `payload`)."""
    cur = _Cursor(payload, "TOKENS")
    items: list[TokensItem] = []
    for _ in range(cur.count(_TOKENS_ITEM.size)):
        status, n = cur.unpack(_TOKENS_ITEM)
        if status == TOKENS_OK:
            if n * 4 > len(cur.buf) - cur.pos:
                raise FrameError(f"TOKENS: {n} ids do not fit in the frame")
            items.append((status, cur.array("<i4", n).astype(np.int32)))
        elif status == TOKENS_TOO_LONG:
            items.append((status, n))
        elif status == TOKENS_FAILED:
            items.append((status, bytes(cur.take(n)).decode("utf-8", errors="replace")))
        else:
            raise FrameError(f"TOKENS: unknown status {status}")
    cur.done()
    return items


def _utf8(data: memoryview, what: str) -> str:
    try:
        return bytes(data).decode("utf-8")
    except UnicodeDecodeError as e:
        raise FrameError(f"{what}: invalid utf-8 at byte {e.start}") from None


class OutputsEncoder:
    """Packs one step's EngineCoreOutputs (request ids are the core's integer indices)."""

    def __init__(self) -> None:
        self._last_rows: list[int] | None = None

    def encode(self, outputs: list[EngineCoreOutput]) -> bytes:
        rows = [o for o in outputs if o.new_token_ids]
        aborted = [o.request_id for o in outputs if not o.new_token_ids]
        indices = [o.request_id for o in rows]
        flags = 0
        parts = []
        rows_changed = indices != self._last_rows
        if rows_changed:
            flags |= ROWS
            parts.append(_u32s(indices, "request indices"))
        parts.append(_ids([o.new_token_ids[0] for o in rows]))
        finished = [(i, o) for i, o in enumerate(rows) if o.finish_reason is not None]
        if finished:
            flags |= FINISHED
            parts.append(_U32.pack(len(finished)))
            parts.append(np.asarray([i for i, _ in finished], dtype="<u4").tobytes())
            parts.append(bytes(_finish_code(o) for _, o in finished))
        if aborted:
            flags |= ABORTED
            parts.append(_U32.pack(len(aborted)) + _u32s(aborted, "request indices"))
        with_lp = [(i, o.new_logprobs[0]) for i, o in enumerate(rows) if o.new_logprobs]
        if with_lp:
            flags |= LOGPROBS
            parts.append(_U32.pack(len(with_lp)))
            parts.append(np.asarray([i for i, _ in with_lp], dtype="<u4").tobytes())
            parts.append(np.asarray([lp[2] for _, lp in with_lp], dtype="<i4").tobytes())
            parts.append(bytes(len(lp[0]) for _, lp in with_lp))
            parts.append(_ids([t for _, lp in with_lp for t in lp[0]]))
            parts.append(np.asarray([v for _, lp in with_lp for v in lp[1]],
                                    dtype="<f4").tobytes())
        first = [(i, o.num_cached_tokens) for i, o in enumerate(rows)
                 if o.num_cached_tokens is not None]
        if first:
            flags |= CACHED
            parts.append(_U32.pack(len(first)))
            parts.append(np.asarray([i for i, _ in first], dtype="<u4").tobytes())
            parts.append(_u32s([c for _, c in first], "cached prompt tokens"))
        data = frame(OUTPUTS, _OUT_HEAD.pack(len(rows), flags) + b"".join(parts))
        if rows_changed:                    # only once the frame exists: the peer gets them
            self._last_rows = indices
        return data


def _finish_code(o: EngineCoreOutput) -> int:
    if o.finish_reason == "length":
        return FINISH_LENGTH
    return FINISH_EOS if o.stop_reason is None else FINISH_STOP_TOKEN


class OutputsDecoder:
    """Unpacks OUTPUTS frames into EngineCoreOutputs; keeps the rows of the last frame."""

    def __init__(self) -> None:
        self._last_rows: np.ndarray | None = None

    def decode(self, payload: memoryview) -> list[EngineCoreOutput]:
        cur = _Cursor(payload, "OUTPUTS")
        n, flags = cur.unpack(_OUT_HEAD)
        if flags & ~(ROWS | FINISHED | ABORTED | LOGPROBS | CACHED):
            raise FrameError(f"OUTPUTS: unknown flags 0x{flags:02x}")
        if n * 4 > len(cur.buf) - cur.pos:
            raise FrameError(f"OUTPUTS: {n} rows do not fit in the frame")
        if flags & ROWS:
            rows = cur.array("<u4", n).copy()      # kept for the next frame: not a view
        elif self._last_rows is not None and len(self._last_rows) == n:
            rows = self._last_rows
        else:
            raise FrameError(f"OUTPUTS: {n} rows given as 'same as before', but the last frame "
                             f"had {0 if self._last_rows is None else len(self._last_rows)}")
        tokens = cur.array("<i4", n).tolist()
        reasons: dict[int, tuple[str, int | None]] = {}
        if flags & FINISHED:
            m = cur.count(5)
            fin_rows = cur.array("<u4", m)
            codes = cur.array("u1", m)
            _rows_in(fin_rows, n, "OUTPUTS finished")
            for r, c in zip(fin_rows.tolist(), codes.tolist()):
                if c == FINISH_EOS:
                    reasons[r] = ("stop", None)
                elif c == FINISH_STOP_TOKEN:
                    reasons[r] = ("stop", tokens[r])
                elif c == FINISH_LENGTH:
                    reasons[r] = ("length", None)
                else:
                    raise FrameError(f"OUTPUTS: unknown finish code {c}")
        aborted: list[int] = []
        if flags & ABORTED:
            aborted = cur.array("<u4", cur.count(4)).tolist()
        logprobs: dict[int, tuple[list[int], list[float], int]] = {}
        if flags & LOGPROBS:
            m = cur.count(9)
            lp_rows = cur.array("<u4", m)
            ranks = cur.array("<i4", m).tolist()
            counts = cur.array("u1", m)
            _rows_in(lp_rows, n, "OUTPUTS logprobs")
            total = int(counts.sum())
            ids = cur.array("<i4", total).tolist()
            values = cur.array("<f4", total).tolist()
            start = 0
            for r, rank, c in zip(lp_rows.tolist(), ranks, counts.tolist()):
                logprobs[r] = (ids[start:start + c], values[start:start + c], rank)
                start += c
        cached: dict[int, int] = {}
        if flags & CACHED:
            m = cur.count(8)
            cached_rows = cur.array("<u4", m)
            _rows_in(cached_rows, n, "OUTPUTS cached")
            cached = dict(zip(cached_rows.tolist(), cur.array("<u4", m).tolist()))
        cur.done()
        self._last_rows = rows
        outs = []
        for r, (index, tok) in enumerate(zip(rows.tolist(), tokens)):
            reason, stop_reason = reasons.get(r, (None, None))
            lp = logprobs.get(r)
            outs.append(EngineCoreOutput(index, [tok], reason, stop_reason,
                                         [lp] if lp is not None else None,
                                         num_cached_tokens=cached.get(r)))
        outs.extend(EngineCoreOutput(index, [], "abort") for index in aborted)
        return outs


# ---------------------------------------------------------------------------- core -> runner
def encode_sched(sched: SchedulerOutput) -> bytes:
    """A step for the model runner: new requests in full, the rest as (index, num tokens) plus
    any block newly given to them. Request ids must be the core's integer indices."""
    indices = list(sched.num_scheduled_tokens.keys())
    parts = [_SCHED_HEAD.pack(len(indices), sched.total_num_scheduled_tokens),
             _u32s(indices, "request indices"),
             _u32s(list(sched.num_scheduled_tokens.values()), "token counts"),
             _U32.pack(len(sched.new_requests))]
    for new in sched.new_requests:
        _u32(new.request_id, "request index")
        parts.append(_NEW_HEAD.pack(new.request_id, new.num_prompt_tokens,
                                    new.num_computed_tokens))
        parts.append(_pack_params(new.sampling_params))
        parts.append(_U32.pack(len(new.token_ids)) + _ids(new.token_ids))
        parts.append(_U32.pack(len(new.block_ids)) + _u32s(new.block_ids, "block ids"))
    cached = sched.cached_requests
    grown = [(rid, b) for rid, b in zip(cached.request_ids, cached.new_block_ids) if b]
    parts.append(_U32.pack(len(grown)))
    parts.append(_u32s([rid for rid, _ in grown], "request indices"))
    parts.append(_u32s([len(b) for _, b in grown], "block counts"))
    parts.append(_u32s([x for _, b in grown for x in b], "block ids"))
    finished = sorted(sched.finished_request_ids)
    parts.append(_U32.pack(len(finished)) + _u32s(finished, "request indices"))
    return frame(SCHED, b"".join(parts))


def decode_sched(payload: memoryview) -> SchedulerOutput:
    cur = _Cursor(payload, "SCHED")
    n, total = cur.unpack(_SCHED_HEAD)
    if n * 8 > len(cur.buf) - cur.pos:
        raise FrameError(f"SCHED: {n} rows do not fit in the frame")
    indices = cur.array("<u4", n).tolist()
    num_tokens = cur.array("<u4", n).tolist()
    scheduled = dict(zip(indices, num_tokens))
    if len(scheduled) != n:
        raise FrameError("SCHED: a request is scheduled twice")
    if sum(num_tokens) != total:
        raise FrameError(f"SCHED: rows add up to {sum(num_tokens)} tokens, header says {total}")
    new_reqs = []
    for _ in range(cur.count(_NEW_HEAD.size + _PARAMS.size + 20)):
        index, num_prompt, num_computed = cur.unpack(_NEW_HEAD)
        params = _unpack_params(cur)
        token_ids = cur.array("<i4", cur.count(4)).tolist()
        block_ids = cur.array("<u4", cur.count(4)).tolist()
        if index not in scheduled:
            raise FrameError(f"SCHED: new request {index} is not among the scheduled rows")
        if not (num_prompt <= len(token_ids) and num_computed <= len(token_ids)):
            raise FrameError(f"SCHED: new request {index} has inconsistent token counts")
        new_reqs.append(NewRequestData(index, token_ids, num_prompt, params, block_ids,
                                       num_computed))
    m = cur.count(8)
    grown_ids = cur.array("<u4", m).tolist()
    counts = cur.array("<u4", m)
    blocks = cur.array("<u4", int(counts.sum(dtype=np.int64))).tolist()
    finished = set(cur.array("<u4", cur.count(4)).tolist())
    cur.done()
    new_ids = {r.request_id for r in new_reqs}
    grown: dict[int, list[int]] = {}
    start = 0
    for rid, c in zip(grown_ids, counts.tolist()):
        if rid not in scheduled or rid in new_ids:
            raise FrameError(f"SCHED: blocks for request {rid}, which is not a scheduled "
                             f"running request")
        grown[rid] = blocks[start:start + c]
        start += c
    # Rows without new blocks share one empty list (the runner only reads them).
    cached_ids = [rid for rid in indices if rid not in new_ids] if new_ids else indices
    cached = CachedRequestData(cached_ids, [grown.get(rid, _NO_BLOCKS) for rid in cached_ids]
                               if grown else [_NO_BLOCKS] * len(cached_ids))
    return SchedulerOutput(new_reqs, cached, scheduled, total, finished)


_NO_BLOCKS: list[int] = []
