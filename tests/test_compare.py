"""Compare view builders (kvviz.app.figures.compare) on hand-built eviction logs."""
import base64
import io
import json

import numpy as np
import pytest
from PIL import Image

from kvviz.app.figures import compare as C

# T = 6, held after s  iff  p <= s and (ev == -1 or ev > s); A: p1 evicted at 3, p3 at 5
EA = np.array([-1, 3, -1, 5, -1, -1])
HELD_A = {0: {0}, 1: {0, 1}, 2: {0, 1, 2}, 3: {0, 2, 3}, 4: {0, 2, 3, 4}, 5: {0, 2, 4, 5}}


def test_held_shares_one_cell_per_pixel_is_the_held_set():
    sh = C.held_shares(EA, max_bins=6)
    for s in range(6):
        assert set(np.flatnonzero(sh["held"][s] == 1)) == HELD_A[s]
        assert set(np.flatnonzero(sh["not_yet"][s] == 1)) == set(range(s + 1, 6))
        assert set(np.flatnonzero(sh["evicted"][s] == 1)) == (set(range(s + 1)) - HELD_A[s])


def test_held_shares_blocks_by_hand():
    sh = C.held_shares(EA, max_bins=3)  # 2x2 blocks
    # steps 2-3 x positions 0-1: held (0,2) (1,2) (0,3); (1,3) evicted -> 3/4 held
    assert sh["held"][1, 0] == 0.75 and sh["evicted"][1, 0] == 0.25
    # steps 0-1 x positions 2-3: not yet generated
    assert sh["not_yet"][0, 1] == 1.0
    # steps 4-5 x positions 2-3: (2,4) (3,4) (2,5) held, (3,5) evicted
    assert sh["held"][2, 1] == 0.75


def test_held_rgb_colours():
    sh = C.held_shares(EA, max_bins=6)
    rgb = C.held_rgb(sh, "#0072B2")
    assert tuple(rgb[3, 0]) == (0, 0x72, 0xB2)          # held
    assert tuple(rgb[3, 1]) == (0xE4, 0xE4, 0xE4)       # evicted (grey)
    assert tuple(rgb[0, 5]) == (255, 255, 255)          # not yet generated


def _png(uri):
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1]))).convert("RGB"))


def test_small_multiples_six_panels():
    names = ["tova", "snapkv", "h2o", "streaming-llm", "scissorhands", "random"]
    logs = [EA, np.array([-1, -1, 4, 5, -1, -1])] * 3
    panels = [dict(label=n, evicted_at=e, shares=C.held_shares(e, 6)) for n, e in zip(names, logs)]
    fig = json.loads(C.small_multiples(panels, 4).to_json())
    images = [t for t in fig["data"] if t["type"] == "image"]
    assert len(images) == 6
    titles = [a["text"] for a in fig["layout"]["annotations"]]
    assert titles[0] == "tova<br>holds 4" and titles[1] == "snapkv<br>holds 4"
    # the image of each panel is its held set (held cells in the policy's colour)
    img = _png(images[2]["source"])  # h2o, log EA: after step 4, p1 evicted, p2 held
    assert img.shape[:2] == (6, 6)
    assert tuple(img[4, 1]) == (0xE4, 0xE4, 0xE4) and tuple(img[4, 2]) != (0xE4, 0xE4, 0xE4)
    with pytest.raises(ValueError, match="at most 6"):
        C.small_multiples(panels + panels[:1], 4)
    with pytest.raises(ValueError, match="at least one"):
        C.small_multiples([], 4)


def test_survival_compare_by_hand():
    panels = [dict(label="tova", evicted_at=EA)]
    fig = C.survival_compare(panels, 3, sinks=2, recent=2)
    sinks, recent = fig.data[0], fig.data[1]
    # sinks 0 and 1: held 1, 2, 2, then p1 evicted at 3 -> 1, 1, 1
    assert np.asarray(sinks.y).tolist() == [1, 2, 2, 1, 1, 1]
    # two newest held: step 0 only p0 (1/1), 1: p0 p1, 2: p1 p2, 3: p2 p3, 4: p3 p4, 5: p4 p5
    assert np.asarray(recent.y).tolist() == [1, 1, 1, 1, 1, 1]
    fig = C.survival_compare([dict(label="h2o", evicted_at=np.array([-1, 2, -1]))], 2, sinks=1,
                             recent=2)
    assert np.asarray(fig.data[1].y).tolist() == [1, 1, 0.5]


def test_compare_table_labels():
    rows = [dict(policy="tova", params="–", budget=4, **{"held now": 4}, retained_mass=0.5,
                 hh_recall=0.25, attention_loss=0.5, memory_bytes=64)] * 6
    df = C.compare_table(rows)
    assert len(df) == 6
    assert list(df.columns) == ["policy", "params", "budget", "held now", "retained mass",
                                "heavy-hitter recall", "attention loss", "memory (bytes)"]
