"""Incremental detokenization and stop strings.

Byte-level BPE splits a multi-byte character over several tokens; decoding a partial one gives
U+FFFD. So each step decodes a short window of recent tokens twice (without and with the new
ones) and emits the difference only once it no longer ends in U+FFFD. Cost per step is a few
tokens, not the whole output; a step's requests are decoded together (batch_decoder).
"""
from __future__ import annotations

from collections.abc import Callable

# Tokens of the prompt kept as left context: enough for tokenizers whose decoding of a token
# depends on its neighbours (leading-space rules), small enough to stay cheap. More where those
# begin inside a character: a SentencePiece byte-fallback decoder turns a whole run of byte
# tokens with an incomplete character in it into U+FFFD, the output's first bytes with it. So
# the context is the shortest prompt tail of at least _PROMPT_CONTEXT tokens that decodes
# without U+FFFD, up to _MAX_PROMPT_CONTEXT (as vLLM chooses its own).
_PROMPT_CONTEXT = 5
_MAX_PROMPT_CONTEXT = 24

# decode_many(id lists, skip_special_tokens) -> their texts, each as tokenizer.decode gives it
DecodeMany = Callable[[list[list[int]], bool], list[str]]


def _decode(tokenizer, ids: list[int], skip: bool) -> str:
    """tokenizer.decode without its clean-up of spaces: that rewrites text across token
    boundaries (" ' s" -> "'s"), so a window's text would not be a prefix of the next one's and
    incremental text would lose characters. vLLM's incremental text does without it too."""
    return tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def batch_decoder(tokenizer) -> DecodeMany:
    """Decodes many id lists in one call. For a fast (Rust) tokenizer that is its backend's
    decode without the Python around it (3x less time: a step of 256 streams decodes 512
    lists, and this was most of the serving reader thread's time). Used only if it gives
    exactly what tokenizer.decode gives (without clean-up, _decode) on a probe of the
    vocabulary; otherwise tokenizer.decode."""
    def slow(seqs: list[list[int]], skip: bool) -> list[str]:
        return [_decode(tokenizer, ids, skip) for ids in seqs]

    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "decode_batch"):
        return slow

    # The backend's decode per list, not its decode_batch: that one lets go of the GIL and
    # hands the lists to a thread pool, slower for a few tokens each, and getting the GIL
    # back meant waiting behind the other threads of the server.
    decode = backend.decode

    def fast(seqs: list[list[int]], skip: bool) -> list[str]:
        return [decode(ids, skip_special_tokens=skip) for ids in seqs]

    vocab = len(tokenizer)
    probe = [list(range(i, min(i + 3, vocab))) for i in range(0, min(vocab, 3000), 3)]
    probe += [[i] for i in getattr(tokenizer, "all_special_ids", [])]
    if len(probe) >= 3:
        probe += [probe[1] + [i] + probe[2] for i in getattr(tokenizer, "all_special_ids", [])]
    try:
        if all(fast(probe, skip) == slow(probe, skip) for skip in (True, False)):
            return fast
    except Exception:  # noqa: BLE001 - any surprise: the plain path
        pass
    return slow


class IncrementalDetokenizer:
    """One request's detokenization. Per step: `windows(new ids)` gives the two id lists to
    decode (so that a caller can decode many requests' at once), `complete(texts)` the new
    text; `step` does both with the tokenizer."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # The context is chosen at the first step (a decode, off the prompts' intake).
        self.ids: list[int] | None = None
        self._prompt_tail = list(prompt_token_ids[-_MAX_PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = 0

    def _prompt_context(self) -> list[int]:
        tail = self._prompt_tail
        for n in range(_PROMPT_CONTEXT, len(tail)):
            if "\ufffd" not in _decode(self.tokenizer, tail[-n:], self.skip_special_tokens):
                return tail[-n:]
        return tail

    def windows(self, new_token_ids: list[int]) -> tuple[list[int], list[int]]:
        """Adds tokens; returns the ids to decode without and with the unread ones."""
        if self.ids is None:
            self.ids = self._prompt_context()
            self.read_offset = len(self.ids)
        self.ids.extend(new_token_ids)
        return self.ids[self.prefix_offset:self.read_offset], self.ids[self.prefix_offset:]

    def complete(self, prefix_text: str, full_text: str, final: bool = False) -> str:
        """The text the new tokens complete, from the decoded windows; `final` flushes an
        incomplete tail."""
        if not final and (len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd")):
            return ""
        new_text = full_text[len(prefix_text):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return new_text

    def step(self, new_token_ids: list[int], final: bool = False) -> str:
        """Adds tokens; returns the text they complete. `final` flushes an incomplete tail."""
        prefix, full = self.windows(new_token_ids)
        skip = self.skip_special_tokens
        return self.complete(_decode(self.tokenizer, prefix, skip),
                             _decode(self.tokenizer, full, skip), final)


class StopStringMatcher:
    """Finds the first stop string in the output text; while streaming, holds back the last
    `max_len - 1` characters, which could be the start of a stop string to be cut. With
    include_stop_str_in_output nothing is held back (as vLLM): the text is cut where a stop
    string ends, always within the step that completes it, after all that was sent."""

    def __init__(self, stop: list[str], include_stop_str_in_output: bool = False) -> None:
        self.stop = list(stop)
        self.include = include_stop_str_in_output
        self.holdback = (0 if include_stop_str_in_output
                         else max((len(s) for s in self.stop), default=1) - 1)

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
