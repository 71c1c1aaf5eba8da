"""Helpers shared by the tests and scripts that compare greedy runs: a shared-prefix prompt set
(tests/test_prefix_sharing.py, tests/test_gpu_engine.py, scripts/bf16_tie_control.py) and where
two greedy runs part (the bf16 comparisons of the GPU tests and their control script)."""
from __future__ import annotations

import random


def shared_prefix_workload(seed=0, vocab=1000, shuffle=True):
    """Groups of 2, 3, 5 and 6 over prefixes of 40 to 160 tokens (not whole blocks), a pair
    sharing one group's prefix and more, and lone prompts; own parts of 1 to 40 tokens."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    prompts = []
    for size, prefix_len in ((2, 40), (3, 100), (5, 64), (6, 160)):
        prefix = tok(prefix_len)
        prompts += [prefix + tok(rng.randint(1, 40)) for _ in range(size)]
    doc = prompts[-1][:160] + tok(48)
    prompts += [doc + tok(rng.randint(1, 10)) for _ in range(2)]
    prompts += [tok(rng.randint(1, 120)) for _ in range(4)]
    if shuffle:
        rng.shuffle(prompts)
    return prompts


def greedy_partings(got, want) -> tuple[int, float, list[tuple[int, float]]]:
    """Two greedy runs of the same prompts (outputs with logprobs >= 2): how many sequences
    match whole; the largest difference of a chosen token's logprob up to where its sequence
    parts; and per parted sequence (token index, top-2 logprob gap of `want` there)."""
    same, drift, gaps = 0, 0.0, []
    for g, w in zip(got, want):
        a, b = g.outputs[0].token_ids, w.outputs[0].token_ids
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        for i in range(k):          # both chose the same token here
            drift = max(drift, abs(g.outputs[0].logprobs[i][a[i]].logprob
                                   - w.outputs[0].logprobs[i][b[i]].logprob))
        if a == b:
            same += 1
            continue
        top = sorted((lp.logprob for lp in w.outputs[0].logprobs[k].values()), reverse=True)
        gaps.append((k, round(top[0] - top[1], 4)))
    return same, drift, gaps
