"""``kvleague-lm-eval`` (also ``python -m kvleague.runner.lm_eval_cli``): lm-eval's own command line, with
the ``kvleague`` model registered (``runner/lm_eval_model.py``), and three things a newcomer trips on
made plain (issue 50):

* the device: lm-eval's default is ``cuda:0``; without ``--device`` kvleague's ``auto`` is used (CUDA
  where there is one, else the CPU, with no warning; an explicit ``--device cuda`` without CUDA warns);
* a Hub that cannot be reached: found before anything is imported (one connection attempt), so the
  Hugging Face libraries start offline and read their local cache instead of retrying for ~30 s;
* a task whose data is not there: one line naming it and how to give lm-eval a local copy, exit 2,
  instead of datasets' traceback.
"""

from __future__ import annotations

import os
import socket
import sys
from urllib.parse import urlparse

PROG = "kvleague-lm-eval"
OFFLINE = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
LOCAL_COPY = (
    "lm-eval reads a task's data from the Hugging Face Hub; without it, fill a datasets cache where the Hub "
    "is reachable and run with HF_HOME (or HF_DATASETS_CACHE) pointing at it and HF_HUB_OFFLINE=1 "
    "HF_DATASETS_OFFLINE=1, or give the task a local dataset_path in a task YAML of your own (--include_path DIR)"
)


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the Hub (``HF_ENDPOINT``, default huggingface.co) opens."""
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    try:
        socket.create_connection((url.hostname or "", url.port or 443), timeout=timeout).close()
    except OSError:
        return False
    return True


def with_device(argv: list[str]) -> list[str]:
    """``argv`` with ``--device auto`` when a ``run`` names none (lm-eval's default is ``cuda:0``)."""
    if argv[:1] == ["run"] and not any(a == "--device" or a.startswith("--device=") for a in argv):
        return [*argv, "--device", "auto"]
    return argv


def data_unreachable(exc: BaseException) -> str | None:
    """The one line for an exception that says the Hub (or its local cache) has no copy, else None."""
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

    if not isinstance(exc, (ConnectionError, LocalEntryNotFoundError, OfflineModeIsEnabled)):
        return None
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return f"{PROG}: error: data not reachable ({first}); {LOCAL_COPY}"


def main(argv: list[str] | None = None) -> int:
    argv = with_device(list(sys.argv[1:] if argv is None else argv))
    if not any(os.environ.get(name, "").lower() in ("1", "true", "yes") for name in OFFLINE) and not hub_reachable():
        os.environ.update(dict.fromkeys(OFFLINE, "1"))  # before the Hugging Face libraries read them
    from lm_eval.__main__ import cli_evaluate

    import kvleague.runner.lm_eval_model  # noqa: F401 - registers the kvleague model

    sys.argv = [PROG, *argv]
    try:
        cli_evaluate()
    except Exception as exc:
        line = data_unreachable(exc)
        if line is None:
            raise
        print(line, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
