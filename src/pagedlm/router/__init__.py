"""Request routing across models: quality policies (heuristic, learned, random), SLA/cost constraints with
fallback, replica load balancing, and offline training/evaluation (RouteLLM's metrics)."""
from pagedlm.router.policies import (
                                     SLO,
                                     Candidate,
                                     ClassifierPolicy,
                                     Decision,
                                     HeuristicPolicy,
                                     LeastLoadedPolicy,
                                     LoadStats,
                                     NoCandidateError,
                                     PrefixAffinityPolicy,
                                     RandomPolicy,
                                     RequestFeatures,
                                     RoundRobinPolicy,
                                     ScorePolicy,
                                     SLAPolicy,
                                     extract_features,
                                     threshold_for,
)
from pagedlm.router.router import ModelEntry, Router

__all__ = ["SLO", "Candidate", "ClassifierPolicy", "Decision", "HeuristicPolicy", "LeastLoadedPolicy", "LoadStats",
           "ModelEntry", "NoCandidateError", "PrefixAffinityPolicy", "RandomPolicy", "RequestFeatures",
           "RoundRobinPolicy", "Router", "SLAPolicy", "ScorePolicy",
           "extract_features", "threshold_for"]
