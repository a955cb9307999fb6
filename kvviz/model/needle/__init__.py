"""The pass-key test (Mohtashami & Jaggi 2023): a key hidden in a haystack, a question after
it, every policy generating its answer over its own evicted cache beside the full cache.

    python -m kvviz needle --out DIR --lengths 256,512 --depths 10,50,90 --policies tova --budgets 128
    python -m kvviz needle --task recall --reminder-every 20 --out DIR ...   # kvviz.model.needle.tasks

Results and their schema: kvviz/model/needle/results.py. torch loads only in kvviz.model.needle.run.
"""
from kvviz.model.needle.results import layer_table, list_runs, load_results, load_run

__all__ = ["layer_table", "list_runs", "load_results", "load_run"]
