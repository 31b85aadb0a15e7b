"""A budget the run can never reach: the cache never holds that many entries, nothing is evicted, and
the run is the full cache under another name (issue 50). ``kvleague generate`` and a sweep warn about it
once, and a sweep's rows say it (``details["budget_never_binds"]``)."""

from __future__ import annotations


def never_binds(
    budget: int, prompt_tokens: int | None, max_new_tokens: int, context: int | None, positions: str
) -> str | None:
    """Why ``budget`` never binds, in words, or None. The cache holds at most the prompt and the new
    tokens; under true positions a run also never passes the model's context (``max_position_embeddings``),
    while compact positions let a run go past it. ``prompt_tokens`` None: not known before the run (an
    episode's turns)."""
    if prompt_tokens is not None and budget >= prompt_tokens + max_new_tokens:
        return (
            f"budget {budget:,} holds the whole prompt ({prompt_tokens:,} tokens) and all "
            f"{max_new_tokens:,} new tokens, so nothing is evicted: the run is the full cache"
        )
    if context and positions != "compact" and budget >= context:
        return (
            f"budget {budget:,} is at least the model's context of {context:,} tokens, so nothing is "
            "evicted: the run is the full cache"
        )
    return None
