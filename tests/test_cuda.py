"""GPU-only checks (skipped on CPU machines; run them on a GPU with `pytest -m cuda`)."""

import importlib.util

import pytest
import torch

from kvleague.engine.protocol import GenerationSettings, Protocol
from kvleague.methods import available_methods, build_method
from kvleague.runner.models import load_engine
from tests.rounding_ties import LoggedKnorm, assert_parted_only_at_a_rounding_tie
from tests.test_engine import Recorder

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
IMPLEMENTATIONS = ["sdpa", "eager"] + (["flash_attention_2"] if importlib.util.find_spec("flash_attn") else [])


@pytest.mark.parametrize("attn", IMPLEMENTATIONS)
def test_full_cache_greedy_equals_generate_on_cuda(tiny_models, prompt_ids, attn):
    engine = load_engine(str(tiny_models["qwen3"]), attn_implementation=attn, dtype="bfloat16", device="cuda")
    result = engine.generate(prompt_ids, build_method("full"), 4096, settings=GenerationSettings(max_new_tokens=32))
    ref = engine.model.generate(
        torch.tensor([prompt_ids], device="cuda"), max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, len(prompt_ids) :].tolist()
    assert result.token_ids == ref
    assert result.peak_memory_source == "cuda_max_allocated" and result.peak_memory_bytes > 0


@pytest.mark.parametrize("attn", IMPLEMENTATIONS)
def test_attention_rows_match_eager_under_every_kernel(tiny_models, prompt_ids, attn):
    from transformers import AutoModelForCausalLM

    engine = load_engine(str(tiny_models["llama"]), attn_implementation=attn, dtype="bfloat16", device="cuda")
    method = Recorder()
    with engine.session(method, 4096, Protocol()) as session:
        session.feed(prompt_ids)
    eager = AutoModelForCausalLM.from_pretrained(
        tiny_models["llama"], attn_implementation="eager", dtype=torch.bfloat16
    ).cuda()
    with torch.no_grad():
        out = eager(torch.tensor([prompt_ids], device="cuda"), output_attentions=True)
    n = len(prompt_ids)
    for layer, rows in enumerate(method.observations[0].attention):
        torch.testing.assert_close(rows, out.attentions[layer][0, :, n - 4 :, :].float(), rtol=2e-2, atol=2e-3)


def test_eviction_frees_cuda_memory(tiny_models):
    engine = load_engine(str(tiny_models["llama"]), device="cuda", dtype="bfloat16")
    prompt = list(range(10, 250)) * 8
    full = engine.generate(prompt, build_method("full"), 1 << 20, settings=GenerationSettings(max_new_tokens=8))
    small = engine.generate(
        prompt, build_method("knorm"), 64, Protocol(prefill_chunk=64), GenerationSettings(max_new_tokens=8)
    )
    assert small.peak_kv_bytes * 10 < full.peak_kv_bytes


@pytest.fixture(scope="module")
def float32_engines(tiny_models):
    engines = {
        device: load_engine(str(tiny_models["qwen3"]), dtype="float32", device=device) for device in ("cpu", "cuda")
    }
    for engine in engines.values():
        engine.eos_ids = set()
    return engines


@pytest.mark.parametrize("name", sorted(available_methods()))
def test_every_method_keeps_and_generates_the_same_on_cuda_and_cpu(float32_engines, prompt_ids, name):
    """float32, B = 48, 32 new tokens: the same tokens and kept positions on both devices; knorm may
    part only at a rounding-level tie (tests/rounding_ties.py)."""
    methods = {device: LoggedKnorm() if name == "knorm" else build_method(name) for device in float32_engines}
    results = {
        device: engine.generate(prompt_ids, methods[device], 48, Protocol(), GenerationSettings(max_new_tokens=32))
        for device, engine in float32_engines.items()
    }
    cpu, cuda = results["cpu"], results["cuda"]
    if name == "knorm" and (cpu.token_ids, cpu.kept_positions) != (cuda.token_ids, cuda.kept_positions):
        assert assert_parted_only_at_a_rounding_tie(
            methods["cpu"], methods["cuda"], cpu.kept_positions, cuda.kept_positions
        )
        return
    assert cuda.token_ids == cpu.token_ids
    assert cuda.kept_positions == cpu.kept_positions


def test_to_device_copies_host_data_and_host_tensors_to_the_gpu():
    """``engine/to_device.py``'s pinned, non-blocking path (never run on the CPU): lists and host
    tensors arrive with their values once the stream has run; a tensor already there is not copied."""
    from kvleague.engine.to_device import to_device

    made = to_device([[1, 2], [3, 4]], "cuda")
    host = torch.tensor([0.25, -1.0]).pin_memory()
    scores = to_device(host, "cuda", torch.float64)
    host.fill_(7.0)  # written before the copy may have run: the copy took a snapshot
    torch.cuda.synchronize()
    assert made.device.type == "cuda" and made.tolist() == [[1, 2], [3, 4]]
    assert scores.dtype == torch.float64 and scores.tolist() == [0.25, -1.0]
    assert to_device(scores, scores.device) is scores
