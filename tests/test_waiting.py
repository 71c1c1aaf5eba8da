import asyncio

import pytest

from tests.waiting import until


def test_until_returns_once_the_condition_holds_and_fails_naming_what_never_came():
    polls = []
    asyncio.run(until(lambda: polls.append(1) or len(polls) >= 3, "three polls", poll_s=0))
    assert len(polls) == 3
    with pytest.raises(AssertionError, match="timed out waiting for the impossible"):
        asyncio.run(until(lambda: False, "the impossible", timeout_s=0.05))
