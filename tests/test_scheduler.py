"""Scheduler tests with a fake runner: the 'model' picks the next token as a hash of the whole
sequence so far, so outputs are deterministic and any scheduling mistake changes them."""
import random

import pytest

from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import ModelRunnerOutput, Scheduler

VOCAB = 1000


def next_token(tokens):
    return hash(tuple(tokens)) % VOCAB


class FakeRunner:
    """Mirrors the runner's side of the protocol: keeps block tables from the diffs and checks
    them against the manager each step."""

    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.block_ids: dict[str, list[int]] = {}
        self.slot_token: dict[tuple[int, int], int] = {}
        self.max_tokens_in_step = 0
        self.max_seqs_in_step = 0

    def step(self):
        s = self.sched
        out = s.schedule()
        for rid in out.finished_request_ids:
            self.block_ids.pop(rid, None)
        for new in out.new_requests:
            self.block_ids[new.request_id] = list(new.block_ids)
        c = out.cached_requests
        for rid, new_ids in zip(c.request_ids, c.new_block_ids):
            self.block_ids[rid].extend(new_ids)
        for rid in out.num_scheduled_tokens:
            # A block given back behind a sliding window stays in the runner's table, unread.
            kv_ids = s.kv.block_ids(rid)
            assert len(kv_ids) == len(self.block_ids[rid]), rid
            assert all(k is None or k == mine for k, mine in zip(kv_ids, self.block_ids[rid])), rid
        # The KV model: each slot holds the token last written there. After this step's
        # writes, every position a scheduled request attends to must hold its own token.
        bs = s.kv.block_size
        writers = {}
        for rid, n in out.num_scheduled_tokens.items():
            req = s.requests[rid]
            for pos in range(req.num_computed_tokens - n, req.num_computed_tokens):
                slot = (self.block_ids[rid][pos // bs], pos % bs)
                assert slot not in writers, f"{rid} and {writers[slot]} write one slot"
                writers[slot] = rid
                self.slot_token[slot] = req.all_token_ids[pos]
        window = s.kv.sliding_window
        for rid, n in out.num_scheduled_tokens.items():
            req = s.requests[rid]
            first_query = req.num_computed_tokens - n
            first = 0 if window is None else max(0, first_query - window + 1)
            for pos in range(first, req.num_computed_tokens):
                slot = (self.block_ids[rid][pos // bs], pos % bs)
                assert self.slot_token.get(slot) == req.all_token_ids[pos], (rid, pos)
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        assert out.total_num_scheduled_tokens <= s.max_num_batched_tokens
        assert len(s.running) <= s.max_num_seqs
        self.max_tokens_in_step = max(self.max_tokens_in_step, out.total_num_scheduled_tokens)
        self.max_seqs_in_step = max(self.max_seqs_in_step, len(out.num_scheduled_tokens))
        rids, toks = [], []
        for rid in out.num_scheduled_tokens:
            req = s.requests[rid]
            if req.num_computed_tokens == req.num_tokens:
                rids.append(rid)
                toks.append(next_token(req.all_token_ids))
        return out, s.update_from_output(out, ModelRunnerOutput(rids, toks))


def make(num_blocks=1000, block_size=4, max_num_seqs=64, max_tokens_step=512,
         max_model_len=4096, caching=True, policy="max_utilization", hold=0, window=None):
    kv = KVCacheManager(num_blocks, block_size, caching, window)
    return Scheduler(kv, max_num_seqs, max_tokens_step, max_model_len, policy, hold)


def run_all(sched, prompts, max_tokens=8, min_tokens=0):
    reqs = {}
    for i, p in enumerate(prompts):
        r = Request(str(i), p, SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens),
                    eos_token_ids=[])
        sched.add_request(r)
        reqs[str(i)] = r
    runner = FakeRunner(sched)
    results = {}
    steps = 0
    while sched.has_unfinished_requests():
        _, outs = runner.step()
        steps += 1
        assert steps < 10_000
        for o in outs:
            if o.finished:
                results[o.request_id] = reqs[o.request_id].output_token_ids
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    return [results[str(i)] for i in range(len(prompts))], runner


def expected(prompt, max_tokens):
    toks = list(prompt)
    for _ in range(max_tokens):
        toks.append(next_token(toks))
    return toks[len(prompt):]


def prompts(n, seed=0, lo=1, hi=60):
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def test_outputs_match_sequential_generation():
    ps = prompts(20)
    outs, _ = run_all(make(), ps)
    assert outs == [expected(p, 8) for p in ps]


def test_chunked_prefill_respects_budget_and_mixes_with_decode():
    sched = make(max_tokens_step=16)
    ps = [[1] * 3, [2] * 100]               # a short request decodes while the long one chunks
    sched.add_request(Request("short", ps[0], SamplingParams(max_tokens=20), []))
    runner = FakeRunner(sched)
    runner.step()
    sched.add_request(Request("long", ps[1], SamplingParams(max_tokens=2), []))
    mixed = 0
    while sched.has_unfinished_requests():
        out, _ = runner.step()
        if len(out.num_scheduled_tokens) == 2 and out.num_scheduled_tokens.get("long", 0) > 1:
            mixed += 1
    assert runner.max_tokens_in_step == 16
    assert mixed >= 5                        # 100 tokens at <= 15 per step, beside a decode


def test_max_num_seqs_caps_the_batch():
    outs, runner = run_all(make(max_num_seqs=3), prompts(10))
    assert runner.max_seqs_in_step == 3


def test_preemption_recomputes_and_gives_identical_output():
    ps = prompts(12, seed=1, lo=20, hi=40)
    ref = [expected(p, 24) for p in ps]
    sched = make(num_blocks=40, block_size=4, caching=False)
    outs, _ = run_all(sched, ps, max_tokens=24)
    assert sched.stats.num_preemptions > 0
    assert outs == ref


def test_preemption_with_prefix_caching():
    ps = prompts(12, seed=2, lo=20, hi=40)
    sched = make(num_blocks=40, block_size=4, caching=True)
    outs, _ = run_all(sched, ps, max_tokens=24)
    assert sched.stats.num_preemptions > 0
    assert outs == [expected(p, 24) for p in ps]


@pytest.mark.parametrize("caching", [False, True])
def test_guaranteed_no_evict_never_preempts_and_gives_identical_output(caching):
    ps = prompts(12, seed=1, lo=20, hi=40)
    ps += [ps[0][:16] + p for p in prompts(4, seed=3, lo=4, hi=8)]      # cache hits
    ref = [expected(p, 24) for p in ps]
    evicting = make(num_blocks=40, block_size=4, caching=caching)
    outs, runner = run_all(evicting, ps, max_tokens=24)
    assert outs == ref and evicting.stats.num_preemptions > 0
    sched = make(num_blocks=40, block_size=4, caching=caching, policy="guaranteed_no_evict")
    outs, careful = run_all(sched, ps, max_tokens=24)
    assert outs == ref
    assert sched.stats.num_preemptions == 0
    assert careful.max_seqs_in_step < runner.max_seqs_in_step    # what it costs


def test_guaranteed_no_evict_admits_only_with_room_to_finish():
    """Blocks of 4; 8-token prompts with max_tokens 40 end at 48 tokens: 12 blocks each. A pool
    of 20 holds one such request at full length, not two: the second waits for the first."""
    for policy, together in (("max_utilization", True), ("guaranteed_no_evict", False)):
        sched = make(num_blocks=20, block_size=4, policy=policy)
        for rid in ("a", "b"):
            sched.add_request(Request(rid, list(range(1, 9)), SamplingParams(max_tokens=40), []))
        runner = FakeRunner(sched)
        out, _ = runner.step()
        assert (set(out.num_scheduled_tokens) == {"a", "b"}) == together, policy
        while sched.has_unfinished_requests():
            runner.step()
        assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert sched.stats.num_preemptions == 0


def test_guaranteed_no_evict_reserves_up_to_max_model_len():
    """max_tokens beyond the context (or None: no limit) ends at max_model_len: that is what
    is reserved."""
    def admitted(num_blocks, max_tokens):
        sched = make(num_blocks=num_blocks, block_size=4, max_model_len=40,
                     policy="guaranteed_no_evict")
        for rid in ("a", "b"):
            sched.add_request(Request(rid, list(range(1, 9)), SamplingParams(max_tokens=max_tokens),
                                      []))
        out, _ = FakeRunner(sched).step()
        return set(out.num_scheduled_tokens)

    assert admitted(24, 10**6) == {"a", "b"}                # 10 + 10 blocks of 24
    assert admitted(12, 10**6) == {"a"}
    for num_blocks in range(12, 25):
        assert admitted(num_blocks, None) == admitted(num_blocks, 10**6), num_blocks
    assert admitted(16, 20) == {"a", "b"} != admitted(16, None)   # 7 blocks each, not 10


def test_unknown_capacity_policy_is_refused():
    with pytest.raises(ValueError, match="capacity_policy must be one of"):
        make(policy="guaranteed")


def test_preempts_newest_first():
    sched = make(num_blocks=6, block_size=4, max_model_len=24)
    for rid in ("old", "new"):
        sched.add_request(Request(rid, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], SamplingParams(max_tokens=10), []))
    runner = FakeRunner(sched)
    preempted_first = None
    while sched.has_unfinished_requests() and preempted_first is None:
        runner.step()
        for r in list(sched.waiting):
            if r.num_preemptions:
                preempted_first = r.request_id
    assert preempted_first == "new"


def test_fcfs_admission():
    sched = make(max_num_seqs=1)
    for rid in ("a", "b", "c"):
        sched.add_request(Request(rid, [1, 2, 3], SamplingParams(max_tokens=2), []))
    runner = FakeRunner(sched)
    order = []
    while sched.has_unfinished_requests():
        out, _ = runner.step()
        order += [n.request_id for n in out.new_requests]
    assert order == ["a", "b", "c"]


def test_prefix_cache_skips_shared_prompt():
    shared = list(range(200))
    sched = make(block_size=16)
    runner = FakeRunner(sched)
    sched.add_request(Request("first", shared + [7, 1], SamplingParams(max_tokens=2), []))
    while sched.has_unfinished_requests():
        runner.step()
    before = sched.stats.num_computed_prompt_tokens
    for i in range(4):
        sched.add_request(Request(f"x{i}", shared + [5, i], SamplingParams(max_tokens=2), []))
    while sched.has_unfinished_requests():
        runner.step()
    computed = sched.stats.num_computed_prompt_tokens - before
    assert computed == 4 * (202 - 192)       # 12 full blocks of 16 come from the cache
    assert sched.stats.num_cached_prompt_tokens == 4 * 192


def test_abort_waiting_and_running_frees_blocks():
    sched = make(max_num_seqs=1)
    sched.add_request(Request("run", [1] * 10, SamplingParams(max_tokens=50), []))
    sched.add_request(Request("wait", [2] * 10, SamplingParams(max_tokens=50), []))
    runner = FakeRunner(sched)
    runner.step()
    outs = sched.abort_requests(["run", "wait", "unknown"])
    assert [(o.request_id, o.finish_reason) for o in outs] == [("run", "abort"), ("wait", "abort")]
    assert not sched.has_unfinished_requests()
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    out, _ = runner.step()
    assert out.finished_request_ids == {"run", "wait"}


def test_stop_conditions():
    sched = make(max_model_len=12)
    toks = expected([5, 6, 7], 5)
    sched.add_request(Request("eos", [5, 6, 7], SamplingParams(max_tokens=10), [toks[2]]))
    sched.add_request(Request("stopid", [5, 6, 7],
                              SamplingParams(max_tokens=10, stop_token_ids=[toks[1]]), []))
    sched.add_request(Request("len", [5, 6, 7], SamplingParams(max_tokens=4), []))
    sched.add_request(Request("ctx", [5, 6, 7, 8, 9, 10, 11, 12, 13, 14],
                              SamplingParams(max_tokens=10), []))
    sched.add_request(Request("ign", [5, 6, 7], SamplingParams(max_tokens=5, ignore_eos=True),
                              [toks[0]]))
    runner = FakeRunner(sched)
    final = {}
    while sched.has_unfinished_requests():
        _, outs = runner.step()
        for o in outs:
            if o.finished:
                final[o.request_id] = (o.finish_reason, o.stop_reason)
    assert final["eos"] == ("stop", None)
    assert final["stopid"] == ("stop", toks[1])
    assert final["len"] == ("length", None)
    assert final["ctx"] == ("length", None)   # hit max_model_len after 2 tokens
    assert final["ign"] == ("length", None)


def test_min_tokens_defers_eos():
    toks = expected([5, 6, 7], 6)
    sched = make()
    r = Request("a", [5, 6, 7], SamplingParams(max_tokens=6, min_tokens=3), [toks[0]])
    sched.add_request(r)
    runner = FakeRunner(sched)
    while sched.has_unfinished_requests():
        runner.step()
    # The fake model emits EOS first; min_tokens=3 means it only counts from the 3rd token.
    assert r.num_output_tokens == 6 and r.finish_reason == "length"


def test_duplicate_request_id_rejected():
    sched = make()
    sched.add_request(Request("a", [1], SamplingParams(), []))
    with pytest.raises(ValueError, match="request_id"):
        sched.add_request(Request("a", [1], SamplingParams(), []))


# ---------------------------------------------------------------------- prefill hold
def _decoding(sched, runner, n=2):
    """n requests admitted and decoding (one token a step from now on)."""
    for i in range(n):
        sched.add_request(Request(f"d{i}", [i + 1] * 8, SamplingParams(max_tokens=100), []))
    runner.step()


def _admitted(out):
    return [new.request_id for new in out.new_requests]


def test_prefill_hold_keeps_a_short_prompt_back_until_its_steps_are_up():
    """Beside decode rows, a prompt that would not fill the step waits prefill_hold_steps
    steps (counted from its arrival), then goes in; off, it goes in at once."""
    for hold in (0, 1, 3):
        sched = make(max_tokens_step=64, hold=hold)
        runner = FakeRunner(sched)
        _decoding(sched, runner)
        sched.add_request(Request("p", [9] * 20, SamplingParams(max_tokens=2), []))
        steps = [_admitted(runner.step()[0]) for _ in range(hold + 1)]
        assert steps == [[]] * hold + [["p"]], hold


def test_prefill_hold_lets_prompts_in_once_they_fill_the_step():
    """Held prompts go in as soon as their tokens to compute fill what the decode rows leave."""
    sched = make(max_tokens_step=64, hold=10)
    runner = FakeRunner(sched)
    _decoding(sched, runner)                    # 2 decode rows: 62 tokens left
    sched.add_request(Request("a", [9] * 30, SamplingParams(max_tokens=2), []))
    assert _admitted(runner.step()[0]) == []
    sched.add_request(Request("b", [8] * 31, SamplingParams(max_tokens=2), []))
    assert _admitted(runner.step()[0]) == []        # 61 tokens: one short of the step
    sched.add_request(Request("c", [7] * 5, SamplingParams(max_tokens=2), []))
    out, _ = runner.step()
    assert _admitted(out) == ["a", "b", "c"]        # c is chunked to what is left
    assert out.total_num_scheduled_tokens == 64


def test_prefill_hold_counts_only_tokens_the_prefix_cache_does_not_have():
    """A long prompt whose prefix is cached is short to compute: it is held like one."""
    shared = list(range(64))
    sched = make(max_tokens_step=64, hold=2)
    runner = FakeRunner(sched)
    sched.add_request(Request("first", shared + [1], SamplingParams(max_tokens=100), []))
    runner.step()
    runner.step()                                   # first's prompt is done and cached
    sched.add_request(Request("same", shared + [2], SamplingParams(max_tokens=2), []))
    steps = [_admitted(runner.step()[0]) for _ in range(3)]
    assert steps == [[], [], ["same"]]              # 1 token to compute of 65: held
    assert sched.requests["same"].num_cached_tokens == 64
    other = make(max_tokens_step=64, hold=2)        # the same prompt, nothing cached:
    runner = FakeRunner(other)
    _decoding(other, runner, n=1)
    other.add_request(Request("same", shared + [2], SamplingParams(max_tokens=2), []))
    assert _admitted(runner.step()[0]) == ["same"]  # 65 tokens fill the step: in at once


def test_prefill_hold_never_holds_when_the_step_has_no_decode_rows_or_already_a_prompt():
    sched = make(max_tokens_step=16, hold=5)
    runner = FakeRunner(sched)
    sched.add_request(Request("alone", [3] * 4, SamplingParams(max_tokens=50), []))
    assert _admitted(runner.step()[0]) == ["alone"]     # nothing else runs: at once
    sched.add_request(Request("long", [4] * 20, SamplingParams(max_tokens=50), []))
    assert _admitted(runner.step()[0]) == ["long"]      # 20 tokens fill the step
    sched.add_request(Request("short", [5] * 3, SamplingParams(max_tokens=2), []))
    out, _ = runner.step()                              # long's chunk is still running:
    assert out.num_scheduled_tokens["long"] == 5        # the step carries a prompt anyway,
    assert _admitted(out) == ["short"]                  # so short goes with it


def test_prefill_hold_gives_the_same_outputs():
    """Holding changes when prompts run, not what they produce; the pool ends whole."""
    ps = prompts(30, seed=3)
    want = [expected(p, 8) for p in ps]
    for hold in (0, 2, 6):
        sched = make(max_tokens_step=48, max_num_seqs=8, hold=hold)
        outs, _ = run_all(sched, ps)
        assert outs == want, hold


@pytest.mark.parametrize("caching", [True, False])
def test_a_sliding_window_gives_back_the_blocks_behind_it(caching):
    """Every layer windowed (W = 10, blocks of 4): a request holds the blocks its window and
    its step's tokens span, not its whole length, so a small pool preempts less. The fake
    runner checks that every position each query's window reaches holds the request's own
    token: a block given back too early, and written by its next owner, fails it."""
    ps = prompts(12, seed=4, lo=40, hi=120)
    preemptions = {}
    for window in (10, None):
        sched = make(num_blocks=60, block_size=4, max_tokens_step=32, caching=caching,
                     window=window)
        reqs = [Request(str(i), p, SamplingParams(max_tokens=8), []) for i, p in enumerate(ps)]
        for r in reqs:
            sched.add_request(r)
        runner, peak, steps = FakeRunner(sched), 0, 0
        while sched.has_unfinished_requests():
            runner.step()
            steps += 1
            assert steps < 10_000
            for r in sched.running:
                peak = max(peak, sum(b is not None for b in sched.kv.block_ids(r.request_id)))
        assert [r.output_token_ids for r in reqs] == [expected(p, 8) for p in ps]
        assert sched.kv.num_free_blocks == sched.kv.num_blocks
        preemptions[window] = sched.stats.num_preemptions
        if window is not None:
            # The window's 9 keys and a 32-token chunk, two blocks' alignment, one block
            # waiting for its hash (caching: a token in flight).
            assert peak <= -(-(window - 1 + 32) // 4) + 2 + caching
        else:
            assert peak == -(-(max(map(len, ps)) + 8 - 1) // 4)   # the last token is not computed
    assert preemptions[10] < preemptions[None]


def test_windowed_prefix_hits_read_only_what_the_window_reaches():
    """Prompts sharing long prefixes through a pool that evicts them, with a sliding window
    (10 tokens, blocks of 4): hits that skip evicted blocks behind the window find more than
    a lookup that needs every block from the first; the fake runner checks every position
    each query's window reaches holds the request's own token."""
    cached = {}
    for whole in (False, True):
        rng = random.Random(6)
        prefixes = [[rng.randrange(VOCAB) for _ in range(60)] for _ in range(3)]
        ps = [rng.choice(prefixes) + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))]
              for _ in range(30)]
        sched = make(num_blocks=40, block_size=4, max_num_seqs=4, max_tokens_step=24, window=10)
        if whole:                       # the lookup from the first block, as without a window
            kv, lookup = sched.kv, sched.kv.get_computed_blocks

            def lookup_whole(req, prefix=(), max_blocks=None):
                kv.sliding_window, window = None, kv.sliding_window
                try:
                    return lookup(req, prefix, max_blocks)
                finally:
                    kv.sliding_window = window
            kv.get_computed_blocks = lookup_whole
        outs, _ = run_all(sched, ps)
        assert outs == [expected(p, 8) for p in ps]
        cached[whole] = sched.stats.num_cached_prompt_tokens
    assert cached[False] > cached[True] > 0, cached


def test_blocks_behind_a_window_go_back_before_an_older_request_asks_for_room():
    """Window 4, blocks of 4, a pool of 7 (found by review). Step 1 admits a (4 tokens) and b (a
    24-token prompt): the pool is empty. Step 2: a's next token needs a block, and 5 of b's
    blocks are behind b's window (its next query, at 24, reads keys 21..24). They go back
    before a asks, so b is not preempted and its prompt not computed again."""
    sched = make(num_blocks=7, block_size=4, max_tokens_step=64, max_model_len=64,
                 caching=False, window=4)
    a = Request("a", [1, 2, 3, 4], SamplingParams(max_tokens=6), [])
    b = Request("b", list(range(10, 34)), SamplingParams(max_tokens=6), [])
    sched.add_request(a)
    sched.add_request(b)
    runner = FakeRunner(sched)
    out, _ = runner.step()
    assert out.num_scheduled_tokens == {"a": 4, "b": 24} and sched.kv.num_free_blocks == 0
    out, _ = runner.step()
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    assert sched.stats.num_preemptions == 0
    while sched.has_unfinished_requests():
        runner.step()
    assert a.output_token_ids == expected(a.prompt_token_ids, 6)
    assert b.output_token_ids == expected(b.prompt_token_ids, 6)
    assert sched.kv.num_free_blocks == 7


def test_a_repeated_prompt_finds_its_blocks_though_those_given_back_first_were_evicted():
    """(Found by review.) A 32-token prompt runs in 8-token chunks and ends; a filler evicts two
    cached blocks; the prompt comes again. Blocks given back behind a window (4) go to the
    free list head first, so the prompt's first blocks are the ones evicted: a lookup from the
    first block found nothing, where keeping every block (no window) left a hit."""
    cached = {}
    for window in (4, None):
        sched = make(num_blocks=12, block_size=4, max_tokens_step=8, max_model_len=64,
                     window=window)
        prompt = list(range(100, 132))
        reqs = [Request("r1", prompt, SamplingParams(max_tokens=1), []),
                Request("f", list(range(500, 524)), SamplingParams(max_tokens=1), []),
                Request("r2", prompt + [7], SamplingParams(max_tokens=1), [])]
        runner = FakeRunner(sched)
        for r in reqs:                       # one after the other
            sched.add_request(r)
            while sched.has_unfinished_requests():
                runner.step()
        assert reqs[2].output_token_ids == expected(prompt + [7], 1)
        cached[window] = reqs[2].num_cached_tokens
    assert cached[4] >= cached[None] > 0, cached


def test_guaranteed_no_evict_counts_a_window_hit_by_the_blocks_it_takes():
    """(Found by review.) Window 4, blocks of 4, a pool of 12. A 32-token prompt ends, its
    blocks cached; r runs long (1 block held, 5 reserved); b repeats the prompt: its hit is 8
    blocks, 7 of them behind its window (never taken), so b takes 2 blocks, and the 11 free
    less r's 5 reserved leave room. It was counted as taking 9 and kept waiting for r."""
    sched = make(num_blocks=12, block_size=4, max_tokens_step=64, max_model_len=64,
                 policy="guaranteed_no_evict", window=4)
    runner = FakeRunner(sched)
    prompt = list(range(100, 132))
    sched.add_request(Request("a", prompt, SamplingParams(max_tokens=1), []))
    while sched.has_unfinished_requests():
        runner.step()
    r = Request("r", [1, 2, 3, 4], SamplingParams(max_tokens=20), [])
    sched.add_request(r)
    runner.step()
    b = Request("b", prompt + [7], SamplingParams(max_tokens=1), [])
    sched.add_request(b)
    hits, n = sched.kv.get_computed_blocks(b)
    assert n == 32 and hits.count(None) == 7 and sched.kv.num_free_blocks == 11
    out, _ = runner.step()
    assert "b" in out.num_scheduled_tokens
    while sched.has_unfinished_requests():
        runner.step()
    assert b.output_token_ids == expected(prompt + [7], 1)
    assert r.output_token_ids == expected([1, 2, 3, 4], 20)
    assert sched.stats.num_preemptions == 0 and sched.kv.num_free_blocks == 12


# Found by a mutation review: behaviour no test pinned down.
def test_preempted_request_resumes_before_a_later_arrival():
    """FCFS: a preempted request goes back to the head of the waiting queue, ahead of a
    request that arrived after it."""
    sched = make(num_blocks=6, block_size=4, max_num_seqs=2, max_model_len=64)
    runner = FakeRunner(sched)
    for rid in ("old", "mid"):
        sched.add_request(Request(rid, list(range(1, 9)), SamplingParams(max_tokens=12), []))
    runner.step()                      # both admitted: 4 of 6 blocks
    assert {r.request_id for r in sched.running} == {"old", "mid"}
    sched.add_request(Request("late", [9, 9, 9, 9], SamplingParams(max_tokens=2), []))
    admitted_after_preemption = []
    preempted = False
    while sched.has_unfinished_requests():
        out, _ = runner.step()
        if preempted:
            admitted_after_preemption += [n.request_id for n in out.new_requests]
        if not preempted and any(r.num_preemptions for r in sched.waiting):
            assert [r.request_id for r in sched.waiting if r.num_preemptions] == ["mid"]
            preempted = True
    assert preempted
    assert admitted_after_preemption[0] == "mid", admitted_after_preemption


def test_preempted_requests_count_their_prompt_once():
    """A resumed request is no new admission: its prompt counts once in the stats, and its
    prefix-cache hit is the one at its first admission (not its own blocks' before it was
    preempted)."""
    sched = make(num_blocks=6, block_size=4, max_model_len=24)
    prompts = {"old": list(range(1, 11)), "new": list(range(101, 111))}
    for rid, p in prompts.items():
        sched.add_request(Request(rid, p, SamplingParams(max_tokens=10), []))
    runner = FakeRunner(sched)
    first_cached = {}
    while sched.has_unfinished_requests():
        _, outs = runner.step()
        for o in outs:
            if o.num_cached_tokens is not None:
                first_cached.setdefault(o.request_id, []).append(o.num_cached_tokens)
    assert sched.stats.num_preemptions > 0
    assert sched.stats.num_prompt_tokens == 20
    assert sched.stats.num_cached_prompt_tokens == 0      # distinct prompts, cold cache
    assert first_cached == {"old": [0], "new": [0]}
