"""How `pagedlm serve` routes requests for the route name (`auto`) among its models: `RouterConfig`, one field per
routing flag (policy, cascade scorer, tiers, calibration, SLOs, spend caps)."""
from __future__ import annotations

from dataclasses import dataclass

from pagedlm.config.flags import check_choices, option

ROUTING = "several models and routing"  # the flags' help group
ROUTERS = ("heuristic", "learned", "cascade", "none")


@dataclass(frozen=True)
class RouterConfig:
    """The router's settings, each a `pagedlm serve` flag of the same name."""

    router: str | None = option(None, "policy for requests to --router-name (default: heuristic with several "
                                "models, else none); cascade: the weak model answers first, unconfident answers are "
                                "re-run on the strong one", choices=ROUTERS, group=ROUTING)
    cascade_threshold: float = option(-1.0, "cascade: re-run when the weak answer's mean token logprob is at or "
                                      "below this (the start point when --strong-fraction is given)", group=ROUTING)
    cascade_scorer: str = option("mean", "cascade: what judges the weak answer: mean (its mean token logprob), "
                                 "answer (its per-token logprob quantiles, minimum and length-normalised sum, and the "
                                 "agreement of --cascade-samples), or a file from `pagedlm router train-cascade`",
                                 group=ROUTING)
    cascade_samples: int = option(1, "cascade: samples of the weak answer drawn at once (n=k, sharing the prompt's "
                                  "KV blocks); their agreement feeds --cascade-scorer answer", group=ROUTING)
    router_name: str = option("auto", "model name that asks the router to choose", group=ROUTING)
    router_classifier: str | None = option(None, "router file from `pagedlm router train` (learned)", group=ROUTING)
    strong_model: list[str] | None = option(None, "a strong-tier model (repeatable; default: the last --model; the "
                                            "others are weak)", metavar="NAME", group=ROUTING)
    strong_fraction: float | None = option(None, "share of requests the quality policy sends strong, held on live "
                                           "traffic (learned router default 0.5; heuristic: only when given)",
                                           group=ROUTING)
    router_threshold: float | None = option(None, "fixed strong-score threshold (overrides --strong-fraction; "
                                            "heuristic default 0.5)", group=ROUTING)
    calibration_window: int = option(500, "recent requests whose scores set the live threshold (0: keep the offline "
                                     "threshold)", group=ROUTING)
    model_cost: list[str] | None = option(None, "price per 1M input and output tokens (cheapest model of a tier "
                                          "wins; repeatable)", metavar="NAME=IN,OUT", group=ROUTING)
    tier_share: list[str] | None = option(None, "one tier per model, cheapest first (by --model-cost): the share of "
                                          "requests this model's tier takes, held on live traffic (repeatable, one "
                                          "per model, summing to 1); harder requests go to pricier tiers",
                                          metavar="NAME=SHARE", group=ROUTING)
    max_ttft_ms: float | None = option(None, "SLO: predicted time to first token", group=ROUTING)
    max_tpot_ms: float | None = option(None, "SLO: recent time per output token", group=ROUTING)
    max_queue: int | None = option(None, "SLO: waiting requests at which a model is overloaded", group=ROUTING)
    max_request_cost: float | None = option(None, "SLO: predicted price of one request", group=ROUTING)
    max_cost_per_hour: float | None = option(None, "spend cap over the last hour, from --model-cost prices and the "
                                             "tokens used; near it requests go to cheaper models, past it they get "
                                             "429", group=ROUTING)
    max_cost_per_hour_per_key: float | None = option(None, "the same cap for each API key (--api-key)",
                                                     group=ROUTING)
    budget_near: float = option(0.8, "share of a spend cap from which requests go to cheaper models", group=ROUTING)

    def __post_init__(self) -> None:
        check_choices(self)
        if self.calibration_window < 0:
            raise ValueError("--calibration-window must be >= 0.")

    def kind(self, num_models: int) -> str:
        """The policy in effect: --router, else heuristic with several models and none with one."""
        return self.router or ("heuristic" if num_models > 1 else "none")
