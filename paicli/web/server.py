"""The logview server: an aiohttp application over the job store and job folders.

The standby (paicli.web.standby) holds the socket and becomes this server, in the
same process, on the page's first visit (`run`).

Routes (every one answers 403 without the user's token, as ?token=...):
    /  and /logview/            the job list (like `show instances`)
    /logview/?i=ID              a job's page, updated live over server-sent events
    /api/jobs.json              the job list as JSON
    /api/jobs.html              the job list's rows (what the open list page polls for)
    /api/jobs/ID.json           the job's JSON summary (status, series, events, plan)
    /api/jobs/ID/log            a whole log: the combined one, or ?instance=worker:0[&attempt=N]
    /api/jobs/ID/stream         the page's live feed (server-sent events)
    /static/NAME                the page's own JS and CSS (nothing comes from a CDN)
    /logview/studies, /logview/study?s=NAME   `pai tune`'s studies (data: /api/studies/NAME.json|.html)
    /api/jobs/ID/outputs, /api/jobs/ID/file   a job's outputs, and one of them to download

It exits by itself after PAI_LOGVIEW_IDLE seconds (default 900) without a request,
an open page or a pai command handing out its URL.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import signal
import socket
import threading
import time
import urllib.parse
from contextlib import suppress
from pathlib import Path

import jinja2
from aiohttp import web

from paicli import client
from paicli.errors import NotFound, PaiError
from paicli.logview import log_path
from paicli.states import JobStatus
from paicli.store import Store
from paicli.web import data, launch, study

HERE = Path(__file__).resolve().parent
STATIC = HERE / "static"
POLL = 0.5                    # seconds between two looks at the store and the logs of a live page
READ_CAP = 256 * 1024         # at most this much of one log per look
STATUS_EVERY = 2.0            # seconds between two renderings of a live page's status parts without a new event
LIST_EVERY = 2                # seconds between two looks of an open job list at its rows
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                               "img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}

TOKEN = web.AppKey("token", str)
EXPIRES = web.AppKey("expires", float)
HOME = web.AppKey("home", Path)
ENV = web.AppKey("env", jinja2.Environment)
USE = web.AppKey("use", dict)


def make_app(home: Path, token: str, expires: float = float("inf")) -> web.Application:
    app = web.Application(middlewares=[guard])
    app[TOKEN] = token
    app[EXPIRES] = expires
    app[HOME] = home
    Store(home).close()  # a store that cannot be opened fails here, before the first page
    app[ENV] = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"),
                                  autoescape=True, undefined=jinja2.StrictUndefined)
    app[USE] = {"last": time.monotonic(), "streams": 0}
    app.router.add_get("/", job_list_page)
    app.router.add_get("/logview/", logview_page)
    app.router.add_get("/api/jobs.json", jobs_json)
    app.router.add_get("/api/jobs.html", jobs_rows)
    app.router.add_get(r"/api/jobs/{job_id:[a-z0-9]+}.json", job_json)
    app.router.add_get(r"/api/jobs/{job_id:[a-z0-9]+}/log", whole_log)
    app.router.add_get(r"/api/jobs/{job_id:[a-z0-9]+}/stream", stream)
    app.router.add_get(r"/static/{name:[a-z0-9_.-]+}", static_file)
    app.router.add_get("/logview/studies", studies_page)
    app.router.add_get("/logview/study", study_page)
    app.router.add_get(r"/api/studies/{name:[A-Za-z0-9_.-]+}.json", study_json)
    app.router.add_get(r"/api/studies/{name:[A-Za-z0-9_.-]+}.html", study_head)
    app.router.add_get(r"/api/jobs/{job_id:[a-z0-9]+}/outputs", outputs_page)
    app.router.add_get(r"/api/jobs/{job_id:[a-z0-9]+}/file", output_file)
    return app


@web.middleware
async def guard(request: web.Request, handler):
    """The token on every URL (compared in constant time), security headers on every answer."""
    given = request.query.get("token", "")
    if not hmac.compare_digest(given.encode(), request.app[TOKEN].encode()) or time.time() >= request.app[EXPIRES]:
        return web.Response(status=403, text="403 forbidden: this URL's token= is wrong or has expired (a token"
                            f" lasts {launch.TOKEN_DAYS} days and changes with the server's port);"
                            " `pai logview [ID]` prints the current URL\n", headers=SECURITY_HEADERS)
    request.app[USE]["last"] = time.monotonic()
    try:
        response = await handler(request)
    except PaiError as err:  # unknown job or instance: 404; a bad or outside path: 400; one line
        code = 404 if isinstance(err, NotFound) else 400
        response = web.Response(status=code, text=f"{code}: {err}\n")
    for name, value in SECURITY_HEADERS.items():
        response.headers.setdefault(name, value)
    return response


# -- reading the store off the event loop ----------------------------------------------

_THREAD = threading.local()


async def _read(request: web.Request, fn, *args):
    """`fn(store, *args)` in a worker thread: a slow SQLite read (a long job's
    metrics, a store busy with writers) never holds up the event loop, so one page
    does not stall the others or the live feeds. Each thread has its own connection:
    one shared by threads would run their queries one at a time."""
    home = request.app[HOME]

    def call():
        store = getattr(_THREAD, "store", None)
        if store is None or store.home != home:
            store = _THREAD.store = Store(home)
        return fn(store, *args)

    return await asyncio.to_thread(call)


def _render(request: web.Request, template: str, **context) -> str:
    return request.app[ENV].get_template(template).render(token=request.app[TOKEN], **context)


def _html(request: web.Request, template: str, **context) -> web.Response:
    return web.Response(text=_render(request, template, **context), content_type="text/html")


async def job_list_page(request: web.Request) -> web.Response:
    return _html(request, "jobs.html", jobs=await _read(request, data.job_list), every=LIST_EVERY)


async def jobs_rows(request: web.Request) -> web.Response:
    """The list's rows, rendered (and escaped) by the same template as the page."""
    return _html(request, "_jobs.html", jobs=await _read(request, data.job_list))


def _job_page(store: Store, prefix: str) -> tuple[dict, list[dict]]:
    job = store.find_job(prefix)
    page = data.job_page(store, job["id"])
    logs = [{**log, "tail": data.tail_text(log["path"])[0]} for log in data.instance_logs(store, job["id"])]
    return page, logs


async def logview_page(request: web.Request) -> web.Response:
    job_id = request.query.get("i")
    if not job_id:
        return await job_list_page(request)
    page, logs = await _read(request, _job_page, job_id)
    return _html(request, "job.html", page=page, logs=logs, first=data.first_tab([log["instance"] for log in logs]))


async def jobs_json(request: web.Request) -> web.Response:
    return web.json_response(await _read(request, data.job_list))


async def job_json(request: web.Request) -> web.Response:
    summary = await _read(request, lambda store, job_id: data.summary_json(store, store.job(job_id)["id"]),
                          request.match_info["job_id"])
    return web.json_response(summary, dumps=lambda d: json.dumps(d, default=str))


def disposition(kind: str, name: str) -> str:
    """A Content-Disposition for any file name (RFC 6266): `filename*` carries it whole,
    percent-encoded; the plain `filename` for old clients keeps printable ASCII but `"`
    and `\\`, so neither a quote nor a newline of a name reaches the header."""
    plain = "".join(c if " " <= c <= "~" and c not in '"\\' else "_" for c in name)
    return f"{kind}; filename=\"{plain}\"; filename*=UTF-8''{urllib.parse.quote(name, safe='')}"


def _log_file(store: Store, job_id: str, instance: str | None, attempt: int | None) -> tuple[dict, Path]:
    job = store.job(job_id)
    return job, log_path(store, job, instance, attempt)


async def whole_log(request: web.Request) -> web.StreamResponse:
    attempt = request.query.get("attempt")
    if attempt is not None and not attempt.isdigit():
        raise PaiError(f"attempt={attempt!r}: expected a number")
    job, path = await _read(request, _log_file, request.match_info["job_id"],
                            request.query.get("instance") or None, int(attempt) if attempt else None)
    if not path.is_file():
        return web.Response(status=404, text=f"404: no log yet for {request.query.get('instance') or 'the job'}\n")
    name = path.name if path.name != "job.log" else f"{job['id']}.log"
    return web.FileResponse(path, headers={"Content-Type": "text/plain; charset=utf-8",
                                           "Content-Disposition": disposition("inline", name)})


async def static_file(request: web.Request) -> web.StreamResponse:
    name = request.match_info["name"]
    path = (STATIC / name).resolve()
    if path.parent != STATIC or not path.is_file():
        raise web.HTTPNotFound()
    kind = {"js": "text/javascript", "css": "text/css"}.get(path.suffix[1:], "application/octet-stream")
    return web.FileResponse(path, headers={"Content-Type": f"{kind}; charset=utf-8"})


class LogFollower:
    """One instance's log as the page sees it: its tail first, then whole new lines."""

    def __init__(self):
        self.path: Path | None = None
        self.inode: int | None = None
        self.offset = 0

    def read(self, path: Path, final: bool) -> tuple[str, bool] | None:
        """(text, reset) or None when nothing new."""
        try:
            st = path.stat()
            size, inode = st.st_size, st.st_ino
        except FileNotFoundError:
            size, inode = 0, None
        if path != self.path or inode != self.inode or size < self.offset:  # a new attempt, or rotated
            self.path, self.inode = path, inode
            text, self.offset = data.tail_text(path)
            return text, True
        if size == self.offset:
            return None
        with open(path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read(min(size - self.offset, READ_CAP))
        if not final:
            cut = chunk.rfind(b"\n") + 1
            if not cut:
                return None
            chunk = chunk[:cut]
        self.offset += len(chunk)
        return chunk.decode("utf-8", "replace"), False


class Feed:
    """What one open job page has been sent; `look` reads the store and the logs
    (in a worker thread) and says what to send next."""

    def __init__(self, job_id: str, render):
        self.job_id = job_id
        self.render = render          # (part, page) -> html
        self.followers: dict[str, LogFollower] = {}
        self.last_html = None
        self.metric_after = 0
        self.seen_event, self.rendered_at = -1, 0.0
        self.page = None
        self.gone = 0

    def look(self, store: Store) -> tuple[list[tuple[str, dict]], bool]:
        """The events to send, in order, and whether the feed is over."""
        out: list[tuple[str, dict]] = []
        job = store.job(self.job_id)
        over = client.job_over(job)  # read first: then every line before the end is seen
        # A master and its watchdog gone without recording the end, seen twice a poll
        # apart: the feed ends; the record is left to the watchdogs and `pai kill`.
        alive = over or JobStatus(job["status"]).is_terminal() or client.master_alive(job)
        self.gone = 0 if alive else self.gone + 1
        over = over or self.gone >= 2
        # The status parts (queries and rendering, the dearest part of a poll) are redone
        # when an event happened, every STATUS_EVERY seconds for the last metrics, and at the end.
        event = store.last_event_id(self.job_id)
        if self.page is None or over or event != self.seen_event or time.monotonic() - self.rendered_at >= STATUS_EVERY:
            self.seen_event, self.rendered_at = event, time.monotonic()
            self.page = data.job_page(store, self.job_id)
            html = {part: self.render(part, self.page) for part in ("head", "tail")}
            if html != self.last_html:
                self.last_html = html
                out.append(("status", {**html, "status": self.page["status"]}))
        for log in data.instance_logs(store, self.job_id):
            got = self.followers.setdefault(log["instance"], LogFollower()).read(log["path"], over)
            if got is not None:
                out.append(("log", {"instance": log["instance"], "attempt": log["attempt"],
                                    "text": got[0], "reset": got[1]}))
        points, self.metric_after = data.metric_points(store, self.job_id, self.metric_after)
        if points:
            out.append(("metrics", {"points": points}))
        if over:
            verdict = self.page["verdict"] or (f"its master is gone without recording the end"
                                               f" (pai kill {self.job_id} records it)" if self.gone else "")
            out.append(("end", {"status": self.page["status"], "verdict": verdict}))
        return out, over


async def stream(request: web.Request) -> web.StreamResponse:
    """The live feed of a job page: `status` (the rendered head and tail parts), `log`
    (new lines of an instance), `metrics` (new points), and `end` once the job is
    over and everything is sent. A reconnecting page gets everything again."""
    job_id = (await _read(request, lambda store, given: store.job(given)["id"], request.match_info["job_id"]))
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store",
                                           **SECURITY_HEADERS})
    await response.prepare(request)
    use = request.app[USE]
    use["streams"] += 1
    feed = Feed(job_id, lambda part, page: _render(request, f"_{part}.html", page=page))
    try:
        while True:
            events, over = await _read(request, feed.look)
            for event, payload in events:
                await response.write(f"event: {event}\ndata: {json.dumps(payload)}\n\n".encode())
            if over:
                break
            use["last"] = time.monotonic()
            await asyncio.sleep(POLL)
    except (ConnectionResetError, ConnectionError):
        pass
    finally:
        use["streams"] -= 1
    return response


# -- the server process -----------------------------------------------------------


async def serve(home: Path, sock: socket.socket) -> None:
    record = launch.read_token(home)
    ours = launch.token_valid(record, sock.getsockname()[1], time.time())   # else no URL opens this server
    app = make_app(home, record["token"] if ours else "", record["minted"] + launch.TOKEN_SECONDS if ours else 0.0)
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    idle = launch.idle_limit()
    use = app[USE]
    print(f"logview serving {home} on {sock.getsockname()} (idle limit {idle:g}s)", flush=True)
    born = time.monotonic()
    while not stop.is_set():
        with suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=launch.check_every(idle))
        now = time.monotonic()
        why = launch.reason_to_exit(home, os.getpid(), now - born, now - use["last"], use["streams"], idle)
        if why:
            print(f"{why}: exiting", flush=True)
            break
    await runner.cleanup()
    launch.forget_state(home, os.getpid())


def run(home: Path, sock: socket.socket) -> int:
    """Serve on an already listening socket until idle or told to stop."""
    sock.setblocking(False)
    asyncio.run(serve(home, sock))
    return 0


# -- the study page of `pai tune` (data in paicli/web/study.py) -----------------------------


async def studies_page(request: web.Request) -> web.Response:
    return _html(request, "studies.html", studies=await _read(request, study.study_list))


async def study_page(request: web.Request) -> web.Response:
    name = request.query.get("s")
    if not name:
        return await studies_page(request)
    return _html(request, "study.html", study=await _read(request, study.study_page, name), every=study.EVERY)


async def study_json(request: web.Request) -> web.Response:
    return web.json_response(await _read(request, study.curves, request.match_info["name"]))


async def study_head(request: web.Request) -> web.Response:
    return _html(request, "_study_head.html", study=await _read(request, study.study_page, request.match_info["name"]))


# -- a job's outputs, listed with download links ----------------------------------------


def _outputs(store: Store, prefix: str) -> tuple[dict, list[dict]]:
    job = store.find_job(prefix)
    rows = [dict(zip(store.OUTPUT_COLUMNS, row)) for row in store.outputs(job["id"])]
    return {"id": job["id"], **store.resume_links(job["id"]), **store.output_totals(job["id"])}, rows


async def outputs_page(request: web.Request) -> web.Response:
    job, rows = await _read(request, _outputs, request.match_info["job_id"])
    return _html(request, "outputs.html", job=job, rows=rows)


def _output_path(store: Store, job_id: str, instance: str, path: str) -> Path:
    """Only a file the store records as this job's, here: no other path is served."""
    job = store.job(job_id)
    for row in store.outputs(job["id"]):
        if row[1] == instance and row[2] == path and row[6] == "here":
            return Path(path)
    raise NotFound(f"no output {path!r} of {instance} in job {job_id}")


async def output_file(request: web.Request) -> web.StreamResponse:
    path = await _read(request, _output_path, request.match_info["job_id"], request.query.get("instance", ""),
                       request.query.get("path", ""))
    if not path.is_file():
        return web.Response(status=404, text=f"404: {path} is no longer there\n")
    return web.FileResponse(path, headers={"Content-Type": "application/octet-stream",
                                           "Content-Disposition": disposition("attachment", path.name)})
