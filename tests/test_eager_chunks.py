"""Eager attention under the worker's memory budget (issue 45: h2o's prefill took a worker to 7.3 GB):
computed over query chunks it gives transformers' eager kernel's output and weights (to float rounding),
and its largest attention buffer follows the budget, not the prompt; H2O generates the same under a
budget too small for a prefill's rows as with room for them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.models.llama.modeling_llama import eager_attention_forward

from kvleague.engine import eager


class LargestAllocation(TorchDispatchMode):
    """The largest attention-shaped tensor (last dimension: the ``keys`` keys) any op allocated, in its
    storage's bytes (views allocate nothing)."""

    def __init__(self, keys: int):
        super().__init__()
        self.keys, self.largest = keys, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            a.untyped_storage().data_ptr()
            for a in [*args, *(kwargs or {}).values()]
            if isinstance(a, torch.Tensor) and a.device.type != "meta"
        }
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if (
                isinstance(t, torch.Tensor)
                and t.dim()
                and t.shape[-1] == self.keys
                and t.untyped_storage().data_ptr() not in inputs
            ):
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def _inputs(c: int = 96, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    b, h_q, h_kv, d = 2, 4, 2, 16
    q = torch.randn(b, h_q, c, d, generator=g, dtype=dtype)
    k = torch.randn(b, h_kv, c, d, generator=g, dtype=dtype)
    v = torch.randn(b, h_kv, c, d, generator=g, dtype=dtype)
    mask = torch.full((c, c), float("-inf"), dtype=dtype).triu(1)[None, None].expand(b, 1, c, c)
    module = SimpleNamespace(num_key_value_groups=h_q // h_kv, training=False)
    return module, q, k, v, mask


def test_chunked_eager_equals_transformers_eager_and_its_buffers_follow_the_budget():
    module, q, k, v, mask = _inputs()
    with LargestAllocation(96) as whole:
        ref_out, ref_w = eager_attention_forward(module, q, k, v, mask, scaling=0.25)
    full_rows = ref_w.nbytes  # one layer's [B, H_q, C, T] weights
    budget = full_rows // 8
    size = eager.chunk_queries(2, 4, 96, torch.float32, budget)
    assert 1 < size < 96  # several chunks
    with LargestAllocation(96) as chunked:
        out, w = eager.eager_attention(module, q, k, v, mask, scaling=0.25, rows="all", budget=budget)
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w, ref_w, rtol=1e-6, atol=1e-7)
    with LargestAllocation(96) as summing:
        out_s, sums = eager.eager_attention(module, q, k, v, mask, scaling=0.25, rows="sum", budget=budget)
    torch.testing.assert_close(out_s, ref_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sums, ref_w.sum(dim=-2, keepdim=True), rtol=1e-5, atol=1e-6)
    assert sums.shape == (2, 4, 1, 96)
    # transformers' kernel allocates full-size rows; chunked, only the returned weights are full size
    # and every temporary fits the budget; summing, nothing is full size
    assert whole.largest >= full_rows
    assert chunked.largest == full_rows
    assert summing.largest <= budget
    # a pass that fits runs transformers' kernel itself: the same bits
    out_f, w_f = eager.eager_attention(module, q, k, v, mask, scaling=0.25, rows="all", budget=10 * full_rows)
    assert torch.equal(out_f, ref_out) and torch.equal(w_f, ref_w)


def test_h2o_generates_the_same_with_a_budget_too_small_for_its_prefill_rows(engines, prompt_ids, monkeypatch):
    """A worker planned for very little memory: each layer's eager attention in chunks and the prefill's
    rows kept as sums (the largest attention buffer the probe's kernel allocates is bounded), the same
    accumulated attention (to rounding) and the same tokens as with room for every row."""
    from kvleague.engine import probe
    from kvleague.engine.generation import GenerationSettings
    from kvleague.methods.registry import build_method

    engine = engines["llama"]
    settings = GenerationSettings(max_new_tokens=8)

    def run():
        method = build_method("h2o")
        result = engine.generate(prompt_ids, method, budget=24, settings=settings)
        return result.token_ids, method.acc.clone()

    tokens, acc = run()
    largest = {"rows": None}
    real = eager.eager_attention

    def spied(*args, **kwargs):
        with LargestAllocation(args[2].shape[-2]) as seen:
            out = real(*args, **kwargs)
        largest["rows"] = max(largest["rows"] or 0, seen.largest) if kwargs.get("rows") == "sum" else largest["rows"]
        return out

    monkeypatch.setattr(eager, "_budget", 4096)
    monkeypatch.setattr(probe, "budget_bytes", lambda: 4096)
    monkeypatch.setattr(probe, "eager_attention", spied)
    small_tokens, small_acc = run()
    assert largest["rows"] is not None and largest["rows"] <= 4096  # the prefill went through the sums
    assert small_tokens == tokens
    torch.testing.assert_close(small_acc, acc, rtol=1e-5, atol=1e-6)


def test_worker_memory_is_declared_in_the_sweep_config_and_checked():
    from kvleague.engine.errors import KvleagueError
    from kvleague.runner.sweep_config import ResourcesConfig, parse_config

    assert ResourcesConfig().worker_memory_gb == eager.DEFAULT_WORKER_MEMORY_GB
    assert "worker_memory_gb" not in ResourcesConfig().model_dump()  # the default leaves old config hashes alone
    base = {"name": "m", "models": ["org/m"], "methods": ["h2o"], "budgets": [64], "tasks": ["kv_agent"]}
    assert parse_config({**base, "resources": {"worker_memory_gb": 2}}).resources.worker_memory_gb == 2
    with pytest.raises(KvleagueError, match="worker_memory_gb"):
        parse_config({**base, "resources": {"worker_memory_gb": 0}})
