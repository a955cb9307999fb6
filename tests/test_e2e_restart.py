"""A class outlives its server, and nobody sees a question's answer early, in a real browser
(Debian's chromium driven by playwright, never `playwright install`).

A lecturer (the shipped lesson's scene 1, on a projector in presentation mode) and three
students, the class store a SQLite file of the test's own. The lecturer asks "which position
will A evict next?", each student votes, and the server is stopped (SIGTERM) and started
again on the same port. While it is down every student's page says "Reconnecting to the
class…"; within 15 s of the new server answering its health check every student's page has
run again on it, by itself (no reload); the lecturer's projector never shows the answer
before the reveal (no status line of the asked step, no "Answer:", no cache heatmap); a
second vote from a student is refused as one already cast; the reveal reaches every student
and counts each vote once.

Then the early-answer paths, on a second question: a student who stops following sees the
cache heatmap with the asked step and later ones covered, and pressing K (next step) never
brings the status line to the asked step; coming back (their link again) and voting, their
vote is marked on the lecturer's histogram; a student's own link without `follow=` opens no
speaker note, and that page too hides the open question's step.

Missing chromium or playwright: a failure when KVVIZ_REQUIRE_E2E=1 (CI), a skip otherwise.
"""
import contextlib
import re
import sys
import time
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import measure_latency as M  # noqa: E402

from kvviz.app.teach import classroom as cr  # noqa: E402
from kvviz.app.teach import lesson as L  # noqa: E402
from kvviz.app.teach.question import asked_at  # noqa: E402
from kvviz.core.replay import run_policy  # noqa: E402
from kvviz.core.trace import load_trace  # noqa: E402

LESSON = "tova-vs-snapkv"
MAIN = '[data-testid="stMain"]'
QUESTION = "Which position will A (tova) evict next?"
BACK_S = 15  # a student's page runs again on the restarted server within this
# every run of the page's script, as the browser sees it: the time each one ended (ms since
# the epoch), kept across reconnections (the page is never reloaded)
RUNS_JS = """() => {
  if (window.__runs) return;
  window.__runs = [];
  const app = document.querySelector('[data-testid="stApp"]');
  let was = app.getAttribute('data-test-script-state');
  new MutationObserver(() => {
    const now = app.getAttribute('data-test-script-state');
    if (was === 'running' && now !== 'running') window.__runs.push(Date.now());
    was = now;
  }).observe(app, {attributes: true, attributeFilter: ['data-test-script-state']});
}"""
# what the lecturer's projector shows that would answer the open question (sampled every 50 ms)
WATCH_JS = """([step]) => {
  window.__leaks = [];
  window.__watch = setInterval(() => {
    const t = document.body.innerText;
    if (t.includes('evicted at step ' + step + ':') || t.includes('Answer:')
        || t.includes('Who holds which position after every step'))
      window.__leaks.push(t.slice(0, 400));
  }, 50);
}"""
CUT_OFF = """() => getComputedStyle(document.querySelector('[data-testid="stApp"]'), '::after')
  .content"""


def wait_text(page, text, timeout=60_000):
    page.wait_for_function("t => document.body.innerText.includes(t)", arg=text,
                           timeout=timeout)


def key(page, k):
    page.evaluate("() => document.activeElement && document.activeElement.blur()")
    page.keyboard.press(k)


def ran_after(page, t_ms: float, timeout_s: float) -> float:
    """Seconds from `t_ms` until a run of the page's script ended after it."""
    page.wait_for_function("t => window.__runs.some(x => x > t)", arg=t_ms,
                           timeout=timeout_s * 1000, polling=50)
    return (page.evaluate("t => window.__runs.find(x => x > t)", t_ms) - t_ms) / 1000


def vote(page, position):
    box = page.get_by_label("your guess: the position it evicts")
    box.fill(str(position))
    box.press("Enter")
    M.wait_settled(page)
    page.get_by_role("button", name="Vote").click()


def start(env, port=0):
    proc, out = M.start_server(env, "streamlit", port)
    port = out.wait_port(120)
    M.wait_health(port, proc, 120, out)
    return proc, port


def test_a_class_outlives_its_server_and_never_shows_an_answer_early(chromium, server,
                                                                      tmp_path):
    state = L.load(L.path_of(LESSON)).scene(1).query
    ev = run_policy(load_trace(REPO / "traces" / "toy.npz"), state["a"], int(state["budget"]))
    q = asked_at(ev.evicted_at, int(state["step"]))
    q2 = asked_at(ev.evicted_at, q.answer_step)  # the second question, asked where the first ends
    others = [p for p in q.held if p not in q.answer]
    guesses = [min(q.answer), others[0], others[-1]]
    store = f"sqlite://{tmp_path}/classes.sqlite3"
    env = {"KVVIZ_CLASSES": store, "OMP_NUM_THREADS": "1"}
    proc, port = start(env)
    server._procs.append(proc)  # (stopped with the test's other servers)
    url = f"http://127.0.0.1:{port}"
    errors = []
    with contextlib.ExitStack() as stack:
        from playwright.sync_api import sync_playwright

        p = stack.enter_context(sync_playwright())
        browser = p.chromium.launch(executable_path=M.CHROMIUM, args=M.CHROMIUM_ARGS,
                                    headless=True)
        stack.callback(browser.close)
        lect = browser.new_context(viewport={"width": 1024, "height": 768}).new_page()
        lect.on("pageerror", lambda e: errors.append(str(e)))
        lect.goto(f"{url}/?lesson={LESSON}&scene=1")
        lect.wait_for_selector(f'{MAIN} [data-testid="stPlotlyChart"] .main-svg',
                               state="attached", timeout=240_000)
        M.wait_settled(lect, 120_000)
        lect.get_by_role("button", name="Open a class").click()
        side = lect.locator('[data-testid="stSidebar"]')
        side.get_by_text(re.compile(r"follow=[A-Z2-9]{6}")).wait_for(timeout=60_000)
        code = re.search(r"follow=([A-Z2-9]{6})", side.inner_text()).group(1)
        M.wait_settled(lect)
        key(lect, "p")  # the projector: presentation mode
        wait_text(lect, "Scene 1/")
        M.wait_settled(lect)
        assert f"lead={code}" in lect.url  # the page's link says which class it leads

        students = []
        for _ in range(3):
            stu = browser.new_context(viewport={"width": 1024, "height": 768}).new_page()
            stu.on("pageerror", lambda e: errors.append(str(e)))
            stu.goto(f"{url}/?follow={code}")
            wait_text(stu, f"Following the lecturer of class {code}", 240_000)
            students.append(stu)
        lect.get_by_role("button", name="Ask A").click()
        wait_text(lect, QUESTION)
        for stu, g in zip(students, guesses):
            wait_text(stu, QUESTION, 30_000)
            M.wait_settled(stu)
            vote(stu, g)
            wait_text(stu, f"You voted for position {g}", 30_000)
        wait_text(lect, "3 votes", 30_000)
        M.wait_settled(lect)

        # --- the restart, in the middle of the question ----------------------------------
        for page in (lect, *students):
            page.evaluate(RUNS_JS)
        lect.evaluate(WATCH_JS, [q.answer_step])
        M.stop_server(proc)
        for stu in students:  # cut off, and saying so
            stu.wait_for_function(f"() => ({CUT_OFF})().includes('Reconnecting to the class')",
                                  timeout=20_000)
        proc, _ = start(env, port)
        server._procs.append(proc)
        healthy = time.time() * 1000
        back = [ran_after(stu, healthy, BACK_S) for stu in students]  # no reload
        ran_after(lect, healthy, 60)
        M.wait_settled(lect)
        for stu, g in zip(students, guesses):
            M.wait_settled(stu)
            assert stu.evaluate(CUT_OFF) in ("none", "normal")
            wait_text(stu, f"You voted for position {g}")  # the store knows this browser
        again = students[0]
        vote(again, guesses[1])
        wait_text(again, f"Vote refused: you already voted (position {guesses[0]})", 30_000)
        votes = cr.Registry(store).get(code).current_round().votes
        assert sorted(votes.values()) == sorted(guesses)  # each counted once
        leaks = lect.evaluate("() => { clearInterval(window.__watch); return window.__leaks; }")
        assert not leaks, leaks[:3]
        lect.get_by_role("button", name="Reveal the answer").click()
        for stu, g in zip(students, guesses):
            right = "right." if g in q.answer else "not the answer."
            wait_text(stu, f"You guessed position {g}: {right}", 30_000)
        wait_text(lect, "of 3 guessed right")

        # --- no early answer: a second question -------------------------------------------
        lect.get_by_role("button", name="Close the question").click()
        for stu in students:
            wait_text(stu, "The lecturer closed the question", 30_000)
        M.wait_settled(lect)
        lect.get_by_role("button", name="Ask A").click()
        wait_text(lect, QUESTION)
        leaver, linker = students[0], students[1]
        wait_text(leaver, QUESTION, 30_000)
        M.wait_settled(leaver)
        leaver.get_by_role("button", name="Stop following").click()
        # the whole run's heatmap: the asked step and later ones covered
        M.wait_chart_text(leaver, "hidden while the class's question is open", 60_000)
        M.wait_settled(leaver)
        seen = []
        for _ in range(3):  # K (next step): never to the asked step
            key(leaver, "k")
            M.wait_settled(leaver)
            seen.append(leaver.locator(MAIN).inner_text())
        assert all(f"evicted at step {q2.answer_step}:" not in t for t in seen), seen[-1]
        assert f"evicted at step {q2.answer_step - 1}:" in seen[-1], seen[-1]
        leaver.goto(f"{url}/?follow={code}")  # back in the class, and a vote
        wait_text(leaver, QUESTION, 240_000)
        M.wait_settled(leaver)
        vote(leaver, min(q2.answer))
        wait_text(leaver, f"You voted for position {min(q2.answer)}", 30_000)
        M.wait_chart_text(lect, "1 after leaving", 30_000)
        wait_text(lect, "came from students who left the class during this question")
        # a student's own link without follow=: no speaker note
        parts = urlsplit(linker.url)
        query = [(k, v) for k, v in parse_qsl(parts.query) if k != "follow"]
        assert ("lesson", LESSON) in query, linker.url  # (the path the link opens)
        linker.goto(parts._replace(query=urlencode(query)).geturl())
        linker.wait_for_selector(f'{MAIN} [data-testid="stPlotlyChart"] .main-svg',
                                 state="attached", timeout=240_000)
        M.wait_settled(linker, 60_000)
        text = linker.locator("body").inner_text()
        assert "Speaker note" not in text and "Say:" not in text, text[:600]
        # nor, in a student's browser, the open question's step on any link
        assert f"hides the steps from {q2.answer_step} on" in text, text[:600]
        M.wait_chart_text(linker, "hidden while the class's question is open")
    assert not errors, errors
    print(f"students' pages ran again {', '.join(f'{s:.1f}' for s in back)} s after the "
          "restarted server was healthy")
