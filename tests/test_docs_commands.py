"""Every shell command in README.md and docs/ (docs/*.md, docs/studies/*.md) names something
that exists, and every relative link there leads to a file.

The docs promise that their commands run as written from the checkout in a new shell (no
venv activated) once ./scripts/test.sh has run. Running them all is too slow for CI, so this
checks what a new shell would trip on first: each command's executable (`.venv/bin/X`,
`./scripts/X`, or a command on PATH), the module of `python -m MOD` (the lab's, `lab.X`, from
the checkout), the file of `python FILE.py`. A bare name the .venv provides (`pytest`, `streamlit`, `python`) is
refused even if some other install has it on PATH, and so is the `pytest` script itself
(only `python -m pytest` puts the checkout on sys.path). Fenced blocks with no language,
`bash`, `sh`, `shell` or `console` are shell; anything else (```python, ```toml, ```text) is not.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
SHELL_LANGS = {"", "bash", "sh", "shell", "console"}
BUILTINS = {"cd", "export", "set", "source", ".", "unset", "echo", "true", "false"}
FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)")
ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
OPERATORS = {"&&", "||", ";", "|", "&"}


def shell_blocks(text: str) -> list[tuple[int, list[str]]]:
    """(first line number, lines) of each shell-fenced block."""
    blocks, fence, lang, start, lines = [], None, "", 0, []
    for no, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if fence is None and m:
            fence, lang, start, lines = m.group(1), m.group(2).lower(), no + 1, []
        elif fence is not None and line.strip().startswith(fence) and not line.strip()[len(fence):]:
            if lang in SHELL_LANGS:
                blocks.append((start, lines))
            fence = None
        elif fence is not None:
            lines.append(line)
    return blocks


def commands(lines: list[str], console: bool = False) -> list[list[str]]:
    """The simple commands of a block: continuation lines joined, comments dropped,
    `&&` / `||` / `;` / `|` chains split, leading `VAR=value` assignments skipped."""
    if any(ln.lstrip().startswith("$ ") for ln in lines) or console:
        lines = [ln.lstrip()[2:] for ln in lines if ln.lstrip().startswith("$ ")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    out = []
    for line in joined.splitlines():
        lex = shlex.shlex(line, posix=True, punctuation_chars=True)
        lex.whitespace_split, lex.commenters = True, "#"
        try:
            toks = [*lex, ";"]
        except ValueError as e:  # an unclosed quote: broken as a command too
            out.append([f"unparsable ({e}): {line.strip()}"])
            continue
        cmd: list[str] = []
        for tok in toks:
            if tok in OPERATORS:
                while cmd and ENV.match(cmd[0]):
                    cmd.pop(0)
                if cmd:
                    out.append(cmd)
                cmd = []
            else:
                cmd.append(tok)
    return out


def venv_dir() -> Path:
    """The `.venv` that ./scripts/test.sh made: the checkout's, else the one running us."""
    return REPO / ".venv" if (REPO / ".venv").exists() else Path(sys.prefix)


def project_scripts() -> set[str]:
    return set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"])


def resolve(word: str) -> Path:
    if word == ".venv" or word.startswith(".venv/"):
        return venv_dir() / word[len(".venv/"):] if word != ".venv" else venv_dir()
    return Path(word) if word.startswith("/") else REPO / word


def module_exists(mod: str) -> bool:
    if mod.split(".")[0] == "lab":  # the checkout's lab/, not installed: run from the repository root
        return (REPO / Path(*mod.split("."))).with_suffix(".py").is_file()
    try:
        return importlib.util.find_spec(mod) is not None
    except ImportError:  # a missing parent package
        return False


def problems(cmds: list[list[str]]) -> list[str]:
    """What a new shell in the checkout would not find, command by command. A path under an
    argument of an earlier command in the same block counts as made by it (a venv the
    block creates); `.venv/bin/<project script>` counts as made by an earlier
    `pip install .`."""
    found, made, installed = [], [], False
    for cmd in cmds:
        exe, args = cmd[0], cmd[1:]
        if exe in BUILTINS:
            continue
        if "/" in exe:
            path = resolve(exe)
            by_earlier = any(exe.startswith(m.rstrip("/") + "/") for m in made)
            by_pip = installed and exe.startswith(".venv/bin/") and \
                Path(exe).name in project_scripts()
            if not (by_earlier or by_pip) and not (path.is_file() and os.access(path, os.X_OK)):
                found.append(f"{exe}: no such executable")
                continue
        elif (venv_dir() / "bin" / exe).exists() and args[:2] != ["-m", "venv"]:
            # a `pytest` or `python` on PATH is some other install, without the project's
            # packages (pyenv shims have one): only the bootstrap `python3 -m venv` may use it
            found.append(f"{exe}: the .venv's {exe} is meant (write it as .venv/bin/{exe})")
            continue
        elif shutil.which(exe) is None:
            found.append(f"{exe}: not on PATH (write it as .venv/bin/{exe} or ./scripts/{exe})")
            continue
        name = Path(exe).name
        if name in ("pytest", "py.test"):  # its script does not put the checkout on sys.path
            found.append(f"{exe}: cannot import kvviz from the checkout (write it as "
                         ".venv/bin/python -m pytest, as scripts/test.sh does)")
            continue
        if re.fullmatch(r"python(3(\.\d+)?)?", name) and args:
            if args[0] == "-m" and len(args) > 1 and args[1] != "venv":
                if not module_exists(args[1]):
                    found.append(f"{exe} -m {args[1]}: no such module")
            elif args[0].endswith(".py") and not resolve(args[0]).is_file():
                found.append(f"{exe} {args[0]}: no such file")
        if name == "pip" and args[:1] == ["install"] and any(a.startswith(".") for a in args):
            installed = True
        made += [a for a in args if not a.startswith("-")]
    return found


def doc_commands():
    for doc in DOCS:
        for start, lines in shell_blocks(doc.read_text()):
            cmds = commands(lines)
            if cmds:
                yield pytest.param(cmds, id=f"{doc.relative_to(REPO)}:{start}")


@pytest.mark.parametrize("cmds", list(doc_commands()))
def test_documented_commands_name_existing_executables(cmds):
    assert problems(cmds) == []


def test_the_docs_have_commands_to_check():
    ids = [p.id for p in doc_commands()]
    assert any(i.startswith("README.md") for i in ids) and any(i.startswith("docs/") for i in ids)


FAKE_DOC = """
Start it:

```
streamlit-not-installed run app.py
```

```bash
KVVIZ_X=1 A=2 .venv/bin/no-such-tool --flag && ./scripts/test.sh   # comment && ignored
.venv/bin/python -m kvviz.no_such_module \\
    --option
.venv/bin/python scripts/no_such_script.py
python3 -m venv /tmp/v && /tmp/v/bin/pip install x
```

```python
this_is_python --not-a-command
```

```text
trace -> replay -> run
```

```console
$ ./scripts/test.sh
some output line
```
"""


def test_the_extractor_finds_and_splits_commands():
    blocks = shell_blocks(FAKE_DOC)
    assert [len(b) for _, b in blocks] == [1, 5, 2]  # python and text blocks skipped
    cmds = [c for _, b in blocks for c in commands(b)]
    assert [c[0] for c in cmds] == ["streamlit-not-installed", ".venv/bin/no-such-tool",
                                    "./scripts/test.sh", ".venv/bin/python", ".venv/bin/python",
                                    "python3", "/tmp/v/bin/pip", "./scripts/test.sh"]
    assert cmds[1] == [".venv/bin/no-such-tool", "--flag"]  # env prefix skipped
    assert cmds[3] == [".venv/bin/python", "-m", "kvviz.no_such_module", "--option"]


def test_the_check_fails_on_missing_executables():
    blocks = shell_blocks(FAKE_DOC)
    found = problems([c for _, b in blocks for c in commands(b)])
    assert found == [
        "streamlit-not-installed: not on PATH (write it as "
        ".venv/bin/streamlit-not-installed or ./scripts/streamlit-not-installed)",
        ".venv/bin/no-such-tool: no such executable",
        ".venv/bin/python -m kvviz.no_such_module: no such module",
        ".venv/bin/python scripts/no_such_script.py: no such file",
    ]  # ./scripts/test.sh exists; /tmp/v/bin/pip is made by the venv command before it


def test_a_bare_venv_command_is_refused_even_when_on_path(monkeypatch):
    bin_dir = venv_dir() / "bin"
    assert (bin_dir / "pytest").exists()  # test.sh installs it
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    assert problems([["pytest", "tests/test_app.py"], ["python", "-m", "kvviz", "app"]]) == [
        "pytest: the .venv's pytest is meant (write it as .venv/bin/pytest)",
        "python: the .venv's python is meant (write it as .venv/bin/python)"]
    assert problems([[".venv/bin/python", "-m", "pytest", "tests/test_app.py"],
                     ["python3", "-m", "venv", ".venv"]]) == []
    assert problems([[".venv/bin/pytest", "tests/test_app.py"]]) == [
        ".venv/bin/pytest: cannot import kvviz from the checkout (write it as "
        ".venv/bin/python -m pytest, as scripts/test.sh does)"]


LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)\s]*)?\)")


def test_relative_links_lead_to_files():
    broken = [f"{doc.relative_to(REPO)}: {target}" for doc in DOCS for target in LINK.findall(doc.read_text())
              if ":" not in target and not (doc.parent / target).exists()]
    assert broken == []


def test_the_readme_carries_no_generated_study_text():
    """The README is a quickstart: a report's generated block lives in the studies' index."""
    readme = (REPO / "README.md").read_text()
    index = (REPO / "docs" / "studies" / "README.md").read_text()
    assert "<!--" not in readme
    assert "<!-- tasks:summary -->" in index and "<!-- /tasks:summary -->" in index
    assert "](docs/studies/README.md)" in readme
    for page in sorted((REPO / "docs" / "studies").glob("*.md")):  # the index links every study page
        assert page.name == "README.md" or f"]({page.name})" in index, page.name


def test_a_lab_module_is_found_in_the_checkout():
    assert problems([[".venv/bin/python", "-m", "lab.tasks_report", "traces/tasks"]]) == []
    assert problems([[".venv/bin/python", "-m", "lab.no_such_report"]]) == [
        ".venv/bin/python -m lab.no_such_report: no such module"]
