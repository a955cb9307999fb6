"""Unknown paths in a real browser (Debian chromium via playwright): `kvviz app` answers
`/nope` and `/nope/deeper` with the app's own not-found message and a link home, not a blank
page (under a nested path the index page's relative script addresses would resolve to
`/nope/static/...`, which the server answers with the index page again)."""
import sys
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import measure_latency as M  # noqa: E402


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *a, **k):
        return None


def _status(url: str) -> tuple[int, str | None]:
    try:
        with urllib.request.build_opener(_NoRedirect).open(url, timeout=30) as r:
            return r.status, r.headers.get("Location")
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Location")


def test_unknown_paths_get_the_not_found_page(chromium, server):
    url = server.streamlit(launcher="kvviz")
    # the server: an unknown path is redirected to the page with the path named; the index
    # page, a real asset and the health check are served as before
    assert _status(f"{url}/nope/deeper") == (302, "/?notfound=/nope/deeper")
    assert _status(f"{url}/nope") == (302, "/?notfound=/nope")
    assert _status(f"{url}/")[0] == 200
    assert _status(f"{url}/_stcore/health")[0] == 200
    errors = []
    with M.browser(viewport=(1024, 768)) as page:
        page.on("pageerror", lambda e: errors.append(str(e)))
        for path in ("/nope/deeper", "/nope"):
            page.goto(url + path, timeout=120_000)
            box = page.locator(".kv-not-found")
            box.wait_for(timeout=120_000)
            assert box.inner_text().startswith(f"Page not found. kvviz has no page at {path}.")
            assert page.locator('[data-testid="stPlotlyChart"]').count() == 0
        # the link goes home: the explorer's page, its first chart drawn
        page.locator(".kv-not-found a").click()
        page.wait_for_selector(M.CHART_SEL + " image", state="attached", timeout=120_000)
        assert page.locator(".kv-not-found").count() == 0
        assert page.evaluate("() => location.pathname") == "/"
    assert not errors, errors
