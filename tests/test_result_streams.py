import threading

from engine.result_streams import ResultStreams


def test_requests_take_an_owners_streams_in_turn():
    reg = ResultStreams()
    a1, a2 = reg.open("a", "sink-a1"), reg.open("a", "sink-a2")
    b1 = reg.open("b", "sink-b1")
    got = [reg.acquire("a", f"r{i}").stream_id for i in range(4)]
    assert sorted(got) == sorted([a1, a2, a1, a2])
    assert reg.acquire("b", "x").stream_id == b1
    assert reg.acquire("nobody", "y") is None


def test_only_streams_that_owe_nothing_and_sat_idle_are_taken():
    reg = ResultStreams(idle_close_s=5.0)
    busy, idle = reg.open("a", 1), reg.open("b", 2)
    rs = reg.acquire("a", "r1")
    assert rs.stream_id == busy
    t0 = rs.last_used
    assert reg.take_idle(now=t0 + 1.0) == []                   # not idle long enough
    taken = reg.take_idle(now=t0 + 10.0)
    assert [r.stream_id for r in taken] == [idle]              # busy still owes r1
    reg.release(busy, "r1")
    released = reg._by_id[busy].last_used
    assert released >= t0
    assert reg.take_idle(now=released + 1.0) == []             # the clock restarts at release
    (last,) = reg.take_idle(now=reg._by_id[busy].last_used + 5.0)
    assert last.stream_id == busy and len(reg) == 0
    assert reg.acquire("a", "r2") is None


def test_remove_returns_what_the_stream_still_owed():
    reg = ResultStreams()
    sid = reg.open("a", None)
    reg.acquire("a", "r1")
    reg.acquire("a", "r2")
    rs = reg.remove(sid)
    assert rs.requests == {"r1", "r2"} and reg.remove(sid) is None
    assert reg.acquire("a", "r3") is None


def test_take_all_empties_the_registry():
    reg = ResultStreams()
    for owner in "abc":
        reg.open(owner, owner)
    assert sorted(r.sink for r in reg.take_all()) == ["a", "b", "c"] and len(reg) == 0


def test_concurrent_acquire_and_release_keep_counts():
    reg = ResultStreams()
    sids = [reg.open("a", i) for i in range(3)]

    def work(k):
        for i in range(500):
            rs = reg.acquire("a", f"{k}-{i}")
            reg.release(rs.stream_id, f"{k}-{i}")
    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(not reg._by_id[s].requests for s in sids)
