"""The bridge between the scheduler thread and the event loop: the choices of one HTTP request
as scheduler requests whose events arrive, tagged with their choice index, on an asyncio queue;
and the server-sent-events framing of a stream."""

from __future__ import annotations

import asyncio
import json
import threading
import weakref
from collections.abc import AsyncIterator, Callable
from functools import partial

from tiergen.engine.llm import StreamEvent
from tiergen.engine.sampler import SamplingParams
from tiergen.engine.scheduler import Request, Scheduler
from tiergen.errors import TiergenError

DONE = "data: [DONE]\n\n"


def sse(payload: dict) -> str:
    """One server-sent event carrying a JSON object."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


class Courier:
    """Carries events from the scheduler thread to one event loop, a step's worth at a time:
    one wake-up of the loop per step instead of one per stream (the loop and the engine share
    the cores)."""

    _of: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Courier] = weakref.WeakKeyDictionary()

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, object]] = []

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> Courier:
        """The courier of ``loop`` (called on the loop's thread)."""
        courier = cls._of.get(loop)
        if courier is None:
            courier = cls._of[loop] = cls(loop)
        return courier

    def send(self, queue: asyncio.Queue, item: object) -> None:
        """Called on any thread: ``queue.put_nowait(item)`` on the loop, soon."""
        with self._lock:
            self._pending.append((queue, item))
            if len(self._pending) > 1:  # a hand-over is already on its way
                return
        try:
            self._loop.call_soon_threadsafe(self._hand_over)
        except RuntimeError:  # the loop has closed: nobody is listening any more
            with self._lock:
                self._pending.clear()

    def _hand_over(self) -> None:
        with self._lock:
            items, self._pending = self._pending, []
        for queue, item in items:
            queue.put_nowait(item)


class Generation:
    """The scheduler requests behind one HTTP request, one per choice.

    ``on_finish(request)`` is called on the event loop when a choice has finished.
    """

    def __init__(self, scheduler: Scheduler, on_finish: Callable[[Request], None]) -> None:
        self._scheduler = scheduler
        self._on_finish = on_finish
        self._courier = Courier.of(asyncio.get_running_loop())
        self._queue: asyncio.Queue[tuple[int, StreamEvent]] = asyncio.Queue()
        self.requests: list[Request] = []

    def submit(self, prompts: list[list[int]], params: list[SamplingParams]) -> None:
        """Queue every choice, or none: if one is refused, those already queued are cancelled."""
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                self.requests.append(self._scheduler.submit(prompt, p, partial(self._deliver, i)))
        except TiergenError:
            self.cancel()
            raise

    def _deliver(self, choice: int, ev: StreamEvent) -> None:
        """Called on the scheduler thread: hand the event to the event loop."""
        self._courier.send(self._queue, (choice, ev))

    async def events(self) -> AsyncIterator[tuple[int, StreamEvent]]:
        """Every choice's events, as they come, until all choices have finished."""
        pending = len(self.requests)
        while pending:
            choice, ev = await self._queue.get()
            if ev.finish_reason is not None:
                pending -= 1
                self._on_finish(self.requests[choice])
            yield choice, ev

    def cancel(self) -> None:
        """Stop every choice still generating (a no-op for finished ones)."""
        for r in self.requests:
            r.cancel()

    @property
    def completion_tokens(self) -> int:
        return sum(len(r.seq.token_ids) for r in self.requests)
