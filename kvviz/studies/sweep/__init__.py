"""Sweeps: a grid of cells (trace x layer x head x policy x parameters x budget) run
serially, on a process pool or on Ray, resumable, into one table. See docs/sweeps.md.

The driver is `kvviz.studies.sweep.run.run_sweep`; it and the store need pandas, so this
package's own import stays numpy-only (the command tree adds the sweep node with numpy alone)."""
