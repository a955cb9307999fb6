"""The tiers: a test's markers come from the fixtures it takes, and a test that reaches what
a marker stands for without its fixture stops the collection, named (tests/tiers.py,
tests/conftest.py)."""
import textwrap
import types

import conftest
import pytest
import tiers

MODULE = '''
import subprocess
import sys

import pytest
from streamlit.testing.v1 import AppTest

from apphelp import app
import measure_latency as M
from kvviz.studies.sweep import run_sweep


def page_helper(**query):
    return AppTest.from_file("app.py").run()


@pytest.fixture
def needs_torch():
    import torch
    return torch


def test_direct_apptest():
    AppTest.from_file("app.py")


def test_through_a_helper():
    page_helper(step=3)


def test_apphelp_app():
    app(step=3)


def test_apphelp_module_app():
    import apphelp
    apphelp.app(step=3)


def test_a_module_fixture(needs_torch):
    pass


def test_importorskip():
    pytest.importorskip("torch")


def test_getfixturevalue(request):
    request.getfixturevalue("smollm")


def test_streamlit_server():
    with M.server() as url:
        pass


def test_kvviz_app_process(kvviz):
    subprocess.Popen([kvviz, "app", "--server.port=1"])


def test_kvviz_app_dry_run(kvviz):
    subprocess.run([kvviz, "app", "--dry-run"])
    subprocess.Popen([kvviz, "app", "--help"])


def test_ray_sweep(spec):
    run_sweep(spec, "out", ray="local")


def test_ray_sweep_by_dict(spec):
    for kw in ({}, {"ray": "local"}):
        run_sweep(spec, "out", **kw)


def test_browser():
    from playwright.sync_api import sync_playwright


def test_nothing_special():
    assert sys.version_info > (3,)
'''


def test_static_needs_follow_helpers_fixtures_and_aliases(tmp_path):
    path = tmp_path / "test_sample.py"
    path.write_text(MODULE)
    needs = tiers.static_needs(str(path))
    assert needs == {
        "test_direct_apptest": {"page"},
        "test_through_a_helper": {"page"},
        "test_apphelp_app": {"page"},
        "test_apphelp_module_app": {"page"},
        "test_a_module_fixture": {"model"},
        "test_importorskip": {"model"},
        "test_getfixturevalue": {"model"},
        "test_streamlit_server": {"server"},
        "test_kvviz_app_process": {"server"},
        "test_kvviz_app_dry_run": set(),
        "test_ray_sweep": {"slow"},
        "test_ray_sweep_by_dict": {"slow"},
        "test_browser": {"browser"},
        "test_nothing_special": set(),
    }


class FakeItem:
    """What conftest's collection hook reads of a pytest item."""

    def __init__(self, path, name, fixtures):
        self.path, self.nodeid, self.fixturenames = path, f"{path.name}::{name}", fixtures
        self.function = types.SimpleNamespace(__name__=name)
        self.marks = set()

    def add_marker(self, name):
        self.marks.add(name)

    def get_closest_marker(self, name):
        return name if name in self.marks else None


def test_markers_come_from_fixtures_and_a_missing_one_names_the_test(tmp_path):
    path = tmp_path / "test_sample.py"
    path.write_text(textwrap.dedent('''
        from apphelp import app

        def test_page(apptest):
            app(step=1)

        def test_model_and_browser(smollm, chromium, server):
            pass

        def test_plain():
            pass
    '''))
    items = [FakeItem(path, "test_page", ["apptest"]),
             FakeItem(path, "test_model_and_browser", ["smollm", "torch_stack", "chromium",
                                                       "server"]),
             FakeItem(path, "test_plain", ["tmp_path"])]
    conftest.pytest_collection_modifyitems(None, items)
    assert [i.marks for i in items] == [{"page"}, {"model", "browser", "server"}, set()]

    forgot = FakeItem(path, "test_page", ["tmp_path"])  # calls app() without the fixture
    with pytest.raises(pytest.UsageError, match=r"test_sample.py::test_page: reaches page "
                                                r"without the marker; take the fixture apptest"):
        conftest.pytest_collection_modifyitems(None, [forgot])


def test_every_tier_marker_is_registered(pytestconfig):
    registered = {line.split(":")[0] for line in pytestconfig.getini("markers")}
    assert set(tiers.FIXTURE_MARKS.values()) == {"model", "browser", "page", "server", "slow"}
    assert set(tiers.FIXTURE_MARKS.values()) <= registered
