"""The deadline on an async tool: TimeoutError when it runs out, nothing else changed."""

from __future__ import annotations

import asyncio

import pytest

from app.calls.service import _within


async def test_a_call_past_its_deadline_raises_timeout_error() -> None:
    finished = False

    async def slow() -> None:
        nonlocal finished
        await asyncio.sleep(5)
        finished = True

    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(TimeoutError):
        await _within(slow(), 0.05)
    assert loop.time() - started < 2
    assert not finished
    # The expiry's cancellation was taken back: the task is not left cancelling.
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0


async def test_a_call_in_time_returns_its_result_and_its_timer_is_gone() -> None:
    async def quick() -> str:
        await asyncio.sleep(0)
        return "done"

    assert await _within(quick(), 0.05) == "done"
    # Had the timer outlived the call, it would cancel this sleep.
    await asyncio.sleep(0.15)


async def test_a_cancellation_from_outside_is_not_turned_into_a_timeout() -> None:
    started = asyncio.Event()

    async def waits() -> None:
        started.set()
        await asyncio.sleep(5)

    task = asyncio.create_task(_within(waits(), 5))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()


async def test_a_tool_s_own_errors_pass_through() -> None:
    async def fails() -> None:
        raise ValueError("bad input")

    async def own_timeout() -> None:
        raise TimeoutError("the tool's own upstream timed out")

    with pytest.raises(ValueError, match="bad input"):
        await _within(fails(), 1)
    with pytest.raises(TimeoutError, match="own upstream"):
        await _within(own_timeout(), 1)
