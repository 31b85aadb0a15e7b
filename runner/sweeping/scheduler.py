"""Cells on Ray: one actor per GPU (or per ``cpus_per_worker`` CPUs without GPUs), each a
:class:`~runner.sweeping.cell.CellWorker` that keeps the model it loaded and serves many cells.

Ray's own fault tolerance does the recovery it can: an actor that dies is restarted
(``resources.max_restarts``) and its calls retried (``max_task_retries``). What reaches the driver is
a call whose retries are spent or an actor gone for good: that cell goes back to the queue (stored as
failed after ``max_cell_attempts``) and a fresh actor takes the slot. A cell that runs past
``cell_timeout_seconds`` cannot be cancelled (Ray cancels only queued actor calls): it is stored as
failed and its actor killed and replaced.

Groups go out breadth first (each to the worker with the fewest calls), so every worker has one before
any has a second in its pipeline; a worker that runs dry while the queue is empty takes over a group
still waiting behind another worker's running one. That call is cancelled, which Ray honours only when
the actor reaches it (it is then skipped), so the group is sent to the idle worker at once and the
cancelled call's outcome is never read.
"""

from __future__ import annotations

import collections
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from kvleague.engine.errors import KvleagueError
from kvleague.runner.sweeping import ray_output
from kvleague.runner.sweeping.cell import CellWorker, error_text
from kvleague.runner.sweeping.grid import Cell, spread

#: environment variables a worker gets from the driver (offline mode, caches, data)
FORWARDED_ENV = (
    "HF_HUB_OFFLINE",
    "HF_HOME",
    "HF_DATASETS_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "KVLEAGUE_DATA_DIR",
    "TOKENIZERS_PARALLELISM",
)
LOCAL_OBJECT_STORE_BYTES = 300 * 1024**2


def is_loopback_address(address: str) -> bool:
    host = address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "127.0.0.1", "::1") or host.startswith("127.")


def use_loopback() -> None:
    """Keep Ray on 127.0.0.1. Without this Ray rewrites a 127.0.0.1 head address to the machine's
    network address (and binds there when starting locally); the switch is read once, when ray is
    imported, hence the module attribute too."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:
        setattr(constants, "ENABLE_RAY_CLUSTER", False)  # noqa: B010  # a module attribute ray reads


def ray_exceptions():
    """(the errors of a call whose actor or node died, the error of a call that raised)"""
    import ray.exceptions as rex

    died = tuple(
        getattr(rex, name)
        for name in (
            "RayActorError",
            "ActorDiedError",
            "ActorUnavailableError",
            "WorkerCrashedError",
            "NodeDiedError",
            "ObjectLostError",
            "OwnerDiedError",
        )
        if hasattr(rex, name)
    )
    return died, rex.RayTaskError


class Scheduler:
    """Starts (or joins) Ray, keeps a pool of cell actors busy, and hands every finished row to ``record``."""

    def __init__(
        self,
        resources,
        *,
        ray_address: str | None = None,
        workers: int | None = None,
        inject_failures: list[dict[str, Any]] | None = None,
        git: tuple[str, bool | None] = ("unknown", None),
    ):
        self.res = resources
        self.ray_address = ray_address
        self.workers_override = workers
        self.inject_failures = inject_failures or []
        self.git = git
        self.actors: list[Any] = []
        self.replacements = 0
        self.started_ray = False

    # -- ray ------------------------------------------------------------------------------------

    def init_ray(self) -> None:
        address = self.ray_address or os.environ.get("RAY_ADDRESS")
        if not address or address == "local" or is_loopback_address(address):
            use_loopback()  # before ray is imported, where possible
        if not address or address == "local":
            os.environ.setdefault("RAY_AUTH_MODE", "token")  # what Ray picks anyway, without its warning
        import ray

        ray_output.quiet_unhandled_errors()
        if ray.is_initialized():
            ray_output.install()
            return
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        quiet = {"logging_level": "WARNING", "log_to_driver": True}
        if address and address != "local":
            try:
                ray.init(address=address, **quiet)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise KvleagueError(
                    f"ray: cannot connect to {address!r}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
                ) from None
        else:
            ray.init(
                address="local",
                num_cpus=os.cpu_count() or 1,
                object_store_memory=LOCAL_OBJECT_STORE_BYTES,
                include_dashboard=False,
                _node_ip_address="127.0.0.1",
                **quiet,
            )
        self.started_ray = True
        ray_output.install()

    def plan_workers(self, pending: int) -> tuple[int, float, float]:
        """(actors, CPUs each, GPUs each) for ``pending`` cells on this cluster."""
        import ray

        res = self.res
        resources = ray.cluster_resources()
        gpus = float(resources.get("GPU", 0))
        cpus = float(resources.get("CPU", 1))
        gpus_per = res.gpus_per_worker if res.gpus_per_worker is not None else (1.0 if gpus >= 1 else 0.0)
        if gpus_per > 0 and gpus < gpus_per:
            raise KvleagueError(
                f"resources.gpus_per_worker: {gpus_per} but the cluster has {gpus:g} GPUs; use 0 to run on CPUs"
            )
        cpus_per = res.cpus_per_worker
        if cpus_per > cpus:
            raise KvleagueError(f"resources.cpus_per_worker: {cpus_per:g} but the cluster has {cpus:g} CPUs")
        if self.workers_override or res.workers:
            n = self.workers_override or res.workers
        elif gpus_per > 0:
            n = int(gpus // gpus_per)
        else:
            n = int(cpus // cpus_per)
        return max(1, min(n, pending)), cpus_per, gpus_per

    def actor_options(self, cpus_per: float, gpus_per: float) -> dict[str, Any]:
        env = {k: os.environ[k] for k in FORWARDED_ENV if os.environ.get(k)}
        commit, dirty = self.git
        if commit != "unknown":  # workers may run an uploaded copy without .git
            env["KVLEAGUE_GIT_COMMIT"] = commit
            if dirty is not None:
                env["KVLEAGUE_GIT_DIRTY"] = "1" if dirty else "0"
        options = {
            "num_cpus": cpus_per,
            "num_gpus": gpus_per,
            "max_restarts": self.res.max_restarts,
            "max_task_retries": self.res.max_task_retries,
            "runtime_env": {"env_vars": env} if env else None,
        }
        return {k: v for k, v in options.items() if v is not None}

    def new_actor(self):
        import ray

        threads = self.res.torch_threads or max(1, int(self.cpus_per))
        # an address-space cap would break CUDA, which maps far more address space than memory
        cap = self.res.memory_limit_gb if not self.options.get("num_gpus") else None
        return (
            ray.remote(CellWorker)
            .options(**self.options)
            .remote(threads, self.inject_failures, cap, self.res.worker_memory_gb)
        )

    def shutdown(self) -> None:
        import ray

        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass
        self.actors = []
        if self.started_ray and ray.is_initialized():
            ray.shutdown()
            self.started_ray = False

    # -- run ------------------------------------------------------------------------------------

    def run(
        self,
        groups: list[list[Cell]],
        record: Callable[[Cell, dict[str, Any]], None],
        tick: Callable[[], None],
        batch_size: int | str = "auto",
    ) -> None:
        """Run every group of cells (``grid.batches``: cells that decode together, ``batch_size`` rows
        at a time) on one actor;
        ``record(cell, row)`` for each result, ``tick()`` about once a second. A group whose actor died
        comes back as single cells, so a cell that kills its worker is found and fails alone."""
        self.init_ray()  # first: it sets the environment Ray reads once, at import
        import ray

        died_errors, task_error = ray_exceptions()
        res = self.res
        groups = spread(groups, batch_size, self.plan_workers(sum(len(g) for g in groups))[0])
        n_workers, self.cpus_per, gpus_per = self.plan_workers(len(groups))
        self.options = self.actor_options(self.cpus_per, gpus_per)
        self.actors = [self.new_actor() for _ in range(n_workers)]
        # a ping per new actor: the cell time limit counts from when it is up (not while Ray starts
        # the process and imports torch)
        starting: list[Any] = [actor.ping.remote() for actor in self.actors]
        print(f"workers: {n_workers} actor(s), {self.cpus_per:g} CPU / {gpus_per:g} GPU each", flush=True)
        if res.memory_limit_gb and gpus_per:
            print(
                "warning: resources.memory_limit_gb applies to CPU workers only; GPU workers run without it "
                "(CUDA out of memory is still a failed row)",
                file=sys.stderr,
                flush=True,
            )

        queue: collections.deque[list[Cell]] = collections.deque(groups)
        inflight: dict[Any, tuple[int, list[Cell]]] = {}  # ref -> (actor slot, group)
        # per slot, its groups' refs in the order the actor runs them (one at a time): the first is
        # running, since about when the one before it ended
        running: list[collections.deque] = [collections.deque() for _ in range(n_workers)]
        since = [0.0] * n_workers
        max_replacements = 2 * n_workers + 2

        def replace(slot: int, group: list[Cell]) -> None:
            """A fresh actor for the slot; the groups queued behind ``group`` on the old one go back to the queue."""
            try:
                ray.kill(self.actors[slot], no_restart=True)
            except Exception:
                pass
            for ref in [r for r, (s, _) in inflight.items() if s == slot]:
                other = inflight.pop(ref)[1]
                if other is not group:
                    queue.appendleft(other)
            running[slot].clear()
            self.actors[slot] = self.new_actor()
            starting[slot] = self.actors[slot].ping.remote()

        def failed(cell: Cell, error: str) -> None:
            record(cell, {"cell_key": cell.key, "status": "failed", "error": error})

        def send(slot: int, group: list[Cell]) -> None:
            ref = self.actors[slot].run_group.remote(group, batch_size)
            inflight[ref] = (slot, group)
            if not running[slot]:
                since[slot] = time.monotonic()
            running[slot].append(ref)

        while queue or inflight:
            while queue:
                slot = min(range(n_workers), key=lambda s: len(running[s]))
                if len(running[slot]) >= res.in_flight_per_worker:
                    break
                send(slot, queue.popleft())
            # an idle worker takes the newest waiting call of the worker with the most waiting; had
            # that call just started (its predecessor done but not yet seen), it is lost and runs again here
            for idle in [s for s in range(n_workers) if not running[s]]:
                busiest = max(range(n_workers), key=lambda s: len(running[s]))
                if len(running[busiest]) < 2:
                    break
                ref = running[busiest].pop()
                ray.cancel(ref)
                send(idle, inflight.pop(ref)[1])
            ready, _ = ray.wait(list(inflight), num_returns=1, timeout=1.0)
            rest = [r for r in inflight if r not in ready]
            if ready and rest:
                more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
                ready += more
            for ref in ready:
                if ref not in inflight:  # queued on an actor replaced meanwhile: its cell is back in the queue
                    continue
                slot, group = inflight.pop(ref)
                if ref in running[slot]:
                    running[slot].remove(ref)
                    since[slot] = time.monotonic()
                try:
                    out = ray.get(ref)
                except died_errors as exc:
                    # Ray's restarts and retries are spent, or the actor is gone for good
                    for cell in reversed(group):
                        cell.attempts += 1
                        if cell.attempts >= res.max_cell_attempts:
                            failed(
                                cell, f"worker died {cell.attempts} times running this cell; last: {error_text(exc)}"
                            )
                        else:
                            queue.appendleft([cell])
                            print(
                                f"  {cell.describe()}: retried (attempt {cell.attempts + 1} of {res.max_cell_attempts})",
                                file=sys.stderr,
                                flush=True,
                            )
                    if self.replacements >= max_replacements:
                        raise KvleagueError(
                            f"ray: workers keep dying ({self.replacements} replaced); last: {error_text(exc)}"
                        ) from None
                    self.replacements += 1
                    replace(slot, group)
                    print(
                        f"worker {slot} died; replaced it ({self.replacements}/{max_replacements})",
                        file=sys.stderr,
                        flush=True,
                    )
                    continue
                except task_error as exc:  # run() catches cell errors, so this is the worker itself
                    for cell in group:
                        failed(cell, error_text(exc))
                    continue
                for cell, row in zip(group, out):
                    cell.attempts += 1
                    record(cell, row)
            if res.cell_timeout_seconds:
                now = time.monotonic()
                for slot in range(n_workers):
                    if starting[slot] is not None:
                        if not ray.wait([starting[slot]], timeout=0)[0]:
                            continue
                        starting[slot], since[slot] = None, max(since[slot], now)
                    # a group of n cells has n cells' time; past it, which cell hung is unknown, so the
                    # group's cells go back to the queue one by one and only a cell that hangs alone fails
                    group = inflight[running[slot][0]][1] if running[slot] else []
                    limit = res.cell_timeout_seconds * len(group)
                    if group and now - since[slot] > limit:
                        for cell in reversed(group):
                            cell.attempts += 1
                            if len(group) == 1:
                                failed(
                                    cell,
                                    f"timed out after {res.cell_timeout_seconds:g}s (resources.cell_timeout_seconds); "
                                    "its worker was replaced",
                                )
                            else:
                                queue.appendleft([cell])
                        replace(slot, group)
                        what = (
                            group[0].describe()
                            if len(group) == 1
                            else f"a batch of {len(group)} cells (requeued one by one)"
                        )
                        print(
                            f"worker {slot}: {what} timed out after {limit:g}s; replaced the worker",
                            file=sys.stderr,
                            flush=True,
                        )
            tick()
