"""MMLU's 57 subjects in its four standard categories, for leave-domain-out evaluation.

The grouping is the one the MMLU authors publish with the benchmark (Hendrycks et al., "Measuring Massive
Multitask Language Understanding", ICLR 2021; `categories.py` of github.com/hendrycks/test): each subject has a
subcategory (math, physics, law, health, ...), and the subcategories form STEM, humanities, social sciences and
other (business, health, misc.).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

MMLU_GROUPS: dict[str, tuple[str, ...]] = {
    "STEM": (
        "abstract_algebra", "astronomy", "college_biology", "college_chemistry", "college_computer_science",
        "college_mathematics", "college_physics", "computer_security", "conceptual_physics", "electrical_engineering",
        "elementary_mathematics", "high_school_biology", "high_school_chemistry", "high_school_computer_science",
        "high_school_mathematics", "high_school_physics", "high_school_statistics", "machine_learning"),
    "humanities": (
        "formal_logic", "high_school_european_history", "high_school_us_history", "high_school_world_history",
        "international_law", "jurisprudence", "logical_fallacies", "moral_disputes", "moral_scenarios", "philosophy",
        "prehistory", "professional_law", "world_religions"),
    "social sciences": (
        "econometrics", "high_school_geography", "high_school_government_and_politics", "high_school_macroeconomics",
        "high_school_microeconomics", "high_school_psychology", "human_sexuality", "professional_psychology",
        "public_relations", "security_studies", "sociology", "us_foreign_policy"),
    "other": (
        "anatomy", "business_ethics", "clinical_knowledge", "college_medicine", "global_facts", "human_aging",
        "management", "marketing", "medical_genetics", "miscellaneous", "nutrition", "professional_accounting",
        "professional_medicine", "virology"),
}
SUBJECT_GROUP: dict[str, str] = {s: g for g, subjects in MMLU_GROUPS.items() for s in subjects}


def subject_groups(subjects: Sequence[str]) -> np.ndarray:
    """Each subject's MMLU group; ValueError naming the subjects that are not MMLU's."""
    unknown = sorted(set(subjects) - set(SUBJECT_GROUP))
    if unknown:
        raise ValueError(f"not MMLU subjects (no domain group): {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
    return np.array([SUBJECT_GROUP[s] for s in subjects])
