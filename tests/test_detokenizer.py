import pytest

from engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from scripts.make_tiny_model import train_tokenizer

TEXTS = [
    "plain ascii text, nothing special.",
    "Zürich naïve café — Ελληνικά и русский",
    "日本語のテキストと中文混合",
    "emoji 🙂🚀👩‍💻 end",
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return train_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode_and_never_emits_broken_chars(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    prompt = tok.encode("Prompt: ")
    detok = IncrementalDetokenizer(tok, prompt)
    pieces = [detok.step([t]) for t in ids]
    pieces.append(detok.step([], final=True))
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_multibyte_char_split_over_tokens_is_held_back(tok):
    # Byte-level BPE: a rare CJK character usually becomes several byte tokens.
    text = "𝄞"      # 4 bytes in UTF-8
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > 1, "the test needs a character split over tokens"
    detok = IncrementalDetokenizer(tok, [])
    outs = [detok.step([t]) for t in ids]
    assert outs[:-1] == [""] * (len(ids) - 1) and outs[-1] == text


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("hello") + [tok.eos_token_id]
    skip = IncrementalDetokenizer(tok, [])
    keep = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    assert "".join(skip.step([t]) for t in ids) == tok.decode(ids, skip_special_tokens=True)
    assert "".join(keep.step([t]) for t in ids).endswith(tok.eos_token)


def test_stop_matcher_finds_earliest_and_cuts():
    m = StopStringMatcher(["END", "ST"])
    assert m.holdback == 2
    assert m.find("abcdef", 3) is None
    assert m.find("xxSTyyEND", 9) == ("ST", 2)
    assert StopStringMatcher(["END"], include_stop_str_in_output=True).find("abEND", 2) == ("END", 5)


def test_stop_matcher_only_looks_at_new_text_plus_overlap():
    m = StopStringMatcher(["abc"])
    # "abc" already in old text (before the last 1 new char and outside the overlap): ignored.
    assert m.find("abc" + "zzzz" + "q", 1) is None
    # Spanning the old/new boundary is found.
    assert m.find("zzzab" + "c", 1) == ("abc", 3)
