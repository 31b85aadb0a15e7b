"""The sweep's progress: a rich bar on a terminal, heartbeat lines in a log."""

from __future__ import annotations

import sys
import time


class Progress:
    """A rich progress bar on a terminal; otherwise (a log, ``--no-progress``) a heartbeat line every
    ``every`` seconds (60 s with ``bar=False``), so a long sweep in a log is never silent."""

    def __init__(self, total: int, label: str, bar: bool = True, every: float = 10.0):
        self.total, self.label = total, label
        self.every = every if bar else max(every, 60.0)
        self.done = self.failed = 0
        self.start = time.monotonic()
        self.last_line = self.start
        self.bar = None
        if bar and sys.stdout.isatty() and total:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeRemainingColumn,
            )
            from rich.progress import (
                Progress as RichProgress,
            )

            self.bar = RichProgress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("failed {task.fields[failed]}"),
                TimeRemainingColumn(),
            )
            self.bar.start()
            self.task_id = self.bar.add_task(label, total=total, failed=0)

    def eta(self) -> float | None:
        elapsed = time.monotonic() - self.start
        if not self.done or elapsed <= 0:
            return None
        return (self.total - self.done) * elapsed / self.done

    def line(self) -> str:
        eta = self.eta()
        eta_text = "?" if eta is None else f"{eta:.0f}s"
        rate = self.done / max(1e-9, time.monotonic() - self.start)
        return f"[{self.label}] {self.done}/{self.total} cells done, {self.failed} failed, {rate:.2f} cells/s, ETA {eta_text}"

    def update(self, done: int, failed: int) -> None:
        """Called about once a second by the dispatch loop, whether or not a cell finished."""
        self.done, self.failed = done, failed
        if self.bar is not None:
            self.bar.update(self.task_id, completed=done, failed=failed)
        elif time.monotonic() - self.last_line >= self.every:
            self.last_line = time.monotonic()
            print(self.line(), flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
        else:
            print(self.line(), flush=True)
