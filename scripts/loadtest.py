"""Load test: a class of N students on one server (issue 9, item 13). A script, not a test.

    python scripts/loadtest.py                                # N = 10, 30, 60, then a browser round
    python scripts/loadtest.py --sizes 30 --browser 0 --json artifacts/load.json
    python scripts/loadtest.py --launcher kvviz               # servers started by `kvviz app`

For each N, a fresh server (`streamlit run app.py`, or `kvviz app` with --launcher kvviz;
headless, 127.0.0.1, port in 8621-8649), once it answers its health check:
  cold  N sessions open the default page at the same moment (nobody has loaded it yet: with
        `streamlit run` nothing is imported or cached; `kvviz app` drew the default page once
        before it listened), then all move B's poolKernel 5 -> 7 at once, then the step +1;
  warm  the sessions close, and N new ones do the same on that server (imports and the default
        page's replays cached), moving poolKernel 5 -> 9 (a value the server has not replayed
        yet) and the step +1.
Sessions are protocol-level clients (scripts/stclient.py): Streamlit's websocket as the
frontend speaks it, so the figures are the server's, not a browser's (one Chromium drawing 30
pages on 2 cores would measure itself). A slider move is a rerun carrying that widget's new
value, as the frontend sends it.

Measured: first chart (connect -> the cache heatmap received), update (rerun sent -> the
redrawn chart received), errors (exceptions, st.error boxes, protocol failures, a missing
chart), server RSS (peak while the round runs, sampled every 50 ms; idle 5 s after its
sessions closed), and per warm page load: server CPU seconds and bytes (all, and plotly's).
Then a browser round: a few headless Chromium pages (Debian's /usr/bin/chromium, playwright)
on a warm server, each checked to draw the heatmap image and redraw after a poolKernel move.
Other processes on the machine skew every figure: the script prints the load average.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import stclient as C  # noqa: E402

QUERY = "?trace=canonical&budget=512&a=tova&b=snapkv&step=1300&view=cache"
PAGE_TITLE = "Cache contents over time: A = tova, B = snapkv"


# --- the server process ------------------------------------------------------------------------
def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class PeakRSS:
    """Samples the server's RSS every `every` seconds while in the `with` block."""

    def __init__(self, pid: int, every: float = 0.05):
        self.pid, self.every, self.peak = pid, every, 0.0
        self._stop = threading.Event()

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_mb(self.pid))
            self._stop.wait(self.every)

    def __enter__(self):
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss_mb(self.pid))


# --- one class round ---------------------------------------------------------------------------
def errors_of(r) -> list[str]:
    if isinstance(r, BaseException):
        return [f"{type(r).__name__}: {r}"]
    out = [f"{t}: {m}" for t, m, _ in r.exceptions] + [f"st.error: {e}" for e in r.errors]
    if r.status != "FINISHED_SUCCESSFULLY":
        out.append(f"script {r.status}")
    return out


async def class_round(url: str, n: int, pool_to: int, timeout: float) -> dict:
    """n sessions load the page at once, then all move poolKernel, then all move the step."""
    sessions = [C.Session(url, QUERY, timeout) for _ in range(n)]
    errors: list[str] = []

    async def load(s):
        t0 = time.perf_counter()
        await s.connect()
        r = await s.run()
        r.connect_s = time.perf_counter() - t0 - r.seconds  # handshake, before the request
        return r

    loads = await asyncio.gather(*(load(s) for s in sessions), return_exceptions=True)
    first, load_bytes, chart_bytes = [], [], []
    for r in loads:
        errors += errors_of(r)
        if isinstance(r, BaseException):
            continue
        if r.chart_with(PAGE_TITLE) is None:
            errors.append("no cache chart on load")
        else:
            first.append(r.connect_s + r.chart_with(PAGE_TITLE))
            load_bytes.append(r.bytes)
            chart_bytes.append(r.chart_bytes)
    alive = [s for s, r in zip(sessions, loads) if not isinstance(r, BaseException)]

    async def move(s, label, value, expect):
        r = await s.set_widget(label, value)
        return r, r.chart_with(expect)

    updates = {}
    for label, value, expect in (("poolKernel", pool_to, f"poolKernel={pool_to}"),
                                 ("step", 1301, '"step 1301"')):
        res = await asyncio.gather(*(move(s, label, value, expect) for s in alive),
                                   return_exceptions=True)
        times = []
        for x in res:
            if isinstance(x, BaseException):
                errors += errors_of(x)
                continue
            r, t = x
            errors += errors_of(r)
            if t is None:
                errors.append(f"{label}: no redrawn chart with {expect!r}")
            else:
                times.append(t)
            if label == "step" and r.chart_with(f"poolKernel={pool_to}") is None:
                # only the moved widget is sent: the others must keep their values
                errors.append("the step move lost the poolKernel setting")
        updates[label] = times
    await asyncio.gather(*(s.close() for s in sessions), return_exceptions=True)
    return {"first_chart_s": first, "update_s": updates["poolKernel"] + updates["step"],
            "update_pool_s": updates["poolKernel"], "update_step_s": updates["step"],
            "errors": errors, "load_bytes": load_bytes, "chart_bytes": chart_bytes}


def per_load_cost(url: str, pid: int, loads: int = 8) -> dict:
    """Server CPU and bytes of one page load on a warm server, one session at a time."""
    async def go():
        out = []
        for _ in range(loads):
            c0 = cpu_s(pid)
            async with C.Session(url, QUERY) as s:
                r = await s.run()
            out.append((cpu_s(pid) - c0, r.bytes, r.chart_bytes, r.seconds))
        return out
    rows = asyncio.run(go())
    med = statistics.median
    return {"cpu_s": med(r[0] for r in rows), "bytes": med(r[1] for r in rows),
            "chart_bytes": med(r[2] for r in rows), "seconds": med(r[3] for r in rows)}


def stats(xs) -> dict:
    if not xs:
        return {"p50": None, "p95": None, "max": None, "n": 0}
    xs = sorted(xs)
    p95 = xs[min(len(xs) - 1, max(0, int(round(0.95 * len(xs))) - 1))]  # nearest rank
    return {"p50": statistics.median(xs), "p95": p95, "max": xs[-1], "n": len(xs)}


def run_size(n: int, timeout: float, settle: float, repo: Path = REPO,
             launcher: str = "streamlit") -> dict:
    port = C.free_port(8621, 8649)
    out = {"n": n, "launcher": launcher}
    with C.Server(repo, port, launcher=launcher) as srv:
        out["ready_s"] = srv.ready_s
        out["rss_start_mb"] = rss_mb(srv.pid)
        print(f"N={n:3d} server ({launcher}) ready in {srv.ready_s:.1f} s", flush=True)
        for phase, pool_to in (("cold", 7), ("warm", 9)):
            with PeakRSS(srv.pid) as peak:
                t0 = time.perf_counter()
                r = asyncio.run(class_round(srv.url, n, pool_to, timeout))
                r["wall_s"] = time.perf_counter() - t0
            time.sleep(settle)
            r["rss_peak_mb"], r["rss_idle_mb"] = peak.peak, rss_mb(srv.pid)
            out[phase] = r
            print(f"N={n:3d} {phase}: {line(r)}", flush=True)
        out["per_load"] = per_load_cost(srv.url, srv.pid)
        print(f"N={n:3d} per warm page load: server CPU {out['per_load']['cpu_s']:.3f} s, "
              f"{out['per_load']['bytes'] / 1024:.0f} KB sent, of which charts "
              f"{out['per_load']['chart_bytes'] / 1024:.0f} KB", flush=True)
    return out


def fmt(s: dict) -> str:
    return "–" if s["p50"] is None else f"{s['p50']:.2f} / {s['p95']:.2f} / {s['max']:.2f}"


def line(r: dict) -> str:
    return (f"first chart p50/p95/max {fmt(stats(r['first_chart_s']))} s, update "
            f"{fmt(stats(r['update_s']))} s, errors {len(r['errors'])}, RSS peak "
            f"{r['rss_peak_mb']:.0f} MB idle {r['rss_idle_mb']:.0f} MB, wall {r['wall_s']:.1f} s"
            + (f"  first error: {r['errors'][0][:160]}" if r["errors"] else ""))


def table(results: list[dict]) -> str:
    rows = ["| N | server | first chart p50 / p95 / max (s) | update p50 / p95 / max (s) | "
            "errors | RSS peak / idle (MB) |", "|---:|---|---|---|---:|---|"]
    for res in results:
        for phase in ("cold", "warm"):
            r = res[phase]
            rows.append(f"| {res['n']} | {phase} | {fmt(stats(r['first_chart_s']))} | "
                        f"{fmt(stats(r['update_s']))} | {len(r['errors'])} | "
                        f"{r['rss_peak_mb']:.0f} / {r['rss_idle_mb']:.0f} |")
    return "\n".join(rows)


# --- the browser round -------------------------------------------------------------------------
def browser_round(pages: int) -> dict:
    """`pages` headless Chromium pages on one warm server: each must draw the heatmap image
    and redraw after poolKernel moves; page errors are collected."""
    import measure_latency as M
    if not Path(M.CHROMIUM).exists():
        return {"skipped": f"{M.CHROMIUM} not found"}
    from playwright.sync_api import sync_playwright
    port = C.free_port(8621, 8649)
    out = {"pages": pages, "first_chart_s": [], "update_s": [], "errors": []}
    with C.Server(REPO, port) as srv:
        asyncio.run(C.crowd(srv.url, QUERY, 1))  # warm: imports and the default replays
        with sync_playwright() as p:
            _pages(p, M, srv.url, pages, out)
    return out


def _pages(p, M, url: str, pages: int, out: dict) -> None:
    b = p.chromium.launch(executable_path=M.CHROMIUM, args=M.CHROMIUM_ARGS, headless=True)
    try:
        tabs = []
        for _ in range(pages):
            page = b.new_context(viewport={"width": 1280, "height": 900}).new_page()
            page.on("pageerror", lambda e: out["errors"].append(str(e)))
            tabs.append(page)
        t0 = time.perf_counter()
        for page in tabs:  # all loading together
            page.goto(url + "/" + QUERY, wait_until="commit")
        for page in tabs:
            page.wait_for_selector(M.CHART_SEL + " image", state="attached", timeout=180_000)
            out["first_chart_s"].append(time.perf_counter() - t0)
        for page in tabs:
            M.wait_idle(page, timeout=60_000)
            if PAGE_TITLE not in M.chart_text(page):
                out["errors"].append("heatmap title missing")
            out["update_s"].append(M.press_and_wait(page, "poolKernel", "ArrowRight",
                                                    "poolKernel=7"))
    finally:
        b.close()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="10,30,60", help="class sizes (comma-separated)")
    ap.add_argument("--browser", type=int, default=3, help="Chromium pages in the browser "
                    "round (0: none)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds a session waits for "
                    "any one message")
    ap.add_argument("--settle", type=float, default=5, help="seconds after the sessions close "
                    "before idle RSS is read")
    ap.add_argument("--launcher", choices=("streamlit", "kvviz"), default="streamlit",
                    help="streamlit: `streamlit run app.py` (cold: nothing done before the "
                    "first session); kvviz: `kvviz app`, which draws the default page once "
                    "before it listens")
    ap.add_argument("--json", default=None, help="write every figure here")
    ap.add_argument("--repo", type=Path, default=REPO, help="the checkout whose app.py is "
                    "served (e.g. an older commit's, to compare)")
    args = ap.parse_args(argv)
    print("load average before:", " ".join(f"{x:.2f}" for x in os.getloadavg()),
          f"on {os.cpu_count()} cores", flush=True)
    results = [run_size(int(n), args.timeout, args.settle, args.repo, args.launcher)
               for n in args.sizes.split(",")]
    doc = {"load_before": os.getloadavg(), "sizes": results}
    if args.browser:
        doc["browser"] = browser_round(args.browser)
        br = doc["browser"]
        if "skipped" in br:
            print("browser round skipped:", br["skipped"])
        else:
            print(f"browser round, {br['pages']} Chromium pages at once: first chart "
                  f"{fmt(stats(br['first_chart_s']))} s, poolKernel update "
                  f"{fmt(stats(br['update_s']))} s, page errors {len(br['errors'])}")
    doc["load_after"] = os.getloadavg()
    print("load average after:", " ".join(f"{x:.2f}" for x in os.getloadavg()))
    print()
    print(table(results))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
