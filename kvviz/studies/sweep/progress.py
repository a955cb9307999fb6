"""The sweep's progress bar on stderr (tqdm): cells done, failed, rate and ETA."""
from __future__ import annotations

import sys

from tqdm import tqdm


class Progress:
    """A tqdm bar over cells; cells finished by an earlier run count from the start
    (`already`), and the failed count rides in the postfix. On a terminal it redraws ten
    times a second; into a log, every `every` seconds."""

    def __init__(self, total: int, already: int = 0, failed: int = 0, stream=None,
                 every: float = 5.0):
        stream = stream or sys.stderr
        tty = getattr(stream, "isatty", lambda: False)()
        self.failed = failed
        # smoothing=0: the rate is the run's average, so the ETA does not jump with each cell
        self.bar = tqdm(total=total, initial=already, desc="[kvviz sweep]", unit="cell",
                        file=stream, mininterval=0.1 if tty else every, miniters=1,
                        smoothing=0, postfix=f"{failed} failed")
        if already >= total:
            self.bar.close()

    def update(self, ok: bool) -> None:
        self.failed += not ok
        self.bar.set_postfix_str(f"{self.failed} failed", refresh=False)
        self.bar.update(1)
        if self.bar.n >= self.bar.total:
            self.bar.close()
