"""What following the lecturer costs the server: the figures behind kvviz.app.ui.follow.POLL_S.

    .venv/bin/python scripts/follow_cost.py [--students 3] [--seconds 20] [--moves 5]

A development tool (the app never imports it). Starts `streamlit run app.py`, opens a
lecturer's page and `--students` following pages in headless Chromium, and reads the server
process's CPU time (/proc) over three phases: students following with nobody moving (their
poll ticks), the students gone (the idle floor), and the lecturer pressing K `--moves`
times, alone and then followed (each student's rerun after a move). Prints ms of server
CPU per poll tick and per student rerun, the 1-minute load average (on a shared machine the
figures follow it), and what a queue model of those figures predicts for the p95 follow
delay of 30 and 60 students at several poll intervals. The load test (scripts/loadtest.py)
measures the real crowd.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import measure_latency as M

MAIN = '[data-testid="stMain"]'
SHOWS = ("(s) => new RegExp('evicted at step ' + s + '(?!\\\\d)')"
         ".test(document.querySelector('[data-testid=\"stMain\"]').innerText)")


def cpu(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def step(page) -> int:
    return int(re.search(r"evicted at step (\d+)", page.locator(MAIN).inner_text()).group(1))


def moves(lect, pages, n: int) -> None:
    for _ in range(n):
        s = step(lect) + 1
        lect.locator("body").press("k")
        for p in (lect, *pages):
            p.wait_for_function(SHOWS, arg=s, polling=50, timeout=60_000)
        for p in (lect, *pages):
            M.wait_idle(p, timeout=60_000)
        time.sleep(1.0)


def measure(students: int, seconds: float, n_moves: int) -> dict:
    from playwright.sync_api import sync_playwright

    # read, not imported: importing the page's module would start Streamlit's machinery here
    POLL_S = float(re.search(r"^POLL_S = ([\d.]+)", (M.REPO / "kvviz/app/ui/follow.py")
                             .read_text(), re.M).group(1))
    port = M.free_port()
    proc = M.start_server(port)
    try:
        M.wait_health(port, proc)
        url = f"http://127.0.0.1:{port}"
        with sync_playwright() as p:
            b = p.chromium.launch(executable_path=M.CHROMIUM, args=M.CHROMIUM_ARGS,
                                  headless=True)
            ctx = b.new_context(viewport={"width": 1280, "height": 900})
            lect = ctx.new_page()
            lect.goto(url + "/")
            lect.wait_for_selector(f'{MAIN} [data-testid="stPlotlyChart"] .main-svg',
                                   state="attached", timeout=240_000)
            M.wait_idle(lect)
            lect.get_by_role("button", name="Open a class").click()
            side = lect.locator('[data-testid="stSidebar"]')
            side.get_by_text(re.compile(r"follow=[A-Z2-9]{6}")).wait_for()
            code = re.search(r"follow=([A-Z2-9]{6})", side.inner_text()).group(1)
            M.wait_idle(lect)
            c0 = cpu(proc.pid)
            moves(lect, [], n_moves)
            alone = (cpu(proc.pid) - c0) / n_moves
            pages = [ctx.new_page() for _ in range(students)]
            for s in pages:
                s.goto(f"{url}/?follow={code}")
                s.get_by_text("Following the lecturer").wait_for(timeout=120_000)
                M.wait_idle(s, timeout=120_000)
            time.sleep(3)

            def rate():
                c, t = cpu(proc.pid), time.monotonic()
                time.sleep(seconds)
                return (cpu(proc.pid) - c) / (time.monotonic() - t)

            following = rate()
            c0, t0 = cpu(proc.pid), time.monotonic()
            moves(lect, pages, n_moves)
            followed, wall = cpu(proc.pid) - c0, time.monotonic() - t0
            for s in pages:
                s.close()
            time.sleep(3)
            idle = rate()
            b.close()
    finally:
        M.stop_server(proc)
    tick = (following - idle) * POLL_S / students
    ticks_in_moves = (following - idle) * wall
    rerun = (followed - alone * n_moves - idle * wall - ticks_in_moves) / (students * n_moves)
    return {"poll_s": POLL_S, "students": students, "tick_ms": round(tick * 1000, 2),
            "lecturer_rerun_ms": round(alone * 1000), "student_rerun_ms": round(rerun * 1000),
            "load_1min": round(os.getloadavg()[0], 2)}


def model_p95(tick_s: float, rerun_s: float, n: int, poll_s: float, trials: int = 2000) -> float:
    """p95 of the delay from a publish to a student's rerun done, for `n` students whose
    polls find it uniformly over 0..poll_s and whose reruns queue one at a time (one
    interpreter), each slowed by the share of the server the other students' ticks take."""
    import numpy as np

    busy = n * tick_s / poll_s
    if busy >= 1:
        return float("inf")
    rerun = rerun_s / (1 - busy)
    rng = np.random.default_rng(0)
    out = []
    for _ in range(trials):
        t = 0.0
        for found in np.sort(rng.uniform(0, poll_s, n)):
            t = max(t, found) + rerun
            out.append(t)
    return float(np.percentile(out, 95))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--students", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--moves", type=int, default=5)
    a = ap.parse_args(argv)
    if a.students < 1 or a.seconds <= 0 or a.moves < 1:
        print("follow_cost: --students and --moves must be >= 1, --seconds > 0", file=sys.stderr)
        return 2
    fig = measure(a.students, a.seconds, a.moves)
    for k, v in fig.items():
        print(f"{k}: {v}")
    tick, rerun = fig["tick_ms"] / 1000, max(fig["student_rerun_ms"], 1) / 1000
    for n in (30, 60):
        row = ", ".join(f"{t} s: {model_p95(tick, rerun, n, t):.2f}"
                        for t in (0.5, 0.75, 1.0, 1.25))
        print(f"model p95 follow after the lecturer's run, {n} students, by poll interval: {row}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
