"""Batched generation on a GPU under SDPA and FlashAttention-2 (skipped on CPU machines; run them on
a GPU with `pytest -m cuda`). FlashAttention-2 takes the batch's 2D padding mask and unpads by it."""

import importlib.util

import pytest
import torch

from kvleague.engine.protocol import GenerationSettings, Protocol
from kvleague.methods import build_method
from kvleague.runner.models import load_engine
from tests.rounding_ties import LoggedKnorm, assert_parted_only_at_a_rounding_tie

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
KERNELS = [("sdpa", "float32")] + (
    [("flash_attention_2", "bfloat16")] if importlib.util.find_spec("flash_attn") else []
)


@pytest.mark.parametrize("attn,dtype", KERNELS)
@pytest.mark.parametrize("name", ["full", "knorm", "epikv", "tova"])
def test_a_ragged_batch_equals_each_sequence_alone_on_cuda(tiny_models, prompt_ids, attn, dtype, name):
    engine = load_engine(str(tiny_models["qwen3"]), attn_implementation=attn, dtype=dtype, device="cuda")
    engine.eos_ids = set()
    prompts = [prompt_ids[i : i + n] for i, n in enumerate((20, 33, 47, 61))]
    protocol, settings = Protocol(sink=2, recent=4), GenerationSettings(max_new_tokens=24)
    make = LoggedKnorm if name == "knorm" else lambda: build_method(name)
    alone_methods, batched_methods = [make() for _ in prompts], [make() for _ in prompts]
    alone = [engine.generate(p, m, 40, protocol, settings) for p, m in zip(prompts, alone_methods)]
    batched = engine.generate_batch(prompts, batched_methods, 40, protocol, settings)
    same = sum(a.token_ids == b.token_ids and a.kept_positions == b.kept_positions for a, b in zip(alone, batched))
    if name == "knorm":  # the documented exception: a sequence may part from itself alone only at a rounding-level tie
        for a, b, ma, mb in zip(alone, batched, alone_methods, batched_methods):
            if (a.token_ids, a.kept_positions) != (b.token_ids, b.kept_positions):
                assert assert_parted_only_at_a_rounding_tie(ma, mb, a.kept_positions, b.kept_positions)
        return
    # float32 SDPA: every sequence; bfloat16 FlashAttention-2 rounds differently padded and unpadded
    assert same == len(prompts) if dtype == "float32" else same >= len(prompts) - 1
    assert all(r.attn_implementation == attn for r in batched)
