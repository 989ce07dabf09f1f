"""The cron parser of schedules (:mod:`celery_workflow.schedules.cron`): fields, names, steps, day matching, time
zones and daylight-saving changes."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from celery_workflow.errors import ConfigurationError, InvalidSchedule
from celery_workflow.schedules.cron import parse_cron


def _ticks(expression: str, start: datetime, count: int, timezone: str = "UTC") -> list[str]:
    cron = parse_cron(expression, timezone)
    found, tick = [], start
    for _ in range(count):
        tick = cron.next_after(tick)
        found.append(tick.astimezone(cron.tz).strftime("%Y-%m-%d %H:%M%z"))
    return found


def test_every_five_minutes_is_strictly_after_the_instant() -> None:
    start = datetime(2026, 12, 6, 2, 15, tzinfo=UTC)
    assert _ticks("*/5 * * * *", start, 3) == [
        "2026-12-06 02:20+0000",
        "2026-12-06 02:25+0000",
        "2026-12-06 02:30+0000",
    ]
    assert _ticks("*/5 * * * *", start + timedelta(seconds=1), 1) == ["2026-12-06 02:20+0000"]


def test_ranges_steps_lists_and_names() -> None:
    start = datetime(2026, 1, 1, tzinfo=UTC)  # a Thursday
    assert _ticks("0 9-17/4 * * *", start, 4) == [
        "2026-01-01 09:00+0000",
        "2026-01-01 13:00+0000",
        "2026-01-01 17:00+0000",
        "2026-01-02 09:00+0000",
    ]
    assert _ticks("15,45 8 * * MON-fri", start, 3) == [
        "2026-01-01 08:15+0000",
        "2026-01-01 08:45+0000",
        "2026-01-02 08:15+0000",
    ]
    assert _ticks("0 0 1 jan,JUL *", start, 3) == [
        "2026-07-01 00:00+0000",
        "2027-01-01 00:00+0000",
        "2027-07-01 00:00+0000",
    ]
    assert _ticks("30/15 * * * *", start, 3) == [
        "2026-01-01 00:30+0000",
        "2026-01-01 00:45+0000",
        "2026-01-01 01:30+0000",
    ]
    assert _ticks("0 12 * * 7", start, 1) == ["2026-01-04 12:00+0000"]  # 7 is Sunday, as 0
    assert _ticks("@weekly", start, 1) == ["2026-01-04 00:00+0000"]
    assert _ticks("@hourly", start, 2) == ["2026-01-01 01:00+0000", "2026-01-01 02:00+0000"]


def test_both_day_fields_restricted_match_either() -> None:
    start = datetime(2026, 1, 1, tzinfo=UTC)  # the 13th is a Tuesday, the first Friday the 2nd
    assert _ticks("0 0 13 * fri", start, 3) == [
        "2026-01-02 00:00+0000",
        "2026-01-09 00:00+0000",
        "2026-01-13 00:00+0000",
    ]
    assert _ticks("0 0 29 2 *", start, 1) == ["2028-02-29 00:00+0000"]


@pytest.mark.parametrize(
    "expression",
    ["* * * *", "60 * * * *", "* 24 * * *", "* * 0 * *", "* * * 13 *", "* * * * 8", "*/0 * * * *", "5-1 * * * *",
     "a * * * *", "1,,2 * * * *", "* * * foo *", "0 0 30 2 *", 42],
)  # fmt: skip
def test_malformed_expressions_are_refused(expression: object) -> None:
    with pytest.raises(InvalidSchedule):
        parse_cron(expression)  # type: ignore[arg-type]


def test_an_unknown_time_zone_is_refused_as_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="Mars/Olympus"):
        parse_cron("* * * * *", "Mars/Olympus")


def test_a_time_zone_reads_the_wall_clock_there() -> None:
    start = datetime(2026, 1, 1, tzinfo=UTC)
    cron = parse_cron("0 9 * * *", "America/New_York")
    assert cron.next_after(start) == datetime(2026, 1, 1, 14, 0, tzinfo=UTC)
    assert cron.next_after(datetime(2026, 7, 1, tzinfo=UTC)) == datetime(2026, 7, 1, 13, 0, tzinfo=UTC)  # EDT


def test_clocks_going_forward_fire_a_fixed_hour_once_and_skip_the_missing_times_of_an_hourly_one() -> None:
    before = datetime(2026, 3, 28, 12, tzinfo=UTC)  # Paris goes from 02:00 to 03:00 on 29 March
    assert _ticks("30 2 * * *", before, 3, "Europe/Paris") == [
        "2026-03-29 03:00+0200",  # 02:30 does not exist: fired when the clocks jumped
        "2026-03-30 02:30+0200",
        "2026-03-31 02:30+0200",
    ]
    assert _ticks("*/30 * * * *", datetime(2026, 3, 29, 0, 15, tzinfo=UTC), 4, "Europe/Paris") == [
        "2026-03-29 01:30+0100",
        "2026-03-29 03:00+0200",
        "2026-03-29 03:30+0200",
        "2026-03-29 04:00+0200",
    ]


def test_clocks_going_back_fire_a_fixed_hour_once_and_an_hourly_one_at_both_occurrences() -> None:
    before = datetime(2026, 10, 24, 12, tzinfo=UTC)  # Paris goes from 03:00 back to 02:00 on 25 October
    assert _ticks("30 2 * * *", before, 2, "Europe/Paris") == ["2026-10-25 02:30+0200", "2026-10-26 02:30+0100"]
    assert _ticks("*/30 * * * *", datetime(2026, 10, 24, 23, 45, tzinfo=UTC), 4, "Europe/Paris") == [
        "2026-10-25 02:00+0200",
        "2026-10-25 02:30+0200",
        "2026-10-25 02:00+0100",
        "2026-10-25 02:30+0100",
    ]


def test_ticks_between_two_instants() -> None:
    cron = parse_cron("*/10 * * * *")
    start = datetime(2026, 1, 1, tzinfo=UTC)
    assert list(cron.ticks(start, start + timedelta(minutes=30))) == [
        start + timedelta(minutes=10),
        start + timedelta(minutes=20),
        start + timedelta(minutes=30),
    ]


def test_a_naive_instant_is_refused() -> None:
    with pytest.raises(ValueError, match="naive"):
        parse_cron("* * * * *").next_after(datetime(2026, 1, 1))
