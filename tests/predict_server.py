"""The page served with a class whose lecturer is this process (tests/test_e2e_predict.py).

    python tests/predict_server.py PORT CODE_FILE

Opens a class in the page's own registry (the server runs app.py in this process, so
kvviz.app.ui.classroom.REGISTRY is the one the pages use), asks "which position will A (TOVA,
budget 4) evict next?" after step 6 of the toy trace from a fresh replay, writes the code to
CODE_FILE, then takes the lecturer's moves from stdin, one a line: `reveal`, `close`.
"""
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvviz.app.teach.classroom import new_token
from kvviz.app.teach.question import next_eviction
from kvviz.app.ui.classroom import REGISTRY
from kvviz.core.replay import run_policy
from kvviz.core.trace import load_trace


def main(port: int, code_file: str):
    tok = new_token()
    c = REGISTRY.open(tok)
    q = next_eviction(run_policy(load_trace(REPO / "traces" / "toy.npz"), "tova", 4).evicted_at, 7)
    c.ask(tok, step=q.answer_step, who="a", label="tova", held=q.held, answer=q.answer,
          answer_step=q.answer_step)
    Path(code_file).write_text(f"{c.code} {min(q.answer)}")

    def lecturer():
        for line in sys.stdin:
            if line.strip() == "reveal":
                c.reveal(tok, "the lecturer's why")
            elif line.strip() == "close":
                c.close_round(tok)

    threading.Thread(target=lecturer, daemon=True).start()
    from streamlit.web import bootstrap

    opts = {"server_port": port, "server_headless": True, "server_address": "127.0.0.1",
            "browser_gatherUsageStats": False, "browser_serverAddress": "localhost",
            "server_fileWatcherType": "none"}
    bootstrap.load_config_options(flag_options=opts)
    bootstrap.run(str(REPO / "app.py"), False, [], opts)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
