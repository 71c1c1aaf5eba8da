import asyncio
import os
import re
import signal
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from transformers import AutoTokenizer

from engine import wire
from engine.tokenize import (_PROBES, BATCH_MAX_CHARS, BatchTokenizer, PromptDropped,
                             TokenizerClosed, TokenizerProcess)
from scripts.make_tiny_model import make_tiny_model
from tests.waiting import until

TEXTS = ["Hello there", "  spaces  and\ttabs\n", "naïve café ☕ 日本語 🙂", "x" * 5000,
         "The end."]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("m") / "llama", arch="llama", seed=1)
    return AutoTokenizer.from_pretrained(path)


def test_fast_path_is_used_and_equals_encode(tokenizer):
    bt = BatchTokenizer(tokenizer, None, max_num_tokens=10**6)
    assert bt._backend is not None             # this tokenizer has the ids-only batch call
    for inline in (False, True):
        for text, (ids, packed) in zip(TEXTS, bt.encode_now(TEXTS, inline=inline)):
            assert ids == tokenizer.encode(text)
            assert packed.tolist() == ids and packed.dtype.name == "int32"


def test_plain_path_equals_encode(tokenizer):
    bt = BatchTokenizer(tokenizer, None, max_num_tokens=10**6)
    bt._backend = None
    assert [r[0] for r in bt.encode_now(TEXTS)] == [tokenizer.encode(t) for t in TEXTS]


def test_too_long_is_an_error_found_on_the_tokenizer_thread(tokenizer):
    bt = BatchTokenizer(tokenizer, None, max_num_tokens=8)
    ok, too_long = bt.encode_now(["hi", "a much longer prompt than eight tokens, surely"])
    assert ok[0] == tokenizer.encode("hi")
    assert isinstance(too_long, ValueError) and "max_model_len (8)" in str(too_long)


def test_prompts_arriving_together_share_one_call_and_long_ones_go_alone(tokenizer):
    pool = ThreadPoolExecutor(1)
    bt = BatchTokenizer(tokenizer, pool, max_num_tokens=10**6)
    long_text = "y " * (BATCH_MAX_CHARS // 2 + 10)
    texts = [long_text] + [f"prompt number {i}" for i in range(20)] + [long_text + "z"]
    order = []
    real = bt.encode_now
    bt.encode_now = lambda batch: order.append(len(batch)) or real(batch)

    async def main():
        gate = threading.Event()
        pool.submit(gate.wait)                 # hold the thread: all 21 prompts queue up
        tasks = [asyncio.create_task(bt.encode(t)) for t in texts]
        # every prompt queued behind the held thread
        await until(lambda: len(bt._pending) >= len(texts), "every prompt queued", poll_s=0)
        gate.set()
        return await asyncio.gather(*tasks)

    try:
        results = asyncio.run(main())
    finally:
        pool.shutdown()
    assert [r[0] for r in results] == [tokenizer.encode(t) for t in texts]
    assert order == [20, 1, 1]    # the short ones first and together, though a long one came first


def _batch_tokenizer(tokenizer, path):
    """A BatchTokenizer on a one-thread pool, with a tokenizer process where `path` says so."""
    pool = ThreadPoolExecutor(1)
    bt = BatchTokenizer(tokenizer, pool, max_num_tokens=10**6,
                        process_priority="idle" if path == "process" else None)
    assert (bt.process is not None) == (path == "process")
    return bt, pool


async def _in_one_call(bt, pool, texts):
    """Each text's result, the texts queued while the thread is held so they go in one call."""
    gate = threading.Event()
    pool.submit(gate.wait)
    tasks = [asyncio.create_task(bt.encode(t)) for t in texts]
    await until(lambda: len(bt._pending) == len(texts), "every prompt queued", poll_s=0)
    gate.set()
    return await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.parametrize("path", ["thread", "process", "inline", "no_fast_backend"])
def test_a_prompt_that_is_not_text_fails_alone_not_the_prompts_beside_it(tokenizer, path):
    """A str with a lone surrogate (json.loads('"\\ud800"') makes one) is no text: the
    tokenizers library (a TypeError) and the tokenizer process's frame (UTF-8) refuse it. It
    once failed every prompt of its batch call with that error; now it gets a ValueError of
    its own, and the prompts beside it their ids."""
    texts = ["a good prompt", "a bad prompt \ud800 here", "another good one " * 20]
    bt, pool = _batch_tokenizer(tokenizer, path)
    if path == "no_fast_backend":
        bt._backend = None
    try:
        results = (bt.encode_now(texts, inline=True) if path == "inline" else
                   bt.encode_now(texts) if path == "no_fast_backend" else
                   asyncio.run(_in_one_call(bt, pool, texts)))
    finally:
        bt.close()
        pool.shutdown()
    good, bad, good_too = results
    assert isinstance(bad, ValueError), bad
    assert str(bad) == ("the prompt is not valid text: surrogates not allowed at character 13 "
                        "('\\ud800')")
    assert good[0] == tokenizer.encode(texts[0]) and good_too[0] == tokenizer.encode(texts[2])


def test_a_prompt_whose_request_was_aborted_while_queued_is_never_tokenized(tokenizer):
    pool = ThreadPoolExecutor(1)
    bt = BatchTokenizer(tokenizer, pool, max_num_tokens=10**6)
    seen = []
    real = bt.encode_now
    bt.encode_now = lambda batch: seen.extend(batch) or real(batch)
    aborted = threading.Event()

    async def main():
        gate = threading.Event()
        pool.submit(gate.wait)                 # hold the thread: both prompts queue up
        kept = asyncio.create_task(bt.encode("kept prompt"))
        dropped = asyncio.create_task(bt.encode("dropped prompt", dropped=aborted.is_set))
        await until(lambda: len(bt._pending) >= 2, "both prompts queued", poll_s=0)
        aborted.set()                          # e.g. the client cancelled, from another thread
        gate.set()
        return await asyncio.gather(kept, dropped, return_exceptions=True)

    try:
        kept, dropped = asyncio.run(main())
    finally:
        pool.shutdown()
    assert kept[0] == tokenizer.encode("kept prompt") and isinstance(dropped, PromptDropped)
    assert seen == ["kept prompt"]


def test_close_fails_the_queued_prompts_at_once_and_stops_the_process(tokenizer):
    """close() (the engine's shutdown) does not wait for queued prompts to be tokenized."""
    pool = ThreadPoolExecutor(1)
    bt = BatchTokenizer(tokenizer, pool, max_num_tokens=10**6, process_priority="normal")
    proc = bt.process.process
    gate = threading.Event()

    async def main():
        pool.submit(gate.wait)                 # the thread stays busy throughout
        tasks = [asyncio.create_task(bt.encode(t)) for t in ("a b", "c d")]
        await until(lambda: len(bt._pending) >= 2, "both prompts queued", poll_s=0)
        await asyncio.get_running_loop().run_in_executor(None, bt.close)   # another thread
        results = await asyncio.gather(*tasks, return_exceptions=True)     # the thread held
        with pytest.raises(TokenizerClosed):
            await bt.encode("e f")
        return results

    try:
        results = asyncio.run(main())
    finally:
        gate.set()
        pool.shutdown()
    assert all(isinstance(r, TokenizerClosed) for r in results), results
    assert proc.poll() is not None


# ---------------------------------------------------------------------------- tokenizer process
def _nice_and_policy(pid: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()        # from field 3 on
    return int(fields[16]), int(fields[38])                # fields 19 (nice) and 41 (policy)


SCHED_IDLE = 5


@pytest.fixture
def process_tokenizer(tokenizer):
    pool = ThreadPoolExecutor(1)
    bt = BatchTokenizer(tokenizer, pool, max_num_tokens=20_000, process_priority="idle")
    yield bt
    bt.close()
    pool.shutdown()


def _encode_all(bt, texts):
    async def main():
        return await asyncio.gather(*(bt.encode(t) for t in texts), return_exceptions=True)
    return asyncio.run(main())


def test_the_process_gives_the_tokenizers_ids_and_runs_at_idle_priority(process_tokenizer,
                                                                        tokenizer):
    bt = process_tokenizer
    assert bt.process is not None and bt.process.process.poll() is None
    assert _nice_and_policy(bt.process.pid)[1] == SCHED_IDLE
    texts = TEXTS + ["", "z" * (BATCH_MAX_CHARS + 5), "é" * 900]
    results = _encode_all(bt, texts)
    for text, result in zip(texts, results):
        ids, packed = result
        assert ids == tokenizer.encode(text)
        assert packed.tolist() == ids and packed.dtype.name == "int32"


def test_the_process_sends_only_the_length_of_a_prompt_too_long(process_tokenizer, tokenizer):
    text = "many words " * 7000
    [result] = _encode_all(process_tokenizer, [text])
    assert isinstance(result, ValueError)
    assert str(result) == (f"the prompt is {len(tokenizer.encode(text))} tokens long, more "
                           f"than max_model_len (20000)")


def test_a_killed_process_leaves_the_thread_to_tokenize(process_tokenizer, tokenizer, caplog):
    bt = process_tokenizer
    proc = bt.process.process
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(5)
    texts = TEXTS + ["many words " * 7000]
    results = _encode_all(bt, texts)
    assert [r[0] for r in results[:-1]] == [tokenizer.encode(t) for t in TEXTS]
    assert isinstance(results[-1], ValueError) and "max_model_len (20000)" in str(results[-1])
    assert bt.process is None
    assert "tokenizing on the tokenizer thread from now on" in caplog.text
    assert re.search(f"the tokenizer process {proc.pid} (exited|is gone)", caplog.text)


@pytest.mark.parametrize("priority,nice_added", [("low", 10), ("normal", 0)])
def test_low_and_normal_priorities_are_niceness_10_and_0(tokenizer, priority, nice_added):
    pool = ThreadPoolExecutor(1)
    bt = BatchTokenizer(tokenizer, pool, max_num_tokens=100, process_priority=priority)
    try:
        nice, policy = _nice_and_policy(bt.process.pid)
        own_nice, own_policy = _nice_and_policy(os.getpid())
        assert (nice, policy) == (min(19, own_nice + nice_added), own_policy)
    finally:
        bt.close()
        pool.shutdown()


def test_close_ends_the_process(tokenizer):
    pool = ThreadPoolExecutor(1)
    bt = BatchTokenizer(tokenizer, pool, max_num_tokens=100, process_priority="normal")
    proc = bt.process.process
    bt.close()
    pool.shutdown()
    assert proc.returncode == 0


def test_the_process_exits_quietly_when_its_front_end_goes_away_mid_batch(tokenizer, capfd):
    backend = BatchTokenizer(tokenizer, None, 100)._backend
    proc = TokenizerProcess(backend, 100, "normal")
    try:
        proc._sock.sendall(wire.encode_tokenize(["many words " * 100_000]))
        proc._sock.shutdown(socket.SHUT_RD)        # its answer will find nobody to read it
        assert proc.process.wait(30) == 0
    finally:
        proc.close()
    assert "Traceback" not in capfd.readouterr().err


def test_the_process_answers_a_malformed_frame_with_an_error_and_exits(tokenizer):
    backend = BatchTokenizer(tokenizer, None, 100)._backend
    proc = TokenizerProcess(backend, 100, "normal")
    try:
        proc._sock.sendall(wire.frame(wire.TOKENIZE, b"\x01\x00\x00\x00\x05\x00\x00\x00ab"))
        with pytest.raises(RuntimeError, match="malformed frame: TOKENIZE: text lengths add up"):
            proc._recv()
        assert proc.process.wait(5) == 2
    finally:
        proc.close()


def test_a_process_that_disagrees_on_the_probes_is_not_used(tokenizer, caplog):
    backend = BatchTokenizer(tokenizer, None, 100)._backend
    assert TokenizerProcess.start(backend, 100, "normal", _PROBES, [[0]] * 7) is None
    assert "disagrees with the tokenizer on probe strings" in caplog.text


def test_without_a_fast_backend_there_is_no_process(tokenizer, monkeypatch):
    monkeypatch.setattr("engine.tokenize._fast_backend", lambda tok: None)
    bt = BatchTokenizer(tokenizer, ThreadPoolExecutor(1), 100, process_priority="normal")
    assert bt.process is None
    assert _encode_all(bt, ["hi"])[0][0] == tokenizer.encode("hi")


def test_a_process_that_never_gets_ready_is_given_up(tokenizer, monkeypatch, caplog):
    # A process that starts but never answers (it sleeps): start-up gives up, then kills it.
    monkeypatch.setattr("engine.tokenize.START_TIMEOUT_S", 0.5)
    monkeypatch.setattr("engine.tokenize.STOP_WAIT_S", 0.5)
    real_popen = subprocess.Popen

    def silent(cmd, **kw):
        return real_popen([cmd[0], "-c", "import time; time.sleep(60)"], **kw)
    monkeypatch.setattr("engine.child_process.subprocess.Popen", silent)
    backend = BatchTokenizer(tokenizer, None, 100)._backend
    start = time.monotonic()
    assert TokenizerProcess.start(backend, 100, "normal", [], []) is None
    assert time.monotonic() - start < 5
    assert "no tokenizer process" in caplog.text


@pytest.fixture(scope="module")
def split_special_tokenizer(tmp_path_factory):
    """split_special_tokens in tokenizer_config.json: special-token text in a prompt is plain
    text (a user cannot inject control tokens), as HF's encode and vLLM tokenize it."""
    import json
    path = make_tiny_model(tmp_path_factory.mktemp("m") / "llama", arch="llama", seed=1)
    config_path = os.path.join(str(path), "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    with open(config_path, "w") as f:
        json.dump({**config, "split_special_tokens": True}, f)
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.split_special_tokens
    return tok


SPECIAL_TEXT = "<|begin_of_text|>hello <|end_of_text|> world " + "y" * 300


def test_the_process_splits_special_tokens_when_the_tokenizer_does(split_special_tokenizer):
    tok = split_special_tokenizer
    expected = tok.encode(SPECIAL_TEXT)
    assert expected.count(tok.bos_token_id) == 1        # only the BOS the tokenizer adds
    pool = ThreadPoolExecutor(1)
    bt = BatchTokenizer(tok, pool, max_num_tokens=10_000, process_priority="idle")
    try:
        assert bt.process is not None                   # the process, not the thread
        [(ids, _)] = _encode_all(bt, [SPECIAL_TEXT])
    finally:
        bt.close()
        pool.shutdown()
    assert ids == expected


def test_a_special_token_setting_the_process_misses_sends_the_work_to_the_thread(
        split_special_tokenizer, monkeypatch, caplog):
    """The probes hold the tokenizer's own special tokens: a setting about them that does not
    reach the process (here: the flag left out of LOAD_TOKENIZER) is caught at start-up."""
    tok = split_special_tokenizer
    real = wire.encode_load_tokenizer
    monkeypatch.setattr(wire, "encode_load_tokenizer",
                        lambda n, text, special=False: real(n, text))
    pool = ThreadPoolExecutor(1)
    bt = BatchTokenizer(tok, pool, max_num_tokens=10_000, process_priority="idle")
    try:
        assert bt.process is None
        assert "disagrees with the tokenizer on probe strings" in caplog.text
        [(ids, _)] = _encode_all(bt, [SPECIAL_TEXT])
    finally:
        bt.close()
        pool.shutdown()
    assert ids == tok.encode(SPECIAL_TEXT)


def test_a_tokenizer_that_cannot_be_written_as_json_is_tokenized_on_the_thread(
        tmp_path_factory, caplog):
    from tokenizers.pre_tokenizers import PreTokenizer

    class WholeText:                # a custom (Python) pre-tokenizer: to_str() cannot write it
        def pre_tokenize(self, pretok):
            pretok.split(lambda i, normalized: [normalized])

    path = make_tiny_model(tmp_path_factory.mktemp("m") / "llama", arch="llama", seed=1)
    tok = AutoTokenizer.from_pretrained(path)
    tok._tokenizer.pre_tokenizer = PreTokenizer.custom(WholeText())
    pool = ThreadPoolExecutor(1)
    try:
        bt = BatchTokenizer(tok, pool, max_num_tokens=10_000, process_priority="idle")
        assert bt._backend is not None and bt.process is None
        assert "cannot be written as JSON" in caplog.text
        [(ids, _)] = _encode_all(bt, ["hello there " * 30])
        bt.close()
    finally:
        pool.shutdown()
    assert ids == tok.encode("hello there " * 30)


def test_a_prompt_queued_from_a_later_event_loop_is_answered_on_it(tokenizer):
    """A caller that gave up on the first loop (which then closed) left its prompt queued; a
    prompt from a second asyncio.run, queued while the thread still works for the first, is
    answered on its own loop (it was settled on the closed first one and waited for ever)."""
    pool = ThreadPoolExecutor(1)
    bt = BatchTokenizer(tokenizer, pool, max_num_tokens=10_000)
    gate = threading.Event()
    pool.submit(gate.wait)                              # the thread is busy

    async def first():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(bt.encode("first loop " * 40), 0.2)

    async def second():
        task = asyncio.ensure_future(bt.encode("second loop " * 40))
        await until(lambda: len(bt._pending) == 2, "both prompts queued")
        gate.set()
        return await asyncio.wait_for(task, 10)

    try:
        asyncio.run(first())
        ids, _ = asyncio.run(second())
    finally:
        gate.set()
        bt.close()
        pool.shutdown()
    assert ids == tokenizer.encode("second loop " * 40)


def test_the_process_cut_off_mid_frame_by_its_front_end_exits_quietly(tokenizer, capfd):
    """close() during shutdown may cut a TOKENIZE frame off mid-send: the front end has gone,
    which the process reported as a malformed frame at ERROR level (exit 2) on a normal stop."""
    backend = BatchTokenizer(tokenizer, None, 100)._backend
    proc = TokenizerProcess(backend, 100, "normal")
    try:
        frame = wire.encode_tokenize(["a prompt cut off"])
        proc._sock.sendall(frame[:len(frame) // 2])
        proc._sock.shutdown(socket.SHUT_WR)
        assert proc.process.wait(30) == 0
    finally:
        proc.close()
    err = capfd.readouterr().err
    assert "ERROR" not in err and "malformed" not in err, err


def _refusing_tokenizer(tokenizer, directory, char="\x07"):
    """A copy of `tokenizer` that refuses `char`: its ByteLevel symbol is taken out of the BPE
    vocabulary (and its merges), and the unk token is not in the vocabulary either, so encode
    raises "Unk token ... not found in the vocabulary" for any text holding it."""
    import json
    tokenizer.save_pretrained(directory)
    path = os.path.join(directory, "tokenizer.json")
    with open(path, encoding="utf-8") as f:
        d = json.load(f)
    # ByteLevel's symbol for the byte (GPT-2's map: printable bytes as themselves, the others
    # as chr(256 + their rank among the unprintable)).
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    unprintable = [b for b in range(256) if b not in printable]
    b = ord(char)
    sym = chr(b) if b in printable else chr(256 + unprintable.index(b))
    model = d["model"]
    del model["vocab"][sym]
    model["merges"] = [m for m in model["merges"]
                       if sym not in (m if isinstance(m, list) else m.split(" "))]
    model["unk_token"] = "<unk>"
    with open(path, "w", encoding="utf-8") as f:
        json.dump(d, f)
    refusing = AutoTokenizer.from_pretrained(directory)
    with pytest.raises(Exception, match="Unk token"):
        refusing.encode(f"a {char} b")
    return refusing


class _Panic(BaseException):
    """As pyo3's PanicException, which the tokenizers library raises for a Rust panic: a
    BaseException, not an Exception."""


@pytest.mark.parametrize("path", ["thread", "process", "inline", "panic on the thread"])
def test_a_prompt_the_tokenizer_refuses_fails_alone_not_the_prompts_beside_it(
        tokenizer, tmp_path, path):
    """A prompt the tokenizer refuses (an error, or a panic of the tokenizers library) failed
    every prompt of its batch call with its error, on the thread and in the tokenizer process;
    a panic (a BaseException) left the batch's callers without an answer and the thread's
    queue stopped for good. Now it alone gets a ValueError, the prompts beside it their ids,
    and later prompts are tokenized."""
    refusing = _refusing_tokenizer(tokenizer, tmp_path / "tok")
    texts = ["a good prompt", "a bell: \x07 here", "another good one " * 20]
    bt, pool = _batch_tokenizer(refusing, path)
    if path == "panic on the thread":
        backend = bt._backend

        class Panicking:
            def __getattr__(self, name):
                return getattr(backend, name)

            def encode_batch_fast(self, batch, **kwargs):
                if any("\x07" in t for t in batch):
                    raise _Panic("called `Option::unwrap()` on a `None` value")
                return backend.encode_batch_fast(batch, **kwargs)

            def encode(self, text, **kwargs):
                if "\x07" in text:
                    raise _Panic("called `Option::unwrap()` on a `None` value")
                return backend.encode(text, **kwargs)
        bt._backend = Panicking()

    async def together():
        return await _in_one_call(bt, pool, texts), await bt.encode("a later prompt")

    try:
        if path == "inline":
            results, later = bt.encode_now(texts, inline=True), bt.encode_now(["a later one"])[0]
        else:
            results, later = asyncio.run(together())
    finally:
        bt.close()
        pool.shutdown()
    good, bad, good_too = results
    assert isinstance(bad, ValueError), bad
    assert str(bad).startswith("tokenization failed: ")
    assert good[0] == refusing.encode(texts[0]) and good_too[0] == refusing.encode(texts[2])
    assert not isinstance(later, BaseException) and len(later[0]) > 0
