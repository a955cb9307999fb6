"""`kvviz app --dry-run`: which traces it serves, and the addresses it gives a class."""
import ipaddress
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from kvviz.app import launch

ROOT = Path(__file__).resolve().parents[1]


def dry(capsys, *args) -> list[str]:
    assert launch.main(["--dry-run", *args]) == 0
    return capsys.readouterr().out.strip().splitlines()


def _fake_checkout(d: Path, name="kvviz") -> Path:
    d.mkdir()
    (d / "pyproject.toml").write_text(f'[project]\nname = "{name}"\nversion = "0"\n')
    (d / "app.py").write_text("")
    (d / "traces").mkdir()
    (d / "traces" / "mine.npz").write_bytes(b"")
    return d


def test_inside_a_kvviz_checkout_its_traces_are_served(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("KVVIZ_TRACES_DIR", raising=False)
    monkeypatch.delenv("KVVIZ_LOOP_DIR", raising=False)
    here = _fake_checkout(tmp_path / "clone")
    monkeypatch.chdir(here)
    cmd, traces, loop = dry(capsys)
    assert traces == f"traces: {here.resolve() / 'traces'}"
    assert loop == "loop results: None"  # this clone has no traces/loop/
    assert f"run {ROOT / 'app.py'} " in cmd  # the page is this kvviz's own, not the clone's
    other = _fake_checkout(tmp_path / "other", name="not-kvviz")
    monkeypatch.chdir(other)
    assert dry(capsys)[1] == f"traces: {ROOT / 'traces'}"
    monkeypatch.setenv("KVVIZ_TRACES_DIR", str(tmp_path))  # the variable wins over both
    monkeypatch.chdir(here)
    assert dry(capsys)[1] == f"traces: {tmp_path}"


def _bindable(ip: str) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((ip, 0))
            return True
        except OSError:
            return False


def test_bound_to_all_interfaces_it_prints_the_class_urls(capsys):
    lines = dry(capsys, "--server.address", "0.0.0.0", "--server.port=8777")
    assert lines[-1].startswith("class URLs: ")
    urls = lines[-1].removeprefix("class URLs: ").split()
    ips = [u.removeprefix("http://").removesuffix(":8777") for u in urls]
    assert all(u == f"http://{ip}:8777" for u, ip in zip(urls, ips))
    for ip in ips:  # addresses of this machine, none of them loopback
        assert not ipaddress.ip_address(ip).is_loopback and _bindable(ip), ip
    if shutil.which("ip"):  # and the same ones the system reports
        out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True).stdout
        listed = {ln.split()[3].split("/")[0] for ln in out.splitlines() if len(ln.split()) > 3}
        assert set(ips) == {a for a in listed if not a.startswith("127.")}
    assert ips, "this machine has a network address other than loopback"


@pytest.mark.parametrize("args", [[], ["--server.address=127.0.0.1"], ["--server.port", "8502"]])
def test_no_class_urls_when_bound_to_loopback(capsys, args):
    assert not any(ln.startswith("class URLs") for ln in dry(capsys, *args))


def test_the_checkouts_streamlit_config_says_what_kvviz_app_passes():
    """`streamlit run app.py` in a checkout reads .streamlit/config.toml; `kvviz app` passes
    launch.SETTINGS as flags (an install has no .streamlit/). One list, the same everywhere."""
    import tomllib

    toml = tomllib.loads((ROOT / ".streamlit" / "config.toml").read_text())
    as_flags = {f"{section}.{key}": str(v).lower() if isinstance(v, bool) else str(v)
                for section, values in toml.items() for key, v in values.items()}
    assert as_flags == launch.SETTINGS
    flags = launch.command([])[5:]
    assert flags == [f"--{k}={v}" for k, v in launch.SETTINGS.items()]
    assert "--server.address=127.0.0.1" not in launch.command(["--server.address", "0.0.0.0"])
