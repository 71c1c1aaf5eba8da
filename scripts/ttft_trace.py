"""Where time to first token goes inside the server, and how long a closed-loop client takes
from one request's end to its next, from an LLM_SERVING_TRACE file.

    LLM_SERVING_TRACE=/tmp/trace.jsonl python scripts/bench_serving.py ...
    python scripts/ttft_trace.py /tmp/trace.jsonl [--rounds N]      (or a .jsonl.gz)

Each line is one streamed request (engine/serving.py); the stages, in milliseconds:
execute -> loop (the serving loop takes it), tokenize + to core, engine (until its first
step's output comes back: the scheduler's queue and the prefill), outbox + send; then the
final response's outbox + send (its last step back -> handed to the server), and the client's
turn-around: from a final response handed to the server to the `execute` of the request that
replaced it (gRPC both ways, the client, Triton's queue). A closed loop of c clients has c
requests submitted before the first final response; the i-th final response (in time) is
paired with the (c + i)-th request submitted. `--rounds N` splits the requests, by arrival,
into N equal rounds (e.g. bench_serving's warm-up and steady round at one concurrency: 2).

`--core-log FILE` (the engine cores' ENGINE_REQUEST_LOG, engine/core_process.py, same run)
splits the engine's part: to the core (the front end's sender, the socket, the core's loop
until it takes the request), in the core, and back (the core's send to the front end's reader);
and counts, over each round's middle half, how many requests were in each part on average
(Little's law, over every request, whatever its round). With `--core-log` and no trace (an
engine driven directly, as bench_serving.py's direct rows), the same for the core's part alone,
the requests taken in order.
"""
from __future__ import annotations

import argparse
import gzip
import json
import statistics

STAGES = (("execute -> loop", "submitted", "serving"),
          ("tokenize + to core", "serving", "in_engine"),
          ("engine", "in_engine", "first_output"),
          ("outbox + send", "first_output", "first_sent"),
          ("execute -> first sent", "submitted", "first_sent"),
          ("final: outbox + send", "final_output", "final_sent"))


CORE_STAGES = (("to core", "in_engine", "core_taken"),
               ("core: to first sent", "core_taken", "core_first_sent"),
               ("back: first", "core_first_sent", "first_output"),
               ("core: to final sent", "core_taken", "core_final_sent"),
               ("back: final", "core_final_sent", "final_output"))
# What the in-flight counts cover (with --core-log).
SPANS = (("front end: in_engine -> final_output", "in_engine", "final_output"),
         ("on the way to the core", "in_engine", "core_taken"),
         ("in the core: taken -> final sent", "core_taken", "core_final_sent"),
         ("  of them before their first output", "core_taken", "core_first_sent"),
         ("on the way back", "core_final_sent", "final_output"))
CORE_ONLY = ("core: to first sent", "core: to final sent", "in the core: taken -> final sent",
             "  of them before their first output")


def join_core_log(rows: list[dict], core_rows: list[dict]) -> int:
    """Adds core_taken, core_first_sent and core_final_sent to each row whose core's line
    is there (keyed by front end pid, core pid, index); returns how many rows got them."""
    by_key = {(c["front"], c["core"], c["index"]): c for c in core_rows}
    joined = 0
    for r in rows:
        c = by_key.get((r.get("front"), r.get("core"), r.get("index")))
        if c is None:
            continue
        r["core_taken"], r["core_first_sent"], r["core_final_sent"] = (
            c["taken"], c["first_sent"], c["final_sent"])
        joined += 1
    return joined


def in_flight(rows: list[dict], a: str, b: str, t0: float, t1: float) -> float:
    """The mean number of rows between their times a and b over [t0, t1] (Little's law)."""
    total = sum(max(0.0, min(r[b], t1) - max(r[a], t0))
                for r in rows if r.get(a) is not None and r.get(b) is not None)
    return total / (t1 - t0)


def middle_half(part: list[dict]) -> tuple[float, float]:
    """The middle half of a round's span, from its first request's submit to its last final
    response (the steady part of a closed loop's round)."""
    start = min(r["submitted"] for r in part)
    end = max(r.get("final_sent") or r["submitted"] for r in part)
    return start + 0.25 * (end - start), start + 0.75 * (end - start)


def core_rows(core: list[dict]) -> list[dict]:
    """The core log's lines as rows of their own (no trace): a request's span is its time in
    the core, from taken to its final output sent."""
    return [{"submitted": c["taken"], "final_sent": c["final_sent"], "core_taken": c["taken"],
             "core_first_sent": c["first_sent"], "core_final_sent": c["final_sent"]}
            for c in core]


def turnarounds(rows: list[dict]) -> list[float | None]:
    """Per row of one round: ms from its final response handed to the server to the execute
    of the request that replaced it (closed loop; None where none did: the round's last c, and
    rows of a trace written before final_sent was noted)."""
    out: list[float | None] = [None] * len(rows)
    done = [j for j in range(len(rows)) if rows[j].get("final_sent") is not None]
    if not done:
        return out
    sent = sorted(r["submitted"] for r in rows)
    by_final = sorted(done, key=lambda j: rows[j]["final_sent"])
    c = sum(1 for t in sent if t < rows[by_final[0]]["final_sent"])
    for i, j in enumerate(by_final[:len(rows) - c]):
        out[j] = (sent[c + i] - rows[j]["final_sent"]) * 1e3
    return out


def _quantile(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[int(p * (len(s) - 1))]


def summarize(rows: list[dict], stages=STAGES) -> dict[str, dict[str, float]]:
    """Per stage, over the rows that have both its times (traces written before the server
    noted a final response sent ahead of the reader's final_output have a null there, one in
    10,240 requests): quantiles, mean, rows left out."""
    out = {}
    for name, a, b in stages:
        ms = [(r[b] - r[a]) * 1e3 for r in rows if r.get(a) is not None and r.get(b) is not None]
        if not ms:
            continue
        out[name] = {"p50_ms": round(_quantile(ms, 0.5), 2), "p90_ms": round(_quantile(ms, 0.9), 2),
                     "mean_ms": round(statistics.fmean(ms), 2), "left_out": len(rows) - len(ms)}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", nargs="?", help="the LLM_SERVING_TRACE file")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--core-log", default=None, help="the cores' ENGINE_REQUEST_LOG file")
    args = ap.parse_args(argv)
    if args.trace is None and args.core_log is None:
        ap.error("give a trace, a --core-log, or both")
    spans = SPANS
    if args.trace is None:
        rows = sorted(core_rows(_read_lines(args.core_log)), key=lambda r: r["submitted"])
        stages = [s for s in CORE_STAGES if s[0] in CORE_ONLY]
        spans = [s for s in SPANS if s[0] in CORE_ONLY]
        print(f"core log alone: {len(rows)} requests")
    else:
        rows = sorted(_read_lines(args.trace), key=lambda r: r["submitted"])
        stages = STAGES
        if args.core_log:
            joined = join_core_log(rows, _read_lines(args.core_log))
            print(f"core log: {joined} of {len(rows)} requests joined")
            stages = STAGES + CORE_STAGES
    per = -(-len(rows) // args.rounds)
    for i in range(args.rounds):
        part = rows[i * per:(i + 1) * per]
        if not part:
            continue
        # Within the round: its last requests were replaced by none of the next round's.
        around = turnarounds(part) if args.trace else []
        print(f"round {i + 1}: {len(part)} requests")
        for name, q in summarize(part, stages).items():
            print(f"  {name:22s} p50 {q['p50_ms']:8.1f}  p90 {q['p90_ms']:8.1f}  "
                  f"mean {q['mean_ms']:8.1f} ms"
                  + (f"  ({q['left_out']} without these times)" if q["left_out"] else ""))
        turns = [t for t in around if t is not None]
        if turns:
            print(f"  {'client turn-around':22s} p50 {_quantile(turns, 0.5):8.1f}  "
                  f"p90 {_quantile(turns, 0.9):8.1f}  mean {statistics.fmean(turns):8.1f} ms")
        if args.core_log:
            t0, t1 = middle_half(part)
            print(f"  in flight over the round's middle half ({t1 - t0:.1f} s), mean requests:")
            for name, a, b in spans:
                print(f"    {name:38s} {in_flight(rows, a, b, t0, t1):8.1f}")


def _read_lines(path: str) -> list[dict]:
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        return [json.loads(line) for line in f if line.strip()]


if __name__ == "__main__":
    main()
