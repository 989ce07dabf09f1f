"""Configuration and wiring of the Postgres World: :class:`PostgresConfig` and :func:`postgres_url`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any
from urllib.parse import quote, urlencode

from psycopg.conninfo import conninfo_to_dict

from celery_workflow.errors import ConfigurationError

__all__ = ["PostgresConfig", "config_with", "postgres_url"]


@dataclass(frozen=True)
class PostgresConfig:
    """Settings of a Postgres World (the seed's ``Config``; the connection string is given to :meth:`open`).

    * ``base_url``: public URL of the HTTP endpoints, including their prefix (for webhook URLs); optional here.
    * ``poll_interval``: longest sleep of workers and waiters when no notification arrives (seconds).
    * ``concurrency``: deliveries one worker executes at once: the app's ``worker_concurrency`` unless it sets its
      own (``celery worker -c N`` overrides both, as the seed's ``WorkerOptions.Concurrency``). The World's own pool
      holds up to ``concurrency + 5`` connections in a process that is not a worker (an API server); a worker sizes
      it per process to what that process runs at once (:mod:`celery_workflow.worker_setup`): one delivery in each
      prefork child, the worker's concurrency in its main process.
    * ``lease``: seconds a claimed delivery stays hidden; workers renew it while executing.
    * ``routes``: workflow name -> queue of its deliveries (others go to the default queue).
    * ``retention`` / ``retentions``: how long ended runs are kept, by default and per workflow name (``None``:
      forever; a workflow listed in ``retentions`` with ``None`` is kept forever whatever the default).
    * ``unavailable_timeout``: the longest one World call takes (seconds, retries included) when the database refuses
      connections, does not answer or stops answering; the call then raises
      :class:`~celery_workflow.errors.WorldUnavailable`, which the HTTP endpoints answer with ``503``. It bounds
      libpq's ``connect_timeout`` and ``tcp_user_timeout`` (unless the connection string sets them), the wait for a
      pooled connection, the retries, and the call's statements (a watchdog breaks the connection of a call still
      running at its deadline). ``None``: no bound (a call waits and retries for minutes, as before this setting).
      One setting serves HTTP and workers: a worker's call that gives up leaves its delivery unacknowledged, and the
      transport delivers it again with its backoff, so a short bound costs a worker nothing but a retry; the
      transport's own connections are not bounded by it (Celery reconnects them).
    """

    base_url: str | None = None
    poll_interval: float = 0.25
    concurrency: int = 10
    lease: float = 60.0
    routes: Mapping[str, str] = field(default_factory=dict)
    retention: timedelta | None = None
    retentions: Mapping[str, timedelta | None] = field(default_factory=dict)
    unavailable_timeout: float | None = 10.0

    def __post_init__(self) -> None:
        if not self.poll_interval > 0:
            raise ConfigurationError("poll_interval must be positive")
        if self.concurrency < 1:
            raise ConfigurationError("concurrency must be at least 1")
        if not self.lease > 0:
            raise ConfigurationError("lease must be positive")
        if self.unavailable_timeout is not None and not (
            isinstance(self.unavailable_timeout, (int, float)) and self.unavailable_timeout > 0
        ):
            raise ConfigurationError("unavailable_timeout must be a positive number of seconds (or None: no bound)")
        for name, keep in {"": self.retention, **self.retentions}.items():
            if keep is not None and (not isinstance(keep, timedelta) or keep <= timedelta(0)):
                raise ConfigurationError(f"retention{' of ' + repr(name) if name else ''} must be a positive timedelta")

    @property
    def expires_runs(self) -> bool:
        """True when some ended runs are to be deleted (a retention is configured)."""
        return self.retention is not None or any(v is not None for v in self.retentions.values())


def config_with(config: PostgresConfig | None, overrides: Mapping[str, Any]) -> PostgresConfig:
    """``config`` (or the defaults) with ``overrides`` (field names) applied; ConfigurationError for unknown ones."""
    base = config or PostgresConfig()
    known = {f.name for f in dataclasses.fields(PostgresConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ConfigurationError(f"unknown Postgres World settings {unknown}; known: {sorted(known)}")
    return dataclasses.replace(base, **overrides) if overrides else base


def postgres_url(conninfo: str) -> str:
    """A ``postgresql://`` URL for a libpq connection string (a URL is kept as it is, with a ``postgresql`` scheme).

    Every parameter survives, ``options`` (e.g. ``-csearch_path=…``) included: what cannot go in the authority
    (socket directories, several hosts) goes in the query string.
    """
    text = conninfo.strip()
    scheme, sep, rest = text.partition("://")
    if sep and scheme.lower() in ("postgres", "postgresql"):
        return "postgresql://" + rest
    params = {k: str(v) for k, v in conninfo_to_dict(text).items()}
    user, password = params.pop("user", None), params.pop("password", None)
    host, port, dbname = params.pop("host", None), params.pop("port", None), params.pop("dbname", None)
    netloc = ""
    if user is not None:
        netloc = quote(user, safe="") + ("" if password is None else ":" + quote(password, safe="")) + "@"
    elif password is not None:
        params["password"] = password
    if host and "/" not in host and "," not in host:
        netloc += f"[{host}]" if ":" in host else host
        if port:
            netloc += f":{port}"
    else:
        if host:
            params["host"] = host
        if port:
            params["port"] = port
    path = "/" + quote(dbname, safe="") if dbname else "/"
    query = urlencode(params, quote_via=quote)
    return f"postgresql://{netloc}{path}" + (f"?{query}" if query else "")
