"""A results table as plain row dicts, printed, and written as CSV and JSON by the standard
library.

`kvviz bench` and `kvviz perf` must run where numpy is the only dependency installed, so
their tables are not DataFrames. Whoever wants one (the app, a notebook) calls `to_frame`,
which loads pandas then.
"""
from __future__ import annotations

import csv
import json
import math

import numpy as np


def _native(value):
    """A numpy scalar as the Python value csv and json know how to write."""
    return value.item() if isinstance(value, np.generic) else value


def _is_nan(value) -> bool:
    return isinstance(value, float) and math.isnan(value)


def _finite_or_none(value):
    return None if isinstance(value, float) and not math.isfinite(value) else value


class Table:
    """Rows (dicts) under a fixed column order. A row's keys outside `columns` are not shown
    or written; a column a row lacks is left empty."""

    def __init__(self, rows, columns=None):
        self.rows = [dict(r) for r in rows]
        if columns is None:  # first appearance order, as a DataFrame built from the rows has
            columns = list(dict.fromkeys(k for r in self.rows for k in r))
        self.columns = list(columns)

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self):
        return iter(self.records())

    def column(self, name: str) -> list:
        return [r.get(name) for r in self.records()]

    def records(self) -> list[dict]:
        """Each row in column order, numpy scalars as Python values."""
        return [{c: _native(r.get(c)) for c in self.columns} for r in self.rows]

    def to_string(self, float_format=None) -> str:
        """Columns right-aligned under their headers, two spaces apart; floats through
        `float_format` (NaN prints as NaN), everything else as str()."""
        def cell(v) -> str:
            if v is None:
                return ""
            if isinstance(v, float):
                return "NaN" if math.isnan(v) else (float_format(v) if float_format else repr(v))
            return str(v)

        grid = [list(self.columns)] + [[cell(r[c]) for c in self.columns] for r in self.records()]
        widths = [max(len(line[i]) for line in grid) for i in range(len(self.columns))]
        return "\n".join("  ".join(text.rjust(w) for text, w in zip(line, widths)).rstrip()
                         for line in grid)

    def to_csv(self, path) -> None:
        """A header line, then one line per row; floats at full precision (repr), NaN and
        missing values as empty fields."""
        with open(path, "w", newline="", encoding="utf-8") as f:
            out = csv.writer(f, lineterminator="\n")
            out.writerow(self.columns)
            for r in self.records():
                out.writerow(["" if v is None or _is_nan(v) else v for v in r.values()])

    def to_json(self, path) -> None:
        """A list of objects, one per row, keys in column order; floats at full precision,
        NaN and infinities as null (strict JSON has no spelling for them)."""
        records = [{k: _finite_or_none(v) for k, v in r.items()} for r in self.records()]
        with open(path, "w", encoding="utf-8") as f:
            json.dump(records, f, indent=2, allow_nan=False)
            f.write("\n")

    def to_frame(self):
        """The same rows as a pandas DataFrame (pandas is loaded here, not before)."""
        import pandas as pd

        return pd.DataFrame(self.records(), columns=self.columns)
