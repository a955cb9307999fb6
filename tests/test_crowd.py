"""A class on one server: a crowd opening a fresh server at once gets its charts and no
exception; the protocol client keeps a page's run_every timers; a small class follows its
lecturer and every vote reaches the lecturer's histogram.

The crowd: `streamlit run app.py` (headless, 127.0.0.1, telemetry off) on a port the
operating system gave; before anyone has loaded the page, SESSIONS sessions open it at the
same moment with protocol-level clients (scripts/stclient.py: Streamlit's websocket as its
frontend speaks it). Before the page imported numpy up front, 20 such sessions crashed 1-15
of 20 per trial with "partially initialized module 'numpy' has no attribute 'ndarray'":
plotly read a half-imported numpy from sys.modules while another session's thread was
importing it.
"""
import asyncio
import re
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import loadtest
import stclient

SESSIONS = 16
QUERY = "?trace=canonical&budget=512&a=tova&b=snapkv&step=1300&view=cache"


def test_a_crowd_on_a_cold_server_gets_charts_and_no_exceptions(server):
    with stclient.Server(REPO, env={"STREAMLIT_BROWSER_GATHER_USAGE_STATS": "false"}) as srv:
        results = asyncio.run(stclient.crowd(srv.url, QUERY, SESSIONS, timeout=80))
    failures = [r for r in results if isinstance(r, BaseException)]
    assert not failures, f"{len(failures)} sessions failed at the protocol level: {failures[:3]}"
    exceptions = [e[:2] for r in results for e in r.exceptions]
    assert not exceptions, f"{len(exceptions)} exceptions in {SESSIONS} sessions: {exceptions[:3]}"
    for r in results:
        assert r.status == "FINISHED_SUCCESSFULLY", r.status
        assert not r.errors, r.errors
        # the real chart, not only app.py's placeholder
        assert r.first_chart_s is not None, r.chart_titles
        assert any("Cache contents over time: A = tova, B = snapkv" in t
                   for t in r.chart_titles), r.chart_titles


def test_the_live_client_keeps_the_run_every_timers_as_the_browser_does(server):
    """st.fragment(run_every=...) is a timer in the browser: without it a follower never
    polls. The client must rerun the fragment on its timer, keep one timer per fragment
    across full reruns (which restart it), and see each fragment run's new text."""
    app = REPO / "tests" / "fixtures" / "ticker"

    async def go(url):
        s = stclient.LiveSession(url, "", 20, name="ticker")
        s.watch = (re.compile(rb"tick (\d+) of full run (\d+)"),)
        try:
            await s.start()
            await s.wait_for(lambda: s.full_runs_done())
            t0 = time.perf_counter()
            await s.wait_for(lambda: sum(1 for r in s.runs if r.fragment_ids and r.finished
                                         and r.started > t0) >= 3, 10)
            assert len(s.timers) == 1 and s.ticks >= 3, s.diag()
            t1 = await s.act("again")  # a full rerun: the timer is cleared, then set again
            await s.wait_for(lambda: s.full_runs_done(t1), 10)
            await s.wait_for(lambda: sum(1 for r in s.runs if r.fragment_ids and r.finished
                                         and r.started > t1) >= 2, 10)
            assert len(s.timers) == 1, s.diag()
        finally:
            await s.close()
        assert not s.errors, s.errors
        assert all(r.status in stclient.FINISHED_OK for r in s.runs if r.finished)
        ticks = sorted(int(re.search(r"tick (\d+)", t).group(1)) for t in s.texts)
        assert len(set(ticks)) >= 5, ticks  # each fragment run's own text arrived
        assert any(t.endswith("of full run 2") for t in s.texts), sorted(s.texts)

    with stclient.Server(app) as srv:
        asyncio.run(go(srv.url))


def test_a_class_of_four_follows_the_lecturer_and_every_vote_is_counted(server):
    """`kvviz app`, one lecturer and 4 students (the classroom load test at its smallest size):
    the lecturer opens a class, moves the step twice (the next button, the slider); every
    follower's page redraws at the lecturer's step with the lecturer's settings; the
    lecturer asks which position A evicts next, each student votes a held position, the
    lecturer's histogram counts all 4; no exception, st.error or lost connection anywhere."""
    with stclient.Server(REPO, launcher="kvviz") as srv:
        r = asyncio.run(loadtest.class_session(srv.url, 4, moves=2, vote_spread=0.5,
                                               join_spread=0.5, gap=0.5, timeout=60, wait=30))
    assert not r["errors"], r["errors"][:5]
    assert not r["problems"], r["problems"][:5]
    assert len(r["follow_s"]) == 4 * 2, r["follow_s"]
    assert r["votes"] == {"sent": 4, "accepted": 4, "shown": 4}, r["votes"]
    assert len(r["vote_s"]) == 4, r["vote_s"]
