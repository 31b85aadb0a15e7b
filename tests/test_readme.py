"""Every command README.md shows runs as written (issue 50): its code blocks and its inline
``kvleague ...`` commands are extracted, and each is run, or, where running it is minutes of work, checked
for what can be checked fast (its arguments parse, its files exist and parse), the reason listed below.
A command README gains that this file does not know fails the test until it is classified here."""

from __future__ import annotations

import importlib
import json
import re
import shlex
import subprocess
import sys

import pytest
import yaml

from tests.conftest import REPO

README = (REPO / "README.md").read_text(encoding="utf-8")

#: commands checked without being run, and why (the check: their arguments parse / the file is valid)
NOT_RUN = {
    "bash scripts/demo.sh": "set-up and the ~10-minute demo sweep: the script's syntax is checked",
    "bash scripts/test.sh": "the whole suite, which runs this test: the script's syntax is checked",
    "bash scripts/gpu_check.sh": "needs a GPU (or ~minutes dry-run on a CPU): the script's syntax is checked",
    ". .venv/bin/activate": "the shell's set-up",
    "pre-commit install": "installs a git hook",
    "kvleague sweep": "the demo sweep is minutes of Ray work: its arguments parse and its config validates",
    "kvleague dashboard": "serves until stopped: its arguments parse",
    "kvleague report": "minutes on the demo's database: its arguments parse",
    "ray up": "starts cloud machines: ray_cluster.yaml parses",
    "ray job submit": "needs a Ray cluster: runner/sweep.py --help runs and the config parses",
}


def code_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def shell_commands() -> list[str]:
    """The commands of README's bash blocks (continuation lines joined, comments dropped), then its
    inline ones (`` `kvleague ...` ``, `` `ray ...` ``, `` `bash ...` ``) outside code blocks."""
    commands = []
    for block in code_blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                commands.append(" ".join(line.split()))
    # the map of the code ("Where things are") names commands, it does not run them
    prose = re.sub(r"```.*?```", "", README.split("## Where things are")[0], flags=re.S)
    for span in re.findall(r"`([^`\n]+)`", prose):
        if re.match(r"(kvleague|ray|bash|python|pre-commit) ", span):
            commands.append(span)
    return commands


def kind(command: str) -> str:
    for prefix in NOT_RUN:
        if command.startswith(prefix):
            return prefix
    return "run"


def test_every_readme_command_is_known():
    unknown = [
        c
        for c in shell_commands()
        if kind(c) == "run" and not re.match(r"kvleague (methods|make-tiny-model|generate|tasks)", c)
    ]
    assert not unknown, f"README commands this test neither runs nor checks: {unknown}"


def test_readme_commands_run(tmp_path, capsys, monkeypatch):
    """The fast commands run in-process; the default model is the tiny one (its conversion is ~18 s),
    and the value_norm example runs the method README's Python block defines."""
    from kvleague.cli import build_parser, main
    from kvleague.methods.registry import METHODS, describe
    from kvleague.runner.sweep_config import load_config

    tiny = tmp_path / "tiny"
    # README's value_norm, in the file its first line names, imported as a plugin's module would be
    source = code_blocks("python")[0]
    path = tmp_path / source.splitlines()[0].removeprefix("# ")
    path.parent.mkdir()
    path.write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module(f"{path.parent.name}.{path.stem}")
    try:
        assert describe(module.ValueNorm)["name"] == "value_norm"
        generated = []
        for command in shell_commands():
            argv = shlex.split(command.replace("/tmp/tiny", str(tiny)))
            if kind(command) != "run":
                checked = check_without_running(kind(command), argv, build_parser, load_config)
                assert checked, command
                continue
            argv = argv[1:]
            if argv[0] == "generate" and "--model" not in argv:
                argv += ["--model", str(tiny)]
            capsys.readouterr()
            assert main(argv) == 0, command
            out = capsys.readouterr().out
            if argv[0] == "methods":  # the comment "the cache alone" is what it says of value_norm
                line = out.split("value_norm", 1)[1].split("\n")[2]
                assert line.split("needs: ")[1] == "cache only", line
            if argv[0] == "generate":
                generated.append((argv, out))
        assert len(generated) == 3
        argv, out = next((a, o) for a, o in generated if "--json" in a)
        result = json.loads(out)
        budget = int(argv[argv.index("--budget") + 1])
        # the tiny example shows eviction: more tokens pass through the cache than it holds
        assert result["prompt_tokens"] + result["generated_tokens"] > budget
        assert result["evictions"] > 0 and {len(kept) for kept in result["kept_positions"]} == {budget}
    finally:
        METHODS.classes.pop("value_norm", None)
        sys.modules.pop(module.__name__)


def check_without_running(prefix: str, argv: list[str], build_parser, load_config) -> bool:
    if prefix.startswith("bash"):
        assert (REPO / argv[1]).is_file(), argv
        subprocess.run(["bash", "-n", str(REPO / argv[1])], check=True)
    elif prefix.startswith("kvleague"):
        args = build_parser().parse_args(argv[1:])
        if prefix == "kvleague sweep":
            load_config(REPO / args.config)
    elif prefix == "ray up":
        assert yaml.safe_load((REPO / argv[2]).read_text())["cluster_name"]
    elif prefix == "ray job submit":
        script = argv[argv.index("--") + 2]
        config = argv[argv.index("--config") + 1]
        load_config(REPO / config)
        done = subprocess.run([sys.executable, str(REPO / script), "--help"], capture_output=True, text=True)
        assert done.returncode == 0 and "--config" in done.stdout, done.stderr
    return True


def test_browser_help_names_its_module():
    done = subprocess.run(
        [sys.executable, "-m", "kvleague.dashboard.browser", "--help"], capture_output=True, text=True, cwd=REPO
    )
    assert done.returncode == 0
    assert done.stdout.startswith("usage: python -m kvleague.dashboard.browser"), done.stdout


@pytest.mark.parametrize("command", sorted(NOT_RUN))
def test_not_run_commands_are_in_readme(command):
    """The list above stays the README's: a command that left it leaves the list."""
    assert command in README
