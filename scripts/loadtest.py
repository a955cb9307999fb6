"""Load test: a class of N students on one server. A script, not a test.

    python scripts/loadtest.py                                # N = 10, 30, 60, then a browser round
    python scripts/loadtest.py --sizes 30 --browser 0 --json artifacts/load.json
    python scripts/loadtest.py --launcher kvviz               # servers started by `kvviz app`
    python scripts/loadtest.py --class 10,30,60               # a class following and voting
    python scripts/loadtest.py --class 30 --workers 2         # the class on 2 processes, Caddy

--class: per size N a fresh `kvviz app`, one lecturer and N students
following it and voting (class_session below: what is measured and how).

--workers N (with --launcher kvviz, the default with --class): the server is `kvviz app
--workers N`, N Streamlit processes behind Caddy; every session connects through the proxy
(a GET of the page first, as a browser does, so its websocket carries the proxy's sticky
cookie). Server CPU and RSS are then the sums over the worker processes; the proxy's CPU is
counted in its own column.

For each N, a fresh server (`streamlit run app.py`, or `kvviz app` with --launcher kvviz;
headless, 127.0.0.1, a free port from the operating system), once it answers its health check:
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
import random
import re
import statistics
import sys
import threading
import time
from pathlib import Path
from urllib.parse import parse_qs

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import stclient as C  # noqa: E402

QUERY = "?trace=canonical&budget=512&a=tova&b=snapkv&step=1300&view=cache"
PAGE_TITLE = "Cache contents over time: A = tova, B = snapkv"


# --- the server process ------------------------------------------------------------------------
def server_port(workers: int) -> int:
    """0 for one server: it binds port 0 and says which port it got (stclient.Server). The
    proxy of `kvviz app --workers N` (Caddy) reports no port it picked, so it gets one found
    free by binding port 0 and closing: another process could take it before Caddy binds it,
    which then fails to start (a failed run, never a wrong measurement)."""
    if workers == 1:
        return 0
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def server_procs(srv: C.Server) -> tuple[list[int], list[int]]:
    """(the server's processes, the proxy's): the server itself; with --workers, the
    launcher's workers and its Caddy."""
    if srv.workers == 1:
        return [srv.pid], []
    kids = srv.children()
    proxy = [p for p, cmd in kids.items() if cmd.split()[0].endswith("caddy")]
    return [p for p in kids if p not in proxy], proxy


def rss_sum(pids: list[int]) -> float:
    return sum(rss_mb(p) for p in pids)


def cpu_sum(pids: list[int]) -> float:
    return sum(cpu_s(p) for p in pids)


class PeakRSS:
    """Samples the servers' RSS (summed over `pids`) every `every` seconds while in the `with`
    block."""

    def __init__(self, pids: list[int], every: float = 0.05):
        self.pids, self.every, self.peak = pids, every, 0.0
        self._stop = threading.Event()

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_sum(self.pids))
            self._stop.wait(self.every)

    def __enter__(self):
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss_sum(self.pids))


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


def per_load_cost(url: str, pids: list[int], loads: int = 8) -> dict:
    """Server CPU and bytes of one page load on a warm server, one session at a time."""
    async def go():
        out = []
        for _ in range(loads):
            c0 = cpu_sum(pids)
            async with C.Session(url, QUERY) as s:
                r = await s.run()
            out.append((cpu_sum(pids) - c0, r.bytes, r.chart_bytes, r.seconds))
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
             launcher: str = "streamlit", workers: int = 1) -> dict:
    out = {"n": n, "launcher": launcher, "workers": workers}
    with C.Server(repo, server_port(workers), launcher=launcher, workers=workers) as srv:
        pids, _ = server_procs(srv)
        out["ready_s"] = srv.ready_s
        out["rss_start_mb"] = rss_sum(pids)
        print(f"N={n:3d} server ({launcher}, {workers} worker{'s' * (workers > 1)}) ready in "
              f"{srv.ready_s:.1f} s", flush=True)
        for phase, pool_to in (("cold", 7), ("warm", 9)):
            with PeakRSS(pids) as peak:
                t0 = time.perf_counter()
                r = asyncio.run(class_round(srv.url, n, pool_to, timeout))
                r["wall_s"] = time.perf_counter() - t0
            time.sleep(settle)
            r["rss_peak_mb"], r["rss_idle_mb"] = peak.peak, rss_sum(pids)
            out[phase] = r
            print(f"N={n:3d} {phase}: {line(r)}", flush=True)
        out["per_load"] = per_load_cost(srv.url, pids)
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


# --- a class: one lecturer, N students following and voting ------------
CODE_RX = re.compile(rb"follow=([A-Z2-9]{6})")
VOTES_RX = re.compile(rb'"text":\s*"[^"]*?\b(\d+) votes?\b')  # the histogram's title
NEXT, STEP = "nav.next", "w.step"
OPEN, ASK, REVEAL, CLOSE = "class.open", "predict.ask.a", "predict.reveal", "predict.close"
GUESS, VOTE = "predict.guess", "predict.vote"
QUIET_S = 3.0  # class: the quiet spell before the moves (the server's idle cost of a class)
ON_OWN_RX = re.compile(rb"exploring on your own")  # a follower the page thinks moved itself


def step_of(query: str) -> int | None:
    got = parse_qs(query).get("step")
    return int(got[0]) if got else None


def held_positions(query: str) -> list[int]:
    """The guesses a student may give for "which position will A evict next?" asked at the
    lecturer's step: the positions A holds just before that eviction, replayed by kvviz
    itself (the same trace, policy and budget as the page's link)."""
    if str(REPO) not in sys.path:
        sys.path.insert(1, str(REPO))
    from kvviz.app.teach.question import next_eviction
    from kvviz.core.replay import run_policy
    from kvviz.core.trace import canonical
    q = {k: v[0] for k, v in parse_qs(query).items()}
    if q.get("trace", "canonical") != "canonical":
        raise ValueError(f"trace={q['trace']!r}: the class driver replays the canonical trace")
    run = run_policy(canonical(), q.get("a", "tova"), int(q.get("budget", 512)))
    question = next_eviction(run.evicted_at, int(q.get("step", 0)))
    if question is None:
        raise ValueError("A evicts nothing after the lecturer's step: no question to ask")
    return list(question.held)


SAME = ("trace", "layer", "budget", "a", "b", "view", "step")  # what a follower shares


def same_page(query: str) -> dict:
    """The settings a follower's page must share with the lecturer's (its link's keys)."""
    q = parse_qs(query)
    return {k: q[k][0] for k in SAME if k in q}


def arrived(s, since: float, step: int) -> float | None:
    """When a full run of `s` that ended after `since` left its page at `step`, or None."""
    return next((r.finished for r in s.runs if r.full and r.finished is not None
                 and r.finished >= since and step_of(r.query) == step), None)


def code_of(lec) -> str | None:
    """The class code in the student link the lecturer's page shows, once it has."""
    return next((m.group(1).decode() for x in lec.texts
                 for m in [CODE_RX.search(x.encode())] if m), None)


def votes_shown(lec) -> dict[int, float]:
    """Each vote total the lecturer's histogram title showed -> when it first arrived."""
    out = {}
    for text, t in lec.texts.items():
        m = re.search(r"(\d+) votes?", text)
        if m and "follow=" not in text:
            out[int(m.group(1))] = min(t, out.get(int(m.group(1)), t))
    return out


async def class_session(url: str, n: int, moves: int = 6, vote_spread: float = 5.0,
                        timeout: float = 60.0, wait: float = 30.0, seed: int = 0,
                        query: str = QUERY, guesses=held_positions, gap: float = 1.0,
                        join_spread: float = 3.0, cpu=None) -> dict:
    """One lecturer opens a class, n students open its link, the lecturer moves the step
    `moves` times (nav.next, and every other move the step slider), then asks "which position
    will A evict next?", the students vote over `vote_spread` seconds, and the lecturer
    reveals. Students open the link over `join_spread` seconds (so their pages' timers are
    not all in step). Every session is a LiveSession (the page's run_every timers included).
    Follow: the lecturer's move sent -> a follower's whole-page run at that step finished.
    Vote: the k-th vote accepted (its run finished) was sent -> the lecturer's histogram
    title first counted k or more. `cpu`: a function giving the server's CPU seconds so far
    (all its processes); with it, the CPU of each move (sent -> every follower arrived) and of
    a quiet spell before the moves (the pages' timers alone) are recorded."""
    rng = random.Random(seed)
    problems: list[str] = []
    lec = C.LiveSession(url, query, timeout, name="lecturer")
    lec.watch = (CODE_RX, VOTES_RX)
    students = [C.LiveSession(url, "", timeout, name=f"student{i}") for i in range(n)]
    out = {"n": n, "follow_s": [], "vote_s": [], "join_s": [], "problems": problems,
           "move_cpu_s": [], "move_wall_s": []}
    cpu = cpu or (lambda: float("nan"))
    try:
        await lec.start()
        await lec.wait_for(lambda: lec.full_runs_done())
        t = await lec.act(OPEN)
        code = await lec.wait_for(lambda: code_of(lec))
        out["code"] = code
        here = step_of(lec.query)
        t0 = time.perf_counter()
        for s in students:
            s.query = f"follow={code}"
            s.watch = (ON_OWN_RX,)
        offsets = sorted(rng.uniform(0, join_spread) for _ in students)
        await asyncio.gather(*(_join(s, d) for s, d in zip(students, offsets)))
        got = await asyncio.gather(*(_arrive(s, t0, here, wait) for s in students))
        out["join_s"] = [x - t0 - d for x, d in zip(got, offsets) if x is not None]
        problems += [f"{s.name} did not open the class at step {here} within {wait:.0f} s"
                     for s, x in zip(students, got) if x is None]
        problems += [f"{s.name} opened the class with {x} (the lecturer: {y})" for s in students
                     for x, y in [(same_page(s.query), same_page(lec.query))] if x != y]
        await asyncio.sleep(gap)
        c0, w0 = cpu(), time.perf_counter()
        await asyncio.sleep(QUIET_S)
        out["quiet_cpu_per_s"] = (cpu() - c0) / (time.perf_counter() - w0)
        for i in range(moves):
            await asyncio.sleep(gap)
            here = step_of(lec.query)
            c0 = cpu()
            if i % 2 == 0:
                target, t0 = here + 1, await lec.act(NEXT)
            else:
                target = here + 7
                t0 = await lec.act((STEP, target))
            mine, *got = await asyncio.gather(*(_arrive(s, t0, target, wait)
                                                for s in [lec, *students]))
            if mine is None:
                problems.append(f"move {i + 1}: the lecturer's page did not reach step {target}"
                                f" ({lec.diag()})")
            out["move_cpu_s"].append(cpu() - c0)
            out["move_wall_s"].append(time.perf_counter() - t0)
            out["follow_s"] += [x - t0 for x in got if x is not None]
            problems += [f"move {i + 1}: {s.name} did not reach step {target} within "
                         f"{wait:.0f} s ({s.diag()})" for s, x in zip(students, got) if x is None]
        await asyncio.sleep(gap)
        held = guesses(lec.query)
        t_ask = await lec.act(ASK)
        seen = await asyncio.gather(*(_shows(s, t_ask, wait) for s in students))
        problems += [f"{s.name}: no {GUESS!r} and {VOTE!r} within {wait:.0f} s of the question"
                     f" ({s.diag(6)})" for s, ok in zip(students, seen) if not ok]
        voters = [s for s, ok in zip(students, seen) if ok]
        picks = [rng.choice(held) for _ in voters]
        delays = sorted(rng.uniform(0, vote_spread) for _ in voters)
        rng.shuffle(voters)
        sent = await asyncio.gather(*(_vote(s, d, p, wait) for s, d, p in
                                      zip(voters, delays, picks)))
        accepted = sorted((acc, t) for t, acc in sent if acc is not None)
        problems += [f"{s.name}: the vote run did not finish" for s, (_, acc) in
                     zip(voters, sent) if acc is None]
        try:
            await lec.wait_for(lambda: max(votes_shown(lec), default=0) >= len(accepted),
                               wait)
        except TimeoutError:
            problems.append(f"the lecturer's histogram never showed {len(accepted)} votes "
                            f"(saw {sorted(votes_shown(lec))})")
        shown = votes_shown(lec)
        for k, (_, t_sent) in enumerate(accepted, 1):
            when = [t for total, t in shown.items() if total >= k]
            if when:
                out["vote_s"].append(min(when) - t_sent)
        out["votes"] = {"sent": len(voters), "accepted": len(accepted),
                        "shown": max(shown, default=0)}
        if REVEAL not in lec.keys:  # its page never drew the question (a lost redraw)
            problems.append(f"the lecturer's page has no {REVEAL!r} button ({lec.diag(6)})")
        else:
            t = await lec.act(REVEAL)
            try:
                await lec.wait_for(lambda: lec.full_runs_done(t), wait)
            except TimeoutError:
                problems.append(f"the reveal did not redraw the lecturer's page "
                                f"({lec.diag(6)})")
        out["ticks"] = sum(s.ticks for s in students) + lec.ticks
        # the cookies each page holds (behind --workers: the proxy's, naming its worker)
        out["cookies"] = {s.name: dict(s.cookies) for s in [lec, *students]}
        out["runs"] = sum(len(s.runs) for s in students) + len(lec.runs)
    finally:
        await asyncio.gather(*(s.close() for s in [lec, *students]), return_exceptions=True)
    out["errors"] = [f"{s.name}: {e}" for s in [lec, *students] for _, e in s.errors]
    # nothing on a student's page is moved before the vote: "on your own" is the page's error
    problems += [f"{s.name}: its page said 'exploring on your own' at +{t - s.runs[0].started:.1f}"
                 " s, though nothing was moved on it" for s in students
                 for x, t in s.texts.items() if s.runs and ON_OWN_RX.search(x.encode())]
    return out


async def _join(s, delay: float) -> None:
    await asyncio.sleep(delay)
    await s.start()


async def _arrive(s, since: float, step: int, wait: float) -> float | None:
    try:
        return await s.wait_for(lambda: arrived(s, since, step), wait)
    except TimeoutError:
        return None


async def _shows(s, since: float, wait: float) -> bool:
    try:
        await s.wait_for(lambda: s.seen.get(GUESS, 0) > since and s.seen.get(VOTE, 0) > since,
                         wait)
        return True
    except TimeoutError:
        return False


async def _vote(s, delay: float, pos: int, wait: float):
    """(sent, accepted): the vote's send time and when its run finished (None: never)."""
    await asyncio.sleep(delay)
    t = await s.act((GUESS, pos), VOTE)
    try:
        acc = await s.wait_for(lambda: next((r.finished for r in s.runs if r.started >= t
                                             and r.finished is not None), None), wait)
    except TimeoutError:
        acc = None
    return t, acc


def run_class(n: int, timeout: float, settle: float, repo: Path = REPO,
              launcher: str = "kvviz", workers: int = 1, **kw) -> dict:
    """A fresh server (`kvviz app` by default; `kvviz app --workers N` with workers), one
    class of n students on it."""
    with C.Server(repo, server_port(workers), launcher=launcher, workers=workers) as srv:
        pids, proxy = server_procs(srv)
        load0 = os.getloadavg()
        c0, x0, p0 = cpu_sum(pids), cpu_sum(proxy), time.process_time()
        with PeakRSS(pids) as peak:
            t0 = time.perf_counter()
            r = asyncio.run(class_session(srv.url, n, timeout=timeout,
                                          cpu=lambda: cpu_sum(pids), **kw))
            r["wall_s"] = time.perf_counter() - t0
        r["server_cpu_s"] = cpu_sum(pids) - c0  # every worker's, summed
        r["proxy_cpu_s"] = cpu_sum(proxy) - x0
        r["client_cpu_s"] = time.process_time() - p0  # this process: every session's parsing
        time.sleep(settle)
        r.update(rss_peak_mb=peak.peak, rss_idle_mb=rss_sum(pids), ready_s=srv.ready_s,
                 load_before=load0, load_after=os.getloadavg(), launcher=launcher,
                 workers=workers)
    print(f"class N={n:3d}: {class_line(r)}", flush=True)
    return r


def per_student_ms(r: dict) -> tuple[float, float]:
    """Server CPU per student per move, in ms: all of it (sent -> every follower arrived), and
    less what the class costs while nobody moves (its pages' timers: `quiet_cpu_per_s` over
    the move's wall time). NaN without a CPU reading."""
    moves = list(zip(r.get("move_cpu_s", []), r.get("move_wall_s", [])))
    if not moves or r["n"] == 0:
        return float("nan"), float("nan")
    quiet = r.get("quiet_cpu_per_s", float("nan"))
    gross = statistics.fmean(c for c, _ in moves) / r["n"] * 1000
    net = statistics.fmean(c - quiet * w for c, w in moves) / r["n"] * 1000
    return gross, net


def class_line(r: dict) -> str:
    bad = r["errors"] + r["problems"]
    return (f"follow p50/p95/max {fmt(stats(r['follow_s']))} s, vote "
            f"{fmt(stats(r['vote_s']))} s, errors {len(r['errors'])}, problems "
            f"{len(r['problems'])}, RSS peak {r['rss_peak_mb']:.0f} MB, server CPU "
            f"{r['server_cpu_s']:.1f} s"
            + (f" over {r['workers']} workers, proxy {r['proxy_cpu_s']:.1f} s"
               if r.get("workers", 1) > 1 else "")
            + f" (clients {r['client_cpu_s']:.1f} s) in "
            f"{r['wall_s']:.1f} s, per student per move {per_student_ms(r)[0]:.1f} ms "
            f"({per_student_ms(r)[1]:.1f} ms less the quiet rate "
            f"{r.get('quiet_cpu_per_s', float('nan')):.2f} CPU-s/s), load "
            f"{r['load_before'][0]:.2f}->{r['load_after'][0]:.2f}"
            + (f"  first: {bad[0][:160]}" if bad else ""))


def stuck(r: dict) -> list[str]:
    """The students a problem names (a follower that stopped moving, a question not seen)."""
    return sorted({m for p in r["problems"] for m in re.findall(r"\bstudent\d+\b", p)})


def class_table(results: list[dict]) -> str:
    rows = ["| N | workers | follow p50 / p95 / max (s) | vote p50 / p95 / max (s) | "
            "votes counted | errors | students stuck | server CPU (s) | proxy CPU (s) | "
            "server CPU per student per move (ms) | server CPU while nobody moves (s/s) | "
            "RSS peak / idle (MB) | load average (1 min) |",
            "|---:|---:|---|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in results:
        v = r.get("votes", {})
        rows.append(f"| {r['n']} | {r.get('workers', 1)} | {fmt(stats(r['follow_s']))} | "
                    f"{fmt(stats(r['vote_s']))} | {v.get('shown', 0)} of {r['n']} | "
                    f"{len(r['errors'])} | {len(stuck(r))} | {r['server_cpu_s']:.1f} | "
                    f"{r.get('proxy_cpu_s', 0):.1f} | {per_student_ms(r)[0]:.1f} | "
                    f"{r.get('quiet_cpu_per_s', float('nan')):.2f} | "
                    f"{r['rss_peak_mb']:.0f} / {r['rss_idle_mb']:.0f} | "
                    f"{r['load_before'][0]:.1f} → {r['load_after'][0]:.1f} |")
    return "\n".join(rows)


# --- the browser round -------------------------------------------------------------------------
def browser_round(pages: int) -> dict:
    """`pages` headless Chromium pages on one warm server: each must draw the heatmap image
    and redraw after poolKernel moves; page errors are collected."""
    import measure_latency as M
    if not Path(M.CHROMIUM).exists():
        return {"skipped": f"{M.CHROMIUM} not found"}
    from playwright.sync_api import sync_playwright
    out = {"pages": pages, "first_chart_s": [], "update_s": [], "errors": []}
    with C.Server(REPO) as srv:
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
    ap.add_argument("--launcher", choices=("streamlit", "kvviz"), default=None,
                    help="streamlit: `streamlit run app.py` (cold: nothing done before the "
                    "first session); kvviz: `kvviz app`, which draws the default page once "
                    "before it listens (default: streamlit; with --class: kvviz)")
    ap.add_argument("--json", default=None, help="write every figure here")
    ap.add_argument("--repo", type=Path, default=REPO, help="the checkout whose app.py is "
                    "served (e.g. an older commit's, to compare)")
    ap.add_argument("--class", dest="klass", default=None, metavar="SIZES",
                    help="instead: a class of N students per size (e.g. 10,30,60) following "
                    "one lecturer and voting, each on a fresh server (`kvviz app` unless "
                    "--launcher is given)")
    ap.add_argument("--moves", type=int, default=6, help="class: the lecturer's step moves")
    ap.add_argument("--vote-spread", type=float, default=5.0, help="class: seconds over "
                    "which the students' votes are spread (0: all at once)")
    ap.add_argument("--join-spread", type=float, default=3.0, help="class: seconds over which "
                    "the students open the link")
    ap.add_argument("--wait", type=float, default=30.0, help="class: seconds a follower may "
                    "take to arrive before it counts as a problem")
    ap.add_argument("--workers", type=int, default=1, help="`kvviz app --workers N`: N "
                    "server processes behind Caddy, the sessions through it (needs caddy)")
    args = ap.parse_args(argv)
    if args.workers < 1:
        ap.error(f"--workers must be a positive integer, got {args.workers}")
    if args.workers > 1 and (args.launcher or ("kvviz" if args.klass else "streamlit")) != "kvviz":
        ap.error("--workers N starts `kvviz app --workers N`: it takes --launcher kvviz")
    if args.klass:
        return main_class(args, ap)
    print("load average before:", " ".join(f"{x:.2f}" for x in os.getloadavg()),
          f"on {os.cpu_count()} cores", flush=True)
    results = [run_size(int(n), args.timeout, args.settle, args.repo,
                        args.launcher or "streamlit", args.workers)
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


def main_class(args, ap) -> None:
    launcher = args.launcher or "kvviz"
    print("load average before:", " ".join(f"{x:.2f}" for x in os.getloadavg()),
          f"on {os.cpu_count()} cores", flush=True)
    results = [run_class(int(n), args.timeout, args.settle, args.repo, launcher,
                         workers=args.workers, moves=args.moves, vote_spread=args.vote_spread, wait=args.wait,
                         join_spread=args.join_spread)
               for n in args.klass.split(",")]
    print()
    print(class_table(results))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"class": results}, indent=1))


if __name__ == "__main__":
    main()
