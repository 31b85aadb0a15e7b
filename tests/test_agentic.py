"""Agentic tasks: the tool-call format, the episode loop (what is fed to the cache, in which order),
BFCL multi-turn on BFCL's own simulators and checker, and the built-in kv_agent environment."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvleague.engine.protocol import GenerationSettings
from kvleague.runner.models.tiny import CHAT_TEMPLATE, byte_level_tokenizer
from kvleague.tasks.episode import ScriptedSession, Transcript
from kvleague.tasks.registry import build_task
from kvleague.tasks.tool_calls import ToolCall, format_tool_call, parse_tool_calls
from tests.conftest import DATA_DIR


@pytest.fixture(autouse=True)
def _data_dir(monkeypatch):
    monkeypatch.setenv("KVLEAGUE_DATA_DIR", str(DATA_DIR))


@pytest.fixture(scope="module")
def tok():
    return byte_level_tokenizer()


def replay(turn_steps: list[list[str]]):
    """A scripted agent that ignores its context and emits the given step texts in order."""
    steps = iter([s for turn in turn_steps for s in turn])
    return lambda context: next(steps)


# ---------------------------------------------------------------------------------------------
# Tool-call format
# ---------------------------------------------------------------------------------------------


def test_parse_tool_calls_blocks_errors_and_truncation():
    text = (
        "Let me look.\n"
        + format_tool_call("cd", {"folder": "document"})
        + '\nand\n<tool_call>\n{"name": "mv", "arguments": "{\\"source\\": \\"a\\"}"}\n</tool_call>'
        + "\n<tool_call>{not json}</tool_call>"
        + '\n<tool_call>{"arguments": {}}</tool_call>'
        + '\n<tool_call>\n{"name": "ls", "arguments": {"a": true}}'  # cut off: no closing tag
    )
    calls, errors = parse_tool_calls(text)
    assert [c.to_dict() for c in calls] == [
        {"name": "cd", "arguments": {"folder": "document"}},
        {"name": "mv", "arguments": {"source": "a"}},
        {"name": "ls", "arguments": {"a": True}},
    ]
    assert len(errors) == 2 and "not valid JSON" in errors[0] and "'name'" in errors[1]
    assert parse_tool_calls("no calls here") == ([], [])


def test_transcript_rejects_plain_text():
    from kvleague.engine.errors import KvleagueError

    with pytest.raises(KvleagueError, match="transcript"):
        Transcript.parse("just an answer")
    t = Transcript(turns=[["a", "b"], ["c"]], terminated=None)
    assert Transcript.parse(t.to_json()).turns == [["a", "b"], ["c"]]


# ---------------------------------------------------------------------------------------------
# Episode loop: each step's new tokens are fed exactly once, in order
# ---------------------------------------------------------------------------------------------


def _conversation(result, system: str) -> list[dict]:
    """The whole conversation, rebuilt from the episode record (independently of the loop's feeds)."""
    msgs = [{"role": "system", "content": system}]
    for turn in result.turns:
        msgs.extend(turn.user)
        for step in turn.steps:
            msgs.append({"role": "assistant", "content": step.text})
            if step.calls:
                msgs.extend(
                    {"role": "tool", "content": o}
                    for o in step.observations + [f"Error: {e}" for e in step.parse_errors]
                )
    return msgs


def _kv_task_and_sample(**options):
    task = build_task("kv_agent", {"n_episodes": 3, **options})
    return task, task.load()[1]


# A ChatML variant that groups consecutive tool results into one user message, as Qwen's templates do.
GROUPING_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\n<tool_response>\n' + m['content'] + '\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.mark.parametrize("template", ["chatml", "grouping"])
def test_episode_feeds_each_increment_once_in_order(template):
    from kvleague.tasks.agentic import optimal_agent

    tok = byte_level_tokenizer()
    if template == "grouping":
        tok.chat_template = GROUPING_TEMPLATE
    task, sample = _kv_task_and_sample()
    assert any(len(t) == 2 for t in sample.reference["gold_calls"])  # a step with two tool results
    session = ScriptedSession(tok, optimal_agent)
    result = task.run_episode(sample, session, tok, GenerationSettings(max_new_tokens=64))
    assert result.score.correct
    # Oracle: the chat template rendering the finished conversation in one go.
    expected = tok.apply_chat_template(_conversation(result, task.system_message(sample)), tokenize=False)
    assert tok.decode(session.sequence, skip_special_tokens=False) + "\n" == expected
    assert ("</tool_response>\n<tool_response>" in expected) == (template == "grouping")
    # One feed for the first prompt, one per later user turn, one per step with tool calls.
    n_obs_steps = sum(1 for t in result.turns for s in t.steps if s.calls)
    assert len(session.fed) == len(result.feeds) == 1 + (len(result.turns) - 1) + n_obs_steps
    assert [len(f) for f in session.fed] == [f["tokens"] for f in result.feeds]
    assert [f["kind"] for f in result.feeds][:2] == ["prompt", "observation"]
    # Interleaving: feed, decode, feed, decode, ... (every decode is followed by a feed, but the last).
    assert len(session.decoded) == sum(len(t.steps) for t in result.turns) == len(session.fed)


def test_episode_plain_layout_without_chat_template(tok):
    from kvleague.tasks.agentic import optimal_agent

    plain = byte_level_tokenizer()
    plain.chat_template = None
    task, sample = _kv_task_and_sample()
    session = ScriptedSession(plain, optimal_agent)
    result = task.run_episode(sample, session, plain, GenerationSettings(max_new_tokens=64))
    assert result.score.correct
    parts = [task.system_message(sample)]
    for turn in result.turns:
        parts.append("User: " + turn.user[0]["content"])
        for step in turn.steps:
            parts.append("Assistant:" + step.text)
            if step.calls:
                parts.extend(f"Tool: <tool_response>\n{o}\n</tool_response>" for o in step.observations)
    assert plain.decode(session.sequence) == "\n\n".join(parts)


def test_episode_template_without_system_or_tool_role(tok):
    from kvleague.tasks.agentic import optimal_agent

    strict = byte_level_tokenizer()
    strict.chat_template = (
        "{% for m in messages %}"
        "{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
        "{% if m['role'] == 'tool' %}{{ raise_exception('Tool role not supported') }}{% endif %}"
        "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    task, sample = _kv_task_and_sample()
    session = ScriptedSession(strict, optimal_agent)
    result = task.run_episode(sample, session, strict, GenerationSettings(max_new_tokens=64))
    assert result.score.correct
    msgs = []
    for turn in result.turns:
        msgs.extend(dict(m) for m in turn.user)
        for step in turn.steps:
            msgs.append({"role": "assistant", "content": step.text})
            if step.calls:
                body = "\n".join(f"<tool_response>\n{o}\n</tool_response>" for o in step.observations)
                msgs.append({"role": "user", "content": body})
    msgs[0]["content"] = task.system_message(sample) + "\n\n" + msgs[0]["content"]
    oracle = byte_level_tokenizer()  # the permissive ChatML template
    assert oracle.chat_template == CHAT_TEMPLATE
    assert strict.decode(session.sequence, skip_special_tokens=False) + "\n" == oracle.apply_chat_template(
        msgs, tokenize=False
    )


def test_episode_step_limit_force_terminates(tok):
    task, sample = _kv_task_and_sample(max_steps_per_turn=2)

    def always_call(context: str) -> str:
        return format_tool_call("write_log", {"message": "x"})

    result = task.run_episode(sample, ScriptedSession(tok, always_call), tok, GenerationSettings(max_new_tokens=8))
    assert result.transcript.terminated == "max_steps"
    assert len(result.turns) == 1 and len(result.turns[0].steps) == 2
    assert not result.score.correct and not result.score.details["complete"]


class _Recorder:
    """Wraps an engine session; records every feed and decode in order."""

    def __init__(self, session):
        self.session, self.events, self.settings = session, [], None

    def feed(self, ids):
        self.events.append(("feed", list(ids)))
        self.session.feed(ids)

    def decode(self, settings):
        self.settings = settings
        out = self.session.decode(settings)
        self.events.append(("decode", list(out.token_ids)))
        return out

    def result(self):
        return self.session.result()


def test_real_tiny_model_episode_on_one_session(engines):
    from kvleague.engine.protocol import Protocol
    from kvleague.methods.registry import build_method

    engine = engines["llama"]
    task = build_task("kv_agent", {"n_episodes": 1, "n_lockers": 2, "n_queries": 1, "n_logs": 0})
    sample = task.load()[0]
    budget, chunk = 192, 64
    settings = GenerationSettings(max_new_tokens=6)
    protocol = Protocol(prefill_chunk=chunk)
    with engine.session(build_method("streaming_llm", {"n_sink": 4}), budget, protocol, seed=0) as session:
        rec = _Recorder(session)
        result = task.run_episode(sample, rec, engine.tokenizer, settings)
    gen = result.generation
    assert len(result.turns) == len(sample.reference["turns"])  # a random model ends every turn at once
    assert (
        gen.prompt_tokens
        == sum(f["tokens"] for f in result.feeds)
        == sum(len(e[1]) for e in rec.events if e[0] == "feed")
    )
    assert gen.generated_tokens == sum(s.generated_tokens for t in result.turns for s in t.steps)
    assert gen.evictions > 0 and gen.peak_cache_entries <= budget + chunk
    assert all(len(kept) <= budget for kept in gen.kept_positions)
    assert not result.score.correct  # random weights cannot move the right stock

    # Cache continuity, checked against a one-shot oracle: with no eviction, the last decode of the
    # episode equals a fresh session fed the whole sequence (every fed and generated token, in order).
    with engine.session(build_method("full"), 10**6, Protocol(), seed=0) as session:
        rec = _Recorder(session)
        task.run_episode(sample, rec, engine.tokenizer, settings)
    *before, last = rec.events
    assert last[0] == "decode"
    sequence = [t for _, ids in before for t in ids]
    with engine.session(build_method("full"), 10**6, Protocol(), seed=0) as fresh:
        fresh.feed(sequence)
        assert fresh.decode(rec.settings).token_ids == last[1]


def _some_calls(text: str):
    """Tool calls for a random model: an ``open_locker`` call for two texts in three (by a checksum,
    so the same text gets the same answer alone and in a batch), so episodes take different numbers
    of steps and their decodes and feeds interleave in a batch."""
    import zlib

    from kvleague.tasks.tool_calls import ToolCall

    return (
        [ToolCall("open_locker", {"locker_id": f"L-{zlib.crc32(text.encode()) % 1000}"})]
        if zlib.crc32(text.encode()) % 3
        else []
    ), []


@pytest.mark.parametrize("name", ["streaming_llm", "h2o", "snapkv", "epikv"])
def test_episodes_decoded_together_equal_each_alone(tiny_models, monkeypatch, name):
    """``run_samples`` of an episodic task drives its episodes together (their decodes batched round
    by round): every episode's transcript, feeds, tool observations, kept positions and counters
    equal those of it alone (``run_sample``), in float64, where no float rounding parts a near-tie."""
    from kvleague.engine import batch
    from kvleague.engine.protocol import Protocol
    from kvleague.methods.registry import build_method
    from kvleague.runner.models import load_engine
    from kvleague.runner.sample import run_sample, run_samples
    from kvleague.tasks import episode

    engine = load_engine(str(tiny_models["llama"]))
    engine.model.double()
    monkeypatch.setattr(episode, "parse_tool_calls", _some_calls)
    task = build_task("kv_agent", {"n_episodes": 5, "n_lockers": 2, "n_queries": 2, "n_logs": 0})
    samples = task.load()
    settings, protocol, budget = GenerationSettings(max_new_tokens=5), Protocol(sink=2, recent=4, prefill_chunk=48), 96
    alone = [run_sample(engine, task, s, build_method(name), budget, protocol, settings, 7) for s in samples]
    rounds = []
    inner = batch.DecodeLoop
    monkeypatch.setattr(
        batch, "DecodeLoop", lambda engine, sessions, *a: rounds.append(len(sessions)) or inner(engine, sessions, *a)
    )
    together = run_samples(
        engine, task, samples, [build_method(name) for _ in samples], budget, protocol, settings, [7] * len(samples)
    )
    for one, row in zip(alone, together):
        assert row.completion == one.completion and row.details == one.details and row.score == one.score
        for field in (
            "token_ids",
            "kept_positions",
            "evictions",
            "evicted_tokens",
            "prompt_tokens",
            "generated_tokens",
            "peak_cache_entries",
        ):
            assert getattr(row.generation, field) == getattr(one.generation, field), field
    steps = [one.details["episode"]["steps"] for one in alone]
    assert max(rounds) == len(samples)  # decoded together
    if name in ("streaming_llm", "h2o"):  # here the episodes take different numbers of steps
        assert len(set(steps)) > 1
    assert len(rounds) == max(steps) and sum(rounds) == sum(steps)  # one batch per round, a row per waiting episode
    assert sum(one.generation.evictions for one in alone) > 0


def test_a_failing_episode_stops_its_batch_and_raises(tiny_models, monkeypatch):
    """An episode that raises stops the others at their next request (none is left waiting) and its
    error is what the caller gets: the cell worker then runs the cells one by one."""
    from kvleague.engine.batch import drive_sessions
    from kvleague.engine.protocol import Protocol
    from kvleague.engine.session import Session
    from kvleague.methods.registry import build_method
    from kvleague.runner.models import load_engine

    engine = load_engine(str(tiny_models["llama"]))
    sessions = [Session(engine, build_method("h2o"), 32, Protocol(), 0) for _ in range(3)]
    seen = []

    def driver(i):
        def play(handle):
            handle.feed([5, 6, 7, 8 + i])
            for step in range(4):
                seen.append((i, len(handle.decode(GenerationSettings(max_new_tokens=2)).token_ids)))
                if i == 1 and step == 1:
                    raise ValueError("tool crashed")
                handle.feed([9])

        return play

    with pytest.raises(ValueError, match="tool crashed"):
        drive_sessions(engine, sessions, [driver(i) for i in range(3)])
    assert sorted(seen) == [(i, 2) for i in range(3) for _ in range(2)]  # two rounds each, then the stop
    import threading

    assert not [t for t in threading.enumerate() if t.name.startswith("kvleague-driver")]

    # a batched decode that raises (out of memory, say) stops every driver the same way
    from kvleague.engine import batch

    rounds = []
    inner = batch.DecodeLoop

    def failing(engine, group, *args):
        rounds.append(len(group))
        if len(rounds) == 2:
            raise RuntimeError("CUDA out of memory")
        return inner(engine, group, *args)

    monkeypatch.setattr(batch, "DecodeLoop", failing)
    sessions = [Session(engine, build_method("h2o"), 32, Protocol(), 0) for _ in range(3)]
    with pytest.raises(RuntimeError, match="out of memory"):
        drive_sessions(engine, sessions, [driver(i + 3) for i in range(3)])  # (no driver of these crashes)
    assert rounds == [3, 3] and not [t for t in threading.enumerate() if t.name.startswith("kvleague-driver")]


# ---------------------------------------------------------------------------------------------
# BFCL multi-turn base on BFCL's own simulators and checker
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bfcl():
    import os

    os.environ.setdefault("KVLEAGUE_DATA_DIR", str(DATA_DIR))
    task = build_task("bfcl_multi_turn")
    samples = task.load(data_dir=DATA_DIR)
    assert len(samples) == 200 and samples[0].sample_id == "multi_turn_base_0"
    return task, samples


def test_bfcl_gold_replay_scores_at_least_95pct(bfcl, tok):
    task, samples = bfcl
    correct = sum(task.score(s, task.gold_transcript(s).to_json()).correct for s in samples)
    assert correct / len(samples) >= 0.95, correct
    # The same through the episode loop (observations from the live simulators), on every 4th entry;
    # one call per step and all of a turn's calls in one step must both score.
    for i, sample in enumerate(samples[::4]):
        gold = task.gold_transcript(sample, one_call_per_step=bool(i % 2))
        result = task.run_episode(
            sample, ScriptedSession(tok, replay(gold.turns)), tok, GenerationSettings(max_new_tokens=8)
        )
        assert result.transcript.turns == gold.turns
        assert result.score.correct, (sample.sample_id, result.score.details.get("error_message"))


def test_bfcl_one_call_removed_fails(bfcl):
    task, samples = bfcl
    n = failed = 0
    for sample in samples:
        gold = task.gold_transcript(sample)
        assert task.score(sample, gold.to_json()).correct
        for ti, turn in enumerate(gold.turns):
            for si in range(len(turn) - 1):  # every tool-call step (the last step is the closing text)
                turns = [list(t) for t in gold.turns]
                del turns[ti][si]
                n += 1
                failed += not task.score(sample, Transcript(turns).to_json()).correct
    # A few ground-truth calls repeat an earlier read-only call; removing one of those is harmless.
    assert n > 1000 and failed / n >= 0.99, (failed, n)


def test_bfcl_wrong_argument_and_missing_turn_fail(bfcl):
    task, samples = bfcl
    sample = samples[0]  # cd(document), mkdir(temp), mv(final_report.pdf -> temp), ...
    gold = task.gold_transcript(sample)
    turns = [list(t) for t in gold.turns]
    turns[0][1] = format_tool_call("mkdir", {"dir_name": "tmp"})
    verdict = task.score(sample, Transcript(turns).to_json())
    assert not verdict.correct and verdict.details["error_type"] == "multi_turn:instance_state_mismatch"
    verdict = task.score(sample, Transcript(gold.turns[:-1]).to_json())
    assert not verdict.correct and verdict.details["error_type"] == "multi_turn:force_terminated"


def test_bfcl_observations_match_bfcl_executor(bfcl):
    """Our environment's observations equal those of BFCL's own string executor, call by call."""
    import uuid

    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils

    from kvleague.tasks.bfcl import _signatures, bfcl_call_string, parse_bfcl_call

    task, samples = bfcl
    for sample in samples[::10]:
        env = task.make_environment(sample)
        sigs = _signatures(sample.reference["involved_classes"])
        name = f"kvltest_{uuid.uuid4().hex}"
        entry = {
            "initial_config": sample.reference["initial_config"],
            "involved_classes": sample.reference["involved_classes"],
        }
        try:
            for turn in sample.reference["ground_truth"]:
                for call_text in turn:
                    call = parse_bfcl_call(call_text, sigs)
                    ours = env.execute(call)
                    theirs, _ = multi_turn_utils.execute_multi_turn_func_call(
                        [bfcl_call_string(call, set(sigs))],
                        entry["initial_config"],
                        entry["involved_classes"],
                        name,
                        sample.sample_id,
                    )
                    assert ours == theirs[0], call_text
        finally:
            for key in [k for k in vars(multi_turn_utils) if k.startswith(name)]:
                del vars(multi_turn_utils)[key]


def test_bfcl_calls_cannot_inject_code(bfcl, tmp_path):
    task, samples = bfcl
    sample = samples[0]
    marker = tmp_path / "pwned"
    evil = [
        ToolCall("__import__", {"name": "os"}),
        ToolCall("exec", {"source": f"open({str(marker)!r}, 'w')"}),
        ToolCall("cd", {f"folder=open({str(marker)!r},'w'),x": 1}),
        ToolCall("cd", {"folder": f"'); open({str(marker)!r}, 'w'); ('"}),
    ]
    steps = ["\n".join(format_tool_call(c.name, c.arguments) for c in evil), "ok"]
    turns = [steps] + [["ok"] for _ in sample.reference["ground_truth"][1:]]
    verdict = task.score(sample, Transcript(turns).to_json())
    assert not verdict.correct and not marker.exists()
    env = task.make_environment(sample)
    assert all(env.execute(c).startswith("Error during execution") for c in evil[:3]) and not marker.exists()


# ---------------------------------------------------------------------------------------------
# kv_agent: the built-in environment
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kv():
    task = build_task("kv_agent")
    return task, task.load()


def _success_rate(task, samples, make_agent, tok) -> float:
    ok = 0
    for i, sample in enumerate(samples):
        result = task.run_episode(
            sample, ScriptedSession(tok, make_agent(i)), tok, GenerationSettings(max_new_tokens=64)
        )
        ok += result.score.correct
        # the live environment and the scorer's replay agree on the final state
        assert result.final_state == result.score.details["final_state"]
    return ok / len(samples)


def test_kv_agent_optimal_agent_succeeds_always(kv, tok):
    from kvleague.tasks.agentic import optimal_agent

    task, samples = kv
    assert len(samples) == 200
    assert _success_rate(task, samples, lambda i: optimal_agent, tok) == 1.0


def test_kv_agent_random_and_amnesic_agents_fail(kv, tok):
    from kvleague.tasks.agentic import amnesic_agent, random_agent

    task, samples = kv
    assert _success_rate(task, samples[:100], random_agent, tok) < 0.10
    # An agent that sees only the current turn (nothing older kept) never finds the stock's locker.
    assert _success_rate(task, samples[:50], lambda i: amnesic_agent, tok) == 0.0


def test_kv_agent_needs_facts_from_early_turns(kv):
    task, samples = kv
    for sample in samples:
        ref = sample.reference
        turns, gold = ref["turns"], ref["gold_calls"]
        opened_at = {
            c["arguments"]["locker_id"]: i for i, t in enumerate(gold) for c in t if c["name"] == "open_locker"
        }
        for i, t in enumerate(gold):
            for c in t:
                if c["name"] == "transfer":
                    locker = c["arguments"]["locker_id"]
                    # the pin appears in no user message, only in the opening's observation, turns earlier
                    assert ref["lockers"][locker]["pin"] not in " ".join(turns)
                    assert i - opened_at[locker] >= 3
        assert task.score(sample, task.gold_transcript(sample).to_json()).correct


def test_kv_agent_wrong_pin_or_extra_transfer_fails(kv):
    task, samples = kv
    sample = samples[0]
    gold = task.gold_transcript(sample)
    last = sample.reference["gold_calls"][-1][0]["arguments"]
    bad_pin = dict(last, pin=str((int(last["pin"]) + 1 - 1000) % 9000 + 1000))
    turns = [list(t) for t in gold.turns]
    turns[-1][0] = format_tool_call("transfer", bad_pin)
    verdict = task.score(sample, Transcript(turns).to_json())
    assert not verdict.correct and verdict.details["alarms"] == 1
    # moving an extra, unrequested stock (with the right pin and count) also fails
    other = next(
        k
        for k in sample.reference["lockers"]
        if k != last["locker_id"]
        and k
        not in {
            c[0]["arguments"].get("locker_id") for c in sample.reference["gold_calls"] if c[0]["name"] == "transfer"
        }
    )
    info = sample.reference["lockers"][other]
    turns = [list(t) for t in gold.turns]
    turns[-1][0] += "\n" + format_tool_call(
        "transfer", {"locker_id": other, "pin": info["pin"], "quantity": info["quantity"]}
    )
    verdict = task.score(sample, Transcript(turns).to_json())
    assert not verdict.correct and verdict.details["mismatched"] == ["contents", "dock"]


def test_kv_agent_generation_is_deterministic_and_option_dependent():
    a = build_task("kv_agent", {"n_episodes": 5}).load()
    b = build_task("kv_agent", {"n_episodes": 5}).load()
    c = build_task("kv_agent", {"n_episodes": 5, "n_lockers": 10}).load()
    assert [s.reference for s in a] == [s.reference for s in b]
    assert [s.reference for s in a] != [s.reference for s in c]
    assert json.loads(json.dumps(a[0].reference)) == a[0].reference  # JSON-ready for the database
    assert len({s.sample_id for s in a}) == 5


def test_agentic_tasks_are_registered():
    from kvleague.tasks.registry import available_tasks

    tasks = available_tasks()
    for name in ("bfcl_multi_turn", "kv_agent"):
        assert tasks[name].domain == "agentic" and tasks[name].episodic
    assert Path(DATA_DIR / "bfcl_v4" / "BFCL_v4_multi_turn_base.json").is_file()
