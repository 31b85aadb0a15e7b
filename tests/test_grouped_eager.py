"""Eager attention of a slab decode step in the KV heads as they are (issue 49).

Methods that read the eager kernel's weights (``Needs.eager``: H2O, the authors' ports) ran
transformers' kernel, which repeats K and V per query head: 5x the kept slots' bytes read at 32 / 8
heads. The slab backend's ``grouped_eager`` (its default on CUDA) folds each KV head's query heads
into its query length instead (``slab_attention.attend_eager``). Its matmuls have other shapes than
``hf``'s, so its bits differ (~1e-16 in float64): the oracle is the ``hf`` backend in float64, with the
same tokens, kept positions and counts, alone and batched, on the eager and the captured body's path.
"""

from __future__ import annotations

import pytest
import torch

from kvleague.engine import slab_attention
from kvleague.engine.protocol import GenerationSettings, Protocol
from kvleague.methods import build_method
from tests.float64_pair import float64_pair

BUDGET = 16
PROTOCOL = Protocol(sink=2, recent=3)


@pytest.fixture(scope="module")
def pair(tiny_models):
    """``hf`` and the slab backend with grouped eager attention, both float64 and eager."""
    torch.set_num_threads(1)
    hf, slab = float64_pair(tiny_models["qwen3"], attn_implementation="eager")
    slab.backend.grouped_eager = True
    return hf, slab


def _same(oracle, result) -> None:
    assert result.token_ids == oracle.token_ids
    assert result.kept_positions == oracle.kept_positions
    for name in ("evictions", "evicted_tokens", "ranked_evictions"):
        assert getattr(result, name) == getattr(oracle, name), name


@pytest.mark.parametrize("graphs", [False, True], ids=["eager_step", "captured_body"])
@pytest.mark.parametrize("name", ["h2o", "h2o_authors", "rkv_authors", "thinkv_authors"])
def test_grouped_eager_attention_keeps_what_hf_keeps(pair, prompt_ids, monkeypatch, name, graphs):
    hf, slab = pair
    calls = []
    real = slab_attention.attend_eager
    monkeypatch.setattr(slab_attention, "attend_eager", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(slab.backend, "graphs", graphs)
    settings = GenerationSettings(max_new_tokens=16)
    prompts = [prompt_ids[:6], prompt_ids[3:12], prompt_ids[5:24]]
    oracle = [hf.generate(p, build_method(name), BUDGET, PROTOCOL, settings) for p in prompts]
    for p, want in zip(prompts, oracle):
        _same(want, slab.generate(p, build_method(name), BUDGET, PROTOCOL, settings))
    for want, got in zip(
        oracle, slab.generate_batch(prompts, [build_method(name) for _ in prompts], BUDGET, PROTOCOL, settings)
    ):
        _same(want, got)
    assert calls and sum(r.ranked_evictions for r in oracle) > 0


def test_grouped_eager_attention_equals_transformers_kernel():
    """The kernel alone against transformers' eager attention: the same output and weights to
    float64 rounding, each query head j reading KV head j // group, over a length and under a mask."""
    from transformers.models.llama.modeling_llama import eager_attention_forward

    torch.manual_seed(0)
    n, h_q, h_kv, d, capacity = 3, 8, 2, 16, 12
    query = torch.randn(n, h_q, 1, d, dtype=torch.float64)
    key, value = (torch.randn(n, h_kv, capacity, d, dtype=torch.float64) for _ in range(2))
    valid = torch.tensor([12, 7, 3])
    mask = torch.zeros(n, 1, 1, capacity, dtype=torch.float64)
    mask.masked_fill_(
        torch.arange(capacity)[None, None, None] >= valid[:, None, None, None], torch.finfo(mask.dtype).min
    )
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = h_q // h_kv, False
    want_out, want_weights = eager_attention_forward(module, query, key, value, mask, scaling=0.25)
    out, weights = slab_attention.attend_eager(query, key, value, mask, 0.25, slab_attention.Lengths(valid, None, True))
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-14)
    torch.testing.assert_close(weights, want_weights, rtol=0, atol=1e-14)
    # one length for the batch: the slots past it are not read, and their weights not returned
    want_out, want_weights = eager_attention_forward(module, query, key[:, :, :7], value[:, :, :7], None, scaling=0.25)
    out, weights = slab_attention.attend_eager(query, key, value, None, 0.25, slab_attention.Lengths(None, 7, True))
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-14)
    torch.testing.assert_close(weights, want_weights, rtol=0, atol=1e-14)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["h2o", "rkv_authors"])
def test_grouped_eager_attention_on_cuda_keeps_what_hf_keeps(tiny_models, prompt_ids, monkeypatch, name):
    """On CUDA (``scripts/gpu_check.sh``), where it is the slab backend's default: float64, its captured
    steps against ``hf``'s eager kernel on the same GPU, alone and batched."""
    hf, slab = float64_pair(tiny_models["qwen3"], attn_implementation="eager", device="cuda")
    assert slab.backend.grouped_eager and slab.backend.graphs
    test_grouped_eager_attention_keeps_what_hf_keeps((hf, slab), prompt_ids, monkeypatch, name, True)
