"""Measure the explorer in a real headless Chromium (also the e2e test's machinery).

    .venv/bin/python scripts/measure_latency.py [--repeat 5] [--launcher streamlit|kvviz]
                                                [--screenshot docs/images/screenshot.png]

A development tool, not part of the kvviz package (the app never imports it).

Starts `streamlit run app.py` (or, with `--launcher kvviz`, `python -m kvviz app`, which
draws the default page before it listens) on port 0 (the port the operating system gives as
the server binds, read from the URL line it prints), waits for /_stcore/health, opens
the page with the canonical trace at budget 512 and times, from navigation start:
  * first pixels: the cache heatmap's pixels on screen (the server-built PNG preview decoded
    and laid out, or Plotly's own image, whichever comes first);
  * interactive: the Plotly heatmap drawn and answering a hover (its label appears);
  each for the first visit after a server starts (`repeat` servers), a fresh browser profile
  on a warm server, and a reload in the same browser;
  * slider change -> updated charts: a key press on the poolKernel / obsWindow / step
    slider -> the chart shows the new setting (title or step marker text changes), on the
    cache view; and the step slider on the scores view (both policies' scores at the new step).
Prints the 1-minute load average beside each figure (the median over its samples, taken as
each starts) and before and after the run: on a shared machine the figures follow it.
Needs the `playwright` package and Debian's /usr/bin/chromium (never `playwright install`).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("KVVIZ_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


# the line a Streamlit server prints once it has bound its port ("URL: http://HOST:PORT")
URL_LINE = re.compile(rb"\bURL: http://[^\s/]+:(\d+)")


class Output:
    """A server's stdout, read on a thread (the pipe never fills): its lines (each also written
    to `log`, a binary file, if given) and the port it printed once it had bound one. Servers
    here listen on port 0, so the operating system picks a free port as the socket binds (no
    port found free first and taken by another process before the server binds it), and the
    server's own URL line says which."""

    def __init__(self, proc: subprocess.Popen, log=None):
        self.lines: list[bytes] = []
        self.port: int | None = None
        self._said = threading.Event()
        threading.Thread(target=self._read, args=(proc.stdout, log), daemon=True).start()

    def _read(self, stream, log) -> None:
        for line in stream:
            self.lines.append(line)
            if log is not None:  # a binary file the caller reads as it grows
                log.write(line)
                log.flush()
            m = URL_LINE.search(line)
            if m and self.port is None:
                self.port = int(m.group(1))
                self._said.set()
        self._said.set()  # the end of the output: the server has ended

    def text(self) -> str:
        return b"".join(self.lines).decode(errors="replace")

    def wait_port(self, timeout: float) -> int:
        """The port, once the server has printed it (a TimeoutError after `timeout` s, a
        RuntimeError with its output if it ended without)."""
        if not self._said.wait(timeout):
            raise TimeoutError(f"the server printed no URL in {timeout:.0f} s:\n{self.text()}")
        if self.port is None:
            raise RuntimeError(f"the server ended without listening:\n{self.text()}")
        return self.port


def start_server(env: dict | None = None, launcher: str = "streamlit",
                 port: int = 0) -> tuple[subprocess.Popen, Output]:
    """`streamlit run app.py` (cold: nothing imported or replayed before the first visit) or
    `python -m kvviz app` (the README's first command: the default page drawn before it
    listens), on `port` (0: one the operating system picks; `Output.wait_port` says which)."""
    flags = ["--server.port", str(port), "--server.address", "127.0.0.1",
             "--server.headless", "true", "--browser.gatherUsageStats", "false"]
    cmd = ([sys.executable, "-m", "kvviz", "app", *flags] if launcher == "kvviz" else
           [sys.executable, "-m", "streamlit", "run", "app.py", *flags])
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    return proc, Output(proc)


def wait_health(port: int, proc: subprocess.Popen, timeout: float = 60,
                out: Output | None = None) -> float:
    """Until the server on `port` answers its health check ("ok"); the seconds it took. `out`:
    its Output, which owns its stdout, for the message if it ends first."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if proc.poll() is not None:
            said = out.text() if out else ""
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{said}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2) as r:
                if r.read().strip() == b"ok":
                    return time.perf_counter() - start
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError("the server did not report healthy")


def started(proc: subprocess.Popen, out: Output, timeout: float) -> str:
    """The URL of a server from start_server once it is healthy (within `timeout` s)."""
    t0 = time.perf_counter()
    port = out.wait_port(timeout)
    wait_health(port, proc, timeout - (time.perf_counter() - t0), out)
    return f"http://127.0.0.1:{port}"


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)  # the group we started (start_new_session)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


@contextlib.contextmanager
def server(env: dict | None = None, launcher: str = "streamlit"):
    """A server from start_server, healthy: its URL. On port 0 (the operating system picks
    one) unless $KVVIZ_PORT names one."""
    proc, out = start_server(env, launcher, int(os.environ.get("KVVIZ_PORT", 0)))
    try:
        yield started(proc, out, timeout=300 if launcher == "kvviz" else 60)
    finally:
        stop_server(proc)


@contextlib.contextmanager
def browser(viewport=(1500, 1300)):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            ctx = b.new_context(viewport={"width": viewport[0], "height": viewport[1]})
            yield ctx.new_page()
        finally:
            b.close()


# --- page helpers ------------------------------------------------------------------------
CHART_SEL = '[data-testid="stPlotlyChart"] .js-plotly-plot'


def wait_idle(page, timeout=30_000) -> None:
    """Until Streamlit is not running a script (the status widget goes away)."""
    page.wait_for_function(
        "() => !document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=timeout)


# the page at rest: no script running, no element marked stale by a rerun, no finite animation
# or CSS transition running (the sidebar's slide; a looping spinner never ends), the fonts loaded, and the layout (every
# element's box) the same over three animation frames in a row
SETTLED_JS = """async (ms) => {
  const end = performance.now() + ms;
  const busy = () => document.querySelector('[data-testid="stStatusWidget"], [data-stale="true"]')
    || document.getAnimations().some(a => a.playState === 'running'
                                     && a.effect?.getTiming().iterations !== Infinity);
  const boxes = () => [...document.querySelectorAll('[data-testid]')].map(e => {
    const r = e.getBoundingClientRect(); return `${r.x},${r.y},${r.width},${r.height}`; }).join(';');
  await document.fonts.ready;
  let last = null;
  for (let same = 0; same < 3;) {
    if (performance.now() > end) return false;
    await new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)));
    const now = busy() ? null : boxes();
    same = now !== null && now === last ? same + 1 : 0;
    last = now;
  }
  return true;
}"""


def wait_settled(page, timeout=30_000) -> None:
    """Until the page is at rest (SETTLED_JS): what a screenshot or a reading of the layout
    waits for, instead of a pause."""
    wait_idle(page, timeout)
    if not page.evaluate(SETTLED_JS, timeout):
        raise TimeoutError(f"the page did not come to rest in {timeout / 1000:.0f} s")


def wait_chart_text(page, text: str, timeout=30_000) -> None:
    page.wait_for_function(
        "(t) => [...document.querySelectorAll('[data-testid=\"stPlotlyChart\"]')]"
        ".some(e => e.textContent.includes(t))", arg=text, timeout=timeout)


def chart_text(page) -> str:
    return page.evaluate("() => [...document.querySelectorAll('[data-testid=\"stPlotlyChart\"]')]"
                         ".map(e => e.textContent).join(' | ')")


def slider(page, label: str):
    """The role=slider thumb of the Streamlit slider labelled `label`."""
    box = page.locator('[data-testid="stSlider"]').filter(has_text=label).first
    return box.get_by_role("slider")


def load_first_chart(page, url: str) -> float:
    """Navigation -> the Plotly heatmap drawn (its image in the DOM)."""
    start = time.perf_counter()
    page.goto(url, wait_until="commit")
    page.wait_for_selector(CHART_SEL + " image", state="attached", timeout=60_000)
    return time.perf_counter() - start


# the heatmap's pixels on screen: the server-built preview PNG decoded and laid out, or the
# Plotly chart's own image (whichever comes first)
PIXELS_JS = """() => {
  const i = document.querySelector('.kv-preview img');
  if (i && i.complete && i.naturalWidth > 0 && i.getBoundingClientRect().height > 0) return true;
  return !!document.querySelector('[data-testid="stPlotlyChart"] .js-plotly-plot image');
}"""


def wait_hover(page, timeout: float = 60) -> None:
    """Until the heatmap answers a hover: the pointer over its plot area brings up a label."""
    page.wait_for_selector(CHART_SEL + " image", state="attached", timeout=timeout * 1000)
    end = time.perf_counter() + timeout
    i = 0
    while time.perf_counter() < end:
        box = page.locator(CHART_SEL + " .nsewdrag").first.bounding_box()
        if box:
            page.mouse.move(box["x"] + box["width"] * 0.3 + i % 2,
                            box["y"] + box["height"] * 0.6)
            if page.query_selector(CHART_SEL + " .hoverlayer .hovertext"):
                return
        i += 1
        time.sleep(0.02)
    raise TimeoutError("the heatmap never showed a hover label")


def load_timed(page, url: str) -> tuple[float, float]:
    """(navigation -> first pixels of the heatmap, navigation -> the heatmap answers a hover)."""
    start = time.perf_counter()
    page.goto(url, wait_until="commit")
    page.wait_for_function(PIXELS_JS, timeout=60_000, polling="raf")
    pixels = time.perf_counter() - start
    wait_hover(page)
    return pixels, time.perf_counter() - start


def press_and_wait(page, label: str, key: str, expect_text: str) -> float:
    thumb = slider(page, label)
    thumb.focus()
    start = time.perf_counter()
    thumb.press(key)
    wait_chart_text(page, expect_text)
    return time.perf_counter() - start


def measure(repeat: int = 3, screenshot: str | None = None, launcher: str = "streamlit") -> dict:
    """Latencies in seconds. Each first-chart case has two figures: *pixels* (navigation ->
    the heatmap's pixels on screen) and *interactive* (navigation -> it answers a hover).
    cold: the first visit after the server starts (fresh browser, empty caches), over
    `repeat` server starts; new_browser: a fresh browser profile (nothing cached, plotly.js
    fetched and parsed again) on a warm server; reload: reloading in the same browser; then
    key presses on sliders until the chart shows the change."""
    cold, cold_i, fresh, fresh_i, loads, loads_i = [], [], [], [], [], []
    pool, obs, step, scores = [], [], [], []
    load = {"cold": [], "new_browser": [], "reload": [], "sliders": []}  # 1-min load averages

    def note(case):
        load[case].append(os.getloadavg()[0])

    q = "?trace=canonical&budget=512&a=tova&b=snapkv&view=cache"
    for i in range(repeat - 1):  # the other cold visits, each on a server of its own
        with server(launcher=launcher) as url, browser() as page:
            note("cold")
            px, inter = load_timed(page, url + "/" + q + f"&step={1000 + i}")
            cold.append(px)
            cold_i.append(inter)
    with server(launcher=launcher) as url:
        with browser() as page:
            note("cold")
            px, inter = load_timed(page, url + "/" + q + "&step=1050")
            cold.append(px)
            cold_i.append(inter)
        for i in range(repeat):
            with browser() as page:
                note("new_browser")
                px, inter = load_timed(page, url + "/" + q + f"&step={1100 + i}")
                fresh.append(px)
                fresh_i.append(inter)
        with browser() as page:
            for i in range(repeat):
                note("reload")
                px, inter = load_timed(page, url + "/" + q + f"&step={1200 + i}")
                loads.append(px)
                loads_i.append(inter)
                wait_idle(page)
            # poolKernel 5 -> 7 -> 9 ..., obsWindow 16 -> 17 ..., step +1
            note("sliders")
            for i in range(repeat):
                pool.append(press_and_wait(page, "poolKernel", "ArrowRight",
                                           f"poolKernel={5 + 2 * (i + 1)}"))
                wait_idle(page)
            for i in range(repeat):
                obs.append(press_and_wait(page, "obsWindow", "ArrowRight", f"obsWindow={17 + i}"))
                wait_idle(page)
            cur = int(page.evaluate("() => new URL(location.href).searchParams.get('step')"))
            for i in range(repeat):
                step.append(press_and_wait(page, "step", "ArrowRight", f"step {cur + i + 1}"))
                wait_idle(page)
            # the scores view: a step change needs both policies' scores at the new step
            page.goto(url + "/" + q.replace("view=cache", "view=scores") + "&step=2000")
            wait_chart_text(page, "at step 2000")
            wait_idle(page)
            for i in range(repeat):
                scores.append(press_and_wait(page, "step", "ArrowRight", f"at step {2001 + i}"))
                wait_idle(page)
            note("sliders")
            if screenshot:
                page.goto(url + "/?trace=canonical&budget=512&a=tova&b=snapkv&step=1300&view=cache")
                page.wait_for_selector(CHART_SEL + " image", state="attached", timeout=60_000)
                wait_settled(page)
                page.screenshot(path=screenshot)
    med = statistics.median

    def stats(xs, case):
        return {"median": med(xs), "max": max(xs), "all": xs, "load1": med(load[case])}

    return {"first_pixels_cold_s": stats(cold, "cold"),
            "interactive_cold_s": stats(cold_i, "cold"),
            "first_pixels_new_browser_s": stats(fresh, "new_browser"),
            "interactive_new_browser_s": stats(fresh_i, "new_browser"),
            "first_pixels_reload_s": stats(loads, "reload"),
            "interactive_reload_s": stats(loads_i, "reload"),
            "poolKernel_s": stats(pool, "sliders"), "obsWindow_s": stats(obs, "sliders"),
            "step_s": stats(step, "sliders"), "step_scores_view_s": stats(scores, "sliders")}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--screenshot", default=None)
    ap.add_argument("--launcher", choices=("streamlit", "kvviz"), default="streamlit",
                    help="start the server with `streamlit run app.py` (cold) or `kvviz app` "
                    "(warmed before it listens)")
    args = ap.parse_args(argv)
    load_before = os.getloadavg()
    res = measure(args.repeat, args.screenshot, args.launcher)
    res["load_average"] = {"before": load_before, "after": os.getloadavg()}
    print(f"server: {args.launcher}; load average (1, 5, 15 min) before "
          f"{', '.join(f'{x:.2f}' for x in load_before)}, after "
          f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for k, v in res.items():
        if "median" in v:
            print(f"{k:28s} median {v['median']:.2f} s  max {v['max']:.2f} s  "
                  f"({', '.join(f'{x:.2f}' for x in v['all'])})  load {v['load1']:.1f}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
