"""The study design's pieces without a model: the haystack corpus and its licence, the
returns and variable-tracking tasks' options and geometry, a grid over several haystacks
(run ids, order, refusals), the Scissorhands tie rule on a hand-worked vector (fast policy
and reference), the power calculation; then, on SmolLM2's tokenizer only, the prompts the
generator builds (lengths, where the returns and the key sit, the quiet stretch)."""
import math
from pathlib import Path

import numpy as np
import pytest

from kvviz.core.policies import make_policy
from kvviz.core.reference import RefScissorhands
from kvviz.model.needle.grid import Grid
from kvviz.model.needle.tasks import (
    KEY_BEFORE,
    MOST_RETURNS,
    RETURN,
    RETURNS_AT,
    SNAP,
    Task,
    key_position,
    return_positions,
)
from lab.studies import power

ROOT = Path(__file__).resolve().parents[1]
HAY = ROOT / "traces" / "haystacks"


# --- the haystacks -------------------------------------------------------------------------
def test_haystacks_are_twenty_or_more_distinct_prose_texts_with_their_licence():
    files = sorted(HAY.glob("*.txt"))
    texts = [f.read_text(encoding="utf-8") for f in files]
    assert len(files) >= 20 and len(set(texts)) == len(texts)
    for f, t in zip(files, texts):
        assert t.isascii() and 1000 <= len(t.strip()) <= 3200, f.name
        assert "::=" not in t and ">>>" not in t, f.name  # prose: no grammar, no session
        assert t.strip().endswith("."), f.name
    assert "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2" in (HAY / "LICENSE").read_text()
    assert "PSF" in (HAY / "README.md").read_text()


def test_read_haystacks_names_by_stem_and_refuses_what_it_cannot_use(tmp_path):
    from kvviz.model.needle.cli import read_haystacks

    hays = read_haystacks(HAY)
    assert list(hays) == sorted(f.stem for f in HAY.glob("*.txt"))
    with pytest.raises(ValueError, match="--haystacks .*no .txt"):
        read_haystacks(tmp_path)
    with pytest.raises(ValueError, match="--haystacks .*not a folder"):
        read_haystacks(tmp_path / "absent")
    (tmp_path / "blank.txt").write_text("  \n")
    with pytest.raises(ValueError, match="--haystacks .*blank.txt.*empty"):
        read_haystacks(tmp_path)


# --- the tasks' options and geometry ---------------------------------------------------------
def test_returns_and_hops_take_zero_to_their_most_and_only_their_task():
    assert Task("returns").returns == 3 and Task("vartrack").hops == 2
    assert Task("returns", returns=0).prefix == "returns0-" and Task("vartrack", hops=1).prefix == "vartrack1-"
    with pytest.raises(ValueError, match="--returns 4: at most 3"):
        Task("returns", returns=MOST_RETURNS + 1)
    with pytest.raises(ValueError, match="--returns must be an integer >= 0"):
        Task("returns", returns=-1)
    with pytest.raises(ValueError, match="--hops: only --task vartrack takes it"):
        Task("returns", hops=1)


def test_returns_sit_evenly_spaced_after_a_budget_of_three_quarters_and_the_key_before_them():
    last, gap = RETURNS_AT
    assert return_positions(256, 3) == [round((last - 2 * gap) * 256), round((last - gap) * 256), round(last * 256)]
    assert return_positions(256, 3) == [197, 210, 223]
    assert return_positions(256, 1) == [223] and return_positions(256, 0) == []
    assert min(return_positions(256, MOST_RETURNS)) - SNAP >= 192  # inside the window of budget 192
    assert key_position(256, 0, 30) == 31 and key_position(256, 100, 30) == int(KEY_BEFORE * 256)


# --- a grid over haystacks ---------------------------------------------------------------------
def test_a_grid_over_haystacks_names_each_run_by_its_haystack_haystacks_innermost():
    g = Grid(lengths=[256], depths=[10, 50], seeds=[1], policies=["tova"], budgets=[160],
             task=Task("returns", returns=3), haystacks=["try", "for"])
    assert [s.id for s in g.prompts()] == [
        "returns3-htry-L256-d10-s1-decode-layer", "returns3-hfor-L256-d10-s1-decode-layer",
        "returns3-htry-L256-d50-s1-decode-layer", "returns3-hfor-L256-d50-s1-decode-layer"]
    assert Grid(lengths=[256], depths=[10], seeds=[1], policies=["tova"], budgets=[160]).prompts()[0].id == \
        "L256-d10-s1-decode-layer"  # one haystack: the ids are unchanged
    with pytest.raises(ValueError, match="--haystacks: a haystack's name"):
        Grid(lengths=[256], depths=[10], seeds=[1], policies=["tova"], budgets=[160], haystacks=["a b"])
    with pytest.raises(ValueError, match="--haystacks: a value repeats"):
        Grid(lengths=[256], depths=[10], seeds=[1], policies=["tova"], budgets=[160], haystacks=["a", "a"])


def test_the_cli_refuses_a_haystack_and_haystacks_together(capsys):
    from kvviz.model.needle.cli import main

    assert main(["--out", "x", "--policies", "tova", "--budgets", "64", "--haystack", "a.txt",
                 "--haystacks", str(HAY)]) == 2
    assert "--haystack and --haystacks" in capsys.readouterr().err


# --- Scissorhands' tie rule ------------------------------------------------------------------------
STEPS = [(0, None), (1, [1.0]), (2, [0.5, 0.5]), (3, [0.3, 0.3, 0.4])]


def _victims(policy):
    for pos, row in STEPS:
        policy.advance(pos, None if row is None else np.array(row, np.float32))
    return list(policy.evict(3))


@pytest.mark.parametrize("tie_break, victim", [("position", 0), ("attention", 1)])
def test_scissorhands_ties_go_by_position_or_by_accumulated_attention(tie_break, victim):
    # history window 1: only the last step counts. Its row puts positions 0 and 1 below the
    # uniform share (0.3 < 1/3), 2 above it, 3 unobserved: 0 and 1 tie at one low step.
    # Accumulated attention: position 0 got 1.0 + 0.5 + 0.3 = 1.8, position 1 0.5 + 0.3 = 0.8.
    # The registry's rule evicts the lower position (0); tie_break="attention" the less
    # attended one (1).
    kw = dict(budget=3, history_window=1, recent_window=0, tie_break=tie_break)
    assert _victims(make_policy("scissorhands", **kw)) == [victim]
    ref = RefScissorhands(3, None, history_window=1, recent_window=0, tie_break=tie_break)
    for pos, row in STEPS:
        ref.on_decode_step(pos, row)
    assert list(ref.evict(3)) == [victim]


def test_scissorhands_equal_sums_still_go_to_the_lower_position():
    p = make_policy("scissorhands", budget=2, history_window=1, recent_window=0, tie_break="attention")
    for pos, row in [(0, None), (1, [1.0]), (2, [0.5, 0.5]), (3, [0.25, 0.25, 0.5])]:
        p.advance(pos, None if row is None else np.array(row, np.float32))
    # 0: 1.0 + 0.5 + 0.25 = 1.75 and 1: 0.5 + 0.25 = 0.75 both low once; 2 (0.5) not; 3 none.
    # Two victims: the counts put 0 and 1 first, and both go.
    assert list(p.evict(2)) == [0, 1]
    assert make_policy("scissorhands").tie_break == "position"  # the registry's rule is the default
    with pytest.raises(ValueError, match="tie_break"):
        make_policy("scissorhands", tie_break="age")


# --- the power calculation -------------------------------------------------------------------
def test_connor_formula_and_exact_power():
    # ( 1.95996 sqrt(.3) + 0.84162 sqrt(.26) )^2 / .04 = 56.4
    assert power.connor(0.30) == 57
    assert power.sign_p(0, 5) == pytest.approx(2 / 32) and power.sign_p(1, 6) == pytest.approx(2 * 7 / 64)
    assert power.rejects(6) == (True, False, False, False, False, False, True)  # 2/64 <= .05 only at 0 and 6
    # the exact power of n = 1 with pd = 1: one discordant pair never rejects
    assert power.exact_power(1, 1.0) == 0.0
    n = power.exact_n(0.30)
    assert power.exact_power(n, 0.30) >= 0.8 > power.exact_power(30, 0.30)
    assert math.isclose(sum(power.pmf(k, 10, 0.3) for k in range(11)), 1.0)


# --- the prompts on SmolLM2's tokenizer ---------------------------------------------------------
@pytest.fixture(scope="module")
def tok(torch_stack):
    from kvviz.model.needle.run import load_tokenizer

    return load_tokenizer(None)


@pytest.mark.model
@pytest.mark.parametrize("name", ["try", "naming", "dict"])
@pytest.mark.parametrize("depth", [10, 90])
def test_returns_prompts_put_the_key_early_and_the_returns_in_the_window(tok, name, depth):
    from kvviz.model.needle.tasks import build

    text = (HAY / f"{name}.txt").read_text()
    p = build(tok, Task("returns", returns=3), 256, depth, 1, text)
    assert len(p.ids) == 256 and p.task == "returns"
    assert "".join(tok.decode([p.ids[i]]) for i in p.key_positions).replace(" ", "") == p.key * 2
    assert max(p.key_positions) < 0.55 * 256  # well before eviction starts
    starts = [a for a, _ in p.reminders]
    assert len(starts) == 3 and all(abs(a - t) <= SNAP + 1 for a, t in zip(starts, return_positions(256, 3)))
    assert min(starts) >= 192  # inside the window of budget 192
    assert all(tok.decode(p.ids[a:b]).strip() == RETURN for a, b in p.reminders)
    assert p.question_start - p.reminders[-1][1] >= 10  # the quiet stretch
    none = build(tok, Task("returns", returns=0), 256, depth, 1, text)
    assert none.reminders == [] and none.key == p.key and len(none.ids) == 256


@pytest.mark.model
def test_vartrack_passes_the_value_along_a_chain(tok):
    from kvviz.model.needle.tasks import build

    p = build(tok, Task("vartrack", hops=2), 256, 50, 1, (HAY / "for.txt").read_text())
    a, b, c = [p.text[p.text.index("VAR " + n):].split(".")[0] for n in p.text.split("VAR ")[1:] and
               [s.split(" ")[0] for s in p.text.split("VAR ")[1:]]]
    assert a.endswith(p.key) and b.endswith(a.split()[1]) and c.endswith(b.split()[1])
    assert p.target == c.split()[1] and p.text.endswith(f"What is the value of {p.target}? The value of {p.target} is")
    assert len(p.ids) == 256 and len(p.reminders) == 2


# --- the results' study columns, the per-spec haystack, `kvviz check NAME:k=v` -----------------
def test_results_rows_carry_the_haystack_the_gate_the_quiet_stretch_and_the_cost(tmp_path):
    from kvviz.model.needle.results import save_run, write_tables

    T0, C = 12, 2
    ev = np.full((C, 1, 1, T0 + 2), -1, np.int32)
    ev[1, 0, 0, [2, 9]] = 11  # the config loses one key token and one neighbour at the last prompt step
    meta = dict(id="phrase2-htry-L12-d50-s1-prefill-layer", length=12, depth=50, seed=1, prompt_mode="prefill",
                granularity="layer", key="amber river", key_positions=[2, 3], question_start=8, prompt_len=T0,
                max_new_tokens=2, haystack={"name": "try", "sha256": "x"}, model={"model": "m"},
                kvviz_version="t", configs=[{"policy": "full", "params": {}, "budget": None, "label": "full"},
                                            {"policy": "snapkv", "params": {}, "budget": 6, "label": "snapkv@6"}],
                answers=[" amber river", " amber"], correct=[True, False], agreement=[None, 0.5], layers=1,
                kv_heads=1, seconds=8.0, batch_prompts=4, task="phrase", phrase_words=2, reminders=[[5, 7]],
                neighbour_positions=[0, 1, 4, 9])
    save_run(tmp_path, meta, list(range(T0)), ["t"] * T0, np.zeros((C, 2), np.int64), ev)
    df = write_tables(tmp_path)
    assert list(df["haystack"]) == ["try", "try"] and list(df["full_cache_correct"]) == [True, True]
    assert list(df["correct"]) == [True, False] and list(df["outcome"]) == ["whole", "partial"]
    assert list(df["quiet"]) == [1, 1]  # the question at 8, the last reminder ending at 7
    assert list(df["seconds"] / df["batch_prompts"]) == [2.0, 2.0]
    assert list(df["neighbours_held_end"]) == [1.0, 0.75] and list(df["returns"]) == [-1, -1]


def test_each_spec_reads_its_own_haystack():
    from kvviz.model.needle.grid import PromptSpec
    from kvviz.model.needle.run import spec_haystack

    spec = PromptSpec(256, 50, 1, "decode", "layer", "returns3-", "try")
    assert spec_haystack(spec, {"try": "A.", "for": "B."}, None) == ("A.", "try")
    assert spec_haystack(spec, "C.", "c.txt") == ("C.", "c.txt")  # one haystack: the spec's name is not used
    with pytest.raises(ValueError, match="--haystacks: no haystack named 'try'"):
        spec_haystack(spec, {"for": "B."}, None)


def test_kvviz_check_takes_a_policy_with_its_parameters_pinned():
    from kvviz.core.check import load_target

    label, cls = load_target("scissorhands:tie_break=attention")
    assert label == "scissorhands:tie_break=attention"
    spec = next(s for s in cls.specs if s.name == "tie_break")
    assert spec.default == "attention" and spec.choices == ("attention",)  # every drawn scenario uses it
    assert cls(budget=64).tie_break == "attention"
    with pytest.raises(ValueError, match="tie_break"):
        cls(budget=64, tie_break="position")
    with pytest.raises(ValueError, match="tie_break"):
        load_target("scissorhands:tie_break=age")


@pytest.mark.model
def test_a_grid_over_haystacks_runs_batched_records_each_haystack_and_resumes(torch_stack, tmp_path, capsys):
    from kvviz.__main__ import main
    from kvviz.model.needle import list_runs, load_results, load_run

    hay = tmp_path / "hay"
    hay.mkdir()
    for name in ("try", "for"):
        (hay / f"{name}.txt").write_text((HAY / f"{name}.txt").read_text())
    argv = ["needle", "--out", str(tmp_path / "out"), "--task", "returns", "--returns", "1", "--haystacks", str(hay),
            "--lengths", "192", "--depths", "50", "--policies", "tova", "--budgets", "144",
            "--prompt-modes", "prefill", "--batch", "2", "--threads", "1", "--quiet"]
    assert main(argv) == 0
    assert list_runs(tmp_path / "out") == ["returns1-hfor-L192-d50-s0-prefill-layer",
                                            "returns1-htry-L192-d50-s0-prefill-layer"]
    df = load_results(tmp_path / "out")
    assert sorted(set(df["haystack"])) == ["for", "try"] and set(df["batch_prompts"]) == {2}
    for id_ in list_runs(tmp_path / "out"):
        meta = load_run(tmp_path / "out", id_)["meta"]
        assert meta["haystack"]["name"] == id_.split("-")[1][1:] and len(meta["reminders"]) == 1
    capsys.readouterr()
    assert main(argv) == 0  # everything done: nothing runs again
    assert "2 prompts x 2 configs in 0 s" in capsys.readouterr().out


def test_a_run_saved_before_the_tie_rule_existed_still_resumes():
    from kvviz.model.loop.config import LoopConfig
    from kvviz.model.needle.run import label_now

    old = {"policy": "scissorhands", "params": {"history_window": 32, "recent_window": 32}, "budget": 128,
           "label": "scissorhands(history_window=32,recent_window=32)@128"}  # as the shipped runs record it
    assert label_now(old) == LoopConfig("scissorhands", {}, 128).label
    assert label_now(old) != LoopConfig("scissorhands", {"tie_break": "attention"}, 128).label
    assert label_now({"policy": "full", "params": {}, "budget": None, "label": "full"}) == "full"
    gone = {"policy": "not-registered", "params": {}, "budget": 8, "label": "not-registered@8"}
    assert label_now(gone) == "not-registered@8"
