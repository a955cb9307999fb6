"""Sweeps: a grid of cells (trace x layer x head x policy x parameters x budget) run
serially, on a process pool or on Ray, resumable, into one table. See docs/sweeps.md."""
from kvviz.studies.sweep.run import run_sweep
from kvviz.studies.sweep.spec import Cell, SpecError, load
from kvviz.studies.sweep.store import SweepDirError

__all__ = ["Cell", "SpecError", "SweepDirError", "load", "run_sweep"]
