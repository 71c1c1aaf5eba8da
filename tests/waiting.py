"""Polling for a condition with a deadline, from a thread (`wait_for`) or on an asyncio loop
(`until`): a condition that never comes true fails the test with what it waited for, instead
of hanging the run."""
import asyncio
import time


def wait_for(condition, what: str, timeout_s: float = 10.0, state=None) -> None:
    """Sleeps 50 ms at a time until condition() is true, for at most timeout_s. On timeout the
    failure names what was awaited, and state() as it was then, if given."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, (
            f"timed out waiting for {what}" + (f": {state()}" if state else ""))
        time.sleep(0.05)


async def until(condition, what: str, timeout_s: float = 10.0, poll_s: float = 0.001) -> None:
    """Yields to the loop (sleeping poll_s) until condition() is true, for at most timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(poll_s)
