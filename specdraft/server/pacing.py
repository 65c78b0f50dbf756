"""Fixed-cadence streaming (``stream_mode: "fixed"``): a defence against the speculation side channel.

With normal streaming each engine step becomes one SSE event, so an observer of the (encrypted)
connection sees how many tokens each step accepted in the events' sizes and timing, and from that
what the drafter guessed right: which says something about the content and about a retrieval
drafter's datastore ("When Speculation Spills Secrets"). In fixed mode the stream's shape is decided
before decoding. Events fall on a grid of ticks ``interval_s`` apart from the request's arrival,
one per tick from one interval after the first tokens. The queue and prefill time shows, rounded to
the grid, as in any stream; it does not depend on acceptance. Each event carries exactly
``chunk_tokens`` tokens (fewer only in the last), or none when the engine is behind (a keep-alive),
and is padded with an SSE comment to a multiple of ``pad_bytes``. So events differ neither in size
nor in time.

What it does not hide: the stream's end, so the total number of tokens and, when the engine is slower
than the cadence, the total decoding time. See docs/server.md, "Speculation side channel".
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import AsyncIterator

STREAM_MODES = ("normal", "fixed")


@dataclass(frozen=True)
class StreamPacing:
    chunk_tokens: int = 4
    interval_s: float = 0.2
    pad_bytes: int = 512
    locked: bool = False  # True: a request may not ask for "normal" (the operator protects the datastore)

    def __post_init__(self):
        if self.chunk_tokens < 1:
            raise ValueError(f"the fixed stream chunk must be >= 1 token, got {self.chunk_tokens}")
        if not self.interval_s > 0:
            raise ValueError(f"the fixed stream interval must be > 0 s, got {self.interval_s}")
        if self.pad_bytes < 0:
            raise ValueError(f"the fixed stream padding must be >= 0 bytes, got {self.pad_bytes}")


def pad(event: str, bucket: int) -> str:
    """``event`` (an SSE event, ending in a blank line) grown to a multiple of ``bucket`` bytes by an
    SSE comment line in front of it, which every SSE client ignores."""
    if bucket <= 0:
        return event
    size = len(event.encode("utf-8"))
    need = -(size + 2) % bucket  # the comment adds ":" and "\n" at least
    return ":" + " " * need + "\n" + event


def keepalive(bucket: int) -> str:
    """An event with no data (a comment only), the same size as a padded data event."""
    return ":" + " " * max(0, bucket - 3) + "\n\n"


async def _next(events):
    return await anext(events)


def _on_grid(t0: float, t: float, interval: float) -> float:
    """The first time at or after ``t`` on the grid t0 + j * interval."""
    return t0 + math.ceil((t - t0) / interval - 1e-9) * interval


async def paced(events: AsyncIterator[tuple], p: StreamPacing, t0: float | None = None) -> AsyncIterator[tuple]:
    """Regroup a job's ("tokens", (ids, logprob entries)) events into ``p.chunk_tokens``-token events,
    one per tick of ``p.interval_s`` from one interval after the first tokens, on the grid of ticks
    from ``t0`` (the request's arrival, ``time.monotonic()``; default now), with ("keepalive", None) on
    ticks with nothing to send. The final event ("done", or an error or timeout) comes on the tick after
    the last buffered tokens: an error's time must not tell when a step failed either."""
    loop = asyncio.get_running_loop()  # its clock is time.monotonic()
    t0 = loop.time() if t0 is None else t0
    ids: list[int] = []
    lps: list | None = None
    end = None
    pending = None
    tick = None  # the clock starts with the first tokens: before them, the time is the queue and the prefill's
    try:
        while True:
            if end is None:
                pending = pending or asyncio.ensure_future(_next(events))
                await asyncio.wait({pending}, timeout=None if tick is None else max(0.0, tick - loop.time()))
                if pending.done():
                    kind, payload = pending.result()
                    pending = None
                    if kind == "tokens":
                        tick = tick or _on_grid(t0, loop.time() + p.interval_s, p.interval_s)
                        ids += payload[0]
                        if payload[1] is not None:
                            lps = (lps or []) + payload[1]
                        continue
                    end = (kind, payload)  # done, error or timeout: after the buffered tokens, on a tick
                    tick = tick or loop.time()
                    continue
            tick = loop.time() if tick is None else tick  # (set by now: by the first tokens or the end)
            if end is not None:
                await asyncio.sleep(max(0.0, tick - loop.time()))
            tick += p.interval_s
            if len(ids) >= p.chunk_tokens or (end is not None and ids):
                n = p.chunk_tokens
                yield "tokens", (ids[:n], None if lps is None else lps[:n])
                ids, lps = ids[n:], None if lps is None else lps[n:]
            elif end is not None:
                yield end
                return
            else:
                yield "keepalive", None
    finally:
        if pending is not None:
            pending.cancel()
