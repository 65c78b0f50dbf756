"""Acceptance windows: the rollback guard and the acceptance curve.

Acceptance is accepted / drafted over the EAGLE-3 steps of the served requests (the head's own drafts;
inside ``auto``, only the steps its EAGLE-3 arms drafted). A window is the latest ``window`` drafted
tokens. An update is tried only when a full window of the weights before it is known; from the moment it
is copied into the head, the steps drafted with it fill a second window, and when that is full the update
is kept unless its acceptance is more than ``max_drop`` below the window before it."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

CURVE_POINTS = 240  # acceptance points kept for /health and the playground


@dataclass
class Window:
    """The latest drafted tokens' (drafted, accepted) step counts, bounded to ``size`` drafted tokens."""

    size: int

    def __post_init__(self):
        self.steps: deque[tuple[int, int]] = deque()
        self.drafted = self.accepted = 0

    def add(self, drafted: int, accepted: int) -> None:
        self.steps.append((drafted, accepted))
        self.drafted += drafted
        self.accepted += accepted
        while self.steps and self.drafted - self.steps[0][0] >= self.size:
            d, a = self.steps.popleft()
            self.drafted -= d
            self.accepted -= a

    @property
    def full(self) -> bool:
        return self.drafted >= self.size

    @property
    def rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None


@dataclass
class Trial:
    version: int
    before: float  # the acceptance of the window before the update
    after: Window


class AcceptanceGuard:
    def __init__(self, window: int, max_drop: float):
        self.size, self.max_drop = window, max_drop
        self.recent = Window(window)  # the latest window, whatever weights drafted it
        self.trial: Trial | None = None
        self.curve: deque[tuple[float, float]] = deque(maxlen=CURVE_POINTS)  # (unix time, acceptance)
        self._since_point = 0
        self.last_before = self.last_after = None  # the acceptances of the last verdict

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self.recent.add(drafted, accepted)
        if self.trial is not None:
            self.trial.after.add(drafted, accepted)
        self._since_point += drafted
        if self._since_point >= self.size and self.recent.full:  # a point per window's worth of drafts
            self._since_point = 0
            self.curve.append((time.time(), round(self.recent.rate, 4)))

    def can_try(self) -> bool:
        """Whether an update may be tried now: none is on trial and a full window measured the weights before."""
        return self.trial is None and self.recent.full

    def start(self, version: int) -> None:
        self.trial = Trial(version, self.recent.rate, Window(self.size))

    def verdict(self) -> tuple[int, bool] | None:
        """(version, keep) once the trial's window is full, else None; the trial ends with it. A rolled back
        update's window does not count as the weights before the next one."""
        t = self.trial
        if t is None or not t.after.full:
            return None
        self.trial = None
        self.last_before, self.last_after = t.before, t.after.rate
        keep = t.after.rate >= t.before - self.max_drop
        if not keep:
            self.recent = Window(self.size)
        return t.version, keep
