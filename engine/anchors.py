"""The Hugging Face references the engine is measured against, run on the HF backend's own model:
``model.generate`` under the model's own attention kernel, and kvpress's scorers applied the way
kvpress's ``DecodingPress`` applies them. They live in the engine because they run the model and
read its cache directly, which nothing above the engine does; the benchmarks and tests call them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def plain_attention(engine) -> Iterator:
    """The engine's model under its plain attention kernel (not kvleague's probing wrapper), for
    ``model.generate`` and kvpress; the wrapper is put back on exit."""
    model = engine.backend.model
    saved = model.config._attn_implementation
    model.set_attn_implementation(engine.attn_implementation)
    try:
        yield model
    finally:
        model.set_attn_implementation(saved)


def compiled_by_generate(engine) -> bool:
    """Whether ``model.generate`` has compiled the engine's model (transformers does it for a static
    cache on CUDA, ``torch.compile`` of the forward, kept on the model)."""
    return hasattr(engine.backend.model, "_compiled_call")


def kvpress_reference_tokens(engine, decoding, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy tokens of kvpress's scorer (``decoding``: a ``DecodingPress`` with its target size)
    applied after every decode step (true positions, as ``model.generate``), the kept entries in
    position order, equal scores to the more recent position."""
    from transformers import DynamicCache

    press, budget = decoding.base_press, decoding.target_size
    model, layers, n_kv = engine.backend.model, engine.backend.layers, engine.n_kv_heads
    cache = DynamicCache(config=model.config)
    positions = [torch.arange(len(prompt))[None].expand(n_kv, -1) for _ in layers]
    tokens = []
    with torch.inference_mode():
        out = model(torch.tensor([prompt], device=engine.device), past_key_values=cache, use_cache=True)
        for step in range(new_tokens):
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
            first = cache.layers[0].keys
            assert first is not None  # the forward pass above filled every layer
            length = first.shape[2]
            position = len(prompt) + step
            out = model(
                torch.tensor([[token]], device=engine.device),
                position_ids=torch.tensor([[position]], device=engine.device),
                cache_position=torch.tensor([length], device=engine.device),
                past_key_values=cache,
                use_cache=True,
            )
            for i, layer in enumerate(cache.layers):
                keys, values = layer.keys, layer.values
                assert keys is not None and values is not None  # the forward pass above filled every layer
                pos = torch.cat([positions[i], torch.full((n_kv, 1), position)], dim=1)
                k_len = keys.shape[2]
                if k_len > budget:
                    press.compression_ratio = decoding._find_target_compression_ratio(k_len, budget)
                    scores = press.score(layers[i].self_attn, None, keys, values, None, {})[0].cpu()
                    n_kept = int(k_len * (1 - press.compression_ratio))
                    by_recency = torch.argsort(pos, dim=-1, descending=True, stable=True)
                    ranked = by_recency.gather(
                        1, torch.argsort(scores.gather(1, by_recency), dim=-1, descending=True, stable=True)
                    )
                    keep = ranked[:, :n_kept].sort(dim=-1).values  # position order (slots are in position order)
                    index = keep.to(keys.device)[None, :, :, None].expand(1, -1, -1, keys.shape[-1])
                    layer.keys, layer.values = keys.gather(2, index), values.gather(2, index)
                    pos = pos.gather(1, keep)
                positions[i] = pos
    return tokens
