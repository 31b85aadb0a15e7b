"""``bfcl_multi_turn``: BFCL v4 multi-turn base (200 episodes) on BFCL's own simulators and checker.

The model's tool calls (kvleague's ``<tool_call>`` JSON format, see :mod:`tasks.episode`) are
executed against the simulated backends of the ``bfcl-eval`` package (GorillaFileSystem, MathAPI,
MessageAPI, TwitterAPI, TicketAPI, TradingBot, TravelAPI, VehicleControlAPI), loaded with each
entry's ``initial_config``. Scoring is BFCL's: the calls of every step are turned into BFCL call
strings and handed to ``bfcl_eval``'s ``multi_turn_checker``, which replays them and the ground
truth from the initial state and, after every turn, compares the public state of every backend
instance and checks that the ground truth's execution results are among the model's. A turn that
hits the step limit force-terminates the episode (a failure, as in BFCL).

``bfcl-eval`` pins numpy 1.26.4 and pulls a dozen API-client SDKs that the simulators never import,
so install it without its dependencies (the simulators need only ``mpmath``)::

    pip install --no-deps bfcl-eval==2026.3.23 && pip install mpmath

Every tool call runs in a forked child under :data:`TOOL_TIMEOUT_S` and :data:`TOOL_MEMORY_MB`
(:mod:`tasks.limited`), and BFCL's checker (which replays the calls) under :data:`CHECK_TIMEOUT_S`
and :data:`CHECK_MEMORY_MB`; whatever a tool raises, or a limit it hits, is the call's observation
``Error during execution: <message>``, as in BFCL's own executor. The MathAPI's arguments that set a
result's size are bounded first (:func:`argument_error`), so those calls fail at once, in the episode
and in the checker alike.

Data: the local copy ``<data-dir>/bfcl_v4/`` (questions, ``possible_answer/``, ``multi_turn_func_doc/``),
else the same files inside the installed ``bfcl_eval`` package.
"""

from __future__ import annotations

import ast
import copy
import functools
import importlib
import inspect
import json
import keyword
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvleague.engine.errors import KvleagueError
from kvleague.tasks.base import DataSource, Sample, ScoreResult
from kvleague.tasks.data import iter_file
from kvleague.tasks.episode import EpisodicTask, Transcript
from kvleague.tasks.limited import CallFailed, LimitExceeded, run_limited
from kvleague.tasks.registry import register_task
from kvleague.tasks.tool_calls import ToolCall, format_tool_call, tools_system_prompt

BFCL_EVAL_VERSION = "2026.3.23"
INSTALL_HINT = f"pip install --no-deps bfcl-eval=={BFCL_EVAL_VERSION} mpmath"
#: the data folder's name under the data directory
LOCAL_DIR = "bfcl_v4"
SOURCE = DataSource(
    dataset="bfcl_v4_multi_turn_base",
    hub_id=None,
    revision=None,
    local_path=LOCAL_DIR,
    license="Apache-2.0",
    url="https://github.com/ShishirPatil/gorilla/tree/6ea57973c7a6097fd7c5915698c54c17c5b1b6c8/"
    f"berkeley-function-call-leaderboard/bfcl_eval/data (also in the bfcl-eval=={BFCL_EVAL_VERSION} wheel)",
)
QUESTIONS = "BFCL_v4_multi_turn_base.json"
#: API class -> its schema file in ``multi_turn_func_doc/`` (the layout of BFCL's data folder)
FUNC_DOC_FILES = {
    "GorillaFileSystem": "gorilla_file_system.json",
    "MathAPI": "math_api.json",
    "MessageAPI": "message_api.json",
    "TwitterAPI": "posting_api.json",
    "TicketAPI": "ticket_api.json",
    "TradingBot": "trading_bot.json",
    "TravelAPI": "travel_booking.json",
    "VehicleControlAPI": "vehicle_control.json",
}
PREAMBLE = (
    "You are an assistant that carries out the user's requests by calling the tools of the systems "
    "listed below. The systems keep their state for the whole conversation, across all requests. "
    "Use the tools to act and to look things up; make every call the request needs, then reply briefly."
)
_UNKNOWN_TOOL = "__kvleague_unknown_tool__()"  # evaluates to a NameError inside the checker
#: limits of one tool call and of one run of BFCL's checker (honest calls take milliseconds)
TOOL_TIMEOUT_S, TOOL_MEMORY_MB = 10.0, 512
CHECK_TIMEOUT_S, CHECK_MEMORY_MB = 60.0, 2048
#: the most digits a MathAPI result may have: Python refuses to print a longer int (BFCL's executor
#: then reports exactly this error after computing it), and BFCL's ground truth asks for <= 10
MAX_DIGITS = 4300
_DIGITS_ERROR = f"Exceeds the limit ({MAX_DIGITS} digits) for integer string conversion; use sys.set_int_max_str_digits() to increase the limit"


def argument_error(call: ToolCall) -> str | None:
    """Why a MathAPI call's arguments would make a result too large to compute quickly (None if not)."""
    args = call.arguments
    if call.name in ("square_root", "logarithm"):
        precision = args.get("precision")
        if isinstance(precision, int) and precision > MAX_DIGITS:
            return f"precision must be at most {MAX_DIGITS} digits, got {precision}"
    if call.name == "power":
        base, exponent = args.get("base"), args.get("exponent")
        if isinstance(base, int) and isinstance(exponent, int) and abs(base) > 1 and exponent > 0:
            if exponent * math.log10(abs(base)) > MAX_DIGITS:
                return _DIGITS_ERROR
    return None


def observation(result: Any) -> str:
    """A tool's result as BFCL's executor shows it to the model."""
    if type(result) is str:
        return result
    if type(result) is dict:
        try:
            return json.dumps(result)
        except Exception:
            return str(result)
    return str(result)


def _bfcl():
    """BFCL's checker, executor module and backend table (one-line error when missing)."""
    try:
        from bfcl_eval.constants import executable_backend_config as config
        from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_checker as checker
        from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils as utils
    except ImportError as exc:
        raise KvleagueError(
            f"bfcl_multi_turn: the bfcl-eval simulators are not importable ({exc}); install them with: {INSTALL_HINT}"
        ) from None
    return checker, utils, config


@functools.lru_cache(maxsize=1)
def _bfcl_version() -> str | None:
    """The installed bfcl-eval version (scores are defined for :data:`BFCL_EVAL_VERSION`)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("bfcl-eval")
    except PackageNotFoundError:
        return None


def bfcl_data_dir(data_dir: Path | None) -> Path:
    """``<data-dir>/bfcl_v4`` when present, else the data folder of the installed bfcl_eval."""
    if data_dir is not None and (data_dir / LOCAL_DIR / QUESTIONS).is_file():
        return data_dir / LOCAL_DIR
    try:
        import bfcl_eval

        packaged = Path(bfcl_eval.__file__).parent / "data"
        if (packaged / QUESTIONS).is_file():
            return packaged
    except ImportError:
        pass
    expected = data_dir / LOCAL_DIR if data_dir is not None else f"<data-dir>/{LOCAL_DIR}"
    raise KvleagueError(
        f"dataset {SOURCE.dataset} not available: expected local copy at {expected} or the installed bfcl-eval "
        f"package's data (not on the Hugging Face Hub; get it from {SOURCE.url} or: {INSTALL_HINT})"
    )


def _warm() -> None:
    """Import BFCL's checker and every backend once in the limited-call helper (its children share them)."""
    _, _, config = _bfcl()
    for class_name in FUNC_DOC_FILES:
        importlib.import_module(config.CLASS_FILE_PATH_MAPPING[class_name])


def _call_tool(instances: dict[str, Any], class_name: str, name: str, arguments: dict[str, Any]):
    """One tool call on ``instances`` (in the limited child): its observation and the instances after it."""
    try:
        text = observation(getattr(instances[class_name], name)(**arguments))
    except Exception as exc:  # the backends raise on bad arguments; BFCL reports them the same way
        text = f"Error during execution: {exc}"
    return text, instances


class BfclEnvironment:
    """The involved BFCL backends of one entry, loaded with its initial configuration."""

    def __init__(self, entry: dict[str, Any]):
        _, _, config = _bfcl()
        self.instances: dict[str, Any] = {}
        for class_name in entry["involved_classes"]:
            module = importlib.import_module(config.CLASS_FILE_PATH_MAPPING[class_name])
            instance = getattr(module, class_name)()
            if class_name not in config.STATELESS_CLASSES:
                instance._load_scenario(copy.deepcopy(entry["initial_config"].get(class_name, {})), long_context=False)
            self.instances[class_name] = instance
        self.owner = {
            name: class_name
            for class_name, instance in self.instances.items()
            for name, _ in inspect.getmembers(instance, predicate=inspect.ismethod)
            if not name.startswith("_")
        }

    def execute(self, call: ToolCall) -> str:
        """The call's observation; it runs in a child under the tool limits and the instances it
        changed replace ours."""
        class_name = self.owner.get(call.name)
        if class_name is None:
            return f"Error during execution: name '{call.name}' is not defined"
        if (error := argument_error(call)) is not None:
            return f"Error during execution: {error}"

        try:
            text, self.instances = run_limited(
                _call_tool,
                (self.instances, class_name, call.name, call.arguments),
                TOOL_TIMEOUT_S,
                TOOL_MEMORY_MB,
                _warm,
            )
        except (CallFailed, LimitExceeded) as exc:
            return f"Error during execution: {exc}"
        return text

    def state(self) -> dict[str, Any]:
        return {
            name: {k: _jsonable(v) for k, v in vars(inst).items() if not k.startswith("_")}
            for name, inst in self.instances.items()
        }


def _jsonable(value: Any, depth: int = 0) -> Any:
    if depth > 12:
        return "..."
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_jsonable(v, depth + 1) for v in value]
    if hasattr(value, "__dict__"):  # file-system nodes: skip the back-pointer to the parent
        return {k: _jsonable(v, depth + 1) for k, v in vars(value).items() if k != "parent" and not k.startswith("_")}
    return str(value)


def bfcl_call_string(call: ToolCall, known: set[str]) -> str:
    """BFCL's textual form ``name(arg=value, ...)``, built only from a known tool name, identifier
    keywords and Python literals of the JSON values (so the checker's ``eval`` runs nothing else); a
    call :func:`argument_error` refuses becomes an unknown name (an error in the checker too)."""
    if call.name not in known or not call.name.isidentifier() or argument_error(call) is not None:
        return _UNKNOWN_TOOL
    parts = []
    for key, value in call.arguments.items():
        if not isinstance(key, str) or not key.isidentifier() or keyword.iskeyword(key):
            return _UNKNOWN_TOOL
        parts.append(f"{key}={value!r}")
    return f"{call.name}({', '.join(parts)})"


def parse_bfcl_call(text: str, signatures: dict[str, list[str]]) -> ToolCall:
    """A ground-truth call string (``"mv(source='a', destination='b')"``, positional arguments
    allowed) as a :class:`ToolCall`; positional arguments are named after the backend's signature."""
    node = ast.parse(text.strip(), mode="eval").body
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise KvleagueError(f"bfcl ground truth: not a plain call: {text!r}")
    name = node.func.id
    args: dict[str, Any] = {}
    params = signatures.get(name, [])
    for i, arg in enumerate(node.args):
        if i >= len(params):
            raise KvleagueError(f"bfcl ground truth: too many positional arguments in {text!r}")
        args[params[i]] = ast.literal_eval(arg)
    for kw in node.keywords:
        if kw.arg is None:
            raise KvleagueError(f"bfcl ground truth: **kwargs in {text!r}")
        args[kw.arg] = ast.literal_eval(kw.value)
    return ToolCall(name, args)


def _signatures(involved: Sequence[str]) -> dict[str, list[str]]:
    """Tool name -> parameter names, from the backend classes' own signatures."""
    return dict(_signatures_cached(tuple(involved)))


@functools.lru_cache(maxsize=64)
def _signatures_cached(involved: tuple[str, ...]) -> dict[str, list[str]]:
    _, _, config = _bfcl()
    out: dict[str, list[str]] = {}
    for class_name in involved:
        cls = getattr(importlib.import_module(config.CLASS_FILE_PATH_MAPPING[class_name]), class_name)
        for name, fn in inspect.getmembers(cls, predicate=inspect.isfunction):
            if not name.startswith("_"):
                out[name] = [p for p in inspect.signature(fn).parameters if p != "self"]
    return out


@register_task("bfcl_multi_turn")
@dataclass
class BfclMultiTurn(EpisodicTask):
    """BFCL v4 multi-turn base: tool use over 2-7 user turns against stateful simulated APIs."""

    max_steps_per_turn: int = 20

    source = SOURCE
    size = 200
    metric = "accuracy"
    scorer_version = f"1/bfcl-eval-{BFCL_EVAL_VERSION}"
    max_new_tokens = 512

    def __post_init__(self) -> None:
        if self.max_steps_per_turn < 1:
            raise ValueError(f"max_steps_per_turn: must be >= 1, got {self.max_steps_per_turn}")

    # -- data ---------------------------------------------------------------------------------------
    def load_records(self, data_dir: Path | None) -> list[Sample]:
        root = bfcl_data_dir(data_dir)
        answers = {a["id"]: a["ground_truth"] for a in iter_file(root / "possible_answer" / QUESTIONS)}
        docs: dict[str, list[dict[str, Any]]] = {}
        samples = []
        for entry in iter_file(root / QUESTIONS):
            involved = list(entry["involved_classes"])
            excluded = set(entry.get("excluded_function") or [])
            tools = []
            for class_name in involved:
                if class_name not in docs:
                    if class_name not in FUNC_DOC_FILES:
                        raise KvleagueError(
                            f"bfcl_multi_turn: entry {entry['id']} uses unsupported API class {class_name!r}; supported: {', '.join(FUNC_DOC_FILES)}"
                        )
                    docs[class_name] = list(iter_file(root / "multi_turn_func_doc" / FUNC_DOC_FILES[class_name]))
                tools.extend(d for d in docs[class_name] if d["name"] not in excluded)
            if entry["id"] not in answers:
                raise KvleagueError(
                    f"bfcl_multi_turn: no ground truth for {entry['id']} in {root / 'possible_answer' / QUESTIONS}"
                )
            samples.append(
                Sample(
                    sample_id=entry["id"],
                    task=self.name,
                    prompt=[dict(m) for m in entry["question"][0]],
                    reference={
                        "ground_truth": answers[entry["id"]],
                        "turns": entry["question"],
                        "initial_config": entry["initial_config"],
                        "involved_classes": involved,
                        "tools": tools,
                    },
                    metadata={"involved_classes": involved, "n_turns": len(entry["question"])},
                )
            )
        return samples

    # -- episode ------------------------------------------------------------------------------------
    def system_message(self, sample: Sample) -> str:
        return tools_system_prompt(PREAMBLE, sample.reference["tools"])

    def user_turns(self, sample: Sample) -> list[list[dict[str, Any]]]:
        return [[dict(m) for m in turn] for turn in sample.reference["turns"]]

    def make_environment(self, sample: Sample) -> BfclEnvironment:
        return BfclEnvironment(self._entry(sample))

    @staticmethod
    def _entry(sample: Sample) -> dict[str, Any]:
        ref = sample.reference
        return {
            "id": sample.sample_id,
            "initial_config": ref["initial_config"],
            "involved_classes": ref["involved_classes"],
        }

    # -- scoring ------------------------------------------------------------------------------------
    def score_transcript(self, sample: Sample, transcript: Transcript) -> ScoreResult:
        checker, _, _ = _bfcl()
        ground_truth = sample.reference["ground_truth"]
        known = set(_signatures(sample.reference["involved_classes"]))
        decoded = [[[bfcl_call_string(c, known) for c in step] for step in turn if step] for turn in transcript.calls()]
        details: dict[str, Any] = {
            "decoded_calls": decoded,
            "n_calls": sum(len(s) for t in decoded for s in t),
            "bfcl_eval_version": _bfcl_version(),
        }
        if transcript.terminated or len(transcript.turns) != len(ground_truth):
            details.update(
                error_type="multi_turn:force_terminated",
                error_message=f"episode ended after {len(transcript.turns)} of {len(ground_truth)} turns ({transcript.terminated or 'incomplete'})",
            )
            return ScoreResult(False, 0.0, json.dumps(decoded), details)
        verdict = _run_checker(checker, decoded, ground_truth, self._entry(sample))
        details["error_type"] = verdict.get("error_type")
        details["error_message"] = verdict.get("error_message")
        if (text := verdict.get("details")) is not None:
            details["checker_details"] = json.loads(text) if len(text) <= 4000 else text[:4000] + "...(truncated)"
        return ScoreResult(bool(verdict["valid"]), 1.0 if verdict["valid"] else 0.0, json.dumps(decoded), details)

    # -- gold ---------------------------------------------------------------------------------------
    def reference_agent(self, sample: Sample):
        """Replays the ground-truth calls, one step per call, then each turn's closing text."""
        steps = iter([s for turn in self.gold_transcript(sample).turns for s in turn])
        return lambda context: next(steps)

    def gold_transcript(self, sample: Sample, one_call_per_step: bool = True) -> Transcript:
        """The ground-truth calls written in kvleague's tool-call format, one step per call and a
        closing plain-text step per turn (what a perfect agent's episode looks like)."""
        sigs = _signatures(sample.reference["involved_classes"])
        turns = []
        for turn in sample.reference["ground_truth"]:
            calls = [parse_bfcl_call(c, sigs) for c in turn]
            if one_call_per_step:
                steps = [format_tool_call(c.name, c.arguments) for c in calls]
            else:
                steps = ["\n".join(format_tool_call(c.name, c.arguments) for c in calls)] if calls else []
            turns.append([*steps, "Done."])
        return Transcript(turns=turns)


def _run_checker(checker, decoded, ground_truth, entry) -> dict[str, Any]:
    """:func:`_check` in a child under the checker's limits (it replays every call)."""
    try:
        return run_limited(_check, (decoded, ground_truth, entry), CHECK_TIMEOUT_S, CHECK_MEMORY_MB, _warm)
    except (CallFailed, LimitExceeded) as exc:
        return {"valid": False, "error_type": "multi_turn:checker_limit", "error_message": str(exc)}


def _check(decoded, ground_truth, entry) -> dict[str, Any]:
    """BFCL's ``multi_turn_checker`` (in the limited child, so the backend instances it caches in its
    module globals go with it): the verdict and what differed, not the whole backend states."""
    checker, _, _ = _bfcl()
    try:
        verdict = checker.multi_turn_checker(decoded, ground_truth, entry, "multi_turn_base", "kvleague")
    except Exception as exc:  # an assertion inside the checker: count as a failure, say why
        return {
            "valid": False,
            "error_type": "multi_turn:checker_error",
            "error_message": f"{type(exc).__name__}: {exc}",
        }
    out = {k: verdict.get(k) for k in ("valid", "error_type", "error_message")}
    if not verdict["valid"] and isinstance(verdict.get("details"), dict):
        kept = {k: v for k, v in verdict["details"].items() if k in ("differences", "missing_items")}
        out["details"] = json.dumps(_jsonable(kept), default=str)
    return out
