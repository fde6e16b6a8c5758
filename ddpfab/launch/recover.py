"""Unattended training: when a node is lost, start the job again without it, on a spare.

A thin loop over the single-attempt launch (:func:`ddpfab.launch.runner.run`): each attempt is a plan of
its own, made by the same pure planner from a new list of nodes, with a run id of its own
(``R``, ``R-r1``, ``R-r2``...), so a fresh master port, a fresh file:// init file and, when the
master was lost, a new master. What this module adds:

- which nodes the next attempt runs on (:func:`next_nodes`, pure: survivors keep their order, a
  healthy spare takes each lost node's place, or the job shrinks down to ``--min-nodes``);
- whether a failure is the node's or the script's (:func:`classify`: a node that was lost, that
  ended without an exit status, or that does not answer a fresh SSH connection now, is a node
  failure; an exit code on nodes that all still answer is the script's);
- the record: every attempt in the first attempt's manifest under ``recovery`` (nodes, ranks,
  master, why it ended, which node replaced which, how long the recovery took).

Ctrl-C (or SIGTERM) never starts another attempt: an interrupted attempt ends the run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from ddpfab.hosts import inventory
from ddpfab.hosts.inventory import Inventory, Node
from ddpfab.launch.execute import Interrupted, Printer, RunResult
from ddpfab.launch.runner import Prepared, RunError
from ddpfab.launch.runs import RunDir
from ddpfab.optionnames import option
from ddpfab.planning.plan import Plan, PlanError, RunOptions, is_run_id
from ddpfab.problems import DdpfabError, Problem
from ddpfab.remote import ssh
from ddpfab.remote.ssh import HostKeyPolicy

#: Env vars that tell the script it is a restart (beside DDPFAB_RUN_ID, the attempt's own id).
RESTART_VAR, ROOT_VAR, LINEAGE_VAR = "DDPFAB_RESTART_COUNT", "DDPFAB_ROOT_RUN_ID", "DDPFAB_RUN_LINEAGE"
#: Lines of a failed node's log kept as evidence.
EVIDENCE_LINES = 8
#: Seconds a health check waits for a node's sshd after a failure.
HEALTH_TIMEOUT_S = 5.0


class NoRecovery(DdpfabError):
    """The job cannot go on: no healthy spare and no smaller world allowed; says which node and why."""

    check = "recovery"


@dataclass(frozen=True)
class RecoveryOptions:
    """How a run recovers.

    Args:
        max_job_restarts: how many times the whole job may be started again (0: never).
        spares_group: the inventory group whose hosts stand by (None: no spares).
        retry_on: which failures start the job again: "node" (lost, unreachable or failing the
            preflight) and/or "script" (an exit code on nodes that are all healthy).
        min_nodes: with no healthy spare left, go on with fewer nodes, down to this many (None:
            never shrink; the script must cope with a smaller world).
    """

    max_job_restarts: int = 0
    spares_group: str | None = None
    retry_on: frozenset[str] = frozenset({"node"})
    min_nodes: int | None = None


#: What ``retry_on`` (``--retry-on``) may name: a lost node, or a failure of the script itself.
RETRY_KINDS = ("node", "script")


def recovery_options(opts, cluster: Inventory) -> RecoveryOptions:
    """From the run's options (:class:`ddpfab.api.Options`, or anything with ``max_job_restarts``,
    ``spares``, ``retry_on``, ``min_nodes``) and the inventory; an impossible combination is a
    PlanError."""
    if opts.max_job_restarts < 0:
        raise PlanError(f"{option('max_job_restarts')} must be >= 0, got {opts.max_job_restarts}")
    if opts.min_nodes is not None and opts.min_nodes < 1:
        raise PlanError(f"{option('min_nodes')} must be >= 1, got {opts.min_nodes}")
    groups = {n.spares_group for n in cluster.nodes if n.spares_group}
    if len(groups) > 1 and not opts.spares:
        raise PlanError(f"inventory {cluster.source}: hosts disagree on ddpfab_spares_group ({', '.join(sorted(groups))});"
                        f" set it once (in all:vars) or pass {option('spares', 'GROUP')}")
    unknown = sorted(set(opts.retry_on or ()) - set(RETRY_KINDS))
    if unknown:
        raise PlanError(f"{option('retry_on')} {unknown[0]}: expected one of {', '.join(RETRY_KINDS)}")
    spares = opts.spares or (groups.pop() if groups else None)
    retry = frozenset(opts.retry_on or ("node",))
    return RecoveryOptions(opts.max_job_restarts, spares, retry, opts.min_nodes)


def check_sizes(ropts: RecoveryOptions, nodes: int, spares: int) -> None:
    """What the job's size makes impossible, refused before anything starts (the dry run too):
    a --min-nodes above the number of nodes it starts with can never be met."""
    if ropts.min_nodes is not None and ropts.min_nodes > nodes:
        raise PlanError(f"{option('min_nodes', ropts.min_nodes)}: the job starts on {nodes} node{'s' * (nodes != 1)} "
                        f"({spares} spare{'s' * (spares != 1)} aside), so it can never shrink to {ropts.min_nodes}; "
                        f"give {option('min_nodes')} 1..{nodes}, or leave it out (never shrink)")


@dataclass(frozen=True)
class Failure:
    """Why an attempt ended, as data.

    Args:
        kind: "node", "script", "interrupted" or "none" (the attempt succeeded).
        nodes: the failed nodes (node failure), or the node the script failed on first.
        evidence: node -> what shows it (the error, the health check, the log's last lines).
        error: for a script failure, the exception line its log ends with (or the exit code).
    """

    kind: str
    nodes: tuple[str, ...] = ()
    evidence: dict[str, str] = field(default_factory=dict)
    error: str = ""

    def describe(self) -> str:
        if self.kind == "node":
            return "node failure: " + "; ".join(f"{n}: {self.evidence.get(n, '?').splitlines()[0]}"
                                                for n in self.nodes)
        if self.kind == "script":
            return f"script failure on {', '.join(self.nodes)}: {self.error}"
        return self.kind


@dataclass(frozen=True)
class NextSet:
    """The nodes of the next attempt.

    Args:
        nodes: in order (node_rank follows it; the master is the flagged one, else the first).
        replaced: failed node -> the spare that takes its place.
        dropped: failed nodes nobody replaces (the job shrank).
    """

    nodes: tuple[Node, ...]
    replaced: dict[str, str]
    dropped: tuple[str, ...]


def next_nodes(current: tuple[Node, ...], failed: set[str] | frozenset[str], spares: tuple[Node, ...],
               excluded: set[str] | frozenset[str], min_nodes: int | None) -> NextSet:
    """The next attempt's nodes: the survivors in their order, then one healthy spare per failed node.

    Args:
        current: the failed attempt's nodes, in order.
        failed: names of the nodes that failed (the ones to leave out).
        spares: the spare group's hosts, in inventory order.
        excluded: names never to use again (failed before, or found unhealthy).
        min_nodes: without enough spares, go on with at least this many nodes; None: never shrink.

    Raises NoRecovery naming the lost nodes when neither is possible. Survivors keep their
    relative order, so when the master is lost the first survivor becomes the master.
    """
    survivors = tuple(n for n in current if n.name not in failed)
    lost = [n.name for n in current if n.name in failed]
    in_use = {n.name for n in current}
    free = [s for s in spares if s.name not in excluded and s.name not in in_use and s.name not in failed]
    taken = free[:len(lost)]
    replaced = {old: new.name for old, new in zip(lost, taken, strict=False)}  # fewer free than lost: the rest is dropped
    dropped = tuple(lost[len(taken):])
    nodes = survivors + tuple(taken)
    if dropped and (min_nodes is None or len(nodes) < min_nodes):
        have = f"{len(free)} healthy spare{'s' if len(free) != 1 else ''} left"
        shrink = (f"no {option('min_nodes')} (the job does not shrink)" if min_nodes is None
                  else f"{len(nodes)} node(s) would be left, below {option('min_nodes', min_nodes)}")
        raise NoRecovery(f"lost {', '.join(dropped)}; {have}, {shrink}; add hosts to the spares group "
                         f"({option('spares')} / ddpfab_spares_group) or allow a smaller world with "
                         f"{option('min_nodes')}")
    if not nodes:
        raise NoRecovery(f"lost {', '.join(lost)}: no node left")
    return NextSet(nodes, replaced, dropped)


def attempt_id(root: str, restart: int) -> str:
    """The run id of attempt *restart*: the root id itself first, then ``<root>-r<k>``."""
    return root if restart == 0 else f"{root}-r{restart}"


def attempt_options(options: RunOptions, restart: int, lineage: tuple[str, ...]) -> RunOptions:
    """*options* for one attempt: its own run id, and the restart count and lineage in the env
    (DDPFAB_RUN_ID, set by the planner, is the attempt's id)."""
    root = lineage[0]
    env = tuple((k, v) for k, v in options.env if k not in (RESTART_VAR, ROOT_VAR, LINEAGE_VAR))
    env += ((RESTART_VAR, str(restart)), (ROOT_VAR, root), (LINEAGE_VAR, ",".join(lineage)))
    return replace(options, run_id=attempt_id(root, restart), env=env)


def problem_hosts(problems: list[Problem], names: set[str]) -> set[str]:
    """The hosts that preflight/probe problems are about, among *names*: each problem's own
    ``node`` (exact names; a problem about no single node blames none, whatever its text says)."""
    return {p.node for p in problems if p.node in names}


def tail(path: Path, lines: int = EVIDENCE_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip("\n").splitlines()[-lines:])


def health(nodes: tuple[Node, ...], policy: HostKeyPolicy, ssh_config: str | None) -> dict[str, str]:
    """node -> why it is unhealthy now, for the nodes that do not answer a fresh SSH connection
    and a trivial command (retried once: a timeout is not yet evidence of a fault)."""
    def one(node: Node) -> None:
        last: BaseException | None = None
        for _ in range(2):
            try:
                conn = ssh.connect(node, policy, ssh_config, timeout=HEALTH_TIMEOUT_S)
            except ssh.SSHError as exc:
                last = exc
                if exc.kind != "unreachable":
                    break
                continue
            try:
                if ssh.run(conn, node.name, "true", timeout=HEALTH_TIMEOUT_S).exit_code == 0:
                    return None
            finally:
                conn.close()
        raise last or RuntimeError(f"host {node.name}: `true` failed")

    results = ssh.parallel(nodes, one)
    return {n: str(r) for n, r in results.failed.items()}


def classify(result: RunResult, nodes: tuple[Node, ...], log_dir: Path, policy: HostKeyPolicy,
             ssh_config: str | None) -> Failure:
    """Whose failure ended the attempt: a node's or the script's."""
    if result.exit_code == 0:
        return Failure("none")
    if result.interrupted:
        return Failure("interrupted", error=result.interrupted)
    evidence: dict[str, str] = {}
    for name, out in result.outcomes.items():
        if out.exit_code is None and out.error:  # lost, cut off, or no exit status
            evidence[name] = out.error
    # a node declared lost has its evidence (keepalives unanswered for seconds); the others answered
    # a moment ago, so their check is quick, and it catches a node whose failure looked like an exit
    for name, why in health(tuple(n for n in nodes if n.name not in evidence), policy, ssh_config).items():
        evidence[name] = f"health check: {why}"
    if evidence:
        for name in evidence:
            last = tail(log_dir / f"{name}.log")
            if last:
                evidence[name] += "\nlast lines:\n" + last
        return Failure("node", tuple(n.name for n in nodes if n.name in evidence), evidence)
    first = result.first_failure or next(iter(result.outcomes))  # the rank that failed on its own (cause.blame)
    cause = result.outcomes[first].cause
    code = result.outcomes[first].exit_code
    error = (cause.text() if cause else "exited 0 while the others still waited for it" if code == 0
             else f"exit code {code}")
    return Failure("script", (first,), {first: tail(log_dir / f"{first}.log")}, error)


# --- the loop -------------------------------------------------------------------------------

#: Prepares one attempt: connect, sync, probe, preflight, plan. Returns (Prepared, manifest extra).
PrepareFn = Callable[[Inventory, RunOptions], tuple]
RunFn = Callable  # runner.run


@dataclass
class Attempt:
    run_id: str
    restart: int
    nodes: list[str]
    started: float
    replaced: dict[str, str] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)
    recovery_s: float | None = None
    plan: Plan | None = None
    ended: float | None = None
    exit_code: int | None = None
    ended_because: str = ""
    failure: Failure | None = None
    skipped: dict[str, str] = field(default_factory=dict)  # spare/survivor -> why it was left out

    def to_dict(self) -> dict:
        plan = self.plan
        return {
            "run_id": self.run_id, "restart": self.restart, "nodes": self.nodes,
            "ranks": {n.name: n.node_rank for n in plan.nodes} if plan else {},
            "master": plan.master if plan else None,
            "master_addr": plan.master_addr if plan else None,
            "master_port": plan.master_port if plan else None,
            "started": self.started, "ended": self.ended, "exit_code": self.exit_code,
            "ended_because": self.ended_because,
            "failure_kind": self.failure.kind if self.failure else None,
            "failed_nodes": list(self.failure.nodes) if self.failure and self.failure.kind == "node" else [],
            "replaced": self.replaced, "dropped": self.dropped, "left_out": self.skipped,
            "recovery_s": self.recovery_s,
        }


@dataclass
class Course:
    """Where a run with restarts stands before its next attempt.

    Args:
        restart: the next attempt's number (0: the first).
        lineage: the run ids of the attempts so far and the next one's, in order.
        nodes: the nodes the next attempt is prepared on, in order.
        pending: the replacements and drops the last failure decided (None: none).
        failed_at: when the last attempt failed (None before the first restart).
    """

    restart: int
    lineage: tuple[str, ...]
    nodes: tuple[Node, ...]
    pending: NextSet | None = None
    failed_at: float | None = None


class Recovery:
    """One run with restarts. *prepare* and *run* are the single-attempt steps (api and runner)."""

    def __init__(self, cluster: Inventory, spares: tuple[Node, ...], options: RunOptions, ropts: RecoveryOptions,
                 policy: HostKeyPolicy, ssh_config: str | None, runs_dir: str, prepare: PrepareFn,
                 run: RunFn, color: bool | None = None, out=None, verbose: bool = False):
        self.cluster, self.spares, self.options, self.ropts = cluster, spares, options, ropts
        self.policy, self.ssh_config, self.runs_dir = policy, ssh_config, runs_dir
        self.prepare, self.run_attempt, self.color, self.verbose = prepare, run, color, verbose
        self.out = out or sys.stdout
        self.root = options.run_id
        self.attempts: list[Attempt] = []
        self.failed: dict[str, str] = {}  # node -> evidence, over the whole run
        self.excluded: set[str] = set()

    def note(self, text: str) -> None:
        self.out.write(f"ddpfab: {text}\n")
        self.out.flush()

    def record(self, state: str, exit_code: int | None) -> None:
        path = Path(self.runs_dir) / self.root / "manifest.json"
        if not path.exists():
            return
        manifest = json.loads(path.read_text())
        manifest["recovery"] = {
            "state": state, "exit_code": exit_code,
            "final_run_id": self.attempts[-1].run_id if self.attempts else self.root,
            "options": {"max_job_restarts": self.ropts.max_job_restarts, "spares_group": self.ropts.spares_group,
                        "retry_on": sorted(self.ropts.retry_on), "min_nodes": self.ropts.min_nodes},
            "spares": [s.name for s in self.spares],
            "attempts": [a.to_dict() for a in self.attempts],
            "failed_nodes": self.failed,
        }
        RunDir.existing(self.runs_dir, self.root).write_manifest(manifest)

    def _prepare(self, attempt: Attempt, nodes: tuple[Node, ...], restart: int, lineage: tuple[str, ...]):
        """Prepare the attempt on *nodes*; a node the preflight blames is left out and replaced by
        another spare (at most once per spare). Returns (prepared, extra, nodes actually used)."""
        opts = attempt_options(self.options, restart, lineage)
        while True:
            try:
                prepared, extra = self.prepare(replace(self.cluster, nodes=nodes), opts)
                return prepared, extra, nodes
            except RunError as exc:
                blamed = problem_hosts(exc.problems, {n.name for n in nodes})
                # a restart's run id already on a node (an earlier run of the same --run-id whose
                # first attempt was pruned) is this run's naming, not the node's fault: no spare fixes it
                if restart == 0 or not blamed or any(p.check == "run_id" for p in exc.problems):
                    raise
                for name in blamed:
                    why = "; ".join(str(p) for p in exc.problems if p.about(name))  # node1 is not node10
                    attempt.skipped[name] = why
                    self.excluded.add(name)
                    self.note(f"{name} left out of restart {restart}: {why}")
                nxt = next_nodes(nodes, blamed, self.spares, self.excluded, self.ropts.min_nodes)
                for old, new in nxt.replaced.items():
                    origin = next((k for k, v in attempt.replaced.items() if v == old), old)
                    attempt.replaced.pop(origin, None)
                    attempt.replaced[origin] = new
                attempt.dropped += list(nxt.dropped)
                nodes = nxt.nodes

    def run(self) -> int:
        """Attempts until one ends the run (it succeeds, is interrupted, or no next attempt is
        allowed or possible); returns the run's exit code. SIGTERM is an interruption meanwhile, so
        a stop between attempts starts no other one."""
        previous = signal.signal(signal.SIGTERM, _raise_interrupted) \
            if threading_main() else None
        try:
            course = Course(0, (self.root,), self.cluster.nodes)
            while True:
                code = self._one_attempt(course)
                if code is not None:
                    return code
        except (Interrupted, KeyboardInterrupt) as exc:
            name, code = (exc.name, exc.exit_code) if isinstance(exc, Interrupted) else ("SIGINT", 130)
            self.note(f"{name} between attempts: no restart; nothing is running")
            self.record("interrupted", code)
            return code
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)

    def _one_attempt(self, course: Course) -> int | None:
        """One attempt on *course*'s nodes, then what follows it: the run's exit code when the
        attempt ends the run, else None with *course* moved on to the next attempt. At the first
        attempt a node that cannot start raises (nothing ran yet: the caller reports it as a run
        that did not start); later it ends the run with the reason."""
        attempt = self._new_attempt(course)
        try:
            prepared, extra, course.nodes = self._prepare(attempt, course.nodes, course.restart, course.lineage)
        except (RunError, NoRecovery) as exc:
            lines = self._could_not_start(attempt, exc)
            if course.restart == 0:
                raise
            return self._give_up(lines + ["nothing is running"])
        try:
            extra = self._begin(attempt, prepared, extra, course)
        except BaseException:  # (a signal between attempts): its prepared sessions end here
            prepared.close()
            raise
        result = self._execute(attempt, prepared, extra, course.failed_at)
        failure = self._ended(attempt, result, course.nodes)
        if failure.kind in ("none", "interrupted"):
            self.record("succeeded" if failure.kind == "none" else "interrupted", result.exit_code)
            return self._finish(result.exit_code)
        self.note(f"attempt {attempt.run_id} ended: {attempt.ended_because}")
        refused = self._no_retry(attempt, failure, course.restart)
        if refused:
            return self._give_up([refused], result.exit_code)
        return self._next(course, attempt, result, failure)

    def _new_attempt(self, course: Course) -> Attempt:
        """The record of *course*'s next attempt, started now, with the replacements and drops that
        the failure before it decided (the preparation may add to them)."""
        pending = course.pending
        return Attempt(attempt_id(self.root, course.restart), course.restart, [], time.time(),
                       replaced=dict(pending.replaced) if pending else {},
                       dropped=list(pending.dropped) if pending else [])

    def _could_not_start(self, attempt: Attempt, exc: RunError | NoRecovery) -> list[str]:
        """Record that *attempt* could not start (the preparation's problems, *exc*) and return
        those problems as lines: the manifest shows why the run stopped where it did."""
        lines = [str(p) for p in exc.problems]
        attempt.ended, attempt.ended_because = time.time(), "could not start: " + "; ".join(lines)
        self.attempts.append(attempt)
        return lines

    def _begin(self, attempt: Attempt, prepared: Prepared, extra: dict, course: Course) -> dict:
        """Record the prepared *attempt* (its nodes and plan) and return what its manifest records
        beside the plan: the spares group and the nodes in order (a replay finds them again) and,
        for a restart, which run it recovers and the attempts' lineage."""
        attempt.nodes = [n.name for n in course.nodes]
        attempt.plan = prepared.plan
        self.attempts.append(attempt)
        extra = {**extra, "spares_group": self.ropts.spares_group, "attempt_nodes": attempt.nodes}
        if course.restart:
            extra = {**extra, "recovery_of": self.root, "restart": course.restart, "lineage": list(course.lineage)}
        return extra

    def _execute(self, attempt: Attempt, prepared: Prepared, extra: dict, failed_at: float | None) -> RunResult:
        """Run the prepared *attempt* to its end (its connections closed after): a restart says
        first which node replaced which, and its recovery time (from *failed_at*, when the failure
        before it happened) is recorded with the run marked running."""
        try:
            printer = Printer(prepared.plan, stream=self.out, color=self.color, verbose=self.verbose)
            if attempt.restart:
                swap = ", ".join(f"{a} -> {b}" for a, b in attempt.replaced.items()) or "no replacement"
                printer.note(f"restart {attempt.restart}/{self.ropts.max_job_restarts} as {attempt.run_id}: {swap}"
                             + (f", dropped {', '.join(attempt.dropped)}" if attempt.dropped else ""))
            attempt.started = time.time()
            if failed_at is not None:
                attempt.recovery_s = round(attempt.started - failed_at, 3)
            self.record("running", None)
            result, _ = self.run_attempt(prepared, self.runs_dir, printer, extra=extra)
        finally:
            prepared.close()
        return result

    def _ended(self, attempt: Attempt, result: RunResult, nodes: tuple[Node, ...]) -> Failure:
        """Record how *attempt* ended (*result* on *nodes*): whose failure it was and why; failed
        nodes join the run's failed and excluded ones, so no later attempt uses them."""
        attempt.ended, attempt.exit_code = time.time(), result.exit_code
        failure = classify(result, nodes, Path(self.runs_dir) / attempt.run_id, self.policy,
                           self.ssh_config)
        attempt.failure = failure
        attempt.ended_because = "succeeded" if failure.kind == "none" else (
            f"interrupted by {result.interrupted}" if failure.kind == "interrupted" else failure.describe())
        if failure.kind == "node":
            self.failed.update({n: failure.evidence[n] for n in failure.nodes})
            self.excluded.update(failure.nodes)
        return failure

    def _no_retry(self, attempt: Attempt, failure: Failure, restart: int) -> str | None:
        """Why *failure* starts no other attempt (a kind --retry-on leaves out, or no restarts
        left), as the line the run gives up with; None when it may be retried."""
        if failure.kind not in self.ropts.retry_on:
            why = (f"a script failure is not retried ({option('retry_on')} script retries it)"
                   if failure.kind == "script" else f"node failures are not retried ({option('retry_on')} node)")
            return f"{attempt.ended_because}; {why}"
        if restart >= self.ropts.max_job_restarts:
            return (f"{attempt.ended_because}; no restarts left "
                    f"({option('max_job_restarts', self.ropts.max_job_restarts)})")
        return None

    def _next(self, course: Course, attempt: Attempt, result: RunResult, failure: Failure) -> int | None:
        """Move *course* on to the attempt after *attempt*: when the failure happened (its recovery
        time counts from there) and, for a node failure, the nodes it runs on; None, or the run's
        exit code when no nodes are left to run on."""
        course.failed_at = min((result.outcomes[n].ended for n in failure.nodes if result.outcomes[n].ended),
                               default=attempt.ended)
        if failure.kind == "node":
            try:
                course.pending = next_nodes(course.nodes, set(failure.nodes), self.spares, self.excluded,
                                            self.ropts.min_nodes)
            except NoRecovery as exc:
                return self._give_up([str(exc)], result.exit_code)
            course.nodes = course.pending.nodes
        else:
            course.pending = None
        course.restart += 1
        course.lineage += (attempt_id(self.root, course.restart),)
        return None

    def _finish(self, code: int) -> int:
        if len(self.attempts) > 1:
            self.note(f"run {self.root}: {len(self.attempts)} attempts, the last ({self.attempts[-1].run_id}) "
                      f"{'succeeded' if code == 0 else f'ended with {code}'}")
        self._report_failed()
        return code

    def _give_up(self, lines: list[str], code: int | None = 1) -> int:
        self.record("failed", code or 1)
        self._report_failed()
        for line in lines:
            sys.stderr.write(f"ddpfab: error: {line}\n")
        return code or 1

    def _report_failed(self) -> None:
        """The nodes that failed during the run, with their evidence: what a person fixes next."""
        if not self.failed:
            return
        self.note(f"failed node{'s' if len(self.failed) > 1 else ''} during run {self.root}: "
                  + ", ".join(self.failed))
        for name, why in self.failed.items():
            for i, line in enumerate(why.splitlines()):
                self.note(f"  {name}: {line}" if i == 0 else f"  {name}|   {line}")


def threading_main() -> bool:
    return threading.current_thread() is threading.main_thread()


def _raise_interrupted(signum, frame):
    raise Interrupted(signum)


def split_spares(cluster: Inventory, spares_group: str | None) -> tuple[Inventory, tuple[Node, ...]]:
    """The cluster without the spares group's hosts, and the spares (in inventory order)."""
    if not spares_group:
        return cluster, ()
    if spares_group == cluster.group:
        raise inventory.InventoryError(f"inventory {cluster.source}: the spares group {spares_group!r} is the "
                                       f"group of the nodes itself; pick another {option('group')} or "
                                       f"{option('spares')}")
    spares = inventory.load(cluster.sources or cluster.source, spares_group).nodes
    names = {s.name for s in spares}
    both = [n.name for n in cluster.nodes if n.name in names]
    if both and cluster.group != "all":
        # a group named for the nodes that also holds a spare: which one the host is meant to be is
        # unclear, and dropping it silently would start a smaller job than the group says
        raise inventory.InventoryError(
            f"inventory {cluster.source}: host{'s' * (len(both) > 1)} {', '.join(both)} {'are' if len(both) > 1 else 'is'} "
            f"in the nodes' group {cluster.group!r} and in the spares group {spares_group!r}; a host is a node or a "
            f"spare: take it out of one of the groups (or use {option('group', 'all')}, whose spares are its other "
            "hosts)")
    active = replace(cluster, nodes=tuple(n for n in cluster.nodes if n.name not in names))
    if not active.nodes:
        raise inventory.InventoryError(f"inventory {cluster.source}: every host of group {cluster.group!r} is a "
                                       f"spare (group {spares_group!r}); nothing to start on")
    return active, spares


#: Set in the environment of the controller-side supervisor of a detached run with restarts.
SUPERVISOR_VAR = "DDPFAB_RECOVERY_SUPERVISOR"


def is_supervisor() -> bool:
    return os.environ.get(SUPERVISOR_VAR) == "1"


def start_detached(argv: list[str], run_id: str, runs_dir: str, out=None) -> int:
    """``run --detach`` with restarts: the recovery loop itself must outlive this command, so it runs
    as a controller-side supervisor in a session of its own (``runs/<id>.supervisor.log``), and
    this command returns once the first attempt is recorded (or the supervisor has failed)."""
    out = out or sys.stdout
    root = Path(runs_dir)
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    log_path = root / f"{run_id}.supervisor.log"
    child = ["--run-id", run_id, *argv]  # the same command, attended (SUPERVISOR_VAR); a later --run-id wins
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    proc = subprocess.Popen([sys.executable, "-m", "ddpfab", "run", *child], stdin=subprocess.DEVNULL, stdout=fd,
                            stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "NO_COLOR": "1", SUPERVISOR_VAR: "1"})
    os.close(fd)
    (root / f"{run_id}.supervisor.json").write_text(json.dumps({"pid": proc.pid, "run_id": run_id,
                                                                "started": time.time()}))
    manifest = root / run_id / "manifest.json"
    while proc.poll() is None:
        if manifest.exists() and json.loads(manifest.read_text()).get("state") == "running":
            out.write(f"ddpfab: run {run_id} started detached, with restarts supervised from this machine (pid "
                      f"{proc.pid}, log {log_path}); `ddpfab stop {run_id}` ends it\n")
            return 0
        time.sleep(0.1)
    sys.stderr.write(f"ddpfab: error: the run's supervisor ended with {proc.returncode} before the job "
                     f"started:\n{log_path.read_text()[-2000:]}")
    return proc.returncode or 1


def stop_supervisor(runs_dir: str, run_id: str, timeout: float = 30.0) -> str | None:
    """End the controller-side supervisor of a detached run with restarts (so it starts no more
    attempts; it stops the running one on every node). None when there is none."""
    path = Path(runs_dir) / f"{run_id}.supervisor.json"
    try:
        pid = int(json.loads(path.read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None

    def alive() -> bool:
        try:
            return run_id.encode() in Path(f"/proc/{pid}/cmdline").read_bytes() and \
                Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    if not alive():
        return "supervisor not running"
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    return "supervisor stopped" if not alive() else "supervisor still running"


def _attempt(runs_dir: str, run_id: object) -> dict | None:
    """Attempt *run_id*'s manifest, when *run_id* (read from a record: data) is a run id and its
    record is that run's; else None (an id like ``../x`` would name a path outside the runs)."""
    if not is_run_id(run_id):
        return None
    try:
        manifest = json.loads((Path(runs_dir) / str(run_id) / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("run_id") == run_id else None


def current_manifest(runs_dir: str, manifest: dict | None) -> dict | None:
    """For a run with restarts, the manifest of its latest attempt (what is running now, or ran
    last); else *manifest* itself."""
    final = ((manifest or {}).get("recovery") or {}).get("final_run_id")
    if not final or manifest is None or final == manifest.get("run_id"):
        return manifest
    return _attempt(runs_dir, final) or manifest


def attempt_manifests(runs_dir: str, manifest: dict) -> list[dict]:
    """Every attempt's manifest of a run with restarts, in order ([*manifest*] for a plain run)."""
    out = []
    for a in ((manifest.get("recovery") or {}).get("attempts") or []):
        run_id = a.get("run_id") if isinstance(a, dict) else None
        if run_id == manifest.get("run_id"):
            out.append(manifest)
        elif (attempt := _attempt(runs_dir, run_id)) is not None:
            out.append(attempt)
    return out or [manifest]


def next_attempt(runs_dir: str, root: dict, followed: str, wait_s: float = 300.0) -> dict | None:
    """After attempt *followed* of a run with restarts has ended: the manifest of the attempt that
    follows it, once it has started, or None when the run has ended (or has no restarts)."""
    if not root.get("recovery"):
        return None
    path = Path(runs_dir) / root["run_id"] / "manifest.json"
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        rec = data.get("recovery") if isinstance(data, dict) else None
        rec = rec if isinstance(rec, dict) else {}
        final = rec.get("final_run_id")
        if final and final != followed:
            manifest = _attempt(runs_dir, final)
            if manifest is not None:
                return manifest
        elif rec.get("state") != "running":
            return None
        time.sleep(0.5)
    return None


def attempt_cluster(manifest: dict, source: str | None = None, group: str | None = None,
                    extra_vars: tuple = ()) -> Inventory:
    """The cluster an attempt ran on, in its order: its nodes, from the run's group and its spares
    (*extra_vars*: the run's ``-e``, over every host's variables)."""
    plan = manifest["plan"]
    source = source or plan["inventory"]
    cluster = inventory.load(source, group or plan["group"], extra_vars=extra_vars)
    spares_group = manifest.get("spares_group")
    pool = {n.name: n for n in cluster.nodes}
    if spares_group:
        pool.update({n.name: n for n in inventory.load(source, spares_group, extra_vars=extra_vars).nodes})
    order = manifest.get("attempt_nodes") or [n["name"] for n in plan["nodes"]]
    missing = [n for n in order if n not in pool]
    if missing:
        raise inventory.InventoryError(f"inventory {source}: the run's nodes {', '.join(missing)} are not in "
                                       f"group {cluster.group!r}" + (f" or {spares_group!r}" if spares_group else ""))
    return replace(cluster, nodes=tuple(pool[n] for n in order))
