"""lab.key_attention on a real recall prompt with SmolLM2: one file per recall
decode run, (layers, prompt_len), attention shares in [0, 1], nothing on the key before it is
read, more on it at the reminders than between them in nearly every layer; resumable, and
other runs left alone."""
import numpy as np

from kvviz.model.needle.results import save_run
from kvviz.model.needle.tasks import recall
from kvviz.studies.key_attention import load_attention
from lab import key_attention as KA
from lab.reminder_attention import query_rows


def _save(folder, p, id_, mode="decode", task="recall"):
    T = len(p.ids)
    meta = dict(id=id_, length=p.length, depth=10, seed=0, prompt_mode=mode, granularity="layer",
                key=p.key, key_positions=list(p.key_positions), question_start=p.question_start,
                prompt_len=T, configs=[{"policy": "full", "params": {}, "budget": None, "label": "full"}],
                answers=[""], correct=[False], task=task, reminder_every=20,
                reminders=[list(r) for r in p.reminders])
    save_run(folder, meta, p.ids, [str(i) for i in p.ids], np.zeros((1, 1)), np.full((1, 1, 1, T + 1), -1))


def test_key_attention_over_a_recall_prompt(smollm, tmp_path, capsys):
    # 600 tokens, a reminder every 20 sentences: the reminder study's setting, where the
    # reminders' rows look back at the key more than the quiet rows in nearly every layer
    p = recall(smollm[0], 600, 10, 0, 20)
    id_ = "recall20-L600-d10-s0-decode-layer"
    _save(tmp_path, p, id_)
    _save(tmp_path, p, "recall20-L600-d10-s0-prefill-layer", mode="prefill")
    assert KA.main([str(tmp_path), "--threads", "1"]) == 0
    written = sorted(x.name for x in (tmp_path / "attention").iterdir())
    assert written == [f"{id_}.npz"]  # the prefill run is not this pass's
    att = load_attention(tmp_path, id_)
    T = len(p.ids)
    assert att.dtype == np.float32 and att.shape == (30, T)
    assert (att >= 0).all() and (att <= 1 + 1e-5).all()
    assert np.all(att[:, :min(p.key_positions)] == 0)  # causal: no row sees the key before it
    inside, between = query_rows(p.reminders, T)
    at_rem, quiet = att[:, inside].mean(1), att[:, between].mean(1)
    assert (at_rem > quiet).sum() >= 25, np.round(at_rem / quiet, 2).tolist()
    # resumable: a second pass finds nothing to do and leaves the file as it was
    before = (tmp_path / "attention" / f"{id_}.npz").stat().st_mtime_ns
    capsys.readouterr()
    assert KA.main([str(tmp_path), "--threads", "1"]) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert (tmp_path / "attention" / f"{id_}.npz").stat().st_mtime_ns == before


def test_key_attention_refuses_a_folder_without_runs(tmp_path, capsys):
    assert KA.main([str(tmp_path / "none")]) == 2
    assert "folder:" in capsys.readouterr().err
