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
    text; `step` does both with the tokenizer.

    The text is the same however the tokens arrive (one a step, many per call, all at the
    end), which is what a byte that never becomes a character needs care for: a byte-fallback
    decoder (SentencePiece's <0xNN> tokens) turns a whole run of byte tokens with an invalid
    one in it into U+FFFD, the characters already sent with it. Such a window is taken one
    token at a time, the unread tokens' text is read on its own where a token rewrote sent
    text, and later windows start after the invalid byte (vLLM resets its decoder there)."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # The context is chosen at the first step (a decode, off the prompts' intake).
        self.ids: list[int] | None = None
        self._prompt_tail = list(prompt_token_ids[-_MAX_PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = 0
        self._num_new = 0                       # tokens the last `windows` call added
        self._prompt_end = 0                    # where the output starts in `ids`

    def _decode(self, ids: list[int]) -> str:
        return _decode(self.tokenizer, ids, self.skip_special_tokens)

    def _prompt_context(self) -> tuple[list[int], int]:
        """The prompt's last tokens to decode the output beside, and where the output starts
        among them. A token-id prompt may end with a character's first bytes: they are left
        unread, so that an output completing the character gives it whole (as vLLM does);
        `complete` reads them as the prompt's again if the output does not."""
        tail = self._prompt_tail
        for n in range(min(_PROMPT_CONTEXT, len(tail)), len(tail) + 1):
            if "\ufffd" not in self._decode(tail[-n:]):
                return tail[-n:], n
        if self._decode(tail).endswith("\ufffd"):
            for num_first_bytes in (1, 2, 3):
                end = len(tail) - num_first_bytes
                context = tail[max(0, end - _PROMPT_CONTEXT):end]
                if end > 0 and "\ufffd" not in self._decode(context):
                    return context + tail[end:], len(context)
        return tail, len(tail)

    def windows(self, new_token_ids: list[int]) -> tuple[list[int], list[int]]:
        """Adds tokens; returns the ids to decode without and with the unread ones."""
        if self.ids is None:
            self.ids, self.read_offset = self._prompt_context()
            self._prompt_end = len(self.ids)
        self.ids.extend(new_token_ids)
        self._num_new = len(new_token_ids)
        return self.ids[self.prefix_offset:self.read_offset], self.ids[self.prefix_offset:]

    def complete(self, prefix_text: str, full_text: str, final: bool = False) -> str:
        """The text the new tokens complete, from the decoded windows; `final` flushes an
        incomplete tail."""
        if prefix_text == "" and "\ufffd" in full_text and self.prefix_offset < self.read_offset:
            widened = self._widened_prefix()
            if widened is not None:
                return self.complete(widened, self._decode(self.ids[self.prefix_offset:]), final)
        new_text = full_text[len(prefix_text):]
        if "\ufffd" not in full_text or ("\ufffd" not in new_text
                                         and full_text.startswith(prefix_text)):
            if not final and len(full_text) <= len(prefix_text):
                return ""                       # nothing visible yet (a skipped special token)
            return self._advance(new_text)
        if self._num_new > 1:
            return self._one_token_at_a_time(final)
        if self.read_offset < self._prompt_end:
            # The prompt's last bytes, unread: while they and the output may still make a
            # character, wait; once not, they are the prompt's (read, not sent).
            if not final and full_text.endswith("\ufffd"):
                return ""
            self.read_offset = self._prompt_end
            return self.complete(self._decode(self.ids[self.prefix_offset:self.read_offset]),
                                 self._decode(self.ids[self.prefix_offset:]), final)
        if full_text.startswith(prefix_text):
            if not final and full_text.endswith("\ufffd"):
                return ""                       # a character's first bytes: wait for the rest
            return self._read_past_invalid(new_text)
        # The token rewrote text already sent: an invalid byte joined its run of bytes. The
        # unread tokens' own text, split after the bytes that can no longer be a character.
        unread = self.ids[self.read_offset:]
        whole = self._decode(unread)
        for j in range(1, len(unread)):
            rest = self._decode(unread[j:])
            # A rest that reads as nothing (skipped special tokens) does not end the bytes'
            # run: decode drops those tokens, and the bytes after them may complete it.
            if rest and "\ufffd" not in rest:
                dead = self._decode(unread[:j])
                if whole.startswith(dead) and "\ufffd" not in whole[len(dead):]:
                    rest = whole[len(dead):]    # with the context of the dead bytes (a space)
                self.prefix_offset = self.read_offset + j
                self.read_offset = len(self.ids)
                return dead + rest
        if not final and whole.endswith("\ufffd"):
            return ""
        return self._read_past_invalid(whole)

    def _widened_prefix(self) -> str | None:
        """The sent tokens of the window read as nothing (a leading space a Strip decoder
        drops, skipped special tokens), so a new byte that turned them into U+FFFD would not
        show as rewriting sent text. Starts the window at up to 8 earlier tokens (a character's
        bytes, skipped tokens among them), the fewest that read as some text without U+FFFD;
        returns that text (None: no such start)."""
        for start in range(self.prefix_offset - 1, max(-1, self.prefix_offset - 9), -1):
            text = self._decode(self.ids[start:self.read_offset])
            if text and "\ufffd" not in text:
                self.prefix_offset = start
                return text
        return None

    def _read_past_invalid(self, new_text: str) -> str:
        """Reads the unread tokens as `new_text`; if that holds an invalid byte, later windows
        start past it, so that it spoils no later run of bytes: at the shortest tail of what
        was just read that decodes whole (for its leading space), else after it."""
        start = self.read_offset
        text = self._advance(new_text)
        if "\ufffd" in text:
            self.prefix_offset = self.read_offset
            for k in range(1, min(4, self.read_offset - start) + 1):
                if "\ufffd" not in self._decode(self.ids[self.read_offset - k:self.read_offset]):
                    self.prefix_offset = self.read_offset - k
                    break
        return text

    def _advance(self, new_text: str) -> str:
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return new_text

    def _one_token_at_a_time(self, final: bool) -> str:
        """A window of several tokens with text that is not whole in it: the steps one token
        each would have taken (rare: only around bytes that are not characters)."""
        pending = self.ids[-self._num_new:]
        del self.ids[-self._num_new:]
        pieces = []
        for i, token_id in enumerate(pending):
            prefix, full = self.windows([token_id])
            pieces.append(self.complete(self._decode(prefix), self._decode(full),
                                        final and i == len(pending) - 1))
        return "".join(pieces)

    def step(self, new_token_ids: list[int], final: bool = False) -> str:
        """Adds tokens; returns the text they complete. `final` flushes an incomplete tail."""
        prefix, full = self.windows(new_token_ids)
        return self.complete(self._decode(prefix), self._decode(full), final)


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
