# each child stays under the per-process limit; together they are far over the run's memory cap
import os

children = []
for _ in range(5):
    pid = os.fork()
    if pid == 0:
        block = b"x" * (int("$CHILD_MB") << 20)
        os._exit(0)
    children.append(pid)
statuses = [os.waitpid(pid, 0)[1] for pid in children]
assert statuses == [0] * 5, statuses
