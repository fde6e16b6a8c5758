"""Jobs on the cluster, by run id: ``ps``, ``stop``, ``attach``, ``logs``; how each ends (a run's
state, attach's exit code by run's policy, logs' report).

Everything here reads the records the node supervisor keeps under each node's run dir
(``agent.json``: pids; ``exit_code``/``result.json``: the end), and signals only the supervisor
named there, after checking that the pid still belongs to that run; a job whose supervisor is gone
is found by the ``DDPFAB_JOB=<run id>`` marker in its processes' environment. Never a name
pattern: two jobs, or two users, may share a host.
"""

from __future__ import annotations

import base64
import io
import os
import shlex
import tarfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ddpfab.remote import nodeprogram as nodeprog
from ddpfab.hostlist import FOLD_ABOVE, compact
from ddpfab.launch import story
from ddpfab.launch.cause import RANK_TAG, CauseReader
from ddpfab.launch.debugger import WAITS
from ddpfab.launch.execute import (STOP_GRACE_S, NodeOutcome, blame_outcomes, exit_race_of, exit_race_summary,
                                   found_signatures, node_cause, ranked, result_record, seen_text,
                                   stopped_from_outside_line, supervisor_text, verdict_hints)
from ddpfab.launch.hangwatch import EXIT_HUNG, HangWatch
from ddpfab.launch.tmuxrun import recorded_socket
from ddpfab.optionnames import option
from ddpfab.planning.plan import is_run_id
from ddpfab.problems import NodeError, Problem
from ddpfab.remote import ssh, streams
from ddpfab.results import GroupResult


#: A job's states on a node, as the node's ``ps`` names them (:func:`ddpfab.node.ops.op_ps`).
NODE_STATES = ("running", "exited", "stopped", "dead", "cancelled")


def ps_record(rec) -> dict:
    """One run record from a node's ``ps`` reply, validated (records are data): its run id names a
    local directory (the run's manifest), so it must be a run id, not a path."""
    if not isinstance(rec, dict) or not is_run_id(rec.get("run_id")) or rec.get("state") not in NODE_STATES \
            or not _is_int_or_none(rec.get("exit_code")):
        raise ValueError(f"malformed run record {nodeprog.printable(repr(rec))[:200]}")
    started, why = rec.get("started"), rec.get("stopped")
    out = {"run_id": rec["run_id"], "state": rec["state"], "exit_code": rec["exit_code"],
           "started": float(started) if isinstance(started, (int, float)) and not isinstance(started, bool) else None}
    if isinstance(why, str) and why:  # what stopped it, in its supervisor's words
        out["stopped"] = nodeprog.printable(why)[:200]
    if rec.get("tmux") is True:  # a `run --tmux` window's launch: no supervisor, its exit code is local
        out["tmux"] = True
    return out


def node_problem(name: str, exc: BaseException, doing: str = "list jobs", check: str = "ps") -> Problem:
    """A node's failure to answer ``ps``, ``stop`` or ``logs`` as a problem record: an SSH or node
    error is one already; anything else (a reply the node program should never give) is named by
    its text, as a failure to do *doing* (the problem's *check*)."""
    if isinstance(exc, NodeError):
        return Problem(name, exc.kind, found=exc.found, text=str(exc))
    found = f"cannot {doing}: {exc}"
    return Problem(name, check, found=found, text=f"host {name}: {found}")


def list_runs(answers: dict[str, tuple[float, list[dict]]], local: Callable[[str], dict]) -> list[dict]:
    """``ps``'s rows from the nodes' answers (node -> (its clock now, its run records)): one per run
    id, with each node's state, the run's state and age, and from *local(run_id)* (the local record,
    {} when there is none) whether it is an attempt of a run with restarts, or has attempts, and
    a ``--tmux`` run's server (``tmux_socket``)."""
    runs: dict[str, dict] = {}
    for name, (now, records) in answers.items():
        for rec in records:
            run = runs.setdefault(rec["run_id"], {"run_id": rec["run_id"], "nodes": {}, "started": rec["started"],
                                                  "now": now})
            run["nodes"][name] = {"state": rec["state"], "exit_code": rec["exit_code"],
                                  **({"stopped": rec["stopped"]} if "stopped" in rec else {})}
            if rec.get("tmux"):
                run["tmux"] = True
    rows = sorted(runs.values(), key=lambda r: r["run_id"])
    for r in rows:
        record = local(r["run_id"])
        if record.get("recovery_of"):  # an attempt of a run with restarts
            r["attempt_of"], r["restart"] = record["recovery_of"], record.get("restart")
        elif record.get("recovery"):
            r["attempts"] = len(record["recovery"].get("attempts") or [])
            r["recovery_state"] = record["recovery"].get("state")
        if r.get("tmux") and recorded_socket(record):
            r["tmux_socket"] = recorded_socket(record)
        r["state"] = run_state(r["nodes"])
        r["age_s"] = round(r["now"] - (r["started"] or r["now"]), 1)
    return rows


def run_state(nodes: dict[str, dict]) -> str:
    """A run's state from its nodes' (``{"state", "exit_code"}`` each): running while any node's
    job runs, dead where a supervisor vanished; stopped when something stopped it (``ddpfab
    stop``) and no node's job failed on its own (a node that ended by itself before the stop
    still counts as stopped); cancelled when every node's ``--wait`` was; else exited."""
    states = {s["state"] for s in nodes.values()}
    if "running" in states or "dead" in states:
        return "running" if "running" in states else "dead"
    if states == {"cancelled"}:
        return "cancelled"
    failed = any(s["state"] == "exited" and s["exit_code"] != 0 for s in nodes.values())
    return "stopped" if "stopped" in states and not failed else "exited"


def node_state_text(state: dict) -> str:
    """How ``ps`` shows one node's job: its state, with its exit code when it ended by itself
    (``exited(1)``); a stopped job's code is the stop's, not the job's, so none."""
    code = state["exit_code"]
    return state["state"] + (f"({code})" if code is not None and state["state"] != "stopped" else "")


def _is_int_or_none(value) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool))


def node_run_dir(node_name: str, manifest: dict | None, run_id: str) -> str:
    if manifest:
        for n in manifest["plan"]["nodes"]:
            if n["name"] == node_name:
                return n["remote_dir"]
    return f".ddpfab/runs/{run_id}"  # relative: SSH sessions start in the user's home


def grouped(outcomes: dict[str, str]) -> list[str]:
    """``name: text`` per node (in the given order), or beyond FOLD_ABOVE nodes one line per
    distinct text naming its nodes compactly: 128 nodes' identical answers are one line, not 128."""
    if len(outcomes) <= FOLD_ABOVE:
        return [f"{name}: {text}" for name, text in outcomes.items()]
    by_text: dict[str, list[str]] = {}
    for name, text in outcomes.items():
        by_text.setdefault(text, []).append(name)
    return [f"{compact(names)}: {text}" for text, names in by_text.items()]


def line_count(text: str) -> int:
    """Lines in *text*, a last one without its newline included."""
    return text.count("\n") + (1 if text and not text.endswith("\n") else 0)


def logs_report(run_id: str, dest: Path, fetched: dict[str, tuple[Path, int, str]], nodes: int) -> list[str]:
    """What ``ddpfab logs`` prints once the copies are done: each node's file and its number of
    lines (``node1: runs/ID/node1.remote.log (42 lines)``; *fetched*: node -> (path, lines, what
    else came, e.g. its per-rank logs)), beyond FOLD_ABOVE nodes one line for them all; then a
    closing line with how many of the run's *nodes* sent theirs, so a quiet job's empty files are
    never mistaken for a fetch that did nothing (none fetched: the errors alone say so)."""
    if len(fetched) > FOLD_ABOVE:  # the files' names say which node each is
        total = sum(lines for _, lines, _ in fetched.values())
        ranks = any(more for _, _, more in fetched.values())
        out = [f"{len(fetched)} nodes' output in {dest}/<node>.remote.log ({total} lines in all)"
               + (f", their per-rank logs in {dest / 'ranks'}/<node>/" if ranks else "")]
    else:
        out = [f"{name}: {path} ({lines} line{'' if lines == 1 else 's'}){f', {more}' if more else ''}"
               for name, (path, lines, more) in fetched.items()]
    if not fetched:  # the errors say it all: no closing line naming a dir that was never made
        return out
    missing = f"; {nodes - len(fetched)} could not be fetched (above)" if len(fetched) < nodes else ""
    whose = "node's" if nodes == 1 else "nodes'"
    out.append(f"logs of run {run_id}: {len(fetched)} of {nodes} {whose} output in {dest}{missing}")
    return out


def follow_all(plan, cluster, conns, printer, hang: HangWatch | None = None,
               readers: dict[str, CauseReader] | None = None) -> dict[str, int]:
    """Every node's output of *plan*'s job until it ends there; node -> its exit code (255: the
    follow broke). Each line goes through the node's :class:`~ddpfab.launch.cause.CauseReader`
    (in *readers*, by node: what the job's end is told from), and is folded as run folds it. With
    *hang* (a detached job's hang watch: nobody else watches it) the ranks' quiet spells go to the
    watch, and its ``--on-hang stop`` ends the job on every node."""
    last_rank_line = [0.0]  # monotonic; 0: no rank has printed yet (the watch is armed after one)
    readers = {} if readers is None else readers
    debugged = threading.Event()  # a rank of a --pdb job waits in pdb: its peers wait for it, not hung

    def follow(node) -> int:
        n = plan.node(node.name)
        chan = conns[node.name].transport.open_session(timeout=30)
        chan.set_combine_stderr(True)
        chan.exec_command(nodeprog.command(node, "ddpfab-node"))
        chan.sendall(nodeprog.setup_head(node) + nodeprog.stdin_for({"id": 1, "op": "follow", "dir": n.remote_dir}))
        reader = readers.setdefault(node.name, CauseReader())
        for line in streams.lines(chan.recv):
            tag = RANK_TAG.match(line)
            if tag:
                last_rank_line[0] = time.monotonic()
                if hang is not None and not debugged.is_set() and WAITS.match(line[tag.end():]):
                    debugged.set()
                    printer.note("a rank waits in pdb (`ddpfab debug` drives it): the hang watch is off while "
                                 "this terminal follows the job")
            printer.line(node.name, line, *reader.feed(line))
            if printer.closed:  # `| head` had enough: stop following; the job goes on
                chan.close()
                return 0
        printer.flush(node.name)
        return chan.recv_exit_status()

    nodes = [n for n in cluster.nodes if n.name in {p.name for p in plan.nodes}]
    # a follow lasts as long as the job: every node at once (on connections already open: no
    # handshakes), else the nodes beyond the fan-out window would wait for the job's end unseen
    if hang is None:
        results = ssh.parallel(nodes, follow, window=len(nodes))
    else:
        results = _watched(lambda: ssh.parallel(nodes, follow, window=len(nodes)), hang, last_rank_line,
                           lambda: stop_everywhere(plan, nodes, conns), printer, debugged)
    return {k: (v if isinstance(v, int) else 255) for k, v in results.items()}


def _watched(follow_all: Callable[[], GroupResult], hang: HangWatch, last_rank_line: list[float],
             stop: Callable[[], None], printer, debugged: threading.Event | None = None) -> GroupResult:
    """``follow_all()`` in a thread of its own while this one ticks *hang* with the ranks' quiet
    spell, as run's monitor does; on a hang verdict with ``--on-hang stop``, *stop* once. Once
    *debugged* is set (a rank waits in pdb, driven from another terminal) no hang is looked for."""
    done: list[GroupResult | BaseException] = []

    def run() -> None:
        try:
            done.append(follow_all())
        except BaseException as exc:  # noqa: BLE001 - raised again below, in the caller's thread
            done.append(exc)

    thread = threading.Thread(target=run, name="ddpfab-follow", daemon=True)
    thread.start()
    stopped = False
    while thread.is_alive():
        thread.join(timeout=0.2)
        if last_rank_line[0] and not stopped and not (debugged is not None and debugged.is_set()):
            hang.tick(last_rank_line[0], time.monotonic())
            if hang.stop_now.is_set() and hang.verdict is not None:
                stopped = True
                printer.note(f"{option('on_hang', 'stop')}: stopping the job on every node")
                stop()
    if isinstance(done[0], BaseException):  # never an empty result read as "every node exited 0"
        raise done[0]
    return done[0]


def stop_everywhere(plan, nodes, conns) -> None:
    """End *plan*'s job on every node of *nodes* over the open *conns* (as ``ddpfab stop`` does);
    each node's follow then ends with the job."""
    ssh.parallel(nodes, lambda n: nodeprog.stop(conns[n.name], n, plan.node(n.name).remote_dir, STOP_GRACE_S,
                                                timeout=30), window=len(nodes))


def ended_outcomes(plan, conns, codes: dict[str, int], readers: dict[str, CauseReader]) -> dict[str, NodeOutcome]:
    """Each followed node's end as run records it: its exit code, its supervisor's result record
    (read for a node whose job failed: the failed worker, when it failed, an exit race) and its
    cause, from the one classifier (:mod:`ddpfab.launch.cause`)."""
    outcomes = {}
    for name, code in codes.items():
        node = plan.node(name)
        record = result_record(conns[name], node) if code != 0 and name in conns else None
        reader = readers.get(name) or CauseReader()
        out = NodeOutcome(name, node.node_rank, exit_code=code, remote=record, causes=reader,
                          stopped_by_ddpfab=bool((record or {}).get("stopped")) and not (record or {}).get("failed_at"))
        out.cause = ranked(plan, node, node_cause(reader, record))
        outcomes[name] = out
    return outcomes


def exit_races_of(outcomes: dict[str, NodeOutcome], guard: str) -> dict[str, dict]:
    """The nodes whose job failed only after every rank of theirs had finished its work, from the
    records read (:func:`ended_outcomes`), as run reads them (none with the exit guard off)."""
    if guard == "off":
        return {}
    return {n: race for n, o in outcomes.items() if (race := exit_race_of(o.exit_code, o.remote))}


def attach_story(plan, outcomes: dict[str, NodeOutcome],
                 own_only: bool = False) -> tuple[str, list[str], list[str]] | None:
    """For a job that failed: run's closing line (the rank that failed on its own, the victims
    counted), the line per other node and run's hints (what sends the signal that killed it); None
    when no node failed on its own account (with *own_only*, a job stopped from outside: also when
    only victims of the stop failed)."""
    addresses = {n.name: n.data_addr for n in plan.nodes}
    verdict = blame_outcomes(outcomes, addresses, None, {n.name: n.nproc for n in plan.nodes})
    if verdict.node is None or (own_only and not verdict.own):
        return None
    out = outcomes[verdict.node]
    fallback = supervisor_text(out.remote)
    found = found_signatures(outcomes)
    return (story.closing_line(verdict, out, fallback, addresses, outcomes) + seen_text(found),
            story.other_nodes(outcomes, verdict.node, addresses), verdict_hints(verdict, out, found))


def attach_end(codes: dict[str, int], races: dict[str, dict], hung: list[str] | None = None,
               failed_story: str | None = None, outside: dict[str, int] | None = None,
               cancelled: bool = False) -> tuple[int, str, bool]:
    """How ``attach`` ends, by run's exit-code policy (ddpfab/cli/errors.py): (its exit code, the
    closing line after ``run RUN_ID ended: ``, whether the exit-race warning goes with it).
    *hung*: the doctor's verdict when the hang watch stopped the job (``--on-hang stop``): 124
    (:data:`ddpfab.launch.hangwatch.EXIT_HUNG`), whatever the nodes' jobs exited with once ended;
    else the first failing node's code, 0 when the only failures are ranks that aborted at exit
    after finishing their work (*races*). *outside*: node -> the signal its supervisor was stopped
    by from outside (``ddpfab stop``): with no failure of a rank's own, 128 + that signal, as run
    ends (*cancelled*: they were still waiting for GPUs)."""
    if hung:
        return (EXIT_HUNG, f"hung: {'; '.join(hung)}; the job was stopped on every node "
                           f"({option('on_hang', 'stop')})", False)
    if outside and not failed_story:
        return 128 + next(iter(outside.values())), stopped_from_outside_line(outside, cancelled), False
    failed = {n: c for n, c in codes.items() if c != 0 and n not in races}
    if races and not failed:  # the work is done
        return 0, exit_race_summary(races), True
    if failed:
        named = ", ".join(f"{n} (exit code {c})" for n, c in failed.items())
        return next(iter(failed.values())), failed_story or f"failed on {named}", False
    return 0, "all nodes exited 0", False


#: The exit codes the line that reads a node's output gives when the file is not there, and when
#: its run dir is not there either (the shell line's own answers, not a message read back).
_NO_OUTPUT, _NO_RUN = 3, 4


def fetch_node_log(conn, node, manifest: dict | None, run_id: str, dest: Path, ranks: bool = False) -> tuple[Path, int, int]:
    """Copy *node*'s output of run *run_id* (its run dir's ``output.log``; *manifest*: the run's
    record, None when there is none here) to ``DEST/NODE.remote.log``, and with *ranks* torchrun's
    per-rank logs to ``DEST/ranks/NODE/``; returns (the copy, its lines, the per-rank files). Of
    a ``run --tmux`` run, whose output went to its windows, the per-rank logs are the copy.

    Raises:
        NodeError: the run never had a run dir on the node (kind ``logs.no-run``), its run dir
            has no output (``logs.missing``), or the output cannot be read (``logs.unreadable``).
    """
    remote = node_run_dir(node.name, manifest, run_id)
    if manifest is not None and isinstance(manifest.get("tmux"), str):
        # a `run --tmux` run: no supervisor relayed its output (it went to the windows); torchrun's
        # per-rank logs on the node are what there is
        ranks_dir = dest / "ranks" / node.name
        count = fetch_rank_logs(conn, node, remote, ranks_dir)
        lines = sum(line_count(p.read_text(errors="replace")) for p in ranks_dir.rglob("*") if p.is_file())
        return ranks_dir, lines, count
    log = shlex.quote(f"{remote}/output.log")
    res = ssh.run(conn, node.name, f"if [ -e {log} ]; then cat {log}; elif [ -d {shlex.quote(remote)} ]; "
                                   f"then exit {_NO_OUTPUT}; else exit {_NO_RUN}; fi", timeout=60)
    if res.exit_code == _NO_RUN:
        found = f"no run {run_id} there (no run dir {remote})"
        raise NodeError(node.name, f"host {node.name}: {found}", "logs.no-run", found=found)
    if res.exit_code == _NO_OUTPUT:
        found = (f"no output of run {run_id} there ({remote}/output.log is missing): it did not run on this "
                 "node, or its run dir was removed")
        raise NodeError(node.name, f"host {node.name}: {found}", "logs.missing", found=found)
    if res.exit_code != 0:
        found = res.stderr.strip() or f"cannot read {remote}/output.log (exit {res.exit_code})"
        raise NodeError(node.name, f"host {node.name}: {found}", "logs.unreadable", found=found)
    dest.mkdir(parents=True, exist_ok=True, mode=0o700)  # only once there is output: no empty record dir
    path = dest / f"{node.name}.remote.log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(res.stdout)
    count = fetch_rank_logs(conn, node, remote, dest / "ranks" / node.name) if ranks else 0
    return path, line_count(res.stdout), count


def fetch_rank_logs(conn, node, remote_dir: str, dest: Path) -> int:
    """Copy torchrun's per-rank logs of a run (``--log-dir``: ``<id>_<x>/attempt_<n>/<local
    rank>/{stdout,stderr}.log``) from *node* into *dest*; returns the number of files."""
    got = nodeprog.call(conn, node, {"op": "rank_logs", "dir": remote_dir}, timeout=120)[0].value(node.name)
    dest.mkdir(parents=True, exist_ok=True, mode=0o700)
    with tarfile.open(fileobj=io.BytesIO(base64.b64decode(str(got["tar_gz"]))), mode="r:gz") as tar:
        members = [m for m in tar.getmembers() if m.isfile() or m.isdir()]  # no links, devices
        tar.extractall(dest, members=members, filter="data")
        return sum(1 for m in members if m.isfile())
