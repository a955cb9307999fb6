"""Parameters of any kind a dataclass field can hold (a free string, a switch, a tuple), each
validated by the function its declaration names; every refusal names the parameter and the
rule, and `kvviz check` probes such a parameter and reports a class that lets a bad value
through in one line (never a traceback)."""
import math
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvviz.core.check import check_refusals
from kvviz.core.check_rules import bad_values
from kvviz.core.policies import check_declaration, config_label, parse_params, register_policy, unregister_policy
from kvviz.core.policies.tova import Tova
from kvviz.policies import param


def existing_file(value):
    """a path to an existing file"""
    path = Path(value)
    if not path.is_file():
        raise ValueError(f"no such file: {value}")
    return str(path.resolve())


def probability(value):
    """a number in 0..1, not 0"""
    if not 0 < value <= 1:
        raise ValueError(f"{value} is outside (0, 1]")


def weights(value):
    """comma-separated non-negative numbers"""
    parts = value.split(",") if isinstance(value, str) else value
    out = tuple(float(x) for x in parts)
    if not out or any(not math.isfinite(x) or x < 0 for x in out):
        raise ValueError(f"{value!r} has a negative or non-finite weight")
    return out


PLUGIN = '''
from dataclasses import dataclass
from pathlib import Path

from kvviz.core.policies.tova import Tova
from kvviz.policies import param


def existing_file(value):
    """a path to an existing file"""
    if not Path(value).is_file():
        raise ValueError(f"no such file: {value}")
    return value


@dataclass
class Tabled(Tova):
    table: str = param(__file__, label="table", validate=existing_file, help="a file it reads",
                       source="a test")
    name = "tabled"
    label = "tabled"
'''


@dataclass
class Kinds(Tova):
    table: str = param(__file__, label="table", validate=existing_file, help="a file", source="a test")
    note: str = param("", label="note", help="free text", source="a test")
    share: float = param(0.5, label="share", min=0.0, max=1.0, validate=probability, help="h", source="s")
    strict: bool = param(False, label="strict", help="a switch", source="a test")
    mix: tuple = param((1.0, 2.0), label="mix", validate=weights, help="weights", source="a test")

    name = "kinds-test"
    label = "kinds"


def test_each_kind_is_read_from_its_text_and_checked_by_its_validator(tmp_path, monkeypatch):
    register_policy(Kinds)
    try:
        specs = {s.name: s for s in Kinds.specs}
        assert [specs[k].kind for k in ("table", "note", "share", "strict", "mix")] == [
            "str", "str", "float", "bool", "value"]
        (tmp_path / "t.json").write_text("{}")
        monkeypatch.chdir(tmp_path)
        got = parse_params("kinds-test", {"table": "t.json", "note": " hi ", "share": "0.25",
                                          "strict": "yes", "mix": "1,0.5"})
        assert got == {"table": str(tmp_path / "t.json"), "note": "hi", "share": 0.25, "strict": True,
                       "mix": (1.0, 0.5)}
        policy = Kinds(budget=8, table="t.json", mix=(3, 4))
        assert policy.table == str(tmp_path / "t.json") and policy.mix == (3.0, 4.0)
        assert "mix=(3.0, 4.0)" in config_label("kinds-test", policy.params)
    finally:
        unregister_policy("kinds-test")


@pytest.mark.parametrize("given, message", [
    ({"table": "heads.json"}, "table must be a path to an existing file: no such file: heads.json "
                              "(got 'heads.json')"),
    ({"table": 3}, "table must be a string, got 3"),
    ({"share": 0.0}, "share must be a number in 0..1, not 0: 0.0 is outside (0, 1] (got 0.0)"),
    ({"share": 1.5}, "share must be in 0.0..1.0, got 1.5"),
    ({"strict": "maybe"}, "strict must be true or false, got 'maybe'"),
    ({"mix": "1,-2"}, "mix must be comma-separated non-negative numbers: '1,-2' has a negative or "
                      "non-finite weight (got '1,-2')"),
    ({"mix": "a,b"}, "mix must be comma-separated non-negative numbers: could not convert string to "
                     "float: 'a' (got 'a,b')"),
])
def test_a_bad_value_is_refused_naming_the_parameter_and_the_rule(given, message):
    with pytest.raises(ValueError) as exc:
        Kinds(budget=8, **given)
    assert str(exc.value) == message


def test_the_refusal_probes_of_a_validated_string_are_the_values_it_refuses():
    table = next(s for s in Kinds.specs if s.name == "table")
    probes = bad_values(table)
    assert "no-such-file.json" in probes and 3 in probes and None in probes and __file__ not in probes
    note = next(s for s in Kinds.specs if s.name == "note")
    assert "" not in bad_values(note) and 3 in bad_values(note)  # a free string: only the type
    (passed,) = [r.passed for r in check_refusals(Kinds)]
    assert passed


def test_kvviz_check_runs_a_policy_with_a_path_parameter_and_fails_one_that_skips_its_rule(tmp_path, capsys):
    from kvviz.__main__ import main

    good = tmp_path / "tabled.py"
    good.write_text(PLUGIN)
    assert main(["check", f"{good}:Tabled", "--steps", "64"]) == 0, capsys.readouterr().out
    capsys.readouterr()
    lax = tmp_path / "lax.py"  # its constructor skips the declared rules
    lax.write_text(PLUGIN + "\n    def __post_init__(self):\n        self.reset_state()\n")
    assert main(["check", f"{lax}:Tabled", "--steps", "64"]) == 1
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("FAIL")]
    assert line.startswith("  FAIL  refusals: ") and "table=None: accepted" in line
    assert "table='no-such-file.json': accepted" in line


def test_the_declaration_rules_for_the_new_kinds():
    @dataclass
    class Ranged(Tova):
        path: str = param("x", label="path", min=0, help="h", source="s")
        name = "ranged-str"
        label = "ranged"

    with pytest.raises(ValueError, match="ranged-str.path: min, max and choices are for numbers and "
                                         "choices; a str parameter states its rule with validate="):
        check_declaration(Ranged)

    @dataclass
    class BadDefault(Tova):
        path: str = param("missing.json", label="path", validate=existing_file, help="h", source="s")
        name = "bad-default-path"
        label = "bad default"

    with pytest.raises(ValueError, match="bad-default-path.path: the default breaks its own rule: path must "
                                         "be a path to an existing file: no such file: missing.json"):
        check_declaration(BadDefault)
    with pytest.raises(ValueError, match="validate must be a function"):
        param("x", label="x", help="h", source="s", validate="existing_file")


def test_the_page_shows_a_text_box_for_a_path_parameter_and_refuses_a_bad_one(tmp_path, monkeypatch, apptest):
    import apphelp

    plugin = tmp_path / "tabled.py"
    plugin.write_text(PLUGIN)
    monkeypatch.setenv("KVVIZ_PLUGINS", str(plugin))
    at = apphelp.app(a="tabled", b="tova", budget=64, step=300)
    apphelp.ok(at)
    box = at.sidebar.text_input(key="w.pa.table")
    assert box.value == str(plugin)
    box.set_value(str(tmp_path / "missing.json")).run()
    apphelp.ok(at)
    shown = [e.value for e in at.error] + [w.value for w in at.warning]
    assert any("table must be a path to an existing file: no such file:" in m for m in shown), shown
