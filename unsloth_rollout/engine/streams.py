"""RequestStream: the deltas of submitted requests, as an async iterator for one event loop.

``open_stream`` submits every request at once (an invalid one raises and none stays queued); the engine thread
puts each delta, then one ``None`` per request when its future is done, on the loop's queue. Leaving the iteration
early, or ``close()`` (a client disconnect), aborts whatever has not finished.
"""

from __future__ import annotations

import asyncio
import concurrent.futures


class RequestStream:
    """Deltas of submitted requests as they are produced; ``close()`` aborts what has not finished."""

    def __init__(self, engine, indexed: bool):
        self.engine = engine
        self.indexed = indexed
        self.queue: asyncio.Queue = asyncio.Queue()
        self.futures: list[tuple[str, concurrent.futures.Future]] = []

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        remaining = len(self.futures)
        try:
            while remaining:
                k, d = await self.queue.get()
                if d is None:
                    remaining -= 1
                    exc = self.futures[k][1].exception()
                    if exc is not None:
                        raise exc
                    continue
                yield (k, d) if self.indexed else d
        finally:
            self.close()

    def close(self) -> None:
        for rid, fut in self.futures:
            if not fut.done():
                self.engine.abort(rid)


def open_stream(engine, requests: list, indexed: bool) -> RequestStream:
    """Submit ``requests`` to ``engine`` now and return their RequestStream (call from a running event loop)."""
    loop = asyncio.get_running_loop()
    stream = RequestStream(engine, indexed)
    try:
        for k, req in enumerate(requests):
            fut = engine.submit(req, on_delta=lambda d, k=k: loop.call_soon_threadsafe(stream.queue.put_nowait, (k, d)))
            # Queued after the last delta: both are put from the engine thread, in order.
            fut.add_done_callback(lambda f, k=k: loop.call_soon_threadsafe(stream.queue.put_nowait, (k, None)))
            stream.futures.append((req.request_id, fut))
    except BaseException:
        stream.close()
        raise
    return stream
