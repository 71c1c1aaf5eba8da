import asyncio

import pytest

from tests.waiting import until, wait_for


def test_both_return_once_the_condition_holds_and_fail_naming_what_never_came():
    polls = []
    asyncio.run(until(lambda: polls.append(1) or len(polls) >= 3, "three polls", poll_s=0))
    assert len(polls) == 3
    with pytest.raises(AssertionError, match="timed out waiting for the impossible"):
        asyncio.run(until(lambda: False, "the impossible", timeout_s=0.05))
    polls.clear()
    wait_for(lambda: polls.append(1) or len(polls) >= 2, "two polls")
    assert len(polls) == 2
    with pytest.raises(AssertionError, match="timed out waiting for the impossible"):
        wait_for(lambda: False, "the impossible", timeout_s=0.05)
    with pytest.raises(AssertionError, match="waiting for the impossible: it was 7"):
        wait_for(lambda: False, "the impossible", timeout_s=0.05, state=lambda: "it was 7")
