"""A private event loop in a daemon thread, for engines whose APIs are coroutines bound to one loop
(vLLM's ``AsyncLLM``, SGLang's ``Engine``). Lets their adapters offer postrl's interface — async
``generate`` from any loop, plain blocking ``update_weights`` / ``sleep`` / ``wake_up`` — with a
deadline on every blocking wait."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from postrl.rollout.types import RolloutTimeoutError

__all__ = ["LoopThread"]

T = TypeVar("T")


class LoopThread:
    """Run coroutines on a dedicated loop thread."""

    def __init__(self, name: str = "postrl-engine-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float = 600.0) -> T:
        """Run ``coro`` on the loop thread and block for its result (raises on deadline)."""
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout=timeout_s)
        except TimeoutError as e:
            fut.cancel()
            raise RolloutTimeoutError(f"engine call did not finish within {timeout_s}s") from e

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` (executed on the loop thread) from any other event loop."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def close(self) -> None:
        """Stop the loop thread."""
        self.loop.call_soon_threadsafe(self.loop.stop)
