"""Known failure signatures in node output become one hint in the run's output and manifest."""

from __future__ import annotations

from types import SimpleNamespace

from ddpfab.health import hints
from ddpfab.launch import execute as launch


def test_the_gloo_exit_abort_line_gets_the_known_cause_and_the_fix():
    line = "[default1]:terminate called without an active exception"
    hint = hints.hint_for(line)
    assert hint is not None
    assert "190489" in hint and "ddpfab.dist.finish()" in hint and "os._exit(0)" in hint
    assert hints.hint_for("terminate called after throwing an instance of 'c10::Error'") is None
    assert hints.hint_for("step 3 mean loss 0.1") is None


def test_a_node_job_records_each_hint_once():
    job = launch._NodeJob.__new__(launch._NodeJob)  # only its line handling: no connection needed
    job.node = SimpleNamespace(name="node1")
    job.outcome = launch.NodeOutcome("node1", 0)
    lines = []
    job.printer = SimpleNamespace(line=lambda node, text: lines.append((node, text)))
    for text in ("rank 0 done", f"[default0]:{hints.EXIT_ABORT_LINE}", f"[default1]:{hints.EXIT_ABORT_LINE}"):
        job._line(text)
    assert job.outcome.lines == 3 and len(lines) == 3
    assert job.outcome.hints == [hints.EXIT_ABORT_HINT]
    assert job.outcome.to_dict()["hints"] == [hints.EXIT_ABORT_HINT]
