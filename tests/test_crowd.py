"""A class opening a fresh server at once: every session gets its chart, none an exception.

Starts `streamlit run app.py` (headless, 127.0.0.1, telemetry off) on a free port in
8621-8649 and, before anyone has loaded the page, opens SESSIONS sessions at the same moment
with protocol-level clients (scripts/stclient.py: Streamlit's websocket as its frontend speaks
it). On the code before the fix, 20 such sessions crashed 1-15 of 20 per trial with
"partially initialized module 'numpy' has no attribute 'ndarray'" (issue 9, item 0): plotly
read a half-imported numpy from sys.modules while another session's thread was importing it.
"""
import asyncio
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import stclient  # noqa: E402

SESSIONS = 16
QUERY = "?trace=canonical&budget=512&a=tova&b=snapkv&step=1300&view=cache"


def test_a_crowd_on_a_cold_server_gets_charts_and_no_exceptions():
    port = stclient.free_port(8621, 8649)
    with stclient.Server(REPO, port, env={"STREAMLIT_BROWSER_GATHER_USAGE_STATS": "false"}) as srv:
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
