"""Host time an offline job spends on its prompts before the first step: `LLM.generate` checks
every prompt's token ids (engine.llm.encode_prompt) and finds the shared prefixes
(engine.prefix_groups.group_prompts) before it schedules anything, so the GPU waits for both.
The prompts are scripts/bench_shared_prefix.py's for a workload (default issue 12's RFC job),
in shuffled order. --generate also times the whole intake of `LLM.generate` (every check, the
output processor, the grouping, the scheduler's groups) up to its first step, on a tiny model
made for it on CPU (its own vocabulary), first call and median of the rest, with its phases
(`LLM.intake_s`), once with prefix groups and once without; the engine itself runs no step.

    python3 scripts/bench_prompt_intake.py [--generate] --out benchmarks/prompt_intake
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.llm import encode_prompt  # noqa: E402
from engine.prefix_groups import group_prompts  # noqa: E402
from scripts.bench_common import PRESETS, git_commit, hardware, write_results  # noqa: E402
from scripts.bench_shared_prefix import make_prompts, parse_workload  # noqa: E402


def median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class _FirstStep(Exception):
    pass


def generate_intake_s(w: dict, repeats: int, groups: bool = True) -> tuple[list[float], list[dict]]:
    """Seconds from LLM.generate's call to its first step, `repeats` calls on fresh prompt lists
    (the first is the one an offline job pays once), each call's requests aborted after; and
    each call's phases (LLM.intake_s). groups: prefix groups on (issue 12's groups mode) or off
    (prefix caching alone)."""
    import tempfile

    from engine import LLM, SamplingParams
    from scripts.make_tiny_model import make_tiny_model
    max_len = -(-(w["prefix"] + w["own"] + 1) // 16) * 16
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(tmp, max_position_embeddings=max(max_len, 1024))
        llm = LLM(str(model), dtype="float32", device="cpu", max_model_len=max_len,
                  num_kv_blocks=max_len // 16 + 8, enable_prefix_groups=groups)
    vocab = llm.core.vocab_size

    def stop():
        raise _FirstStep
    llm.core.step = stop
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times, phases = [], []
    for i in range(repeats):
        prompts = make_prompts(w, "shuffled", vocab, seed=i)
        t0 = time.perf_counter()
        try:
            llm.generate(prompts, params)
        except _FirstStep:
            times.append(time.perf_counter() - t0)
            phases.append(dict(llm.intake_s))
        llm.core.abort_requests(list(llm.core.scheduler.requests))
        del prompts
    return times, phases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="rfc", help="as bench_shared_prefix.py's: rfc or g<degree>-p<prefix>")
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--own-len", type=int, default=200)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--generate", action="store_true", help="also time LLM.generate's whole intake")
    ap.add_argument("--out", required=True, help="results prefix (.json and .md)")
    args = ap.parse_args()
    w = parse_workload(args.workload, args.num_requests, args.own_len, 1)
    prompts = make_prompts(w, "shuffled", PRESETS["llama-3.1-8b"]["vocab_size"])
    encode_s = median_s(lambda: [encode_prompt(None, p) for p in prompts], args.repeats)
    group_s = median_s(lambda: group_prompts(prompts, args.block_size), args.repeats)
    row = {"workload": w["name"], "num_requests": len(prompts), "degree": w["degree"], "prefix_len": w["prefix"],
           "own_len": w["own"], "token_ids": sum(map(len, prompts)), "encode_prompt_s": encode_s,
           "group_prompts_s": group_s}
    head, rule, cells = "| requests | token ids | encode_prompt s | group_prompts s |", "| ---: | ---: | ---: | ---: |", \
        f"| {len(prompts)} | {row['token_ids']:,} | {encode_s:.3f} | {group_s:.3f} |"
    if args.generate:
        del prompts
        for groups, label in ((True, ""), (False, "_no_groups")):
            times, phases = generate_intake_s(w, max(args.repeats, 2), groups)
            median_phases = {k: statistics.median(p[k] for p in phases[1:]) for k in phases[0]}
            row.update({f"generate_intake{label}_first_s": times[0],
                        f"generate_intake{label}_s": statistics.median(times[1:]),
                        f"generate_intake{label}_phases_first_s": phases[0],
                        f"generate_intake{label}_phases_s": median_phases})
            name = "generate intake s (first / median)" if groups else "without groups"
            head, rule = head + f" {name} |", rule + " ---: |"
            cells += (f" {times[0]:.3f} / {row[f'generate_intake{label}_s']:.3f} ("
                      + ", ".join(f"{k} {v:.3f}" for k, v in median_phases.items()) + ") |")
    meta = {"title": "Host time on an offline job's prompts before its first step",
            "hardware": hardware(), "commit": git_commit(), "command": " ".join(["python3"] + sys.argv)}
    write_results(args.out, meta, [row], [head, rule, cells])


if __name__ == "__main__":
    main()
