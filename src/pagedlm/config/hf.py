"""Each family's HF config read into `ModelConfig` fields (what transformers' config classes would read, their
defaults included: a GGUF carries only some of the keys)."""
from __future__ import annotations

from typing import Any

LLAMA_STYLE_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe",
                     "smollm3")
SUPPORTED_ARCHITECTURES = ("LLaMA", "Mistral", "Qwen2/2.5", "Qwen3", "Phi-3", "Mixtral", "Qwen2-MoE", "Qwen3-MoE",
                           "OLMoE", "SmolLM3", "Gemma 3")


def model_config_kwargs(cfg: dict[str, Any]) -> dict[str, Any]:
    """`ModelConfig` keyword arguments from an HF config dict, as the family's transformers config class reads it."""
    model_type = cfg.get("model_type", "llama")
    if model_type in ("gemma3", "gemma3_text"):
        return _gemma3(cfg)
    if model_type not in LLAMA_STYLE_TYPES:
        arch = (cfg.get("architectures") or [None])[0]
        raise ValueError(f"Unsupported architecture {arch or model_type!r} (model_type {model_type!r}): pagedlm "
                         f"runs {', '.join(SUPPORTED_ARCHITECTURES)}.")
    return {**_common(cfg, model_type), **_llama_style(cfg, model_type)}


def _llama_style(cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
    """What sets the LLaMA-style families apart, read as transformers' config classes read it."""
    n = cfg["num_hidden_layers"]
    rope = cfg.get("rope_parameters") or {}
    if (cfg.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0) != 1.0:
        raise ValueError(f"{model_type}: partial rotary embeddings (partial_rotary_factor < 1) are not supported.")
    out: dict[str, Any] = dict(hidden_act=cfg.get("hidden_act") or "silu")
    window = cfg.get("sliding_window") or None
    types = cfg.get("layer_types")
    if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "smollm3") and not cfg.get("use_sliding_window"):
        window = None
    if model_type == "smollm3":  # a NoPE layer every no_rope_layer_interval layers unless no_rope_layers says
        every = cfg.get("no_rope_layer_interval") or 4
        flags = cfg.get("no_rope_layers") or [int((i + 1) % every != 0) for i in range(n)]
        out["layer_rope"] = [bool(f) for f in flags]
    if window is not None:
        if not types:
            mwl = cfg.get("max_window_layers", n)
            sliding = {"qwen2": lambda i: i >= mwl, "qwen3": lambda i: i >= mwl,
                       "qwen2_moe": lambda i: (i + 1) % 2 == 1 and i < mwl}.get(model_type, lambda i: True)
            types = ["sliding_attention" if sliding(i) else "full_attention" for i in range(n)]
        out.update(layer_types=list(types), sliding_window=int(window))
    if model_type in ("qwen2", "qwen2_moe"):
        out["qkv_bias"] = cfg.get("qkv_bias", True)
    else:
        bias = bool(cfg.get("attention_bias", False))
        out.update(qkv_bias=bias, o_bias=bias, mlp_bias=bool(cfg.get("mlp_bias", False)))
    if model_type in ("qwen3", "qwen3_moe"):
        out["qk_norm"] = "head"
    elif model_type == "olmoe":
        out.update(qk_norm="full", clip_qkv=cfg.get("clip_qkv"))
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    if model_type in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe") and experts:
        step, dense = cfg.get("decoder_sparse_step") or 1, set(cfg.get("mlp_only_layers") or [])
        out.update(num_experts=experts, num_experts_per_tok=cfg["num_experts_per_tok"],
                   moe_intermediate_size=(cfg.get("moe_intermediate_size") if model_type.startswith("qwen")
                                          else None) or cfg["intermediate_size"],
                   norm_topk_prob=model_type == "mixtral" or bool(cfg.get("norm_topk_prob", False)),
                   shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size") or 0,
                   moe_layers=[i not in dense and (i + 1) % step == 0 for i in range(n)])
    return out


def _common(cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
    heads = cfg["num_attention_heads"]
    eos = cfg.get("eos_token_id")
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    return dict(
        model_type=model_type,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta") or 10000.0,
        rope_scaling=_rope_scaling(cfg),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


def _gemma3(cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma3TextConfig semantics, its defaults included (a GGUF carries only some of these keys)."""
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if not types:
        pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]
    rope = cfg.get("rope_parameters") or {}
    local = (rope.get("sliding_attention") or {}).get("rope_theta") or cfg.get("rope_local_base_freq") or 10000.0
    glob = (rope.get("full_attention") or {}).get("rope_theta") or cfg.get("rope_theta") or 1_000_000.0
    common = _common({**cfg, "rope_theta": glob, "head_dim": cfg.get("head_dim") or 256,
                      "rms_norm_eps": cfg.get("rms_norm_eps") or 1e-6,
                      "max_position_embeddings": cfg.get("max_position_embeddings") or 131072,
                      "tie_word_embeddings": cfg.get("tie_word_embeddings", True)}, "gemma3_text")
    # the global layers' scaling (Gemma 3 4B-27B: linear, factor 8), flat or under "full_attention"
    scaling = common.pop("rope_scaling") or _rope_scaling({"rope_parameters": rope.get("full_attention") or {}})
    if scaling is not None and scaling["rope_type"] != "linear":
        raise ValueError(f"Gemma 3 with {scaling['rope_type']} rope scaling is not supported.")
    return dict(**common, rope_scaling=scaling,
                hidden_act=cfg.get("hidden_activation") or "gelu_pytorch_tanh",
                layer_types=list(types), sliding_window=cfg.get("sliding_window") or 4096,
                rope_local_base_freq=float(local),
                query_pre_attn_scalar=cfg.get("query_pre_attn_scalar") or 256,
                attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
                final_logit_softcapping=cfg.get("final_logit_softcapping"),
                embedding_scale=cfg["hidden_size"] ** 0.5)


def _rope_scaling(cfg: dict[str, Any]) -> dict[str, Any] | None:
    """The RoPE scaling of an HF config (`rope_scaling`, or transformers 5's flat `rope_parameters`) as one dict
    with `rope_type` and, for the types that need it, `original_max_position_embeddings` (for dynamic NTK: the
    length beyond which it scales, max_position_embeddings) and `factor`; None for plain RoPE."""
    rope = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling")
    if scaling is None and ("rope_type" in rope or "type" in rope):
        scaling = rope
    if not scaling:
        return None
    s = {k: v for k, v in scaling.items() if k not in ("rope_theta", "type", "partial_rotary_factor")}
    kind = scaling.get("rope_type") or scaling.get("type")
    kind = "longrope" if kind == "su" else kind  # older Phi-3 configs
    if kind in (None, "default"):
        return None
    max_pos = cfg.get("max_position_embeddings") or 2048
    s["rope_type"] = kind
    if kind in ("llama3", "yarn", "longrope"):  # Phi-3 states the pretraining length at the top level
        s["original_max_position_embeddings"] = (cfg.get("original_max_position_embeddings")
                                                 or s.get("original_max_position_embeddings") or max_pos)
    elif kind == "dynamic":
        s["original_max_position_embeddings"] = max_pos
    if kind in ("yarn", "longrope") and s.get("factor") is None:
        s["factor"] = max_pos / s["original_max_position_embeddings"]
    return s
