"""Where time to first token goes inside the server, from an LLM_SERVING_TRACE file.

    LLM_SERVING_TRACE=/tmp/trace.jsonl python scripts/bench_serving.py ...
    python scripts/ttft_trace.py /tmp/trace.jsonl [--rounds N]

Each line is one streamed request (engine/serving.py); the stages, in milliseconds:
execute -> loop (the serving loop takes it), tokenize + to core, engine (until its first
step's output comes back: the scheduler's queue and the prefill), outbox + send. `--rounds N`
splits the requests, by arrival, into N equal rounds (e.g. bench_serving's warm-up and steady
round at one concurrency: 2).
"""
from __future__ import annotations

import argparse
import json
import statistics

STAGES = (("execute -> loop", "submitted", "serving"),
          ("tokenize + to core", "serving", "in_engine"),
          ("engine", "in_engine", "first_output"),
          ("outbox + send", "first_output", "first_sent"),
          ("execute -> first sent", "submitted", "first_sent"))


def _quantile(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[int(p * (len(s) - 1))]


def summarize(rows: list[dict]) -> dict[str, dict[str, float]]:
    out = {}
    for name, a, b in STAGES:
        ms = [(r[b] - r[a]) * 1e3 for r in rows]
        out[name] = {"p50_ms": round(_quantile(ms, 0.5), 2), "p90_ms": round(_quantile(ms, 0.9), 2),
                     "mean_ms": round(statistics.fmean(ms), 2)}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args(argv)
    with open(args.trace) as f:
        rows = sorted((json.loads(line) for line in f if line.strip()),
                      key=lambda r: r["submitted"])
    per = -(-len(rows) // args.rounds)
    for i in range(args.rounds):
        part = rows[i * per:(i + 1) * per]
        if not part:
            continue
        print(f"round {i + 1}: {len(part)} requests")
        for name, q in summarize(part).items():
            print(f"  {name:22s} p50 {q['p50_ms']:8.1f}  p90 {q['p90_ms']:8.1f}  "
                  f"mean {q['mean_ms']:8.1f} ms")


if __name__ == "__main__":
    main()
