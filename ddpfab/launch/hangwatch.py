"""``ddpfab run --hang-timeout``: when no rank has printed for that long, the doctor runs by itself.

Once per quiet spell (a line from any rank starts a new one), in a thread of its own so the run's
monitor keeps its heartbeats and its deadlines: the doctor asks every node over the run's own
connections (:func:`ddpfab.health.doctor.over`), prints its verdict and the grouped stacks, and
saves its record in the run's dir. With ``--on-hang stop`` a hang verdict (a rank stopped, gone or
elsewhere, or every rank waiting without using CPU) asks the monitor to end the job at once; ranks
that use CPU are busy, not hung, and the run goes on.

In one quiet spell the doctor looks again every timeout (a busy rank may hang later), so the grouped
stacks are printed with a hang verdict only, and once per spell while the ranks stay where they
were: a look that finds no hang prints its verdict and its record's path (the stacks are in the
record), a later look that finds the same places says so.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from ddpfab.health import doctor
from ddpfab.optionnames import option
from ddpfab.planning.plan import Plan

#: The run's exit code when ``--on-hang stop`` ended a hung job (as timeout(1) reports a command it
#: ended): the exit-code table in ddpfab/cli/errors.py.
EXIT_HUNG = 124


class HangWatch:
    """Call :meth:`tick` from the monitor's idle loop; :attr:`stop_now` is set when the job must end."""

    def __init__(self, plan: Plan, conns: dict, run_dir: Path, note: Callable[[str], None]):
        self.plan, self.conns, self.run_dir, self.note = plan, conns, run_dir, note
        self.timeout = plan.hang_timeout
        self.stop_on_hang = plan.on_hang == "stop"
        self.stop_now = threading.Event()
        self.verdict: doctor.Verdict | None = None
        #: the last hang verdict reported while the job ran on (``--on-hang report``), and when
        #: (monotonic): the run's closing line tells it when the job then fails
        self.reported: tuple[float, doctor.Verdict] | None = None
        self._spell: float | None = None  # the quiet spell (its start) last looked at
        self._next = 0.0  # when the same spell is looked at again (monotonic)
        self._thread: threading.Thread | None = None
        self._shown: tuple | None = None  # (spell, places) of the stacks printed last

    def tick(self, quiet_since: float, now: float) -> None:
        """The ranks have been quiet since *quiet_since* (monotonic): past the timeout, start the
        doctor; in the same quiet spell again every timeout (a busy rank may hang later)."""
        if self.timeout <= 0 or now - quiet_since < self.timeout or self.stop_now.is_set():
            return
        if (self._spell == quiet_since and now < self._next) or (self._thread is not None and self._thread.is_alive()):
            return
        self._spell, self._next = quiet_since, now + self.timeout
        self._thread = threading.Thread(target=self._diagnose, args=(now - quiet_since, quiet_since),
                                        name="ddpfab-hang", daemon=True)
        self._thread.start()

    def _diagnose(self, quiet_s: float, spell: float | None = None) -> None:
        timeout = int(self.timeout) if float(self.timeout).is_integer() else self.timeout  # as given: 10, not 10.0
        self.note(f"hang watch: no rank has printed for {quiet_s:.0f} s ({option('hang_timeout', timeout)}); "
                  "asking every node where its ranks are")
        try:
            verdict, path = doctor.diagnose(self.plan, doctor.over(self.conns), self.run_dir)
        except Exception as exc:  # noqa: BLE001 - the watch must never break the run it watches
            self.note(f"hang watch: the doctor could not finish ({type(exc).__name__}: {exc}); still waiting")
            return
        self._report(verdict, path, spell)
        if not verdict.hung:
            self.reported = None  # a later look that finds none: what an earlier one found has passed
            self.note("no hang found (no rank stands out, and the ranks use CPU or none runs yet); still waiting")
        elif self.stop_on_hang:
            self.verdict = verdict
            self.stop_now.set()
        else:
            self.reported = (time.monotonic(), verdict)
            self.note(f"still waiting ({option('on_hang', 'stop')} would end it now; `ddpfab stop {self.plan.run_id}` "
                      "ends it)")

    def standing(self, last_progress: float) -> doctor.Verdict | None:
        """The reported hang verdict when it still stands: it named ranks as the odd ones out and
        no rank has printed a line of its own since (*last_progress*, monotonic: a traceback of a
        rank whose collective timed out is none). A job that fails after a hang fails of it, its
        ranks' timeouts only follow; one that moved on after the report did not hang there."""
        if self.reported is None:
            return None
        at, verdict = self.reported
        return verdict if verdict.odd and last_progress <= at else None

    def _report(self, verdict: doctor.Verdict, path: Path | None, spell: float | None) -> None:
        """The verdict's lines; with a hang verdict the grouped stacks too, unless this quiet spell
        has printed them already for the same places (then a line says so)."""
        for line in verdict.lines:
            self.note(("hang: " if verdict.hung else "doctor: ") + line)
        if not verdict.hung:
            self.note(f"doctor's record (every rank's stack): {path}")
            return
        places = tuple((g["site"], tuple((r["node"], r["rank"], r["pid"]) for r in g["ranks"]))
                       for g in verdict.groups)
        if self._shown == (spell, places):
            self.note(f"the ranks are where they were at the last look (their stacks above); doctor's record: {path}")
            return
        self._shown = (spell, places)
        for line in doctor.render(verdict)[len(verdict.lines):]:
            self.note(line)
        self.note(f"doctor's record: {path}")
