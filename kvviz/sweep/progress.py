"""A plain-text progress line on stderr: cells done, failed, rate and ETA."""
from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, already: int = 0, failed: int = 0, stream=None,
                 every: float = 5.0):
        self.total, self.done, self.failed = total, already, failed
        self.start_done = already
        self.stream = stream or sys.stderr
        self.tty = getattr(self.stream, "isatty", lambda: False)()
        self.every = 0.1 if self.tty else every
        self.t0 = self.last = time.monotonic()
        self.show(force=True)

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += not ok
        self.show(force=self.done == self.total)

    def line(self) -> str:
        width = 30
        fill = int(width * self.done / self.total) if self.total else width
        ran = self.done - self.start_done
        elapsed = time.monotonic() - self.t0
        rate = ran / elapsed if elapsed > 0 and ran else 0.0
        left = self.total - self.done
        eta = _clock(left / rate) if rate else "?"
        return (f"[{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} cells, "
                f"{self.failed} failed, {rate:.1f} cells/s, ETA {eta}")

    def show(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last < self.every:
            return
        self.last = now
        end = "" if self.tty and self.done < self.total else "\n"
        self.stream.write(("\r" if self.tty else "") + self.line() + end)
        self.stream.flush()


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
