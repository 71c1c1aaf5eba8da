"""Bytes and time per decode step across the process boundaries, binary frames vs pickle.

For N running requests in steady-state decode (real Scheduler + KVCacheManager state, a fake
runner that samples one token per request) it measures each direction:

  front end -> core   nothing per step; ADD and ABORT once per request, for context
  core -> front end   OUTPUTS (wire.OutputsEncoder, one encoder across steps as in the core)
  core -> runner      SCHED (wire.encode_sched)

beside pickle.dumps of the same dataclasses (the seed's format). Time per step is encode +
transport + decode: a round trip over a socketpair to a peer process that decodes the message
and answers one byte; both formats use the same transport. Encode-only and decode-only are
timed in-process. Target: <= 16 bytes per running request per step in each direction between
the front end and the core; the core -> runner message is reported beside it.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import multiprocessing
import os
import pickle
import platform
import socket
import struct
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from engine import wire  # noqa: E402
from engine.kv_cache_manager import KVCacheManager  # noqa: E402
from engine.request import Request  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.scheduler import ModelRunnerOutput, Scheduler  # noqa: E402
from scripts.bench_common import git_commit, write_results  # noqa: E402
from scripts.server_probe import cpu_name  # noqa: E402

TARGET_BYTES_PER_REQUEST = 16
BUDGET_TOKENS = 8192
VOCAB = 32000
_LEN = struct.Struct("<I")      # pickle's length prefix on the socket (as multiprocessing's)


# ---------------------------------------------------------------------------- scheduler state
def record_steps(num_running: int, num_steps: int, prompt_len: int, block_size: int,
                 first_index: int = 0):
    """Runs prefill, then `num_steps` decode steps. Returns (the last prefill step's outputs,
    [(SchedulerOutput, list[EngineCoreOutput])] for the decode steps)."""
    max_tokens = num_steps + num_running * (prompt_len + block_size) // BUDGET_TOKENS + 16
    max_model_len = prompt_len + block_size + max_tokens
    num_blocks = num_running * (-(-max_model_len // block_size)) + 64
    sched = Scheduler(KVCacheManager(num_blocks, block_size, enable_caching=True),
                      max_num_seqs=num_running, max_num_batched_tokens=BUDGET_TOKENS,
                      max_model_len=max_model_len)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i in range(num_running):
        # Lengths staggered over a block, so block growth spreads over steps as in real traffic.
        n = prompt_len + i % block_size
        sched.add_request(Request(first_index + i, [(i * 31 + t) % VOCAB for t in range(n)],
                                  params, eos_token_ids=[]))
    step = 0

    def run_step():
        nonlocal step
        out = sched.schedule()
        rids = [rid for rid in out.num_scheduled_tokens
                if sched.requests[rid].num_computed_tokens == sched.requests[rid].num_tokens]
        step += 1
        tokens = [(step * 7 + i) % VOCAB for i in range(len(rids))]
        return out, sched.update_from_output(out, ModelRunnerOutput(rids, tokens))

    prime = []
    while any(r.num_output_tokens == 0 for r in sched.requests.values()):
        prime = run_step()[1]
    steps = [run_step() for _ in range(num_steps)]
    assert sched.num_running == num_running
    assert all(len(outs) == num_running and not out.new_requests for out, outs in steps)
    return prime, steps


# ---------------------------------------------------------------------------- formats
def pickle_message(obj) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _LEN.pack(len(data)) + data


def encoder_for(fmt: str, direction: str):
    """A fresh encoder: obj -> bytes on the socket."""
    if fmt == "pickle":
        return pickle_message
    if direction == "core_to_frontend":
        return wire.OutputsEncoder().encode
    return wire.encode_sched


def _recv_exact(sock: socket.socket, n: int) -> bytearray | None:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            return None
        got += k
    return buf


def _peer(sock: socket.socket, fmt: str) -> None:
    """The receiving process: decode each message, answer one byte; exit at end of stream."""
    gc.collect()
    gc.freeze()     # as the engine core after start-up; else full collections add 10-20 ms
    decoder = wire.OutputsDecoder()
    head_bytes = {"wire": wire.HEADER.size, "pickle": _LEN.size, "raw": 1}[fmt]
    while (head := _recv_exact(sock, head_bytes)) is not None:
        if fmt == "wire":
            kind, n = wire.parse_header(bytes(head))
            payload = memoryview(_recv_exact(sock, n))
            decoder.decode(payload) if kind == wire.OUTPUTS else wire.decode_sched(payload)
        elif fmt == "pickle":
            pickle.loads(_recv_exact(sock, _LEN.unpack(head)[0]))
        sock.sendall(b"\x01")


def _ack(sock: socket.socket) -> None:
    if _recv_exact(sock, 1) is None:
        raise RuntimeError("the peer process died: its error is printed above")


def round_trips_s(fmts: list[str], direction: str, prime, messages) -> dict[str, list[float]]:
    """Seconds per message and format: encode, send, peer decodes and acks, ack received.
    The formats take turns message by message (one peer each), so load from elsewhere on the
    machine falls on both alike."""
    # Not a plain fork: the peer would share the pages of the recorded steps copy-on-write,
    # and the refcount writes of encoding them would fault pages into the timed loop.
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    socks, peers, encoders = {}, [], {}
    for fmt in fmts:
        socks[fmt], theirs = socket.socketpair()
        peers.append(ctx.Process(target=_peer, args=(theirs, fmt), daemon=True))
        peers[-1].start()
        theirs.close()
        encoders[fmt] = (lambda _: b"\x00") if fmt == "raw" else encoder_for(fmt, direction)
        socks[fmt].sendall(encoders[fmt](prime))    # the peer learns the rows, as after prefill
        _ack(socks[fmt])
    times: dict[str, list[float]] = {fmt: [] for fmt in fmts}
    for i, msg in enumerate(messages):
        for fmt in (fmts if i % 2 == 0 else fmts[::-1]):
            sock, encode = socks[fmt], encoders[fmt]
            t0 = time.perf_counter()
            sock.sendall(encode(msg))
            _ack(sock)
            times[fmt].append(time.perf_counter() - t0)
    for sock in socks.values():
        sock.close()
    for peer in peers:
        peer.join(timeout=10)
    return times


# ---------------------------------------------------------------------------- measuring
def _us(times_s: list[float]) -> dict:
    xs = sorted(times_s)
    return {"median": 1e6 * xs[len(xs) // 2], "p99": 1e6 * xs[min(len(xs) - 1,
                                                                  int(0.99 * len(xs)))]}


def _timed(fns: dict[str, tuple]) -> dict[str, list[float]]:
    """{name: (fn, items)} -> {name: seconds per item}; the fns take turns item by item."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(len(next(iter(fns.values()))[1])):
        for name, (fn, items) in fns.items():
            t0 = time.perf_counter()
            fn(items[i])
            times[name].append(time.perf_counter() - t0)
    return times


def measure_direction(direction: str, num_running: int, prime, messages) -> dict:
    """Bytes and times for one boundary; `messages` are the steady steps' dataclasses."""
    wire_enc = encoder_for("wire", direction)
    wire_enc(prime)
    frames = [wire_enc(m) for m in messages]
    pickles = [pickle.dumps(m, protocol=pickle.HIGHEST_PROTOCOL) for m in messages]
    if direction == "core_to_frontend":
        decoder = wire.OutputsDecoder()
        decoder.decode(wire.split_frame(encoder_for("wire", direction)(prime))[1])
        wire_dec = lambda f: decoder.decode(wire.split_frame(f)[1])  # noqa: E731
        rows_sent = sum(1 for f in frames if wire.split_frame(f)[1][4] & wire.ROWS)
    else:
        wire_dec = lambda f: wire.decode_sched(wire.split_frame(f)[1])  # noqa: E731
        rows_sent = None
    # Each step's decoded message must equal what was encoded (the same decoder state).
    assert wire_dec(frames[0]) == messages[0] and pickle.loads(pickles[0]) == messages[0]
    for f in frames[1:]:
        wire_dec(f)

    gc.collect()
    gc.freeze()                 # as the engine does after start-up: fewer collector pauses
    fresh_enc = encoder_for("wire", direction)
    fresh_enc(prime)
    res = {
        "num_running": num_running, "direction": direction,
        "message": "OUTPUTS" if direction == "core_to_frontend" else "SCHED",
        "num_steps": len(messages),
        "wire_bytes_per_step_mean": sum(map(len, frames)) / len(frames),
        "wire_bytes_per_step_max": max(map(len, frames)),
        "pickle_bytes_per_step_mean": sum(map(len, pickles)) / len(pickles),
        "pickle_bytes_per_step_max": max(map(len, pickles)),
        "steps_with_rows_sent": rows_sent,
    }
    times = _timed({
        "wire_encode_us": (fresh_enc, messages), "wire_decode_us": (wire_dec, frames),
        "pickle_encode_us": (lambda m: pickle.dumps(m, pickle.HIGHEST_PROTOCOL), messages),
        "pickle_decode_us": (pickle.loads, pickles)})
    trips = round_trips_s(["wire", "pickle"], direction, prime, messages)
    times.update({f"{fmt}_round_trip_us": t for fmt, t in trips.items()})
    res.update({name: _us(t) for name, t in times.items()})
    gc.unfreeze()
    res["wire_bytes_per_request_per_step"] = res["wire_bytes_per_step_mean"] / num_running
    res["pickle_bytes_per_request_per_step"] = res["pickle_bytes_per_step_mean"] / num_running
    # The target is for the front end <-> core directions; the runner boundary is reported
    # beside them (8 bytes per request plus a 27-byte frame, as the diff lists).
    res["meets_target"] = (None if direction == "core_to_runner" else
                           res["wire_bytes_per_request_per_step"] <= TARGET_BYTES_PER_REQUEST)
    return res


def frontend_to_core(num_running: int, prompt_len: int, block_size: int,
                     first_index: int = 0) -> dict:
    """Nothing is sent per decode step; ADD once per request, ABORT when one is cancelled."""
    params = SamplingParams(max_tokens=1 << 20, ignore_eos=True)
    prompts = [[(i * 31 + t) % VOCAB for t in range(prompt_len + i % block_size)]
               for i in range(num_running)]
    add = [len(wire.encode_add(first_index + i, p, params)) for i, p in enumerate(prompts)]
    add_pickle = [len(pickle.dumps((first_index + i, p, params), pickle.HIGHEST_PROTOCOL))
                  for i, p in enumerate(prompts)]
    all_ids = list(range(first_index, first_index + num_running))
    return {
        "num_running": num_running, "direction": "frontend_to_core",
        "message": "nothing sent", "num_steps": None,
        "wire_bytes_per_step_mean": 0, "wire_bytes_per_request_per_step": 0.0,
        "pickle_bytes_per_step_mean": 0, "pickle_bytes_per_request_per_step": 0.0,
        "meets_target": True,
        "add_prompt_tokens_mean": sum(map(len, prompts)) / num_running,
        "add_bytes_per_request": sum(add) / num_running,
        "add_pickle_bytes_per_request": sum(add_pickle) / num_running,
        "abort_one_bytes": len(wire.encode_abort([all_ids[-1]])),
        "abort_one_pickle_bytes": len(pickle.dumps([all_ids[-1]], pickle.HIGHEST_PROTOCOL)),
        "abort_all_bytes_per_request": len(wire.encode_abort(all_ids)) / num_running,
        "abort_all_pickle_bytes_per_request":
            len(pickle.dumps(all_ids, pickle.HIGHEST_PROTOCOL)) / num_running,
    }


def bench(num_running: int, num_steps: int, prompt_len: int, block_size: int,
          first_index: int) -> list[dict]:
    prime, steps = record_steps(num_running, num_steps, prompt_len, block_size, first_index)
    # SCHED keeps no state between frames: its first message only warms the peer up.
    return [frontend_to_core(num_running, prompt_len, block_size, first_index),
            measure_direction("core_to_frontend", num_running, prime, [o for _, o in steps]),
            measure_direction("core_to_runner", num_running, steps[0][0], [s for s, _ in steps])]


# ---------------------------------------------------------------------------- report
def _verdict(meets: bool | None) -> str:
    return "n/a (runner)" if meets is None else "pass" if meets else "FAIL"


def table(rows: list[dict]) -> list[str]:
    def us(r, fmt):
        t = r.get(f"{fmt}_round_trip_us")
        return f"{t['median']:.1f} ({t['p99']:.1f})" if t else "-"

    lines = ["| running | direction | ours B/req/step | pickle B/req/step | ours µs/step "
             "median (p99) | pickle µs/step median (p99) | ≤ 16 B/req/step |",
             "| ---: | :--- | ---: | ---: | ---: | ---: | :---: |"]
    for r in rows:
        lines.append(f"| {r['num_running']} | {r['direction']} ({r['message']}) | "
                     f"{r['wire_bytes_per_request_per_step']:.2f} | "
                     f"{r['pickle_bytes_per_request_per_step']:.2f} | {us(r, 'wire')} | "
                     f"{us(r, 'pickle')} | {_verdict(r['meets_target'])} |")
    lines += ["", "One-time messages, front end -> core (bytes per request):", "",
              "| running | ADD (prompt tokens) | ADD pickle | ABORT one | ABORT one pickle | "
              "ABORT all, per request | ABORT all pickle |", "| ---: | ---: | ---: | ---: | ---: | ---: "
              "| ---: |"]
    for r in rows:
        if r["direction"] == "frontend_to_core":
            lines.append(f"| {r['num_running']} | {r['add_bytes_per_request']:.0f} "
                         f"({r['add_prompt_tokens_mean']:.0f}) | "
                         f"{r['add_pickle_bytes_per_request']:.0f} | {r['abort_one_bytes']} | "
                         f"{r['abort_one_pickle_bytes']} | "
                         f"{r['abort_all_bytes_per_request']:.2f} | "
                         f"{r['abort_all_pickle_bytes_per_request']:.2f} |")
    lines += ["", "In-process encode / decode, µs per step (median):", "",
              "| running | direction | ours encode | ours decode | pickle encode | "
              "pickle decode |", "| ---: | :--- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        if "wire_encode_us" in r:
            lines.append(f"| {r['num_running']} | {r['direction']} | "
                         f"{r['wire_encode_us']['median']:.1f} | "
                         f"{r['wire_decode_us']['median']:.1f} | "
                         f"{r['pickle_encode_us']['median']:.1f} | "
                         f"{r['pickle_decode_us']['median']:.1f} |")
    return lines


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-running", default="1,64,256,1024",
                    help="comma-separated numbers of running requests")
    ap.add_argument("--steps", type=int, default=200, help="steady decode steps measured")
    ap.add_argument("--prompt-len", type=int, default=512,
                    help="prompt tokens (request i gets prompt_len + i %% block_size)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--first-index", type=int, default=0,
                    help="the core's index of the first request (0: a fresh server; indices "
                         "only grow, and pickle's ints cost 5 bytes from 65536 on)")
    ap.add_argument("--out-dir", default="benchmarks")
    args = ap.parse_args(argv)
    counts = [int(x) for x in args.num_running.split(",")]
    if args.steps < 1 or min(counts) < 1:
        raise ValueError("--steps and every --num-running must be >= 1")
    if not 0 <= args.first_index <= 2**32 - 1 - max(counts):
        raise ValueError("--first-index must leave every index within u32")

    load_average = os.getloadavg()[0]
    t0 = time.perf_counter()
    rows = [r for n in counts for r in bench(n, args.steps, args.prompt_len, args.block_size,
                                             args.first_index)]
    ping = _us(round_trips_s(["raw"], "", None, [None] * max(args.steps, 100))["raw"])
    meta = {
        "title": "IPC bytes and time per decode step: binary frames vs pickle",
        "command": " ".join(["python", "scripts/bench_ipc.py"]
                            + (sys.argv[1:] if argv is None else list(argv))),
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(),
        "load_average_at_start": load_average,
        "prompt_len": args.prompt_len, "block_size": args.block_size, "steps": args.steps,
        "first_index": args.first_index, "vocab": VOCAB,
        "target": f"<= {TARGET_BYTES_PER_REQUEST} bytes per running request per step, "
                  "each direction (mean frame bytes incl. header / running requests)",
        "one_byte_round_trip_us": ping,
        "bench_seconds": time.perf_counter() - t0,
    }
    meta["hardware"] = (f"{meta['cpu']}, {meta['cores']} cores, Python {meta['python']}, "
                        f"load average {load_average:.1f} at start")
    notes = [
        f"{args.steps} steady decode steps per row after prefill; prompts {args.prompt_len}"
        f"+(i mod {args.block_size}) tokens, block {args.block_size}. Bytes are whole frames "
        "(7-byte header included) / running requests; pickle is `pickle.dumps` of the same "
        "dataclasses (list[EngineCoreOutput], SchedulerOutput), HIGHEST_PROTOCOL, without its "
        f"4-byte length prefix. Request indices {args.first_index}.. and tokens < {VOCAB}: "
        "pickle writes ints below 65536 in 2-3 bytes, so it gains on small ids (ADD, ABORT, "
        "SCHED); ours are fixed u32 / i32.",
        "µs/step is encode + socketpair round trip to a peer process that decodes and acks one "
        f"byte (a bare 1-byte round trip: {ping['median']:.1f} µs median); the formats take turns "
        "step by step, and both processes freeze the collector after start-up, as the core does.",
        "Frame sizes: OUTPUTS = 12 + 4N bytes once the rows are known; SCHED = 27 + 8N, "
        "+ 12 per request given a new block (1 in block_size steps), so its fixed 27 bytes "
        "dominate at N = 1.", ""]
    write_results(os.path.join(args.out_dir, "ipc"), meta, rows, notes + table(rows))
    return {"meta": meta, "results": rows}


if __name__ == "__main__":
    main()
