"""Write a file so that neither a reader nor a kill half-way ever sees half of it."""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


@contextlib.contextmanager
def replacing(path, suffix: str = ".tmp"):
    """Yield a binary handle on a temporary file beside `path`. When the block ends it
    replaces `path` in one rename, readable as the umask allows (mkstemp alone gives 0600,
    and traces and results are meant to be shared); if the block raises, it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    try:
        with os.fdopen(fd, "wb") as fh:
            yield fh
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
