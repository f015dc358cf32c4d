"""Prometheus metrics under vLLM's names (so its dashboards work), plus pagedlm's KV-block gauges.

Gauges and engine-wide totals are read from the engine's stats snapshot at scrape time; latency
histograms are fed by an engine listener. Each app gets its own CollectorRegistry.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pagedlm.engine.async_engine import AsyncLLMEngine, StepRecord

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0]
_REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0]
_TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000]


class _EngineCollector(Collector):
    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.engine, self.model_name = engine, model_name

    def collect(self):
        s = self.engine.stats
        label = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(label, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(label, value)
            return c

        yield gauge("vllm:num_requests_running", "Sequences in the running batch.", s.num_running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield gauge("vllm:num_requests_swapped", "Requests swapped out to host memory.", s.num_swapped)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.", s.kv_cache_usage)
        yield gauge("vllm:gpu_cache_usage_perc", "KV-cache usage (legacy name); 1 means 100 percent.",
                    s.kv_cache_usage)
        yield counter("vllm:num_preemptions", "Cumulative number of preemptions.", s.num_preemptions)
        yield counter("vllm:prompt_tokens", "Prefill tokens processed.", s.prompt_tokens)
        yield counter("vllm:generation_tokens", "Generation tokens processed.", s.generation_tokens)
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits)
        yield gauge("pagedlm:kv_blocks_total", "KV-cache blocks on the device.", s.num_total_blocks)
        yield gauge("pagedlm:kv_blocks_free", "Free KV-cache blocks.", s.num_free_blocks)
        yield gauge("pagedlm:kv_blocks_used", "Allocated KV-cache blocks.", s.num_total_blocks - s.num_free_blocks)
        yield counter("pagedlm:requests_rejected", "Requests refused because the waiting queue was full.",
                      self.engine.num_rejected)
        yield counter("pagedlm:requests_failed", "Requests failed by an engine error.", self.engine.num_failed)


class ServerMetrics:
    """Registers on `engine` as a step listener; `render()` gives the Prometheus exposition text."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.model_name = model_name
        disable_created_metrics()  # no `_created` series (process-wide), as vLLM does
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        lbl, reg = ["model_name"], self.registry

        def hist(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(name, doc, lbl, buckets=buckets, registry=reg).labels(model_name)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between successive outputs of a request.",
                        _ITL_BUCKETS)
        self.tpot = hist("vllm:time_per_output_token_seconds", "Legacy name of inter_token_latency.",
                         _ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "End-to-end request latency.", _REQUEST_BUCKETS)
        self.queue = hist("vllm:request_queue_time_seconds", "Time waiting before first scheduled.",
                          _REQUEST_BUCKETS)
        self.prefill = hist("vllm:request_prefill_time_seconds", "First scheduled to first token.", _REQUEST_BUCKETS)
        self.decode = hist("vllm:request_decode_time_seconds", "First token to finish.", _REQUEST_BUCKETS)
        self.inference = hist("vllm:request_inference_time_seconds", "First scheduled to finish.",
                              _REQUEST_BUCKETS)
        self.prompt_tokens = hist("vllm:request_prompt_tokens", "Prompt tokens per request.", _TOKEN_BUCKETS)
        self.generation_tokens = hist("vllm:request_generation_tokens", "Generated tokens per request.",
                                      _TOKEN_BUCKETS)
        self.params_n = hist("vllm:request_params_n", "The n parameter of requests.", [1, 2, 5, 10, 20])
        self.success = Counter("vllm:request_success", "Finished requests by finish reason.",
                               ["model_name", "finished_reason"], registry=reg)
        engine.add_listener(self.on_step)

    def on_step(self, rec: StepRecord) -> None:
        for v in rec.ttft:
            self.ttft.observe(v)
        for v in rec.itl:
            self.itl.observe(v)
            self.tpot.observe(v)
        for out in rec.finished:
            for o in out.outputs:
                self.success.labels(self.model_name, o.finish_reason or "abort").inc()
            m = out.metrics
            if m is None or any(o.finish_reason == "abort" for o in out.outputs) or m.finished_time is None:
                continue
            self.e2e.observe(m.finished_time - m.arrival_time)
            if m.first_scheduled_time is not None:
                self.queue.observe(m.first_scheduled_time - m.arrival_time)
                self.inference.observe(m.finished_time - m.first_scheduled_time)
                if m.first_token_time is not None:
                    self.prefill.observe(m.first_token_time - m.first_scheduled_time)
            if m.first_token_time is not None:
                self.decode.observe(m.finished_time - m.first_token_time)
            self.prompt_tokens.observe(len(out.prompt_token_ids))
            self.generation_tokens.observe(sum(len(o.token_ids) for o in out.outputs))
            self.params_n.observe(len(out.outputs))

    def render(self) -> bytes:
        return generate_latest(self.registry)
