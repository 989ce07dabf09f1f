"""Resident memory of a process tree, read from ``/proc`` (Linux): a worker's main process and its pool children."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path


def children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def rss_kib(pid: int) -> int:
    """VmRSS of ``pid`` in KiB (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree(pid: int) -> dict[int, int]:
    """RSS (KiB) of ``pid`` and of every descendant, by pid."""
    out: dict[int, int] = {}
    todo = [pid]
    while todo:
        p = todo.pop()
        out[p] = rss_kib(p)
        todo += children(p)
    return out


@dataclass
class Sampler:
    """Samples the RSS of process trees every ``interval`` seconds in a thread, until stopped.

    ``samples[name]`` holds ``(seconds since start, largest process's RSS, whole tree's RSS)`` in KiB."""

    roots: dict[str, int]
    interval: float = 5.0
    samples: dict[str, list[tuple[float, int, int]]] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Sampler:
        import time

        began = time.monotonic()

        def loop() -> None:
            while True:
                for name, pid in self.roots.items():
                    sizes = tree(pid) if pid != os.getpid() else {pid: rss_kib(pid)}
                    self.samples.setdefault(name, []).append(
                        (time.monotonic() - began, max(sizes.values(), default=0), sum(sizes.values()))
                    )
                if self._stop.wait(self.interval):
                    return

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def summary(self, name: str, settle: float = 0.0) -> str:
        """``first → peak → last`` of the tree's RSS in MiB (first: the first sample ``settle`` seconds or more into
        the sampling, when warm-up growth is over), and the largest single process's peak."""
        s = self.samples.get(name) or [(0.0, 0, 0)]
        first = next((x for x in s if x[0] >= settle), s[0])
        peak_one = max(x[1] for x in s)
        return (
            f"{first[2] / 1024:.0f} → peak {max(x[2] for x in s) / 1024:.0f} → {s[-1][2] / 1024:.0f} MiB"
            f" (largest process peak {peak_one / 1024:.0f} MiB)"
        )
