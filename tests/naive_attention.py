"""An independent re-computation of one decode step, for the engine's position/eviction oracle.

It uses the model's weights (projections, norms, MLP) but none of transformers' attention, RoPE,
mask or cache code, and none of kvleague's: RoPE is written out from its definition and attention is
an explicit per-head softmax over exactly the keys/values it is given.
"""

import math

import torch


def _rope(x: torch.Tensor, position: int, theta: float) -> torch.Tensor:
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    angles = position * inv_freq
    cos = torch.cat([angles.cos(), angles.cos()]).to(x.dtype)
    sin = torch.cat([angles.sin(), angles.sin()]).to(x.dtype)
    rotated = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1)
    return x * cos + rotated * sin


def decode_logits(model, keys, values, token: int, position: int) -> torch.Tensor:
    """Logits for ``token`` at RoPE ``position``, attending to per-layer ``keys/values`` [H_kv, T, d]."""
    return decode_step(model, keys, values, token, position)[0]


def decode_step(model, keys, values, token: int, position: int):
    """``(logits, [k per layer], [v per layer])``: the step of :func:`decode_logits` and the token's own
    post-RoPE keys and values [H_kv, d] in every layer (what a cache would append)."""
    config = model.config
    theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta") or config.rope_theta
    inner = model.model
    new_k, new_v = [], []
    h = inner.embed_tokens(torch.tensor([token]))[0]
    for layer, k_cache, v_cache in zip(inner.layers, keys, values):
        attn = layer.self_attn
        d = attn.head_dim
        x = layer.input_layernorm(h)
        q = attn.q_proj(x).view(-1, d)
        k = attn.k_proj(x).view(-1, d)
        v = attn.v_proj(x).view(-1, d)
        if hasattr(attn, "q_norm"):  # Qwen3 normalises q and k per head before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = _rope(q, position, theta), _rope(k, position, theta)
        new_k.append(k)
        new_v.append(v)
        group = q.shape[0] // k.shape[0]
        outputs = []
        for head in range(q.shape[0]):
            kv = head // group
            all_k = torch.cat([k_cache[kv], k[kv][None]])
            all_v = torch.cat([v_cache[kv], v[kv][None]])
            weights = torch.softmax(all_k @ q[head] / math.sqrt(d), dim=0)
            outputs.append(weights @ all_v)
        h = h + attn.o_proj(torch.cat(outputs))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.lm_head(inner.norm(h)), new_k, new_v
