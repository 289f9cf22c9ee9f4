"""The core lease between a rollout replica process (owner) and the trainer (borrower)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from postrl.protocol.cores import CoreBorrower, CoreOwner


def test_borrower_takes_idle_cores_and_the_owner_gets_them_back_at_the_next_poll(tmp_path):
    owner = CoreOwner(tmp_path, "replica-0", timeout_s=10)
    borrower = CoreBorrower(tmp_path, {"replica-0": 3})
    assert borrower.poll() == 3  # idle owner: its 3 threads are lent

    async def main():
        claimed, done = asyncio.Event(), asyncio.Event()

        async def work():
            async with owner.working():
                claimed.set()
                async with owner.working():  # a second request shares the claim
                    await done.wait()

        task = asyncio.create_task(work())
        await asyncio.sleep(0.05)
        assert not claimed.is_set()  # still lent: the owner waits for the borrower's poll
        assert borrower.poll() == 0  # the owner wants them: given back
        await asyncio.wait_for(claimed.wait(), 5)
        assert borrower.poll() == 0  # working: nothing to borrow
        done.set()
        await task

    asyncio.run(main())
    assert owner.claims == 1 and owner.timeouts == 0 and owner.waited_s >= 0.04
    assert borrower.poll() == 3  # the last request left: lent again
    borrower.release()
    assert borrower.borrowed_s > 0
    owner.close()
    borrower.close()


def test_an_owner_that_waits_past_its_deadline_works_anyway_and_counts_it(tmp_path):
    owner = CoreOwner(tmp_path, "r", timeout_s=0.2)
    borrower = CoreBorrower(tmp_path, {"r": 1})
    assert borrower.poll() == 1

    async def main():
        async with owner.working():
            pass

    t0 = time.monotonic()
    asyncio.run(main())  # the borrower never polls again
    assert 0.2 <= time.monotonic() - t0 < 5
    assert owner.timeouts == 1
    owner.close()
    borrower.close()


def test_a_killed_owner_or_borrower_leaves_no_lock_behind(tmp_path):
    """flock locks die with their process: a SIGKILLed owner lends its cores, a SIGKILLed
    borrower gives them back."""
    src = textwrap.dedent(
        f"""
        import asyncio, sys, time
        from postrl.protocol.cores import CoreBorrower, CoreOwner
        if sys.argv[1] == "owner":
            o = CoreOwner({str(tmp_path)!r}, "r", timeout_s=30)
            async def main():
                async with o.working():
                    print("holding", flush=True)
                    await asyncio.sleep(60)
            asyncio.run(main())
        else:
            b = CoreBorrower({str(tmp_path)!r}, {{"r": 1}})
            print("holding" if b.poll() == 1 else "idle?", flush=True)
            time.sleep(60)
        """
    )
    env = {**os.environ, "PYTHONPATH": os.getcwd()}

    def hold(role: str) -> subprocess.Popen:
        p = subprocess.Popen(
            [sys.executable, "-c", src, role], stdout=subprocess.PIPE, text=True, env=env
        )
        assert p.stdout is not None and p.stdout.readline().strip() == "holding"
        return p

    borrower = CoreBorrower(tmp_path, {"r": 2})
    p = hold("owner")
    try:
        assert borrower.poll() == 0  # the owner works
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(10)
    assert borrower.poll() == 2  # its locks died with it
    borrower.release()

    p = hold("borrower")
    owner = CoreOwner(tmp_path, "r", timeout_s=30)

    async def claim() -> float:
        t0 = time.monotonic()
        async with owner.working():
            return time.monotonic() - t0

    try:

        async def main() -> float:
            task = asyncio.create_task(claim())
            await asyncio.sleep(0.2)
            assert not task.done()  # lent to the live borrower
            p.send_signal(signal.SIGKILL)
            return await asyncio.wait_for(task, 10)

        assert asyncio.run(main()) >= 0.2
    finally:
        p.kill()
        p.wait(10)
    assert owner.timeouts == 0
    owner.close()
    borrower.close()


@pytest.mark.parametrize("cancel", [True, False])
def test_a_request_cancelled_while_the_owner_waits_releases_everything(tmp_path, cancel):
    owner = CoreOwner(tmp_path, "r", timeout_s=10)
    borrower = CoreBorrower(tmp_path, {"r": 1})
    assert borrower.poll() == 1

    async def main():
        async def work():
            async with owner.working():
                await asyncio.sleep(0)

        task = asyncio.create_task(work())
        await asyncio.sleep(0.02)
        if cancel:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        assert borrower.poll() == 0  # the owner's pending claim marks it busy: given back
        await asyncio.sleep(0.05)  # the claim ends; with no caller left it lends again
        if not cancel:
            await task

    asyncio.run(main())
    assert borrower.poll() == 1
    owner.close()
    borrower.close()
