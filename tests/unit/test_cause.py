"""The failure summary's cause (ddpfab.launch.cause): the failing rank's first exception line, read from a
node's output as data, and the closing line that quotes it (ddpfab.launch.execute.ranked)."""

from __future__ import annotations

from ddpfab.hosts.inventory import Inventory, Node
from ddpfab.launch import execute as launch
from ddpfab.launch.cause import MAX_LINE, Cause, CauseKind, CauseReader, Fold
from ddpfab.planning.plan import Facts, RunOptions, make_plan


def root_cause(host: str, rank: int, local: int, error_file: str, traceback: str) -> str:
    """torchrun 2.x's "Root Cause" block (torch/distributed/elastic/multiprocessing/errors)."""
    return f"""\
Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_12:00:00
  host      : {host}
  rank      : {rank} (local_rank: {local})
  exitcode  : 1 (pid: 123)
  error_file: {error_file}
  traceback : {traceback}
============================================================"""


#: What torchrun prints on a node whose local rank 1 (global 3) raised, with --tee=3.
TORCHRUN_OUTPUT = """\
[default0]:step 0
[default1]:[rank3]: Traceback (most recent call last):
[default1]:[rank3]:   File "/w/t.py", line 3, in <module>
[default1]:[rank3]:     raise RuntimeError("boom")
[default1]:[rank3]: RuntimeError: boom
[default1]:[rank3]: During handling of the above exception, another exception occurred:
E1201 12:00:00.000000 1234 api.py:1] failed (exitcode: 1) local_rank: 1 (pid: 123) of binary: /usr/bin/python3
Traceback (most recent call last):
  File "/x/torch/distributed/run.py", line 1, in <module>
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
t.py FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
""" + root_cause("node2", 3, 1, "<N/A>", "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html")

#: The Root Cause block of a script whose entry point is decorated with @record (an error file).
RECORDED = root_cause("node1", 0, 0, "/r/.ddpfab/runs/x/torchrun/none_x/attempt_0/0/error.json", """\
Traceback (most recent call last):
    File "/w/t.py", line 9, in main
      raise ValueError("bad shape (3, 4)")
  ValueError: bad shape (3, 4)
  """)


def core(cause: Cause | None) -> tuple | None:
    """The cause's rank, local rank, exit code, exception line and kind (its traceback aside)."""
    return None if cause is None else (cause.rank, cause.local_rank, cause.exit_code, cause.exception, cause.kind)


def read(text: str) -> CauseReader:
    reader = CauseReader()
    for line in text.splitlines():
        reader.feed(line)
    return reader


def test_the_root_cause_rank_and_its_own_exception_line():
    cause = read(TORCHRUN_OUTPUT).cause()
    assert core(cause) == (3, 1, 1, "RuntimeError: boom", CauseKind.EXCEPTION)
    assert cause.text() == "rank 3 (local rank 1), exit code 1: RuntimeError: boom"


def test_torchruns_own_traceback_is_never_the_ranks_cause():
    untagged = "\n".join(ln for ln in TORCHRUN_OUTPUT.splitlines() if not ln.startswith("[default"))
    cause = read(untagged).cause()
    assert core(cause) == (3, 1, 1, None, CauseKind.EXIT)
    assert "ChildFailedError" not in cause.text()


def test_the_error_files_traceback_in_the_root_cause_block():
    assert core(read(RECORDED).cause()) == (0, 0, 1, "ValueError: bad shape (3, 4)", CauseKind.EXCEPTION)


def test_without_a_root_cause_the_first_rank_that_raised():
    lines = ["[default0]:Traceback (most recent call last):", '[default0]:  File "t.py", line 1',
             "[default1]:Traceback (most recent call last):", '[default1]:  File "t.py", line 1',
             "[default1]:    x = 1 / 0", "[default1]:ZeroDivisionError: division by zero",
             "[default0]:KeyError: 'lr'"]
    assert core(read("\n".join(lines)).cause()) == (None, 1, None, "ZeroDivisionError: division by zero", CauseKind.EXCEPTION)
    assert read("[default0]:loss 0.1\nplain line").cause() is None


def test_what_a_rank_prints_is_bounded_and_printable():
    long = "x" * 5000
    cause = read(f"[default0]:Traceback (most recent call last):\n[default0]:  File \"t.py\", line 1\n"
                 f"[default0]:RuntimeError: {long}\x1b[31m").cause()
    assert len(cause.exception) == MAX_LINE and cause.exception.startswith("RuntimeError: xxx")
    assert "\x1b" not in cause.exception
    # not an exception's shape: nothing is quoted
    assert read("[default0]:Traceback (most recent call last):\n[default0]:  File \"t.py\", line 1\n"
                "[default0]:$(rm -rf /) oops").cause() is None


def test_the_closing_line_names_node_rank_exit_code_and_exception():
    c = Inventory("inv.yml", "all", (Node("node1", "10.0.0.1", nproc=2), Node("node2", "10.0.0.2", nproc=2)))
    plan = make_plan(c, RunOptions("t.py"), Facts({"node1": "10.0.0.1", "node2": "10.0.0.2"}, 29500, "/w"))
    node2 = plan.node("node2")
    # a rank's own lines only (the supervisor stopped torchrun before its Root Cause): rank = offset + local
    assert launch.ranked(plan, node2, Cause(None, 1, None, "RuntimeError: boom")).text() == \
        "rank 3 (local rank 1): RuntimeError: boom"
    assert launch.ranked(plan, node2, None) is None
    out = launch.NodeOutcome("node2", 1, exit_code=1)
    for line in TORCHRUN_OUTPUT.splitlines():
        out.causes.feed(line)
    out.cause = out.causes.cause()
    assert out.to_dict()["cause"] == {"rank": 3, "local_rank": 1, "exit_code": 1, "exception": "RuntimeError: boom",
                                      "kind": "exception", "signal": None, "peer": None}


def test_a_line_the_rank_printed_before_raising_may_come_inside_its_traceback():
    """The rank's stdout and stderr are two streams: the print just before the raise can reach
    torchrun's tee after the traceback's header (seen on the lab under load), even one shaped like
    an exception line; before the first frame it is not the end of the traceback, and the
    exception line after the frames is still the cause. After a frame too (seen in CI: the print
    came between the frame and its code line), as long as the exception line names a class; a
    class of a function's own is an exception too."""
    lines = ["[default1]:Traceback (most recent call last):", "[default1]:rank 3 failing on purpose",
             '[default1]:  File "report.py", line 34, in <module>',
             '[default1]:    raise RuntimeError(f"rank {rank} failing on purpose")',
             "[default1]:RuntimeError: rank 3 failing on purpose"]
    assert core(read("\n".join(lines)).cause()) == (None, 1, None, "RuntimeError: rank 3 failing on purpose", CauseKind.EXCEPTION)
    shaped = [lines[0], "[default1]:loss: 0.5", *lines[2:]]
    cause = ("RuntimeError: rank 3 failing on purpose", CauseKind.EXCEPTION)
    assert core(read("\n".join(shaped)).cause())[3:] == cause
    after_frame = [*lines[:3], lines[1], *lines[3:]]
    reader = CauseReader()
    folds = [reader.feed(line)[0] for line in after_frame]
    assert folds[3] is Fold.SHOW and folds[-1] is Fold.RELEASE
    assert core(reader.cause()) == (None, 1, None, "RuntimeError: rank 3 failing on purpose", CauseKind.EXCEPTION)
    cut = ["[default0]:Traceback (most recent call last):", '[default0]:  File "t.py", line 1',
           "[default0]:step 1 of 9", "[default0]:loss: 0.5"]
    assert read("\n".join(cut)).cause() is None
    # after such a line, an exception class by its name: numpy's private one too; not a capitalised print
    numpy_oom = [*lines[:3], lines[1], lines[3], "[default1]:numpy.core._exceptions._ArrayMemoryError: Unable to "
                 "allocate 8.00 GiB"]
    assert read("\n".join(numpy_oom)).cause().exception.startswith("numpy.core._exceptions._ArrayMemoryError")
    printed = [cut[0], cut[1], "[default0]:step 1 of 9", "[default0]:Loss: 0.5"]
    assert read("\n".join(printed)).cause() is None
    cut_long = [*cut, "[default0]:step 2 of 9", "[default0]:step 3 of 9", "[default0]:Epoch: 4"]
    assert read("\n".join(cut_long)).cause() is None  # past INTERLEAVED lines the traceback had ended
    local = [lines[0], '[default1]:  File "t.py", line 1', "[default1]:main.<locals>.ConfigError: bad lr", "[default1]:x"]
    assert core(read("\n".join(local)).cause()) == (None, 1, None, "main.<locals>.ConfigError: bad lr", CauseKind.EXCEPTION)


def test_a_line_of_stdout_between_the_frames_of_a_marked_traceback_is_not_its_end():
    """As a CI run under load saw it: torch marks a rank's traceback ([rank5]:), and what the rank
    printed before raising came between the raise's code line and the exception line."""
    lines = ["[default1]:[rank5]: Traceback (most recent call last):",
             '[default1]:[rank5]:   File "crash_after_collective.py", line 59, in <module>',
             '[default1]:[rank5]:     raise ValueError(f"bad batch shape (3, 4) on rank {rank}")',
             "[default1]:rank 5 step 0 ok",
             "[default1]:[rank5]: ValueError: bad batch shape (3, 4) on rank 5"]
    reader = CauseReader()
    folds = [reader.feed(line)[0].value for line in lines]
    assert folds[3] == "show"  # printed, not held with the traceback
    assert core(reader.cause()) == (None, 1, None, "ValueError: bad batch shape (3, 4) on rank 5", CauseKind.EXCEPTION)
    unmarked = [ln.replace("[rank5]: ", "") for ln in lines]  # unmarked: the stdout line is shown as well
    reader = CauseReader()
    assert [reader.feed(line)[0].value for line in unmarked][3] == "show"
    assert core(reader.cause()) == (None, 1, None, "ValueError: bad batch shape (3, 4) on rank 5", CauseKind.EXCEPTION)


def test_a_script_python_could_not_compile_names_its_syntax_error():
    """A SyntaxError in the script is reported without a traceback header (python compiles it
    before anything runs); the closing line said only "exit code 1", then only "SyntaxError:
    invalid syntax" (a new user's pass): the place is said too."""
    lines = ["[default0]:  File \"/w/train.py\", line 3", "[default0]:    x = = 1", "[default0]:        ^",
             "[default0]:SyntaxError: invalid syntax"]
    assert core(read("\n".join(lines)).cause()) == (None, 0, None, "SyntaxError: invalid syntax (train.py, line 3)",
                                                     CauseKind.EXCEPTION)
    indented = ['[default1]:  File "/w/train.py", line 2', "[default1]:    print(1)", "[default1]:IndentationError: "
                "unexpected indent"]
    assert read("\n".join(indented)).cause().exception == "IndentationError: unexpected indent (train.py, line 2)"
    # in a module the script imports: the report's last frame is the place
    imported = ["[default0]:Traceback (most recent call last):", '[default0]:  File "/w/train.py", line 1, in <module>',
                "[default0]:    import model", '[default0]:  File "/w/model.py", line 7', "[default0]:    def f(:",
                "[default0]:          ^", "[default0]:SyntaxError: invalid syntax"]
    assert read("\n".join(imported)).cause().exception == "SyntaxError: invalid syntax (model.py, line 7)"
    assert read("\n".join(lines[:2] + ["[default0]:ValueError: x"])).cause().exception == "ValueError: x"
    assert read("[default0]:loss 0.5").cause() is None
