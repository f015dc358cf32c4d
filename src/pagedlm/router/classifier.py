"""Learned routing signal: a prompt -> the strong score that ranks it for the strong model.

Inputs (`inputs`): all-MiniLM-L6-v2 sentence embeddings (`embedding.py`), the domain-robust prompt features
(`features.py`), or both side by side. Labels: whether the weak model answered correctly, and optionally whether
the strong one did. Trained on the weak label alone (target "weak"), the strong score is 1 - P(weak correct);
trained on both (target "gain"), it is P(strong correct) - P(weak correct), the expected accuracy gained by
sending the prompt to the strong model (RouteLLM's golden-label win, but counting the prompts where only the weak
model is right as losses). The head is logistic regression, an MLP or gradient-boosted trees (`heads.py`).
A router file is written with `torch.save` (plain tensors and numbers, loadable with `weights_only=True`).
"""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Sequence

import numpy as np

from pagedlm.router.embedding import (  # noqa: F401 - re-exported: where router files and tests look for them
    FAST_EMBEDDER,
    LEGACY_EMBEDDER,
    Embedder,
    EmbedderConfig,
    embed_cached,
    embedding_model_path,
)
from pagedlm.router.features import FEATURE_NAMES, FEATURES_VERSION, feature_matrix
from pagedlm.router.heads import BoostedTrees, TorchHead, head_from_state

INPUTS = ("embedding", "features", "embedding+features")
FORMAT = "pagedlm-router-v2"


def build_inputs(inputs: str, embeddings: np.ndarray | None, features: np.ndarray | None) -> np.ndarray:
    """The classifier's input rows: embeddings, prompt features, or both side by side."""
    if inputs not in INPUTS:
        raise ValueError(f"inputs must be one of {INPUTS}, got {inputs!r}")
    parts = [a for name, a in (("embedding", embeddings), ("features", features)) if name in inputs]
    if any(a is None for a in parts):
        raise ValueError(f"inputs {inputs!r} need {' and '.join(n for n in INPUTS[:2] if n in inputs)}")
    return np.hstack([np.asarray(a, dtype=np.float32) for a in parts]) if len(parts) > 1 else parts[0]


class WeakCorrectClassifier:
    """`predict(x)` = P(weak model correct | input row x); `strong_score(x)` ranks prompts for the strong model
    (see the module docstring). Keeps the sorted training scores so a threshold can be calibrated for any strong
    share. Feature columns are standardised with the training mean and spread (`shift`, `scale`)."""

    def __init__(self, head: TorchHead | BoostedTrees, train_scores: np.ndarray, meta: dict | None = None,
                 embedder: EmbedderConfig = LEGACY_EMBEDDER, inputs: str = "embedding", target: str = "weak",
                 shift: np.ndarray | None = None, scale: np.ndarray | None = None) -> None:
        self.head, self.inputs, self.target = head, inputs, target
        self.train_scores = np.sort(np.asarray(train_scores, dtype=np.float64))
        self.meta = dict(meta or {})  # e.g. how the training split was drawn
        self.embedder_config = embedder  # how the training prompts were embedded
        self.shift, self.scale = shift, scale
        self._embedder: Embedder | None = None

    @property
    def kind(self) -> str:
        return self.head.kind

    @property
    def uses_embedding(self) -> bool:
        return "embedding" in self.inputs

    @classmethod
    def fit(cls, x: np.ndarray, weak_correct: np.ndarray, kind: str = "logreg", hidden: int = 128,
            weight_decay: float = 1e-3, epochs: int = 40, seed: int = 0, embedder: EmbedderConfig = LEGACY_EMBEDDER,
            strong_correct: np.ndarray | None = None, inputs: str = "embedding") -> "WeakCorrectClassifier":
        """Fit on input rows `x` (`build_inputs(inputs, ...)`, embeddings computed with the `embedder` config).
        With `strong_correct`, the target is the gain (two labels); without, P(weak correct)."""
        x = np.asarray(x, dtype=np.float32)
        labels = np.asarray(weak_correct, dtype=np.float32)[:, None]
        if strong_correct is not None:
            labels = np.hstack([labels, np.asarray(strong_correct, dtype=np.float32)[:, None]])
        shift, scale = np.zeros(x.shape[1], np.float32), np.ones(x.shape[1], np.float32)
        if "features" in inputs:  # the feature columns come last
            cols = slice(x.shape[1] - len(FEATURE_NAMES), None)
            spread = x[:, cols].std(0)
            shift[cols], scale[cols] = x[:, cols].mean(0), np.where(spread > 1e-4, spread, 1.0)
        z = (x - shift) / scale
        if kind == "gbm":
            head = BoostedTrees.fit(z, labels, seed=seed)
        else:
            head = TorchHead.fit(kind, z, labels, hidden, weight_decay, epochs, seed)
        clf = cls(head, np.zeros(0), embedder=embedder, inputs=inputs,
                  target="weak" if strong_correct is None else "gain", shift=shift, scale=scale)
        clf.train_scores = np.sort(clf.strong_score(x))
        return clf

    def _probs(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        if self.shift is not None:
            x = (x - self.shift) / self.scale
        return 1.0 / (1.0 + np.exp(-self.head.logits(x)))

    def predict(self, x: np.ndarray) -> np.ndarray:
        return self._probs(x)[:, 0]

    def strong_score(self, x: np.ndarray) -> np.ndarray:
        p = self._probs(x)
        return p[:, 1] - p[:, 0] if self.target == "gain" else 1.0 - p[:, 0]

    def inputs_for(self, texts: Sequence[str]) -> np.ndarray:
        """Input rows for raw prompts, built as in training (loads the embedding model on first use, if used)."""
        emb = None
        if self.uses_embedding:
            if self._embedder is None:
                self._embedder = Embedder(config=self.embedder_config)
            emb = self._embedder.encode(texts)
        return build_inputs(self.inputs, emb, feature_matrix(texts) if "features" in self.inputs else None)

    def score_texts(self, texts: Sequence[str]) -> np.ndarray:
        return self.strong_score(self.inputs_for(texts))

    def threshold_for(self, strong_fraction: float) -> float:
        """The score above which `strong_fraction` of the training prompts fall (RouteLLM's calibration)."""
        from pagedlm.router.policies import threshold_for

        return threshold_for(self.train_scores, strong_fraction)

    def save(self, path: str | Path) -> None:
        import torch

        torch.save({"format": FORMAT, "head": self.head.state(), "inputs": self.inputs, "target": self.target,
                    "features_version": FEATURES_VERSION, "embedder": "all-MiniLM-L6-v2",
                    "embedder_config": asdict(self.embedder_config),
                    "shift": torch.from_numpy(self.shift), "scale": torch.from_numpy(self.scale),
                    "train_scores": torch.from_numpy(self.train_scores), "meta": self.meta}, Path(path))

    @classmethod
    def load(cls, path: str | Path) -> "WeakCorrectClassifier":
        import torch

        blob = torch.load(Path(path), map_location="cpu", weights_only=True)
        embedder = EmbedderConfig(**blob["embedder_config"]) if "embedder_config" in blob else LEGACY_EMBEDDER
        if blob.get("format") == "pagedlm-router-v1":  # embedding + torch head on P(weak correct)
            head = TorchHead.from_state(blob)
            return cls(head, blob["train_scores"].numpy(), blob.get("meta"), embedder)
        if blob.get("format") != FORMAT:
            raise ValueError(f"{path}: not a pagedlm router file")
        if "features" in blob["inputs"] and blob.get("features_version") != FEATURES_VERSION:
            raise ValueError(f"{path}: trained on prompt features v{blob.get('features_version')}, this pagedlm "
                             f"computes v{FEATURES_VERSION}: train it again")
        return cls(head_from_state(blob["head"]), blob["train_scores"].numpy(), blob.get("meta"), embedder,
                   blob["inputs"], blob["target"], blob["shift"].numpy(), blob["scale"].numpy())
