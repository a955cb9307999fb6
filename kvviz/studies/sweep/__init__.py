"""Sweeps: a grid of cells (trace x layer x head x policy x parameters x budget) run
serially, on a process pool or on Ray, resumable, into one table. See docs/sweeps.md."""
from kvviz.studies.sweep.spec import Cell, SpecError, load

__all__ = ["Cell", "SpecError", "SweepDirError", "load", "run_sweep"]


def __getattr__(name):
    """The driver and the store need pandas; they load on first use so that `kvviz`'s
    command tree, which adds the sweep node, stays importable with numpy alone."""
    if name == "run_sweep":
        from kvviz.studies.sweep.run import run_sweep
        return run_sweep
    if name == "SweepDirError":
        from kvviz.studies.sweep.store import SweepDirError
        return SweepDirError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
