"""What this API process watched over the last minute, for the console: its online requests
(rate, time to first token) and each batch's completion rate and ETA."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from jobs import batches


class OnlineStats:
    """This API process's online requests over the last `window_seconds`: how many arrived, and
    their time to first token (enqueue to the first event from the worker). The console shows it."""

    def __init__(self, window_seconds: float = 60.0, clock=time.monotonic) -> None:
        self.window_seconds, self.clock = window_seconds, clock
        self.arrivals: deque[float] = deque()
        self.first_tokens: deque[tuple[float, float]] = deque()  # (when, seconds to the first token)

    def arrived(self) -> None:
        self.arrivals.append(self.clock())

    def first_token(self, seconds: float) -> None:
        self.first_tokens.append((self.clock(), seconds))

    def summary(self) -> dict[str, float | int | None]:
        start = self.clock() - self.window_seconds
        while self.arrivals and self.arrivals[0] < start:
            self.arrivals.popleft()
        while self.first_tokens and self.first_tokens[0][0] < start:
            self.first_tokens.popleft()
        ttfts = sorted(seconds for _, seconds in self.first_tokens)

        def quantile(q: float) -> float | None:
            return ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))] if ttfts else None

        return {"requests_per_s": len(self.arrivals) / self.window_seconds, "requests": len(self.arrivals),
                "ttft_p50": quantile(0.5), "ttft_p99": quantile(0.99), "window_seconds": self.window_seconds}


class RateSampler:
    """Each batch's recent completion rate, from the counts seen while the console is open."""

    def __init__(self, window_seconds: float = 60.0, clock=time.time) -> None:
        self.window_seconds, self.clock = window_seconds, clock
        self.samples: dict[str, deque[tuple[float, int]]] = {}

    def rate(self, batch: dict[str, Any]) -> float | None:
        """Requests/s over the last window (or since the batch started, until the console has
        watched it for a few seconds); None before it runs."""
        now, counts = self.clock(), batch["request_counts"]
        done = counts["completed"] + counts["failed"]
        samples = self.samples.setdefault(batch["id"], deque())
        samples.append((now, done))
        while len(samples) > 2 and now - samples[1][0] >= self.window_seconds:
            samples.popleft()
        start, done_then = samples[0]
        if now - start >= 5:
            return (done - done_then) / (now - start)
        started = batch.get("in_progress_at")
        return done / (now - started) if started and now > started else None


def eta_seconds(batch: dict[str, Any], rate: float | None) -> float | None:
    counts = batch["request_counts"]
    remaining = counts["total"] - counts["completed"] - counts["failed"]
    if batch["status"] in batches.TERMINAL or remaining <= 0:
        return 0.0
    return remaining / rate if rate else None
