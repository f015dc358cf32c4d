"""BERT encoders for sentence embeddings (all-MiniLM-L6-v2 and its kind): the encoder in plain torch, loaded from an
HF safetensors directory (tensors only), and the pooling a sentence-transformers directory declares (mean or CLS
token, then L2 normalisation where its modules list `Normalize`).

Post-LayerNorm BERT: embeddings = LN(word + position + token type); each layer h = LN(h + attn(h)),
h = LN(h + W2 gelu(W1 h)). Padding is masked out of attention and of the mean."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    max_seq_length: int  # tokens embedded per input (sentence-transformers' max_seq_length, else the positions)
    pooling: str  # "mean" | "cls"
    normalize: bool

    @classmethod
    def of(cls, path: Path) -> BertConfig:
        hf = json.loads((path / "config.json").read_text())
        if hf.get("model_type") != "bert" or hf.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"{path} is not a BERT encoder with absolute positions (model_type "
                             f"{hf.get('model_type')!r})")
        if hf.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"{path}: hidden_act {hf['hidden_act']!r} is not supported (gelu)")
        st = _json(path / "sentence_bert_config.json")
        pooling = _json(path / "1_Pooling" / "config.json")
        modules = _json(path / "modules.json") or []
        return cls(vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
                   num_heads=hf["num_attention_heads"], intermediate_size=hf["intermediate_size"],
                   max_position_embeddings=hf["max_position_embeddings"], type_vocab_size=hf.get("type_vocab_size", 2),
                   layer_norm_eps=hf.get("layer_norm_eps", 1e-12),
                   max_seq_length=min(st.get("max_seq_length") or hf["max_position_embeddings"],
                                      hf["max_position_embeddings"]),
                   pooling="cls" if pooling.get("pooling_mode_cls_token") else "mean",
                   normalize=any(m.get("type", "").endswith("Normalize") for m in modules))


def _json(path: Path) -> dict | list:
    return json.loads(path.read_text()) if path.is_file() else {}


class BertLayer(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.layer_norm_eps
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(h, 3 * h)
        self.attn_out = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=eps)
        self.up = nn.Linear(h, cfg.intermediate_size)
        self.down = nn.Linear(cfg.intermediate_size, h)
        self.out_norm = nn.LayerNorm(h, eps=eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.num_heads, h // self.num_heads).permute(2, 0, 3, 1, 4)
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = self.attn_norm(x + self.attn_out(ctx.transpose(1, 2).reshape(b, t, h)))
        return self.out_norm(x + self.down(F.gelu(self.up(x))))


class BertEncoder(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.word = nn.Embedding(cfg.vocab_size, h)
        self.position = nn.Embedding(cfg.max_position_embeddings, h)
        self.token_type = nn.Embedding(cfg.type_vocab_size, h)
        self.norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_layers))

    @property
    def dim(self) -> int:
        return self.config.hidden_size

    @torch.inference_mode()
    def embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Sentence embeddings [batch, hidden] (float32) of right-padded ids [batch, tokens] and their mask
        (1: token, 0: padding)."""
        t = input_ids.shape[1]
        x = self.word(input_ids) + self.position.weight[:t] + self.token_type.weight[0]
        x = self.norm(x)
        keep = attention_mask.bool()
        mask = keep[:, None, None, :]  # [batch, 1, 1, keys]: padding is never attended to
        for layer in self.layers:
            x = layer(x, mask)
        x = x.float()
        if self.config.pooling == "cls":
            pooled = x[:, 0]
        else:
            m = keep.unsqueeze(-1).float()
            pooled = (x * m).sum(1) / m.sum(1).clamp(min=1.0)
        return F.normalize(pooled, dim=-1) if self.config.normalize else pooled


def load_bert(path: Path, dtype: torch.dtype = torch.float32) -> BertEncoder:
    """The encoder of an HF BERT directory (`model.safetensors`, with or without the `bert.` prefix)."""
    cfg = BertConfig.of(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} holds no .safetensors weights")
    raw: dict[str, torch.Tensor] = {}
    for f in files:
        raw.update((k.removeprefix("bert."), v) for k, v in load_file(f).items())
    model = BertEncoder(cfg)
    state = {"word.weight": raw["embeddings.word_embeddings.weight"],
             "position.weight": raw["embeddings.position_embeddings.weight"],
             "token_type.weight": raw["embeddings.token_type_embeddings.weight"],
             "norm.weight": raw["embeddings.LayerNorm.weight"], "norm.bias": raw["embeddings.LayerNorm.bias"]}
    for i in range(cfg.num_layers):
        p = f"encoder.layer.{i}."
        for part in ("weight", "bias"):
            state[f"layers.{i}.qkv.{part}"] = torch.cat([raw[f"{p}attention.self.{n}.{part}"]
                                                        for n in ("query", "key", "value")])
            for ours, theirs in (("attn_out", "attention.output.dense"), ("attn_norm", "attention.output.LayerNorm"),
                                 ("up", "intermediate.dense"), ("down", "output.dense"),
                                 ("out_norm", "output.LayerNorm")):
                state[f"layers.{i}.{ours}.{part}"] = raw[f"{p}{theirs}.{part}"]
    model.load_state_dict(state, strict=True)
    return model.to(dtype).eval()
