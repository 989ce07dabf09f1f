"""Remote control of a worker on an AWS World (issue #29, item 3: Flower asks ``inspect stats`` and ``conf``): the
World object in the app's transport options must not make the replies unencodable."""

from __future__ import annotations

import json

from celery import Celery
from kombu.utils.json import dumps

from celery_workflow import Workflows
from tests.integration.aws_fixtures import Aws, aws_fixture, moto_fixture  # noqa: F401


def test_the_connection_info_inspect_stats_sends_is_json(aws: Aws) -> None:
    world = aws.world()
    wf = Workflows(Celery("aws_inspect"), world, broker="world")
    with wf.celery_app.connection_for_write() as conn:
        info = conn.info()  # what a worker's ``inspect stats`` reply carries as its "broker"
    encoded = json.loads(dumps(info))
    assert encoded["transport_options"]["world"] == {"world": "aws", "table": world.config.table_name}
    json.loads(dumps(wf.celery_app.conf.table(with_defaults=False, censored=True)))  # ``inspect conf``
