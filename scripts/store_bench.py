"""Operations a second on the class store (kvviz.app.teach.store), through the registry as a
server process uses it: a student's poll (served from the process's copy, and straight from
the store), a page's presence write, a vote; 1 and 8 threads.

    python scripts/store_bench.py                       SQLite in a temporary folder
    python scripts/store_bench.py --redis redis://127.0.0.1:6379/0   and that Redis server

Each figure is the operations done by all threads together in --seconds, per second. Redis
is measured only when --redis is given and answers; its database's kvviz:* keys are written
(a database of the bench's own: not one a server uses).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvviz.app.teach import classroom as cr  # noqa: E402

CLASS = 200  # students in a class: the vote figure's round holds up to this many votes


def rate(op, threads: int, seconds: float) -> float:
    """op(thread, i) called in a loop by `threads` threads for `seconds`: calls a second."""
    done, stop, go = [0] * threads, threading.Event(), threading.Barrier(threads + 1)

    def run(t):
        go.wait()
        n = 0
        while not stop.is_set():
            op(t, n)
            n += 1
        done[t] = n

    ts = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    [t.start() for t in ts]
    go.wait()
    t0 = time.perf_counter()
    time.sleep(seconds)
    stop.set()
    [t.join() for t in ts]
    return sum(done) / (time.perf_counter() - t0)


def operations(url: str) -> dict:
    """name -> op(thread, i), on a fresh class of the store at `url`."""
    cached, direct = cr.Registry(url), cr.Registry(url, ttl=0)
    c = cached.open("lecturer")
    c.publish("lecturer", {"step": "1"})
    room, lock = {"n": 0}, threading.Lock()

    def vote(t, i):
        """A vote in a class of CLASS students: a new class and question every CLASS votes."""
        with lock:
            n = room["n"]
            room["n"] += 1
            if n % CLASS == 0:
                room["c"] = cached.open("lecturer")
                room["r"] = room["c"].ask("lecturer", step=1, who="a", label="A",
                                          held=range(64), answer=[1], answer_step=1)
            klass, rnd = room["c"], room["r"]
        klass.vote(f"voter{n}", rnd.number, n % 64)

    return {
        "poll (process copy, ttl 0.2 s)": lambda t, i: cached.get(c.code).poll(),
        "poll (store read)": lambda t, i: direct.get(c.code).poll(),
        "here (a write)": lambda t, i: c.here(f"page{t}-{i}"),
        f"vote (a class of {CLASS})": vote,
    }


def bench(url: str, seconds: float) -> list[tuple[str, int, float]]:
    out = []
    for threads in (1, 8):
        for name, op in operations(url).items():
            out.append((name, threads, rate(op, threads, seconds)))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--redis", help="a Redis URL to measure too (redis://HOST:PORT/DB)")
    p.add_argument("--seconds", type=float, default=2.0, help="per figure (default 2)")
    args = p.parse_args(argv)
    if args.seconds <= 0:
        p.error(f"--seconds {args.seconds}: must be more than 0")
    stores = []
    with tempfile.TemporaryDirectory() as tmp:
        stores.append(("sqlite", f"sqlite://{tmp}/classes.sqlite3"))
        if args.redis:
            try:
                cr.Registry(args.redis).store.count()
                stores.append(("redis", args.redis))
            except (ValueError, cr.Refused) as exc:
                print(f"redis: not measured: {exc}")
        print(f"{'store':7} {'operation':32} {'threads':>7} {'ops/s':>10}")
        for label, url in stores:
            for name, threads, ops in bench(url, args.seconds):
                print(f"{label:7} {name:32} {threads:7d} {ops:10.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
