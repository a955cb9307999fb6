"""Killing a sweep at a known point: the `kvviz sweep` driver, run with one change (after it
has saved its n-th cell it stops itself with SIGSTOP), and a blocking wait for that stop.
The kill then lands with exactly n cells on disk, whatever the machine's speed."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

_DRIVER = """
import os, signal, sys
from kvviz.studies.sweep import store
save, saved = store.save_cell, []
def save_then_stop(*args, **kwargs):
    save(*args, **kwargs)
    saved.append(1)
    if len(saved) == {n}:
        os.kill(os.getpid(), signal.SIGSTOP)
store.save_cell = save_then_stop
from kvviz.__main__ import main
sys.exit(main())
"""


def kill_after_cells(n: int, args: list[str], cwd, env: dict) -> list[int]:
    """Run `kvviz sweep` with `args` until it has saved its n-th cell, then SIGKILL it. The
    pids of the processes it had started (a pool's workers), taken while it was stopped."""
    proc = subprocess.Popen([sys.executable, "-c", _DRIVER.format(n=n), *args], cwd=cwd,
                            env=env, stderr=subprocess.DEVNULL)
    try:
        _, status = os.waitpid(proc.pid, os.WUNTRACED)  # returns when it stops (or ends)
        assert os.WIFSTOPPED(status), f"the sweep ended before its cell {n} (wait status {status})"
        children = subprocess.run(["ps", "-o", "pid=", "--ppid", str(proc.pid)],
                                  capture_output=True, text=True).stdout.split()
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    return [int(p) for p in children]
