"""Request routing across models: quality policies (heuristic, learned, random) with live share calibration,
SLA/cost constraints with fallback, spend caps, balancing a model's replicas (with `dp.placement`'s policies), and
offline training/evaluation (RouteLLM's metrics). Pure policy: nothing here runs an engine."""
from pagedlm.dp.placement import (
                                  LeastLoadedPolicy,
                                  LoadStats,
                                  NoCandidateError,
                                  PrefixAffinityPolicy,
                                  RoundRobinPolicy,
)
from pagedlm.router.answer import EscalationScorer, WeakAnswer
from pagedlm.router.budget import BudgetExceededError, BudgetLimits, SpendLedger
from pagedlm.router.calibration import ShareCalibrator, ShareMonitor, population_stability_index
from pagedlm.router.cascade import CascadePolicy, SamplesCost
from pagedlm.router.policies import (
                                     SLO,
                                     Candidate,
                                     ClassifierPolicy,
                                     Decision,
                                     HeuristicPolicy,
                                     RandomPolicy,
                                     RequestFeatures,
                                     ScorePolicy,
                                     SLAPolicy,
                                     extract_features,
                                     threshold_for,
)
from pagedlm.router.router import ModelEntry, Router

__all__ = ["SLO", "BudgetExceededError", "BudgetLimits", "Candidate", "CascadePolicy", "ClassifierPolicy",
           "Decision", "EscalationScorer", "HeuristicPolicy", "LeastLoadedPolicy", "LoadStats", "ModelEntry",
           "NoCandidateError", "PrefixAffinityPolicy", "RandomPolicy", "RequestFeatures", "RoundRobinPolicy", "Router",
           "SLAPolicy", "SamplesCost", "ScorePolicy", "ShareCalibrator", "ShareMonitor", "SpendLedger", "WeakAnswer",
           "extract_features", "population_stability_index", "threshold_for"]
