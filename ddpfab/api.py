"""The public API: a cluster loaded from an inventory, and the whole pipelines as calls on it.

    import ddpfab
    cluster = ddpfab.Cluster.load("lab.yml", group="gpus")
    result = cluster.run("train.py", ["--epochs", "1"], nproc_per_node=2)
    print(result.exit_code, result.manifest)

``check``, ``sync``, ``exec``, ``fetch``, ``logs``, ``ps``, ``stop``, ``doctor``, ``plan``, ``emit``,
``run`` and ``replay`` are what ``ddpfab check|sync|exec|fetch|logs|ps|stop|doctor|plan|run|replay`` do,
with the command line's options under their Python names (:class:`Options`; the CLI builds the
same object from its arguments and calls these). Fabric's ``Group`` and torchrunx's ``launch`` are
the models: a small surface over the library, every decision made where the library makes it.

Errors are the library's: ``InventoryError``, ``PlanError``, ``TargetError`` (bad input, nothing
contacted) and ``RunError`` (a problem on the nodes before anything started; ``.problems``).

Printing is injectable: *say* takes ddpfab's own lines (default: ``ddpfab: ...`` on stderr, as the
command line prints them), *out* the job's prefixed output lines (default stdout).

LAZY: this module is imported by ``ddpfab.cli`` (whose parser must stay light) and by ``ddpfab``
itself on first use of ``ddpfab.Cluster``; the modules that reach Fabric/paramiko are imported
inside the calls that need them, as in the command line.
"""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from ddpfab.health import resourcecheck
from ddpfab.hosts import inventory
from ddpfab.hosts.suggest import did_you_mean
from ddpfab.launch import replicate
from ddpfab.launch.debugger import refuse_without_input
from ddpfab.launch.progress import Ticker
from ddpfab.launch.runs import runs_dir_problem
from ddpfab.node.workdir import source_problem
from ddpfab.optionnames import option
from ddpfab.planning import plan as planmod
from ddpfab.planning import scriptfile
from ddpfab.masking import recordable
from ddpfab.planning.plan import LOCAL_RANK_ARGS, Facts, Plan, PlanError
from ddpfab.problems import NodeError, Problem
from ddpfab.remote.target import HostKeyPolicy, resolve_all
from ddpfab.results import GroupResult

if TYPE_CHECKING:  # (slow to import: see LAZY above)
    from ddpfab.launch.runner import Prepared
    from ddpfab.remote.output import Printer

Say = Callable[[str], object]  # (what it returns is ignored: print, sys.stderr.write)


def stderr_say(line: str) -> None:
    """The library's default for its own lines: as the command line prints them."""
    sys.stderr.write(f"ddpfab: {line}\n")


def runs_dir_default() -> str:
    """``$DDPFAB_RUNS_DIR`` (set and not empty; ``~`` is the home), else ``runs``: as the command line has it."""
    return os.path.expanduser(os.environ.get("DDPFAB_RUNS_DIR") or "runs")


@dataclass(frozen=True)
class Options:
    """What shapes a run (and a plan): ``ddpfab run``'s options under their Python names.

    Args:
        nproc_per_node: processes per node: a number, or ``gpu``/``cpu``/``auto`` (None: inventory, GPUs, or 1).
        master_port: MASTER_PORT (None: a port found free on the master).
        gpus_per_node: GPUs each node's supervisor leases for the job (None: one per process, or
            the inventory's ``ddpfab_gpu_ids``); the job sees exactly those (CUDA_VISIBLE_DEVICES).
        wait: GPUs leased or busy: wait in each node's queue, in arrival order, instead of refusing.
        exit_guard: the ranks' exit guard: ``on`` (each rank records that it finished and leaves
            without the interpreter teardown where gloo can abort it), ``record`` or ``off``.
        resource_floors: what the preflight requires of each node (``shm=2G,disk=5G,mem=4G,nofile=4096``,
            any subset; see :mod:`ddpfab.health.resourcecheck`).
        hang_timeout: seconds without a line from any rank before the run runs the doctor by
            itself (its verdict printed and saved in the run's dir); 0: never.
        on_hang: ``report`` (the doctor's verdict, then keep waiting) or ``stop`` (end the job: exit 124).
        pdb: ranks whose ``breakpoint()`` and uncaught exceptions wait in pdb, driven from this
            process's stdin and stdout (``"all"``, or ranks and ranges: ``"5"``, ``"0,3-4"``); "": none.
        debugpy: ranks that wait for a DAP client (VS Code) before the script runs, each forwarded
            to a port on this machine's loopback (spelled as *pdb*); "": none.
        env: environment for every rank: a mapping, or ``K=V`` strings (a bare ``KEY`` takes this
            process's value), over the env files and the forwarded variables.
        env_file: files of ``KEY=VALUE`` lines for every rank (``env`` wins over them).
        forward_env: forward this process's NCCL_*, TORCH_*, GLOO_*, PYTORCH_* variables.
        secret_env: keys whose values are masked wherever the run is shown or recorded.
        check: run the preflight checks (firewall/data plane, hostnames, versions).
        socket_ifname: GLOO/NCCL_SOCKET_IFNAME: interface names (``eth0``, ``eth0,eth1``; a node that
            lacks one or has it down is refused before anything starts), ``auto``, or ``none``/``off``; None (the
            default): auto where neither variable is set, nothing on a node without one interface
            towards all its peers (a warning).
        max_restarts: torchrun's in-node restarts.
        run_id: the run id (None: time + random suffix).
        rdzv: ``static`` (node_rank in inventory order) or ``c10d``.
        launcher: ``torchrun`` or ``legacy`` (torch.distributed.launch).
        local_rank_style: ``auto``, ``dash`` or ``underscore``.
        init_method: ``env``, ``tcp`` or ``file``.
        debug: NCCL/torch distributed debug variables.
        module: the script is a module (``python -m``).
        sync: sync the current directory to the nodes' workdirs first.
        fanout: sync's ``star`` or ``tree``.
        compress: sync with rsync --compress.
        include_keys: sync private keys and ``.ssh/`` files too (left out by default, and named:
            :mod:`ddpfab.transfer.keys`).
        replicate: files (relative to the workdir) copied from rank 0's node to the others first.
        detach: start the job and return.
        tmux: each node's launch in a window of a tmux session named after the run, with a terminal
            there (Ctrl-C and the keyboard reach that node's torchrun), without the node supervisor.
        runs_dir: where run records go.
        max_job_restarts: start the whole job again up to N times after a node is lost.
        spares: inventory group of standby hosts.
        retry_on: which failures are retried: ``node`` and/or ``script``.
        min_nodes: with no spare left, go on with fewer nodes, down to this many.
        perf_check: the slow-node check before the launch (a straggler stops it).
        perf_check_warn: the slow-node check, a straggler only reported.
        dry_run: make the plan as the real run would, start nothing.
        offline: plan without contacting the hosts (port: ``master_port`` or 29500).
        quiet: no progress lines (they are off anyway when stderr is not a terminal).
        color: colours in the job's output (None: on a terminal without NO_COLOR).
        verbose: every line of the job's output, as it comes: torchrun's failure reports and the
            tracebacks of ranks that lost their peer are folded otherwise (the node logs keep them).
    """

    nproc_per_node: int | str | None = None
    master_port: int | None = None
    gpus_per_node: int | None = None
    wait: bool = False
    exit_guard: str = "on"
    resource_floors: str | None = None
    hang_timeout: float = planmod.HANG_TIMEOUT_S
    on_hang: str = "report"
    pdb: str = ""
    debugpy: str = ""
    env: Mapping[str, str] | tuple[str, ...] = ()
    env_file: tuple[str, ...] = ()
    forward_env: bool = True
    secret_env: tuple[str, ...] = ()
    check: bool = True
    socket_ifname: str | None = None
    max_restarts: int = 0
    run_id: str | None = None
    rdzv: str = "static"
    launcher: str = "torchrun"
    local_rank_style: str = "auto"
    init_method: str = "env"
    debug: bool = False
    module: bool = False
    sync: bool = True
    fanout: str = "star"
    compress: bool = False
    include_keys: bool = False
    replicate: tuple[str, ...] = ()
    detach: bool = False
    tmux: bool = False
    runs_dir: str = field(default_factory=runs_dir_default)
    max_job_restarts: int = 0
    spares: str | None = None
    retry_on: tuple[str, ...] = ()
    min_nodes: int | None = None
    perf_check: bool = False
    perf_check_warn: bool = False
    dry_run: bool = False
    offline: bool = False
    quiet: bool = False
    color: bool | None = None
    verbose: bool = False

    @classmethod
    def of(cls, **given: Any) -> Options:
        """From keyword arguments; an unknown name is a PlanError that names the close ones."""
        names = [f.name for f in fields(cls)]
        unknown = [k for k in given if k not in names]
        if unknown:
            raise PlanError(f"unknown option {unknown[0]!r}{did_you_mean(unknown[0], names)} (options: "
                            f"{', '.join(names)})")
        seqs = {k: tuple(v) for k, v in given.items()  # lists (argparse's, a caller's) as tuples: comparable
                if k in ("env", "env_file", "secret_env", "replicate", "retry_on") and v is not None
                and not isinstance(v, (str, Mapping))}
        return cls(**{**given, **seqs})

    @property
    def recovering(self) -> bool:
        """Restarts asked for: the run is a :class:`ddpfab.launch.recover.Recovery`."""
        return bool(self.max_job_restarts or self.retry_on or self.min_nodes)

    def env_pairs(self) -> tuple[tuple[str, str], ...]:
        """The ranks' environment: forwarded allowlist, then env files, then ``env``: later wins."""
        merged: dict[str, str] = {}
        if self.forward_env:
            merged.update(planmod.forwarded_env(dict(os.environ)))
        for path in self.env_file:
            try:  # utf-8-sig: a byte-order mark an editor wrote is not part of the first name
                with open(path, encoding="utf-8-sig") as fh:
                    text = fh.read()
            except OSError as exc:
                raise PlanError(f"env file {path}: {exc.strerror}") from None
            except UnicodeDecodeError as exc:
                raise PlanError(f"env file {path}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset "
                                f"{exc.start}); write it as KEY=VALUE lines of text") from None
            merged.update(planmod.parse_env(planmod.read_env_file(text, path)))
        given = [f"{k}={v}" for k, v in self.env.items()] if isinstance(self.env, Mapping) else list(self.env)
        merged.update(planmod.parse_env(given, dict(os.environ)))
        return tuple(merged.items())


@dataclass
class RunOutcome:
    """What a run did.

    Args:
        run_id: the run's id (with restarts: the first attempt's, whose manifest records them all).
        exit_code: 0 when every rank succeeded (a dry run: 0).
        plan: the plan started (with restarts: the last attempt's; None if none was made).
        outcomes: node -> its :class:`ddpfab.launch.execute.NodeOutcome` (empty: detached, dry run,
            or a run with restarts, whose attempts are in the manifest's ``recovery``).
        manifest: the path of the run record, `RUNS_DIR/RUN_ID/manifest.json` (None for a dry run).
        summary: the one-line summary printed at the end.
        failed_node: the node whose failure ended the run (the first to fail on its own), if known.
    """

    run_id: str
    exit_code: int
    plan: Plan | None
    outcomes: dict[str, Any] = field(default_factory=dict)
    manifest: Path | None = None
    summary: str = ""
    failed_node: str | None = None

    @property
    def ok(self) -> bool:
        """Every rank succeeded (a dry run, a detached start: it started)."""
        return self.exit_code == 0

    @property
    def problems(self) -> list[Problem]:
        """The run's failure, about the node that failed on its own (the closing line's words)."""
        if self.ok:
            return []
        return [Problem(self.failed_node, "run", text=self.summary or f"run {self.run_id}: exit code {self.exit_code}")]


@dataclass
class Replayed(RunOutcome):
    """What :meth:`Cluster.replay` did: a :class:`RunOutcome` of the new run, and

    Args:
        of: the replayed run's id.
        changed: how the plan the recorded options make now differs from the recorded plan (a
            replay runs only with ``force``, or plans only with ``dry_run``).
    """

    of: str = ""
    changed: list[str] = field(default_factory=list)


@dataclass
class Fetched:
    """What :meth:`Cluster.fetch` copied.

    Args:
        node: the node it came from.
        path: its path there (absolute).
        local: where it is here.
        kind: ``file`` or ``dir``.
        files: how many files.
        size: how many bytes.
    """

    node: str
    path: str
    local: str
    kind: str
    files: int
    size: int
    #: a fetch that returns has copied everything (a failure raises :class:`FetchError`)
    ok: bool = True
    problems: list[Problem] = field(default_factory=list)


@dataclass
class Diagnosis:
    """What :meth:`Cluster.doctor` found.

    Args:
        run_id: the run diagnosed (with restarts: its latest attempt).
        lines: the verdict, then each group of ranks with its stack, as ``ddpfab doctor`` prints it.
        hung: the ranks are alive and none has moved: a hang.
        ended: the job has ended on every node (nothing to diagnose).
        odd: the odd ones out (``node``, ``what``, ``text``, and what more each kind says).
        record: the doctor's record, ``RUNS_DIR/RUN_ID/doctor-TIME.json``.
    """

    run_id: str
    lines: list[str]
    hung: bool
    ended: bool
    odd: list[dict]
    record: Path | None

    @property
    def ok(self) -> bool:
        """No rank or node is an odd one out."""
        return not self.odd

    @property
    def problems(self) -> list[Problem]:
        """Each odd one out, about its node."""
        return [Problem(o.get("node"), f"doctor.{o.get('what')}", text=str(o.get("text"))) for o in self.odd]


@dataclass
class Jobs:
    """What :meth:`Cluster.ps` found on the nodes.

    Args:
        runs: one per run id any node knows, newest last: ``run_id``, ``state`` (running, exited,
            stopped, dead, cancelled), ``age_s``, ``nodes`` (node -> ``state``, ``exit_code``,
            ``stopped``), and for runs with restarts ``attempt_of``/``restart`` or ``attempts``.
        gpus: node -> its GPUs' states (:class:`ddpfab.planning.gpu_leases.GpuState`), every user's
            leases.
        problems: the nodes that could not be asked (the others are listed).
        warnings: local records that could not be read (their runs are listed without them).
    """

    runs: list[dict]
    gpus: dict[str, list]
    problems: list[Problem]
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every node answered."""
        return not self.problems


@dataclass
class Stopped:
    """What :meth:`Cluster.stop` did.

    Args:
        run_id: the run stopped (with restarts: its latest attempt).
        said: node -> what happened there, in one line.
        left: the nodes where something of the job may still run (not reached, or not ended).
        supervisor: for a detached run with restarts, what ending its supervisor did ("" if none).
        problems: the nodes that could not be reached.
        tmux: for a ``run --tmux`` run, what closing its session did ("" if none).
        found: the run is known: a local record of it, or a node that knew it (or could not be
            asked); False for a run id no node and no record knows (a typo: nothing was stopped).
    """

    run_id: str
    said: dict[str, str]
    left: list[str]
    supervisor: str = ""
    problems: list[Problem] = field(default_factory=list)
    tmux: str = ""
    found: bool = True

    @property
    def ok(self) -> bool:
        """Nothing of the job is left on any node."""
        return not self.left


@dataclass
class Logs:
    """What :meth:`Cluster.logs` copied: each node's output of one run.

    Args:
        run_id: the run (or the attempt of a run with restarts) whose output it is.
        directory: where the copies are, ``RUNS_DIR/RUN_ID``.
        files: node -> its output, ``DIRECTORY/NODE.remote.log``; of a ``run --tmux`` run (no
            supervisor relayed its output), the dir of its per-rank logs, ``DIRECTORY/ranks/NODE``.
        lines: node -> the lines of its output.
        rank_files: node -> the per-rank log files copied to ``DIRECTORY/ranks/NODE/`` (``ranks=True``,
            and always for a ``run --tmux`` run).
        problems: the nodes whose output could not be copied (the others' is).
    """

    run_id: str
    directory: Path
    files: dict[str, Path]
    lines: dict[str, int]
    rank_files: dict[str, int]
    problems: list[Problem]

    @property
    def ok(self) -> bool:
        """Every node's output was copied."""
        return not self.problems


@dataclass
class Held:
    """A holder of this cluster's connections (:meth:`Cluster.hold`): a process of this user that
    keeps one SSH connection per node open; ``exec`` runs over them.

    Args:
        pid: the holder's process.
        nodes: the nodes it holds.
        connected: those connected now (a node not connected is connected again on its next command).
        idle_s: it ends after this many seconds without a command.
        already: it was there before the call (holding the same nodes, the same way).
        failed: node -> why it could not be connected when the holder started.
    """

    pid: int
    nodes: list[str]
    connected: list[str]
    idle_s: float
    already: bool = False
    failed: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of_status(cls, status: dict) -> Held:
        """The holder that answered *status* (:func:`ddpfab.remote.holder.status`'s validated
        reply): one that was there before the call."""
        return cls(status["pid"], [str(n) for n in status["nodes"]], [str(n) for n in status["connected"]],
                   float(status["idle_s"]), already=True)

    @property
    def ok(self) -> bool:
        """Every node was connected."""
        return not self.failed

    @property
    def problems(self) -> list[Problem]:
        """Each node not connected, and why."""
        return [Problem(n, "hold", found=why, text=f"host {n}: not connected now ({why})")
                for n, why in self.failed.items()]


@dataclass
class Emitted:
    """What :meth:`Cluster.emit` wrote.

    Args:
        plan: the plan the scripts start.
        files: the files written (a script per node, ``ssh_config``, ``README.txt``).
        manifest: the run's record (None for an offline plan: its scripts run the launch itself,
            without ddpfab's node supervisor, and no record is kept).
    """

    plan: Plan
    files: list[Path]
    manifest: Path | None
    ok: bool = True
    problems: list[Problem] = field(default_factory=list)


def _ended_here(manifest: dict) -> dict[str, int | None] | None:
    """node -> its exit code, from a run's record (data: read, never trusted for more) when that
    says the run ended here (its closing was recorded); None while it runs or was detached."""
    nodes = manifest.get("nodes")
    if manifest.get("state") not in ("succeeded", "failed", "interrupted") or not isinstance(nodes, dict):
        return None
    return {str(n): (v["exit_code"] if isinstance(v, dict) and type(v.get("exit_code")) is int else None)
            for n, v in nodes.items()}


def _warm(method: Callable) -> Callable:
    """A :class:`Cluster` method whose node work goes over ``ddpfab hold``'s connections where a
    holder holds this cluster's nodes the same way (:mod:`ddpfab.remote.heldconn`); cold
    connections otherwise, and for what needs more of SSH than a command's channel."""
    @functools.wraps(method)
    def warm(self: Cluster, *args: Any, **kwargs: Any) -> Any:
        with self.held_connections():
            return method(self, *args, **kwargs)
    return warm


class Cluster:
    """The nodes of one inventory group and how to reach them; the pipelines as methods.

    Args:
        parsed: the parsed inventory (:class:`ddpfab.hosts.inventory.Inventory`, whose ``nodes`` are
            the nodes in rank order).
        inventory: what it was loaded from (for the commands ddpfab prints back).
        ssh_config: an ssh_config file to read (None: ~/.ssh/config).
        known_hosts: the known_hosts file (None: the inventory's, else ~/.ssh/known_hosts).
        accept_new_host_keys: trust and record host keys not yet known (a changed key is refused).
        say: where ddpfab's own lines go (default: ``ddpfab: ...`` on stderr).
    """

    def __init__(self, parsed: inventory.Inventory, *, inventory: str | list[str] | None = None,
                 ssh_config: str | None = None, known_hosts: str | None = None,
                 accept_new_host_keys: bool = False, say: Say = stderr_say, limit: str | None = None,
                 extra_vars: Iterable[str | Mapping] = ()):
        self.parsed = parsed
        #: how the nodes were chosen beyond the inventory and group: a run records them for replay
        self.limit, self.extra_vars = limit, tuple(extra_vars)
        self.inventory = inventory
        self.ssh_config, self.known_hosts, self.accept_new_host_keys = ssh_config, known_hosts, accept_new_host_keys
        self.say = say

    @classmethod
    def load(cls, inventory_source: str | os.PathLike | Iterable[str | os.PathLike], group: str | None = None,
             limit: str | None = None, ssh_config: str | None = None, extra_vars: Iterable[str] = (),
             accept_new_host_keys: bool = False, known_hosts: str | None = None, say: Say = stderr_say) -> Cluster:
        """The nodes of *group* (default ``all``) of the inventory (a path, a host list, several:
        merged in order), *limit* (an Ansible pattern) and *extra_vars* (``-e``) applied."""
        source = ([os.fspath(s) for s in inventory_source]
                  if not isinstance(inventory_source, (str, os.PathLike)) else [os.fspath(inventory_source)])
        extra_vars = tuple(extra_vars)  # (an iterator is read once: the run records them too)
        parsed = inventory.load(source, group or "all", limit=limit, extra_vars=extra_vars)
        for line in parsed.warnings:  # a mistyped variable: it has no effect
            say(f"warning: {line}")
        return cls(parsed, inventory=source, ssh_config=ssh_config, known_hosts=known_hosts,
                   accept_new_host_keys=accept_new_host_keys, say=say, limit=limit, extra_vars=extra_vars)

    @property
    def names(self) -> list[str]:
        return [n.name for n in self.parsed.nodes]

    @property
    def policy(self) -> HostKeyPolicy:
        return HostKeyPolicy(known_hosts=self.known_hosts, accept_new=self.accept_new_host_keys)

    def targets(self, nodes: inventory.Inventory | None = None) -> dict:
        """How each node is reached (:mod:`ddpfab.remote.target`), for the ssh lines a plan prints."""
        return resolve_all((nodes or self.parsed).nodes, self.policy, self.ssh_config)

    # -- check, sync, exec ------------------------------------------------------------------
    @_warm
    def check(self, *, master_port: int | None = None, nproc_per_node: int | str | None = None,
              max_skew: float | None = None, fast: bool = False, exhaustive: bool = False,
              resource_floors: str | None = None):
        """``ddpfab check``: the :class:`ddpfab.health.check.Report` (``.failures`` empty: ready)."""
        # slow to import: see LAZY above
        from ddpfab.health.check import CheckOptions, check_cluster

        planmod.master_port(master_port, offline=True)  # the port's one rule, before any host is contacted
        planmod.nproc_per_node(nproc_per_node)  # run's rule, as for the port
        return check_cluster(self.parsed, self.policy, CheckOptions(
            master_port=master_port, nproc_per_node=nproc_per_node,
            max_skew_s=CheckOptions.max_skew_s if max_skew is None else max_skew,
            full=not fast, exhaustive=exhaustive, floors=resourcecheck.parse_floors(resource_floors)), self.ssh_config)

    @_warm
    def sync(self, path: str | os.PathLike = ".", *, fanout: str = "star", compress: bool = False,
             checksum: bool = False, keep: Iterable[str] = (), with_git: bool = False, verify_only: bool = False,
             adopt: bool = False, dry_run: bool = False, wait: bool = True, runs_dir: str | os.PathLike | None = None,
             progress: Say | None = None, include_keys: bool = False):
        """``ddpfab sync``: the :class:`ddpfab.transfer.sync.SyncResult`; SyncError when refused. The
        run records (*runs_dir*, default :func:`runs_dir_default`) are never sent, as a run's sync
        leaves them out. Private keys are left out, said in one line, unless *include_keys*."""
        # slow to import: see LAZY above
        from ddpfab.transfer.sync import LOCK_WAIT_S, SyncError, runs_keep, sync_cluster

        keep = (*keep, *runs_keep(path, runs_dir_default() if runs_dir is None else runs_dir))
        try:
            result = sync_cluster(self.parsed, path, self.policy, fanout=fanout, compress=compress,
                                  ssh_config=self.ssh_config, checksum=checksum, keep=keep, with_git=with_git,
                                  verify_only=verify_only, adopt=adopt, dry_run=dry_run,
                                  lock_wait=LOCK_WAIT_S if wait else 0, progress=progress, include_keys=include_keys,
                                  no_wait=option("wait", False))
        except SyncError as exc:
            self._say_left_out(exc.result.left_out if exc.result else [])
            raise
        self._say_left_out(result.left_out)
        return result

    def _left_out_here(self, opts: Options) -> list[str]:
        """The private keys a run's sync from here would leave out (its selection, made here)."""
        # slow to import: see LAZY above
        from ddpfab.transfer import sync as syncmod

        try:
            return syncmod.select(os.getcwd(), syncmod.runs_keep(os.getcwd(), opts.runs_dir),
                                  include_keys=opts.include_keys).left_out
        except syncmod.SyncError as exc:
            raise PlanError(str(exc.problems[0])) from None

    def _say_left_out(self, paths: list[str]) -> None:
        """The one line about the private keys a sync left out (:mod:`ddpfab.transfer.keys`), if any:
        said whether or not progress lines are, since the user may expect them on the nodes."""
        if paths:
            # slow to import: see LAZY above
            from ddpfab.transfer.keys import left_out_line

            self.say(left_out_line(paths))

    def exec(self, cmd: str | Iterable[str], *, nodes: Iterable[str] | None = None, timeout: float | None = None,
             printer: Printer | None = None, color: bool | None = None) -> GroupResult:
        """``ddpfab exec``: *cmd* on every node (or *nodes*) at once, output prefixed per host on
        *printer* (a :class:`ddpfab.remote.output.Printer`; default: stdout). A string is run by
        the remote shell as is; a list of words is quoted. Node ->
        :class:`ddpfab.remote.output.HostResult` (``exit_code``, ``error``)."""
        # the held path imports no SSH stack (paramiko: a third of its start): see LAZY above
        from ddpfab.remote.holder import exec_held
        from ddpfab.remote.output import LinePrinter, remote_command

        command = remote_command([cmd] if isinstance(cmd, str) else list(cmd))
        chosen = list(self.parsed.nodes)
        if nodes is not None:
            wanted = list(nodes)
            if not wanted:  # `--nodes ,,`: running on nobody is not a success
                raise inventory.InventoryError(f"{option('nodes')} names no node (nodes: {', '.join(self.names)})")
            unknown = [w for w in wanted if w not in self.names]
            if unknown:
                raise inventory.InventoryError(
                    f"{option('nodes')}: {', '.join(unknown)} not in group {self.parsed.group} of "
                    f"{self.parsed.source} (nodes: {', '.join(self.names)})")
            chosen = [n for n in chosen if n.name in wanted]
        printer = printer or LinePrinter([n.name for n in chosen], color=color)
        # the connections `ddpfab hold` keeps open, when it holds these nodes as given: no handshakes
        held = exec_held(self._holder_name(), chosen, command, printer, timeout)
        if held is not None:
            return GroupResult(held)
        from ddpfab.remote.command import exec_all  # cold: the SSH stack after all

        return GroupResult(exec_all(chosen, command, self.policy, self.ssh_config, printer, timeout))

    @_warm
    def fetch(self, remote_path: str, local_dir: str | os.PathLike = ".", *, node: str | None = None,
              rank: int | None = None, overwrite: bool = False) -> Fetched:
        """``ddpfab fetch``: copy *remote_path* (relative to the node's workdir, or absolute inside
        it or its run dirs) from *node* (or node rank *rank*; default: rank 0) into *local_dir*.

        Raises:
            FetchError: a bad choice or path (nothing contacted), or the copy failed (``.code``: the
                exit code the command line gives).
        """
        # the SSH stack: see LAZY above
        from ddpfab.transfer.fetch import check_local_dir, fetch, pick_node

        chosen = pick_node(self.parsed, node, rank)
        check_local_dir(local_dir)
        got = fetch(chosen, remote_path, local_dir, self.policy, ssh_config=self.ssh_config, overwrite=overwrite)
        return Fetched(got["node"], got["path"], got["local"], got["kind"], got["files"], got["bytes"])

    def _each_node(self, fn: Callable[[Any, Any], Any]) -> GroupResult:
        """``fn(connection, node)`` on every node at once, each over a connection of its own, closed
        after; node -> its result, or the exception it raised (a node that cannot be reached is one
        failure among the results)."""
        from ddpfab.remote import ssh  # the SSH stack: see LAZY above

        return ssh.on_each(self.parsed.nodes, self.policy, self.ssh_config, fn)

    # -- warm connections -------------------------------------------------------------------
    def _holder_name(self) -> str:
        from ddpfab.remote import holder  # (light: no SSH stack)

        return holder.address(self.inventory or [], self.ssh_config, self.policy)

    @contextmanager
    def held_connections(self) -> Iterator[None]:
        """Within: :func:`ddpfab.remote.ssh.connect` reaches the nodes this cluster's holder
        (``ddpfab hold``) holds over its connections, as every method here does; cold elsewhere."""
        from ddpfab.remote import heldconn, holder  # (light: the SSH stack comes with the node work)
        from ddpfab.remote import ssh

        name = self._holder_name() if self.inventory else None
        status = holder.status(name) if name else None
        if name is None or status is None:
            yield
            return
        with ssh.warm_through(heldconn.factory(name, status["prints"], self.policy, self.ssh_config)):
            yield

    def held(self) -> Held | None:
        """``ddpfab hold --status``: this cluster's holder (same inventory, ssh_config and host-key
        policy), or None when there is none."""
        from ddpfab.remote import holder

        status = holder.status(self._holder_name())
        if status is None:
            return None
        return Held.of_status(status)

    def hold(self, *, idle: float | None = None) -> Held:
        """``ddpfab hold``: start a process that connects every node once and keeps the connections
        open; :meth:`exec` (and ``ddpfab exec`` with the same inventory) runs over them until it
        ends, after *idle* seconds without a command (default 900) or :meth:`release`. A holder
        of the same nodes, held the same way, is kept; one that holds them otherwise (other
        variables, hosts, idle limit) is replaced.

        Raises:
            PlanError: *idle* is not a number of seconds above 0.
            HolderError: the holder could not start (what it said, or how it ended); or the one
                to replace did not end.
        """
        from ddpfab.remote import holder

        if idle is not None and not (isinstance(idle, (int, float)) and 0 < idle < float("inf")):
            raise PlanError(f"idle {idle!r}: give a number of seconds above 0")
        if not self.inventory:
            raise PlanError("hold needs the inventory's sources: load the cluster with Cluster.load")
        idle = float(idle) if idle is not None else holder.IDLE_S
        name = self._holder_name()
        wanted = {n.name: holder.fingerprint(n) for n in self.parsed.nodes}
        status = holder.status(name)
        if status is not None:
            if status["prints"] == wanted and status["idle_s"] == idle:
                return Held.of_status(status)
            self.say(f"the holder (pid {status['pid']}) holds these nodes otherwise (other variables, hosts or "
                     "idle limit); starting a new one")
            self._end_holder(name, status["pid"])
            self.say(f"stopped the holder (pid {status['pid']}); its connections are closed")
        spec = {"name": name, "inventory": [os.fspath(s) for s in ([self.inventory] if isinstance(
                    self.inventory, (str, os.PathLike)) else self.inventory)],
                "group": self.parsed.group, "limit": self.limit,
                "extra_vars": [dict(e) if isinstance(e, Mapping) else str(e) for e in self.extra_vars],
                "ssh_config": self.ssh_config, "known_hosts": self.known_hosts,
                "accept_new": self.accept_new_host_keys, "idle_s": idle}
        try:
            msg = holder.start(spec)
        except holder.HolderError as exc:
            taken = holder.status(name) if exc.taken else None
            if taken is None:  # else another hold of this inventory started it at the same moment
                raise
            return Held.of_status(taken)
        failed = {str(k): str(v) for k, v in (msg.get("failed") or {}).items()}
        return Held(int(msg["pid"]), self.names, [n for n in self.names if n not in failed], idle, failed=failed)

    def release(self) -> Held | None:
        """``ddpfab hold --stop``: end this cluster's holder and wait until its process has (its
        connections closed); what it held, or None when there was none.

        Raises:
            HolderError: it did not end (its pid is in the message).
        """

        held = self.held()
        if held is not None:
            self._end_holder(self._holder_name(), held.pid)
        return held

    @staticmethod
    def _end_holder(name: str, pid: int) -> None:
        from ddpfab.remote import holder

        if not holder.stop(name, pid):
            raise holder.HolderError(f"the holder (pid {pid}) did not end; end it with `kill {pid}`")

    @_warm
    def ps(self, *, runs_dir: str | os.PathLike | None = None) -> Jobs:
        """``ddpfab ps``: every job the nodes' supervisors know (every user's GPU leases too), each
        node asked over a connection of its own; a node that cannot be asked is a problem, the
        others are listed. *runs_dir*: where local records say which runs are attempts."""
        # the SSH stack: see LAZY above
        from ddpfab.launch.jobs import list_runs, node_problem, ps_record
        from ddpfab.launch.runs import RunRecordError, read_record
        from ddpfab.planning import gpu_leases
        from ddpfab.remote import nodeprogram

        root = os.fspath(runs_dir if runs_dir is not None else runs_dir_default())
        gpus: dict[str, list] = {}

        def ask(conn, node) -> tuple[float, list[dict]]:
            res = nodeprogram.call(conn, node, {"op": "ps", "root": "~/.ddpfab/runs", "leases": True},
                                   timeout=20)[0].value(node.name)
            gpus[node.name] = gpu_leases.parse(res.get("leases")) or []
            return float(res["now"]), [ps_record(r) for r in res["runs"]]

        warnings: list[str] = []

        def local(run_id: str) -> dict:
            try:
                return read_record(root, run_id) or {}
            except RunRecordError as exc:  # the nodes' listing stands without it
                warnings.append(str(exc))
                return {}

        results = self._each_node(ask)
        rows = list_runs(results.succeeded, local)
        return Jobs(rows, {n: gpus[n] for n in self.names if gpus.get(n)},
                    [node_problem(name, exc) for name, exc in results.failed.items()], warnings)

    @_warm
    def stop(self, run_id: str, *, runs_dir: str | os.PathLike | None = None, record: dict | None = None) -> Stopped:
        """``ddpfab stop RUN_ID``: end the job on every node of this cluster (its supervisor, then
        what is left of the job by its marker); a node that cannot be reached does not keep it
        running on the others. A detached run with restarts gets no more attempts.

        Args:
            run_id: the run (with restarts: its latest attempt is stopped).
            runs_dir: where the run records are (default: as the command line's ``--runs-dir``).
            record: the run's record (its latest attempt's), read after its restarts' supervisor was
                stopped (:func:`ddpfab.launch.recover.stop_supervisor`); None: both done here (a run
                with no local record is stopped by its run id: its node dirs by the default rule).

        Raises:
            RunRecordError: the local record of *run_id* is not a run record.
        """
        # the SSH stack: see LAZY above
        from ddpfab.launch.execute import STOP_GRACE_S
        from ddpfab.launch.jobs import node_problem, node_run_dir
        from ddpfab.launch.recover import current_manifest, stop_supervisor
        from ddpfab.launch.runs import read_record
        from ddpfab.remote import nodeprogram

        root = os.fspath(runs_dir if runs_dir is not None else runs_dir_default())
        supervisor = ""
        if record is None:  # no more attempts start, then the latest one is read
            supervisor = stop_supervisor(root, run_id) or ""
            record = read_record(root, run_id)
            record = current_manifest(root, record) if record else None
        manifest = record
        latest = (manifest or {}).get("run_id", run_id)
        closed = ""
        if (manifest or {}).get("tmux"):  # a --tmux run: its windows' launches end with the session
            from ddpfab.launch import tmuxrun

            closed = tmuxrun.close_session(str(manifest["tmux"]), tmuxrun.recorded_socket(manifest))

        def stop(conn, node) -> nodeprogram.StopReply:
            return nodeprogram.stop(conn, node, node_run_dir(node.name, manifest, latest), STOP_GRACE_S, timeout=30)

        results = self._each_node(stop)
        said = {n: f"not stopped: {exc.found if isinstance(exc, NodeError) else exc}"
                for n, exc in results.failed.items()}
        said.update({n: r.said for n, r in results.succeeded.items()})
        left = [n for n in self.names if n in results.failed or not results.succeeded[n].stopped]
        found = manifest is not None or bool(supervisor or closed or results.failed) or any(
            r.known for r in results.succeeded.values())
        return Stopped(latest, {n: said[n] for n in self.names if n in said}, left, supervisor,
                       [node_problem(n, exc) for n, exc in results.failed.items()], closed, found)

    @_warm
    def logs(self, run_id: str, *, runs_dir: str | os.PathLike | None = None, ranks: bool = False,
             record: dict | None = None) -> Logs:
        """``ddpfab logs RUN_ID``: each node's output of the run, copied to ``RUNS_DIR/RUN_ID/``, each
        node over a connection of its own; a node whose output cannot be copied is a problem, the
        others' is copied.

        Args:
            run_id: the run (an attempt's id for one attempt of a run with restarts).
            runs_dir: where the run records are (default: as the command line's ``--runs-dir``); the
                record, when there is one, names each node's run dir.
            ranks: also torchrun's per-rank logs, to ``RUNS_DIR/RUN_ID/ranks/NODE/``.
            record: the run's record, already read with :func:`ddpfab.launch.runs.read_record`.

        Raises:
            RunRecordError: a record of *run_id* that is not a run record.
        """
        from ddpfab.launch.jobs import fetch_node_log, node_problem
        from ddpfab.launch.runs import read_record

        root = os.fspath(runs_dir if runs_dir is not None else runs_dir_default())
        manifest = record if record is not None else read_record(root, run_id)
        dest = Path(root) / run_id
        results = self._each_node(lambda conn, node: fetch_node_log(conn, node, manifest, run_id, dest, ranks))
        got = {n: results.succeeded[n] for n in self.names if n in results.succeeded}
        tmux = isinstance((manifest or {}).get("tmux"), str)  # its output is the per-rank logs
        return Logs(run_id, dest, {n: g[0] for n, g in got.items()}, {n: g[1] for n, g in got.items()},
                    {n: g[2] for n, g in got.items() if ranks or tmux},
                    [node_problem(n, exc, "copy its output", "logs") for n, exc in results.failed.items()])

    @_warm
    def doctor(self, run_id: str, *, runs_dir: str | os.PathLike | None = None,
               timeout: float | None = None, record: dict | None = None) -> Diagnosis:
        """``ddpfab doctor RUN_ID``: every rank's state and stack on this cluster's nodes, the odd
        ones out named; the record written under ``RUNS_DIR/RUN_ID``.

        Args:
            run_id: a run started from here (its record in *runs_dir*; with restarts, its latest
                attempt is diagnosed).
            runs_dir: where the run records are (default: as the command line's ``--runs-dir``).
            timeout: seconds each node gets to answer.
            record: the run's record, already read with :func:`ddpfab.launch.runs.read_record`
                (its latest attempt's), so that it is not read again.

        Raises:
            RunRecordError: no record of *run_id* in *runs_dir*, or one that is not a run record.
        """
        # the SSH stack: see LAZY above
        from ddpfab.health import doctor as doctormod
        from ddpfab.launch.recover import current_manifest
        from ddpfab.launch.runs import RunRecordError, read_record, record_plan
        from ddpfab.problems import NodeError
        from ddpfab.remote import nodeprogram, ssh

        root = os.fspath(runs_dir if runs_dir is not None else runs_dir_default())
        manifest = record if record is not None else current_manifest(root, read_record(root, run_id))
        if manifest is None:
            raise RunRecordError(f"no local record of run {run_id} in {root}")
        plan = record_plan(manifest, root, "doctor")
        hosts = {n.name: n for n in self.parsed.nodes}

        def call(node, request: dict, wait: float) -> dict:
            # one connection per node, its own: a node that cannot be reached is one answer among the others
            if node.name not in hosts:
                raise NodeError(node.name, f"host {node.name}: not in the inventory given", "doctor",
                                found="not in the inventory given")
            conn = ssh.connect(hosts[node.name], self.policy, self.ssh_config)
            try:
                return nodeprogram.call(conn, node, request, timeout=wait)[0].value(node.name)
            finally:
                conn.close()

        verdict, path = doctormod.diagnose(plan, call, Path(root) / plan.run_id,
                                           timeout=timeout or doctormod.NODE_TIMEOUT_S, recorded=_ended_here(manifest))
        return Diagnosis(plan.run_id, doctormod.render(verdict), verdict.hung, verdict.ended, verdict.odd, path)

    @classmethod
    def replay(cls, run_id: str, *, runs_dir: str | os.PathLike | None = None,
               inventory: str | list[str] | None = None, group: str | None = None, env: Iterable[str] = (),
               extra_vars: Iterable[str] = (), same_port: bool = False, force: bool = False,
               new_run_id: str | None = None, dry_run: bool = False, ssh_config: str | None = None,
               known_hosts: str | None = None, accept_new_host_keys: bool = False, say: Say = stderr_say,
               out: TextIO | None = None, color: bool | None = None,
               on_plan: Callable[[Plan, dict], object] | None = None) -> Replayed:
        """``ddpfab replay RUN_ID``: run a recorded run again under a new run id, on the nodes it
        ran on (or *inventory*/*group*'s), with its recorded options; what would not be the same
        run is refused before anything starts.

        Args:
            run_id: the recorded run (with restarts: its latest attempt is replayed).
            runs_dir: where the run records are (default: as the command line's ``--runs-dir``).
            inventory, group: instead of the recorded ones.
            env: ``K=V``: a masked (secret) value given again, or one replaced.
            extra_vars: the same for the run's masked ``-e`` values.
            same_port: the recorded master port or refuse (default: it if free, else a free one).
            force: replay though the inventory, the code or the plan changed (each is said).
            new_run_id: the new run's id (default: time + random suffix).
            dry_run: plan only: the nodes are probed, nothing starts, nothing is recorded.
            on_plan: called with the plan and its SSH targets before anything starts, when the
                plan differs from the recorded one or on a dry run (the command line prints it).

        Raises:
            ReplayRefused: the replay would not be the same run (its ``plan``, when one was made).
            ManifestError, InventoryError, PlanError: a record or input that cannot be replayed.
            RunError: a problem on the nodes; nothing started.
        """
        # slow to import: see LAZY above
        from ddpfab.launch import rerun
        from ddpfab.launch.execute import Printer

        root = os.fspath(runs_dir if runs_dir is not None else runs_dir_default())
        replaying = rerun.prepare(run_id, root, inventory_source=inventory, group=group, env=env,
                                  extra_vars=extra_vars, same_port=same_port, force=force, new_id=new_run_id,
                                  ssh_config=ssh_config, say=say,
                                  policy=HostKeyPolicy(known_hosts=known_hosts, accept_new=accept_new_host_keys))
        plan = replaying.plan
        if replaying.changed or dry_run:
            for line in replaying.changed:
                say(f"differs from the recorded plan: {line}")
            if on_plan is not None:
                on_plan(plan, replaying.prepared.targets())
        if dry_run or (replaying.changed and not force):
            replaying.close()
            if not dry_run:
                raise rerun.ReplayRefused([f"replay of {run_id} refused: what its options plan now differs from the "
                                           f"plan it recorded (above); nothing was started; {option('force', True)} "
                                           "runs the plan shown"])
            return Replayed(plan.run_id, 0, plan, of=run_id, changed=replaying.changed)
        result, path = replaying.run(root, Printer(plan, stream=out, color=color))
        return Replayed(plan.run_id, result.exit_code, plan, dict(result.outcomes), path, result.summary,
                        result.first_failure, of=run_id, changed=replaying.changed)

    # -- plan and run -----------------------------------------------------------------------
    @_warm
    def plan(self, script: str, args: Iterable[str] = (), options: Options | None = None, **given: Any) -> Plan:
        """``ddpfab plan``: the plan ``run`` would make (probing the nodes for a free port and the
        preflight, unless ``offline=True``); nothing is started. The options as keywords, or as
        an :class:`Options` (what the command line passes)."""
        opts = _options(options, given)
        run_options = planner_options(script, args, opts)
        if opts.offline:
            return self._offline_plan(self.parsed, run_options, opts)
        # slow to import: see LAZY above
        from ddpfab.launch import runner

        prepared = runner.prepare(self.parsed, run_options, self.policy, self.ssh_config, preflight=opts.check)
        prepared.close()
        return prepared.plan

    @_warm
    def emit(self, script: str, args: Iterable[str] = (), options: Options | None = None, *,
             directory: str | os.PathLike, force: bool = False, **given: Any) -> Emitted:
        """``ddpfab plan --emit DIR``: the plan as a script per node in *directory*, to start by hand.
        Each script starts the node's supervisor with the job, as ``run`` does, and the run is
        recorded now (in ``runs_dir``), so ``ps``, ``stop``, ``logs``, ``attach`` and ``doctor``
        see the job once its scripts run; offline, the scripts run the launch itself, unrecorded.

        Raises:
            PlanError: as :meth:`plan`, or a runs dir the record cannot go to, or a run id in use.
            EmitError: *directory* cannot take the scripts (:mod:`ddpfab.planning.emit`).
        """
        from ddpfab.planning import emit as emitmod

        opts = _options(options, given)
        run_options = planner_options(script, args, opts)
        if opts.offline:
            plan = self._offline_plan(self.parsed, run_options, opts)
            return Emitted(plan, emitmod.write(plan, directory, self.targets(), force=force), None)
        # slow to import: see LAZY above
        from ddpfab.launch import handrun, runner

        root = os.fspath(opts.runs_dir)
        why = runs_dir_problem(root, writable=True)
        if why:
            raise PlanError(f"{option('runs_dir', root)}: {why}: the emitted job's record goes there (another "
                            f"with {option('runs_dir')} or DDPFAB_RUNS_DIR)")
        if os.path.lexists(os.path.join(root, run_options.run_id)):
            raise PlanError(f"{option('run_id', run_options.run_id)}: {os.path.join(root, run_options.run_id)} "
                            f"exists already: a run id names one run; pick another (or leave {option('run_id')} out)")
        prepared = runner.prepare(self.parsed, run_options, self.policy, self.ssh_config, preflight=opts.check)
        prepared.close()
        plan = prepared.plan
        manifest = runner.record_emitted(prepared, root, directory, self._selection())  # no script without its record
        try:
            files = emitmod.write(plan, directory, self.targets(), force=force,
                                  bodies={n.name: handrun.script_body(plan, n) for n in plan.nodes})
        except BaseException:  # no record of scripts that were not written: the record dir is ddpfab's own
            shutil.rmtree(manifest.parent, ignore_errors=True)
            raise
        return Emitted(plan, files, manifest)

    @_warm
    def run(self, script: str, args: Iterable[str] = (), options: Options | None = None, *,
            out: TextIO | None = None, supervise: Callable[[str], int] | None = None, **given: Any) -> RunOutcome:
        """``ddpfab run``: sync (unless ``sync=False``), probe, preflight, plan, start on every node,
        stream the output (prefixed, to *out*), record. Returns when the job has ended (``detach``:
        once it started; ``dry_run``: with the plan, nothing started).

        *supervise*: for ``detach`` with job restarts, which a process of its own must supervise:
        called with the run id, it starts that process and returns an exit code (the command line
        runs itself again); without it such a run is refused."""
        opts = _options(options, given)
        # slow to import: see LAZY above
        from ddpfab.launch import recover, runner

        ropts = recover.recovery_options(opts, self.parsed)
        nodes, spares = recover.split_spares(self.parsed, ropts.spares_group)  # spares never start in the set
        recover.check_sizes(ropts, len(nodes.nodes), len(spares))
        run_options = planner_options(script, args, opts)
        self._refuse_before_contact(opts, run_options)
        paths = replicate.wanted(nodes, opts.replicate)
        opts = replace(opts, replicate=paths)
        if opts.dry_run and opts.offline:
            plan = self._offline_plan(nodes, run_options, opts)
            for path in paths:
                self.say(f"replicate (offline, not looked at on the hosts): {path} from {plan.nodes[0].name} "
                         "(rank 0's node) to the other nodes, where it differs")
            return RunOutcome(plan.run_id, 0, plan)
        if opts.recovering and opts.detach and not recover.is_supervisor():
            if supervise is None:
                raise PlanError("detach with job restarts: the restarts are supervised by a process of their own; "
                                "start it with `ddpfab run --detach`")
            code = supervise(run_options.run_id)
            return RunOutcome(run_options.run_id, code, None, manifest=self._manifest(opts, run_options.run_id))
        perf = self._perf_check(nodes, opts, run_options.env)
        if opts.recovering and not opts.dry_run:
            code = recover.Recovery(nodes, spares, run_options, ropts, self.policy, self.ssh_config, opts.runs_dir,
                                    lambda cl, o: self.prepare(cl, o, opts), runner.run, color=opts.color,
                                    out=out, verbose=opts.verbose).run()
            return RunOutcome(run_options.run_id, code, None, manifest=self._manifest(opts, run_options.run_id))
        prepared, extra = self.prepare(nodes, run_options, opts)
        if spares:  # the nodes are the group without its spares: replay, stop and logs must know
            extra.update(spares_group=ropts.spares_group, attempt_nodes=[n.name for n in nodes.nodes])
        if perf:
            extra["perf"] = perf
        if opts.dry_run:
            prepared.close()
            return RunOutcome(prepared.plan.run_id, 0, prepared.plan)
        return self._start(prepared, opts, extra, out)

    def _start(self, prepared: Prepared, opts: Options, extra: dict, out: TextIO | None) -> RunOutcome:
        """Start the prepared run (detached, in tmux, or attached) and close its connections."""
        from ddpfab.launch import runner  # slow to import: see LAZY above
        from ddpfab.launch.execute import Printer

        printer = Printer(prepared.plan, stream=out, color=opts.color, verbose=opts.verbose)
        try:
            if opts.detach:
                code = runner.start_detached(prepared, opts.runs_dir, printer, extra=extra)
                if code == 0:
                    self._say_where_rank0_is(prepared.plan)
                return RunOutcome(prepared.plan.run_id, code, prepared.plan,
                                  manifest=self._manifest(opts, prepared.plan.run_id))
            start = runner.run_tmux if opts.tmux else runner.run
            result, path = start(prepared, opts.runs_dir, printer, extra=extra)
        finally:
            prepared.close()
        if result.exit_code == 0 or result.interrupted:  # after a failure the closing line stays the last
            self._say_where_rank0_is(prepared.plan)
        return RunOutcome(prepared.plan.run_id, result.exit_code, prepared.plan, dict(result.outcomes), path,
                          result.summary, result.first_failure)

    def _refuse_before_contact(self, opts: Options, run_options: planmod.RunOptions) -> None:
        """What a run refuses before any node is contacted (PlanError): options that do not go
        together, a runs dir or run id it cannot record in, a source dir or script it will not
        sync. The dry run refuses the same: it is the real run minus starting."""
        if opts.wait and opts.detach:
            raise PlanError(f"{option('wait')} with {option('detach')}: a waiting job starts on every node when "
                            "ddpfab, attached, has seen each node's leases granted; run it attached (in tmux, or with "
                            "nohup)")
        if opts.debugpy and opts.detach:
            raise PlanError(f"{option('debugpy')} with {option('detach')}: the ports reach the nodes over this run's "
                            "connections; run it attached")
        from ddpfab.launch import tmuxrun  # slow to import: see LAZY above

        # options that never go together first: fixing the input would only meet this refusal next
        tmuxrun.refuse(opts.tmux, detach=opts.detach, pdb=opts.pdb, debugpy=opts.debugpy, wait=opts.wait,
                       gpus_per_node=opts.gpus_per_node, max_job_restarts=opts.recovering)
        planmod.check_own_options(run_options)  # (a value's spelling: before the copy, not after it)
        if not opts.dry_run and not opts.detach:
            refuse_without_input(opts.pdb)
        record = os.path.join(opts.runs_dir, run_options.run_id)
        why = runs_dir_problem(opts.runs_dir, writable=not opts.dry_run)
        if why:
            raise PlanError(f"{option('runs_dir', opts.runs_dir)}: {why}: each run's record goes there (another "
                            f"with {option('runs_dir')} or DDPFAB_RUNS_DIR)")
        if not opts.dry_run and os.path.lexists(record):
            raise PlanError(f"{option('run_id', run_options.run_id)}: {record} exists already: a run id names one "
                            f"run; pick another (or leave {option('run_id')} out)")
        if opts.sync:  # the dry run too: the real run refuses it before starting
            why = source_problem(os.getcwd())
            if why:
                raise PlanError(why)
            check_script_here(run_options.script, run_options.module)
            if opts.dry_run:  # what the real run's sync would leave out, said as it would
                self._say_left_out(self._left_out_here(opts))

    def prepare(self, nodes: inventory.Inventory, run_options: planmod.RunOptions, opts: Options):
        """One attempt's start: connect, sync the code (unless ``sync=False`` or a dry run), probe,
        preflight, plan, replicate. Returns (Prepared, manifest extra); raises RunError with
        nothing started. (The step :class:`ddpfab.launch.recover.Recovery` repeats per attempt.)"""
        # slow to import: see LAZY above
        from ddpfab.launch import runner

        attached = not (opts.dry_run or opts.detach or opts.tmux)  # its supervisors may be the probe's programs
        opened = runner.connect_and_start(nodes, self.policy, self.ssh_config,
                                          run_id=run_options.run_id if attached else None)
        conns, probing = opened.conns, None
        try:  # one node program per node for the whole preparation: facts, hash, mesh in one session
            probing = runner.start_probe(nodes, conns, run_options, os.getcwd(), preflight=opts.check, opened=opened)
            code = None if opts.dry_run or not opts.sync else self._sync_code(nodes, opts, conns, probing.sessions)
        except BaseException:
            if probing:
                probing.close(wait=0)
            for c in conns.values():
                c.close()
            raise
        copied = bool(code) and any(n.get("source") != "unchanged" for n in code.get("nodes", {}).values())
        prepared = runner.prepare(nodes, run_options, self.policy, self.ssh_config, preflight=opts.check, conns=conns,
                                  probing=probing, synced=copied, replicate_paths=tuple(opts.replicate),
                                  will_sync=opts.dry_run and opts.sync)
        extra = {"code": code} if code else {}
        extra.update(self._selection())
        for w in planmod.socket_ifname_warnings(prepared.cluster, run_options, runner.plan_facts(
                prepared.facts, prepared.plan.master_port, os.getcwd())):
            self.say(f"warning: {w}")
        try:
            replicated = self._replicate(prepared, tuple(opts.replicate), opts.dry_run)
        except BaseException:
            prepared.close()
            raise
        if replicated:
            extra["replicate"] = replicated
        return prepared, extra

    # -- the steps of a run -----------------------------------------------------------------
    def _selection(self) -> dict:
        """``--limit`` and ``-e`` as the manifest records them, for replay to choose the same nodes
        with the same variables (a secret's value masked by its key: replay asks for it again)."""
        out: dict[str, Any] = {"limit": self.limit} if self.limit else {}
        if self.extra_vars:
            out["extra_vars"] = recordable(inventory.parse_extra_vars(self.extra_vars))
        return out

    def _offline_plan(self, nodes: inventory.Inventory, run_options: planmod.RunOptions, opts: Options) -> Plan:
        # slow to import: see LAZY above
        from ddpfab.remote.address import offline_addresses

        addresses, unresolved = offline_addresses(nodes, self.targets(nodes))
        facts = Facts(addresses=addresses, master_port=planmod.master_port(opts.master_port, offline=True),
                      cwd=os.getcwd(), unresolved=unresolved)
        return planmod.make_plan(nodes, run_options, facts)

    def _perf_check(self, nodes: inventory.Inventory, opts: Options, env) -> dict | None:
        """``perf_check``: the slow-node check first (its own job and record); the manifest's
        ``perf`` entry, or RunError on a straggler (see :func:`ddpfab.launch.perfcheck.before_run`)."""
        if not (opts.perf_check or opts.perf_check_warn) or opts.dry_run:
            return None
        # slow to import: see LAZY above
        from ddpfab.launch.perfcheck import before_run

        return before_run(nodes, self.policy, opts, env, self.ssh_config)

    def _progress(self, opts: Options) -> bool:
        """Progress lines (copies, rendezvous waits): only on a terminal, never with ``quiet``."""
        return not opts.quiet and sys.stderr.isatty()

    def _sync_code(self, nodes: inventory.Inventory, opts: Options, conns: dict, sessions: dict | None) -> dict:
        """Sync the current directory to every node and verify it by hash (before the probe, which
        checks that the script is there); the result goes into the manifest as ``code``. When every
        node has the tree already (checked in the run's node program *sessions*) nothing is started
        for it."""
        # slow to import: see LAZY above
        from ddpfab.launch import runner
        from ddpfab.transfer import sync as syncmod

        done: list[str] = []
        progress = self._progress(opts)

        def say(line: str) -> None:
            done.append(line)
            if progress:
                self.say(f"sync: {line}")

        def copying(elapsed: float) -> str:
            return f"sync: copying to {len(nodes.nodes)} nodes, {elapsed:.0f} s ({len(done)} reported)"

        keep = syncmod.runs_keep(os.getcwd(), opts.runs_dir)  # recorded: replay hashes the tree the same way
        try:
            result = syncmod.unchanged(nodes, conns, os.getcwd(), keep=keep, sessions=sessions,
                                       include_keys=opts.include_keys)
            if result is None:
                with Ticker(copying, enabled=progress):
                    result = syncmod.sync_cluster(nodes, os.getcwd(), self.policy, fanout=opts.fanout,
                                                  compress=opts.compress, ssh_config=self.ssh_config, progress=say,
                                                  conns=conns, fast=False, keep=keep, include_keys=opts.include_keys)
        except syncmod.SyncError as exc:
            self._say_left_out(exc.result.left_out if exc.result else [])
            # per node as problems (a restart leaves out the node they name) when sync got that far
            problems = exc.result.problems if exc.result else exc.problems
            if problems and all(isinstance(p, Problem) and p.check == "setup" for p in problems):
                raise runner.RunError(problems) from None  # the nodes' setup lines, which every command runs
            raise runner.RunError([replace(p, text=f"sync: {p}") if isinstance(p, Problem) else f"sync: {p}"
                                   for p in problems]
                                  + ["(to take such a directory over: `ddpfab sync --adopt`)"] * bool(exc.not_ours)
                                  + [f"(skip syncing with {option('sync', False)})"] * (not exc.stale)) from None
        self._say_left_out(result.left_out)
        return {**result.to_dict(), **({"keep": list(keep)} if keep else {})}

    def _replicate(self, prepared, paths: tuple[str, ...], dry_run: bool) -> dict | None:
        """``replicate``: copy each path from rank 0's node to the others (the dry run says what it
        would copy), after the preflight's warning about resume files that differ between nodes.
        The manifest's ``replicate`` entry, or None when there was nothing to say; RunError when a
        copy is refused or fails (nothing has started)."""
        # slow to import: see LAZY above
        from ddpfab.launch import runner

        if prepared.replicas is None:
            return None
        order = [n.name for n in sorted(prepared.plan.nodes, key=lambda n: n.node_rank)]
        warned = replicate.warnings(order, paths, prepared.replicas)
        for w in warned:
            self.say(f"warning: {w}")
        # without paths the look was for the warning alone: a node that could not answer it stops nothing
        decision = replicate.decide(order, paths, prepared.replicas) if paths else replicate.Decision()
        if decision.problems:
            raise runner.RunError([*decision.problems, "replicate: nothing was copied"])
        for path in decision.missing:
            self.say(f"replicate: {path} is not in the workdir of {order[0]} (rank 0's node): nothing to "
                     "replicate (a first run?)")
        workdirs = {n.name: n.workdir for n in prepared.plan.nodes}
        nodes = {n.name: n for n in prepared.cluster.nodes}
        for copy in decision.copies:
            if copy.to and not dry_run:
                problems = replicate.relay(copy, prepared.conns, nodes, workdirs)
                if problems:
                    raise runner.RunError([*problems, f"replicate {copy.path}: nothing was started (the nodes that "
                                                      "did not get it keep their old file)"])
            self.say(f"replicate: {replicate.describe(copy, dry_run=dry_run)}")
        if not (paths or warned):
            return None
        return replicate.record(decision, warned)

    def _say_where_rank0_is(self, plan: Plan) -> None:
        """Where results are: rank 0's workdir, and the command that brings a file back. The command
        names the node, not ``--rank 0``: fetch's ranks count the hosts its own --limit leaves, and a
        run's rank 0 is often not the inventory's first host (``-l``, spares)."""
        node = plan.nodes[0]
        inv = "".join(f" -i {shlex.quote(s)}" for s in self.inventory or ())
        self.say(f"rank 0's workdir: {node.name}:{node.workdir} (copy results here with: ddpfab fetch"
                 f"{inv} --node {shlex.quote(node.name)} PATH)")

    @staticmethod
    def _manifest(opts: Options, run_id: str) -> Path | None:
        path = Path(opts.runs_dir) / run_id / "manifest.json"
        return path if path.exists() else None


def planner_options(script: str, args: Iterable[str], opts: Options) -> planmod.RunOptions:
    """The planner's options from *opts*: one mapping, for the API and the command line."""
    # slow to import: see LAZY above
    from ddpfab.launch.runs import new_run_id

    planmod.master_port(opts.master_port, offline=True)  # the port's one rule (raises PlanError)
    resourcecheck.parse_floors(opts.resource_floors)  # the floors' one reading (FloorError is a PlanError)
    if isinstance(args, str):  # its characters would become the arguments
        raise PlanError(f"the script's arguments are a list of words, not one string: {args!r}")
    script, script_args, module = script_and_mode(script, tuple(args), opts.module)
    if module:  # the planner's rule, before the script is looked for here
        planmod.check_module_name(script)
    if not module and not script:
        raise PlanError(f"the script is an empty name: give the file to run (or a module with "
                        f"{option('module', True)})")
    local_rank_arg, to_script = local_rank_spelling(opts.local_rank_style, script, module)
    return planmod.RunOptions(
        script=script, args=script_args, nproc_per_node=opts.nproc_per_node,
        master_port=opts.master_port, env=opts.env_pairs(), max_restarts=opts.max_restarts,
        run_id=planmod.check_run_id(opts.run_id or new_run_id()), socket_ifname=opts.socket_ifname,
        rdzv=opts.rdzv, launcher=opts.launcher, init_method=opts.init_method, debug=opts.debug,
        local_rank_arg=local_rank_arg, module=module, secret_env=tuple(opts.secret_env),
        script_local_rank=to_script, gpus_per_node=opts.gpus_per_node, wait=opts.wait,
        exit_guard=opts.exit_guard, resource_floors=opts.resource_floors, hang_timeout=opts.hang_timeout,
        on_hang=opts.on_hang, pdb=opts.pdb, debugpy=opts.debugpy)


def _options(options: Options | None, given: dict[str, Any]) -> Options:
    if options is not None and given:
        raise PlanError(f"options given twice: as an Options and as {', '.join(given)}; use one way")
    return options if options is not None else Options.of(**given)


def check_script_here(script: str, module: bool = False) -> None:
    """A relative script (or a module of this directory) is synced from here: name a typo before
    anything starts (did you mean), in the real run and the dry run alike."""
    try:
        scriptfile.check_here(script, module, os.getcwd())
    except scriptfile.ScriptError as exc:
        hint = "" if module else scriptfile.suggestion(script, os.getcwd())
        raise PlanError(f"{exc}{hint} (it is synced from here; with {option('sync', False)} it must be in the "
                        "nodes' workdir)") from None


def script_and_mode(script: str, args: tuple[str, ...], module: bool) -> tuple[str, tuple[str, ...], bool]:
    """(script or module, its arguments, module mode): ``-m MODULE`` as ddpfab's option or as the
    first words after ``--`` (torchrun's habit), the same thing."""
    if not module and script in ("-m", "--module"):
        if not args:
            raise PlanError(f"{script} needs a module name after it (e.g. -- -m pkg.train)")
        return args[0], args[1:], True
    return script, args, bool(module)


def local_rank_spelling(style: str, script: str, module: bool) -> tuple[str, bool]:
    """The local-rank argument's spelling, and whether torchrun passes it to the script.

    Legacy launcher: the spelling asked for, or the one the script here declares (only
    ``--local_rank``: that; everything else the dashed form); it always passes one. torchrun sets
    only LOCAL_RANK, so a script that declares the argument (and may never read LOCAL_RANK: the
    argument's default on every rank) is given it too, in its spelling; a style asked for is
    passed as asked."""
    if style != "auto":
        return LOCAL_RANK_ARGS[style == "underscore"], True
    declared = scriptfile.declared_local_rank(scriptfile.local_file(script, module, os.getcwd()))
    return declared or LOCAL_RANK_ARGS[0], declared is not None
