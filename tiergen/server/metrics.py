"""``GET /metrics`` in the Prometheus text format: the scheduler's counters and gauges, and
histograms of batch sizes, request latency and time to first token."""

from __future__ import annotations

import bisect
import math

from tiergen.engine.scheduler import Request, Scheduler

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Histogram:
    """Cumulative buckets, a sum and a count, as Prometheus histograms are exposed."""

    def __init__(self, name: str, help: str, buckets: tuple[float, ...]) -> None:
        self.name, self.help, self.bounds = name, help, buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += count
        self.sum += value * count

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        total = 0
        for bound, count in zip((*self.bounds, math.inf), self.counts):
            total += count
            le = "+Inf" if bound == math.inf else f"{bound:g}"
            lines.append(f'{self.name}_bucket{{le="{le}"}} {total}')
        lines += [f"{self.name}_sum {self.sum:.6f}", f"{self.name}_count {total}"]
        return lines


class ServerMetrics:
    """What /metrics reports; ``observe`` is called for every request that finishes."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler
        self.latency = Histogram("tiergen_request_latency_seconds",
                                 "Seconds from submission to the last token, per finished request.",
                                 SECONDS_BUCKETS)
        self.ttft = Histogram("tiergen_time_to_first_token_seconds",
                              "Seconds from submission to the first token, per finished request.",
                              SECONDS_BUCKETS)

    def observe(self, req: Request) -> None:
        if req.finish_reason not in ("stop", "length"):
            return
        self.latency.observe(req.finished_at - req.created)
        self.ttft.observe(req.first_token_at - req.created)

    def render(self) -> str:
        m = self._scheduler.snapshot()
        batch_size = Histogram("tiergen_batch_size", "Sequences in each engine step.",
                               BATCH_BUCKETS)
        for size, steps in m.batch_sizes.items():  # the scheduler counts every step
            batch_size.observe(size, steps)
        lines: list[str] = []
        for name, kind, help, value in [
            ("requests_total", "counter", "Requests submitted to the engine.", m.requests_total),
            ("requests_finished_total", "counter", "Requests that finished (stop or length).",
             m.requests_finished),
            ("requests_cancelled_total", "counter", "Requests cancelled (client gone or shutdown).",
             m.requests_cancelled),
            ("requests_rejected_total", "counter", "Requests refused because the queue was full.",
             m.requests_rejected),
            ("requests_timed_out_total", "counter",
             "Requests that waited in the queue longer than the queue timeout.",
             m.requests_timed_out),
            ("prompt_tokens_total", "counter", "Prompt tokens submitted.", m.prompt_tokens),
            ("generated_tokens_total", "counter", "Tokens generated.", m.generated_tokens),
            ("steps_total", "counter", "Engine steps run.", m.steps),
            ("queue_depth", "gauge", "Requests waiting to be admitted.", m.queue_depth),
            ("running_sequences", "gauge", "Sequences in the running batch.", m.running),
        ]:
            lines += [f"# HELP tiergen_{name} {help}", f"# TYPE tiergen_{name} {kind}",
                      f"tiergen_{name} {value}"]
        for histogram in (batch_size, self.latency, self.ttft):
            lines += histogram.render()
        return "\n".join(lines) + "\n"
