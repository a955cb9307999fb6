"""The model in the loop (kvviz.loop): SmolLM2 decoding over its own evicted cache.

The refusal tests run without the model. The rest load SmolLM2 once for the module;
without torch they skip, unless KVVIZ_REQUIRE_CAPTURE=1 (set by CI), where that fails.
"""
import importlib.util
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from kvviz.loop import LoopConfig, check_configs, load_loop_result, parse_policy
from kvviz.loop.cli import build_configs

ROOT = Path(__file__).resolve().parents[1]
PROSE = (ROOT / "traces" / "sources" / "execmodel.txt").read_text(encoding="utf-8")


# -- refusals: one clear line, before the model loads ------------------------------

def _cli(tmp_path, monkeypatch, capsys, *args, text="hello world, a short text."):
    from kvviz.__main__ import main

    src = tmp_path / "t.txt"
    src.write_text(text, encoding="utf-8")
    # torch is blocked: a refusal must come before anything imports it
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(SystemExit) as stop:
        sys.exit(main(["loop", "--text", str(src), *args]))
    return stop.value.code, capsys.readouterr().err


@pytest.mark.parametrize("args,text,needle", [
    (["--policy", "nosuch", "--budget", "8"], None, "unknown policy 'nosuch'"),
    (["--policy", "tova:sinks=2", "--budget", "8"], None, "tova has no parameter ['sinks']"),
    (["--policy", "snapkv:poolKernel=4", "--budget", "64"], None, "pool_kernel must be odd"),
    (["--policy", "tova", "--budget", "0"], None, "--budget must be >= 1, got 0"),
    (["--policy", "h2o:recentWindow=32", "--budget", "32"], None, "recent_window must be smaller than budget"),
    (["--policy", "tova", "--budget", "8"], "  \n\t", "is empty"),
    (["--policy", "tova"], None, "--budget is required"),
    (["--policy", "snapkv:pool_kernel=x", "--budget", "8"], None, "pool_kernel must be an integer"),
    (["--policy", "tova", "--budget", "8", "--granularity", "head"], None, "invalid choice: 'head'"),
])
def test_cli_refuses_in_one_line_before_loading_the_model(tmp_path, monkeypatch, capsys, args, text, needle):
    code, err = _cli(tmp_path, monkeypatch, capsys, *args, text=text or "hello world, a short text.")
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], err


def test_streaming_llm_without_sinks_is_accepted():
    assert parse_policy("streaming-llm:sinks=0") == ("streaming-llm", {"sinks": 0})
    cfgs = build_configs(["streaming-llm:sinks=0", "snapkv:poolKernel=1,obsWindow=16"], [64, 128])
    assert [c.label for c in cfgs] == [
        "full", "streaming-llm(sinks=0)@64", "streaming-llm(sinks=0)@128",
        "snapkv(obs_window=16,pool_kernel=1,recent_window=32)@64",
        "snapkv(obs_window=16,pool_kernel=1,recent_window=32)@128"]
    assert cfgs[3].to_dict() == {"policy": "snapkv", "budget": 64,
                                 "params": {"obs_window": 16, "pool_kernel": 1, "recent_window": 32}}


def test_configs_get_a_full_row_and_refuse_duplicates():
    cfgs = check_configs([LoopConfig("tova", {}, 8)])
    assert [c.policy for c in cfgs] == ["full", "tova"]
    with pytest.raises(ValueError, match="distinct"):
        check_configs([LoopConfig("tova", {}, 8), LoopConfig("tova", {}, 8)])
    with pytest.raises(ValueError, match="policy must be one of"):
        LoopConfig("lru", {}, 8)
