"""Bad trace files: each gives a clear message naming the problem, in the page as st.error,
and the page keeps the trace it had. Good files switch the page to them."""
import io
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest

from kvviz.app.ui.upload import validate_upload
from kvviz.core.trace import save_trace

APP = str(Path(__file__).resolve().parents[1] / "app.py")


def npz(**arrays) -> bytes:
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    return buf.getvalue()


def packed(steps=12, layers=1, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for t in range(1, steps):
        w = rng.random(t) + 0.01
        rows.append(w / w.sum())
    return np.tile(np.concatenate(rows), (layers, 1)).astype(dtype)


def good(**over) -> dict:
    arrays = {"format_version": np.int64(1), "attn": packed(), "layers": np.arange(1, dtype=np.int64),
              "meta": np.str_(json.dumps({"name": "ok"}))}
    arrays.update(over)
    return {k: v for k, v in arrays.items() if v is not None}


def good_bytes(tmp_path, steps=40, tokens=True) -> bytes:
    rng = np.random.default_rng(1)
    a = np.zeros((steps, steps), np.float32)
    for t in range(1, steps):
        w = rng.random(t) + 0.01
        a[t, :t] = w / w.sum()
    p = tmp_path / "good.npz"
    save_trace(p, a, tokens=[f"t{i}" for i in range(steps)] if tokens else None,
               meta={"name": "good-upload"})
    return p.read_bytes()


def zip_bytes(members: dict) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return buf.getvalue()


nan_attn = packed()
nan_attn[0, 5] = np.nan
inf_attn = packed()
inf_attn[0, 7] = np.inf
neg_attn = packed()
neg_attn[0, 3] = -0.1

BAD = {  # name -> (bytes, words the message must contain)
    "empty.npz": (b"", "empty"),
    "text.npz": (b"hello, this is not a trace\n" * 10, "not an .npz"),
    "zip-not-npy.npz": (zip_bytes({"format_version.npy": b"garbage", "attn.npy": b"x"}),
                        "could not be read"),
    "truncated.npz": (npz(**good())[:200], "not an .npz"),
    "pickled.npz": (npz(**good(attn=np.array([{"x": 1}], dtype=object))), "object arrays"),
    "no-version.npz": (npz(**good(format_version=None)), "format_version"),
    "version-6.npz": (npz(**good(format_version=np.int64(6))), "format_version must be 1, 2, 3, 4 or 5"),
    "no-attn.npz": (npz(**good(attn=None)), "no 'attn' field"),
    "int-attn.npz": (npz(**good(attn=(packed() * 100).astype(np.int32))), "float16 or float32"),
    "1d-attn.npz": (npz(**good(attn=packed()[0])), "2-D"),
    "row-lengths.npz": (npz(**good(attn=packed()[:, :-3])), "wrong lengths"),
    "nan.npz": (npz(**good(attn=nan_attn)), "finite"),
    "inf.npz": (npz(**good(attn=inf_attn)), "finite"),
    "negative.npz": (npz(**good(attn=neg_attn)), "non-negative"),
    "tokens-length.npz": (npz(**good(tokens=np.array(["a", "b"]))), "tokens must have one entry"),
    "layers-shape.npz": (npz(**good(layers=np.arange(3, dtype=np.int64))), "layers must list"),
    "meta-not-json.npz": (npz(**good(meta=np.str_("{not json"))), "meta must be a JSON"),
    "float64-attn.npz": (npz(**good(attn=packed(dtype=np.float64))), "float16 or float32"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_validate_upload_refuses_with_reason(name):
    data, words = BAD[name]
    key, err = validate_upload(data, name)
    assert key is None
    assert err.startswith(name) and words in err, err


def test_validate_upload_size_cap(tmp_path):
    data = good_bytes(tmp_path)
    key, err = validate_upload(data, "big.npz", max_bytes=len(data) - 1)
    assert key is None and "limit" in err
    key, err = validate_upload(data, "fine.npz")
    assert err is None and key.startswith("upload:")


def run_app():
    at = AppTest.from_file(APP, default_timeout=120)
    at.query_params["budget"] = "16"
    at.query_params["b"] = "h2o"
    at.query_params["b.recentWindow"] = "4"
    return at.run()


def trace_param(at):
    v = at.query_params["trace"]
    return v[0] if isinstance(v, list) else v


def test_bad_uploads_in_the_page_keep_the_previous_trace(tmp_path, apptest):
    at = run_app()
    assert not at.exception
    # a good upload first: the page switches to it
    at.file_uploader(key="w.upload").set_value(("good.npz", good_bytes(tmp_path), "application/octet-stream")).run()
    assert not at.exception and not at.sidebar.error
    current = trace_param(at)
    assert current.startswith("upload:")
    assert at.get("plotly_chart")
    assert any("loaded good.npz" in s.value for s in at.sidebar.success)
    shown = 0
    for name, (data, words) in BAD.items():
        at.file_uploader(key="w.upload").set_value((name, data, "application/octet-stream")).run()
        assert not at.exception, name
        errs = [e.value for e in at.sidebar.error]
        assert any(name in e and words in e for e in errs), (name, errs)
        assert trace_param(at) == current, name  # previous trace kept
        assert at.get("plotly_chart"), name  # page still drawn
        shown += 1
    assert shown >= 12


def test_uploaded_trace_listed_with_token_view(tmp_path, apptest):
    at = run_app()
    at.file_uploader(key="w.upload").set_value(("good.npz", good_bytes(tmp_path), "application/octet-stream")).run()
    opts = at.selectbox(key="w.trace").options
    assert "uploaded: good.npz" in opts
    assert "Tokens" in at.segmented_control(key="w.view").options
    # switching back to the canonical trace works and the upload stays listed
    at.selectbox(key="w.trace").set_value("canonical").run()
    assert not at.exception and trace_param(at) == "canonical"
    assert "uploaded: good.npz" in at.selectbox(key="w.trace").options
