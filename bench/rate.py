"""A small open-loop load generator: requests at a constant rate, latency measured from the schedule.

wrk keeps a fixed number of connections busy (closed loop), which says nothing about latency at a
steady, modest load. This sends request i at start + i / rate whatever the earlier ones are doing,
and measures each latency from the moment it was due (so a stalled server is not hidden by the
generator waiting for it: no coordinated omission). It is bounded: at most `max_in_flight` requests
outstanding (a request due while that many are pending is counted as dropped) and a timeout on each.

The client is aiohttp on keep-alive connections: it spends about a third of the CPU per request that
httpx did, and on a 2-core machine the generator's own time is part of every latency it measures.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp


@dataclass(frozen=True)
class RateResult:
    rate: float
    duration_s: float
    scheduled: int
    ok: int
    non_2xx: int
    failed: int
    dropped: int
    late_sends: int  # sent more than 5 ms after they were due (the generator itself fell behind)
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    # Each answer that was not 2xx: its status and the start of its body (what went wrong).
    not_2xx: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of unsorted values; NaN when there are none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q / 100 * len(ordered))))
    return ordered[rank - 1]


async def constant_rate(
    url: str,
    body_for: Callable[[int], bytes],
    *,
    rate: float,
    duration: float,
    headers: dict[str, str] | None = None,
    request_timeout: float = 10.0,
    max_in_flight: int = 256,
    warmup: int = 5,
) -> RateResult:
    """POST `body_for(i)` to `url` at `rate` requests/s for `duration` seconds."""
    total = max(1, int(rate * duration))
    latencies: list[float] = []
    counts = {"ok": 0, "non_2xx": 0, "failed": 0, "dropped": 0, "late": 0}
    not_2xx: list[str] = []
    request_headers = {"Content-Type": "application/json", **(headers or {})}
    connector = aiohttp.TCPConnector(limit=max_in_flight)
    timeout = aiohttp.ClientTimeout(total=request_timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=request_headers) as client:
        for i in range(warmup):  # open a connection or two before the clock starts
            async with client.post(url, data=body_for(-1 - i)) as response:
                await response.read()
        in_flight = 0

        async def one(i: int, due: float) -> None:
            nonlocal in_flight
            try:
                async with client.post(url, data=body_for(i)) as response:
                    body = await response.read()
            except (aiohttp.ClientError, TimeoutError):
                counts["failed"] += 1
            else:
                latencies.append((time.perf_counter() - due) * 1000)
                if 200 <= response.status < 300:
                    counts["ok"] += 1
                else:
                    counts["non_2xx"] += 1
                    if len(not_2xx) < 20:
                        not_2xx.append(f"{response.status} {body[:200].decode(errors='replace')}")
            finally:
                in_flight -= 1

        tasks: list[asyncio.Task[None]] = []
        start = time.perf_counter() + 0.01
        for i in range(total):
            due = start + i / rate
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            elif -delay > 0.005:
                counts["late"] += 1
            if in_flight >= max_in_flight:
                counts["dropped"] += 1
                continue
            in_flight += 1
            tasks.append(asyncio.create_task(one(i, due)))
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=request_timeout + 1)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
    return RateResult(
        rate=rate,
        duration_s=duration,
        scheduled=total,
        ok=counts["ok"],
        non_2xx=counts["non_2xx"],
        failed=counts["failed"],
        dropped=counts["dropped"],
        late_sends=counts["late"],
        p50_ms=percentile(latencies, 50),
        p90_ms=percentile(latencies, 90),
        p99_ms=percentile(latencies, 99),
        max_ms=max(latencies, default=float("nan")),
        not_2xx=not_2xx,
    )
