"""When the database is down, an HTTP request fails with 503 within the World's ``unavailable_timeout`` (issue #12),
and the same World serves again once the database is back.

The Postgres World is reached through a TCP proxy run by the test (:class:`Proxy`), which stands for the three ways a
database goes away:

* ``refuse()``: nothing listens any more (connection refused) and the connections the pool holds are reset;
* ``black_hole()``: connections are accepted and never answered, and the connections the pool holds stop getting
  answers mid-session (a hung server, a partition: TCP keeps acknowledging, so only the World's own deadline ends
  the wait);
* a World opened while the proxy already refuses or is a black hole (no connection ever made).

Each request runs in a thread of its own and the test waits for it at most ``TIMEOUT + SLACK`` seconds: before the
bound existed these requests took minutes (refused) or never returned (black hole), and the test fails rather than
hangs. ``SLACK`` is a correctness margin for a busy machine, not a performance threshold.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any
from urllib.parse import urlsplit

import pytest
from celery import Celery
from flask import Flask
from flask.testing import FlaskClient

from celery_workflow import Workflows
from celery_workflow._postgres.database import PgDatabase, bounded_conninfo
from celery_workflow.errors import ConfigurationError, WorldUnavailable
from celery_workflow.world_pg import PostgresConfig, PostgresWorld
from tests.integration import pg_fixtures

PREFIX = "/v1/workflow"
#: The bound the Worlds under test are configured with (seconds).
TIMEOUT = 1.5
#: What a request may take beyond the bound on a busy machine (a margin, not a performance threshold).
SLACK = 2.0
#: How long the World may take to serve again once the database is back.
RECOVERY = 15.0


class Proxy:
    """A TCP proxy on 127.0.0.1 to the test database, which the test can make refuse or go silent."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.mode = "forward"
        self.port = 0
        self._lock = threading.Lock()
        self._forwarding = threading.Event()
        self._forwarding.set()
        self._relayed: list[tuple[socket.socket, socket.socket]] = []
        self._held: list[socket.socket] = []
        self._closed = False
        self._listener: socket.socket | None = None
        self._listen()

    def _listen(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), name="proxy-accept", daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self.mode != "forward":
                    self._held.append(client)  # accepted, never answered
                    continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._relayed.append((client, upstream))
            threading.Thread(target=self._relay, args=(client, upstream), name="proxy-relay", daemon=True).start()

    def _relay(self, a: socket.socket, b: socket.socket) -> None:
        while True:
            if not self._forwarding.is_set():  # a black hole: nothing passes, in either direction
                self._forwarding.wait(0.1)
                if self._closed:
                    break
                continue
            try:
                ready, _, _ = select.select([a, b], [], [], 0.1)
                for sock in ready:
                    data = sock.recv(65536)
                    if not data:
                        raise OSError("closed")
                    (b if sock is a else a).sendall(data)
            except (OSError, ValueError):
                break
        for sock in (a, b):
            _close(sock)

    def refuse(self) -> None:
        """Stop listening (connection refused) and reset every relayed connection."""
        with self._lock:
            self.mode = "refuse"
            if self._listener is not None:
                self._listener.close()
                self._listener = None
            for pair in self._relayed:
                for sock in pair:
                    _reset(sock)
            self._relayed.clear()

    def black_hole(self) -> None:
        """Accept and never answer; relayed connections stop passing anything."""
        with self._lock:
            self.mode = "black_hole"
            self._forwarding.clear()

    def restore(self) -> None:
        """Forward again. Connections accepted while silent are closed (their clients gave up on them); relayed
        connections pass data again, as after a hung server recovers."""
        with self._lock:
            self.mode = "forward"
            for sock in self._held:
                _close(sock)
            self._held.clear()
            self._forwarding.set()
            if self._listener is None:
                self._listen()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._listener is not None:
                self._listener.close()
                self._listener = None
            for sock in [*self._held, *(s for pair in self._relayed for s in pair)]:
                _close(sock)
            self._held.clear()
            self._relayed.clear()
            self._forwarding.set()


def _close(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass


def _reset(sock: socket.socket) -> None:
    """Close with a TCP reset (SO_LINGER 0), as a server that goes away does to its peers."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    except OSError:
        pass
    _close(sock)


def _proxied_url(schema: str, port: int) -> str:
    parts = urlsplit(pg_fixtures.schema_url(schema))
    netloc = parts.netloc.rsplit("@", 1)
    hostport = f"127.0.0.1:{port}"
    return parts._replace(netloc=f"{netloc[0]}@{hostport}" if len(netloc) == 2 else hostport).geturl()


def _timed(call: Callable[[], Any], limit: float) -> tuple[Any, float]:
    """``call()``'s answer and how long it took; fails the test (instead of hanging it) when it takes over ``limit``
    seconds. The call runs in a daemon thread, which the proxy's teardown unblocks."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # re-raised in the test's thread
            box["error"] = exc

    started = time.monotonic()
    thread = threading.Thread(target=target, name="timed-request", daemon=True)
    thread.start()
    thread.join(limit)
    elapsed = time.monotonic() - started
    if thread.is_alive():
        pytest.fail(f"no answer within {limit:.1f} s (the bound is {TIMEOUT} s)")
    if "error" in box:
        raise box["error"]
    return box["value"], elapsed


@pytest.fixture
def proxy() -> Iterator[Proxy]:
    target = urlsplit(pg_fixtures.DATABASE_URL)
    p = Proxy(target.hostname or "127.0.0.1", target.port or 5432)
    yield p
    p.close()


@pytest.fixture
def schema() -> Iterator[str]:
    """A migrated schema of this test's own (migrated directly, not through the proxy)."""
    with pg_fixtures.fresh_schema("cw_unavail") as name:
        PostgresWorld.open(pg_fixtures.schema_url(name)).close()
        yield name


def _workflows(world: PostgresWorld) -> Workflows:
    wf = Workflows(Celery("unavailable"), world=world, broker="app", base_url="https://x.test/wf")

    @wf.workflow
    def noop() -> None:
        return None

    return wf


def _http(wf: Workflows) -> FlaskClient:
    app = Flask("unavailable")
    app.register_blueprint(wf.blueprint(authorize=lambda request, method: True), url_prefix=PREFIX)
    return app.test_client()


@pytest.fixture
def served(proxy: Proxy, schema: str) -> Iterator[tuple[FlaskClient, PostgresWorld]]:
    """The blueprint on a World opened through the proxy while the database is up, with a request served (so the
    pool holds live connections when the database goes away)."""
    with ExitStack() as stack:
        world = PostgresWorld.open(_proxied_url(schema, proxy.port), unavailable_timeout=TIMEOUT)
        stack.callback(world.close)
        http = _http(_workflows(world))
        assert _list_runs(http)[0] == 200
        yield http, world


def _list_runs(http: FlaskClient) -> tuple[int, Any]:
    resp = http.post(f"{PREFIX}/rpc", json={"method": "list_runs", "params": {}})
    return resp.status_code, resp.get_json()


def _assert_503_in_time(http: FlaskClient) -> None:
    (status, body), elapsed = _timed(lambda: _list_runs(http), TIMEOUT + SLACK)
    assert status == 503, body
    assert body["error"]["code"] == "unavailable"
    assert "no answer within 1.5 s" in body["error"]["message"]
    assert elapsed < TIMEOUT + SLACK
    resp, elapsed = _timed(lambda: http.post(f"{PREFIX}/webhooks/some-token", data=b"{}"), TIMEOUT + SLACK)
    assert resp.status_code == 503, resp.get_data()
    assert resp.get_json()["error"]["code"] == "unavailable"


def _serves_again(http: FlaskClient) -> None:
    deadline = time.monotonic() + RECOVERY
    while True:
        (status, body), _ = _timed(lambda: _list_runs(http), TIMEOUT + SLACK)
        if status == 200:
            assert body["result"]["runs"] == []
            return
        assert status == 503, body
        assert time.monotonic() < deadline, f"still {status} {RECOVERY} s after the database came back: {body}"
        time.sleep(0.1)


def test_a_database_that_refuses_mid_session_gives_503_in_time_then_serves_again(
    proxy: Proxy, served: tuple[FlaskClient, PostgresWorld]
) -> None:
    http, _ = served
    proxy.refuse()
    _assert_503_in_time(http)
    _assert_503_in_time(http)  # the pool's reconnection attempts do not lengthen later requests
    proxy.restore()
    _serves_again(http)


def test_a_database_that_goes_silent_mid_session_gives_503_in_time_then_serves_again(
    proxy: Proxy, served: tuple[FlaskClient, PostgresWorld]
) -> None:
    http, world = served
    proxy.black_hole()
    _assert_503_in_time(http)
    _assert_503_in_time(http)
    proxy.restore()
    _serves_again(http)
    watchdog = world.db._watchdog
    assert watchdog is not None and watchdog.broken >= 1  # the silent pooled connections were broken at the deadline


@pytest.mark.parametrize("down", ["refuse", "black_hole"])
def test_a_world_opened_while_the_database_is_down_gives_503_in_time_then_serves(
    proxy: Proxy, schema: str, down: str
) -> None:
    getattr(proxy, down)()
    world = PostgresWorld.open(_proxied_url(schema, proxy.port), unavailable_timeout=TIMEOUT, migrate=False)
    try:
        http = _http(_workflows(world))
        _assert_503_in_time(http)
        proxy.restore()
        _serves_again(http)
    finally:
        world.close()


@pytest.mark.parametrize("down", ["refuse", "black_hole"])
def test_opening_a_world_on_a_database_that_is_down_fails_in_time(proxy: Proxy, schema: str, down: str) -> None:
    getattr(proxy, down)()

    def open_world() -> None:
        with pytest.raises(WorldUnavailable, match=r"no answer within 1\.5 s"):
            PostgresWorld.open(_proxied_url(schema, proxy.port), unavailable_timeout=TIMEOUT)

    _timed(open_world, TIMEOUT + SLACK)


def test_a_statement_outliving_the_bound_on_a_live_server_is_cut_and_the_world_serves_on(
    served: tuple[FlaskClient, PostgresWorld],
) -> None:
    """A server that answers, but not in time, is cut at the bound too."""
    http, world = served

    def slow(conn: Any) -> None:
        conn.execute("SELECT pg_sleep(10)")

    def call() -> None:
        with pytest.raises(WorldUnavailable, match=r"no answer within 1\.5 s"):
            world.db.run(slow, what="slow")

    _, elapsed = _timed(call, TIMEOUT + SLACK)
    assert elapsed >= TIMEOUT - 0.1
    assert _list_runs(http)[0] == 200


def test_unavailable_timeout_is_checked_and_sets_the_connection_timeouts() -> None:
    for bad in (0, -1.0, float("nan"), "10"):
        with pytest.raises(ConfigurationError, match="unavailable_timeout"):
            PostgresConfig(unavailable_timeout=bad)  # type: ignore[arg-type]
    assert PostgresConfig().unavailable_timeout == 10.0
    assert PostgresConfig(unavailable_timeout=None).unavailable_timeout is None
    with pytest.raises(ConfigurationError, match="unavailable_timeout"):
        PgDatabase(url="postgresql://x/y", unavailable_timeout=0)
    dial = bounded_conninfo("postgresql://u@h:5/db?connect_timeout=7", 1.5)
    assert "connect_timeout=7" in dial  # the connection string's own values win
    assert "tcp_user_timeout=1500" in dial and "keepalives=1" in dial
    assert "connect_timeout=2" in bounded_conninfo("host=h dbname=db", 0.5)  # libpq's minimum
    assert bounded_conninfo("host=h dbname=db", None) == "host=h dbname=db"
