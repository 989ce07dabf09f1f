"""Fault injection for Worlds: make chosen calls of a real World fail once, to test what a workflow does when its
storage is unavailable for a moment.

:class:`Faults` wraps methods of one World object (its instance attributes, nothing global) and raises the error you
choose at the calls you choose, each fault once; everything else goes to the World as usual::

    faults = Faults(world)
    faults.fail("append", call=2)                                  # the 2nd append raises WorldUnavailable
    faults.fail("append", when=ending(EventType.RUN_COMPLETED))    # the run's terminal append, once
    ...
    assert faults.fired == [("append", 2), ("append", 5)]
    faults.restore()

The rule it checks: an infrastructure error is never a workflow's outcome. A delivery that meets one is retried with
backoff, and the run goes on as if nothing had happened.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from celery_workflow.errors import WorldUnavailable
from celery_workflow.events import EventType, NewEvent

#: A predicate on a World call's arguments: which calls count towards a fault's ``call`` number.
Match = Callable[..., bool]


def ending(*kinds: EventType) -> Match:
    """Matches an ``append(run_id, events, ...)`` whose batch holds one of ``kinds`` (e.g. the run's terminal
    event)."""

    def match(run_id: str, events: Sequence[NewEvent], *args: Any, **kwargs: Any) -> bool:
        return any(ev.event_type in kinds for ev in events)

    return match


@dataclass(slots=True)
class _Fault:
    method: str
    call: int
    error: Callable[[], BaseException]
    when: Match | None
    seen: int = 0
    done: bool = False


@dataclass(slots=True)
class Faults:
    """Failing calls of one World, each once. Thread-safe; :meth:`restore` puts the World's own methods back."""

    world: Any
    #: ``(method, n)`` for each fault that fired: the n-th matching call of ``method`` raised
    fired: list[tuple[str, int]] = field(default_factory=list)
    _faults: list[_Fault] = field(default_factory=list)
    #: method name -> the instance attribute it had before (None: it came from the class)
    _wrapped: dict[str, Any] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _off: int = 0

    def fail(
        self,
        method: str,
        *,
        call: int = 1,
        error: BaseException | Callable[[], BaseException] | None = None,
        when: Match | None = None,
    ) -> None:
        """Make the ``call``-th call of ``method`` (counting only calls ``when`` matches, if given) raise ``error``
        (default: :class:`WorldUnavailable`), once."""
        if not callable(getattr(self.world, method, None)):
            raise AttributeError(f"{type(self.world).__name__} has no method {method!r}")
        if error is None:
            make: Callable[[], BaseException] = lambda: WorldUnavailable(f"injected: {method} failed once")  # noqa: E731
        elif isinstance(error, BaseException):
            make = lambda: error  # noqa: E731
        else:
            make = error
        with self._lock:
            self._faults.append(_Fault(method, call, make, when))
            if method not in self._wrapped:
                self._wrap(method)

    def _wrap(self, method: str) -> None:
        original = getattr(self.world, method)
        own = vars(self.world).get(method)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            error = self._due(method, args, kwargs)
            if error is not None:
                raise error
            return original(*args, **kwargs)

        setattr(self.world, method, wrapper)
        self._wrapped[method] = own

    def _due(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> BaseException | None:
        with self._lock:
            if self._off:
                return None
            for fault in self._faults:
                if fault.method != method or fault.done:
                    continue
                if fault.when is not None and not fault.when(*args, **kwargs):
                    continue
                fault.seen += 1
                if fault.seen == fault.call:
                    fault.done = True
                    self.fired.append((method, fault.call))
                    return fault.error()
        return None

    @contextmanager
    def off(self) -> Iterator[None]:
        """Calls made inside pass straight through and count towards no fault (a test's own look at the World)."""
        with self._lock:
            self._off += 1
        try:
            yield
        finally:
            with self._lock:
                self._off -= 1

    @property
    def pending(self) -> list[tuple[str, int]]:
        """The faults that have not fired yet."""
        with self._lock:
            return [(f.method, f.call) for f in self._faults if not f.done]

    def restore(self) -> None:
        """Put the World's own methods back (faults not fired are dropped)."""
        with self._lock:
            for method, own in self._wrapped.items():
                if own is None:
                    delattr(self.world, method)
                else:
                    setattr(self.world, method, own)
            self._wrapped.clear()
            self._faults.clear()
