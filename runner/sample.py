"""One sample's run (prompt -> engine session -> score): the one path the sweep's cells, and anything
else that runs a task's sample under a method, take.

A plain task's prompt is generated once by :meth:`Engine.generate` (the engine's own one-prompt
path, which the lm-eval bridge and ``kvleague generate`` use too) and scored by the task. An
episodic task (:class:`tasks.episode.EpisodicTask`: a conversation with tool calls) drives an open
session itself through :meth:`~tasks.episode.EpisodicTask.run_episode`, and is scored on its
transcript.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvleague.engine.errors import KvleagueError
from kvleague.tasks.episode import EpisodicTask


@dataclass
class SampleRun:
    """What one sample's run produced: the engine's record, the completion (an episode's transcript
    for an episodic task), its score, and details for the stored row (scorer details, episode summary)."""

    generation: Any  # engine.GenerationResult
    completion: Any
    score: Any  # tasks.base.ScoreResult
    details: dict[str, Any] = field(default_factory=dict)


def run_sample(engine, task, sample, method, budget: int, protocol, settings, seed: int) -> SampleRun:
    """Run ``sample`` of ``task`` under ``method`` at ``budget`` and score it."""
    if not isinstance(task, EpisodicTask):
        prompt = _prompt(task, sample, engine.tokenizer, protocol)
        protocol, budget = protocol.for_prompt(budget, len(prompt[0]))
        generation = engine.generate(prompt, method, budget, protocol, settings, seed)
        return _scored(task, sample, generation)
    _check_episodic(task, protocol)
    with engine.session(method, budget, protocol, seed) as session:
        episode = task.run_episode(sample, session, engine.tokenizer, settings)
        generation = episode.generation if episode.generation is not None else session.result()
    return _episode_run(episode, generation)


def _prompt(task, sample, tokenizer, protocol) -> tuple[list[int], ...]:
    """The prompt as the engine feeds it: ``(context, question)`` under ``scope: context`` (kvpress's
    pipeline: only the context is compressed), else one part; the first part is what a relative
    budget counts from."""
    if protocol.scope == "context":
        return task.split_prompt(sample, tokenizer, protocol.query_aware)
    return (task.build_prompt(sample, tokenizer),)


def _check_episodic(task, protocol) -> None:
    if protocol.budget_base != "none":
        raise KvleagueError(
            f"budget_base: {protocol.budget_base!r} needs the prompt before the episode starts; "
            f"episodic task {task.name!r} allows: none (or measure: fidelity)"
        )
    if protocol.scope != "all":
        raise KvleagueError(
            f"scope: {protocol.scope!r} compresses one context; episodic task {task.name!r} allows: all"
        )


def _episode_run(episode, generation) -> SampleRun:
    summary = episode.to_dict()
    details: dict[str, Any] = {
        "episode": {k: summary[k] for k in ("fed_tokens", "generated_tokens", "steps") if k in summary}
    }
    details["episode"]["turns"] = len(episode.turns)
    details["episode"]["terminated"] = episode.transcript.terminated
    details["score"] = _jsonable(episode.score.details)
    return SampleRun(generation=generation, completion=episode.completion, score=episode.score, details=details)


def run_samples(
    engine,
    task,
    samples,
    methods,
    budget: int,
    protocol,
    settings,
    seeds,
    rows: int | None = None,
    max_rows: int | None = None,
) -> list[SampleRun]:
    """:func:`run_sample` for several samples, decoded together (``methods[i]`` and ``seeds[i]`` are
    sample i's): a plain task's by :meth:`Engine.generate_batch`, ``rows`` at a time (None: what fits
    in memory, at most ``max_rows``, by default the engine's most), a finished row taken by the next
    sample; an episodic task's episodes each played by its own driver, all their decodes batched round
    by round (``engine.batch.drive_sessions``). Each sequence decodes as it would alone."""
    if isinstance(task, EpisodicTask):
        return _run_episodes(engine, task, samples, methods, budget, protocol, settings, seeds)
    prompts = [_prompt(task, sample, engine.tokenizer, protocol) for sample in samples]
    # each prompt its own budget where budgets count from the prompt or its context (one absolute protocol for all)
    absolute, budgets = protocol.for_prompts(budget, [len(prompt[0]) for prompt in prompts])
    generations = engine.generate_batch(
        prompts, list(methods), budgets, absolute, settings, list(seeds), rows, max_batch_size=max_rows
    )
    return [_scored(task, sample, generation) for sample, generation in zip(samples, generations)]


def _run_episodes(engine, task, samples, methods, budget: int, protocol, settings, seeds) -> list[SampleRun]:
    from kvleague.engine.batch import drive_sessions
    from kvleague.engine.session import Session

    _check_episodic(task, protocol)
    sessions = [Session(engine, method, budget, protocol, seed) for method, seed in zip(methods, seeds)]

    def driver(sample):
        def play(handle):
            episode = task.run_episode(sample, handle, engine.tokenizer, settings)
            return _episode_run(episode, episode.generation)

        return play

    return drive_sessions(engine, sessions, [driver(sample) for sample in samples])


def _scored(task, sample, generation) -> SampleRun:
    score = task.score(sample, generation.completion)
    return SampleRun(
        generation=generation,
        completion=generation.completion,
        score=score,
        details={"score": _jsonable(score.details)},
    )


def _jsonable(value: Any) -> Any:
    """``value`` as JSON would store it (unknown objects as strings; unencodable: their repr)."""
    try:
        return json.loads(json.dumps(value, default=str))
    except (TypeError, ValueError):
        return {"repr": repr(value)[:2000]}
