"""Tidy data: `to_frame()` on a replay Run, a loop result, a generation and a needle run,
checked against runs built by hand (every expected value worked out below from the held
rule: position p is held for query t when p < t and it was evicted at a step >= t, or
never), and `kvviz export`'s round trip through CSV and Parquet."""
import math
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
from apphelp import REPO

from kvviz.core.replay import NEVER, Replay, Run
from kvviz.core.trace import ArrayTrace, canonical

# Rows of a 4-step trace, unnormalised: query 1 on [0], query 2 on [0, 1], query 3 on [0, 1, 2].
# Normalised: q1 [1.0]; q2 [0.25, 0.75]; q3 [0.25, 0.25, 0.5].
PACKED = np.array([2.0, 1.0, 3.0, 1.0, 1.0, 2.0], np.float32)
TOKENS = ["The", " cat", " sat", "."]
EVICTED = np.array([NEVER, 2, NEVER, NEVER])  # position 1 goes at step 2: query 2 still sees it


def hand_trace():
    return ArrayTrace(PACKED, 4, name="hand", tokens=TOKENS, layers=[7], layer=7, heads=["mean"], head="mean")


def hand_run():
    return Run(policy="tova", params={}, budget=2, steps=4, evicted_at=EVICTED.copy(),
               retained=np.full(4, np.nan))


def test_run_to_frame_per_position_against_hand_values():
    df = hand_run().to_frame(hand_trace())
    assert list(df.columns) == ["config", "policy", "budget", "layer", "head", "position", "token",
                                "admitted", "evicted", "full_mass", "lost_mass"]
    assert df["config"].tolist() == ["tova @ 2"] * 4 and df["policy"].tolist() == ["tova"] * 4
    assert df["layer"].tolist() == [7] * 4 and df["head"].tolist() == ["mean"] * 4
    assert df["token"].tolist() == TOKENS
    assert df["admitted"].tolist() == [0, 1, 2, 3]
    assert df["evicted"].isna().tolist() == [True, False, True, True] and df["evicted"][1] == 2
    # p0: 1.0 + 0.25 + 0.25; p1: 0.75 + 0.25; p2: 0.5; p3: no query after it
    assert np.allclose(df["full_mass"][:3], [1.5, 1.0, 0.5]) and math.isnan(df["full_mass"][3])
    # only query 3 comes after position 1's eviction, and gave it 0.25
    assert np.allclose(df["lost_mass"][:3], [0.0, 0.25, 0.0]) and math.isnan(df["lost_mass"][3])


def test_run_to_frame_per_step_against_hand_values():
    df = hand_run().to_frame(hand_trace(), per="step")
    got = list(zip(df["step"], df["position"], df["held"], df["full_mass"].round(6), df["token"]))
    assert got == [(1, 0, True, 1.0, "The"),
                   (2, 0, True, 0.25, "The"), (2, 1, True, 0.75, " cat"),
                   (3, 0, True, 0.25, "The"), (3, 1, False, 0.25, " cat"), (3, 2, True, 0.5, " sat")]


def test_run_to_frame_without_the_trace_has_no_masses_and_refuses_another_trace():
    df = hand_run().to_frame()
    assert df["full_mass"].isna().all() and df["token"].isna().all()
    with pytest.raises(ValueError, match="trace has 5 steps; this run has 4"):
        hand_run().to_frame(ArrayTrace(np.ones(10, np.float32), 5))
    with pytest.raises(ValueError, match=r"per must be one of \['position', 'step'\], got 'row'"):
        hand_run().to_frame(per="row")


def test_per_step_held_mass_is_the_replays_retained_share():
    """On a real replay, the held rows' full_mass of each step sum to the share held_shares
    computes (another code path over the same rule)."""
    trace = canonical(300)
    run = Replay(trace, __import__("kvviz").make_policy("tova", budget=40)).run()
    df = run.to_frame(trace, per="step")
    held = df[df["held"]].groupby("step")["full_mass"].sum()
    assert np.allclose(held.to_numpy(), run.retained[1:], atol=1e-9)


def hand_loop():
    from kvviz.model.loop import LoopConfig, LoopResult

    cfgs = [LoopConfig("full"), LoopConfig("tova", {}, 2)]
    T = 4
    ev = np.full((2, 1, 2, T), NEVER, np.int64)
    ev[1, 0, 0, 1] = 2   # kv0 drops position 1 at step 2
    ev[1, 0, 1, 0] = 3   # kv1 drops position 0 at step 3
    rows = np.zeros((2, 1, 2, 6), np.float32)
    rows[0, 0, 0] = PACKED                                # the full cache, kv0
    rows[0, 0, 1] = [1.0, 1.0, 1.0, 2.0, 1.0, 1.0]        # kv1: q1 [1]; q2 [.5, .5]; q3 [.5, .25, .25]
    rows[1] = 9.0  # the evicting row's own attention: never what full_mass reads
    return LoopResult(configs=cfgs, granularity="kv-head", tokens=TOKENS, token_ids=np.arange(T),
                      nll=np.array([[0.5, 1.0, 1.5], [0.5, 2.0, 4.0]]), p_true=np.ones((2, T - 1)),
                      kl_tokens=np.array([[0.0, 0.0, 0.0], [0.0, 0.25, 0.75]]),
                      top1=np.array([[7, 8, 9], [7, 3, 9]]), evicted_at=ev, layers=[5], rows=rows,
                      rows_layers=[5], rows_tokens=T)


def test_loop_result_to_frame_uses_the_full_caches_rows():
    df = hand_loop().to_frame()
    assert len(df) == 2 * 2 * 4
    tova = df[df["policy"] == "tova"].set_index(["head", "position"])
    assert tova.loc[("kv0", 1), "evicted"] == 2 and math.isclose(tova.loc[("kv0", 1), "lost_mass"], 0.25)
    # kv1, position 0: full mass 1 + .5 + .5; evicted at step 3, so query 3 still saw it: nothing lost
    assert math.isclose(tova.loc[("kv1", 0), "full_mass"], 2.0) and tova.loc[("kv1", 0), "lost_mass"] == 0.0
    assert math.isclose(tova.loc[("kv1", 1), "full_mass"], 0.75)
    full = df[df["policy"] == "full"]
    assert full["config"].unique().tolist() == ["full"] and full["budget"].isna().all()
    assert full["evicted"].isna().all() and (full.dropna(subset=["lost_mass"])["lost_mass"] == 0).all()
    steps = hand_loop().to_frame(per="step", configs=[1], heads=[1])
    assert steps[["step", "position"]].values.tolist() == [[1, 0], [2, 0], [2, 1], [3, 0], [3, 1], [3, 2]]
    assert steps["held"].tolist() == [True, True, True, True, True, True]  # position 0 goes at step 3: after query 3
    assert np.allclose(steps["full_mass"], [1.0, 0.5, 0.5, 0.5, 0.25, 0.25])
    with pytest.raises(ValueError, match=r"layer 4 is not stored; stored layers: \[5\]"):
        hand_loop().to_frame(layers=[4])


def test_loop_position_table_carries_each_tokens_outcome():
    """Position p's row holds the prediction of token p (made at p - 1): its NLL, KL to the
    full cache and whether the argmax agrees; position 0 has none. Every layer and head row
    of a config repeats the token's values, and their means are the config's summary."""
    loop = hand_loop()
    df = loop.to_frame()
    assert list(df.columns)[-3:] == ["nll", "kl", "top1_agreement"]
    assert df["nll"].dtype == "float64" and df["kl"].dtype == "float64" and df["top1_agreement"].dtype == "boolean"
    tova = df[df["policy"] == "tova"]
    for head in ("kv0", "kv1"):
        h = tova[tova["head"] == head]
        assert math.isnan(h["nll"].iloc[0]) and h["nll"].iloc[1:].tolist() == [0.5, 2.0, 4.0]
        assert math.isnan(h["kl"].iloc[0]) and h["kl"].iloc[1:].tolist() == [0.0, 0.25, 0.75]
        assert h["top1_agreement"].isna().tolist() == [True, False, False, False]
        assert h["top1_agreement"].iloc[1:].tolist() == [True, False, True]  # 7=7, 3!=8, 9=9
    full = df[df["policy"] == "full"]
    assert full["top1_agreement"].dropna().all() and (full["kl"].dropna() == 0).all()
    summary = loop.results[1]
    one = tova[tova["head"] == "kv0"]
    assert math.isclose(one["top1_agreement"].astype(float).mean(), summary["top1_agreement"])
    assert math.isclose(one["kl"].mean(), summary["kl"])
    assert math.isclose(math.exp(one["nll"].mean()), summary["perplexity"])
    narrow = loop.to_frame(configs=[1], heads=[1])
    assert narrow["nll"].iloc[1:].tolist() == [0.5, 2.0, 4.0] and len(narrow) == 4
    assert "nll" not in loop.to_frame(per="step").columns  # the step table is per query x position


def hand_generation():
    from kvviz.model.loop import Generation, LoopConfig

    ev = np.full((2, 1, 1, 5), NEVER)
    ev[1, 0, 0, 1] = 3
    return Generation(configs=[LoopConfig("full"), LoopConfig("tova", {}, 3)], granularity="layer",
                      prompt_mode="decode", prompt_ids=[1, 2, 3], tokens=["a", "b", "c"],
                      new_ids=[[7, 8], [7, 9]], logprobs=[[-0.1, -0.2], [-0.1, -0.3]], texts=["d\ne", "dx"],
                      stopped=["length"] * 2, evicted_at=ev, pieces=[["d", "\n,e"], ["d", " x"]])


def test_generation_to_frame_reads_each_rows_own_tokens():
    gen = hand_generation()
    df = gen.to_frame()
    assert df[df["policy"] == "full"]["token"].tolist() == ["a", "b", "c", "d", "\n,e"]
    assert df[df["policy"] == "tova"]["token"].tolist() == ["a", "b", "c", "d", " x"]
    assert df[df["policy"] == "tova"]["evicted"].isna().tolist() == [True, False, True, True, True]
    assert df["full_mass"].isna().all()
    steps = gen.to_frame(per="step", configs=[1])
    held = steps.set_index(["step", "position"])["held"]
    assert held[(3, 1)] and not held[(4, 1)]  # evicted at step 3: query 3 saw it, query 4 did not


@pytest.fixture
def needle_dir(tmp_path):
    from kvviz.model.needle.results import save_run

    ev = np.full((2, 2, 1, 8), NEVER)
    ev[1, 0, 0, 2] = 3  # layer 0 loses the key's first digit at step 3, before the question
    ev[1, 1, 0, 3] = 5  # layer 1 loses its second digit at step 5, after the question began
    meta = {"id": "L6-d50-s0-decode-layer", "length": 6, "depth": 50, "seed": 0, "prompt_mode": "decode",
            "granularity": "layer", "key": "42", "key_positions": [2, 3], "question_start": 4, "prompt_len": 6,
            "max_new_tokens": 2, "haystack": {"name": "filler", "sha256": "0"}, "model": {"model": "m"},
            "kvviz_version": "0",
            "configs": [{"policy": "full", "params": {}, "budget": None, "label": "full"},
                        {"policy": "tova", "params": {}, "budget": 4, "label": "tova@4"}],
            "answers": ["42", "4"], "correct": [True, False], "agreement": [1.0, 0.5], "layers": 2, "kv_heads": 1}
    save_run(tmp_path, meta, range(6), ["k", "e", "4", "2", "?", " is"], [[1, 2], [1, 3]], ev)
    return tmp_path


def test_needle_run_to_frame_and_the_long_per_layer_table(needle_dir):
    from kvviz.model.needle.results import layer_table, load_run, write_tables

    df = load_run(needle_dir, "L6-d50-s0-decode-layer").to_frame()
    assert (df["id"] == "L6-d50-s0-decode-layer").all() and len(df) == 2 * 2 * 8
    tova0 = df[(df["policy"] == "tova") & (df["layer"] == 0)]
    assert tova0["token"][:6].tolist() == ["k", "e", "4", "2", "?", " is"]
    assert tova0["token"][6:].isna().all()  # generated: a run keeps their ids only
    assert tova0["evicted"].isna().tolist() == [True, True, False, True, True, True, True, True]
    long = layer_table(needle_dir)
    tova = long[long["label"] == "tova@4"].set_index("layer")
    # the question is read after step 3: layer 0 holds "2" only; layer 1 both (5 > 3)
    assert tova["held_question"].tolist() == [0.5, 1.0]
    # generation starts after step 5: layer 1's "2" went at step 5, so half is held there too
    assert tova["held_end"].tolist() == [0.5, 0.5]
    assert tova["first_lost"].tolist() == [3, 5] and long[long["label"] == "full"]["first_lost"].isna().all()
    # the pass key has no task option: <NA> in each option's column, never -1
    assert (long["task"] == "passkey").all()
    assert long[["reminder_every", "distractors", "phrase_words"]].isna().all().all()
    # each row carries its config's answer, the check's verdict, and the full cache's on the same prompt
    assert tova["answer"].tolist() == ["4", "4"] and not tova["correct"].any()
    assert tova["outcome"].tolist() == ["wrong", "wrong"] and tova["full_cache_correct"].all()
    full = long[long["label"] == "full"]
    assert full["answer"].tolist() == ["42", "42"] and full["correct"].all() and full["budget"].isna().all()
    wide = write_tables(needle_dir)  # the same values as results.csv's JSON lists
    row = wide[wide["label"] == "tova@4"].iloc[0]
    import json
    assert json.loads(row["held_by_layer"]) == [0.5, 1.0] and json.loads(row["first_lost_by_layer"]) == [3, 5]


def kvviz_export(*args, env=None):
    return subprocess.run([sys.executable, "-m", "kvviz", "export", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env=env)


def export_here(capsys, *args) -> tuple[int, str, str]:
    """`kvviz export ARGS` in this process, through the command's own entry: (exit status,
    stdout, stderr). The round trip runs it ten times: a process each would mostly import."""
    from kvviz.__main__ import main

    capsys.readouterr()
    rc = main(["export", *map(str, args)])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_export_round_trip(tmp_path, fmt, needle_dir, capsys):
    from kvviz.studies.export import read

    pytest.importorskip("pyarrow") if fmt == "parquet" else None
    loop = hand_loop()
    loop.save(tmp_path / "loop.npz")
    gen = hand_generation()
    gen.save(tmp_path / "gen.json")
    run_file = needle_dir / "runs" / "L6-d50-s0-decode-layer.npz"
    from kvviz.model.needle.results import read_run
    for src, per, expect in ((tmp_path / "loop.npz", "position", loop.to_frame()),
                             (tmp_path / "loop.npz", "step", loop.to_frame(per="step")),
                             (tmp_path / "gen.json", "position", gen.to_frame()),
                             (run_file, "step", read_run(run_file).to_frame(per="step")),
                             (needle_dir, "position", None)):
        out = tmp_path / f"t-{per}.{fmt}"
        rc, stdout, stderr = export_here(capsys, src, "--format", fmt, "--out", out, "--per", per)
        assert rc == 0, stderr
        back = read(out)
        if expect is None:
            from kvviz.model.needle.results import layer_table
            expect = layer_table(needle_dir)
        assert stdout.strip() == f"{len(expect):,} rows x {len(expect.columns)} columns -> {out}"
        pd.testing.assert_frame_equal(back, expect, check_dtype=fmt == "parquet")
        if fmt == "csv" and "evicted" in back:  # the types a reader needs survive the text
            assert back["evicted"].dtype == "Int64" and back["full_mass"].dtype == "float64"


def test_export_refusals_are_one_line(tmp_path):
    r = kvviz_export(REPO / "traces" / "code.npz", "--format", "csv", "--out", tmp_path / "x.csv")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"error: result {REPO / 'traces' / 'code.npz'} is a trace: give --policy and --budget to replay one"]
    code = ("import sys; sys.modules['pyarrow'] = None\nfrom kvviz.__main__ import main\n"
            f"sys.exit(main(['export', {str(REPO / 'traces' / 'loop' / 'code-layer.npz')!r}, '--format', "
            f"'parquet', '--out', {str(tmp_path / 'x.parquet')!r}]))")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: --format parquet needs pyarrow, which is not installed: pip install 'kvviz[scale]' "
        "(in a checkout: pip install -r requirements-scale.txt), or use --format csv"]
    assert not list(tmp_path.iterdir())


def test_export_replays_a_trace(tmp_path):
    r = kvviz_export(REPO / "traces" / "code.npz", "--format", "csv", "--out", tmp_path / "t.csv",
                     "--policy", "tova", "--budget", "64", "--layer", "14")
    assert r.returncode == 0, r.stderr
    df = pd.read_csv(tmp_path / "t.csv")
    assert (df["layer"] == 14).all() and df["evicted"].notna().sum() == len(df) - 64


LOOP_TYPES = {"config": "string", "policy": "string", "budget": "Int64", "layer": "Int64", "head": "string",
              "position": "int64", "token": "string", "admitted": "int64", "evicted": "Int64",
              "full_mass": "float64", "lost_mass": "float64", "nll": "float64", "kl": "float64",
              "top1_agreement": "boolean"}
NEEDLE_TYPES = {"id": "string", "task": "string", "reminder_every": "Int64", "distractors": "Int64",
                "phrase_words": "Int64", "returns": "Int64", "hops": "Int64", "length": "Int64", "depth": "float64",
                "seed": "Int64",
                "prompt_mode": "string", "granularity": "string", "policy": "string", "label": "string",
                "budget": "Int64", "layer": "Int64", "head": "string", "held_question": "float64",
                "held_end": "float64", "first_lost": "Int64", "answer": "string", "correct": "boolean",
                "outcome": "string", "full_cache_correct": "boolean"}


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_the_long_tables_read_back_typed_with_one_kind_of_null(tmp_path, fmt, needle_dir, capsys):
    """The loop and needle long tables, exported and read with pandas: every column's type as
    listed, absent values null (never -1), no JSON in a cell; a run without a full-cache row
    has a null full-cache verdict."""
    from kvviz.model.needle.results import read_run, save_run
    from kvviz.studies.export import read

    if fmt == "parquet":
        pytest.importorskip("pyarrow")
    run = read_run(needle_dir / "runs" / "L6-d50-s0-decode-layer.npz")
    alone = dict(run["meta"], id="L6-d90-s0-decode-layer", depth=90, configs=run["meta"]["configs"][1:],
                 answers=["42"], correct=[True], agreement=[None])
    save_run(needle_dir, alone, run["prompt_ids"], run["tokens"], run["new_ids"][1:], run["evicted_at"][1:])
    hand_loop().save(tmp_path / "loop.npz")
    tables = {}
    for name, src in (("loop", tmp_path / "loop.npz"), ("needle", needle_dir)):
        out = tmp_path / f"{name}.{fmt}"
        rc, _, err = export_here(capsys, src, "--format", fmt, "--out", out)
        assert rc == 0, err
        if fmt == "csv":
            cells = pd.read_csv(out, dtype=str, keep_default_na=False).to_numpy().ravel()
            assert not [c for c in cells if c.startswith(("[", "{")) or c in ("-1", "<NA>", "nan", "NaN")]
            tables[name] = read(out)
        else:
            tables[name] = pd.read_parquet(out)
    loop, needle = tables["loop"], tables["needle"]
    assert {c: str(t) for c, t in loop.dtypes.items()} == LOOP_TYPES
    assert {c: str(t) for c, t in needle.dtypes.items()} == NEEDLE_TYPES
    # the loop: the full cache has no budget, position 0 no prediction, a held position no eviction
    assert loop[loop["policy"] == "full"]["budget"].isna().all()
    assert loop[loop["position"] == 0][["nll", "kl", "top1_agreement"]].isna().all().all()
    assert loop[loop["position"] > 0][["nll", "kl", "top1_agreement"]].notna().all().all()
    assert loop["evicted"].isna().sum() == 2 * 2 * 4 - 2
    # the needle: the first prompt has its full cache, the second none
    by_id = needle.set_index("id")
    first, second = by_id.loc["L6-d50-s0-decode-layer"], by_id.loc["L6-d90-s0-decode-layer"]
    assert first["full_cache_correct"].tolist() == [True] * 4
    assert second["full_cache_correct"].isna().all() and len(second) == 2 and second["correct"].all()
    assert needle["first_lost"].isna().sum() == 2 and needle["budget"].isna().sum() == 2
    assert needle[["reminder_every", "distractors", "phrase_words", "returns", "hops"]].isna().all().all()
    assert needle[["answer", "correct", "outcome"]].notna().all().all()


def test_a_loop_result_without_the_full_cache_has_null_comparisons():
    from kvviz.model.loop import LoopResult

    loop = hand_loop()
    alone = LoopResult(configs=loop.configs[1:], granularity="kv-head", tokens=TOKENS, token_ids=loop.token_ids,
                       nll=loop.nll[1:], p_true=loop.p_true[1:], kl_tokens=loop.kl_tokens[1:],
                       top1=loop.top1[1:], evicted_at=loop.evicted_at[1:], layers=[5], rows=loop.rows[1:],
                       rows_layers=[5], rows_tokens=4)
    df = alone.to_frame()
    assert df["nll"].iloc[1:4].tolist() == [0.5, 2.0, 4.0]
    assert df["kl"].isna().all() and df["top1_agreement"].isna().all() and df["full_mass"].isna().all()
