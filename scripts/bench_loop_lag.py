"""Short streams' inter-token latency and the serving loop's lag under a flood of huge prompts.

Through a real tritonserver, gRPC streaming to the `llm` model, once per tokenization mode:

  process   the repository's settings: prompts longer than `tokenize_inline_max_chars` (the
            engine default) go to the tokenizer thread, which hands them to the tokenizer
            process (lower CPU priority, `tokenizer_process_priority`)
  thread    `tokenizer_process` = false: the tokenizer thread tokenizes them itself, in the
            serving process
  inline    `tokenize_inline_max_chars` = 1,000,000: every prompt is tokenized on the loop

Each run gets a fresh server. `--streams` slots each run short greedy requests back to back
over their own gRPC stream, every response's arrival timed here:

  unloaded  the slots alone for `--unloaded-seconds` (after a warm-up that is not counted);
  flood     the slots keep running while `--flood-requests` prompts of `--flood-chars`
            characters are sent as fast as a few sender streams can; each is longer than the
            tiny model's max_model_len, so it is tokenized, then answered with an error. The
            phase runs from the first flood send to the last flood answer + FLOOD_TAIL_S.

Inter-token latency (ITL): the gap between consecutive responses of one request, per token (the
first response, time to first token, opens no gap); a gap counts in the phase in which its
later response arrived. Loop lag, from the server's /metrics: the histogram
`llm_event_loop_lag_seconds` (delta over the phase) and the gauge
`llm_event_loop_lag_max_seconds` (max lag over the last 0.5 s), polled every 0.25 s.
Target: flood ITL p99 <= 1.5x unloaded ITL p99.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import queue
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import tritonclient.grpc as grpcclient  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from scripts.bench_common import git_commit, write_results  # noqa: E402
from scripts.tritonserver_env import copy_repository as make_repo  # noqa: E402
from scripts.server_probe import (GaugePoller, cpu_delta, cpu_name, cpu_seconds,  # noqa: E402
                                  hist_delta, scrape)
from tests.tritonserver import start_server  # noqa: E402

TARGET_RATIO = 1.5
STALLED_RATE = 0.5          # flood gaps/s below this share of unloaded: the streams stalled
INLINE_MAX_CHARS = 1_000_000
WARMUP_S = 3.0
FLOOD_TAIL_S = 0.5          # the gaps a stall opened close just after the loop's last answer
GAUGE_POLL_S = 0.25
GAUGE_SPAN_S = 1.0          # a gauge read at t holds the max lag of up to ~1 s before t
RESPONSE_TIMEOUT_S = 300.0
TIMELINE_BIN_S = 0.5
LAG_HIST = "llm_event_loop_lag_seconds"
LAG_GAUGE = "llm_event_loop_lag_max_seconds"
ITL_HIST = "llm_inter_token_latency_seconds"
# Each mode's llm settings over the repository's.
MODES = {"process": {}, "thread": {"tokenizer_process": "false"},
         "inline": {"tokenize_inline_max_chars": str(INLINE_MAX_CHARS)}}
_LEDGER = ("Ledger {n}: on day {d} the harbour office at Port {p} logged {q} crates of salt, "
           "{r} barrels of oil and {s} sacks of grain; the clerk noted a {t}-minute delay "
           "because crane #{c} was under repair, and ship {v} left at {h}:{m:02d}.\n")
_TOPICS = ["ships", "clouds", "bread", "rivers", "lamps", "maps", "salt", "bees", "tides",
           "bells", "kites", "owls"]


# ---------------------------------------------------------------------------- inputs
def flood_prompt(index: int, num_chars: int) -> str:
    """Varied text: every line has other numbers and names (not one repeated token run)."""
    parts, n, i = [], 0, index * 100_003
    while n < num_chars:
        parts.append(_LEDGER.format(
            n=i, d=i % 31 + 1, p=chr(65 + i % 26), q=i * 7 % 997, r=i * 13 % 211,
            s=i * 17 % 503, t=i % 90, c=i % 12, v=f"{chr(65 + i * 5 % 26)}{i % 1000}",
            h=i % 24, m=i * 11 % 60))
        n += len(parts[-1])
        i += 1
    return "".join(parts)[:num_chars]


def short_prompt(slot: int, index: int) -> str:
    return f"Slot {slot}, request {index}: a short note on {_TOPICS[(slot + index) % 12]}."


def grpc_inputs(prompt: str, params: dict, stream: bool = True,
                **flags) -> list[grpcclient.InferInput]:
    arrays = {"text_input": np.array([prompt.encode()], dtype=np.object_),
              "stream": np.array([stream]),
              "sampling_parameters": np.array([json.dumps(params).encode()], dtype=np.object_)}
    arrays.update({k: np.array([v]) for k, v in flags.items()})
    out = []
    for name, arr in arrays.items():
        t = grpcclient.InferInput(name, list(arr.shape),
                                  "BOOL" if arr.dtype == np.bool_ else "BYTES")
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


# ---------------------------------------------------------------------------- clients
class StreamSlot(threading.Thread):
    """Requests back to back over one gRPC stream. `requests`: [(send time, [(arrival time,
    tokens in that response)])], perf_counter seconds."""

    def __init__(self, grpc_url: str, slot: int, params: dict, stop: threading.Event) -> None:
        super().__init__(name=f"slot-{slot}", daemon=True)
        self.grpc_url, self.slot, self.params, self.stop = grpc_url, slot, params, stop
        self.requests: list[tuple[float, list[tuple[float, int]]]] = []
        self.errors: list[str] = []

    def run(self) -> None:
        client = grpcclient.InferenceServerClient(self.grpc_url)
        responses: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: responses.put(
            (time.perf_counter(), result, error)))
        try:
            index = 0
            while not self.stop.is_set():
                inputs = grpc_inputs(short_prompt(self.slot, index), self.params,
                                     return_output_ids=True)
                sent, arrivals = time.perf_counter(), []
                client.async_stream_infer("llm", inputs, request_id=f"s{self.slot}-{index}",
                                          enable_empty_final_response=True)
                while True:
                    t, result, error = responses.get(timeout=RESPONSE_TIMEOUT_S)
                    if error is not None:
                        self.errors.append(str(error))
                        break
                    ids = result.as_numpy("output_ids")
                    if ids is not None and len(ids):
                        arrivals.append((t, len(ids)))
                    if result.get_response().parameters["triton_final_response"].bool_param:
                        break
                self.requests.append((sent, arrivals))
                index += 1
        finally:
            client.stop_stream()
            client.close()


def flood(grpc_url: str, inputs: list[list[grpcclient.InferInput]], num_senders: int) -> dict:
    """Sends all requests at once over `num_senders` streams (a thread each); waits for every
    final answer. Times are perf_counter seconds."""
    answers: list[tuple[float, str | None]] = []
    lock, done = threading.Lock(), threading.Event()

    def on_response(result, error) -> None:
        if error is None and not result.get_response().parameters[
                "triton_final_response"].bool_param:
            return
        with lock:
            answers.append((time.perf_counter(), None if error is None else str(error)))
            if len(answers) == len(inputs):
                done.set()

    clients = [grpcclient.InferenceServerClient(grpc_url) for _ in range(num_senders)]
    for c in clients:
        c.is_server_live()                  # connected before the clock starts
        c.start_stream(callback=on_response)
    sent_at: list[float] = []

    def send(client, indices) -> None:
        for i in indices:
            client.async_stream_infer("llm", inputs[i], request_id=f"flood-{i}",
                                      enable_empty_final_response=True)
        sent_at.append(time.perf_counter())

    senders = [threading.Thread(target=send, args=(c, range(k, len(inputs), num_senders)))
               for k, c in enumerate(clients)]
    start = time.perf_counter()
    for s in senders:
        s.start()
    for s in senders:
        s.join()
    all_answered = done.wait(RESPONSE_TIMEOUT_S)
    for c in clients:
        c.stop_stream()
        c.close()
    times = sorted(t for t, _ in answers)
    errors = [e for _, e in answers if e is not None]
    return {"start": start, "end": times[-1] if times else time.perf_counter(),
            "num_sent": len(inputs), "num_answers": len(answers), "num_errors": len(errors),
            "num_ok": len(answers) - len(errors), "all_answered": all_answered,
            "first_error": errors[0] if errors else None, "send_s": max(sent_at) - start,
            "first_answer_s": times[0] - start if times else None}


# ---------------------------------------------------------------------------- statistics
def _pct(a: np.ndarray, q: float) -> float | None:
    return float(np.percentile(a, q)) if len(a) else None


def phase_stats(slots, start: float, end: float) -> dict:
    """Client-side numbers of the phase [start, end]."""
    per_request = [gaps for s in slots for _, arr in s.requests    # [(gap s, tokens of its end)]
                   if (gaps := [(t1 - t0, n) for (t0, _), (t1, n) in zip(arr, arr[1:])
                                if start <= t1 <= end])]
    itl = np.array([1e3 * gap / n for gaps in per_request for gap, n in gaps for _ in range(n)])
    # A request's longest gap: a stall shows here even when the tokens it held back then
    # arrive as a burst of tiny gaps that dilute the per-token percentiles.
    worst = np.array([1e3 * max(gap for gap, _ in gaps) for gaps in per_request])
    ttft = np.array([1e3 * (arr[0][0] - sent) for s in slots for sent, arr in s.requests
                     if arr and start <= sent <= end])     # sent in the phase, however late
    tokens = sum(n for s in slots for _, arr in s.requests for t, n in arr if start <= t <= end)
    return {"duration_s": end - start, "num_itl": len(itl), "itl_p50_ms": _pct(itl, 50),
            "itl_p90_ms": _pct(itl, 90), "itl_p99_ms": _pct(itl, 99),
            "itl_max_ms": float(itl.max()) if len(itl) else None,
            "worst_gap_per_request_p99_ms": _pct(worst, 99), "num_ttft": len(ttft),
            "ttft_p50_ms": _pct(ttft, 50), "ttft_max_ms": float(ttft.max()) if len(ttft) else None,
            "tokens_per_s": tokens / (end - start)}


def timeline(slots: list[StreamSlot], poller: GaugePoller, start: float, end: float) -> dict:
    """Per TIMELINE_BIN_S from `start`: tokens arrived, the longest gap that ended in the bin,
    the highest lag gauge read in it."""
    num_bins = int((end - start) / TIMELINE_BIN_S) + 1
    tokens, gaps, lag = [0] * num_bins, [0.0] * num_bins, [0.0] * num_bins
    for s in slots:
        for _, arrivals in s.requests:
            for i, (t, n) in enumerate(arrivals):
                b = int((t - start) / TIMELINE_BIN_S)
                if 0 <= b < num_bins:
                    tokens[b] += n
                    gaps[b] = max(gaps[b], 1e3 * (t - arrivals[i - 1][0]) if i else 0.0)
    for t, v in poller.samples:
        b = int((t - start) / TIMELINE_BIN_S)
        if 0 <= b < num_bins:
            lag[b] = max(lag[b], 1e3 * v)
    return {"bin_s": TIMELINE_BIN_S, "tokens": tokens, "max_gap_ms": [round(g, 1) for g in gaps],
            "lag_gauge_ms": [round(v, 1) for v in lag]}


# ---------------------------------------------------------------------------- one run
def mode_settings(mode: str) -> str:
    """The tokenization settings a mode runs with, defaults included."""
    fields = EngineConfig.__dataclass_fields__
    names = ("tokenize_inline_max_chars", "tokenizer_process", "tokenizer_process_priority")
    values = {n: MODES[mode].get(n, str(fields[n].default).lower()) for n in names}
    if values["tokenizer_process"] == "false":
        del values["tokenizer_process_priority"]
    return ", ".join(f"{k} {v}" for k, v in values.items())


def run_mode(mode: str, args, work_dir: str) -> dict:
    """One server: warm-up, unloaded phase, flood phase."""
    repo = os.path.join(work_dir, f"repo-{mode}")
    make_repo(repo, args.model, MODES[mode])
    params = {"max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
    flood_inputs = [grpc_inputs(flood_prompt(i, args.flood_chars), {"max_tokens": 16})
                    for i in range(args.flood_requests)]
    with start_server(repo, log_dir=os.path.join(work_dir, f"log-{mode}")) as server:
        pids = server.group_pids()

        def snapshot():
            return time.perf_counter(), scrape(server.metrics_url), cpu_seconds(pids)

        poller = GaugePoller(server.metrics_url, LAG_GAUGE, GAUGE_POLL_S)
        poller.start()
        stop = threading.Event()
        slots = [StreamSlot(server.grpc_url, i, params, stop) for i in range(args.streams)]
        for s in slots:
            s.start()
        time.sleep(WARMUP_S)
        t0, m0, c0 = snapshot()
        time.sleep(args.unloaded_seconds)
        t1, m1, c1 = snapshot()
        sent = flood(server.grpc_url, flood_inputs, args.flood_senders)
        time.sleep(FLOOD_TAIL_S)
        t2, m2, c2 = snapshot()
        stop.set()
        for s in slots:
            s.join(timeout=RESPONSE_TIMEOUT_S)
        poller.stop.set()
        poller.join()

    def server_side(m_a, m_b, c_a, c_b, seconds, gauge_from, gauge_to) -> dict:
        gauge_max = poller.max_between(gauge_from, gauge_to)
        return {"loop_lag": hist_delta(m_a, m_b, LAG_HIST),
                "loop_lag_gauge_max_ms": None if gauge_max is None else 1e3 * gauge_max,
                "server_itl": hist_delta(m_a, m_b, ITL_HIST),
                "cpu_cores_used": cpu_delta(c_a, c_b, seconds)}

    unloaded = {**phase_stats(slots, t0, t1),
                **server_side(m0, m1, c0, c1, t1 - t0, t0 + GAUGE_SPAN_S, t1)}
    loaded = {**phase_stats(slots, sent["start"], t2),
              **server_side(m1, m2, c1, c2, t2 - t1, t1, t2 + GAUGE_SPAN_S),
              "flood": {**{k: v for k, v in sent.items() if k not in ("start", "end")},
                        "chars_per_prompt": args.flood_chars,
                        "duration_s": sent["end"] - sent["start"]},
              "timeline_from_flood_start": timeline(slots, poller, sent["start"], t2)}
    p99_0, p99_1 = unloaded["itl_p99_ms"], loaded["itl_p99_ms"]
    ratio = p99_1 / p99_0 if p99_0 and p99_1 is not None else None
    errors = [e for s in slots for e in s.errors]
    return {"mode": mode, "settings": mode_settings(mode),
            "unloaded": unloaded, "flood": loaded, "itl_p99_ratio": ratio,
            "stalled": is_stalled(unloaded, loaded),
            "meets_target": (ratio is not None and ratio <= TARGET_RATIO
                             and not is_stalled(unloaded, loaded)),
            "num_slot_errors": len(errors), "first_slot_error": errors[0] if errors else None}


def _rate(phase: dict) -> float:
    """Inter-token gaps recorded per second: how fast the short streams moved."""
    return phase["num_itl"] / phase["duration_s"]


def is_stalled(unloaded: dict, flood: dict) -> bool:
    """The streams moved at under STALLED_RATE of their unloaded pace: their few gaps' p99
    says nothing of the stalls between them."""
    return _rate(flood) < STALLED_RATE * _rate(unloaded)


# ---------------------------------------------------------------------------- report
def _f(v, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _lag_p99(hist: dict) -> str:
    top = hist["max_bucket_ms"]
    if top and top[1] is None and hist["p99_ms"] == top[0]:
        return f"≥ {top[0]:.0f}"           # beyond the histogram's last bound
    return _f(hist["p99_ms"])


def summary(results: list[dict]) -> dict[str, dict]:
    """Per mode over its runs: the flood / unloaded ITL p99 ratios and their median."""
    out: dict[str, dict] = {}
    for r in results:
        m = out.setdefault(r["mode"], {"settings": r["settings"], "ratios": [], "stalled": 0})
        m["ratios"].append(r["itl_p99_ratio"])
        m["stalled"] += r["stalled"]
    for m in out.values():
        ratios = [x for x in m["ratios"] if x is not None]
        m["median_ratio"] = float(np.median(ratios)) if ratios else None
        m["meets_target"] = (m["median_ratio"] is not None and m["median_ratio"] <= TARGET_RATIO
                             and not m["stalled"])
    return out


def tables(results: list[dict]) -> list[str]:
    lines = ["| mode | phase | s | ITL samples | ITL p50 ms | ITL p90 ms | ITL p99 ms | "
             "ITL max ms | worst gap per request p99 ms | loop lag p99 ms (hist) | "
             "loop lag max ms (gauge) | ITL p99 / unloaded | target ≤ 1.5x |",
             "| :--- | :--- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
             "| :---: |"]
    for r in results:
        for phase in ("unloaded", "flood"):
            p = r[phase]
            ratio, verdict = ("1.00", "") if phase == "unloaded" else (
                _f(r["itl_p99_ratio"], 2), "pass" if r["meets_target"] else "FAIL")
            lines.append(
                f"| {r['label']} | {phase} | {p['duration_s']:.1f} | {p['num_itl']} | "
                f"{_f(p['itl_p50_ms'])} | {_f(p['itl_p90_ms'])} | {_f(p['itl_p99_ms'])} | "
                f"{_f(p['itl_max_ms'])} | {_f(p['worst_gap_per_request_p99_ms'])} | "
                f"{_lag_p99(p['loop_lag'])} | {_f(p['loop_lag_gauge_max_ms'])} | {ratio} | "
                f"{verdict} |")
    lines += ["", f"Flood and CPU: cores used on average over the phase (of {os.cpu_count()}); "
              "CPU pressure: share of the phase in which some runnable task waited for a CPU; "
              "other: machine busy minus the server's processes and this client.", "",
              "| mode | phase | flood answered (errors) | flood s | TTFT p50 / max ms | "
              "tokens/s | machine busy | CPU pressure | tritonserver | llm stub (busiest "
              "thread) | engine core | client | other |",
              "| :--- | :--- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
              "| ---: | ---: |"]
    for r in results:
        for phase in ("unloaded", "flood"):
            p, cpu, fl = r[phase], r[phase]["cpu_cores_used"], r[phase].get("flood")

            def cores(prefix: str) -> str:
                return _f(sum(v for k, v in cpu.items() if k.startswith(prefix)), 2)
            top = cpu["stub_llm_top_threads"]
            answered = (f"{fl['num_answers']}/{fl['num_sent']} ({fl['num_errors']}) | "
                        f"{fl['duration_s']:.1f}") if fl else "- | -"
            lines.append(
                f"| {r['label']} | {phase} | {answered} | {_f(p['ttft_p50_ms'])} / "
                f"{_f(p['ttft_max_ms'])} | {p['tokens_per_s']:.0f} | "
                f"{cpu['machine_busy_fraction']:.0%} | {_f(cpu.get('cpu_pressure_some'), 2)} | "
                f"{cores('tritonserver')} | {cores('stub_llm[')} "
                f"({_f(top[0][1] if top else None, 2)}) | {cores('engine_core')} | "
                f"{cores('client')} | {cores('other_processes')} |")
    return lines


def source_digest() -> str:
    """sha256 of the engine/ and model_repository/ sources measured: with uncommitted changes,
    the commit id alone does not say which tree ran."""
    h = hashlib.sha256()
    for top in ("engine", "model_repository"):
        for d, dirs, files in sorted(os.walk(os.path.join(ROOT, top))):
            dirs.sort()
            for name in sorted(f for f in files if f.endswith((".py", ".pbtxt"))):
                path = os.path.join(d, name)
                h.update(os.path.relpath(path, ROOT).encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()[:16]


def report(args, argv, results: list[dict], load_start, load_end, seconds: float,
           work_dir: str) -> tuple[dict, list[str]]:
    meta = {
        "title": "Short streams' inter-token latency and event-loop lag under a flood of "
                 f"{args.flood_chars // 1000}k-character prompts",
        "command": " ".join(["python", "scripts/bench_loop_lag.py"]
                            + (sys.argv[1:] if argv is None else list(argv))),
        "commit": git_commit(), "source_digest": source_digest(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(),
        "load_average_at_start": list(load_start), "load_average_at_end": list(load_end),
        "model": os.path.relpath(args.model, ROOT), "streams": args.streams,
        "short_request": {"prompt_example": short_prompt(0, 0), "max_tokens": args.max_tokens,
                          "temperature": 0, "ignore_eos": True},
        "flood_requests": args.flood_requests, "flood_chars": args.flood_chars,
        "flood_senders": args.flood_senders, "unloaded_seconds": args.unloaded_seconds,
        "warmup_s": WARMUP_S, "flood_tail_s": FLOOD_TAIL_S, "repeats": args.repeats,
        "target": f"flood ITL p99 <= {TARGET_RATIO}x unloaded ITL p99",
        "summary": summary(results), "bench_seconds": seconds, "server_logs": work_dir,
    }
    meta["hardware"] = (f"{meta['cpu']}, {meta['cores']} cores, Python {meta['python']}, "
                        f"load average {load_start[0]:.2f} at start, {load_end[0]:.2f} at end")
    notes = [
        f"{args.streams} streams of short greedy requests ({args.max_tokens} tokens, prompts like "
        f"`{short_prompt(0, 0)}`) run back to back throughout; the flood: {args.flood_requests} "
        f"prompts of {args.flood_chars:,} characters sent over {args.flood_senders} gRPC "
        "streams, each rejected after tokenization (longer than max_model_len). ITL: gaps "
        "between the responses of one request, timed by the client (first response excluded), "
        "counted in the phase of the later response; the flood phase runs from the first flood "
        f"send to the last flood answer + {FLOOD_TAIL_S} s. TTFT: requests sent in the phase. "
        "Loop lag: p99 of the server histogram's delta (interpolated in its bucket), max of the "
        "max-over-0.5 s gauge polled every 0.25 s. Tiny CPU model; the client runs on the same "
        f"machine. Each run has a fresh server; the whole benchmark took {seconds:.0f} s.", ""]
    for r in results:
        fl = r["flood"]["flood"]
        notes.append(f"- {r['label']}: {fl['num_errors']} of {fl['num_sent']} flood requests "
                     f"answered with an error (first: `{fl['first_error']}`), {fl['num_ok']} "
                     f"without; sent in {fl['send_s']:.2f} s, all answered after "
                     f"{fl['duration_s']:.1f} s. Short-stream errors: {r['num_slot_errors']}.")
    for r in results:
        if r["stalled"]:
            notes.append(
                f"- {r['label']}: STALLED. The short streams moved at {_rate(r['flood']):.0f} "
                f"gaps/s in the flood against {_rate(r['unloaded']):.0f} unloaded (below "
                f"{STALLED_RATE:.0%}): so few gaps were recorded that their p99 hides the stalls "
                f"(ITL max {_f(r['flood']['itl_max_ms'])} ms). Counted as FAIL.")
    notes += ["", f"Flood ITL p99 / unloaded ITL p99 (target ≤ {TARGET_RATIO}x; a run whose "
              f"streams stalled fails, whatever its p99):", ""]
    for mode, m in meta["summary"].items():
        stalled = f", {m['stalled']} run(s) stalled" if m["stalled"] else ""
        notes.append(f"- {mode} ({m['settings']}): "
                     f"{', '.join(_f(x, 2) for x in m['ratios'])}; median "
                     f"{_f(m['median_ratio'], 2)}x{stalled}: "
                     f"{'pass' if m['meets_target'] else 'FAIL'}")
    return meta, notes + [""] + tables(results)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flood-requests", type=int, default=60)
    ap.add_argument("--flood-chars", type=int, default=300_000, help="characters per prompt")
    ap.add_argument("--flood-senders", type=int, default=4, help="gRPC streams sending the flood")
    ap.add_argument("--streams", type=int, default=8, help="short streams running throughout")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per short request")
    ap.add_argument("--modes", default=",".join(MODES),
                    help=f"comma-separated, of: {', '.join(MODES)}")
    ap.add_argument("--unloaded-seconds", type=float, default=10.0)
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of each mode, a fresh server each, modes taking turns")
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "tiny-llama"))
    ap.add_argument("--out-dir", default="benchmarks")
    ap.add_argument("--out-name", default="loop_lag", help="writes OUT_NAME.json and .md")
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    if not modes or not set(modes) <= set(MODES):
        raise ValueError(f"--modes must be some of {', '.join(MODES)}, got {args.modes!r}")
    if min(args.flood_requests, args.flood_chars, args.flood_senders, args.streams,
           args.max_tokens, args.repeats) < 1 or args.unloaded_seconds <= 0:
        raise ValueError("every count must be >= 1 and --unloaded-seconds > 0")
    if not os.path.exists(os.path.join(args.model, "config.json")):
        raise FileNotFoundError(f"{args.model}: make it with `make tiny-model`")

    load_start, t0 = os.getloadavg(), time.perf_counter()
    work_dir = tempfile.mkdtemp(prefix="bench-loop-lag-")
    results = []
    for repeat in range(1, args.repeats + 1):
        for mode in modes:
            r = run_mode(mode, args, os.path.join(work_dir, f"run{repeat}"))
            r["repeat"], r["label"] = repeat, mode if args.repeats == 1 else f"{mode} #{repeat}"
            results.append(r)
            print(f"{r['label']}: ITL p99 {_f(r['unloaded']['itl_p99_ms'])} -> "
                  f"{_f(r['flood']['itl_p99_ms'])} ms ({_f(r['itl_p99_ratio'], 2)}x)",
                  flush=True)
    meta, lines = report(args, argv, results, load_start, os.getloadavg(),
                         time.perf_counter() - t0, work_dir)
    rows = [{"mode": r["mode"], "repeat": r["repeat"], "phase": phase,
             "settings": r["settings"], **r[phase],
             **({k: r[k] for k in ("itl_p99_ratio", "stalled", "meets_target",
                                   "num_slot_errors",
                                   "first_slot_error")} if phase == "flood" else {})}
            for r in results for phase in ("unloaded", "flood")]
    write_results(os.path.join(args.out_dir, args.out_name), meta, rows, lines)
    return {"meta": meta, "results": rows}


if __name__ == "__main__":
    main()
