"""Benchmarks: the metrics table (`python -m kvviz bench`) and replay speed (`... perf`)."""
from __future__ import annotations

import time
import tracemalloc

from kvviz.core.budget import as_given, is_ratio, parse_budget, resolve
from kvviz.core.layers import layer_summary, load_layers, refuse_single, replay_layers, replay_streams
from kvviz.core.metrics import summary
from kvviz.core.policies import ALLOCATORS, POLICIES, make_policy, parse_params
from kvviz.core.reference import make_reference
from kvviz.core.replay import Replay, run_policy, runnable
from kvviz.core.trace import Trace, canonical, load_trace
from kvviz.studies.table import Table

BUDGETS = (256, 512, 1024)


def open_trace(path=None, layer=None, head=None) -> Trace:
    """The canonical trace (path None) or a trace file at a model layer number and head label.

    A bare name that is not a file here, e.g. `code.npz`, is looked up among the shipped
    traces (the checkout's traces/ or an installed kvviz's bundle)."""
    if path:
        from pathlib import Path

        from kvviz.core.paths import traces_dir
        shipped = traces_dir()
        if not Path(path).exists() and shipped is not None and (shipped / path).is_file():
            path = shipped / path
        trace = load_trace(path, layer=layer, head=head)
        trace.source, trace.layer_chosen = path, layer  # an allocator replays every KV head
        trace.head_chosen = head
        return trace
    if layer is not None:
        raise ValueError("layer applies to a --trace file; the canonical trace has no model layers")
    if head not in (None, "mean"):
        raise ValueError(f"head {head} is not stored in the canonical trace; stored heads: mean")
    return canonical()


def describe(trace: Trace, table=None) -> str:
    """The header line: which trace, and which model layer and head of it ran (for a `table`
    at kv-head granularity, every stored layer's KV heads: its note says which)."""
    text = f"trace: {trace.name} ({trace.steps} steps)"
    if table is not None and "kv-head" in table.column("granularity"):
        return text + f", every KV head of stored layers {', '.join(map(str, trace.layers))}"
    if getattr(trace, "layer", None) is not None:
        text += f", model layer {trace.layer} of stored {', '.join(map(str, trace.layers))}"
    return text + f", head {getattr(trace, 'head', 'mean')}"


def policy_list(text: str) -> list[str]:
    """`--policies` text as specs: 'tova,adakv:scorer=snapkv,poolKernel=3,h2o' is
    ['tova', 'adakv:scorer=snapkv,poolKernel=3', 'h2o'] (a k=v item belongs to the spec
    before it)."""
    out: list[str] = []
    for item in (p.strip() for p in str(text).split(",")):
        if not item:
            continue
        if "=" in item and ":" not in item and out:
            out[-1] += "," + item
        else:
            out.append(item)
    return out


def parse_spec(spec: str) -> tuple[str, dict]:
    """'name' or 'name:k=v,...' -> (name, typed parameters), refused as the registry refuses."""
    name, _, rest = str(spec).partition(":")
    name = name.strip()
    if name not in POLICIES and name not in ALLOCATORS:
        raise ValueError(f"--policies: unknown policy {name!r}; known: "
                         f"{', '.join(sorted(POLICIES) + sorted(ALLOCATORS))}")
    params = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"--policies {spec!r}: parameters are k=v, got {item!r}")
        params[key.strip()] = value
    return name, parse_params(name, params, where=f"--policies {spec!r}: ")


def table(trace: Trace, budgets=BUDGETS, policies=None, pool_kernels=None,
          spans: bool = False) -> Table:
    """Policies x budgets. A budget is a slot count or a ratio of the tokens seen
    (kvviz.core.budget: '0.25x', resolved at every step); with a ratio among them the table
    gains `held`, the most slots a row held (memory_bytes is that count's bytes), and the
    `budget` column is each budget as given. `pool_kernels` gives snapkv one row per kernel; `spans` adds
    span integrity (kvviz.core.spans: important attention spans whole / fragmented / dropped at the end).
    A Table, not a DataFrame, so `kvviz bench` runs with numpy alone (`.to_frame()` for pandas).

    A policy is a name or 'name:k=v,...'. An allocator (adakv, pyramidkv) replays every KV
    head of the trace file (all stored layers, or the one chosen) through
    kvviz.core.layers; its row averages the streams' metrics, its memory is the recorded
    held counts summed over the streams, and `Table.notes` gets each head's held count at
    the end. A trace with no KV heads refuses it in one line. With an allocator in the
    table, the table is at kv-head granularity: every per-stream policy's row is the same
    streams, one policy object per KV head (kvviz.core.layers.replay_streams), so every row
    averages and sums over the same streams; otherwise each row is the one stream chosen.
    The `granularity` column says which ("kv-head", or the head's label). For each plugin,
    `Table.notes` names its file (or module, or entry point) and the SHA-256 of its source."""
    configs = []
    for spec in policies or runnable(trace):
        name, given = parse_spec(spec)
        kernels = pool_kernels if name == "snapkv" and pool_kernels else [None]
        configs += [(name, {**given, **({} if k is None else {"pool_kernel": k})}) for k in kernels]
    if spans:
        from kvviz.core.spans import received, span_integrity
        totals = received(trace)
    rows, notes = [], []
    grid = None
    allocators = [name for name, _ in configs if name in ALLOCATORS]
    if allocators:  # every row over the KV heads the allocators share
        if spans:
            raise ValueError(f"--spans reads one stream, and {allocators[0]} is an allocator (every KV head): "
                             "run --spans without allocators")
        grid = kv_grid(trace, allocators[0])
        notes.append(f"granularity kv-head: every row is the {len(grid) * len(grid[0])} KV-head streams of "
                     f"layer{'s' if len(grid) > 1 else ''} {', '.join(str(row[0].layer) for row in grid)} "
                     f"(kv0..kv{len(grid[0]) - 1}): metrics averaged over them, memory summed")
    for name, params in configs:
        if name in ALLOCATORS:
            rows += _allocator_rows(trace, name, params, budgets, notes, grid)
            continue
        for budget in budgets:
            if grid is not None:
                found = replay_streams(grid, name, budget, **params)
                row = {"policy": name, "budget": as_given(budget), "granularity": "kv-head",
                       **layer_summary(grid, found)}
                row["held"] = int(found.held.sum(axis=(0, 1)).max())
                row["evicts"] = resolve(budget, trace.steps) < trace.steps
                row["params"] = ", ".join(f"{k}={v}" for k, v in found.runs[0][0].params.items())
                rows.append(row)
                continue
            run = run_policy(trace, name, budget, **params)
            row = {"policy": name, "budget": as_given(budget), "granularity": getattr(trace, "head", "mean"),
                   **summary(trace, run)}
            row["held"] = run.peak_held
            row["evicts"] = resolve(run.budget, trace.steps) < trace.steps  # False: perfect by construction
            row["params"] = ", ".join(f"{k}={v}" for k, v in run.params.items())
            if spans:
                found = span_integrity(trace, run, spans="attention", totals=totals)
                row.update({f"span_{k}": found[k] for k in ("whole", "fragmented", "dropped")})
            rows.append(row)
    columns = ["policy", "budget", "granularity", "retained_mass", "attention_loss", "hh_recall", "memory_bytes"]
    columns += ["span_whole", "span_fragmented", "span_dropped"] if spans else []
    columns += ["held"] if any(is_ratio(b) for b in budgets) else []  # the resolved count
    columns += ["evicts"]
    out = Table(rows, columns + ["params"])
    out.notes = notes + sources([name for name, _ in configs])
    return out


def parse_budgets(text: str) -> list:
    """`--budgets` text ('64,0.25x') as budgets: slot counts and ratios (kvviz.core.budget),
    refused in one line naming --budgets and the rule."""
    return [parse_budget(x.strip(), "--budgets") for x in str(text).split(",") if x.strip()]


def sources(names) -> list[str]:
    """One line per policy or allocator in `names` that is not built in: where it came from
    and the SHA-256 of its source (kvviz.core.plugins.provenance), so a table of a plugin's
    numbers names the code that made them."""
    from kvviz.core.plugins import provenance

    out = []
    for name in dict.fromkeys(names):
        found = provenance(name)
        if found["origin"] != "built-in":
            out.append(f"{name}: {found['origin']} {found['where']}, sha256 {found['sha256']}")
    return out


def kv_grid(trace: Trace, name: str) -> list:
    """[layer][head] KV-head traces of `trace`'s file (every stored layer, or the one chosen):
    what an allocator, and at kv-head granularity every row, replays. A trace with no KV
    heads refuses `name` in one line, and so does a chosen --head (one stream)."""
    source = getattr(trace, "source", None)
    if source is None or not [h for h in trace.heads if h.startswith("kv")]:
        raise refuse_single(name, trace.name)
    head = getattr(trace, "head_chosen", None)
    if head is not None:
        raise ValueError(f"--head {head} picks one stream, and {name} is an allocator: its rows (and so every "
                         "row of the table) are every KV head; drop --head, or drop the allocators")
    chosen = getattr(trace, "layer_chosen", None)
    return load_layers(source, None if chosen is None else [chosen])


def _allocator_rows(trace: Trace, name: str, params: dict, budgets, notes: list, grid=None) -> list[dict]:
    grid = kv_grid(trace, name) if grid is None else grid
    rows = []
    for budget in budgets:
        try:
            alloc = make_policy(name, budget, **params)
        except ValueError as exc:
            raise ValueError(f"--budgets {budget}: {exc}") from None
        found = replay_layers(grid, alloc)
        row = {"policy": name, "budget": as_given(budget), "granularity": "kv-head", **layer_summary(grid, found)}
        row["held"] = int(found.held.sum(axis=(0, 1)).max())
        row["evicts"] = resolve(budget, trace.steps) < trace.steps
        row["params"] = ", ".join(f"{k}={v}" for k, v in alloc.params.items())
        rows.append(row)
        end = found.held_at_end()
        for d, layer in enumerate(found.layer_numbers):
            counts = ", ".join(f"kv{g}={int(n)}" for g, n in enumerate(end[d]))
            notes.append(f"{name} @ {budget}: layer {layer} (per-head budget {found.budgets[d]}"
                         f"{' at the last step' if is_ratio(budget) else ''}, "
                         f"total {found.budgets[d] * len(end[d])}) held at the end: {counts}")
    return rows


class CachedTrace(Trace):
    """Every row materialised once, so timings measure the replay and not row generation."""

    def __init__(self, trace: Trace):
        self.steps, self.name = trace.steps, trace.name
        self._rows = [trace.row(i) for i in range(trace.steps)]
        for r in self._rows:
            r.flags.writeable = False

    def row(self, i):
        return self._rows[i]


def _time_replay(trace, policy) -> float:
    """CPU seconds to step the policy through every row (gather, renormalise, observe,
    evict). CPU time, not wall time, so another busy process on the machine does not
    skew one side of the ratio."""
    replay = Replay(trace, policy)
    start = time.process_time()
    replay.seek(trace.steps - 1)
    return time.process_time() - start


def perf_specs(policies) -> list[tuple[str, dict]]:
    """`perf`'s policies parsed (as bench's), allocators refused: perf times one stream."""
    specs = [parse_spec(p) for p in policies]
    for name, _ in specs:
        if name in ALLOCATORS:
            raise ValueError(f"--policies: {name} is an allocator (several streams at once); perf "
                             "times one stream's policy against its reference")
    return specs


def perf(budget: int = 512, steps: int = 4096, policies=None) -> Table:
    """Fast replay against the reference per policy, in CPU seconds (a Table, as `table`).
    A policy is a name or 'name:k=v,...' (as `--policies` of bench: every registered policy,
    plugins included); a row with parameters is labelled 'name:k=v,...' with the values used."""
    trace = CachedTrace(canonical(steps))
    specs = perf_specs(policies or runnable(trace))
    rows = []
    for name, params in specs:
        fast = min(_time_replay(trace, make_policy(name, budget, **params)) for _ in range(3))
        try:
            ref = _time_replay(trace, make_reference(name, budget, **params))
        except ValueError:  # a plugin that names no reference
            ref = float("nan")
        label = name + (":" + ",".join(f"{k}={v}" for k, v in params.items()) if params else "")
        rows.append({"policy": label, "fast_cpu_s": fast, "reference_cpu_s": ref, "speedup": ref / fast})
    return Table(rows, ["policy", "fast_cpu_s", "reference_cpu_s", "speedup"])


def long_run(steps: int = 65536, budget: int = 1024, name: str = "snapkv") -> dict:
    """Replay a long canonical trace; report the peak of Python/numpy allocations during it
    (tracemalloc) and the whole process's peak RSS (interpreter and libraries included)."""
    tracemalloc.start()
    start, cpu = time.perf_counter(), time.process_time()
    run = run_policy(canonical(steps), name, budget)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {"policy": name, "steps": steps, "budget": budget, "seconds": round(elapsed, 1),
            "cpu_seconds": round(cpu, 1),  # wall time swells when other jobs share the CPU
            "traced_peak_mib": round(peak / 2**20, 1), "process_peak_rss_mib": round(rss, 1),
            "held_at_end": int(len(run.held_at(steps - 1)))}
