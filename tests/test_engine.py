"""The budgeted generation engine against independent oracles."""

from dataclasses import dataclass

import pytest
import torch
from transformers import DynamicCache

from kvleague.engine.contract import CacheView, Observation
from kvleague.engine.errors import KvleagueError
from kvleague.engine.protocol import GenerationSettings, Protocol
from kvleague.methods import EvictionMethod, Needs, build_method
from kvleague.runner.models import load_engine
from tests.conftest import ARCHS
from tests.naive_attention import decode_logits

# -- test-only methods (not registered: they exist to exercise the engine) --------------------------


@dataclass
class PerLayerRandom(EvictionMethod):
    """Random scores with shape [L, T]: every layer keeps its own set."""

    def reset(self, info):
        super().reset(info)
        self.gen = torch.Generator().manual_seed(7)

    def score(self, cache: CacheView) -> torch.Tensor:
        return torch.rand(len(cache.keys), cache.length, generator=self.gen)


@dataclass
class Recorder(EvictionMethod):
    """Random per-token scores; records what the engine shows it at every observation."""

    needs = Needs(attention=True, attention_window=4, hidden_states=True, queries=True, new_keys_values=True)

    def reset(self, info):
        super().reset(info)
        self.gen = torch.Generator().manual_seed(3)
        self.observations: list[Observation] = []

    def hidden_layers(self, n_layers):
        return [1]

    def observe(self, obs: Observation) -> None:
        self.observations.append(obs)

    def score(self, cache: CacheView) -> torch.Tensor:
        return torch.rand(cache.length, generator=self.gen)


def greedy(n: int, **kw) -> GenerationSettings:
    return GenerationSettings(max_new_tokens=n, **kw)


# -- no eviction: identical to model.generate ---------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_full_cache_greedy_equals_model_generate(engines, prompt_ids, arch):
    engine = engines[arch]
    result = engine.generate(prompt_ids, build_method("full"), budget=4096, settings=greedy(48))
    reference = engine.model.generate(
        torch.tensor([prompt_ids]), max_new_tokens=48, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, len(prompt_ids) :].tolist()
    assert result.token_ids == reference
    assert result.evictions == 0 and result.peak_cache_entries == len(prompt_ids) + 47


@pytest.mark.parametrize("arch", ARCHS)
def test_sampling_is_deterministic_for_a_seed(engines, prompt_ids, arch):
    engine = engines[arch]
    settings = greedy(40, temperature=1.0, top_p=0.9)
    runs = [
        engine.generate(prompt_ids, build_method("knorm"), 64, Protocol(sink=4), settings, seed=s).token_ids
        for s in (11, 11, 12)
    ]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


# -- the position/eviction oracle ---------------------------------------------------------------


def _snapshot(session):
    layers = session.cache.cache.layers
    return (
        [l.keys[0].clone() for l in layers],
        [l.values[0].clone() for l in layers],
        [p.clone() for p in session.cache.positions],
    )


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    "method,granularity",
    [(lambda: build_method("random"), "token"), (PerLayerRandom, "layer"), (lambda: build_method("knorm"), "head")],
)
@pytest.mark.parametrize("positions", ["absolute", "compact"])
def test_logits_after_eviction_equal_naive_recomputation(engines, prompt_ids, arch, method, granularity, positions):
    engine = engines[arch]
    budget = 40
    with engine.session(method(), budget, Protocol(sink=2, recent=4, positions=positions)) as session:
        session.feed(prompt_ids)
        session.decode(greedy(25))  # evicts after prefill and at every decode step
        keys, values, kept = _snapshot(session)
        last = session.pending[0]
        rope_position = session.next_position if positions == "absolute" else session.cache.length
        session.decode(greedy(1))  # feeds `last`, whose logits we compare
        engine_logits = session.logits

    distinct = {tuple(p.flatten().tolist()) for layer in kept for p in layer}
    if granularity == "token":
        assert len({tuple(p.flatten().tolist()) for p in kept}) == 1
    else:  # the cache really differs across layers (and heads)
        assert len(distinct) > 1
    assert all(p.shape[-1] == budget for p in kept)
    with torch.no_grad():
        expected = decode_logits(engine.model, keys, values, last, rope_position)
    torch.testing.assert_close(engine_logits, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_kept_entries_are_the_full_prefill_entries_at_kept_positions(engines, prompt_ids, arch):
    """Prefill compression must gather the right K/V rows for every layer and KV head."""
    engine = engines[arch]
    full = DynamicCache(config=engine.model.config)
    with torch.no_grad():
        engine.model(torch.tensor([prompt_ids]), past_key_values=full, use_cache=True)
    with engine.session(build_method("knorm"), 50, Protocol()) as session:
        session.feed(prompt_ids)
        keys, values, kept = _snapshot(session)
    for layer in range(engine.n_layers):
        index = kept[layer][:, :, None].expand(-1, -1, engine.head_dim)
        torch.testing.assert_close(keys[layer], full.layers[layer].keys[0].gather(1, index))
        torch.testing.assert_close(values[layer], full.layers[layer].values[0].gather(1, index))


# -- budget accounting and protection -----------------------------------------------------------


@pytest.mark.parametrize(
    "protocol,bound",
    [
        (Protocol(), lambda b, c: b),
        (Protocol(cadence="buffer=8"), lambda b, c: b + 8),
        (Protocol(prefill_chunk=16), lambda b, c: b),
    ],
)
def test_cache_never_exceeds_budget(engines, prompt_ids, protocol, bound):
    engine = engines["qwen2"]
    budget, chunk = 48, protocol.prefill_chunk or len(prompt_ids)
    method = Recorder()
    with engine.session(method, budget, protocol) as session:
        session.feed(prompt_ids)
        session.decode(greedy(60))
        final = session.cache.length
    lengths = [(o.phase, o.cache_positions[0].shape[1]) for o in method.observations]
    # each observation sees the cache right after a forward pass appended its tokens, before eviction,
    # so the cache before that pass held (length - new tokens) entries
    for (phase, length), obs in zip(lengths, method.observations):
        held_before = length - obs.new_positions.shape[0]
        assert held_before <= bound(budget, chunk)
        if phase == "prefill":
            assert length <= budget + chunk
    assert final <= bound(budget, chunk)
    if protocol.buffer:  # the buffer is used: the cache does grow past the budget between evictions
        assert max(l for _, l in lengths[1:]) == budget + protocol.buffer + 1


def test_protected_tokens_are_never_evicted(engines, prompt_ids):
    engine = engines["llama"]
    method = Recorder()
    protocol = Protocol(sink=3, recent=6)
    with engine.session(method, 40, protocol) as session:
        session.feed(prompt_ids[:30])
        session.decode(greedy(50))
    for obs in method.observations:
        held = set(obs.cache_positions[0][0].tolist())
        newest = int(obs.new_positions[-1])
        # sinks, and the recent window as it stood before this pass, must all still be held
        assert set(range(3)) <= held
        assert set(range(max(0, newest - obs.new_positions.shape[0] - 5), newest + 1)) <= held


def test_protect_prompt_keeps_every_prompt_token(engines, prompt_ids):
    engine = engines["qwen3"]
    prompt = prompt_ids[:20]
    with engine.session(build_method("random"), 32, Protocol(protect_prompt=True)) as session:
        session.feed(prompt)
        session.decode(greedy(60))
        kept = sorted(session.cache.positions[0][0].tolist())
        is_prompt = session.cache.is_prompt[0][0]
    assert set(range(20)) <= set(kept)
    assert int(is_prompt.sum()) == 20 and len(kept) == 32


def test_protect_prompt_longer_than_budget_is_a_clear_error(engines, prompt_ids):
    with pytest.raises(KvleagueError, match="protected tokens"):
        engines["llama"].generate(prompt_ids, build_method("random"), 32, Protocol(protect_prompt=True), greedy(4))


def test_streaming_llm_keeps_exactly_sinks_and_most_recent(engines, prompt_ids):
    result = engines["llama"].generate(
        prompt_ids, build_method("streaming_llm", {"n_sink": 4}), 32, Protocol(), greedy(30)
    )
    newest = len(prompt_ids) + 30 - 2  # the last sampled token is not fed
    assert result.kept_positions[0] == list(range(4)) + list(range(newest - 27, newest + 1))
    assert all(layer == result.kept_positions[0] for layer in result.kept_positions)


# -- agreement with kvpress on prefill compression -------------------------------------------------


def _kvpress_kept(engine, prompt_ids, press, budget):
    """kvpress's kept indices: its score(), top-`budget` per KV head, as ScorerPress.compress does,
    with kvleague's stated tie-break (equal scores: the more recent position; see test_methods_kvpress)."""
    from tests.test_methods_kvpress import ranked_top

    cache = DynamicCache(config=engine.model.config)
    with torch.no_grad():
        engine.model(torch.tensor([prompt_ids]), past_key_values=cache, use_cache=True)
    kept = []
    for i, layer in enumerate(cache.layers):
        module = engine.layers[i].self_attn
        scores = press.score(module, None, layer.keys, layer.values, None, {})
        kept.append(ranked_top(scores[0], torch.arange(scores.shape[-1]).expand(scores.shape[1:]), budget))
    return kept


@pytest.mark.parametrize("arch", ARCHS)
def test_knorm_and_streaming_llm_match_kvpress_on_prefill(engines, prompt_ids, arch):
    from kvpress import KnormPress, StreamingLLMPress

    engine, budget = engines[arch], 64
    n = len(prompt_ids)
    for ours, press in [
        (build_method("knorm"), KnormPress(compression_ratio=1 - budget / n)),
        (build_method("streaming_llm", {"n_sink": 4}), StreamingLLMPress(compression_ratio=1 - budget / n, n_sink=4)),
    ]:
        with engine.session(ours, budget, Protocol()) as session:
            session.feed(prompt_ids)
            kept = [p.sort(dim=-1).values for p in session.cache.positions]
        expected = _kvpress_kept(engine, prompt_ids, press, budget)
        for layer in range(engine.n_layers):
            assert torch.equal(kept[layer], expected[layer]), (type(press).__name__, layer)


# -- observations -------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ARCHS)
def test_attention_rows_under_sdpa_equal_eager_attention(engines, tiny_models, prompt_ids, arch, kernel):
    """A method that does not declare ``Needs.eager`` gets the newest ``attention_window`` rows under
    every kernel: recomputed from q and K under SDPA, cut from the kernel's own weights under eager."""
    from transformers import AutoModelForCausalLM

    engine = engines[arch] if kernel == "sdpa" else load_engine(str(tiny_models[arch]), attn_implementation="eager")
    assert engine.attn_implementation == kernel
    method = Recorder()
    with engine.session(method, 4096, Protocol()) as session:
        session.feed(prompt_ids)
        session.decode(greedy(3))
    prefill, decode = method.observations[0], method.observations[-1]
    eager = AutoModelForCausalLM.from_pretrained(tiny_models[arch], attn_implementation="eager")
    with torch.no_grad():
        all_ids = torch.tensor([prompt_ids + [int(t) for o in method.observations[1:] for t in o.new_token_ids]])
        out = eager(all_ids, output_attentions=True, output_hidden_states=True)
    n = len(prompt_ids)
    for layer in range(engine.n_layers):
        torch.testing.assert_close(
            prefill.attention[layer], out.attentions[layer][0, :, n - 4 : n, :n], rtol=1e-4, atol=1e-5
        )
        total = all_ids.shape[1]
        torch.testing.assert_close(
            decode.attention[layer], out.attentions[layer][0, :, total - 1 :, :], rtol=1e-4, atol=1e-5
        )
    # hidden states: only the declared layer, equal to HF's hidden_states[l + 1]
    assert set(prefill.hidden_states) == {1}
    torch.testing.assert_close(prefill.hidden_states[1], out.hidden_states[2][0, :n], rtol=1e-4, atol=1e-5)
    assert prefill.queries[0].shape == (engine.n_heads, n, engine.head_dim)
    assert prefill.new_keys[0].shape == (engine.n_kv_heads, n, engine.head_dim)


def test_undeclared_observations_are_not_collected(engines, prompt_ids):
    @dataclass
    class Blind(EvictionMethod):
        def reset(self, info):
            super().reset(info)
            self.seen = []

        def observe(self, obs):
            self.seen.append(obs)

        def score(self, cache):
            return torch.zeros(cache.length)

    method = Blind()
    engines["llama"].generate(prompt_ids, method, 32, Protocol(), greedy(3))
    obs = method.seen[0]
    assert obs.attention is obs.queries is obs.hidden_states is obs.new_keys is None


def test_method_needing_eager_runs_eager_and_says_so(engines, prompt_ids):
    @dataclass
    class NeedsEager(Recorder):
        needs = Needs(attention=True, eager=True)

    engine = engines["qwen2"]
    method = NeedsEager()
    result = engine.generate(prompt_ids, method, 48, Protocol(), greedy(4))
    assert result.attn_implementation == "eager"
    n = len(prompt_ids)
    # eager rows cover every prefill query, and each row is a causal distribution
    rows = method.observations[0].attention[0]
    assert rows.shape == (engine.n_heads, n, n)
    torch.testing.assert_close(rows.sum(-1), torch.ones(engine.n_heads, n))
    assert torch.all(rows.triu(1) == 0)
    assert engine.model.config._attn_implementation == "kvleague_sdpa"  # restored afterwards


# -- instrumentation and multi-turn ---------------------------------------------------------------


def test_instrumentation_is_consistent(engines, prompt_ids):
    engine = engines["llama"]
    result = engine.generate(prompt_ids, build_method("knorm"), 40, Protocol(), greedy(20))
    per_entry = 2 * engine.n_layers * engine.n_kv_heads * engine.head_dim * 4  # K and V, float32
    assert result.prompt_tokens == len(prompt_ids) and result.generated_tokens == 20
    assert result.peak_cache_entries == len(prompt_ids)
    assert result.peak_kv_bytes == len(prompt_ids) * per_entry
    assert result.evictions == 20  # once after prefill, then at each of the 19 fed decode tokens
    assert result.evicted_tokens == len(prompt_ids) - 40 + 19
    assert 0 < result.decode_seconds_p50 <= result.decode_seconds_p95
    assert result.method_seconds > 0 and result.peak_memory_bytes > 0
    assert all(len(heads) == engine.n_kv_heads and len(heads[0]) == 40 for heads in result.kept_positions)


def test_decode_steps_read_the_synchronizing_clock_only_at_their_boundaries(engines, prompt_ids, monkeypatch):
    """On CUDA the engine's clock waits for the device; inside a step (observe, score, selection) the
    engine takes marks instead (CUDA events there), so a batch of 4 evicting every step reads the
    clock about once per step, not once per sequence and phase."""
    from kvleague.engine.generation import Engine

    engine = engines["llama"]
    reads = []
    monkeypatch.setattr(engine, "clock", lambda: reads.append(1) or float(len(reads)))
    monkeypatch.setattr(Engine, "mark", lambda self: 0.0)
    prompts = [prompt_ids[i : i + 20] for i in range(4)]
    engine.generate_batch(
        prompts,
        [build_method("h2o") for _ in prompts],
        12,
        Protocol(sink=1, recent=2),
        GenerationSettings(max_new_tokens=10),
    )
    assert len(reads) <= 2 * 10 + 4 * 3, len(reads)  # two per step, plus each sequence's prefill and finish


def test_spans_sum_marks_and_read_events_only_when_read():
    """``Spans`` against a naive sum: numbers add at once; event pairs wait until the sum is read (or
    until enough have completed), and then add their elapsed milliseconds as seconds."""
    from kvleague.engine.resources import Spans

    class Event:  # a CUDA event's interface: elapsed_time in ms, query, synchronize
        def __init__(self, t: float, done: bool = True):
            self.t, self.done, self.waited = t, done, False

        def elapsed_time(self, end) -> float:
            return 1000.0 * (end.t - self.t)

        def query(self) -> bool:
            return self.done

        def synchronize(self) -> None:
            self.waited = True

    spans = Spans()
    spans.add(1.0, 1.5)
    spans.add(2.0, 3.0, 0.25)
    assert spans.seconds == pytest.approx(0.75)
    pending = Spans()
    pairs = [(Event(i), Event(i + 0.5, done=i % 2 == 0)) for i in range(Spans.FOLD_AT)]
    for start, end in pairs:
        pending.add(start, end, 0.5)
    assert len(pending._events) == Spans.FOLD_AT // 2 and not any(
        end.waited for _, end in pairs
    )  # completed ones folded
    assert pending.seconds == pytest.approx(Spans.FOLD_AT * 0.25) and pairs[-1][1].waited and not pending._events


def test_multi_turn_session_keeps_one_cache_and_true_positions(engines, prompt_ids):
    engine = engines["qwen3"]
    tok = engine.tokenizer
    turn2 = tok("Observation: 42", add_special_tokens=False)["input_ids"]
    with engine.session(build_method("full"), 4096) as session:
        session.feed(prompt_ids)
        first = session.decode(greedy(10))
        session.feed(turn2)
        second = session.decode(greedy(10))
    whole = prompt_ids + first.token_ids + turn2
    reference = engine.model.generate(
        torch.tensor([whole]), max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    assert second.token_ids == reference[0, len(whole) :].tolist()


def test_stop_strings_cut_the_completion(engines, prompt_ids):
    engine = engines["llama"]
    sampled = dict(temperature=1.0)  # seeded sampling: deterministic, and more varied than random-weight greedy text
    free = engine.generate(prompt_ids, build_method("full"), 4096, settings=greedy(60, **sampled), seed=5).completion
    starts = [k for k in range(3, len(free) - 2) if free[k : k + 2] not in free[: k + 1]]
    assert starts, f"no late-first substring in {free!r}"
    stop = free[starts[0] : starts[0] + 2]
    cut = engine.generate(prompt_ids, build_method("full"), 4096, settings=greedy(60, stop=(stop,), **sampled), seed=5)
    assert cut.stop_reason == "stop"
    assert cut.completion == free[: starts[0]]


def test_a_special_token_stop_string_ends_the_completion_before_it(engines, prompt_ids, monkeypatch):
    """A stop string that is a special token (an end of turn that is not the model's EOS, as chat
    formats add) is found in the decoded window and skipped in the completion: the completion is the
    text before it (this used to raise: the cut looked for it in the text without special tokens)."""
    engine = engines["llama"]
    tokenizer = engine.tokenizer
    special = next(
        t for t in tokenizer.all_special_tokens if tokenizer.convert_tokens_to_ids(t) < engine.backend.vocab_size
    )
    special_id = tokenizer.convert_tokens_to_ids(special)
    monkeypatch.setattr(engine, "eos_ids", set())
    others = tuple(i for i in range(engine.backend.vocab_size) if i != special_id)  # the model can only say it
    cut = engine.generate(prompt_ids, build_method("full"), 4096, settings=greedy(5, stop=(special,), suppress=others))
    assert (cut.token_ids, cut.stop_reason, cut.completion) == ([special_id], "stop", "")


def test_decode_streams_each_token_as_it_is_chosen(engines, prompt_ids):
    engine = engines["llama"]
    seen = []
    with engine.session(build_method("knorm"), 40, Protocol()) as session:
        session.feed(prompt_ids)
        out = session.decode(greedy(9), on_token=lambda token: seen.append((token, len(session.generated))))
    # every token, in order, before the decode call returned (generated is extended only at its end)
    assert [t for t, _ in seen] == out.token_ids and all(n == 0 for _, n in seen)


def test_load_engine_names_its_backend_and_refuses_an_unknown_one(tiny_models):
    engine = load_engine(str(tiny_models["llama"]), backend="hf")
    assert engine.describe()["backend"] == "hf" and engine.describe()["parameters"] == sum(
        p.numel() for p in engine.model.parameters()
    )
    with pytest.raises(KvleagueError, match=r"^backend: unknown 'vllm'; allowed: hf, slab$"):
        load_engine(str(tiny_models["llama"]), backend="vllm")
