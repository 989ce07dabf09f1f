"""What carries a Celery app's workflow deliveries: ``Workflows(app, world, broker="world" | "app")`` (issue #29).

``"world"``: the World's queue becomes the app's broker (its Kombu transport), for plain tasks too. ``"app"``: the app
keeps its broker (RabbitMQ, Redis…) and the relay (:mod:`celery_workflow.relay`) publishes the World's due deliveries
to it. An app whose broker is configured and which says nothing is refused: its broker is never replaced silently.
"""

from __future__ import annotations

import os
import warnings
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from celery_workflow.errors import ConfigurationError

__all__ = ["BROKER_CHOICES", "DEFAULT_RELAY_LEASE", "broker_choice", "configured_broker"]


def _masked(url: str) -> str:
    """``url`` with its password shown as ``**``."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        netloc = parts.netloc.replace(f":{parts.password}@", ":**@", 1)
        return urlunsplit(parts._replace(netloc=netloc))
    except ValueError:
        return "<unparsable URL>"


#: The two values of ``Workflows(broker=...)``.
BROKER_CHOICES = ("world", "app")

#: Default ``Workflows(relay_lease=...)``: seconds a relayed delivery is leased before it is published again.
DEFAULT_RELAY_LEASE = 300.0


def configured_broker(celery_app: Any) -> str | None:
    """The broker URL the Celery app was configured with (its password masked), or None when it has none of its own:
    Celery's default, or a broker a :class:`Workflows` set (one of our transports)."""
    conf = celery_app.conf
    transport = conf.broker_transport
    if isinstance(transport, str) and transport.startswith("celery_workflow."):
        return None
    url = conf.broker_url or conf.broker_write_url or conf.broker_read_url or os.environ.get("CELERY_BROKER_URL")
    if not url and not transport:
        return None
    shown = url if isinstance(url, str) else repr(url) if url else f"transport {transport!r}"
    return _masked(shown) if isinstance(url, str) else shown


def broker_choice(celery_app: Any, broker: str | None, configure_broker: bool | None = None) -> str:
    """What carries the deliveries: ``broker`` (``"world"`` or ``"app"``) if given; else, from the deprecated
    ``configure_broker`` (True: ``"world"``, False: ``"app"``, with a DeprecationWarning); else ``"world"`` when the app
    has no broker of its own. An app with a configured broker and no choice is refused with a ConfigurationError
    naming both choices: its broker is never replaced silently."""
    if configure_broker is not None:
        mapped = "world" if configure_broker else "app"
        warnings.warn(
            f"Workflows(configure_broker={configure_broker!r}) is deprecated: use Workflows(..., broker={mapped!r})",
            DeprecationWarning,
            stacklevel=3,
        )
        if broker is not None and broker != mapped:
            raise ConfigurationError(
                f"Workflows(broker={broker!r}, configure_broker={configure_broker!r}) contradict each other;"
                f" give broker= alone"
            )
        broker = mapped
    if broker is not None:
        if broker not in BROKER_CHOICES:
            raise ConfigurationError(f"Workflows(broker={broker!r}): broker is 'world' or 'app'")
        return broker
    url = configured_broker(celery_app)
    if url is None:
        return "world"
    raise ConfigurationError(
        f"the Celery app {getattr(celery_app, 'main', None) or '?'!r} already has a broker ({url}); say what"
        " workflow deliveries should use:\n"
        '  Workflows(app, world, broker="app")    keep this broker: the World keeps each delivery and a relay'
        " publishes it to this broker when due (in every worker, or `celery -A app workflow relay`);"
        " plain tasks stay where they are\n"
        '  Workflows(app, world, broker="world")  replace it with the World\'s queue: plain tasks move there too,'
        " and nothing consumes this broker any more\n"
        "(see docs/coming-from-celery.md)"
    )
