"""kvviz in a notebook: the step-by-step view as a widget (`pip install 'kvviz[notebook]'`).

One call per result kind, each returning a `StepView`:

- `replay(trace, run_a, run_b=None)`: one or two replay `Run`s of a trace;
- `loop(result, a, b=None)`: configurations of a closed-loop `LoopResult`;
- `generation(gen, a, b=None)`: configurations of a `Generation`;
- `needle(run, a, b=None)`: configurations of a pass-key run (the key's positions shaded);
- `heads(trace, allocator, scorer, budget)`: an allocator beside its scorer alone (the Heads
  picture), on a trace captured per KV head.

A view shows the cache heatmap with a step control, the held slots' scores at the chosen step
with the victims marked, and the sinks / recent-window survival, each drawn by the app's own
figure builders (kvviz.app.figures). The pictures and, for every step of a window around the
chosen one (at most `window` steps), the moved step marks and that step's scores are sent to
the browser once, so moving the step control needs no kernel round-trip. A run longer than the
window says so in the view; setting `view.step` outside the window sends the window around it.

`view.to_figure(name)` is the same picture as a plain Plotly figure (a static notebook,
nbconvert to HTML, a paper's figure script); `view.pictures` names them.

The widget is an anywidget (JupyterLab, Jupyter Notebook, VS Code, Colab, marimo): nothing to
install in Jupyter itself. Plotly.js comes from the plotly package installed here, asked for
once per page, never from the internet.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np

from kvviz.core.extras import require

require("kvviz.app.notebook", "notebook", "anywidget", "traitlets")

import anywidget  # noqa: E402  (after the one-line refusal above)
import plotly.graph_objects as go  # noqa: E402
import traitlets  # noqa: E402

from kvviz.app.engine import allocator_runs  # noqa: E402
from kvviz.app.figures.cache import at_step, cache_heatmap, heatmap_grid  # noqa: E402
from kvviz.app.figures.common import pair_colours  # noqa: E402
from kvviz.app.figures.heads import heads_figure  # noqa: E402
from kvviz.app.figures.needle import key_cache_figure  # noqa: E402
from kvviz.app.figures.scores import neighbourhood_figure  # noqa: E402
from kvviz.app.figures.survival import survival_figure  # noqa: E402
from kvviz.core.policies import config_label, make_policy  # noqa: E402
from kvviz.core.replay import NEVER, Replay, Run  # noqa: E402
from kvviz.core.trace import Trace  # noqa: E402

WINDOW = 32  # steps whose marks and scores go to the browser at most (one view: about 3 s of figures)
SLOTS = 12  # held slots drawn each side of the step's victim in the scores picture
MAX_WINDOW = 1024


@dataclass
class Side:
    """One configuration shown: its eviction log and, when known, the rows it read.

    `trace`: the attention rows the policy was fed (a replay's trace, a loop's recorded rows),
    from which its scores at a step are replayed; None (a generation, a pass-key run, an
    allocator): the scores picture shows its held slots and victims only."""

    label: str
    policy: str
    evicted_at: np.ndarray
    budget: int
    params: dict = field(default_factory=dict)
    trace: Trace | None = None

    def panels(self, lo: int, hi: int, letter: str, colour: str) -> list[dict]:
        """The scores panel (kvviz.app.figures.scores) of steps lo..hi, in one pass."""
        ev = np.asarray(self.evicted_at, np.int64)
        scored = self.trace.steps if self.trace is not None else 0
        rp = None
        if lo < scored:
            try:  # an allocator, or a policy reading what the rows lack (key norms): no scores
                rp = Replay(self.trace, make_policy(self.policy, budget=self.budget, **self.params))
            except ValueError:
                scored = 0
            else:
                rp.seek(lo - 1)
        pos = np.arange(len(ev))
        out = []
        for s in range(lo, hi + 1):
            if rp is not None and s < scored:
                kept, scores = rp.peek(s)
                rp.step()
            else:  # held after admitting s, before evicting: the log's held rule
                kept, scores = np.flatnonzero((pos <= s) & ((ev == NEVER) | (ev >= s))), {}
            out.append(dict(label=f"{letter}: {self.label}", policy=self.policy, kept=kept,
                            scores=scores, victims=np.flatnonzero(ev == s), colour=colour,
                            params=dict(self.params)))
        return out


class Pair:
    """What a view draws: two sides (or one, shown as both) over the same positions."""

    def __init__(self, a: Side, b: Side | None = None, *, tokens=None, slots: int = SLOTS,
                 title: str = "", key_positions=None, prompt_len: int | None = None, extra=None):
        self.a, self.b = a, b or a
        self.sides = [a] if b is None else [a, b]
        self.steps = len(a.evicted_at)
        if len(self.b.evicted_at) != self.steps:
            raise ValueError(f"the two runs must cover the same steps, got {self.steps} and "
                             f"{len(self.b.evicted_at)}")
        self.tokens = list(tokens) if tokens is not None and len(tokens) == self.steps else None
        self.slots = int(slots)
        self.title = title or " vs ".join(s.label for s in self.sides)
        self.key_positions, self.prompt_len = key_positions, prompt_len
        self.extra = extra  # (name, builder(step) -> Figure): another step-marked picture
        self.colours = pair_colours(self.a.label, self.b.label)
        self._grid = None

    @property
    def marked(self) -> list[str]:
        """The step-marked pictures, drawn once (their marks move)."""
        return ["cache", "survival"] + ([self.extra[0]] if self.extra else [])

    stepped = ["scores"]

    def figure(self, name: str, step: int) -> go.Figure:
        """Picture `name` at `step`, by the app's builder for it."""
        a, b = self.a, self.b
        if name == "cache":
            if self.key_positions is not None:
                fig = key_cache_figure(a.evicted_at, b.evicted_at, key_positions=self.key_positions,
                                       prompt_len=self.prompt_len, label_a=a.label, label_b=b.label)
                return go.Figure(at_step(fig.to_dict(), step).to_dict())
            if self._grid is None:
                self._grid = heatmap_grid(a.evicted_at, b.evicted_at, label_a=a.label,
                                          label_b=b.label, tokens=self.tokens)
            return cache_heatmap(a.evicted_at, b.evicted_at, step, label_a=a.label, label_b=b.label,
                                 grid=self._grid)
        if name == "survival":
            return survival_figure(a.evicted_at, b.evicted_at, step, label_a=a.label, label_b=b.label)
        if self.extra and name == self.extra[0]:
            return self.extra[1](step)
        if name == "scores":
            return self.scores(self.panels(step, step), step)[0]
        raise ValueError(f"picture must be one of {self.marked + self.stepped}, got {name!r}")

    def panels(self, lo: int, hi: int) -> list[list[dict]]:
        """Per step lo..hi, the panels of each side."""
        per_side = [s.panels(lo, hi, letter, colour)
                    for s, letter, colour in zip(self.sides, "AB", self.colours)]
        return [list(ps) for ps in zip(*per_side)]

    def scores(self, panels: list[list[dict]], lo: int) -> list[go.Figure]:
        """The scores picture of each step from `lo` on: `slots` held slots either side of
        the step's first victim (the newest position when nothing is evicted)."""
        out = []
        for i, shown in enumerate(panels):
            s = lo + i
            victims = np.concatenate([p["victims"] for p in shown])
            center = int(victims[0]) if len(victims) else s
            out.append(neighbourhood_figure(shown, s, center, half_width=self.slots,
                                            tokens=self.tokens, centre_line=False))
        return out


def _spec(fig: go.Figure) -> dict:
    """A figure as the browser takes it (plotly's JSON: arrays as typed base64 blocks)."""
    return json.loads(fig.to_json())


def _plotly_js() -> bytes:
    return (resources.files("plotly") / "package_data" / "plotly.min.js").read_bytes()


ESM = r"""
// kvviz's step view: the pictures drawn once, the step control answered here from the window
// of marks and frames the kernel sent (no round-trip); plotly.js asked of the kernel once a page.
// The page's own Plotly (another extension's, of another version) is left as it was.
function plotly(model) {
  if (!globalThis.__kvvizPlotly) {
    globalThis.__kvvizPlotly = new Promise((resolve, reject) => {
      model.on("msg:custom", (msg, buffers) => {
        if (!msg || msg.kind !== "plotly.js") return;
        const url = URL.createObjectURL(new Blob([buffers[0]], { type: "text/javascript" }));
        const tag = document.createElement("script");
        const before = globalThis.Plotly;
        tag.src = url;
        tag.onload = () => {
          const ours = globalThis.Plotly;
          if (before !== undefined) globalThis.Plotly = before;
          resolve(ours);
        };
        tag.onerror = () => reject(new Error("kvviz: plotly.js did not load"));
        document.head.appendChild(tag);
      });
      model.send({ kind: "plotly.js?" });
    });
  }
  return globalThis.__kvvizPlotly;
}

const CONFIG = { displaylogo: false, responsive: true };

async function render({ model, el }) {
  const waiting = document.createElement("div");
  waiting.className = "kvviz-note";
  waiting.textContent = "kvviz: loading plotly.js from the kernel…";
  el.appendChild(waiting);
  const Plotly = await plotly(model);
  waiting.remove();
  const root = document.createElement("div");
  root.className = "kvviz-view";
  // the step control's keys are its own, not the notebook's shortcuts (JupyterLab's arrows)
  root.dataset.lmSuppressShortcuts = "true";
  root.addEventListener("keydown", (e) => e.stopPropagation());
  el.appendChild(root);
  let divs = [];

  function build() {
    divs.forEach((d) => Plotly.purge(d));
    root.replaceChildren();
    const bar = document.createElement("div");
    bar.className = "kvviz-bar";
    const title = document.createElement("b");
    title.textContent = model.get("title");
    const slider = document.createElement("input");
    slider.type = "range";
    slider.className = "kvviz-step";
    slider.min = model.get("lo");
    slider.max = model.get("hi");
    slider.value = model.get("step");
    slider.setAttribute("aria-label", "step");
    const shown = document.createElement("span");
    shown.className = "kvviz-shown";
    const note = document.createElement("span");
    note.className = "kvviz-note";
    note.textContent = model.get("note");
    bar.append(title, slider, shown, note);
    root.appendChild(bar);
    const marked = model.get("marked");
    const frames = model.get("frames");
    const lo = model.get("lo");
    divs = [];
    const pic = (name) => {
      const d = document.createElement("div");
      d.className = "kvviz-picture";
      d.dataset.picture = name;
      root.appendChild(d);
      divs.push(d);
      return d;
    };
    const markedDivs = marked.map((m) => pic(m.name));
    const steppedDivs = frames[0].map((_, k) => pic("scores" + (k ? k : "")));
    marked.forEach((m, j) => Plotly.newPlot(markedDivs[j], m.figure.data, m.figure.layout, CONFIG));
    let current = -1;
    function show(s) {
      s = Math.max(lo, Math.min(model.get("hi"), s));
      if (s === current) return;
      current = s;
      const i = s - lo;
      model.get("marks")[i].forEach((patch, j) => Plotly.relayout(markedDivs[j], patch));
      frames[i].forEach((f, k) => Plotly.react(steppedDivs[k], f.data, f.layout, CONFIG));
      shown.textContent = `step ${s} of 0–${model.get("steps") - 1}`;
      slider.value = s;
    }
    slider.addEventListener("input", () => {
      const s = Number(slider.value);
      show(s);
      model.set("step", s);
      model.save_changes();
    });
    show(model.get("step"));
    return show;
  }

  let show = build();
  const onStep = () => show(model.get("step"));
  model.on("change:step", onStep);
  const onWindow = () => { show = build(); };
  model.on("change:frames", onWindow);
  return () => {
    model.off("change:step", onStep);
    model.off("change:frames", onWindow);
    divs.forEach((d) => Plotly.purge(d));
  };
}

export default { render };
"""
CSS = """
.kvviz-view { font-family: system-ui, -apple-system, Segoe UI, Roboto, sans-serif; }
.kvviz-bar { display: flex; gap: 0.8em; align-items: center; flex-wrap: wrap; margin: 4px 0; }
.kvviz-bar input[type=range] { flex: 1 1 320px; }
.kvviz-note { color: #555; font-size: 0.9em; }
"""


class StepView(anywidget.AnyWidget):
    """The step-by-step view of one result (built by `replay`, `loop`, `generation`, `needle`
    or `heads`). `step` is the chosen step (set it, or move the control); `to_figure(name)`
    any of `pictures` as a plain Plotly figure."""

    _esm = ESM
    _css = CSS
    title = traitlets.Unicode("").tag(sync=True)
    steps = traitlets.Int(0).tag(sync=True)
    step = traitlets.Int(0).tag(sync=True)
    lo = traitlets.Int(0).tag(sync=True)
    hi = traitlets.Int(0).tag(sync=True)
    note = traitlets.Unicode("").tag(sync=True)
    marked = traitlets.List().tag(sync=True)  # [{"name", "figure"}]: drawn once
    marks = traitlets.List().tag(sync=True)  # per window step, per marked picture: its moved marks
    frames = traitlets.List().tag(sync=True)  # per window step, per stepped picture: the figure

    def __init__(self, pair: Pair, step: int | None = None, window: int = WINDOW):
        if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or not 1 <= window <= MAX_WINDOW:
            raise ValueError(f"window must be an integer in 1..{MAX_WINDOW} (steps sent to the "
                             f"browser), got {window!r}")
        self._pair, self._window = pair, int(window)
        first = pair.steps - 1 if step is None else self._checked(step)
        super().__init__(title=pair.title, steps=pair.steps)
        self._window_at(first)
        self.on_msg(self._answer)
        self.observe(self._stepped, names="step")

    @property
    def pictures(self) -> list[str]:
        return self._pair.marked + self._pair.stepped

    def _checked(self, step) -> int:
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or not 0 <= step < self._pair.steps:
            raise ValueError(f"step must be an integer in 0..{self._pair.steps - 1}, got {step!r}")
        return int(step)

    def window_of(self, step: int) -> tuple[int, int]:
        """The steps [lo, hi] sent for `step`: `window` of them around it, within the run."""
        n, w = self._pair.steps, self._window
        lo = max(0, min(step - w // 2, n - w))
        return lo, min(n - 1, lo + w - 1)

    def _window_at(self, step: int) -> None:
        pair = self._pair
        lo, hi = self.window_of(step)
        marked = [_spec(pair.figure(name, step)) for name in pair.marked]
        marks = [[{k: at_step(f, s).to_dict()["layout"].get(k, []) for k in ("shapes", "annotations")}
                  for f in marked] for s in range(lo, hi + 1)]
        frames = [[_spec(f)] for f in pair.scores(pair.panels(lo, hi), lo)]
        note = ("" if (lo, hi) == (0, pair.steps - 1) else
                f"steps {lo}–{hi} of 0–{pair.steps - 1} are here (a window of {hi - lo + 1}); "
                "set view.step outside it for another")
        with self.hold_sync():
            self.lo, self.hi, self.note = lo, hi, note
            self.marked = [{"name": n, "figure": f} for n, f in zip(pair.marked, marked)]
            self.marks, self.frames = marks, frames
            self.step = step

    def _stepped(self, change) -> None:
        s = self._checked(change["new"])
        if not self.lo <= s <= self.hi:
            self._window_at(s)

    def _answer(self, _widget, content, _buffers) -> None:
        if isinstance(content, dict) and content.get("kind") == "plotly.js?":
            self.send({"kind": "plotly.js"}, buffers=[_plotly_js()])

    def to_figure(self, name: str = "cache", step: int | None = None) -> go.Figure:
        """Picture `name` (one of `pictures`) at `step` (default: the chosen one) as a plain
        Plotly figure, built by the same builder as the widget's."""
        if name not in self.pictures:
            raise ValueError(f"name must be one of {self.pictures}, got {name!r}")
        return self._pair.figure(name, self.step if step is None else self._checked(step))


# --- one call per result kind ----------------------------------------------------------------

def replay(trace: Trace, run_a: Run, run_b: Run | None = None, *, step: int | None = None,
           window: int = WINDOW, slots: int = SLOTS) -> StepView:
    """One replay `Run` of `trace` (or two, to compare): their scores replayed from the trace."""
    def side(run):
        if not isinstance(run, Run):
            raise ValueError(f"run_a and run_b must be kvviz Runs, got {type(run).__name__}")
        if run.steps != trace.steps:
            raise ValueError(f"run of {run.policy} covers {run.steps} steps, the trace {trace.steps}")
        return Side(config_label(run.policy, run.params, budget=run.budget), run.policy, run.evicted_at,
                    run.budget, dict(run.params), trace)

    pair = Pair(side(run_a), None if run_b is None else side(run_b), tokens=trace.tokens, slots=slots,
                title=f"{trace.name}: " + " vs ".join(
                    config_label(r.policy, r.params, budget=r.budget) for r in (run_a, run_b) if r is not None))
    return StepView(pair, step, window)


def _config(configs, which, what: str) -> int:
    labels = [c["label"] if isinstance(c, dict) else c.label for c in configs]
    if isinstance(which, str):
        if which not in labels:
            raise ValueError(f"{what} must be a configuration's index or label, one of {labels}; "
                             f"got {which!r}")
        return labels.index(which)
    if isinstance(which, bool) or not isinstance(which, (int, np.integer)) or not 0 <= which < len(labels):
        raise ValueError(f"{what} must be an index in 0..{len(labels) - 1} or a label, got {which!r}")
    return int(which)


def _layer_head(shape, layer: int, head: int, layers=None) -> tuple[int, int]:
    """Indices into (layers, heads) of a result's eviction logs; `layers` the model layer
    numbers stored (None: every layer, by index)."""
    names = list(range(shape[0])) if layers is None else list(layers)
    if layer not in names:
        raise ValueError(f"layer must be one of the stored layers {names}, got {layer!r}")
    if isinstance(head, bool) or not isinstance(head, (int, np.integer)) or not 0 <= head < shape[1]:
        raise ValueError(f"head must be in 0..{shape[1] - 1}, got {head!r}")
    return names.index(layer), int(head)


def loop(result, a=1, b=None, *, layer: int | None = None, head: int = 0, step: int | None = None,
         window: int = WINDOW, slots: int = SLOTS) -> StepView:
    """Configurations `a` (and `b`) of a closed-loop `LoopResult` (an index or a label) at one
    model `layer` (default: the first with recorded rows) and KV `head`. Their scores are
    replayed from the rows the model produced, over the steps rows were recorded for."""
    ia, ib = _config(result.configs, a, "a"), None if b is None else _config(result.configs, b, "b")
    layer = (result.rows_layers or result.layers)[0] if layer is None else layer
    _layer_head(result.evicted_at.shape[1:], layer, head, result.layers)

    def side(c):
        run, cfg = result.run(c, layer, head), result.configs[c]
        rows = result.trace(c, layer, head) if result.rows is not None and layer in result.rows_layers else None
        return Side(config_label(cfg.policy, cfg.params, budget=cfg.budget), cfg.policy, run.evicted_at,
                    run.budget, dict(run.params), rows)

    pair = Pair(side(ia), None if ib is None else side(ib), tokens=result.tokens, slots=slots,
                title=f"loop, layer {layer}, {result.heads[head]}")
    return StepView(pair, step, window)


def generation(gen, a=1, b=None, *, layer: int = 0, head: int = 0, step: int | None = None,
               window: int = WINDOW, slots: int = SLOTS) -> StepView:
    """Configurations `a` (and `b`) of a `Generation` (an index or a label) at model `layer`
    and KV `head`: prompt and generated tokens; held slots and victims (no rows recorded)."""
    ia, ib = _config(gen.configs, a, "a"), None if b is None else _config(gen.configs, b, "b")
    li, h = _layer_head(gen.evicted_at.shape[1:], layer, head)

    def side(c):
        cfg = gen.configs[c]
        ev = gen.evicted_at[c, li, h]
        return Side(config_label(cfg.policy, cfg.params, budget=cfg.budget), cfg.policy, ev, cfg.budget or len(ev),
                    dict(cfg.params))

    c0 = ia
    tokens = list(gen.tokens) + (list(gen.pieces[c0]) if gen.pieces else [])
    pair = Pair(side(ia), None if ib is None else side(ib), tokens=tokens, slots=slots,
                title=f"generation, layer {layer}, head {head}")
    return StepView(pair, step, window)


def needle(run: dict, a=1, b=None, *, layer: int = 0, head: int = 0, step: int | None = None,
           window: int = WINDOW, slots: int = SLOTS) -> StepView:
    """Configurations `a` (and `b`) of a pass-key run (kvviz.model.needle.results.read_run)
    at model `layer` and KV `head`, the key's positions shaded; the step starts at the end of
    the prompt. Held slots and victims (no rows recorded)."""
    meta, ev = run["meta"], np.asarray(run["evicted_at"], np.int64)
    ia, ib = _config(meta["configs"], a, "a"), None if b is None else _config(meta["configs"], b, "b")
    li, h = _layer_head(ev.shape[1:3], layer, head)

    def side(c):
        cfg = meta["configs"][c]
        return Side(config_label(cfg["policy"], cfg["params"], budget=cfg["budget"]), cfg["policy"], ev[c, li, h],
                    cfg["budget"] or ev.shape[-1], dict(cfg["params"]))

    pair = Pair(side(ia), None if ib is None else side(ib), tokens=[str(t) for t in run["tokens"]],
                slots=slots, key_positions=meta["key_positions"], prompt_len=int(meta["prompt_len"]),
                title=f"pass key {meta['id']}, layer {layer}")
    first = int(meta["prompt_len"]) - 1 if step is None else step
    return StepView(pair, first, window)


def heads(trace, allocator: str = "adakv", scorer: str = "snapkv", budget: int = 64, *, layer: int = 0,
          head: int = 0, step: int | None = None, window: int = WINDOW, slots: int = SLOTS) -> StepView:
    """An allocator beside its scorer alone at the same per-head budget, on `trace` (a path,
    or kvviz.core.layers.load_layers's grid) captured per KV head: the Heads picture (held
    slots per head over time) and, at `layer`'s `head`, the cache of the two, the scorer's
    scores replayed from that head's rows (the allocator's held slots and victims)."""
    from kvviz.core.layers import load_layers

    grid = load_layers(trace) if isinstance(trace, (str, Path)) else trace
    r = allocator_runs(grid, allocator, scorer, budget)
    layers = list(r["layers"])
    li, h = _layer_head((len(layers), len(grid[0])), layer, head, layers)
    alloc_run, alone = r["runs"][li][h], r["alone"][li][h]
    tr = grid[li][h]
    label = f"{allocator} ({scorer})"
    roles = r["roles"] if any(x is not None for x in r["roles"]) else None

    def heads_picture(s):
        return heads_figure(r["held"], r["plain"], layers, r["budgets"], label=label,
                            plain_label=f"{scorer} alone", budget=budget, roles=roles, step=s)

    a = Side(config_label(allocator, {"scorer": scorer}, budget=budget), allocator, alloc_run.evicted_at, budget)
    b = Side(config_label(scorer, {}, budget=budget), scorer, alone.evicted_at, budget, {}, tr)
    pair = Pair(a, b, tokens=tr.tokens, slots=slots, extra=("heads", heads_picture),
                title=f"{label} vs {scorer} alone, layer {layer}, kv{head}")
    return StepView(pair, step, window)
