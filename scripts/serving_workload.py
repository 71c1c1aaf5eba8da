"""The prompts of scripts/bench_serving.py's rounds: what each round sends, and the text.

Every round's prompts are new to the engine that runs it; with shared prefixes, each group of
consecutive prompts starts with the same text (a system prompt, a document), new in every round.
"""
from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIN_REQUESTS = 8


def make_prompts(model_dir: str, num: int, num_tokens: int, shared_tokens: int = 0,
                 group_size: int = 1) -> list[str]:
    """`num` distinct prompts of about `num_tokens` tokens: a numbered line, then corpus text
    from a different offset each (no two share a first KV block: none is served from
    another's prefix cache).

    With `shared_tokens`, each run of `group_size` consecutive prompts (prompt i is in group
    i // group_size) starts with the same text of about `shared_tokens` tokens, a different one
    per group (its own numbered line, then corpus text from its own offset), and a prompt's
    own `num_tokens` come after it: a system prompt or a document that requests share."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    with open(os.path.join(ROOT, "data", "tiny_corpus.txt")) as f:
        corpus = " ".join(f.read().split())
    corpus_ids = tok.encode(" " + corpus, add_special_tokens=False)

    def text(head: str, num_tokens: int, offset: int) -> str:
        head_ids = tok.encode(head, add_special_tokens=False)
        start = offset % len(corpus_ids)
        body = (corpus_ids[start:] + corpus_ids * (1 + num_tokens // len(corpus_ids)))
        return tok.decode(head_ids + body[:max(num_tokens - 1 - len(head_ids), 0)])
    shared = {}
    prompts = []
    for i in range(num):
        prompt = text(f"Request {i}:", num_tokens, i * 37)
        if shared_tokens:
            g = i // group_size
            if g not in shared:
                shared[g] = text(f"Document {g}:", shared_tokens, g * 7919 + 13) + "\n"
            prompt = shared[g] + prompt
        prompts.append(prompt)
    return prompts


def num_requests(args, c: int) -> int:
    return max(args.waves * c, MIN_REQUESTS)


class PromptRounds:
    """Which prompts each round sends. Every round's prompts are new to the engine that runs
    it (an earlier round's would be answered from the prefix cache, skipping their prefill:
    a warm-up round on the same prompts made every later round look faster), and the direct
    and the first served round at a concurrency send the same prompts; a server's later
    rounds at that concurrency (other models, other drivers) get prompts of their own."""

    def __init__(self, args) -> None:
        # --reuse-prompts: every round sends the warm-up's prompts again, their prefill
        # answered from the prefix cache: steps are nearly all decode, tokens come at the
        # highest rate, the hardest case for the response path.
        self.reuse = getattr(args, "reuse_prompts", False)
        # With shared prefixes, every round starts on a group's first prompt: no round meets a
        # prefix an earlier round left in the cache.
        shared = getattr(args, "shared_prefix_tokens", 0)
        self.align = getattr(args, "group_size", 1) if shared else 1
        self.n = {c: num_requests(args, c) for c in args.concurrency}
        self.offsets = {"warm": 0}
        pos = self._up(max(self.n.values()))
        for c in args.concurrency:
            self.offsets[c] = pos
            pos = self._up(pos + self.n[c])
        self._next = pos
        self._served: set = set()
        # Enough for every round: a warm-up, then each concurrency per model and driver.
        self.total = pos + (sum(map(self._up, self.n.values()))
                            * len(args.models) * len(args.drivers))

    def _up(self, i: int) -> int:
        return -(-i // self.align) * self.align

    def warm(self) -> int:
        return self.offsets["warm"]

    def direct(self, c: int) -> int:
        return self.offsets["warm" if self.reuse else c]

    def served(self, c: int) -> int:
        if self.reuse:
            return self.offsets["warm"]
        if c not in self._served:
            self._served.add(c)
            return self.offsets[c]
        first = self._next
        self._next = self._up(first + self.n[c])
        return first
