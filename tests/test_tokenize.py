import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from transformers import AutoTokenizer

from engine.tokenize import BATCH_MAX_CHARS, BatchTokenizer
from scripts.make_tiny_model import make_tiny_model

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
        while len(bt._pending) < len(texts):   # every prompt queued behind the held thread
            await asyncio.sleep(0)
        gate.set()
        return await asyncio.gather(*tasks)

    try:
        results = asyncio.run(main())
    finally:
        pool.shutdown()
    assert [r[0] for r in results] == [tokenizer.encode(t) for t in texts]
    assert order == [20, 1, 1]    # the short ones first and together, though a long one came first
