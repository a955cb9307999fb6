"""A part of kvviz imported or run without its extra fails in one line naming the extra.

The parts are hidden the way a missing package is (None in sys.modules, in a fresh
interpreter), although everything is installed here; tests/test_install.py does the same in a
venv that really holds the bare wheel alone.
"""
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from kvviz.core.extras import DISTRIBUTIONS, EXTRAS, MissingExtra, missing, refusal, require

ROOT = Path(__file__).resolve().parents[1]
OPTIONAL = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def names(extra: str) -> set[str]:
    """The packages an extra names itself (not the kvviz extras it includes)."""
    return {re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower() for r in OPTIONAL[extra]} - {"kvviz"}


def without(modules, code: str, timeout=120):
    """Run `code` in a fresh interpreter in which `modules` cannot be imported."""
    hide = "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in modules)
    return subprocess.run([sys.executable, "-c", hide + code], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_each_module_is_installed_by_the_extra_it_names():
    for module, extra in EXTRAS.items():
        assert DISTRIBUTIONS.get(module, module).lower() in names(extra), (module, extra)
    # and each package an extra installs (the test tools aside) is a module here
    mapped = {DISTRIBUTIONS.get(m, m).lower() for m in EXTRAS}
    for extra in set(OPTIONAL) - {"test", "capture"}:
        assert names(extra) <= mapped, extra
    assert OPTIONAL["capture"] == ["kvviz[model]"]


def test_require_names_the_extra_in_one_line(monkeypatch):
    require("kvviz check --reference", "check", "json")  # there: nothing happens
    monkeypatch.setitem(sys.modules, "hypothesis", None)
    with pytest.raises(MissingExtra) as info:
        require("kvviz check --reference", "check", "json", "hypothesis")
    assert str(info.value) == ("kvviz check --reference needs hypothesis, which is not installed: "
                               "pip install 'kvviz[check]'")
    assert isinstance(info.value, ModuleNotFoundError) and info.value.name == "hypothesis"
    monkeypatch.setitem(sys.modules, "PIL", None)
    assert missing("json", "hypothesis", "PIL", "no_such_module_here") == ["hypothesis", "PIL", "no_such_module_here"]
    with pytest.raises(MissingExtra, match=r"^kvviz.app needs hypothesis, pillow, which are not installed: "
                                           r"pip install 'kvviz\[app\]'$"):
        require("kvviz.app", "app", "hypothesis", "PIL")
    with pytest.raises(ValueError, match="extra must be one of .*'app'.*, got 'gui'"):
        require("kvviz.app", "gui", "streamlit")


def test_refusal_is_for_an_extra_s_package_only():
    assert refusal(ModuleNotFoundError("No module named 'ray.util'", name="ray.util"), "kvviz sweep") == (
        "kvviz sweep needs ray, which is not installed: pip install 'kvviz[scale]'")
    assert refusal(MissingExtra("kvviz.app", ["streamlit"], "app"), "kvviz lesson") == (
        "kvviz lesson needs streamlit, which is not installed: pip install 'kvviz[app]'")
    assert refusal(ModuleNotFoundError("No module named 'mine'", name="mine"), "kvviz bench") is None
    assert refusal(ImportError("cannot import name 'x'", name="torch"), "kvviz loop") is None
    assert refusal(ValueError("bad"), "kvviz bench") is None


@pytest.mark.parametrize("module, hidden, extra", [
    ("kvviz.app", ["streamlit"], "app"),
    ("kvviz.app.ui.view_loop", ["plotly"], "app"),
    ("kvviz.hf", ["torch"], "model"),
    ("kvviz.app.notebook", ["anywidget"], "notebook"),
])
def test_importing_a_part_without_its_extra_fails_naming_it(module, hidden, extra):
    out = without(hidden, f"import {module}")
    assert out.returncode == 1
    err = out.stderr.strip().splitlines()
    assert [ln for ln in err if f"'kvviz[{extra}]'" in ln] == [err[-1]], out.stderr
    assert err[-1].startswith(f"kvviz.core.extras.MissingExtra: {module.split('.ui')[0]} needs {hidden[0]}")


def test_the_core_and_the_model_readers_import_without_any_extra():
    # the explorer reads saved loop and pass-key results through kvviz.model without torch
    out = without(EXTRAS,
                  "import kvviz, kvviz.core.check, kvviz.model.loop.config, kvviz.model.needle.prompt; print('ok')")
    assert out.returncode == 0 and out.stdout == "ok\n", out.stderr


def test_the_command_line_lists_a_missing_part_and_refuses_it_in_one_line():
    code = "from kvviz.__main__ import main; sys.exit(main(sys.argv[1:]))"
    line = "kvviz {} needs streamlit, which is not installed: pip install 'kvviz[app]'"
    helped = without(["streamlit"], code.replace("sys.argv[1:]", "['--help']"))
    assert helped.returncode == 0 and "'kvviz[app]'" in helped.stdout
    for argv, command in ((["app", "--server.port=1"], "app"), (["app", "--help"], "app"),
                          (["lesson", "list"], "lesson")):
        out = without(["streamlit"], f"sys.argv[1:] = {argv!r}\n{code}")
        assert (out.returncode, out.stderr, out.stdout) == (2, line.format(command) + "\n", "")
    # an extra's package missing inside a command's run: the same one line, exit 2
    out = without(["pandas"], f"sys.argv[1:] = ['sweep', '--bench']\n{code}")
    assert (out.returncode, out.stderr) == (2, "kvviz sweep needs pandas, which is not installed: "
                                               "pip install 'kvviz[scale]'\n")
    out = without(["hypothesis"], f"sys.argv[1:] = ['check', 'tova', '--reference', "
                                  f"'kvviz.core.reference:RefTova']\n{code}")
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr == ("error: --reference needs hypothesis, which is not installed: pip install 'kvviz[check]' "
                          "(it draws its scenarios with Hypothesis)\n")
