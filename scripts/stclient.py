"""A protocol-level Streamlit client: speaks the app's websocket as its frontend does.

Used by tests/test_crowd.py and scripts/loadtest.py to measure the *server* under a crowd
(one headless browser rendering 30 pages on 2 cores measures the browser instead).

    async with Session(base_url, "?trace=canonical&step=1300") as s:
        first = await s.run()                     # page load: rerun_script with the query
        moved = await s.set_widget("poolKernel", 7)  # a slider moved: rerun with its new value

What the frontend does, and this client with it: connect to /_stcore/stream with subprotocol
`streamlit`; send a BackMsg `rerun_script` (ClientState: the URL's query string, widget
states, the hashes of cacheable messages it already holds); read ForwardMsgs until
`script_finished`; keep the query string the app writes (`page_info_changed`) and send it back
on the next rerun. A moved widget is sent as its WidgetState. The browser sends every widget's
value; this client sends only the moved one, which the server treats the same way (a widget
absent from the message keeps its previous value: `SessionState.on_script_will_rerun`).
`LiveSession` is a tab left open: it reads every message as it comes and keeps the page's
`st.fragment(run_every=...)` timers as the frontend does (a class's followers poll that way).
Like a browser, a session first GETs the page and keeps the cookies it is given; its
websocket connects (the first and any reconnect) carry them. Behind `kvviz app --workers N`
that includes the proxy's sticky-session cookie, so a reconnect lands on the same worker (or,
if that worker died, the proxy sets a new cookie for a live one, which is kept too).
Nothing here imports kvviz; it needs `streamlit` (for the protobufs) and `websockets`.
"""
from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from dataclasses import dataclass, field
from http.cookies import SimpleCookie
from urllib.parse import urlsplit

import websockets
from streamlit.proto.BackMsg_pb2 import BackMsg
from streamlit.proto.ForwardMsg_pb2 import ForwardMsg

PLACEHOLDER_TITLE = "Replaying the policies"  # app.py's first-run placeholder chart


def rerun_msg(query: str, cache, widget_states=(), fragment_id: str = "",
              auto: bool = False) -> BackMsg:
    """A `rerun_script` BackMsg as the frontend sends it: the page's query string, the
    cached message hashes it holds, the moved widgets, and for a timer tick its fragment."""
    msg = BackMsg()
    rs = msg.rerun_script
    rs.query_string = query
    rs.page_script_hash = ""
    rs.cached_message_hashes.extend(cache)
    rs.context_info.timezone = "UTC"
    rs.context_info.locale = "en-US"
    if fragment_id:
        rs.fragment_id = fragment_id
    rs.is_auto_rerun = auto
    for ws in widget_states:
        rs.widget_states.widgets.append(ws)
    return msg


@dataclass
class RunResult:
    """One script run as the client saw it (times in seconds from sending the request)."""
    status: str = ""
    seconds: float = 0.0
    first_chart_s: float | None = None       # first plotly chart that is not the placeholder
    charts: list = field(default_factory=list)      # (id, spec JSON, seconds) of every plotly chart
    exceptions: list = field(default_factory=list)  # (type, message, stack) of exception elements
    errors: list = field(default_factory=list)      # st.error texts
    bytes: int = 0                           # ForwardMsg bytes received during the run
    chart_bytes: int = 0                     # of which plotly chart deltas
    messages: int = 0

    @property
    def chart_titles(self) -> list[str]:
        out = []
        for _, spec, _ in self.charts:
            try:
                t = json.loads(spec).get("layout", {}).get("title", {})
            except ValueError:
                continue
            out.append(t.get("text", "") if isinstance(t, dict) else str(t))
        return out

    def chart_with(self, text: str) -> float | None:
        """Seconds until the first chart whose figure JSON contains `text` arrived, or None."""
        return next((t for _, spec, t in self.charts if text in spec), None)


class Session:
    """One browser tab's worth of protocol: a websocket and the state the frontend keeps."""

    def __init__(self, base_url: str, query: str = "", timeout: float = 120.0):
        u = urlsplit(base_url)
        self.page_url = f"http://{u.netloc}/"
        self.ws_url = f"ws://{u.netloc}/_stcore/stream"
        self.cookies: dict[str, str] = {}  # what the server set, sent back as a browser does
        self._got_page = False
        self.query = query.lstrip("?")
        self.timeout = timeout
        self.ws = None
        self.widgets: dict[str, tuple[str, object]] = {}  # label -> (widget id, element proto)
        self.cache: dict[str, ForwardMsg] = {}            # hash -> cacheable message
        self.last: RunResult | None = None

    async def __aenter__(self):
        await self.connect()
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def connect(self) -> None:
        """Open the websocket; the first time, GET the page before it, as a browser does."""
        if not self._got_page:
            await asyncio.to_thread(self._get_page)
            self._got_page = True
        headers = ({"Cookie": "; ".join(f"{k}={v}" for k, v in self.cookies.items())}
                   if self.cookies else None)
        self.ws = await websockets.connect(self.ws_url, subprotocols=["streamlit"],
                                           max_size=None, open_timeout=self.timeout,
                                           ping_interval=None, additional_headers=headers)
        self._keep_cookies(self.ws.response.headers.get_all("Set-Cookie"))

    def _get_page(self) -> None:
        url = self.page_url + (f"?{self.query}" if self.query else "")
        with urllib.request.urlopen(url, timeout=self.timeout) as r:
            r.read()
            self._keep_cookies(r.headers.get_all("Set-Cookie") or [])

    def _keep_cookies(self, headers) -> None:
        for h in headers:
            for name, morsel in SimpleCookie(h).items():
                self.cookies[name] = morsel.value

    async def close(self) -> None:
        if self.ws is not None:
            await self.ws.close()
            self.ws = None

    # --- requests --------------------------------------------------------------------------
    async def run(self, widget_states=None) -> RunResult:
        """A whole-page run: what the frontend sends on page load (no widget states) and after
        a widget changed (the changed WidgetState)."""
        return await self._send_and_read(rerun_msg(self.query, self.cache, widget_states or ()))

    async def set_widget(self, label: str, value) -> RunResult:
        """Move the widget labelled `label` (seen in the last run) to `value`, as a user would."""
        if label not in self.widgets:
            raise KeyError(f"no widget labelled {label!r}; seen: {sorted(self.widgets)}")
        wid, el = self.widgets[label]
        from streamlit.proto.WidgetStates_pb2 import WidgetState
        ws = WidgetState(id=wid)
        kind = el.WhichOneof("type")
        if kind == "slider":
            ws.double_array_value.data.extend([float(v) for v in
                                               (value if isinstance(value, (list, tuple))
                                                else [value])])
        elif kind == "number_input":
            if isinstance(value, int):
                ws.int_value = value
            else:
                ws.double_value = float(value)
        elif kind in ("checkbox",):
            ws.bool_value = bool(value)
        else:
            raise NotImplementedError(f"widget type {kind} (label {label!r})")
        return await self.run([ws])

    # --- reading ---------------------------------------------------------------------------
    async def _send_and_read(self, back: BackMsg) -> RunResult:
        res = RunResult()
        t0 = time.perf_counter()
        await self.ws.send(back.SerializeToString())
        while True:
            raw = await asyncio.wait_for(self.ws.recv(), self.timeout)
            res.bytes += len(raw)
            res.messages += 1
            fm = ForwardMsg()
            fm.ParseFromString(raw)
            if fm.WhichOneof("type") == "ref_hash":
                cached = self.cache.get(fm.ref_hash)
                if cached is None:
                    raise RuntimeError(f"server referred to unknown message {fm.ref_hash}")
                fm = cached
            elif fm.metadata.cacheable and fm.hash:
                self.cache[fm.hash] = fm
            kind = fm.WhichOneof("type")
            if kind == "delta" and fm.delta.WhichOneof("type") == "new_element":
                self._element(fm.delta.new_element, res, len(raw), time.perf_counter() - t0)
            elif kind == "page_info_changed":
                self.query = fm.page_info_changed.query_string
            elif kind == "script_finished":
                res.status = ForwardMsg.ScriptFinishedStatus.Name(fm.script_finished)
                res.seconds = time.perf_counter() - t0
                self.last = res
                return res

    def _element(self, el, res: RunResult, size: int, t: float) -> None:
        kind = el.WhichOneof("type")
        if kind == "exception":
            e = el.exception
            res.exceptions.append((e.type, e.message, "\n".join(e.stack_trace)))
        elif kind == "alert" and el.alert.format == 1:  # ERROR
            res.errors.append(el.alert.body)
        elif kind == "plotly_chart":
            res.charts.append((el.plotly_chart.id, el.plotly_chart.spec, t))
            res.chart_bytes += size
            if res.first_chart_s is None and PLACEHOLDER_TITLE not in el.plotly_chart.spec:
                res.first_chart_s = t
        sub = getattr(el, kind, None) if kind else None
        wid = getattr(sub, "id", "") if sub is not None else ""
        label = getattr(sub, "label", "") if sub is not None else ""
        if wid and label:
            self.widgets[label] = (wid, el)


# --- a tab left open: every message as it comes, and the frontend's run_every timers ----------
FINISHED_OK = ("FINISHED_SUCCESSFULLY", "FINISHED_FRAGMENT_RUN_SUCCESSFULLY",
               "FINISHED_EARLY_FOR_RERUN")  # the last: a newer request replaced the run


def widget_key(wid: str) -> str:
    """The user key a widget id ends with (`$$ID-<hash>-<key>`), or ""."""
    parts = wid.split("-", 2)
    return parts[2] if len(parts) == 3 and parts[0] == "$$ID" else ""


@dataclass
class LiveRun:
    """One script run of a LiveSession (times from the client's perf_counter)."""
    started: float
    fragment_ids: tuple = ()
    run_id: str = ""
    finished: float | None = None
    status: str = ""
    query: str = ""                 # the page's query string when the run finished

    @property
    def full(self) -> bool:
        return not self.fragment_ids


class LiveSession(Session):
    """A browser tab kept open: a reader task handles every ForwardMsg as it arrives (reruns
    overlap, fragments poll), and the `run_every` timers run as the frontend runs them.

    Streamlit's `st.fragment(run_every=...)` is a timer in the frontend: the server sends
    `auto_rerun` (interval, fragment id) each time the fragment is registered; the frontend
    keeps one interval timer per fragment id (a repeat with the same interval keeps the
    countdown), clears them all when a full run starts (a `new_session` whose run carries no
    fragment ids) and on `stop_auto_rerun`, and on each tick sends a rerun for that fragment
    with `is_auto_rerun` (frontend/app/src/App.tsx: handleAutoRerun, handleNewSession).
    Widgets inside a fragment rerun only it: their clicks carry the fragment's id.
    Every run is kept in `runs`; `errors` collects exception elements, st.error texts,
    unexpected script statuses and a lost connection, each with the time it arrived.
    """

    def __init__(self, base_url: str, query: str = "", timeout: float = 120.0, name: str = ""):
        super().__init__(base_url, query, timeout)
        self.name = name
        self.runs: list[LiveRun] = []
        self.errors: list[tuple[float, str]] = []
        self.keys: dict[str, tuple[str, object, str]] = {}  # key -> (id, element, fragment id)
        self.seen: dict[str, float] = {}   # widget key -> when it last arrived
        self.watch: tuple = ()             # byte regexes looked for in every element
        self.texts: dict[str, float] = {}  # each distinct `watch` match -> when first seen
        self.timers: dict[str, tuple[float, asyncio.Task]] = {}
        self.ticks = 0
        self._reader: asyncio.Task | None = None
        self._changed = asyncio.Event()
        self._closing = False

    async def start(self) -> "LiveSession":
        """Connect and load the page (what a browser does on opening the link)."""
        await self.connect()
        self._reader = asyncio.create_task(self._read_loop())
        await self.send()
        return self

    async def close(self) -> None:
        await self._stop_reading()
        await super().close()

    async def reconnect(self) -> float:
        """What the frontend does when its websocket is lost: a new connection (with the
        cookies it holds) and a whole-page run of the page's current query; the send time."""
        await self._stop_reading()
        if self.ws is not None:
            try:
                await self.ws.close()
            except Exception:  # the old connection is already gone
                pass
            self.ws = None
        self._closing = False
        await self.connect()
        self._reader = asyncio.create_task(self._read_loop())
        return await self.send()

    async def _stop_reading(self) -> None:
        self._closing = True
        for _, task in self.timers.values():
            task.cancel()
        self.timers.clear()
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except BaseException:  # cancelled or already failed
                pass
            self._reader = None

    # --- requests --------------------------------------------------------------------------
    async def send(self, widget_states=(), fragment_id: str = "", auto: bool = False) -> float:
        """A rerun request as the frontend sends it; returns the send time."""
        msg = rerun_msg(self.query, self.cache, widget_states, fragment_id, auto)
        t = time.perf_counter()
        await self.ws.send(msg.SerializeToString())
        return t

    def state_of(self, key: str, value=None):
        """The WidgetState the frontend sends for widget `key` (seen on the page) at `value`
        (a button: its click)."""
        from streamlit.proto.WidgetStates_pb2 import WidgetState
        if key not in self.keys:
            raise KeyError(f"{self.name}: no widget with key {key!r}; seen: {sorted(self.keys)}")
        wid, el, _ = self.keys[key]
        ws = WidgetState(id=wid)
        kind = el.WhichOneof("type")
        if kind == "button":
            ws.trigger_value = True
        elif kind == "slider":
            vals = value if isinstance(value, (list, tuple)) else [value]
            ws.double_array_value.data.extend(float(v) for v in vals)
        elif kind == "number_input":
            if el.number_input.data_type == 0:  # INT
                ws.int_value = int(value)
            else:
                ws.double_value = float(value)
        elif kind in ("checkbox", "toggle"):
            ws.bool_value = bool(value)
        elif kind == "text_input":
            ws.string_value = str(value)
        else:
            raise NotImplementedError(f"widget type {kind} (key {key!r})")
        return ws

    async def act(self, *changes) -> float:
        """Move widgets at once, each `(key, value)` or a button's key alone; returns the
        send time. Inside a fragment the rerun is that fragment's, as in the browser."""
        states, frag = [], ""
        for ch in changes:
            key, value = (ch, None) if isinstance(ch, str) else ch
            states.append(self.state_of(key, value))
            frag = frag or self.keys[key][2]
        return await self.send(states, fragment_id=frag)

    async def wait_for(self, pred, timeout: float | None = None):
        """Wait until `pred()` is true (checked after every message); returns its value."""
        deadline = time.perf_counter() + (self.timeout if timeout is None else timeout)
        while True:
            got = pred()
            if got:
                return got
            left = deadline - time.perf_counter()
            if left <= 0:
                raise TimeoutError(f"{self.name}: condition not met in time")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                pass

    def diag(self, last: int = 3) -> str:
        """A line on this session's state (for a report of what went wrong)."""
        runs = [(("frag" if r.fragment_ids else "full"), r.status or "unfinished",
                 round(r.started, 2)) for r in self.runs[-last:]]
        return (f"{self.name}: {len(self.runs)} runs, last {runs}; timers "
                f"{ {k[:8]: v[0] for k, v in self.timers.items()} }, {self.ticks} ticks, "
                f"now {time.perf_counter():.2f}, query {self.query!r}")

    def full_runs_done(self, since: float = 0.0) -> list[LiveRun]:
        return [r for r in self.runs if r.full and r.finished is not None and r.started >= since]

    # --- the frontend's timers -------------------------------------------------------------
    def _auto_rerun(self, fragment_id: str, interval: float) -> None:
        if not fragment_id or interval <= 0:  # a page-level timer (set_page_config) not used
            return
        old = self.timers.get(fragment_id)
        if old is not None and old[0] == interval:
            return  # the same timer again: the countdown goes on
        if old is not None:
            old[1].cancel()
        self.timers[fragment_id] = (interval, asyncio.create_task(self._tick(fragment_id,
                                                                             interval)))

    async def _tick(self, fragment_id: str, interval: float) -> None:
        while not self._closing:
            await asyncio.sleep(interval)
            self.ticks += 1
            try:
                await self.send(fragment_id=fragment_id, auto=True)
            except Exception as exc:  # the reader reports the lost connection
                self._error(f"auto-rerun send failed: {type(exc).__name__}: {exc}")
                return

    def _clear_timers(self, ids=None) -> None:
        for fid in list(self.timers) if ids is None else ids:
            got = self.timers.pop(fid, None)
            if got is not None:
                got[1].cancel()

    # --- reading ---------------------------------------------------------------------------
    def _error(self, text: str) -> None:
        self.errors.append((time.perf_counter(), text))

    async def _read_loop(self) -> None:
        try:
            async for raw in self.ws:
                self._handle(raw)
                self._changed.set()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if not self._closing:
                self._error(f"disconnected: {type(exc).__name__}: {exc}")
        else:
            if not self._closing:
                self._error("disconnected: the server closed the connection")
        self._changed.set()

    def _handle(self, raw: bytes) -> None:
        now = time.perf_counter()
        fm = ForwardMsg()
        fm.ParseFromString(raw)
        if fm.WhichOneof("type") == "ref_hash":
            cached = self.cache.get(fm.ref_hash)
            if cached is None:
                self._error(f"server referred to unknown message {fm.ref_hash}")
                return
            fm = cached
        elif fm.metadata.cacheable and fm.hash:
            self.cache[fm.hash] = fm
        kind = fm.WhichOneof("type")
        if kind == "new_session":
            frags = tuple(fm.metadata.run.fragment_ids)
            if not frags:
                self._clear_timers()
            self.runs.append(LiveRun(started=now, fragment_ids=frags,
                                     run_id=fm.metadata.run.script_run_id))
        elif kind == "auto_rerun":
            self._auto_rerun(fm.auto_rerun.fragment_id, fm.auto_rerun.interval)
        elif kind == "stop_auto_rerun":
            self._clear_timers(list(fm.stop_auto_rerun.fragment_ids))
        elif kind == "page_info_changed":
            self.query = fm.page_info_changed.query_string
        elif kind == "delta" and fm.delta.WhichOneof("type") == "new_element":
            self._live_element(fm.delta.new_element, fm.delta.fragment_id, raw, now)
        elif kind == "script_finished":
            status = ForwardMsg.ScriptFinishedStatus.Name(fm.script_finished)
            # a stopped run's finish may arrive after its successor's new_session
            rid = fm.metadata.run.script_run_id
            run = next((r for r in reversed(self.runs) if rid and r.run_id == rid),
                       self.runs[-1] if self.runs and not rid else None)
            if run is None:
                run = LiveRun(started=now, run_id=rid)
                self.runs.append(run)
            run.finished, run.status, run.query = now, status, self.query
            if status not in FINISHED_OK:
                self._error(f"script {status}")

    def _live_element(self, el, fragment_id: str, raw: bytes, now: float) -> None:
        kind = el.WhichOneof("type")
        if kind == "exception":
            self._error(f"{el.exception.type}: {el.exception.message}")
            return
        if kind == "alert" and el.alert.format == 1:  # ERROR
            self._error(f"st.error: {el.alert.body}")
        if self.watch:
            blob = (el.plotly_chart.spec.encode() if kind == "plotly_chart"
                    else el.SerializeToString())
            for rx in self.watch:
                for m in rx.finditer(blob):
                    self.texts.setdefault(m.group(0).decode("utf-8", "replace"), now)
        if kind == "plotly_chart":
            return
        sub = getattr(el, kind, None) if kind else None
        wid = getattr(sub, "id", "") if sub is not None else ""
        if wid:
            key = widget_key(wid)
            if key:
                self.keys[key] = (wid, el, fragment_id)
                self.seen[key] = now
            label = getattr(sub, "label", "")
            if label:
                self.widgets[label] = (wid, el)


# --- a server to talk to ---------------------------------------------------------------------
class Server:
    """`streamlit run app.py` (launcher "streamlit") or `kvviz app` (launcher "kvviz": the
    page drawn once before the server listens; `workers` > 1: `kvviz app --workers N`, the
    workers behind Caddy on `port`) on 127.0.0.1, headless, telemetry off, in its own
    process group (stopped by that group's id). `port` 0 (the default): the server binds port
    0, so the operating system picks a free one as it binds, and `port` and `url` are set
    from the URL line the server prints then (on entering, or by `wait_port`); nothing can
    take the port between its choice and its use. `--workers N` needs a port named for its
    proxy (Caddy reports none it picked). Its output goes to `log` (a binary file) if given.
    `pid` is the server's process id (for RSS; `kvviz app` runs the server in its own
    process); with workers, the launcher's, and `children()` are its workers and proxy."""

    def __init__(self, repo, port: int = 0, env: dict | None = None, log=None,
                 launcher: str = "streamlit", workers: int = 1):
        import os
        import subprocess
        import sys

        from measure_latency import Output  # scripts/, beside this file
        if workers > 1 and not port:
            raise ValueError("kvviz app --workers N needs the proxy's port (not 0)")
        self.port = port or None
        self.url = f"http://127.0.0.1:{port}" if port else None
        flags = ["--server.port", str(port), "--server.address", "127.0.0.1",
                 "--server.headless", "true", "--browser.gatherUsageStats", "false",
                 "--server.fileWatcherType", "none"]
        if launcher == "kvviz":
            cmd = [sys.executable, "-m", "kvviz", "app", *[f"{k}={v}" for k, v in
                                                          zip(flags[::2], flags[1::2])]]
            if workers > 1:
                cmd += ["--workers", str(workers)]
        elif launcher == "streamlit" and workers == 1:
            cmd = [sys.executable, "-m", "streamlit", "run", "app.py", *flags]
        else:
            raise ValueError(f"launcher must be streamlit or kvviz (workers: kvviz only), "
                             f"got {launcher!r} with {workers} workers")
        self.workers = workers
        self.proc = subprocess.Popen(cmd, cwd=repo, env={**os.environ, **(env or {})},
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.output = Output(self.proc, log)
        self.pid = self.proc.pid

    def wait_port(self, timeout: float = 120.0) -> int:
        """The port it listens on, once it has said so (at once if it was given)."""
        if self.port is None:
            self.port = self.output.wait_port(timeout)
            self.url = f"http://127.0.0.1:{self.port}"
        return self.port

    def children(self) -> dict[int, str]:
        """{pid: command line} of the launcher's child processes (its workers and Caddy)."""
        import glob
        out = {}
        for f in glob.glob(f"/proc/{self.pid}/task/*/children"):
            try:
                with open(f) as fh:
                    pids = fh.read().split()
            except OSError:
                continue
            for pid in map(int, pids):
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                        out[pid] = cmdline.read().replace(b"\0", b" ").decode().strip()
                except OSError:
                    pass
        return out

    def wait_healthy(self, timeout: float = 120.0) -> float:
        """Until it answers its health check: the seconds since this call."""
        import urllib.request
        t0 = time.perf_counter()
        self.wait_port(timeout)
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"streamlit exited with {self.proc.returncode}:\n"
                                   f"{self.output.text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/_stcore/health", timeout=2) as r:
                    if r.read().strip() == b"ok":
                        return time.perf_counter() - t0
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError("streamlit did not report healthy")

    def stop(self) -> None:
        import os
        import signal
        import subprocess
        if self.proc.poll() is None:
            try:
                os.killpg(self.pid, signal.SIGTERM)  # the group we started
                self.proc.wait(10 if self.workers == 1 else 30)  # the launcher stops its own
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                os.killpg(self.pid, signal.SIGKILL)
                self.proc.wait(5)

    def __enter__(self):
        try:
            self.ready_s = self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()


async def crowd(url: str, query: str, n: int, timeout: float = 120.0) -> list:
    """n sessions open the page at the same moment; each a RunResult or the exception raised."""
    async def one():
        async with Session(url, query, timeout) as s:
            return await s.run()
    return await asyncio.gather(*(one() for _ in range(n)), return_exceptions=True)
