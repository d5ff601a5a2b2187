"""The router of a serving job: one per job, on the submitting machine, in front of
the replicas the job's master runs.

    main([FD, PLAN])   (started by cluster.spawn.start_router; stdin: the master's pipe)

FD is a listening socket the master bound (so a busy port failed the job before
anything started); PLAN is the job's plan.json: its `front` names the role served,
and that role's env holds the replicas' token (PAI_SERVING_TOKEN). The master
writes one line per change, `up replica:0 HOST:PORT` and `down replica:0`; EOF
(the master done or gone) ends the router.

Requests are spread over the ready replicas, least outstanding first. A health
check of `/v2/health/ready` every HEALTH_EVERY seconds takes a replica in and out;
a failed connection takes it out at once, and the request goes to another ready
replica (predict is idempotent). Bodies pass through unchanged. The policy is the
pure functions below; aiohttp is imported only by the process that serves.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import signal
import socket
import time
from collections.abc import Iterable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from paicli.errors import UsageError
from paicli.jobplan import JobPlan, front_url

HEALTH_EVERY = 0.25      # seconds between a replica's health checks
HEALTH_TIMEOUT = 0.7     # a check unanswered this long fails: a sick replica is out within 1 s
WAIT_FOR_REPLICA = 5.0   # a request while no replica is ready waits this long, then gets 503
DRAIN = 2.0              # at the end, requests in flight get this long (within the stop's grace)
CONNECT_TIMEOUT = 2.0
MAX_BODY = 64 << 20      # bytes, unless the plan's front says otherwise
TOKEN_ENV = "PAI_SERVING_TOKEN"
TOKEN_HEADER = "X-Pai-Token"
HEALTH_PATH = "/v2/health/ready"
# What of a request or an answer crosses the router besides the body.
PASSED_HEADERS = ("Content-Type", "Accept")


# -- the policy ---------------------------------------------------------------------


@dataclass
class Replica:
    name: str               # ROLE:INDEX
    address: str            # HOST:PORT
    ready: bool = False     # its last health check answered 200, and no connection failed since
    outstanding: int = 0    # requests sent to it and not answered yet
    picked: int = 0         # when it was last chosen (the router's count of choices)


def parse_control(line: str) -> tuple[str, str, str | None]:
    """A line from the master: ("up", NAME, "HOST:PORT") or ("down", NAME, None);
    ValueError for anything else."""
    words = line.split()
    if len(words) == 3 and words[0] == "up" and words[2].rpartition(":")[2].isdigit():
        return "up", words[1], words[2]
    if len(words) == 2 and words[0] == "down":
        return "down", words[1], None
    raise ValueError(f"not a router command: {line.strip()[:200]!r}")


def choose(replicas: Iterable[Replica]) -> Replica | None:
    """The ready replica with the fewest requests outstanding; between equals, the one
    chosen longest ago, so that even one client at a time is spread (and a new replica
    takes its turn, not every request until it has caught up). None: none ready."""
    ready = [r for r in replicas if r.ready]
    return min(ready, key=lambda r: (r.outstanding, r.picked, r.name)) if ready else None


def ready_after_check(status: int | None) -> bool:
    """Whether a replica is ready after a health check that answered `status` (None:
    no answer: refused, reset or timed out)."""
    return status == 200


def error_body(message: str) -> bytes:
    """An error in both protocols' form."""
    return json.dumps({"error": message}).encode()


def passed(headers) -> dict[str, str]:
    """The headers that cross the router (the token never leaves it towards a client)."""
    return {name: headers[name] for name in PASSED_HEADERS if name in headers}


def listen(front: dict) -> socket.socket:
    """The router's listening socket, bound by the master before anything starts;
    a port in use is the user's to change, in one line."""
    host, port = front.get("host") or "127.0.0.1", int(front["port"])
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # a last router's closed connections may linger
        sock.bind((host, port))
        sock.listen(1024)
    except OSError as err:
        sock.close()
        raise UsageError(f"the serving port {host}:{port} cannot be bound: {err.strerror}",
                         "pick another with --port (pai serve) or -DservingPort") from None
    return sock


# -- the process ----------------------------------------------------------------------


def note(text: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} router: {text}", flush=True)


def bearer_ok(header: str | None, token: str | None) -> bool:
    """A client's `Authorization: Bearer TOKEN` against the front's token (none asked
    for when the router listens on loopback only)."""
    if not token:
        return True
    scheme, _, given = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


class Router:
    def __init__(self, token: str | None, max_body: int, client_token: str | None = None):
        import aiohttp

        self.aiohttp = aiohttp
        self.token = token
        self.client_token = client_token
        self.max_body = max_body
        self.replicas: dict[str, Replica] = {}
        self.checks: dict[str, asyncio.Task] = {}
        self.changed = asyncio.Event()
        self.choices = 0
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT))

    def _headers(self, source) -> dict[str, str]:
        """What a request to a replica carries besides its body."""
        headers = passed(source)
        if self.token:
            headers[TOKEN_HEADER] = self.token
        return headers

    def _set_ready(self, replica: Replica, ready: bool, why: str) -> None:
        if replica.ready != ready:
            replica.ready = ready
            note(f"{replica.name} ({replica.address}) {'in' if ready else 'out'}: {why}")
            self.changed.set()
            self.changed = asyncio.Event()

    # -- the master's commands

    def command(self, line: str) -> None:
        try:
            word, name, address = parse_control(line)
        except ValueError as err:
            note(str(err))
            return
        self._forget(name, "down" if word == "down" else "replaced")
        if word == "up":
            replica = self.replicas[name] = Replica(name, address)
            self.checks[name] = asyncio.get_running_loop().create_task(self._check(replica))
            note(f"{name} up at {address}")

    def _forget(self, name: str, why: str) -> None:
        replica = self.replicas.pop(name, None)
        if replica is not None:
            self.checks.pop(name).cancel()
            self._set_ready(replica, False, why)   # its requests in flight finish; no new ones

    async def _check(self, replica: Replica) -> None:
        url = f"http://{replica.address}{HEALTH_PATH}"
        timeout = self.aiohttp.ClientTimeout(total=HEALTH_TIMEOUT)
        while True:
            status = None
            try:
                async with self.session.get(url, headers=self._headers({}), timeout=timeout) as answer:
                    status = answer.status
                    await answer.read()
            except (self.aiohttp.ClientError, asyncio.TimeoutError, OSError):
                pass
            self._set_ready(replica, ready_after_check(status),
                            f"health check answered {status}" if status else "health check got no answer")
            await asyncio.sleep(HEALTH_EVERY)

    # -- requests

    async def handle(self, request):
        from yarl import URL   # aiohttp's own

        web = self.aiohttp.web
        if not bearer_ok(request.headers.get("Authorization"), self.client_token):
            return self._error(401, "this service asks for `Authorization: Bearer TOKEN` (pai status shows it)")
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return self._error(413, f"the request body is over {self.max_body} bytes")
        deadline = time.monotonic() + WAIT_FOR_REPLICA
        while True:
            replica = choose(self.replicas.values())
            if replica is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return self._error(503, "no replica of the model is ready; try again shortly")
                with suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.changed.wait(), left)
                continue
            self.choices += 1
            replica.outstanding += 1
            replica.picked = self.choices
            try:
                url = URL(f"http://{replica.address}{request.raw_path}", encoded=True)
                async with self.session.request(request.method, url, data=body,
                                                headers=self._headers(request.headers)) as answer:
                    data = await answer.read()
                    return web.Response(status=answer.status, body=data, headers=passed(answer.headers))
            except (self.aiohttp.ClientConnectionError, asyncio.TimeoutError) as err:
                # Refused, reset or closed without an answer: the replica is gone. Another one answers.
                self._set_ready(replica, False, f"a request failed: {type(err).__name__}: {err}")
            finally:
                replica.outstanding -= 1

    def _error(self, status: int, message: str):
        return self.aiohttp.web.Response(status=status, body=error_body(message), content_type="application/json")

    async def close(self) -> None:
        for task in self.checks.values():
            task.cancel()
        await self.session.close()


async def serve(sock: socket.socket, front: dict, token: str | None) -> None:
    import aiohttp
    from aiohttp import web

    max_body = int(front.get("max_body") or MAX_BODY)
    router = Router(token, max_body, front.get("token"))
    app = web.Application(client_max_size=max_body)
    app.router.add_route("*", "/{tail:.*}", router.handle)
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=DRAIN)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(0, "rb", closefd=False))
    note(f"serving {front_url(front)} (aiohttp {aiohttp.__version__}) for role {front.get('role')}")

    async def commands() -> None:
        while line := await reader.readline():
            router.command(line.decode(errors="replace"))
        note("the master closed its pipe")
        stop.set()

    reading = loop.create_task(commands())
    await stop.wait()
    reading.cancel()
    await runner.cleanup()   # stops accepting, lets the requests in flight finish (DRAIN)
    await router.close()
    note("stopped")


def main(argv: list[str]) -> int:
    fd, plan_path = int(argv[0]), Path(argv[1])
    plan = JobPlan.from_json(plan_path.read_text())
    front = plan.front or {}
    token = plan.role(front["role"]).env.get(TOKEN_ENV) if front.get("role") else None
    signal.signal(signal.SIGHUP, signal.SIG_IGN)   # its own session: no terminal to lose
    sock = socket.socket(fileno=fd)
    sock.setblocking(False)
    asyncio.run(serve(sock, front, token))
    return 0
