"""What the engine cores' step logs (ENGINE_STEP_LOG_S, engine/core_process.py) add up to.

Each core logs, every ENGINE_STEP_LOG_S seconds, its steps' phases and GPU time, the shares of
steps that replayed CUDA graphs (the decode graph, or graphs cut at attention), and the prompt
tokens it computed and the tokens it generated since its last line. Over a run's busy lines (at
least --min-generated tokens) this sums, per log file (a server's log, or a direct bench's
output, both cores' lines together):

  graph steps x GPU ms     decode-only steps, replayed from the decode CUDA graph
  other steps x GPU ms     steps carrying prompt tokens (mixed), their prompt tokens each, and
                           how many of them replayed the graphs cut at attention (the rest ran
                           eagerly)
  GPU ms / generated token the GPU's time over the tokens generated
  prompt tokens / generated token

    ENGINE_STEP_LOG_S=2 python scripts/bench_serving.py ... --out OUT/run   (OUT/run.server.log)
    python scripts/core_step_log.py OUT/run.server.log OUT/direct.stdout
"""
from __future__ import annotations

import argparse
import ast
import re
from collections import defaultdict

LINE = re.compile(
    r"core\[(?P<pid>\d+)\].*core (?P<steps>\d+) steps in (?P<s>[\d.]+) s: busy loop ms per step "
    r"\{.*?\}; step phases (?P<phases>\{.*?\}); running (?P<running>\d+), waiting "
    r"(?P<waiting>\d+); since the last line: prompt tokens computed (?P<prompt>\d+) "
    r"\(cached (?P<cached>\d+)\), tokens generated (?P<generated>\d+)")


def parse(lines) -> dict[str, list[dict]]:
    """Each core's (by process id) lines: steps, seconds, phases (ms per step), running,
    waiting, prompt (tokens computed), cached, generated."""
    cores: dict[str, list[dict]] = defaultdict(list)
    for line in lines:
        m = LINE.search(line)
        if m:
            d = {k: int(v) for k, v in m.groupdict().items() if k not in ("pid", "s", "phases")}
            d["s"] = float(m["s"])
            d["phases"] = ast.literal_eval(m["phases"])
            cores[m["pid"]].append(d)
    return dict(cores)


def summarize(cores: dict[str, list[dict]], min_generated: int = 5000) -> dict:
    """The busy lines of every core, summed (see the module's doc); {} without GPU times."""
    busy = [d for lines in cores.values() for d in lines
            if d["steps"] and d["generated"] >= min_generated and "gpu" in d["phases"]]
    if not busy:
        return {}
    def steps(d, share):
        return d["steps"] * d["phases"].get(share, 0.0)
    # Decode graph steps: graph steps not cut at attention (older logs have no piecewise share).
    graph = sum(steps(d, "graph_step_share") - steps(d, "piecewise_step_share") for d in busy)
    piecewise = sum(steps(d, "piecewise_step_share") for d in busy)
    other = sum(d["steps"] for d in busy) - graph
    graph_ms = sum((steps(d, "graph_step_share") - steps(d, "piecewise_step_share"))
                   * d["phases"].get("gpu_graph_step", 0.0) for d in busy)
    other_ms = sum(steps(d, "piecewise_step_share") * d["phases"].get("gpu_piecewise_step", 0.0)
                   + (d["steps"] - steps(d, "graph_step_share"))
                   * d["phases"].get("gpu_other_step", 0.0) for d in busy)
    prompt = sum(d["prompt"] for d in busy)
    generated = sum(d["generated"] for d in busy)
    return {"cores": len(cores), "lines": len(busy),
            "graph_steps": round(graph), "graph_step_ms": round(graph_ms / max(graph, 1), 2),
            "other_steps": round(other), "other_step_ms": round(other_ms / max(other, 1), 2),
            "other_steps_piecewise": round(piecewise),
            "prompt_tokens_per_other_step": round(prompt / max(other, 1)),
            "graph_share": round(graph / (graph + other), 3),
            "gpu_ms_per_generated_token": round((graph_ms + other_ms) / generated, 4),
            "prompt_tokens_per_generated_token": round(prompt / generated, 3)}


def caveats(s: dict) -> list[str]:
    """What a summary cannot tell apart, from its form: logs of the engine's earlier labels."""
    out = []
    if s and s["other_steps"] < 1 and s["prompt_tokens_per_generated_token"] > 0:
        out.append("prompt tokens but no step carrying them: a log written before the cores "
                   "told steps cut at attention from decode graphs (piecewise_step_share)")
    if s and s["graph_steps"] < 1 and s["other_steps_piecewise"] > 0:
        out.append("no decode graph step, graph steps all cut at attention: every step carried "
                   "prompt tokens, or a log written from 2592aaa to 7acd8ee, which counted the "
                   "decode graph's steps as cut when their rows fit the cut graphs (1461ff3)")
    return out


def table(rows: list[tuple[str, dict]]) -> str:
    out = ["| log | decode graph steps x GPU ms | other steps x GPU ms (prompt tokens each; of "
           "them cut at attention) | graph share | GPU ms / generated token | prompt tokens / "
           "generated token |",
           "| --- | --- | --- | ---: | ---: | ---: |"]
    for name, s in rows:
        out.append(f"| {name} | {s['graph_steps']} x {s['graph_step_ms']} | {s['other_steps']} x "
                   f"{s['other_step_ms']} ({s['prompt_tokens_per_other_step']}; "
                   f"{s['other_steps_piecewise']}) | "
                   f"{s['graph_share']} | {s['gpu_ms_per_generated_token']} | "
                   f"{s['prompt_tokens_per_generated_token']} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--min-generated", type=int, default=5000,
                    help="a line counts when its core generated at least this many tokens")
    args = ap.parse_args()
    rows = []
    for path in args.logs:
        with open(path, errors="replace") as f:
            s = summarize(parse(f), args.min_generated)
        for caveat in caveats(s):
            print(f"{path}: {caveat}")
        if s:
            rows.append((path, s))
        else:
            print(f"{path}: no busy step-log line with GPU times")
    if rows:
        print(table(rows))


if __name__ == "__main__":
    main()
