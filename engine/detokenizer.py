"""Incremental detokenization and stop strings.

Byte-level BPE splits a multi-byte character over several tokens; decoding a partial one gives
U+FFFD. So each step decodes a short window of recent tokens twice (without and with the new
ones) and emits the difference only once it no longer ends in U+FFFD. Cost per step is a few
tokens, not the whole output.
"""
from __future__ import annotations

# Tokens of the prompt kept as left context: enough for tokenizers whose decoding of a token
# depends on its neighbours (leading-space rules), small enough to stay cheap.
_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def step(self, new_token_ids: list[int], final: bool = False) -> str:
        """Adds tokens; returns the text they complete. `final` flushes an incomplete tail."""
        self.ids.extend(new_token_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset:])
        if not final and (len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd")):
            return ""
        new_text = full_text[len(prefix_text):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return new_text


class StopStringMatcher:
    """Finds the first stop string in the output text; while streaming, holds back the last
    `max_len - 1` characters, which could be the start of a stop string."""

    def __init__(self, stop: list[str], include_stop_str_in_output: bool = False) -> None:
        self.stop = list(stop)
        self.include = include_stop_str_in_output
        self.holdback = max((len(s) for s in self.stop), default=1) - 1

    def find(self, text: str, num_new_chars: int) -> tuple[str, int] | None:
        """Returns (stop string, length to cut the text to) if a stop string ends inside the
        last `num_new_chars` characters."""
        if not self.stop or num_new_chars == 0:
            return None
        best = None
        for s in self.stop:
            start = max(0, len(text) - num_new_chars - len(s) + 1)
            idx = text.find(s, start)
            if idx >= 0 and (best is None or idx < best[1]):
                best = (s, idx)
        if best is None:
            return None
        s, idx = best
        return s, idx + len(s) if self.include else idx
