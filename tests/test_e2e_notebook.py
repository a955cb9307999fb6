"""The notebook widget in JupyterLab in a real browser (Debian chromium via playwright): one
JupyterLab server (offline: no news, no update check, no extension manager; its settings,
workspaces and runtime files in a temporary folder), the example notebook run top to bottom;
moving the replay view's step control with the keyboard moves the heatmap's step line and
redraws the scores at the new step, with no error in the browser's console and no request
leaving the machine.

The screenshot docs/notebook.md shows is taken here (KVVIZ_SCREENSHOT=1, scripts/screenshots.sh).
"""
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import measure_latency as M  # noqa: E402

ART = REPO / "artifacts"
NOTEBOOK = "notebook_replay.ipynb"
URL_LINE = re.compile(r"(http://127\.0\.0\.1:\d+)/lab")
OFFLINE = ["--allow-root", "--no-browser", "--ServerApp.ip=127.0.0.1", "--ServerApp.port=0",
           "--IdentityProvider.token=", "--ServerApp.password=", "--ServerApp.terminals_enabled=False",
           "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
           "--LabApp.extension_manager=readonly", "--LabApp.expose_app_in_browser=True"]


def start_lab(folder: Path):
    """JupyterLab on a free port serving `folder`: (process, base URL)."""
    settings = folder / "settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    # every cell in the page (no windowing): the views below the fold draw too
    (settings / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
    (folder / "config" / "labconfig").mkdir(parents=True)
    (folder / "config" / "labconfig" / "page_config.json").write_text(json.dumps(
        {"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}))
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(folder / "config"), JUPYTER_RUNTIME_DIR=str(folder / "run"),
               IPYTHONDIR=str(folder / "ipython"), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    log = open(folder / "lab.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "jupyter", "lab", *OFFLINE,
                             f"--ServerApp.root_dir={folder / 'root'}",
                             f"--LabApp.user_settings_dir={folder / 'settings'}",
                             f"--LabApp.workspaces_dir={folder / 'workspaces'}"],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    end = time.monotonic() + 90
    while time.monotonic() < end:
        log.seek(0)
        found = URL_LINE.search(log.read())
        if found:
            return proc, found.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    log.seek(0)
    raise AssertionError("JupyterLab did not start:\n" + log.read()[-3000:])


def view_state(page, view) -> dict:
    """The replay view's step label, its heatmap's step line and label, its scores' title."""
    return view.evaluate("""(v) => {
      const pic = (n) => v.querySelector(`[data-picture="${n}"]`);
      const cache = pic("cache"), scores = pic("scores");
      return {shown: v.querySelector(".kvviz-shown").textContent,
              line: cache.layout.shapes.filter(s => s.name === "step").map(s => s.y0),
              label: [...cache.querySelectorAll(".annotation-text")].map(e => e.textContent),
              scores: scores.querySelector(".gtitle").textContent,
              ticks: [...scores.querySelectorAll(".xtick text")].map(e => e.textContent).join(",")};
    }""")


def test_the_replay_view_steps_in_jupyterlab(chromium, server, tmp_path):
    # `server`: the tier of a test that starts a server process (JupyterLab, started here)
    ART.mkdir(exist_ok=True)
    (tmp_path / "root").mkdir()
    shutil.copy(REPO / "examples" / NOTEBOOK, tmp_path / "root" / NOTEBOOK)
    proc, url = start_lab(tmp_path)
    errors, outside = [], []  # outside: requests leaving the machine (plotly.js comes from the kernel)
    try:
        with M.browser(viewport=(1500, 2200)) as page:  # the whole view in the screenshot
            page.on("console", lambda m: m.type == "error" and errors.append(m.text))
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("request", lambda r: r.url.startswith((url, "blob:", "data:")) or outside.append(r.url))
            page.goto(f"{url}/lab/tree/{NOTEBOOK}")
            page.wait_for_function("() => window.jupyterapp?.shell.currentWidget?.sessionContext?.session?.kernel",
                                   timeout=90_000)
            page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
            # the four views drawn: replay, loop, pass key, heads
            page.wait_for_function("""() => {
              const views = document.querySelectorAll('.kvviz-view');
              const drawn = (v) => v.querySelectorAll('.kvviz-picture .main-svg').length >= 3;
              return views.length === 4 && [...views].every(drawn);
            }""", timeout=120_000)
            view = page.locator(".kvviz-view").first
            before = view_state(page, view)
            assert before["shown"] == "step 300 of 0–1023"
            assert before["line"] == [300] and "step 300" in before["label"]
            assert "at step 300" in before["scores"]
            slider = view.locator("input.kvviz-step")
            slider.scroll_into_view_if_needed()
            slider.focus()
            for _ in range(3):
                page.keyboard.press("ArrowRight")
            page.wait_for_function("(v) => v.querySelector('.kvviz-shown').textContent.startsWith('step 303')",
                                   arg=view.element_handle(), timeout=10_000)
            after = view_state(page, view)
            assert after["line"] == [303] and "step 303" in after["label"]  # the heatmap's step moved
            assert "at step 303" in after["scores"]  # the scores redrawn at the new step
            assert after["ticks"] != before["ticks"]  # other held slots, around another victim
            view.screenshot(path=str(ART / "notebook.png"))
            if os.environ.get("KVVIZ_SCREENSHOT") == "1":
                shutil.copy(ART / "notebook.png", REPO / "docs" / "images" / "screenshot-notebook.png")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert errors == [], errors
    assert outside == [], outside
