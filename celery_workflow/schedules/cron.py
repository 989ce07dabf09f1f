"""Cron expressions: five fields, read in a time zone, with its daylight-saving changes.

``minute hour day-of-month month day-of-week``; each field is ``*``, a value, a range ``a-b``, a step ``*/s``,
``a-b/s`` or ``a/s`` (from ``a`` to the field's end), or a comma-separated list of those. Months may be named
``jan``…``dec`` and days ``sun``…``sat`` (any case); day-of-week ``0`` and ``7`` are both Sunday. As in Vixie cron,
when both day fields are restricted a day matches either of them; when one is ``*`` only the other counts. The
macros ``@yearly`` (``@annually``), ``@monthly``, ``@weekly``, ``@daily`` (``@midnight``) and ``@hourly`` stand for
their usual expressions.

Ticks are instants (aware UTC datetimes), computed on the wall clock of ``timezone`` (an IANA name, read with
:mod:`zoneinfo`):

* **Clocks go forward** (a wall time that does not exist that day): an expression with a restricted hour field
  (``30 2 * * *``) fires once, at the instant the clocks changed; one that runs every hour (``*/5 * * * *``) skips
  the wall times that do not exist, as it has no hour to keep.
* **Clocks go back** (a wall time that occurs twice): an expression with a restricted hour field fires at the first
  occurrence only; one that runs every hour fires at both, so that its ticks stay evenly spaced in real time.

Ticks are strictly increasing: :meth:`Cron.next_after` is the first tick after an instant.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, tzinfo
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from celery_workflow.errors import InvalidSchedule

__all__ = ["Cron", "parse_cron", "zone"]

MACROS = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
_MONTH_NAMES = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
MONTHS = {name: n for n, name in enumerate(_MONTH_NAMES, start=1)}
DAYS = {name: n for n, name in enumerate(("sun", "mon", "tue", "wed", "thu", "fri", "sat"))}
#: (name, lowest, highest, names) of each field, in order.
FIELDS: tuple[tuple[str, int, int, dict[str, int]], ...] = (
    ("minute", 0, 59, {}),
    ("hour", 0, 23, {}),
    ("day of month", 1, 31, {}),
    ("month", 1, 12, MONTHS),
    ("day of week", 0, 7, DAYS),
)
#: How far ahead a tick is looked for before an expression is taken to match no date (29 February on a given
#: weekday recurs within 28 years).
HORIZON = timedelta(days=366 * 29)
MINUTE = timedelta(minutes=1)
#: How far apart two looks for a change of the zone's UTC offset are (no zone changes its offset twice within it).
OFFSET_PROBE = timedelta(hours=6)


def zone(name: str) -> tzinfo:
    """The time zone named ``name`` (IANA, e.g. ``"Europe/Paris"``, or ``"UTC"``); InvalidSchedule when unknown."""
    if not isinstance(name, str) or not name:
        raise InvalidSchedule(f"a time zone is an IANA name such as 'UTC' or 'Europe/Paris', not {name!r}")
    if name.upper() == "UTC":
        return UTC
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise InvalidSchedule(f"unknown time zone {name!r}") from exc


def _value(text: str, field: tuple[str, int, int, dict[str, int]]) -> int:
    name, low, high, names = field
    found = names.get(text.lower())
    if found is None:
        if not text.isdigit():
            raise InvalidSchedule(f"cron {name}: {text!r} is not a number{' or a name' if names else ''}")
        found = int(text)
    if not low <= found <= high:
        raise InvalidSchedule(f"cron {name}: {found} is outside {low}-{high}")
    return found


def _field(text: str, field: tuple[str, int, int, dict[str, int]]) -> frozenset[int]:
    name, low, high, _ = field
    values: set[int] = set()
    for part in text.split(","):
        if not part:
            raise InvalidSchedule(f"cron {name}: empty item in {text!r}")
        span, _, step_text = part.partition("/")
        step = 1
        if step_text:
            if not step_text.isdigit() or int(step_text) < 1:
                raise InvalidSchedule(f"cron {name}: step {step_text!r} is not a positive number")
            step = int(step_text)
        if span == "*":
            first, last = low, high
        elif "-" in span:
            a, _, b = span.partition("-")
            first, last = _value(a, field), _value(b, field)
            if first > last:
                raise InvalidSchedule(f"cron {name}: range {span!r} runs backwards")
        else:
            first = _value(span, field)
            last = high if step_text else first
        values.update(range(first, last + 1, step))
    return frozenset(values)


@dataclass(frozen=True)
class Cron:
    """A parsed cron expression in a time zone (see the module docstring); build it with :func:`parse_cron`."""

    expression: str
    timezone: str
    minutes: frozenset[int]
    hours: frozenset[int]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]  # 0 = Sunday
    any_day: bool  # day of month is *
    any_weekday: bool  # day of week is *

    @property
    def tz(self) -> tzinfo:
        return zone(self.timezone)

    @property
    def every_hour(self) -> bool:
        """Whether the hour field is unrestricted (how the daylight-saving changes are met: module docstring)."""
        return len(self.hours) == 24

    def _day_matches(self, day: datetime) -> bool:
        in_month = day.day in self.days
        in_week = (day.isoweekday() % 7) in self.weekdays
        if self.any_day and self.any_weekday:
            return True
        if self.any_day:
            return in_week
        if self.any_weekday:
            return in_month
        return in_month or in_week

    def matches(self, wall: datetime) -> bool:
        """Whether the wall-clock time ``wall`` (naive) matches, to the minute."""
        return (
            wall.minute in self.minutes
            and wall.hour in self.hours
            and wall.month in self.months
            and self._day_matches(wall)
        )

    def _next_wall(self, start: datetime, end: datetime) -> datetime | None:
        """The first naive wall time at or after ``start`` (whole minutes) that matches, before ``end``."""
        t = start.replace(second=0, microsecond=0)
        if t < start:
            t += MINUTE
        while t < end:
            if t.month not in self.months:
                later = [m for m in sorted(self.months) if m > t.month]
                t = datetime(t.year, later[0], 1) if later else datetime(t.year + 1, min(self.months), 1)
                continue
            if not self._day_matches(t):
                t = datetime(t.year, t.month, t.day) + timedelta(days=1)
                continue
            if t.hour not in self.hours:
                later = [h for h in sorted(self.hours) if h > t.hour]
                t = (
                    t.replace(hour=later[0], minute=0)
                    if later
                    else datetime(t.year, t.month, t.day) + timedelta(days=1)
                )
                continue
            if t.minute not in self.minutes:
                later = [m for m in sorted(self.minutes) if m > t.minute]
                t = t.replace(minute=later[0]) if later else t.replace(minute=0) + timedelta(hours=1)
                continue
            return t
        return None

    def next_after(self, after: datetime) -> datetime:
        """The first tick strictly after the aware instant ``after``, as an aware UTC datetime; InvalidSchedule when
        none comes within :data:`HORIZON` (an expression that matches no date, such as ``0 0 30 2 *``)."""
        if after.tzinfo is None:
            raise ValueError("naive datetime; celery_workflow uses aware datetimes")
        tz = self.tz
        first = after.astimezone(UTC)
        now = first
        limit = first + HORIZON
        while now < limit:
            offset = _offset(tz, now)
            # the wall clock reads UTC + offset from now until the offset changes; a tick must come after ``after``
            start = _naive(now) + offset + (timedelta(microseconds=1) if now == first else timedelta(0))
            end = _naive(limit) + offset
            wall = self._next_wall(start, end)
            while True:
                instant = None if wall is None else (wall - offset).replace(tzinfo=UTC)
                change = _next_change(tz, now, offset, limit if instant is None else min(limit, instant + MINUTE))
                if wall is None or instant is None or instant >= change:
                    break  # no candidate before the offset changes
                if self.every_hour or not _repeated(tz, wall, offset):
                    return instant
                wall = self._next_wall(wall + MINUTE, end)
            if change >= limit:
                break
            new_offset = _offset(tz, change)
            skipped = new_offset > offset and not self.every_hour
            if skipped and self._next_wall(_naive(change) + offset, _naive(change) + new_offset) is not None:
                return change  # a wall time the clocks jumped over fires when they jumped
            now = change
        raise InvalidSchedule(f"cron {self.expression!r} matches no date within {HORIZON.days // 366} years")

    def ticks(self, after: datetime, until: datetime) -> Iterator[datetime]:
        """The ticks strictly after ``after`` and at or before ``until``, in order."""
        tick = self.next_after(after)
        while tick <= until:
            yield tick
            tick = self.next_after(tick)


def _offset(tz: tzinfo, instant: datetime) -> timedelta:
    found = instant.astimezone(tz).utcoffset()
    assert found is not None
    return found


def _naive(instant: datetime) -> datetime:
    return instant.astimezone(UTC).replace(tzinfo=None)


def _next_change(tz: tzinfo, now: datetime, offset: timedelta, limit: datetime) -> datetime:
    """The first whole minute after ``now`` at which the zone's offset is no longer ``offset``; ``limit`` when there
    is none before it. (Zones change their offsets on whole minutes.)"""
    if tz is UTC:
        return limit
    base = now.replace(second=0, microsecond=0)
    low, high = 0, int(OFFSET_PROBE / MINUTE)  # in minutes from base: the offset is ``offset`` at low
    while _offset(tz, base + high * MINUTE) == offset:
        if base + high * MINUTE >= limit:
            return limit
        low, high = high, high + int(OFFSET_PROBE / MINUTE)
    while high - low > 1:
        middle = (low + high) // 2
        if _offset(tz, base + middle * MINUTE) == offset:
            low = middle
        else:
            high = middle
    return base + high * MINUTE


def _repeated(tz: tzinfo, wall: datetime, offset: timedelta) -> bool:
    """Whether the wall time ``wall`` under ``offset`` is the second occurrence of a wall time the clocks went back
    over."""
    first = wall.replace(tzinfo=tz, fold=0).utcoffset()
    return first is not None and first != offset and (wall - first) < (wall - offset)


def parse_cron(expression: str, timezone: str = "UTC") -> Cron:
    """Parse ``expression`` (five fields or a macro) in ``timezone``; InvalidSchedule saying what is wrong."""
    if not isinstance(expression, str):
        raise InvalidSchedule(f"a cron expression is a string, not {expression!r}")
    text = " ".join(expression.split())
    zone(timezone)
    spelled = MACROS.get(text.lower(), text)
    parts = spelled.split(" ")
    if len(parts) != 5:
        raise InvalidSchedule(
            f"cron {expression!r}: five fields (minute hour day month weekday) or a macro, got {len(parts)}"
        )
    minutes, hours, days, months, weekdays = (_field(p, f) for p, f in zip(parts, FIELDS, strict=True))
    cron = Cron(
        expression=text,
        timezone=timezone,
        minutes=minutes,
        hours=hours,
        days=days,
        months=months,
        weekdays=frozenset(d % 7 for d in weekdays),
        any_day=parts[2].startswith("*"),
        any_weekday=parts[4].startswith("*"),
    )
    cron.next_after(datetime(2000, 1, 1, tzinfo=UTC))  # InvalidSchedule for an expression no date matches
    return cron
