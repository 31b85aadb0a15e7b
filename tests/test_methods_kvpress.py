"""Prefill kept indices equal kvpress's where kvpress has the same rule (SnapKV, TOVA, KeyDiff).

StreamingLLM and Knorm are compared in ``test_engine.py``. kvpress's SnapKV/TOVA compute the
window attention themselves from the attention module's ``q_proj`` and the hidden states that enter
the attention block, so those are captured with a forward pre-hook on a plain full-cache forward.
"""

import pytest
import torch
from transformers import DynamicCache

from methods import build_method
from runner.protocol import Protocol
from tests.conftest import ARCHS

BUDGET = 64


def _kvpress_kept(engine, prompt_ids, press, budget):
    """kvpress's kept indices per layer ``[H_kv, budget]``: its score(), then top-budget per KV head."""
    captured = {}

    def grab(layer):
        def hook(module, args, kwargs):
            captured[layer] = kwargs

        return hook

    handles = [l.self_attn.register_forward_pre_hook(grab(i), with_kwargs=True) for i, l in enumerate(engine.layers)]
    cache = DynamicCache(config=engine.model.config)
    try:
        with torch.no_grad():
            engine.model(torch.tensor([prompt_ids]), past_key_values=cache, use_cache=True)
    finally:
        for h in handles:
            h.remove()
    kept = []
    for i, layer in enumerate(cache.layers):
        module = engine.layers[i].self_attn
        kwargs = captured[i]
        with torch.no_grad():
            scores = press.score(module, kwargs["hidden_states"], layer.keys, layer.values, None, kwargs)
        kept.append(scores[0].topk(budget, dim=-1).indices.sort(dim=-1).values)
    return kept


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", ["snapkv", "tova", "keydiff"])
def test_prefill_kept_indices_equal_kvpress(engines, prompt_ids, arch, name):
    from kvpress import KeyDiffPress, SnapKVPress, TOVAPress

    engine = engines[arch]
    ratio = 1 - BUDGET / len(prompt_ids)
    press, protocol = {
        "snapkv": (SnapKVPress(compression_ratio=ratio, window_size=32, kernel_size=7), Protocol()),
        # kvpress always keeps the newest token; TOVA itself does not: protect it in the protocol
        "tova": (TOVAPress(compression_ratio=ratio), Protocol(recent=1)),
        "keydiff": (KeyDiffPress(compression_ratio=ratio), Protocol()),
    }[name]
    with engine.session(build_method(name), BUDGET, protocol) as session:
        session.feed(prompt_ids)
        kept = [p.sort(dim=-1).values for p in session.cache.positions]  # order-free methods: slot order is arbitrary
    expected = _kvpress_kept(engine, prompt_ids, press, BUDGET)
    for layer in range(engine.n_layers):
        assert torch.equal(kept[layer], expected[layer]), (name, layer)
