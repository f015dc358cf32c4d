"""Domain-robust prompt features: what a prompt looks like, not what it is about.

Topic embeddings learn which subjects the weak model fails on, and that does not carry over to subjects it has
not seen (on MMLU, trained on three of its four domains, an embedding router falls below random on the fourth).
These features describe the prompt's form instead: its length and the length of its parts, numbers and operators,
the question's form (negated, a blank to fill, statements to judge, a passage to read, a computation asked for) and
its reading level (word length, syllables, sentence length, a Flesch-Kincaid grade). Microseconds a prompt.
"""
from __future__ import annotations

import math
import re
import string
from collections.abc import Sequence

import numpy as np

FEATURES_VERSION = 1
FEATURE_NAMES = (
    "log_chars", "log_stem_chars", "log_choice_chars", "choice_length_spread", "log_numbers", "numbers_per_word",
    "operators_per_char", "numeric_choices", "word_length", "syllables_per_word", "log_words_per_sentence",
    "grade_level", "long_words", "negated", "ends_with_question_mark", "blank", "statements", "which_of_following",
    "uppercase_share", "first_person", "computation", "judgement", "passage", "all_none_of_above", "log_sentences",
    "multiple_choice",
)

_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_OPERATOR = re.compile(r"[-+*/^=<>%]|\\[a-z]+")
_WORD = re.compile(r"[A-Za-z]+")
_SENTENCE_END = re.compile(r"[.?!](?:\s|$)")
_VOWELS = re.compile(r"[aeiouy]+")
_NO_VOWEL = re.compile(r"\b[b-df-hj-np-tv-xz]+\b")  # a lower-case word without a vowel group
_CHOICE = re.compile(r"^[A-D][.)] ?(.*)$", re.MULTILINE)
# `(?=[...])`: the first letters of the alternatives, a quick test before trying each one at every word start
_NEGATED = re.compile(r"(?=[nefil])\b(not|except|false|incorrect|least)\b", re.IGNORECASE)
_STATEMENTS = re.compile(r"(Statement|Scenario) 1\s*\|")
_WHICH = re.compile(r"which of the following", re.IGNORECASE)
_FIRST_PERSON = re.compile(r"(?=[Im])\b(I|me|my)\b")
_COMPUTATION = re.compile(r"(?=[chwfsed])\b(calculate|compute|how many|how much|what is the value|find the|solve|"
                          r"evaluate|estimate|determine the)\b", re.IGNORECASE)
_JUDGEMENT = re.compile(r"(?=[bmpsc])\b(best|most likely|primarily|most|strongest|correct)\b", re.IGNORECASE)
_PASSAGE = re.compile(r"(?=[tr])\b(the following (passage|information|excerpt|text)|refers to)\b", re.IGNORECASE)
_ALL_NONE = re.compile(r"(?=[anb])\b(all|none|both) of the (above|following)\b", re.IGNORECASE)


def prompt_features(prompt: str) -> list[float]:
    """The FEATURE_NAMES values of one prompt. The stem is the text before the first `\\nA.` choice line."""
    stem = prompt.split("\nA.")[0]
    choices = _CHOICE.findall(prompt)
    words, stem_words = _WORD.findall(prompt), _WORD.findall(stem)
    n_words, n_stem_words = max(1, len(words)), max(1, len(stem_words))
    sentences = max(1, len(_SENTENCE_END.findall(stem)))
    numbers = len(_NUMBER.findall(prompt))
    choice_logs = [math.log1p(len(c)) for c in choices] or [0.0]
    choice_mean = sum(len(c) for c in choices) / len(choices) if choices else 0.0
    log_mean = sum(choice_logs) / len(choice_logs)
    numeric_choices = sum(bool(_NUMBER.search(c)) and len(_WORD.findall(c)) <= 2 for c in choices)
    lowered = " ".join(stem_words).lower()  # a word's syllables: its vowel groups, at least one
    syllables = (len(_VOWELS.findall(lowered)) + len(_NO_VOWEL.findall(lowered))) / len(stem_words) \
        if stem_words else 1.0
    words_per_sentence = n_stem_words / sentences
    grade = 0.39 * words_per_sentence + 11.8 * syllables - 15.59  # Flesch-Kincaid
    return [
        math.log1p(len(prompt)), math.log1p(len(stem)), math.log1p(choice_mean),
        math.sqrt(sum((v - log_mean) ** 2 for v in choice_logs) / len(choice_logs)), math.log1p(numbers),
        numbers / n_words, len(_OPERATOR.findall(prompt)) / max(1, len(prompt)),
        numeric_choices / max(1, len(choices)), sum(map(len, words)) / len(words) if words else 0.0, syllables,
        math.log1p(words_per_sentence), grade / 10, sum(len(w) > 6 for w in words) / len(words) if words else 0.0,
        bool(_NEGATED.search(stem)), stem.rstrip().endswith("?"), "_" in stem, bool(_STATEMENTS.search(stem)),
        bool(_WHICH.search(stem)), _uppercase(prompt) / max(1, len(prompt)),
        bool(_FIRST_PERSON.search(stem)), bool(_COMPUTATION.search(stem)), bool(_JUDGEMENT.search(stem)),
        bool(_PASSAGE.search(stem)), bool(_ALL_NONE.search(prompt)), math.log1p(sentences), len(choices) >= 2,
    ]


def _uppercase(text: str) -> int:
    """Characters of `text` that are upper case (ASCII text: A-Z counted in C)."""
    return sum(map(text.count, string.ascii_uppercase)) if text.isascii() else sum(map(str.isupper, text))


def feature_matrix(prompts: Sequence[str]) -> np.ndarray:
    """[len(prompts), len(FEATURE_NAMES)] float32."""
    return np.array([prompt_features(p) for p in prompts], dtype=np.float32).reshape(len(prompts), len(FEATURE_NAMES))
