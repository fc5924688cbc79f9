"""GET /metrics: Prometheus text through `prometheus_client`, with llama-server's metric names under a
`kimi_k3:` prefix (llama-server's is `llamacpp:`), read from the engine when scraped."""
from __future__ import annotations

from typing import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

PREFIX = "kimi_k3:"


class EngineCollector:
    """One scrape: the engine's counters and gauges as they are now."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        e = self.engine
        t, s = e.batch.timings, e.stats
        counters = (
            ("prompt_tokens", "Number of prompt tokens processed (not counting those from the prompt cache).",
             t.prompt_tokens),
            ("prompt_seconds", "Prompt process time.", t.prompt_s),
            ("tokens_predicted", "Number of generation tokens processed.", t.samples),
            ("tokens_predicted_seconds", "Predict process time.", t.eval_s + t.sample_s),
            ("n_decode", "Total number of model decode calls (one graph per step).", s.n_decode),
            ("requests", "Requests accepted.", s.requests),
            ("prompt_cache_hits", "Requests whose prompt began with a slot's cached tokens.", s.cache_hits),
            ("prompt_cache_tokens", "Prompt tokens taken from the prompt cache instead of computed.", s.cached_tokens),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(PREFIX + name, doc, value=value)
        busy = [slot for slot in e.slots if slot.busy]
        gauges = (
            ("prompt_tokens_seconds", "Average prompt throughput in tokens/s.", _rate(t.prompt_tokens, t.prompt_s)),
            ("predicted_tokens_seconds", "Average generation throughput in tokens/s.",
             _rate(t.samples, t.eval_s + t.sample_s)),
            ("n_busy_slots_per_decode", "Average number of busy slots per decode call.",
             s.busy_slots / s.n_decode if s.n_decode else 0.0),
            ("requests_processing", "Number of requests processing (in a slot).", e.processing),
            ("requests_deferred", "Number of requests deferred (waiting for a slot).", e.deferred),
            ("slots_total", "Slots (-np).", len(e.slots)),
            ("slots_busy", "Slots processing a request.", len(busy)),
        )
        for name, doc, value in gauges:
            yield GaugeMetricFamily(PREFIX + name, doc, value=value)


def _rate(n: float, seconds: float) -> float:
    return n / seconds if seconds > 0 else 0.0


def registry_for(engine) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
