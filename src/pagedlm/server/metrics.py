"""Prometheus metrics under vLLM's names (so its dashboards work), plus pagedlm's KV-block gauges.

Gauges and engine-wide totals are read from the engine's stats snapshot at scrape time; latency
histograms are fed by engine listeners. Each app gets its own CollectorRegistry, shared by all its engines.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pagedlm.engine.client import EngineClient, StepRecord

if TYPE_CHECKING:
    from pagedlm.router import Router
    from pagedlm.server.limits import LogprobBudget
    from pagedlm.server.stages import StagePools

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0]
_REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0]
_DECISION_BUCKETS = [0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0]
_TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000]


_G, _C = GaugeMetricFamily, CounterMetricFamily
# (kind, name, help, value of (engine, its stats snapshot)), in exposition order
_ENGINE_FAMILIES: list[tuple[type, str, str, Callable]] = [
    (_G, "vllm:num_requests_running", "Sequences in the running batch.", lambda e, s: s.num_running),
    (_G, "vllm:num_requests_waiting", "Requests waiting to be scheduled.", lambda e, s: s.num_waiting),
    (_G, "vllm:num_requests_swapped", "Requests swapped out to host memory.", lambda e, s: s.num_swapped),
    (_G, "vllm:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.", lambda e, s: s.kv_cache_usage),
    (_G, "vllm:gpu_cache_usage_perc", "KV-cache usage (legacy name); 1 means 100 percent.",
     lambda e, s: s.kv_cache_usage),
    (_C, "vllm:num_preemptions", "Cumulative number of preemptions.", lambda e, s: s.num_preemptions),
    (_C, "vllm:prompt_tokens", "Prefill tokens processed.", lambda e, s: s.prompt_tokens),
    (_C, "vllm:generation_tokens", "Generation tokens processed.", lambda e, s: s.generation_tokens),
    (_C, "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
     lambda e, s: s.prefix_cache_queries),
    (_C, "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", lambda e, s: s.prefix_cache_hits),
    (_C, "vllm:spec_decode_num_drafts", "Speculative steps: a sequence verified a draft.",
     lambda e, s: s.spec_decode.num_drafts),
    (_C, "vllm:spec_decode_num_draft_tokens", "Draft tokens verified.", lambda e, s: s.spec_decode.num_draft_tokens),
    (_C, "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
     lambda e, s: s.spec_decode.num_accepted_tokens),
    (_G, "pagedlm:kv_blocks_total", "KV-cache blocks on the device.", lambda e, s: s.num_total_blocks),
    (_G, "pagedlm:kv_blocks_free", "Free KV-cache blocks.", lambda e, s: s.num_free_blocks),
    (_G, "pagedlm:kv_blocks_used", "Allocated KV-cache blocks.", lambda e, s: s.num_total_blocks - s.num_free_blocks),
    (_C, "pagedlm:requests_rejected", "Requests refused because the waiting queue was full.",
     lambda e, s: e.num_rejected),
    (_C, "pagedlm:requests_failed", "Requests failed by an engine error.", lambda e, s: e.num_failed),
    (_C, "pagedlm:requests_stalled", "Requests aborted because their client stopped reading.",
     lambda e, s: e.num_stalled),
]

# the prefix cache's disk tier (--kv-cache-dir): (kind, name, help, DiskTierStats field), shown when an engine has one
_DISK_FAMILIES = [
    (_C, "pagedlm:kv_disk_lookups", "Prompts whose prefix missed in memory and was looked up on disk.", "lookups"),
    (_C, "pagedlm:kv_disk_misses", "Disk lookups that found nothing.", "misses"),
    (_C, "pagedlm:kv_disk_skipped_loads", "Disk hits recomputed instead: the load was predicted slower.", "skipped"),
    (_C, "pagedlm:kv_disk_hit_blocks", "KV blocks loaded from disk.", "hit_blocks"),
    (_C, "pagedlm:kv_disk_read_bytes", "Bytes of KV blocks read from disk.", "bytes_read"),
    (_C, "pagedlm:kv_disk_written_bytes", "Bytes of KV block files written.", "bytes_written"),
    (_C, "pagedlm:kv_disk_load_seconds", "Time spent reading KV blocks from disk.", "load_seconds"),
    (_C, "pagedlm:kv_disk_writes_dropped", "Runs of KV blocks not written (queue full or write error).",
     "writes_dropped"),
    (_C, "pagedlm:kv_disk_writes_skipped", "KV blocks not written: the write budget was spent (kept in memory).",
     "writes_skipped"),
    (_C, "pagedlm:kv_disk_corrupt_files", "KV block files rejected (truncated, corrupted, foreign) and removed.",
     "corrupt_files"),
    (_C, "pagedlm:kv_disk_evicted_files", "KV block files removed to keep the disk budget.", "evicted_files"),
    (_G, "pagedlm:kv_disk_usage_bytes", "Bytes under the KV cache directory, as last counted.", "usage_bytes"),
    (_G, "pagedlm:kv_disk_files", "KV block files under the KV cache directory, as last counted.", "num_files"),
]


class _EngineCollector(Collector):
    """Each engine's stats snapshot, one sample per model (label `model_name`) in every family."""

    def __init__(self, engines: Mapping[str, EngineClient]) -> None:
        self.engines = dict(engines)

    def collect(self):
        # with data parallelism, one sample per replica (label `replica`), else one per model
        by_replica = any(eng.replicas for eng in self.engines.values())
        snaps = []
        for name, eng in self.engines.items():
            parts = list(eng.replicas.items()) or [("0", eng)]
            snaps += [((name, rep) if by_replica else (name,), e, e.stats) for rep, e in parts]
        labels = ["model_name", "replica"] if by_replica else ["model_name"]

        def family(kind: type, name: str, doc: str, value: Callable) -> GaugeMetricFamily | CounterMetricFamily:
            f = kind(name, doc, labels=labels)
            for key, eng, s in snaps:
                f.add_metric(list(key), value(eng, s))
            return f

        for kind, name, doc, value in _ENGINE_FAMILIES:
            yield family(kind, name, doc, value)
        if any(s.disk is not None for _, _, s in snaps):
            for kind, name, doc, attr in _DISK_FAMILIES:
                yield family(kind, name, doc, lambda e, s, attr=attr: getattr(s.disk, attr) if s.disk else 0)
        if by_replica:
            yield family(_C, "pagedlm:replica_restarts", "Times Ray restarted the replica after it died or hung.",
                         lambda e, s: e.restarts)
            yield family(_C, "pagedlm:replica_retries", "Requests moved to another replica after losing this one "
                                                       "before sending anything.",
                         lambda e, s: self._retries(e))
            yield family(_G, "pagedlm:replica_healthy", "1 while the replica is up, 0 while it is out.",
                         lambda e, s: float(e.is_running))
        per_pos = _C("vllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by draft position.",
                     labels=[*labels, "position"])
        for key, eng, s in snaps:
            for pos, n in enumerate(s.spec_decode.accepted_per_pos):
                per_pos.add_metric([*key, str(pos)], n)
        yield per_pos
        moe = _C("pagedlm:moe_expert_tokens", "Tokens routed to each expert of each mixture-of-experts layer.",
                 labels=[*labels, "layer", "expert"])
        for key, eng, s in snaps:
            for layer, counts in s.moe_expert_tokens.items():
                for expert, n in enumerate(counts):
                    moe.add_metric([*key, str(layer), str(expert)], n)
        yield moe

    def _retries(self, replica: EngineClient) -> int:
        for eng in self.engines.values():
            for name, r in eng.replicas.items():
                if r is replica:
                    return eng.retries_of(name)
        return 0


class _RouterCollector(Collector):
    """The router's promises, read at scrape time: strong share (target, realised, the policy's own, what the
    SLA/load/fallback/budget rules forced), the live threshold, score drift vs training, and spend."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self):
        r, G = self.router, GaugeMetricFamily
        st = r.served.stats()
        share = G("pagedlm:router_strong_share", "Share of recent routed requests (pagedlm:router_share_window) "
                  "served by a strong model (kind=realised) or sent strong by the quality policy (kind=policy).",
                  labels=["kind"])
        for kind, v in (("realised", st.realised), ("policy", st.policy)):
            if v is not None:
                share.add_metric([kind], v)
        yield share
        yield G("pagedlm:router_share_window", "Recent routed requests the shares are measured on.", value=st.requests)
        forced = G("pagedlm:router_forced_share", "Share of recent routed requests a rule moved to the other tier "
                   "than the quality policy chose.", labels=["rule", "tier"])
        for rule, tiers in st.forced.items():
            for tier, v in tiers.items():
                forced.add_metric([rule, tier], v)
        yield forced
        targets = getattr(r.policy, "shares", None)
        if targets is not None:  # more than two tiers
            names = {m.rank: m.name for m in r.models.values()}
            tier = G("pagedlm:router_tier_share", "Share of recent routed requests served by each tier "
                     "(kind=realised), sent there by the quality policy (kind=policy), and its target.",
                     labels=["tier", "model", "kind"])
            seen = r.served.tier_shares()
            for k, target in enumerate(targets):
                for kind, v in (("target", target), *((kd, seen[k][kd]) for kd in ("realised", "policy") if k in seen)):
                    tier.add_metric([str(k), names.get(k, ""), kind], v)
            yield tier
        threshold = getattr(r.policy, "threshold", None)
        if threshold is not None:
            yield G("pagedlm:router_threshold", "The quality policy's current strong-score threshold.",
                    value=threshold)
        cal = r.calibrator
        if cal is not None:
            cs = cal.state()
            yield G("pagedlm:router_strong_share_target", "The strong share live calibration holds.", value=cs.target)
            if cs.psi is not None:
                yield G("pagedlm:router_score_drift_psi", "Population stability index of recent strong scores vs "
                        "the training scores (>0.25: traffic unlike the training data).", value=cs.psi)
        if r.budget is not None:
            b = r.budget.state()
            yield CounterMetricFamily("pagedlm:router_spend_dollars", "Cost of routed requests, by tokens used.",
                                      value=b.total_spent)
            yield G("pagedlm:router_spend_window_dollars", "Cost settled in the budget window (last hour).",
                    value=b.spent)
            yield G("pagedlm:router_spend_held_dollars", "Worst-case cost held for routed requests in flight.",
                    value=b.held)
            if b.cap_per_hour is not None:
                yield G("pagedlm:router_budget_dollars_per_hour", "The server's spend cap (--max-cost-per-hour).",
                        value=b.cap_per_hour)


class _StageCollector(Collector):
    """The pre-engine stages' load (stages.py): jobs in each pool, its threads, and requests it refused."""

    def __init__(self, stages: StagePools) -> None:
        self.stages = stages

    def collect(self):
        jobs = _G("pagedlm:stage_jobs", "Pre-engine jobs running or queued, by stage.", labels=["stage"])
        threads = _G("pagedlm:stage_threads", "Worker threads of each pre-engine stage.", labels=["stage"])
        refused = _C("pagedlm:stage_refused", "Requests answered 503 because their stage was full.",
                     labels=["stage"])
        for stage, (n, t, r) in self.stages.load().items():
            jobs.add_metric([stage], n)
            threads.add_metric([stage], t)
            refused.add_metric([stage], r)
        yield from (jobs, threads, refused)


class _LogprobBudgetCollector(Collector):
    """The logprob entries admitted requests hold of the server's budget (limits.LogprobBudget)."""

    def __init__(self, budget: LogprobBudget) -> None:
        self.budget = budget

    def collect(self):
        yield _G("pagedlm:logprob_entries_held", "Logprob entries the admitted requests keep on the host.",
                 value=self.budget.held)
        yield _G("pagedlm:logprob_budget", "Logprob entries all requests may keep at once (0: no budget).",
                 value=self.budget.total)


class _ModelHistograms:
    """One model's children of the shared latency/size histograms; `on_step` is its engine listener."""

    def __init__(self, m: ServerMetrics, model_name: str) -> None:
        self.model_name, self.success = model_name, m.success
        for attr in _HISTOGRAMS:
            setattr(self, attr, getattr(m, attr).labels(model_name))

    def on_step(self, rec: StepRecord) -> None:
        for v in rec.ttft:
            self.ttft.observe(v)
        for v in rec.itl:
            self.itl.observe(v)
            self.tpot.observe(v)
        for out in rec.finished:
            for reason in out.finish_reasons:
                self.success.labels(self.model_name, reason).inc()
            m = out.metrics
            if m is None or out.aborted or m.finished_time is None:
                continue
            self.e2e.observe(m.finished_time - m.arrival_time)
            if m.first_scheduled_time is not None:
                self.queue.observe(m.first_scheduled_time - m.arrival_time)
                self.inference.observe(m.finished_time - m.first_scheduled_time)
                if m.first_token_time is not None:
                    self.prefill.observe(m.first_token_time - m.first_scheduled_time)
            if m.first_token_time is not None:
                self.decode.observe(m.finished_time - m.first_token_time)
            self.prompt_tokens.observe(out.num_prompt_tokens)
            self.generation_tokens.observe(out.num_generation_tokens)
            self.params_n.observe(len(out.finish_reasons))


_HISTOGRAMS = ("ttft", "itl", "tpot", "e2e", "queue", "prefill", "decode", "inference", "prompt_tokens",
               "generation_tokens", "params_n")


class ServerMetrics:
    """Metrics of every served engine (each sample labelled `model_name`, as vLLM does), registered as step
    listeners on them; with a `router`, also its counters and gauges. `render()` gives the exposition text."""

    def __init__(self, engines: Mapping[str, EngineClient], router: Router | None = None,
                 stages: StagePools | None = None, logprob_budget: LogprobBudget | None = None) -> None:
        disable_created_metrics()  # no `_created` series (process-wide), as vLLM does
        self.registry = reg = CollectorRegistry()
        reg.register(_EngineCollector(engines))
        if stages is not None:
            reg.register(_StageCollector(stages))
        if logprob_budget is not None:
            reg.register(_LogprobBudgetCollector(logprob_budget))
        ProcessCollector(registry=reg)  # process_resident_memory_bytes etc.: host memory of the server process
        lbl = ["model_name"]

        def hist(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(name, doc, lbl, buckets=buckets, registry=reg)

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
        for name, engine in engines.items():
            engine.add_listener(_ModelHistograms(self, name).on_step)
        if router is not None:
            reg.register(_RouterCollector(router))
            self.router_cascade = Counter("pagedlm:router_cascade", "Cascade answers of the weak model: kept, or "
                                          "re-run on the strong model (escalated).", ["outcome"], registry=reg)
            self.router_cascade_tokens = Counter(
                "pagedlm:router_cascade_sample_tokens", "Tokens of the cascade's extra weak samples (n=k beyond the "
                "kept answer): decode tokens generated (extra_decode), and prompt tokens read from the kept "
                "sample's KV blocks instead of prefilled (prefill_reused).", ["kind"], registry=reg)
            self.router_cascade_cost = Counter(
                "pagedlm:router_cascade_sample_cost_dollars", "Cost of the cascade's extra weak samples at the weak "
                "model's prices (--model-cost).", registry=reg)
            self.router_budget_refusals = Counter("pagedlm:router_budget_refusals",
                                                  "Routed requests refused because every model was over budget.",
                                                  registry=reg)
            self.router_requests = Counter(
                "pagedlm:router_requests", "Routed requests, by the model that took them and the reason category.",
                ["model", "reason"], registry=reg)
            self.router_fallbacks = Counter(
                "pagedlm:router_fallbacks", "Routed requests moved to another model after a refusal or failure.",
                ["from_model", "to_model"], registry=reg)
            self.router_decision = Histogram("pagedlm:router_decision_seconds",
                                             "Time to choose a model (policy and classifier).",
                                             buckets=_DECISION_BUCKETS, registry=reg)

    def render(self) -> bytes:
        return generate_latest(self.registry)
