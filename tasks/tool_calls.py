"""kvleague's tool-call wire format, the same for every agentic task: the ``<tool_call>`` JSON blocks a
model writes, their parsing (tolerant of a missing closing tag and of fenced blocks; a malformed block
is an error message for the model, not an exception), and the system prompt that spells the format
out. Episodes (:mod:`tasks.episode`) and the agentic tasks build on it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"

TOOL_FORMAT_INSTRUCTIONS = (
    "To call a tool, write a block of this exact form (one block per call; several blocks run in order):\n"
    f"{TOOL_CALL_OPEN}\n"
    '{"name": "<tool name>", "arguments": {"<parameter>": <value>, ...}}\n'
    f"{TOOL_CALL_CLOSE}\n"
    "The arguments are a JSON object with the parameters the tool's schema defines. Each result comes back "
    f"in the next message, wrapped in {TOOL_RESPONSE_OPEN}...{TOOL_RESPONSE_CLOSE}. When the user's request "
    "is complete (or cannot be completed), answer in plain text without any tool call: that ends your turn."
)


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "arguments": self.arguments}


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """The canonical text of one tool call (what a well-behaved model writes)."""
    return (
        f"{TOOL_CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{TOOL_CALL_CLOSE}"
    )


_DECODER = json.JSONDecoder()


def parse_tool_calls(text: str) -> tuple[list[ToolCall], list[str]]:
    """Tool calls in ``text``, in order, and one error message per malformed ``<tool_call>`` block."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    pos = 0
    while True:
        start = text.find(TOOL_CALL_OPEN, pos)
        if start < 0:
            break
        body_start = start + len(TOOL_CALL_OPEN)
        close = text.find(TOOL_CALL_CLOSE, body_start)
        nxt = text.find(TOOL_CALL_OPEN, body_start)
        end = min(i for i in (close, nxt, len(text)) if i >= 0)
        body = text[body_start:end].strip()
        pos = close + len(TOOL_CALL_CLOSE) if close >= 0 and close == end else end
        if body.startswith("```"):  # tolerate a fenced block inside the tags
            body = re.sub(r"^```[a-zA-Z]*\s*|\s*```$", "", body).strip()
        try:
            obj, _ = _DECODER.raw_decode(body)
        except json.JSONDecodeError as exc:
            errors.append(f"tool call is not valid JSON ({exc.msg} at char {exc.pos}): {body[:120]!r}")
            continue
        call, error = _tool_call_from_obj(obj)
        if error:
            errors.append(error)
        elif call is not None:
            calls.append(call)
    return calls, errors


def _tool_call_from_obj(obj: Any) -> tuple[ToolCall | None, str | None]:
    if not isinstance(obj, dict):
        return None, f"tool call must be a JSON object with 'name' and 'arguments', got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None, "tool call has no 'name' string"
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return None, f"tool call {name!r}: 'arguments' is a string that is not JSON"
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return None, f"tool call {name!r}: 'arguments' must be a JSON object"
    return ToolCall(name, args), None


def tools_system_prompt(preamble: str, tools: Sequence[dict[str, Any]]) -> str:
    """System prompt: ``preamble``, the tool schemas (one JSON object a line) and the call format."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return f"{preamble.strip()}\n\nYou can use these tools:\n<tools>\n{lines}\n</tools>\n\n{TOOL_FORMAT_INSTRUCTIONS}"
