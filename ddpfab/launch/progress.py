"""Progress lines while nothing else is printed (a long copy before a run).

(Ranks waiting in the rendezvous are reported by the run itself, :mod:`ddpfab.launch.execute`.)

Only for a person at a terminal: the CLI enables them when stderr is a TTY and ``-q`` was not
given, so logs and pipes stay exactly as before. Each line is a plain ``ddpfab: ...`` line on
stderr (no carriage-return tricks that garble when several things write).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

#: Seconds between two progress lines.
EVERY_S = 5.0


class Ticker:
    """Calls *status(elapsed_s)* every *every* seconds while running and prints what it returns
    (None: nothing this time). A context manager; a no-op when not *enabled*."""

    def __init__(self, status: Callable[[float], str | None], *, enabled: bool, every: float = EVERY_S,
                 stream: TextIO | None = None):
        self.status, self.enabled, self.every = status, enabled, every
        self.stream = stream or sys.stderr
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.t0 = time.monotonic()

    def __enter__(self) -> Ticker:
        if self.enabled:
            self._thread = threading.Thread(target=self._loop, name="ddpfab-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1)

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            try:
                text = self.status(time.monotonic() - self.t0)
            except Exception:  # noqa: BLE001 - a progress line must never break the work it describes
                text = None
            if text and not self._stop.is_set():
                self.stream.write(f"ddpfab: {text}\n")
                self.stream.flush()
