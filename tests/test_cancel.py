"""The cancellation token: first reason wins, callbacks once, children, threads, async waits."""

import asyncio
import threading
import time

import pytest
from conftest import run
from hypothesis import given, settings
from hypothesis import strategies as st

from anarchon_lite import Aborted, Cancelled, CancelToken, LeaseLost, RunTimeout, Shutdown


def test_reason_hierarchy():
    for cls in (Shutdown, RunTimeout, LeaseLost, Cancelled):
        assert issubclass(cls, Aborted)
    assert issubclass(RunTimeout, TimeoutError) and issubclass(RunTimeout, OSError)
    # a loop's `except Exception:` must not swallow a shutdown
    assert not issubclass(Shutdown, Exception) and not issubclass(Aborted, Exception)


def test_first_reason_wins_and_callbacks_run_once():
    token = CancelToken()
    seen = []
    token.on_abort(seen.append)
    assert not token.aborted and token.reason is None
    token.throw_if_aborted()
    first = Shutdown("deploy")
    assert token.abort(first) is True
    assert token.abort(Cancelled("later")) is False
    assert token.aborted and token.reason is first and seen == [first]
    with pytest.raises(Shutdown):
        token.throw_if_aborted()
    late = []
    token.on_abort(late.append)  # registered after the abort: runs at once
    assert late == [first]


def test_default_reason_and_remover():
    token = CancelToken()
    seen = []
    remove = token.on_abort(seen.append)
    remove()
    token.abort()
    assert seen == [] and isinstance(token.reason, Cancelled)


def test_a_failing_callback_does_not_stop_the_others():
    token = CancelToken()
    seen = []
    token.on_abort(lambda r: 1 / 0)
    token.on_abort(seen.append)
    token.abort(Shutdown())
    assert len(seen) == 1


def test_child_aborts_with_parent_and_detaches():
    parent = CancelToken()
    child = parent.child()
    grandchild = child.child()
    reason = Shutdown()
    parent.abort(reason)
    assert child.reason is reason and grandchild.reason is reason
    # a child aborted by itself leaves its parent
    parent2 = CancelToken()
    kid = parent2.child()
    kid.abort(Cancelled())
    assert parent2._callbacks == {}
    parent2.abort(Shutdown())
    assert isinstance(kid.reason, Cancelled)
    # a child of an aborted token starts aborted
    assert CancelToken.child(parent).aborted


def test_after_aborts_by_itself():
    token = CancelToken.after(0.05)
    assert token.aborted is False
    event = threading.Event()
    token.on_abort(lambda r: event.set())
    assert event.wait(5)
    assert isinstance(token.reason, RunTimeout)


def test_async_wait_sleep_and_run():
    async def main():
        token = CancelToken()
        asyncio.get_running_loop().call_later(0.05, token.abort, Shutdown("stop"))
        assert isinstance(await token.wait(), Shutdown)
        assert isinstance(await token.wait(), Shutdown)  # already aborted: returns at once

        token = CancelToken()
        await token.sleep(0.01)  # not aborted: just sleeps
        asyncio.get_running_loop().call_later(0.05, token.abort, Cancelled())
        started = time.monotonic()
        with pytest.raises(Cancelled):
            await token.sleep(30)
        assert time.monotonic() - started < 10

        token = CancelToken()
        assert await token.run(asyncio.sleep(0, result=7)) == 7
        cancelled = asyncio.Event()

        async def slow():
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.set()
                raise

        asyncio.get_running_loop().call_later(0.05, token.abort, LeaseLost())
        with pytest.raises(LeaseLost):
            await token.run(slow())
        assert cancelled.is_set()

    run(main())


def test_abort_from_a_thread_wakes_the_loop_and_the_other_way_round():
    async def main():
        token = CancelToken()
        threading.Timer(0.05, token.abort, [Shutdown()]).start()
        assert isinstance(await token.wait(), Shutdown)

        token = CancelToken()
        result = []

        def worker():
            try:
                for _ in range(10_000):
                    token.throw_if_aborted()
                    token.sleep_sync(0.01)
            except Shutdown as exc:
                result.append(exc)

        thread = threading.Thread(target=worker)
        thread.start()
        await asyncio.sleep(0.05)
        token.abort(Shutdown())
        await asyncio.get_running_loop().run_in_executor(None, thread.join, 10)
        assert len(result) == 1

    run(main())


@given(st.lists(st.integers(0, 3), min_size=1, max_size=8))
@settings(max_examples=50, deadline=None)
def test_concurrent_aborts_from_threads(kinds):
    token = CancelToken()
    children = [token.child() for _ in range(3)]
    calls = []
    token.on_abort(calls.append)
    reasons = [(Shutdown, Cancelled, LeaseLost, RunTimeout)[k]() for k in kinds]
    barrier = threading.Barrier(len(reasons))
    wins = []

    def hit(reason):
        barrier.wait()
        if token.abort(reason):
            wins.append(reason)

    threads = [threading.Thread(target=hit, args=(r,)) for r in reasons]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1 and calls == wins and token.reason is wins[0]
    assert all(c.reason is wins[0] for c in children)
