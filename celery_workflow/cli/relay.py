"""``relay [--queue Q…] [--once]``: the relay of a ``Workflows(app, world, broker="app")`` on its own.

Workers of such an app already run the relay of the queues they consume (one at a time per World and queue set, see
:mod:`celery_workflow.relay`); this command runs it without a worker, e.g. beside workers that run only plain tasks,
or in a deployment whose workers should not hold a World connection for it. It needs the app (``celery -A app
workflow relay``): the relay publishes with the app's broker settings and routes. Stops on SIGINT or SIGTERM.
"""

from __future__ import annotations

from collections.abc import Sequence

import click

from celery_workflow.cli.session import BadInput, Session

__all__ = ["relay"]

pass_session = click.make_pass_decorator(Session)


@click.command("relay")
@click.option("--queue", "queues", metavar="Q", multiple=True, help="Relay this queue (repeatable). Default: every"
              " queue the app's workflows use.")  # fmt: skip
@click.option("--once", is_flag=True, help="One round: publish what is due now, print how many, and exit.")
@pass_session
def relay(session: Session, queues: Sequence[str], once: bool) -> None:
    """Publish the World's due workflow deliveries to the Celery app's own broker (broker="app")."""
    wf = session.workflows()
    if wf is None:
        raise BadInput("relay needs the Celery app: celery -A app workflow relay (it publishes with the app's broker)")
    if wf.broker != "app":
        raise BadInput(
            f"the app's Workflows uses broker={wf.broker!r}: its workers consume the World's queue themselves, there"
            ' is nothing to relay (the relay is for Workflows(app, world, broker="app"))'
        )
    from celery_workflow.relay_celery import run_relay
    from celery_workflow.worker_setup import known_queues

    names = list(dict.fromkeys(queues)) or known_queues(wf)
    if not once:
        click.echo(f"relaying {', '.join(names)} to {wf.celery_app.conf.broker_url or 'the default broker'}", err=True)
    published = run_relay(wf, names, once=once)
    click.echo(f"published {published} deliveries" if once else f"stopped after publishing {published} deliveries")
