"""Multi-turn agentic episodes on one KV cache.

An episode alternates model turns and tool executions on the **same** engine session, so an eviction
decided in turn 1 is still in force in turn 5::

    feed(system + first user message + generation prompt)
    for each user turn:
        (turn > 0) feed(end of the previous assistant message + the user message + generation prompt)
        repeat (at most ``max_steps_per_turn`` steps):
            decode -> completion; parse its tool calls
            no tool call: the turn is over (the completion is the assistant's answer)
            else: execute every call in the environment and
                  feed(end of the assistant message + one tool message per call + generation prompt)

Only the **new** tokens of each step are fed (each exactly once, in order): the text to feed is
what the tokenizer's chat template renders *after* the previous assistant message (found with a
sentinel), so it is exactly the template's own continuation of the conversation. A tokenizer without a
chat template gets a plain ``User:`` / ``Assistant:`` / ``Tool:`` layout.

Tool-call format (:mod:`tasks.tool_calls`; the same for every agentic task, and spelled out in the
system prompt by :func:`~tasks.tool_calls.tools_system_prompt`): one block per call, anywhere in the
completion::

    <tool_call>
    {"name": "transfer", "arguments": {"locker_id": "L-417", "pin": "5821", "quantity": 23}}
    </tool_call>

The JSON object has ``name`` (a string) and ``arguments`` (an object; a JSON-encoded string is
accepted too). Several blocks in one completion are executed in order. A missing closing tag is
tolerated (a completion cut by the token limit), a block that is not valid JSON is reported back to
the model as an error observation. Tool results come back as ``tool`` messages (or, for templates
without a tool role, as a user message wrapping each result in ``<tool_response>...</tool_response>``).

The **transcript** (what is stored as the sample's completion and what :meth:`EpisodicTask.score`
reads back) is JSON: ``{"format": "kvleague-episode/1", "turns": [[step text, ...], ...],
"terminated": null | "max_steps"}``. Scoring re-parses the tool calls from the step texts and replays
them in a fresh environment, so ``kvleague score`` can re-score stored episodes.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Protocol

from kvleague.engine.errors import KvleagueError
from kvleague.tasks.base import Domain, Sample, ScoreResult, Task
from kvleague.tasks.tool_calls import TOOL_RESPONSE_CLOSE, TOOL_RESPONSE_OPEN, ToolCall, parse_tool_calls

TRANSCRIPT_FORMAT = "kvleague-episode/1"
#: marks the previous assistant message when rendering the template's continuation
_SENTINEL = "\u2063kvleague-sentinel-7f3a\u2063"
#: plain-text layout for tokenizers without a chat template
PLAIN_ROLES = {"system": "", "user": "User: ", "assistant": "Assistant:", "tool": "Tool: "}
PLAIN_STOPS = ("\nUser:", "\nTool:")


# ------------------------------------------------------------------------------------------------
# Transcripts
# ------------------------------------------------------------------------------------------------


@dataclass
class Transcript:
    """Per user turn, the assistant's completion text of every step (tool calls are in the texts)."""

    turns: list[list[str]]
    terminated: str | None = None  # "max_steps": a turn hit the step limit; the episode stopped there

    def to_json(self) -> str:
        return json.dumps(
            {"format": TRANSCRIPT_FORMAT, "turns": self.turns, "terminated": self.terminated}, ensure_ascii=False
        )

    @classmethod
    def parse(cls, completion: Any) -> Transcript:
        """From a stored completion: the JSON text (or the already-decoded object)."""
        obj = completion
        if isinstance(completion, str):
            try:
                obj = json.loads(completion)
            except json.JSONDecodeError:
                raise KvleagueError(
                    f"completion: an agentic completion must be an episode transcript (JSON with format {TRANSCRIPT_FORMAT!r}), got plain text"
                ) from None
        if isinstance(obj, list):  # bare list of turns
            obj = {"turns": obj}
        turns = obj.get("turns") if isinstance(obj, dict) else None
        if not isinstance(turns, list) or not all(
            isinstance(t, list) and all(isinstance(s, str) for s in t) for t in turns
        ):
            raise KvleagueError("completion: transcript 'turns' must be a list of lists of step texts")
        terminated = obj.get("terminated") if isinstance(obj, dict) else None
        if terminated is not None and not isinstance(terminated, str):
            raise KvleagueError("completion: transcript 'terminated' must be a string or null")
        return cls(turns=[list(t) for t in turns], terminated=terminated)

    def calls(self) -> list[list[list[ToolCall]]]:
        """Parsed calls per turn, per step (steps without a valid call are kept as empty lists)."""
        return [[parse_tool_calls(step)[0] for step in turn] for turn in self.turns]


# ------------------------------------------------------------------------------------------------
# Environments and episodic tasks
# ------------------------------------------------------------------------------------------------


class Environment(Protocol):
    """A simulated backend for one episode."""

    def execute(self, call: ToolCall) -> str:
        """Run one call and return the observation text (errors are observations too)."""
        ...

    def state(self) -> Any:
        """A JSON-ready snapshot of the environment state."""


@dataclass
class EpisodicTask(Task):
    """A task whose samples are episodes. Subclasses implement :meth:`system_message`,
    :meth:`user_turns`, :meth:`make_environment` and :meth:`score_transcript`.

    The runner (``runner.sample.run_sample``) calls :meth:`run_episode` of an instance of this class with an open engine session
    instead of feeding :meth:`build_prompt` and decoding once.
    """

    episodic: ClassVar[bool] = True
    domain: ClassVar[Domain] = "agentic"
    #: observations are fed tokens too; protecting them would leave eviction only the model's own text
    protect_prompt: ClassVar[bool] = False
    max_new_tokens: ClassVar[int] = 512
    #: steps (model completions) allowed per user turn before the episode is force-terminated
    step_limit: ClassVar[int] = 20

    def system_message(self, sample: Sample) -> str:
        raise NotImplementedError

    def user_turns(self, sample: Sample) -> list[list[dict[str, Any]]]:
        """Per turn, the user message(s) that open it."""
        raise NotImplementedError

    def make_environment(self, sample: Sample) -> Environment:
        raise NotImplementedError

    def score_transcript(self, sample: Sample, transcript: Transcript) -> ScoreResult:
        raise NotImplementedError

    # -- contract ---------------------------------------------------------------------------------
    def max_steps(self) -> int:
        return int(getattr(self, "max_steps_per_turn", self.step_limit))

    def messages(self, sample: Sample) -> list[dict[str, Any]]:
        """The first prompt: the system message and the first turn's user message(s)."""
        turns = self.user_turns(sample)
        return [{"role": "system", "content": self.system_message(sample)}, *(turns[0] if turns else [])]

    def score(self, sample: Sample, completion: Any) -> ScoreResult:
        result = self.score_transcript(sample, Transcript.parse(completion))
        result.sample_id = sample.sample_id
        return result

    def reference_agent(self, sample: Sample) -> Callable[[str], str] | None:
        """A scripted agent that solves ``sample`` (its turns are the reference continuation); None: none."""
        return None

    def fidelity_segments(self, sample: Sample, tokenizer: Any) -> list[tuple[list[int], bool]]:
        """The reference agent's episode, played against the real environment: what it was fed
        (prompt, observations, user turns) unscored, its own turns scored."""
        agent = self.reference_agent(sample)
        if agent is None:
            raise KvleagueError(f"task {self.name}: sample {sample.sample_id} has no reference agent")
        session = ScriptedSession(tokenizer, agent)
        run_episode(self, sample, session, tokenizer, _ReferenceSettings())
        return session.segments

    def run_episode(self, sample: Sample, session: Any, tokenizer: Any, settings: Any) -> EpisodeResult:
        return run_episode(self, sample, session, tokenizer, settings)


# ------------------------------------------------------------------------------------------------
# Rendering the conversation incrementally
# ------------------------------------------------------------------------------------------------


class ChatFormat:
    """Turns conversation increments into the exact text to feed, with or without a chat template."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.templated = bool(getattr(tokenizer, "chat_template", None))
        self.system_role = True
        self.tool_role = True
        self.end_marker = ""
        if self.templated:
            self._probe()

    # -- probing the template ----------------------------------------------------------------------
    def _render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def _probe(self) -> None:
        try:
            self._render([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}], True)
        except Exception:  # e.g. "System role not supported"
            self.system_role = False
        base = self._fix_system([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
        try:
            text = self._render(
                [*base, {"role": "assistant", "content": _SENTINEL}, {"role": "tool", "content": "OBS-PROBE-42"}], True
            )
            self.tool_role = "OBS-PROBE-42" in text.split(_SENTINEL, 1)[1]
        except Exception:
            self.tool_role = False
        try:
            text = self._render([*base, {"role": "assistant", "content": _SENTINEL}], False)
            tail = text.split(_SENTINEL, 1)[1]
            self.end_marker = tail.strip().split("\n")[0].strip() if tail.strip() else ""
        except Exception:
            self.end_marker = ""

    def _fix_system(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if self.system_role or not messages or messages[0]["role"] != "system":
            return messages
        system, rest = messages[0]["content"], [dict(m) for m in messages[1:]]
        if rest and rest[0]["role"] == "user":
            rest[0]["content"] = f"{system}\n\n{rest[0]['content']}"
            return rest
        return [{"role": "user", "content": system}, *rest]

    # -- what the loop needs -----------------------------------------------------------------------
    def stop_strings(self) -> tuple[str, ...]:
        if not self.templated:
            return PLAIN_STOPS
        return (self.end_marker,) if self.end_marker else ()

    def observation_messages(self, observations: list[str]) -> list[dict[str, Any]]:
        if self.tool_role:
            return [{"role": "tool", "content": obs} for obs in observations]
        body = "\n".join(f"{TOOL_RESPONSE_OPEN}\n{obs}\n{TOOL_RESPONSE_CLOSE}" for obs in observations)
        return [{"role": "user", "content": body}]

    def first(self, messages: list[dict[str, Any]]) -> str:
        """Text of the first prompt (system + first user turn + generation prompt)."""
        if not self.templated:
            return self._plain(messages) + PLAIN_ROLES["assistant"]
        return self._render(self._fix_system(messages), True)

    def continuation(self, history: list[dict[str, Any]], new: list[dict[str, Any]], generated_raw: str) -> str:
        """Text that follows the last assistant message (``history[-1]``) up to the next generation
        prompt, without what the model already emitted itself (its end-of-turn marker)."""
        if not self.templated:
            return "\n\n" + self._plain(new) + PLAIN_ROLES["assistant"]
        msgs = self._fix_system([*history[:-1], {"role": "assistant", "content": _SENTINEL}, *new])
        text = self._render(msgs, True)
        tail = text[text.rindex(_SENTINEL) + len(_SENTINEL) :]
        marker = self.end_marker
        if marker and tail.startswith(marker) and generated_raw.rstrip().endswith(marker):
            tail = tail[len(marker) :]
        return tail

    def _plain(self, messages: list[dict[str, Any]]) -> str:
        parts = []
        for m in messages:
            role = m["role"]
            content = m["content"]
            if role == "tool":
                content = f"{TOOL_RESPONSE_OPEN}\n{content}\n{TOOL_RESPONSE_CLOSE}"
            parts.append(f"{PLAIN_ROLES.get(role, role + ': ')}{content}")
        return "\n\n".join(parts) + "\n\n"

    def encode(self, text: str, first: bool) -> list[int]:
        # Templates carry their own BOS text; plain prompts get the tokenizer's default specials once.
        add_special = first and not self.templated
        return [int(i) for i in self.tokenizer(text, add_special_tokens=add_special)["input_ids"]]


# ------------------------------------------------------------------------------------------------
# The loop
# ------------------------------------------------------------------------------------------------


@dataclass
class StepRecord:
    text: str  # the completion as the model produced it (special tokens removed, cut at a stop string)
    generated_tokens: int
    stop_reason: str
    calls: list[dict[str, Any]]
    observations: list[str]
    parse_errors: list[str]


@dataclass
class TurnRecord:
    user: list[dict[str, Any]]
    steps: list[StepRecord] = field(default_factory=list)


@dataclass
class EpisodeResult:
    sample_id: str
    turns: list[TurnRecord]
    transcript: Transcript
    #: every chunk handed to ``session.feed``: what it was and how many tokens
    feeds: list[dict[str, Any]]
    final_state: Any
    score: ScoreResult
    generation: Any = None  # the session's GenerationResult when it provides one

    @property
    def completion(self) -> str:
        return self.transcript.to_json()

    def to_dict(self) -> dict[str, Any]:
        out = {
            "sample_id": self.sample_id,
            "completion": self.completion,
            "turns": [asdict(t) for t in self.turns],
            "feeds": self.feeds,
            "final_state": self.final_state,
            "score": self.score.to_dict(),
            "fed_tokens": sum(f["tokens"] for f in self.feeds),
            "generated_tokens": sum(s.generated_tokens for t in self.turns for s in t.steps),
            "steps": sum(len(t.steps) for t in self.turns),
        }
        if self.generation is not None and hasattr(self.generation, "to_dict"):
            out["generation"] = self.generation.to_dict()
        return out


@dataclass
class _ReferenceSettings:
    """Decoding settings for a scripted agent's episode (it ignores them)."""

    max_new_tokens: int = 0
    stop: tuple[str, ...] = ()


def _decode_settings(settings: Any, extra_stops: tuple[str, ...]) -> Any:
    stops = tuple(dict.fromkeys((*tuple(getattr(settings, "stop", ()) or ()), *extra_stops)))
    if dataclasses.is_dataclass(settings) and not isinstance(settings, type):
        return dataclasses.replace(settings, stop=stops)
    duck: Any = settings  # a duck-typed settings object
    duck.stop = stops
    return duck


def run_episode(task: EpisodicTask, sample: Sample, session: Any, tokenizer: Any, settings: Any) -> EpisodeResult:
    """Play ``sample`` on one session (anything with ``feed(ids)`` and ``decode(settings)``)."""
    fmt = ChatFormat(tokenizer)
    settings = _decode_settings(settings, fmt.stop_strings())
    env = task.make_environment(sample)
    user_turns = task.user_turns(sample)
    if not user_turns:
        raise KvleagueError(f"task {task.name}: sample {sample.sample_id} has no user turns")
    max_steps = task.max_steps()
    history: list[dict[str, Any]] = [{"role": "system", "content": task.system_message(sample)}, *user_turns[0]]
    feeds: list[dict[str, Any]] = []

    def feed(text: str, kind: str, first: bool = False) -> None:
        ids = fmt.encode(text, first)
        session.feed(ids)
        feeds.append({"kind": kind, "tokens": len(ids), "text": text})

    feed(fmt.first(history), "prompt", first=True)
    turns: list[TurnRecord] = []
    terminated: str | None = None
    last_raw = ""
    for t, user in enumerate(user_turns):
        if t > 0:
            feed(fmt.continuation(history, user, last_raw), "user")
            history.extend(user)
        record = TurnRecord(user=user)
        turns.append(record)
        for _step in range(max_steps):
            out = session.decode(settings)
            last_raw = tokenizer.decode(list(out.token_ids), skip_special_tokens=False)
            calls, errors = parse_tool_calls(out.text)
            history.append({"role": "assistant", "content": out.text})
            observations = [env.execute(c) for c in calls] if calls else []
            record.steps.append(
                StepRecord(
                    text=out.text,
                    generated_tokens=len(out.token_ids),
                    stop_reason=out.stop_reason,
                    calls=[c.to_dict() for c in calls],
                    observations=observations,
                    parse_errors=errors,
                )
            )
            if not calls:  # a plain answer (or only undecodable blocks) ends the turn
                break
            new = fmt.observation_messages(observations + [f"Error: {e}" for e in errors])
            feed(fmt.continuation(history, new, last_raw), "observation")
            history.extend(new)
        else:
            terminated = "max_steps"
            break
    transcript = Transcript(turns=[[s.text for s in r.steps] for r in turns], terminated=terminated)
    score = task.score(sample, transcript.to_json())
    generation = session.result() if hasattr(session, "result") else None
    return EpisodeResult(
        sample_id=sample.sample_id,
        turns=turns,
        transcript=transcript,
        feeds=feeds,
        final_state=env.state(),
        score=score,
        generation=generation,
    )


# ------------------------------------------------------------------------------------------------
# A stand-in session for scripted agents (tests, baselines, dry runs)
# ------------------------------------------------------------------------------------------------


@dataclass
class ScriptedOutput:
    token_ids: list[int]
    text: str
    stop_reason: str


class ScriptedSession:
    """Implements ``feed``/``decode`` like an engine session, with a scripted agent instead of a model.

    The agent sees only what a model would: the decoded text of every token in the sequence so far
    (``respond(context) -> completion text``). Its completion is tokenized, ended with the template's
    end-of-turn marker (as a model emitting EOS would), and becomes part of the sequence.
    """

    def __init__(self, tokenizer: Any, respond: Callable[[str], str]):
        self.tokenizer = tokenizer
        self.respond = respond
        self.fmt = ChatFormat(tokenizer)
        self.sequence: list[int] = []
        self.fed: list[list[int]] = []
        self.decoded: list[list[int]] = []
        self.segments: list[tuple[list[int], bool]] = []  # in sequence order: (ids, decoded by the agent)
        self._text: list[str] = []  # decoded chunk by chunk (cheaper than re-decoding the sequence)

    def feed(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise KvleagueError("prompt: empty token list")
        self.fed.append(list(token_ids))
        self.segments.append((list(token_ids), False))
        self.sequence.extend(token_ids)
        self._text.append(self.tokenizer.decode(list(token_ids), skip_special_tokens=False))

    def decode(self, settings: Any) -> ScriptedOutput:
        text = self.respond("".join(self._text))
        end = self.fmt.end_marker if self.fmt.templated else ""
        ids = [int(i) for i in self.tokenizer(text + end, add_special_tokens=False)["input_ids"]]
        self.decoded.append(ids)
        self.segments.append((ids, True))
        self.sequence.extend(ids)
        self._text.append(text + end)
        return ScriptedOutput(ids, text, "stop" if end else "eos")
