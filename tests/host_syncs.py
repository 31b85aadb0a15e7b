"""A spy for what a CUDA graph cannot hold, usable on the CPU.

A CUDA graph records device work only: an op that makes the host wait for the device's result
(``.item()``, ``bool(t)``, ``.tolist()``, data-dependent shapes such as ``nonzero`` or a boolean
index) fails inside a capture or freezes the value seen at capture time, and a tensor built from
host data (``torch.tensor([...])``) is copied in once, at capture, never again. On CUDA such ops
only show as an error at capture or as wrong tokens on replay; this spy names them on any device,
so a step's body is checked capture-safe without a GPU. It sees every ATen op (a dispatch mode)
and the tensor methods that leave for the host (a function mode).
"""

from __future__ import annotations

import traceback
from functools import lru_cache
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from kvleague.runner.bench.step_ops import HOST_READS

#: ATen ops that read a device value on the host, or whose output shape depends on device values, and
#: building a tensor from host data (``lift_fresh``: copied in once, at capture)
_SYNCING = HOST_READS | {"lift_fresh"}
#: tensor methods that hand data to the host
_TO_HOST = {"tolist", "numpy", "cpu"}


class HostSyncs:
    """``with HostSyncs() as spy: ...``; ``spy.found``: one ``(op, where)`` per offending call, ``where``
    the innermost frame of this repository's code that made it."""

    def __init__(self) -> None:
        self.found: list[tuple[str, str]] = []
        self._modes = (_Functions(self), _Dispatch(self))

    def __enter__(self) -> HostSyncs:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    def note(self, op: str) -> None:
        frames = [f for f in traceback.extract_stack() if f.filename != __file__ and is_repository_code(f.filename)]
        where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
        self.found.append((op, where))


#: the repository's own code: the package's folders and the tests, found from where this file is (a
#: folder's name in a path says nothing: a clone may be called ``kvleague`` and hold its venv inside)
REPO = Path(__file__).resolve().parents[1]
OWN_DIRS = tuple(
    REPO / d for d in ("engine", "methods", "tasks", "db", "analysis", "runner", "dashboard", "kvleague", "tests")
)


@lru_cache(maxsize=4096)
def is_repository_code(filename: str) -> bool:
    """Whether ``filename`` (a frame's) is a file of this repository's code, links resolved."""
    path = Path(filename).resolve()
    return any(path.is_relative_to(d) for d in OWN_DIRS)


class _Dispatch(TorchDispatchMode):
    def __init__(self, spy: HostSyncs):
        super().__init__()
        self.spy = spy

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in _SYNCING:
            self.spy.note(f"aten.{name}")
        elif name in ("index", "index_put", "index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ()) or ()
        ):
            self.spy.note(f"aten.{name} (boolean index)")
        return func(*args, **(kwargs or {}))


class _Functions(TorchFunctionMode):
    def __init__(self, spy: HostSyncs):
        super().__init__()
        self.spy = spy

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in _TO_HOST:
            self.spy.note(f"Tensor.{func.__name__}")
        return func(*args, **(kwargs or {}))
