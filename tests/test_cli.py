"""The command line: plugins through entry points, and one-line errors for bad input."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from kvleague.cli import main

PLUGIN = textwrap.dedent(
    '''
    from dataclasses import dataclass

    import torch

    from kvleague.methods import EvictionMethod


    @dataclass
    class NewestOnly(EvictionMethod):
        """Keeps the newest tokens: score = absolute position."""

        bonus: float = 0.0

        def score(self, cache):
            return cache.token_positions.float() + self.bonus
    '''
)


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory):
    """A throwaway package, pip-installed into its own target dir, registering `newest_only`."""
    src = tmp_path_factory.mktemp("plugin-src")
    (src / "kvl_plugin_demo.py").write_text(PLUGIN)
    (src / "pyproject.toml").write_text(
        textwrap.dedent(
            """
            [build-system]
            requires = ["setuptools"]
            build-backend = "setuptools.build_meta"
            [project]
            name = "kvl-plugin-demo"
            version = "0.0.1"
            [project.entry-points."kvleague.methods"]
            newest_only = "kvl_plugin_demo:NewestOnly"
            [tool.setuptools]
            py-modules = ["kvl_plugin_demo"]
            """
        )
    )
    target = tmp_path_factory.mktemp("plugin-site")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(src),
        ],
        check=True,
        timeout=300,
    )
    return target


def run_cli(*args, pythonpath=None, timeout=180):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    if pythonpath:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run(
        [sys.executable, "-m", "kvleague.cli", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


@pytest.mark.slow  # the slow tier (KVLEAGUE_SLOW=1 bash scripts/test.sh)
def test_plugin_method_is_listed_and_runs(plugin_path, tiny_models):
    listed = run_cli("methods", "--json", pythonpath=plugin_path)
    assert listed.returncode == 0, listed.stderr
    by_name = {m["name"]: m for m in json.loads(listed.stdout)}
    assert {"full", "streaming_llm", "random", "knorm", "newest_only"} <= set(by_name)
    assert by_name["newest_only"]["hyperparameters"] == [{"name": "bonus", "type": "float", "default": 0.0}]

    out = run_cli(
        "generate",
        "--model",
        str(tiny_models["llama"]),
        "--method",
        "newest_only",
        "--param",
        "bonus=1.5",
        "--budget",
        "24",
        "--prompt",
        "a plugin evicts " * 4,
        "--max-new-tokens",
        "12",
        "--json",
        pythonpath=plugin_path,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["method"] == "newest_only" and result["params"] == {"bonus": 1.5}
    newest = result["prompt_tokens"] + 12 - 2
    assert result["kept_positions"][0] == list(range(newest - 23, newest + 1))  # newest-first really ran


def test_methods_lists_hyperparameters_and_needs(capsys):
    assert main(["methods"]) == 0
    text = capsys.readouterr().out
    assert "streaming_llm" in text and "n_sink: int = 4" in text


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--method", "nope"], "method: unknown 'nope'; valid names: "),
        (["--method", "streaming_llm", "--param", "window=3"], "unknown hyperparameter 'window'; valid: n_sink"),
        (["--method", "streaming_llm", "--param", "n_sink=abc"], "hyperparameter n_sink='abc'"),
        (["--method", "streaming_llm", "--param", "n_sink=-1"], "n_sink must be >= 0"),
        (
            ["--method", "knorm", "--sink", "8", "--recent", "8", "--budget", "16"],
            "budget: 16 leaves no evictable slot",
        ),
        (
            ["--method", "knorm", "--cadence", "sometimes"],
            "cadence: unknown 'sometimes'; allowed: every_step, buffer=N",
        ),
        (
            ["--method", "knorm", "--model", "/no/such/dir"],
            "model: no checkpoint directory or .gguf file at '/no/such/dir'",
        ),
        (["--method", "knorm", "--budget", "x"], "argument --budget: invalid int value"),
    ],
)
def test_bad_input_is_one_line_exit_2(capsys, tiny_models, args, fragment):
    # argparse keeps the last occurrence of an option, so each case overrides these defaults
    argv = ["generate", "--model", str(tiny_models["qwen2"]), "--budget", "32", "--prompt", "hello", *args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert fragment in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_console_script_exit_code_without_traceback():
    proc = run_cli("generate", "--model", "/no/such/dir", "--method", "full", "--budget", "8", "--prompt", "x")
    assert proc.returncode == 2
    assert (
        proc.stderr.strip()
        == "kvleague: error: model: no checkpoint directory or .gguf file at '/no/such/dir' (known names: smollm2-135m)"
    )


README_CHECK = textwrap.dedent(
    """
    import sys, torch
    from transformers import DynamicCache
    from kvleague.methods import build_method
    from kvleague.runner.models import load_engine
    from kvleague.engine.protocol import Protocol
    import value_norm  # the README's example, registered on import

    engine = load_engine(sys.argv[1])
    ids = list(range(40, 120))
    with engine.session(build_method("value_norm", {"p": 1}), 30, Protocol()) as session:
        session.feed(ids)
        kept = session.cache.positions
    full = DynamicCache(config=engine.model.config)
    with torch.no_grad():
        engine.model(torch.tensor([ids]), past_key_values=full, use_cache=True)
    for layer, positions in zip(full.layers, kept):
        top = layer.values[0].float().abs().sum(-1).topk(30, dim=-1).indices.sort(-1).values
        assert torch.equal(top, positions.sort(-1).values), (top, positions)
    print("ok")
    """
)


def test_readme_method_example_runs(tmp_path, tiny_models):
    from tests.conftest import REPO

    readme = (REPO / "README.md").read_text()
    example = readme.split("```python\n", 1)[1].split("```", 1)[0]
    (tmp_path / "value_norm.py").write_text(example)
    (tmp_path / "check.py").write_text(README_CHECK)
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "check.py"), str(tiny_models["qwen3"])],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_every_protocol_field_is_a_flag_and_a_model_arg():
    """The protocol's flags, the sweep YAML's protocol and lm-eval's model_args come from one field list:
    each field set by its flag gives the Protocol with that field, and text values parse the same way."""
    from kvleague.cli import build_parser
    from kvleague.engine.protocol import Protocol, protocol_fields
    from kvleague.runner.cli_args import protocol_from_args
    from kvleague.runner.sweep_config import ProtocolConfig, ProtocolOverride

    given = {
        "cadence": "buffer=8",
        "positions": "compact",
        "sink": "4",
        "recent": "16",
        "protect_prompt": "true",
        "prefill_chunk": "32",
        "recent_max_fraction": "0.25",
        "prompt_over_budget": "keep",
        "budget_base": "prompt",
        "scope": "context",
        "query_aware": "true",
    }
    assert (
        set(given)
        == {f.name for f in protocol_fields()}
        == set(ProtocolConfig.model_fields)
        == set(ProtocolOverride.model_fields)
    )
    expected = Protocol(
        cadence="buffer=8",
        positions="compact",
        sink=4,
        recent=16,
        protect_prompt=True,
        prefill_chunk=32,
        recent_max_fraction=0.25,
        prompt_over_budget="keep",
        budget_base="prompt",
        scope="context",
        query_aware=True,
    )
    argv = ["generate", "--method", "full", "--budget", "64", "--prompt", "x"]
    for name, value in given.items():
        flag = "--" + name.replace("_", "-")
        argv += [flag] if name in ("protect_prompt", "query_aware") else [flag, value]
    assert protocol_from_args(build_parser().parse_args(argv)) == expected
    assert Protocol.from_text(given) == expected
    assert Protocol(**ProtocolConfig.model_validate({k: v for k, v in given.items()}).model_dump()) == expected
    assert Protocol.from_text({"prefill_chunk": "None", "protect_prompt": "0"}) == Protocol()


#: modules that take seconds to import; the parser and its errors must not need them
HEAVY_MODULES = ("torch", "transformers", "ray", "streamlit", "pandas", "matplotlib", "sqlalchemy", "sklearn")

IMPORT_CHECK = textwrap.dedent(
    """
    import argparse, contextlib, io, json, sys
    from kvleague.cli import build_parser, main

    def subcommands(parser, prefix=()):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield (*prefix, name)
                    yield from subcommands(sub, (*prefix, name))

    codes = {}
    for argv in [["--help"], *([*c, "--help"] for c in subcommands(build_parser())), ["generate", "--budget", "x"], ["nope"]]:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            try:
                codes[" ".join(argv)] = main(argv)
            except SystemExit as exc:
                codes[" ".join(argv)] = exc.code
    print(json.dumps({"codes": codes, "loaded": sorted(m for m in sys.argv[1:] if m in sys.modules)}))
    """
)


def test_help_and_argument_errors_import_no_heavy_library():
    """`kvleague --help`, every subcommand's --help and an argument error answer from the parser alone:
    none of them imports torch, transformers, Ray, Streamlit, pandas, matplotlib or SQLAlchemy (each
    command imports what it needs when it runs), which keeps them well under a second."""
    proc = subprocess.run(
        [sys.executable, "-c", IMPORT_CHECK, *HEAVY_MODULES],
        capture_output=True,
        text=True,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    assert result["loaded"] == [], result["loaded"]
    codes = result["codes"]
    assert {"--help", "bench batch --help", "db import --help", "signals --help"} <= set(codes), sorted(codes)
    assert codes.pop("generate --budget x") == 2 and codes.pop("nope") == 2
    assert set(codes.values()) == {0}, codes


@pytest.fixture(scope="module")
def short_context_model(tiny_models, tmp_path_factory):
    """The tiny qwen2 checkpoint with a context of 256 positions (max_position_embeddings)."""
    import shutil

    path = tmp_path_factory.mktemp("short-context") / "qwen2"
    shutil.copytree(tiny_models["qwen2"], path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 256}))
    return path


@pytest.mark.parametrize(
    "args,message",
    [
        (["--prompt", ""], "--prompt: the prompt is empty; give the text the model should continue"),
        (["--prompt", "  \n "], "--prompt: the prompt is empty; give the text the model should continue"),
        ([], "generate: give one of --prompt TEXT or --prompt-file FILE"),
        (["--prompt", "x", "--prompt-file", "f.txt"], "generate: give one of --prompt TEXT or --prompt-file FILE"),
        (
            ["--prompt-file", "/no/such/file.txt"],
            "--prompt-file: cannot read '/no/such/file.txt' as UTF-8 text: FileNotFoundError",
        ),
        (
            ["--prompt", "x" * 400],
            "--prompt: the prompt is 400 tokens and --max-new-tokens 8, past the model's context of 256 "
            "tokens (max_position_embeddings); shorten the prompt or --max-new-tokens",
        ),
        (
            ["--prompt", "x" * 250, "--max-new-tokens", "20"],
            "--prompt: the prompt is 250 tokens and --max-new-tokens 20, past the model's context of 256 tokens",
        ),
    ],
)
def test_bad_prompts_are_one_line_exit_2(short_context_model, capsys, args, message):
    """The byte-level tokenizer makes one token per character, so the token counts above are exact."""
    argv = [
        "generate",
        "--model",
        str(short_context_model),
        "--method",
        "streaming_llm",
        "--budget",
        "64",
        "--chat",
        "off",
        "--max-new-tokens",
        "8",
        *args,
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvleague: error: {message}"), err
    assert err.count("\n") == 1


def test_prompt_file_and_compact_positions_past_the_context(short_context_model, tmp_path, capsys):
    """--prompt-file gives the same completion as --prompt; past the context under compact positions
    (no position above the budget) the run goes ahead with a one-line warning, and reports progress."""
    text = "The quick brown fox jumps over the lazy dog. " * 3
    (tmp_path / "p.txt").write_text(text, encoding="utf-8")
    base = [
        "generate",
        "--model",
        str(short_context_model),
        "--method",
        "streaming_llm",
        "--budget",
        "64",
        "--chat",
        "off",
        "--max-new-tokens",
        "8",
        "--json",
    ]
    assert main([*base, "--prompt", text]) == 0
    direct = json.loads(capsys.readouterr().out)
    assert main([*base, "--prompt-file", str(tmp_path / "p.txt")]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == direct["token_ids"]
    long = "x" * 400
    assert (
        main(
            [
                "generate",
                "--model",
                str(short_context_model),
                "--method",
                "streaming_llm",
                "--budget",
                "64",
                "--chat",
                "off",
                "--max-new-tokens",
                "8",
                "--positions",
                "compact",
                "--prompt",
                long,
            ]
        )
        == 0
    )
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(
        "kvleague generate: warning: the prompt is 400 tokens and --max-new-tokens 8, past the model's "
        "context of 256 tokens"
    ), err
    assert err[1] == "kvleague generate: prefill of 400 prompt tokens under budget 64"
    assert err[2].startswith("kvleague generate: prefill done in ") and err[2].endswith("decoding up to 8 tokens")


class _Writes:
    """A stdout that notes how many tokens the engine had chosen when each piece of text arrived."""

    def __init__(self, chosen):
        self.chosen, self.pieces = chosen, []

    def write(self, text):
        self.pieces.append((len(self.chosen), text))

    def flush(self):
        pass


@pytest.mark.parametrize("stop", [False, True])
def test_generate_streams_the_completion_as_it_is_decoded(tiny_models, capsys, monkeypatch, stop):
    """Without --json the completion reaches stdout while decoding runs, and the streamed text is the
    completion --json reports (ending before a stop string, none of which is streamed)."""
    from kvleague.engine.generation import Session

    base = [
        "generate",
        "--model",
        str(tiny_models["qwen2"]),
        "--method",
        "streaming_llm",
        "--budget",
        "32",
        "--chat",
        "off",
        "--prompt",
        "the cache keeps " * 6,
        "--max-new-tokens",
        "40",
    ]
    assert main([*base, "--json"]) == 0
    whole = json.loads(capsys.readouterr().out)
    extra, expected = [], whole["completion"]
    if stop:  # a stop string from the middle of the unstopped completion
        text = whole["completion"]
        cut = next(i for i in range(len(text) // 2, len(text)) if not text[i].isspace())
        stop_string = text[cut : cut + 2]
        extra, expected = ["--stop", stop_string], text[: text.find(stop_string)]
        assert main([*base, *extra, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["completion"] == expected
    assert len(expected) > 4

    chosen = []
    decode = Session.decode

    def counting_decode(self, settings, on_token=None):
        def seen(token):
            chosen.append(token)
            if on_token is not None:
                on_token(token)

        return decode(self, settings, on_token=seen)

    monkeypatch.setattr(Session, "decode", counting_decode)
    out = _Writes(chosen)
    monkeypatch.setattr(sys, "stdout", out)
    assert main([*base, *extra]) == 0
    assert "".join(t for _, t in out.pieces) == expected + "\n"
    assert out.pieces[0][0] < len(chosen) // 2  # the first text came with the first tokens, not at the end
