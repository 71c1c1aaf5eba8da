"""engine/bls_calls.py: the server's thread pool size from its command line, and the watcher
that asks llm_bls's requests a bounded number per round whether they were cancelled."""
import gc
import threading
import weakref

import pytest

from engine.bls_calls import (DEFAULT_THREAD_POOL_SIZE, BlsCall, BlsCalls,
                              python_backend_thread_pool_size)
from engine.protocol import BLS_REQUEST_ID_PREFIX


@pytest.mark.parametrize("argv,size", [
    ([], DEFAULT_THREAD_POOL_SIZE),
    (["tritonserver", "--model-repository=r"], DEFAULT_THREAD_POOL_SIZE),
    (["tritonserver", "--backend-config=python,thread-pool-size=64"], 64),
    (["tritonserver", "--backend-config", "python,thread-pool-size=128"], 128),
    (["tritonserver", "--backend-config=thread-pool-size=48"], 48),        # every backend's
    (["tritonserver", "--backend-config=python,thread-pool-size=8",
      "--backend-config=python,thread-pool-size=512"], 512),              # the last counts
    (["tritonserver", "--backend-config=onnxruntime,thread-pool-size=8"], 32),
    # The backend's own setting wins over every backend's, wherever it stands (Triton's rule;
    # scripts/tritonserver_env.py passes python,thread-pool-size=64 before a user's own).
    (["tritonserver", "--backend-config=python,thread-pool-size=64",
      "--backend-config=thread-pool-size=128"], 64),
    (["tritonserver", "--backend-config=thread-pool-size=128",
      "--backend-config=python,thread-pool-size=64"], 64),
    (["tritonserver", "--backend-config=python,shm-default-byte-size=1048576"], 32),
    (["tritonserver", "--backend-config=python,thread-pool-size=many"], 32),
    (["tritonserver", "--backend-config"], 32),
])
def test_thread_pool_size_from_the_server_command_line(argv, size):
    assert python_backend_thread_pool_size(argv) == size


class Client:
    """A fake request: counts the asks, cancelled once told to, raises if asked once its
    final response went out (the server would have freed it)."""

    def __init__(self):
        self.asks = 0
        self.cancel = False
        self.call: BlsCall | None = None

    def is_cancelled(self):
        assert not self.call.done, "asked about a finished request"
        self.asks += 1
        return self.cancel


def watched(calls, n):
    clients = [Client() for _ in range(n)]
    for c in clients:
        c.call = calls.add(c.is_cancelled, payload=c)
    return clients


def test_calls_get_distinct_ids_llm_honours():
    calls = BlsCalls(lambda call, started: None, round_s=None)
    ids = {calls.add(lambda: False).inner_id for _ in range(100)}
    assert len(ids) == 100 and all(i.startswith(BLS_REQUEST_ID_PREFIX) for i in ids)


def test_a_round_asks_a_bounded_number_in_turn():
    calls = BlsCalls(lambda call, started: None, checks_per_round=64, round_s=None)
    clients = watched(calls, 150)
    calls.check_round()
    assert sum(c.asks for c in clients) == 64
    calls.check_round()
    calls.check_round()
    asks = [c.asks for c in clients]
    assert sum(asks) == 3 * 64 and min(asks) == 1 and max(asks) == 2, asks


def test_a_finished_call_is_never_asked_again():
    calls = BlsCalls(lambda call, started: None, checks_per_round=64, round_s=None)
    clients = watched(calls, 10)
    for c in clients[:5]:
        assert calls.start(c.call)
        assert calls.finish(c.call) is False
    assert len(calls) == 5
    for _ in range(3):
        calls.check_round()            # Client.is_cancelled raises if a finished one is asked
    assert [c.asks for c in clients] == [1] * 5 + [3] * 5     # finish asks once more


def test_finish_reports_a_cancel_that_came_after_the_last_round():
    calls = BlsCalls(lambda call, started: None, round_s=None)
    (client,) = watched(calls, 1)
    assert calls.start(client.call)
    calls.check_round()
    client.cancel = True
    assert calls.finish(client.call) is True
    assert client.asks == 2


def test_a_request_cancelled_in_the_queue_is_handed_over_and_never_started():
    seen = []
    calls = BlsCalls(lambda call, started: seen.append((call.payload, started)), round_s=None)
    waiting, other = watched(calls, 2)
    waiting.cancel = True
    calls.check_round()
    assert seen == [(waiting, False)]
    assert calls.start(waiting.call) is False       # its worker comes later: nothing to do
    assert calls.start(other.call) is True
    calls.check_round()
    assert seen == [(waiting, False)]               # told once


def test_a_started_request_cancelled_is_aborted_and_answered_as_cancelled():
    seen = []
    calls = BlsCalls(lambda call, started: seen.append((call.payload, started)), round_s=None)
    (client,) = watched(calls, 1)
    assert calls.start(client.call)
    calls.check_round()
    assert seen == []
    client.cancel = True
    calls.check_round()
    calls.check_round()
    assert seen == [(client, True)]
    assert calls.finish(client.call) is True
    assert len(calls) == 0


def test_finish_waits_for_an_ask_under_way():
    """The final response must not go out while its request is being asked about."""
    asking, release = threading.Event(), threading.Event()

    def slow_is_cancelled():
        asking.set()
        release.wait(10)
        return False

    calls = BlsCalls(lambda call, started: None, round_s=None)
    call = calls.add(slow_is_cancelled)
    assert calls.start(call)
    watcher = threading.Thread(target=calls.check_round)
    watcher.start()
    assert asking.wait(10)
    finished = threading.Event()
    finisher = threading.Thread(target=lambda: (calls.finish(call), finished.set()))
    finisher.start()
    assert not finished.wait(0.3), "finish returned while is_cancelled() was under way"
    release.set()
    assert finished.wait(10)
    watcher.join()
    finisher.join()


def test_a_failing_ask_or_handler_does_not_stop_the_others():
    seen = []

    def on_cancel(call, started):
        seen.append(call.payload)
        raise RuntimeError("the abort failed")

    calls = BlsCalls(on_cancel, round_s=None)
    broken = calls.add(lambda: 1 / 0)
    clients = watched(calls, 3)
    for c in clients:
        c.cancel = True
    calls.check_round()
    assert seen == clients and not broken.cancelled


def test_the_watcher_thread_passes_cancellations_on_until_closed():
    cancelled = threading.Event()
    calls = BlsCalls(lambda call, started: cancelled.set(), round_s=0.01)
    (client,) = watched(calls, 1)
    client.cancel = True
    assert cancelled.wait(10)
    calls.close()
    assert not calls._thread.is_alive()


class Kept:
    """Stands for a BLS call's iterator: must outlive an ask that began after it was done."""


def test_finish_holds_keep_through_its_own_ask():
    calls = BlsCalls(lambda call, started: None, round_s=None)
    (client,) = watched(calls, 1)
    assert calls.start(client.call)
    kept = Kept()
    assert calls.finish(client.call, kept) is False and client.asks == 1
    assert calls.num_kept() == 0        # the ask it made came after what `kept` waited for


def test_what_finish_could_not_ask_for_lives_until_a_later_ask_returns():
    calls = BlsCalls(lambda call, started: None, round_s=None)
    cancelled, other = watched(calls, 2)
    assert calls.start(cancelled.call) and calls.start(other.call)
    cancelled.cancel = True
    calls.check_round()                 # known cancelled: finish makes no ask
    kept = Kept()
    ref = weakref.ref(kept)
    assert calls.finish(cancelled.call, kept) is True
    del kept
    gc.collect()
    assert ref() is not None and calls.num_kept() == 1
    calls.check_round()                 # asks `other`: a round trip after the keep
    gc.collect()
    assert ref() is None and calls.num_kept() == 0


def test_close_drops_what_it_kept():
    """At llm_bls's finalize every request has its answer: what waited for a later ask goes
    with close(), while the stub runs (left to the stub's collection at exit, Triton's objects
    crashed it)."""
    calls = BlsCalls(lambda call, started: None, round_s=None)
    (client,) = watched(calls, 1)
    ref = weakref.ref(kept := Kept())
    calls.keep_until_next_ask(kept)
    del kept
    calls.close()
    assert ref() is None and calls.num_kept() == 0 and len(calls) == 0


def test_an_ask_that_began_before_the_keep_does_not_release_it():
    asking, release = threading.Event(), threading.Event()

    def slow_is_cancelled():
        asking.set()
        release.wait(10)
        return False

    calls = BlsCalls(lambda call, started: None, checks_per_round=1, round_s=None)
    slow = calls.add(slow_is_cancelled)
    (fast,) = watched(calls, 1)
    watcher = threading.Thread(target=calls.check_round)    # asks `slow` only
    watcher.start()
    assert asking.wait(10)              # an ask under way ...
    ref = weakref.ref(kept := Kept())
    calls.keep_until_next_ask(kept)     # ... when this is kept
    del kept
    release.set()
    watcher.join()
    gc.collect()
    assert ref() is not None            # that ask may have passed the stub before the keep
    calls.finish(fast.call)             # this one began after it
    gc.collect()
    assert ref() is None


def test_bls_settings_from_the_config_name_what_is_wrong():
    from engine.bls_calls import BlsSettings

    def settings(**kv):
        return BlsSettings.from_parameters({k: {"string_value": v} for k, v in kv.items()},
                                           "llm_bls")
    assert settings() == BlsSettings(256, "llm")
    assert settings(max_concurrency=" 8 ") == BlsSettings(8, "llm")
    assert settings(max_concurrency="", EXECUTION_ENV_PATH="env.tar.gz") == BlsSettings(256, "llm")
    assert settings(llm_model=" chat ").llm_model == "chat"
    assert settings(llm_model="").llm_model == "llm"
    with pytest.raises(ValueError, match=r"unknown llm_bls parameter\(s\) \['max_concurency'\]; "
                                         r"its parameters are max_concurrency .* and llm_model"):
        settings(max_concurency="8")
    for bad in ("0", "-5", "abc", "8.0"):
        with pytest.raises(ValueError, match=f"max_concurrency must be an integer >= 1, got '{bad}'"):
            settings(max_concurrency=bad)
    with pytest.raises(ValueError, match="llm_model must name the decoupled model that llm_bls "
                                         "calls, not llm_bls itself"):
        settings(llm_model="llm_bls")
