"""``GET /metrics`` in the Prometheus text format, written by prometheus_client: the
scheduler's counters and gauges, and histograms of batch sizes, request latency and time to
first token. Each app has its own registry, so several apps can live in one process."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily, Metric)
from prometheus_client.registry import Collector

from tiergen.engine.scheduler import Request, Scheduler

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class _SchedulerCollector(Collector):
    """Reads the scheduler's counters at each scrape."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler

    def collect(self) -> Iterator[Metric]:
        m = self._scheduler.snapshot()
        for name, help, value in [
            ("requests", "Requests submitted to the engine.", m.requests_total),
            ("requests_finished", "Requests that finished (stop or length).", m.requests_finished),
            ("requests_cancelled", "Requests cancelled (client gone or shutdown).",
             m.requests_cancelled),
            ("requests_rejected", "Requests refused because the queue was full.",
             m.requests_rejected),
            ("requests_timed_out", "Requests that waited in the queue longer than the queue "
                                   "timeout.", m.requests_timed_out),
            ("prompt_tokens", "Prompt tokens submitted.", m.prompt_tokens),
            ("generated_tokens", "Tokens generated.", m.generated_tokens),
            ("prefix_cache_hits", "Micro-batches that took a prompt prefix from the prefix "
                                  "cache.", m.prefix_cache_hits),
            ("shared_prompt_tokens", "Prompt tokens copied from a shared prefix (the prefix "
                                     "cache's, or one computed once for a micro-batch) instead "
                                     "of computed.", m.shared_prompt_tokens),
            ("steps", "Engine steps run.", m.steps),
            ("merges", "Micro-batches merged into another once their prompts were in.", m.merges),
            ("speculative_proposed_tokens", "Tokens proposed by speculative decoding and checked.",
             m.proposed_tokens),
            ("speculative_accepted_tokens", "Proposed tokens kept (the model picked them too).",
             m.accepted_tokens),
            ("speculative_checking_steps", "Sequences' speculative steps; each keeps its accepted "
                                           "tokens and one of the model's own.", m.checking_steps),
        ]:
            yield CounterMetricFamily(f"tiergen_{name}", help, value=value)
        yield GaugeMetricFamily("tiergen_prefix_cache_bytes", "Bytes the prefix cache holds "
                                "where the policy keeps KV caches.", value=m.prefix_cache_bytes)
        yield GaugeMetricFamily("tiergen_prefix_cache_disk_bytes", "Bytes the prefix cache holds "
                                "in spill files.", value=m.prefix_cache_disk_bytes)
        yield GaugeMetricFamily("tiergen_queue_depth", "Requests waiting to be admitted.",
                                value=m.queue_depth)
        yield GaugeMetricFamily("tiergen_running_sequences", "Sequences in the running batch.",
                                value=m.running)
        sizes = m.batch_sizes  # sequences per step -> steps
        buckets = [(f"{b:g}", float(sum(n for size, n in sizes.items() if size <= b)))
                   for b in BATCH_BUCKETS]
        yield HistogramMetricFamily(
            "tiergen_batch_size", "Sequences in each engine step.",
            buckets=buckets + [("+Inf", float(sum(sizes.values())))],
            sum_value=float(sum(size * n for size, n in sizes.items())))


class ServerMetrics:
    """What /metrics reports; ``observe`` is called for every request that finishes."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_SchedulerCollector(scheduler))
        self.latency = Histogram("tiergen_request_latency_seconds",
                                 "Seconds from submission to the last token, per finished request.",
                                 buckets=SECONDS_BUCKETS, registry=self.registry)
        self.ttft = Histogram("tiergen_time_to_first_token_seconds",
                              "Seconds from submission to the first token, per finished request.",
                              buckets=SECONDS_BUCKETS, registry=self.registry)

    def observe(self, req: Request) -> None:
        if req.finish_reason not in ("stop", "length"):
            return
        self.latency.observe(req.finished_at - req.created)
        self.ttft.observe(req.first_token_at - req.created)

    def render(self) -> bytes:
        return generate_latest(self.registry)
