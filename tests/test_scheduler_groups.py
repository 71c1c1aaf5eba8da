"""Prefix-group admission in the scheduler (Scheduler.add_group), with the fake runner of
tests/test_scheduler.py: it checks every step that each position a request attends to holds
that request's own token, so a member reading a wrong or overwritten prefix fails."""
import random

import pytest

from engine.prefix_groups import group_prompts
from engine.request import Request
from engine.sampling_params import SamplingParams
from tests.test_scheduler import VOCAB, FakeRunner, expected, make


def shared_prefix_prompts(num_groups, size, prefix_len, own_lo, own_hi, num_lone=0, seed=0,
                          shuffle=True):
    rng = random.Random(seed)
    out = []
    for _ in range(num_groups):
        prefix = [rng.randrange(VOCAB) for _ in range(prefix_len)]
        out += [prefix + [rng.randrange(VOCAB) for _ in range(rng.randint(own_lo, own_hi))]
                for _ in range(size)]
    out += [[rng.randrange(VOCAB) for _ in range(rng.randint(own_lo, prefix_len))]
            for _ in range(num_lone)]
    if shuffle:
        rng.shuffle(out)
    return out


def add_grouped(sched, prompts, max_tokens=8):
    """What LLM.generate does: group the prompts, add each group (a lone prompt on its own)."""
    reqs = [Request(str(i), p, SamplingParams(max_tokens=max_tokens), []) for i, p in enumerate(prompts)]
    groups = group_prompts(prompts, sched.kv.block_size)
    for g in groups:
        sched.add_group([reqs[i] for i in g.members], g.prefix_len)
    return reqs, groups


def run(sched, reqs, runner=None, on_step=None):
    runner = runner or FakeRunner(sched)
    steps = 0
    while sched.has_unfinished_requests():
        out, _ = runner.step()
        if on_step:
            on_step(out)
        steps += 1
        assert steps < 10_000
    assert sched.kv.num_free_blocks == sched.kv.num_blocks, "a pinned prefix was never released"
    return [r.output_token_ids for r in reqs]


@pytest.mark.parametrize("caching", [True, False])
def test_groups_compute_each_prefix_once_in_any_order(caching):
    ps = shared_prefix_prompts(5, 6, 64, 3, 20, num_lone=7)
    sched = make(block_size=4, caching=caching, max_num_seqs=8, max_tokens_step=96)
    reqs, groups = add_grouped(sched, ps)
    assert sorted(len(g.members) for g in groups if g.prefix_len) == [6] * 5
    assert run(sched, reqs) == [expected(p, 8) for p in ps]
    # Each group's 64-token prefix once, every other prompt token once.
    grouped = sum(len(g.members) for g in groups if g.prefix_len)
    assert sched.stats.num_computed_prompt_tokens == sum(map(len, ps)) - (grouped - 5) * 64
    assert sched.stats.num_cached_prompt_tokens == (grouped - 5) * 64


def test_members_wait_for_the_prefix_then_come_together():
    ps = shared_prefix_prompts(1, 5, 40, 2, 6, shuffle=False)
    sched = make(block_size=4, max_tokens_step=16)       # the leader's prefix takes 3 steps
    reqs, _ = add_grouped(sched, ps)
    assert sched.num_waiting == 5
    admitted = []

    def on_step(out):
        admitted.append(sorted(n.request_id for n in out.new_requests))
        for n in out.new_requests:
            if n.request_id != "0":
                assert n.num_computed_tokens == 40            # the prefix, as computed
    run(sched, reqs, on_step=on_step)
    assert admitted[0] == ["0"] and admitted[1] == []
    # Step 3 schedules the last 8 prefix tokens (and the leader's own): the members come at once,
    # as far as the budget goes, and the rest first thing the step after.
    assert admitted[2] and sorted(admitted[2] + admitted[3]) == ["1", "2", "3", "4"]


def test_pinned_prefix_survives_eviction_pressure_from_other_traffic():
    """Caching on, a pool that other requests keep cycling through: without the pin, the group's
    prefix would be evicted between its members (one seat: they run one after the other)."""
    rng = random.Random(3)
    ps = shared_prefix_prompts(1, 4, 48, 2, 4, shuffle=False)
    others = [[rng.randrange(VOCAB) for _ in range(60)] for _ in range(6)]
    sched = make(num_blocks=34, block_size=4, max_num_seqs=1, max_model_len=80)
    reqs, _ = add_grouped(sched, ps)
    for i, p in enumerate(others):
        r = Request(f"o{i}", p, SamplingParams(max_tokens=8), [])
        sched.add_request(r)
        reqs.append(r)
    assert run(sched, reqs) == [expected(p, 8) for p in ps + others]
    assert sched.stats.num_computed_prompt_tokens == sum(map(len, ps + others)) - 3 * 48


def test_abort_leader_before_its_prefix_then_members():
    ps = shared_prefix_prompts(1, 4, 32, 2, 4, shuffle=False)
    sched = make(block_size=4, max_tokens_step=8)
    reqs, _ = add_grouped(sched, ps)
    runner = FakeRunner(sched)
    runner.step()                                  # the leader has 8 of its 32 prefix tokens
    assert sched.abort_requests(["0", "2"])[0].finish_reason == "abort"
    assert sched.num_waiting == 2                  # "1" leads now, "3" is held
    out, _ = runner.step()
    assert [n.request_id for n in out.new_requests] == ["1"]
    assert run(sched, reqs[1:], runner) == [expected(ps[1], 8), [], expected(ps[3], 8)]


def test_aborting_every_member_releases_the_pin():
    ps = shared_prefix_prompts(1, 3, 32, 2, 4, shuffle=False)
    sched = make(block_size=4)
    add_grouped(sched, ps, max_tokens=50)
    runner = FakeRunner(sched)
    runner.step()
    runner.step()
    assert sched.kv.num_free_blocks < sched.kv.num_blocks
    sched.abort_requests(["0", "1", "2"])
    assert not sched.has_unfinished_requests()
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def _queues(sched):
    """The scheduler's queues and groups. Where leaders taking over from aborted ones stand in
    `waiting` is left out: each goes first when its group's leader leaves, and one call for
    all of them moves leader after leader at once."""
    return ([r.request_id for r in sched.running],
            [r.request_id for r in sched.waiting if r.request_id not in sched._leaders],
            sorted(r.request_id for r in sched.waiting if r.request_id in sched._leaders),
            [r.request_id for r in sched._ready], sched.num_waiting, sorted(sched.requests),
            {rid: (g.leader and g.leader.request_id, [r.request_id for r in g.pending],
                   g.num_unfinished, g.blocks and [(b.block_id, b.ref_cnt) for b in g.blocks])
             for rid, g in sched._group_of.items()},
            sched.kv.num_free_blocks)


def _where(sched, req):
    group = sched._group_of.get(req.request_id)
    if req in sched.running:
        return "running"
    if group is not None and req in group.pending:
        return "pending"
    if req in sched._ready:
        return "ready"
    return "leader" if req.request_id in sched._leaders else "waiting"


def test_aborting_many_at_once_is_aborting_them_one_by_one():
    """abort_requests takes its ids out of the queues in one pass each; what it returns, the
    queues and groups after it (but where new leaders stand, `_queues`) and the tokens to the
    end equal aborting the same ids one call each: running, waiting, ready and held members,
    leaders with their next members, unknown and repeated ids."""
    seen = set()
    for seed in range(40):
        rng = random.Random(seed)
        ps = shared_prefix_prompts(4, 5, 24, 2, 10, num_lone=6, seed=seed)
        num_steps = rng.randrange(6)
        victims = rng.sample([str(i) for i in range(len(ps))], rng.randint(1, len(ps)))
        victims += ["nobody", victims[0]]
        scheds, reqs, runners = [], [], []
        for _ in range(2):
            sched = make(num_blocks=48, block_size=4, max_num_seqs=6, max_tokens_step=32)
            rs, _ = add_grouped(sched, ps, max_tokens=12)
            runner = FakeRunner(sched)
            for _ in range(num_steps):
                runner.step()
            scheds.append(sched), reqs.append(rs), runners.append(runner)
        assert _queues(scheds[0]) == _queues(scheds[1])
        seen |= {_where(scheds[0], reqs[0][int(v)]) for v in victims if v in scheds[0].requests}
        at_once = scheds[0].abort_requests(victims)
        one_by_one = [o for v in victims for o in scheds[1].abort_requests([v])]
        assert [(o.request_id, o.finish_reason) for o in at_once] == \
            [(o.request_id, o.finish_reason) for o in one_by_one]
        assert _queues(scheds[0]) == _queues(scheds[1]), seed
        assert run(scheds[0], reqs[0], runners[0]) == run(scheds[1], reqs[1], runners[1])
    assert seen == {"running", "waiting", "ready", "pending", "leader"}


@pytest.mark.parametrize("caching", [True, False])
def test_preemption_in_a_pool_too_small(caching):
    ps = shared_prefix_prompts(4, 4, 24, 4, 12, num_lone=4, seed=5)
    sched = make(num_blocks=24, block_size=4, caching=caching, max_model_len=48)
    reqs, _ = add_grouped(sched, ps, max_tokens=10)
    assert run(sched, reqs) == [expected(p, 10) for p in ps]
    assert sched.stats.num_preemptions > 0


@pytest.mark.parametrize("caching", [True, False])
def test_pins_are_released_when_they_leave_no_room(caching):
    """Members preempted back to the ready queue of two pinned groups, nothing running, and the
    two pins leave too few blocks for any member: the pins go, the requests finish."""
    ps = shared_prefix_prompts(4, 2, 20, 2, 6, seed=0)
    sched = make(num_blocks=14, block_size=4, max_num_seqs=4, max_model_len=48, caching=caching)
    reqs, _ = add_grouped(sched, ps, max_tokens=16)
    released = []
    release = sched._release_pins
    sched._release_pins = lambda: released.append(release()) or released[-1]
    assert run(sched, reqs) == [expected(p, 16) for p in ps]
    assert any(released)


def livelock_case():
    """Two groups of two sharing 8 tokens each, prefix caching off, a pool of max_model_len (the
    engine's least) and 8 tokens a step. Member "1" needs more blocks than group "2,3"'s pin
    leaves it, and its prompt is longer than the budget: admitted chunk by chunk, it used to
    run out of blocks, preempt itself back to the head of the ready queue, ahead of the group
    whose pin held the pool, and start over forever."""
    sched = make(num_blocks=6, block_size=4, max_num_seqs=3, max_tokens_step=8, max_model_len=24,
                 caching=False)
    p1, p2 = [1] * 8, [2] * 8
    ps = [p1 + [3] * 14, p1 + [4] * 7, p2 + [5] * 14, p2 + [6] * 14]
    max_tokens = [1, 3, 1, 2]
    reqs = [Request(str(i), p, SamplingParams(max_tokens=m), []) for i, (p, m) in
            enumerate(zip(ps, max_tokens))]
    sched.add_group(reqs[:2], 8)
    sched.add_group(reqs[2:], 8)
    return sched, reqs, [expected(p, m) for p, m in zip(ps, max_tokens)]


def test_the_oldest_request_short_of_blocks_only_for_pins_releases_them():
    sched, reqs, want = livelock_case()
    released = []
    release = sched._release_pins
    sched._release_pins = lambda: released.append(release()) or released[-1]
    assert run(sched, reqs) == want           # run() fails after 10,000 steps
    assert any(released)


def test_add_group_checks_its_members():
    sched = make(block_size=4)
    a = Request("a", [1] * 9, SamplingParams(), [])
    with pytest.raises(ValueError, match="multiple of the block size"):
        sched.add_group([a, Request("b", [1] * 9, SamplingParams(), [])], 6)
    with pytest.raises(ValueError, match="does not start with"):
        sched.add_group([a, Request("b", [1] * 7 + [2, 2], SamplingParams(), [])], 8)
    with pytest.raises(ValueError, match="does not start with"):   # no token after the prefix
        sched.add_group([a, Request("b", [1] * 8, SamplingParams(), [])], 8)
    with pytest.raises(ValueError, match="new and distinct"):
        sched.add_group([a, Request("a", [1] * 9, SamplingParams(), [])], 8)
    assert not sched.has_unfinished_requests()
    sched.add_group([a], 8)                          # a group of one is a plain request
    assert sched.num_waiting == 1 and not sched._group_of


def test_a_windowed_group_pins_what_of_its_prefix_the_leader_still_held():
    """With a sliding window (10 tokens) shorter than the prefix (64), a leader computing its
    prefix in chunks gives back what falls behind its window; the group pins the rest, and the
    members take the whole prefix as computed (the blocks behind their windows never read).
    The fake runner checks every position each member's window reaches holds its own token."""
    ps = shared_prefix_prompts(3, 5, 64, 3, 20, num_lone=4)
    sched = make(block_size=4, max_num_seqs=8, max_tokens_step=24, window=10)
    reqs, groups = add_grouped(sched, ps)
    pinned = []
    pin = sched.kv.pin_prefix

    def recorded_pin(req, num_blocks):
        pinned.append(pin(req, num_blocks))
        return pinned[-1]
    sched.kv.pin_prefix = recorded_pin
    assert run(sched, reqs) == [expected(p, 8) for p in ps]
    grouped = sum(len(g.members) for g in groups if g.prefix_len)
    assert grouped == 15
    assert sched.stats.num_computed_prompt_tokens == sum(map(len, ps)) - (grouped - 3) * 64
    assert pinned and all(None in blocks and blocks[-1] is not None for blocks in pinned)


def test_a_windowed_leader_whose_prompt_is_cached_stops_its_hit_at_the_prefix():
    """(Found by review.) A leader whose whole prompt is in the prefix cache (run before) took
    a windowed hit past its group's prefix: the slots behind that hit's window, None, covered
    the end of the prefix, and the group pinned None where its members' windows read (they
    read block 0, another request's tokens). The fake runner checks each member's reads."""
    rng = random.Random(1)
    prefix = [rng.randrange(VOCAB) for _ in range(32)]
    long_prompt = prefix + [rng.randrange(VOCAB) for _ in range(40)]
    sched = make(block_size=4, max_num_seqs=8, max_tokens_step=128, window=10)
    first = Request("a", list(long_prompt), SamplingParams(max_tokens=2), [])
    members = [Request("L", list(long_prompt), SamplingParams(max_tokens=4), [])]
    members += [Request(f"m{i}", prefix + [rng.randrange(VOCAB) for _ in range(5 + i)],
                        SamplingParams(max_tokens=4), []) for i in range(2)]
    others = [Request(f"o{i}", [rng.randrange(VOCAB) for _ in range(30)],
                      SamplingParams(max_tokens=4), []) for i in range(2)]
    runner = FakeRunner(sched)
    sched.add_request(first)
    run(sched, [first], runner)
    for r in others:
        sched.add_request(r)
    sched.add_group(members, 32)
    run(sched, members + others, runner)
    for r in members + others:
        assert r.output_token_ids == expected(r.prompt_token_ids, 4), r.request_id
