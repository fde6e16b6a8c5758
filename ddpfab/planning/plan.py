"""The launch plan: every decision about a run, made before anything starts.

``make_plan(cluster, options, facts)`` takes data and returns data: which node is the master, its
address and port, each node's node_rank, nproc, python, workdir and env, and the launch itself
(launcher, its flags, the script and its arguments with their ``{{placeholders}}``, the rendezvous
style). No SSH, no clock, no randomness in here: the same inputs give the same plan, so
``--dry-run`` prints it, the manifest stores it, and unit tests cover every rule without a network.
The plan holds no rendered command: :mod:`ddpfab.planning.render` turns it into a node's argv, a shell line,
an emitted script or a scheduler's job, and nothing reads a rendered command back.
The facts it needs from the hosts (resolved addresses, a free port on the master) are gathered
beforehand by :mod:`ddpfab.health.probe`; :func:`master_port` decides the port from them.
"""

from __future__ import annotations

import ipaddress
import json
import re
import types
import typing
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ddpfab.hosts import nodeenv
from ddpfab.hosts.inventory import Inventory, Node, is_address
from ddpfab.hosts.suggest import did_you_mean
from ddpfab.node.workdir import WorkdirError
from ddpfab.node.workdir import resolve as resolve_workdir
from ddpfab.hostlist import compact
from ddpfab.optionnames import option
from ddpfab.problems import DdpfabError, Problem

#: Where each node keeps its run records, relative to the SSH user's home.
REMOTE_RUNS_DIR = ".ddpfab/runs"

#: torchrun's own default is 29500; free ports are looked for from there upwards.
DEFAULT_PORT_RANGE = (29500, 29999)
#: Always set on every node: unbuffered output makes lines stream live instead of at exit.
BASE_ENV = {"PYTHONUNBUFFERED": "1"}
#: ``--debug``: what NCCL, c10d and gloo log when asked (user --env values win over these).
DEBUG_ENV = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET", "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
             "TORCH_CPP_LOG_LEVEL": "INFO"}
#: ... except on nodes the inventory gives no GPUs (ddpfab_gpus): they run gloo, and DETAIL crashes
#: DDP on gloo (torch 2.13: SIGSEGV in the DDP constructor, c10d::Logger::set_env_variables casts
#: DETAIL's wrapper process group to ProcessGroupGloo). INFO still logs DDP's setup.
DEBUG_ENV_GLOO = {"TORCH_DISTRIBUTED_DEBUG": "INFO"}
#: On nodes with GPUs (NCCL): PyTorch's NCCL flight recorder, its last collectives per rank, dumped
#: on a collective timeout into the run's record dir (TORCH_FR_DUMP_TEMP_FILE + the global rank),
#: where ``ddpfab doctor`` collects the dumps. The names are torch 2.13's (``TORCH_FR_*``) and the
#: older ``TORCH_NCCL_*`` ones (torch >= 2.2 reads them); user --env values win.
FLIGHT_RECORDER_ENV = {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
                       "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
#: The dump file's prefix in the run's record dir (ddpfab.node.stacks.TRACE_PREFIX: the same name).
FLIGHT_RECORDER_PREFIX = "nccl_trace_rank_"
FLIGHT_RECORDER_FILE_VARS = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
#: The ranks' hang watch (RunOptions.hang_timeout): seconds without a line from any rank before
#: ddpfab runs the doctor by itself. 300: far above a healthy job's quiet spells between log lines
#: in the lab's and the examples' loops, far below the collective timeouts a hung job otherwise
#: waits for (gloo's and NCCL's default: 30 and 10 minutes).
HANG_TIMEOUT_S = 300.0
#: What the run does when the doctor finds a hang: report (and keep waiting) or stop the job.
ON_HANG = ("report", "stop")
RDZV_STYLES = ("static", "c10d")
#: launcher name -> the module the node's python runs
LAUNCHERS = {"torchrun": "torch.distributed.run", "legacy": "torch.distributed.launch"}
INIT_METHODS = ("env", "tcp", "file")
#: The env var that tells a training script (via :mod:`ddpfab.dist`) which init method to use.
INIT_METHOD_VAR = "DDPFAB_INIT_METHOD"
#: How a legacy-launcher script spells the local rank argument (torch 2.x passes the dashed one).
LOCAL_RANK_ARGS = ("--local-rank", "--local_rank")
#: Per-node values a script argument may name as ``{{name}}`` (expanded on the controller, per node).
PLACEHOLDERS = ("node_rank", "nnodes", "nproc", "world_size", "master_addr", "master_port", "run_id",
                "node_name")
_PLACEHOLDER = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
#: What plans recorded by schema version 2 stored per node beside the data: renderings, now derived.
LEGACY_NODE_FIELDS = ("argv", "command")
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: ``--nproc-per-node`` words, as torchrun means them, decided per node from the probe's facts:
#: gpu = its GPU count, cpu = its CPU count, auto = its GPUs if it has any, else its CPUs.
NPROC_WORDS = ("gpu", "cpu", "auto")
#: A module for ``-m`` (module mode): dotted Python identifiers.
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
#: A run id names a local and a remote directory: no separators, no dot-dot, no shell characters.
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,79}")


#: The ranks' exit guard (RunOptions.exit_guard): on (the default), record, off.
EXIT_GUARD_MODES = ("on", "record", "off")


class PlanError(DdpfabError):
    """The run cannot be planned as asked; the message says what to change."""

    check = "plan"


@dataclass(frozen=True)
class RunOptions:
    """What the user asked for, independent of any host.

    Args:
        script: the training script, relative to the workdir (or absolute).
        args: the script's arguments, passed through byte for byte.
        nproc_per_node: overrides the inventory's ``ddpfab_nproc_per_node`` on every node: a
            number, or one of :data:`NPROC_WORDS` (resolved per node, see :func:`nproc_for`).
        master_port: a fixed MASTER_PORT; None lets the probe find a free one on the master.
        env: extra environment for every node, as (key, value) pairs.
        max_restarts: torchrun's in-node restarts.
        run_id: the run's id (names the remote and local run dirs).
        remote_runs_dir: where each node keeps a run's record (supervisor pid, exit code, output,
            per-rank logs); relative paths are under the node user's home.
        socket_ifname: set GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME on every node: interface
            names (checked against each probed node's: :func:`socket_ifname_problems`), "auto"
            for the interface each node uses to reach its peers (an explicit --env of either
            variable still wins), "none"/"off" to set neither; None (the default) is auto
            where the user set neither variable, and nothing on a node without one such interface
            (see :func:`socket_ifname_for`).
        rdzv: "static" (node_rank fixed by ddpfab in inventory order, ``--node-rank``) or "c10d"
            (torchrun's c10d rendezvous on the master's address and port; torchrun assigns the
            node ranks).
        launcher: "torchrun" (``python -m torch.distributed.run``) or "legacy"
            (``python -m torch.distributed.launch`` without ``--use-env``: the script also gets
            ``--local-rank=N`` before its own arguments, as scripts written for it expect).
        init_method: how a script that calls ``init_process_group`` itself should rendezvous:
            "env" (env://), "tcp" (tcp://MASTER_ADDR:MASTER_PORT) or "file" (a file in each
            node's ``ddpfab_shared_dir``). Told to the script in ``DDPFAB_INIT_METHOD`` (unset for
            env://); :mod:`ddpfab.dist` reads it.
        debug: add :data:`DEBUG_ENV` (NCCL and torch.distributed debug logging); ``env`` wins.
        local_rank_arg: with ``launcher="legacy"``, the argument the script declares for its local
            rank: "--local-rank" (what torch 2.x passes) or "--local_rank" (scripts written for
            torch 1.x; then the launcher runs with ``--use-env`` and each worker gets
            ``--local_rank=N`` through torch's ``${local_rank}`` substitution).
        module: *script* is a module to run as ``-m MODULE`` (torchrun's module mode).
        secret_env: env keys to mask wherever shown or recorded (``--secret-env``), on top of
            :mod:`ddpfab.masking`'s rule and the inventory's ``ddpfab_secret_env``.
        script_local_rank: with ``launcher="torchrun"``, also give each rank its local rank as
            ``local_rank_arg=N`` (the script declares that argument and may never read
            LOCAL_RANK): torchrun substitutes ``${local_rank}`` in the workers' arguments.
        gpus_per_node: GPUs each node's supervisor leases for the job (``--gpus-per-node``); None:
            what the node's processes need (see :func:`gpu_lease`).
        wait: ``--wait``: a node whose GPUs are leased or busy queues the job until they are free,
            instead of refusing it.
        exit_guard: the ranks' exit guard (:mod:`ddpfab.node.exitguard`, one of
            :data:`EXIT_GUARD_MODES`): "on" records each rank's end and leaves without the
            interpreter teardown where gloo can abort a finished rank; "record" only records (a
            rank that aborts after finishing is reported as such, not as a failure); "off"
            installs nothing.
        resource_floors: ``--resource-floors`` (``shm=2G,disk=5G,mem=4G,nofile=4096``): what the
            preflight requires of each node's resources (:func:`ddpfab.health.resourcecheck.parse_floors`
            reads it; None: its defaults).
        hang_timeout: seconds without a line from any rank before the run runs the doctor by
            itself (:mod:`ddpfab.health.doctor`) and prints its verdict; 0: never.
        on_hang: what a hang verdict does: "report" (keep waiting) or "stop" (end the job at once).
        pdb: ``--pdb``: the global ranks whose ``breakpoint()`` and uncaught exceptions wait in pdb
            for the user (:func:`pdb_ranks`): "all", ranks and ranges (``"1,4-5"``); "": none.
        debugpy: ``--debugpy``: the global ranks that wait for a DAP client (VS Code) before the
            script runs, debugpy listening on the node's loopback (same spelling as *pdb*).
    """

    script: str
    args: tuple[str, ...] = ()
    nproc_per_node: int | str | None = None
    master_port: int | None = None
    env: tuple[tuple[str, str], ...] = ()
    max_restarts: int = 0
    run_id: str = "run"
    remote_runs_dir: str = REMOTE_RUNS_DIR
    socket_ifname: str | None = None
    rdzv: str = "static"
    launcher: str = "torchrun"
    init_method: str = "env"
    debug: bool = False
    local_rank_arg: str = "--local-rank"
    module: bool = False
    secret_env: tuple[str, ...] = ()
    script_local_rank: bool = False
    gpus_per_node: int | None = None
    wait: bool = False
    exit_guard: str = "on"
    resource_floors: str | None = None
    hang_timeout: float = HANG_TIMEOUT_S
    on_hang: str = "report"
    pdb: str = ""
    debugpy: str = ""


#: Interface operstates in which an interface that is up carries nothing (no carrier, its lower
#: device down, gone); "unknown" (loopback, many virtual devices) and "dormant" are not among them.
DOWN_STATES = ("down", "lowerlayerdown", "notpresent")


@dataclass(frozen=True)
class Interface:
    """One network interface of a node, as its probe saw it.

    Args:
        up: IFF_UP is set (``ip link set DEV up``); None where its flags could not be read.
        state: its operstate (``/sys/class/net/DEV/operstate``), None where unread.
        addrs: its IP addresses (the primary IPv4 one, every IPv6 one).
    """

    up: bool | None = None
    state: str | None = None
    addrs: tuple[str, ...] = ()

    @property
    def down(self) -> bool:
        """Known to carry nothing: not up, or up without a carrier (:data:`DOWN_STATES`)."""
        return self.up is False or self.state in DOWN_STATES

    def describe(self, name: str, addrs: bool = True) -> str:
        """*name* as a list of a node's interfaces shows it: ``eth0 (10.0.0.1)``, ``side0 (down)``;
        without *addrs*, only whether it is down."""
        notes = (list(self.addrs) if addrs else []) + (["down"] if self.down else [])
        return f"{name} ({', '.join(notes)})" if notes else name


@dataclass(frozen=True)
class Facts:
    """What the probe learnt from the hosts, the only non-user input of the plan.

    Args:
        addresses: node name -> the IP literal its data address resolves to.
        master_port: a port free on the master (or the user's, verified free).
        cwd: the controller's working dir, the default workdir on the nodes.
        homes: node name -> the SSH user's home dir there (anchors relative remote paths).
        ifnames: node name -> the network interface it reaches its peers through (for
            ``socket_ifname="auto"``).
        unresolved: nodes whose address is their name as given, not an IP: an offline plan's
            names the controller could not resolve (:func:`ddpfab.remote.address.offline_addresses`).
            The real run never has any: it resolves every address (or refuses) before planning.
        gpus, cpus: node name -> its GPU and CPU counts as probed (for ``--nproc-per-node
            gpu|cpu|auto``); a node missing here was not probed (an offline plan).
        interfaces: node name -> its network interfaces by name (for ``--socket-ifname IFACE``:
            :func:`socket_ifname_problems`); a node missing here was not probed (an offline plan).
    """

    addresses: dict[str, str]
    master_port: int
    cwd: str
    homes: dict[str, str] = field(default_factory=dict)
    ifnames: dict[str, str | None] = field(default_factory=dict)
    unresolved: tuple[str, ...] = ()
    gpus: dict[str, int] = field(default_factory=dict)
    cpus: dict[str, int] = field(default_factory=dict)
    interfaces: dict[str, dict[str, Interface]] = field(default_factory=dict)


#: Fields a record may hold as null, read back as empty (plans recorded before they were filled).
_EMPTY_AS_NULL = frozenset({"env", "setup", "gpu_pin", "secret_env", "unresolved"})


def _check_types(cls: type, values: dict[str, Any], where: str) -> None:
    """ValueError where a recorded field's value is not of the type *cls* declares for it: a
    record is data, and a ``"pdb": 5`` must not reach ``.split`` (nor a list of characters
    stand for a string's setup lines)."""
    hints = typing.get_type_hints(cls)
    for name, value in values.items():
        if name in hints and not (value is None and name in _EMPTY_AS_NULL) and not _is_a(value, hints[name]):
            raise ValueError(f"{where}: {name}: expected {hints[name]}, found {type(value).__name__}")


def _is_a(value: Any, hint: Any) -> bool:
    """Whether JSON-read *value* is of type *hint* (a JSON list stands for a tuple; an int for a float)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_is_a(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint in (bool, int):
        return type(value) is hint
    if hint is float:
        return type(value) in (int, float)
    if hint is str:
        return isinstance(value, str)
    if origin is tuple:
        return isinstance(value, (list, tuple)) and all(_is_a(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(_is_a(k, args[0]) and _is_a(v, args[1]) for k, v in value.items())
    return True  # (Any, and the nested node plans: checked as their own fields)


@dataclass(frozen=True)
class NodePlan:
    """What one node runs, as data (:func:`ddpfab.planning.render.argv` makes its argv).

    Args:
        name: the inventory name.
        ssh_host, ssh_port, ssh_user: how the node is reached.
        node_rank: its rank in inventory order (the master is 0); with c10d rendezvous torchrun
            assigns the ranks and this one only says who hosts the store.
        nproc: processes on the node (torchrun's ``--nproc-per-node``).
        data_addr: the IP literal peers reach it at.
        workdir: the directory the launcher starts in.
        python: the node's python (the launcher runs as ``PYTHON -m MODULE``);
            :data:`ddpfab.hosts.nodeenv.ON_NODE` when only the node can choose it (an offline plan).
        python_from: where it came from (:data:`ddpfab.hosts.nodeenv.SOURCES`, or
            :data:`ddpfab.hosts.nodeenv.ON_NODE_FROM`).
        setup: the shell lines run before the launcher there (``ddpfab_setup``, then the
            activation of ``ddpfab_conda_env``).
        conda_env: the node's ``ddpfab_conda_env``, None when unset.
        remote_dir: the run's record dir on the node (torchrun's per-rank logs go under it).
        env: the ranks' environment, by key (secret values masked by key when shown or recorded).
        shared_dir: the node's ``ddpfab_shared_dir`` (file:// init), None when unset.
        gpus: GPUs its supervisor leases before starting (:func:`gpu_lease`); 0: none (a CPU node).
        gpu_pin: the GPUs it must lease (``ddpfab_gpu_ids``); empty: any free ones.
    """

    name: str
    ssh_host: str
    ssh_port: int | None
    ssh_user: str | None
    node_rank: int
    nproc: int
    data_addr: str
    workdir: str
    python: str
    remote_dir: str
    env: dict[str, str] = field(default_factory=dict)
    shared_dir: str | None = None  # the node's ddpfab_shared_dir (file:// init), None when unset
    # defaults keep plans recorded before these existed loadable (their python ran as written)
    python_from: str = "default"
    setup: tuple[str, ...] = ()
    conda_env: str | None = None
    gpus: int = 0
    gpu_pin: tuple[str, ...] = ()


#: NodePlan fields later than the first recorded plans: a recorded plan without one is not
#: different for lacking it (its default is what that plan meant).
LATER_NODE_FIELDS = ("python_from", "setup", "conda_env", "gpus", "gpu_pin")


@dataclass(frozen=True)
class Plan:
    """A run, decided: the launch as data, the same on every node but each node's own values.

    Args:
        run_id: names the run here and on every node (also c10d's rendezvous id).
        inventory, group: where the nodes came from.
        master, master_addr, master_port: the rendezvous point (node rank 0).
        nnodes, world_size: the job's size.
        script: the training script, relative to each node's workdir (or absolute); with
            *module*, the module torchrun runs as ``-m MODULE``.
        args: the script's arguments, byte for byte, with ``{{name}}`` placeholders
            (:data:`PLACEHOLDERS`) that each node's rendering fills in.
        max_restarts: torchrun's in-node restarts.
        nodes: by node rank.
        unresolved: nodes (in node rank order) whose ``data_addr`` (the master's: ``master_addr``)
            is a host name the controller could not resolve: only in an offline plan, which shows
            them as such; each node then resolves the name itself.
        rdzv, launcher, init_method, debug, local_rank_arg, module, script_local_rank, exit_guard,
        hang_timeout, on_hang, pdb:
            the launch style (see RunOptions).
        secret_env: env keys whose values are masked wherever the plan is shown or recorded
            (``--secret-env`` and every node's ``ddpfab_secret_env``), besides
            :mod:`ddpfab.masking`'s rule.
        wait: ``--wait``: the nodes' supervisors queue for their GPU leases (each node's ``gpus``)
            and start the job together once every node holds them.
    """

    run_id: str
    inventory: str
    group: str
    master: str
    master_addr: str
    master_port: int
    nnodes: int
    world_size: int
    script: str
    args: tuple[str, ...]
    max_restarts: int
    nodes: tuple[NodePlan, ...]
    # launch style (see RunOptions); defaults keep plans recorded before these existed loadable
    rdzv: str = "static"
    launcher: str = "torchrun"
    init_method: str = "env"
    debug: bool = False
    local_rank_arg: str = "--local-rank"
    unresolved: tuple[str, ...] = ()
    module: bool = False
    secret_env: tuple[str, ...] = ()
    script_local_rank: bool = False
    wait: bool = False
    exit_guard: str = "off"  # a plan recorded before the guard ran without one (RunOptions: "on")
    hang_timeout: float = 0.0  # a plan recorded before the hang watch ran without one
    on_hang: str = "report"
    pdb: str = ""  # the ranks in the debugger: "all" or "1,5" (pdb_ranks); "": none
    debugpy: str = ""  # the ranks that wait for a DAP client, spelled as pdb

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if not self.unresolved:
            # only offline plans of names have it: a real run's plan (and its manifest) is as before
            del data["unresolved"]
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, ensure_ascii=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any], legacy: bool = False) -> Plan:
        """A plan from :meth:`to_dict`'s shape; an unknown key is an error.

        Args:
            data: the plan as :meth:`to_dict` gives it.
            legacy: *data* comes from a manifest of schema version 2, whose nodes also stored their
                rendered ``argv`` and ``command``: those are dropped, never read (the data they
                were rendered from is all here).
        """
        data = dict(data)
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"plan: unknown field(s) {', '.join(unknown)}")
        node_fields = {f.name for f in fields(NodePlan)}
        nodes = []
        _check_types(cls, {k: v for k, v in data.items() if k != "nodes"}, "plan")
        if not isinstance(data["nodes"], (list, tuple)):
            raise ValueError("plan: nodes: expected a list")
        for n in data["nodes"]:
            n = {k: v for k, v in n.items() if not (legacy and k in LEGACY_NODE_FIELDS)}
            unknown = sorted(set(n) - node_fields)
            if unknown:
                raise ValueError(f"plan: node {n.get('name')!r}: unknown field(s) {', '.join(unknown)}")
            _check_types(NodePlan, n, f"plan: node {n.get('name')!r}")
            nodes.append(NodePlan(**{**n, "env": dict(n.get("env") or {}), "setup": tuple(n.get("setup") or ()),
                                     "gpu_pin": tuple(n.get("gpu_pin") or ())}))
        data["args"] = tuple(data["args"])
        data["secret_env"] = tuple(data.get("secret_env") or ())
        data["nodes"] = tuple(nodes)
        data["unresolved"] = tuple(data.get("unresolved") or ())
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))

    def node(self, name: str) -> NodePlan:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def first_rank(self, name: str) -> int:
        """The global rank of node *name*'s local rank 0 with static rendezvous: the procs of every
        lower node rank (with c10d, torchrun decides it)."""
        node = self.node(name)
        return sum(n.nproc for n in self.nodes if n.node_rank < node.node_rank)

    def node_of_rank(self, rank: int) -> tuple[NodePlan, int]:
        """(the node that runs global rank *rank*, its local rank there), as :meth:`first_rank`
        counts; ValueError for a rank not in the job."""
        for node in self.nodes:
            local = rank - self.first_rank(node.name)
            if 0 <= local < node.nproc:
                return node, local
        raise ValueError(f"rank {rank} is not in run {self.run_id} (its ranks are 0-{self.world_size - 1})")

    def unresolved_note(self) -> str:
        """One line on the addresses an offline plan kept as names ("" when there are none): the
        printed dry run, emitted scripts and their README all say it the same way."""
        if not self.unresolved:
            return ""
        master = (f"; the master address {self.master_addr!r} is a name each node resolves itself"
                  if self.master in self.unresolved else "")
        return (f"unresolved: {', '.join(self.unresolved)} did not resolve on this controller (neither by ssh_config "
                f"HostName nor by DNS), kept as names{master}; `ddpfab run` resolves every address to an IP "
                "literal before starting (or refuses)")


def node_python(node: Node) -> dict[str, str]:
    """The plan's ``python`` and ``python_from`` for *node*: as decided (the inventory's, or the
    probe's), else the node's own choice (:data:`ddpfab.hosts.nodeenv.ON_NODE`: an offline plan)."""
    if nodeenv.undecided(node):
        return {"python": nodeenv.ON_NODE, "python_from": nodeenv.ON_NODE_FROM}
    return {"python": node.python, "python_from": node.python_from}


def choose_master(cluster: Inventory) -> Node:
    """The node flagged ``ddpfab_master``, else the first node in inventory order."""
    flagged = [n for n in cluster.nodes if n.master]
    return flagged[0] if flagged else cluster.nodes[0]


def parse_nproc(text: str) -> int | str:
    """``--nproc-per-node``'s value: a number >= 1 or one of :data:`NPROC_WORDS` (torchrun's
    vocabulary); a PlanError (argparse's type error) otherwise."""
    word = text.strip().lower()
    if word in NPROC_WORDS:
        return word
    try:
        value = int(word)
    except ValueError:
        raise PlanError(f"{option('nproc_per_node')} {text!r}: expected a number >= 1, or gpu, cpu or auto") from None
    if value < 1:
        raise PlanError(f"{option('nproc_per_node')} must be >= 1, got {value}")
    return value


def nproc_for(node: Node, options: RunOptions, gpus: int | None = None, cpus: int | None = None) -> int:
    """Processes on *node*: the command line wins, then the inventory's nproc (a hostfile's slots),
    then the length of its GPU list, then its GPU count, then 1.

    A word on the command line is torchrun's, decided here per node: ``gpu`` its GPUs (the
    length of its GPU list, else *gpus* as probed, else the inventory's ``ddpfab_gpus``), ``cpu``
    its CPUs (*cpus* as probed), ``auto`` its GPUs if it has any, else its CPUs. A count that
    cannot be known (an offline plan) or a ``gpu`` node without GPUs is a PlanError naming the node.

    Args:
        node, options: the node and what the user asked.
        gpus, cpus: the node's GPU and CPU counts as probed; None when not probed.
    """
    asked = options.nproc_per_node
    if isinstance(asked, str):
        return _nproc_word(node, asked, gpus, cpus)
    if asked is not None:
        return asked
    if node.nproc is not None:
        return node.nproc
    if node.gpu_ids:
        return len(node.gpu_ids)
    if node.gpus:
        return node.gpus
    return 1


def gpu_lease(node: Node, options: RunOptions, nproc: int, gpus: int | None = None) -> int:
    """How many GPUs *node*'s supervisor leases for the job: ``--gpus-per-node``, else the
    length of its pinned list (``ddpfab_gpu_ids``), else one per process, at most its GPUs; 0 on a
    node without GPUs (nothing to lease). More than the node has (or than its pinned list holds) is
    a PlanError naming the node.

    Args:
        node: the node, with its inventory's GPU list and count.
        options: what the user asked (``gpus_per_node``).
        nproc: the node's processes, as decided (:func:`nproc_for`).
        gpus: its GPU count as probed; None when not probed (an offline plan: the inventory's
            ``ddpfab_gpus``, else the pinned list, says what it has).
    """
    have = gpus if gpus is not None else (node.gpus if node.gpus is not None else len(node.gpu_ids or ()))
    asked = options.gpus_per_node
    if asked is not None and asked < 0:
        raise PlanError(f"{option('gpus_per_node', asked)}: expected a number >= 0")
    if gpus == 0 and not asked:
        return 0  # probed: no nvidia-smi there (a pinned list is then only CUDA_VISIBLE_DEVICES, as asked)
    if node.gpu_ids:
        if asked is not None and asked != len(node.gpu_ids):
            raise PlanError(f"host {node.name}: {option('gpus_per_node', asked)} but ddpfab_gpu_ids pins "
                            f"{len(node.gpu_ids)} ({','.join(node.gpu_ids)}); give {len(node.gpu_ids)} or change the pin")
        return len(node.gpu_ids)
    want = asked if asked is not None else min(nproc, have)
    if want > have:
        raise PlanError(f"host {node.name}: {option('gpus_per_node', want)}, but it has {have} GPU{'' if have == 1 else 's'} "
                        "(nvidia-smi's count)")
    return want


def _nproc_word(node: Node, word: str, gpus: int | None, cpus: int | None) -> int:
    """``--nproc-per-node gpu|cpu|auto`` on *node* (see :func:`nproc_for`)."""
    if word not in NPROC_WORDS:
        raise PlanError(f"{option('nproc_per_node')} {word!r}: expected a number >= 1, or gpu, cpu or auto")
    gpu_count = len(node.gpu_ids) if node.gpu_ids else gpus if gpus is not None else node.gpus
    if word == "gpu" or (word == "auto" and gpu_count):
        if gpu_count is None:
            raise PlanError(f"host {node.name}: {option('nproc_per_node', word)}: its GPU count is not known without "
                            "probing it (an offline plan); set ddpfab_gpus in the inventory, give a number, or "
                            f"plan without {option('offline')}")
        if not gpu_count:
            raise PlanError(f"host {node.name}: {option('nproc_per_node', 'gpu')}: it has no GPU (nvidia-smi lists none), and "
                            "torchrun refuses gpu there; use cpu, auto or a number")
        return gpu_count
    if cpus is None:
        raise PlanError(f"host {node.name}: {option('nproc_per_node', word)}: its CPU count is not known without "
                        f"probing it (an offline plan); give a number or plan without {option('offline')}")
    return cpus


#: Controller environment variables with these prefixes are forwarded to every rank (documented
#: in the README); anything else only when asked with --env or --env-file.
FORWARD_PREFIXES = ("NCCL_", "TORCH_", "GLOO_", "PYTORCH_")


def forwarded_env(environ: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """The allowlisted part of the controller's environment, in a stable order."""
    return tuple(sorted((k, v) for k, v in environ.items() if k.startswith(FORWARD_PREFIXES)))


def read_env_file(text: str, source: str) -> list[str]:
    """``KEY=VALUE`` lines of an env file (blank lines and # comments ignored, no shell expansion)."""
    pairs = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export "):].lstrip()
        key, sep, value = line.partition("=")
        if not sep:
            raise PlanError(f"env file {source}, line {number}: expected KEY=VALUE, got {line!r}")
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        pairs.append(f"{key.strip()}={value}")
    return pairs


def parse_env(pairs: list[str] | tuple[str, ...],
              environ: dict[str, str] | None = None) -> tuple[tuple[str, str], ...]:
    """``K=V`` strings as pairs; a key that is not a shell identifier is an error, not a surprise.

    Args:
        pairs: ``KEY=VALUE`` strings; with *environ*, a bare ``KEY`` takes its value from there
            (``--env HF_TOKEN``: the secret is not in ddpfab's own command line either).
        environ: the controller's environment, for bare keys.
    """
    out = []
    for pair in pairs:
        if environ is not None and "=" not in pair and _ENV_KEY.fullmatch(pair):
            if pair not in environ:
                raise PlanError(f"{option('env')} {pair}: no value given and {pair} is not set in this shell; "
                                f"export it, or pass {option('env')} {pair}=VALUE")
            pair = f"{pair}={environ[pair]}"
        key, sep, value = pair.partition("=")
        if not sep or not _ENV_KEY.fullmatch(key):
            raise PlanError(f"{option('env')} {pair!r}: expected KEY=VALUE with KEY made of letters, digits and '_'")
        out.append((key, value))
    return tuple(out)


def host_port(addr: str, port: int | str) -> str:
    """``addr:port``, with an IPv6 literal in brackets."""
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"


def nproc_per_node(asked: int | str | None) -> int | str | None:
    """``--nproc-per-node`` as asked (None: decide per node; ``gpu``/``cpu``/``auto``: per node from
    its facts, see :func:`parse_nproc`): the one rule for it, in run, plan and check alike.

    Raises:
        PlanError: fewer than one process.
    """
    if isinstance(asked, int) and asked < 1:
        raise PlanError(f"{option('nproc_per_node')} must be >= 1, got {asked}")
    return asked


def master_port(asked: int | None, *, found: int | None = None, asked_free: bool | None = None,
                replace_taken: bool = False, offline: bool = False) -> int | None:
    """The run's master port: the one place it is decided (run, plan, check, replay, recovery
    attempts, the perf check and exports all ask here).

    Args:
        asked: the port asked for: ``--master-port``, or the port a replayed run recorded; None
            for any free one.
        found: a port the probe found free on the master (it looks when *asked* is None, or when
            *asked* is taken and *replace_taken*).
        asked_free: whether the probe found *asked* free on the master; None when not probed.
        replace_taken: a taken *asked* port gives way to *found* (replay without ``--same-port``);
            otherwise a taken port is kept, and the probe's "in use" problem stops the run.
        offline: nothing was probed (``--offline``, exports): *asked*, else torchrun's default.

    Returns:
        The port, or None when the probe found none free (its problem says so).
    """
    if asked is not None and not 1 <= asked <= 65535:
        raise PlanError(f"{option('master_port', asked)} is not a TCP port (1-65535)")
    if offline:
        return asked if asked is not None else DEFAULT_PORT_RANGE[0]
    if asked is not None and not (asked_free is False and replace_taken):
        return asked
    return found


def placeholders_in(args: tuple[str, ...] | list[str]) -> list[str]:
    """The ``{{name}}`` placeholder names used in *args*, in order of first use."""
    seen: list[str] = []
    for a in args:
        for name in _PLACEHOLDER.findall(a):
            if name not in seen:
                seen.append(name)
    return seen


def expand_placeholders(args: tuple[str, ...], values: dict[str, Any]) -> tuple[str, ...]:
    """*args* with each ``{{name}}`` replaced by ``values[name]``; other text is left byte for byte.
    ``world_size`` is not per node: :func:`make_plan` puts it in *values* when it is known."""
    def sub(m: re.Match) -> str:
        name = m.group(1)
        if name not in values:
            raise PlanError(f"script argument placeholder {{{{{name}}}}} is unknown{did_you_mean(name, PLACEHOLDERS)}; "
                            f"known: {', '.join(PLACEHOLDERS)}")
        return str(values[name])

    return tuple(_PLACEHOLDER.sub(sub, a) for a in args)


def init_method_url(kind: str, *, master_addr: str, master_port: int, shared_dir: str | None,
                    run_id: str) -> str | None:
    """The ``DDPFAB_INIT_METHOD`` value for one node (None for env://, the default).

    tcp:// points at MASTER_ADDR:MASTER_PORT: under torchrun that is the store torchrun already
    hosts there (it sets TORCHELASTIC_USE_AGENT_STORE, so ``init_process_group`` connects to it
    as a client instead of binding the port a second time), with static and c10d rendezvous alike.
    file:// is a file named after the run in the node's shared dir.
    """
    if kind == "tcp":
        return f"tcp://{host_port(master_addr, master_port)}"
    if kind == "file":
        if not shared_dir:
            raise PlanError("a file:// init method needs the node's ddpfab_shared_dir")
        return f"file://{shared_dir.rstrip('/')}/ddpfab-{run_id}.init"
    return None


def remote_path(path: str, home: str | None) -> str:
    """*path* as an absolute path on a node whose home is *home*."""
    if path.startswith("~/"):
        path = path[2:]
    if path.startswith("/") or not home:
        return path
    return f"{home.rstrip('/')}/{path}"


def node_order(cluster: Inventory) -> list[Node]:
    """Nodes by node_rank: the master first (node_rank 0 must be where the store is), then the
    others in inventory order."""
    master = choose_master(cluster)
    return [master] + [n for n in cluster.nodes if n is not master]


def remote_workdir(raw: str, home: str | None) -> str:
    """The workdir *raw* (``ddpfab_workdir``) as a node with SSH home *home* resolves it: the same
    rules and the same answer as ``ddpfab sync`` (:func:`ddpfab.node.workdir.resolve`)."""
    try:
        return resolve_workdir(raw, home)
    except WorkdirError as exc:  # (the node program's own, stdlib-only): a problem here
        raise PlanError(str(exc), check=exc.code) from None


def is_run_id(value: object) -> bool:
    """Whether *value* may be a run id (it names a directory here and on every node)."""
    return isinstance(value, str) and bool(_RUN_ID.fullmatch(value)) and ".." not in value


def check_module_name(name: str) -> str:
    """*name*, or a PlanError: ``-m``'s module, dotted Python identifiers (``pkg.train``)."""
    if not _MODULE.fullmatch(name):
        raise PlanError(f"-m {name!r}: expected a module name (dotted Python identifiers, e.g. pkg.train)")
    return name


def is_port(value: object) -> bool:
    """Whether *value* is a TCP port: an int (not a bool) in 1-65535."""
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 65535


def check_run_id(run_id: str, what: str | None = None) -> str:
    """*run_id*, or a PlanError naming it as *what* (default: the ``run_id`` option, as the reader
    spells it): it becomes a directory name here and on every node (``runs/<id>``,
    ``~/.ddpfab/runs/<id>``), so every command that takes one checks it so."""
    if not is_run_id(run_id):
        raise PlanError(f"{what or option('run_id')} {run_id!r}: expected 1-80 letters, digits, '.', '_' or '-' (starting with a "
                        "letter or digit, no '..'): it names a directory here and on every node")
    return run_id


#: ``--socket-ifname`` words that turn the interface choice off.
SOCKET_IFNAME_OFF = ("none", "off")
IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def socket_ifname_for(node: Node, options: RunOptions, facts: Facts) -> tuple[str | None, str | None]:
    """The interface the run names in GLOO/NCCL_SOCKET_IFNAME on *node*, and why none when the
    default could not choose one (a warning line), decided once for the plan and the preflight.

    By default (``socket_ifname`` None) it is the interface the node reaches all its peers
    through, so the backends bind and advertise an address the peers reach (not whatever the
    hostname resolves to), unless the user set either variable (``--env``, the inventory's
    ``ddpfab_env``): then nothing. A node without one such interface (or not probed: an offline
    plan) gets nothing, as before this default; an explicit ``auto`` refuses it instead.

    Args:
        node: the node.
        options: ``socket_ifname`` (None, "auto", "none"/"off" or an interface) and ``env``.
        facts: ``ifnames`` (node -> its one interface towards the peers) and ``gpus`` (probed nodes).
    """
    choice = options.socket_ifname
    if choice in SOCKET_IFNAME_OFF:
        return None, None
    if choice is None:
        asked = dict(options.env)
        if any(k in asked or k in node.env for k in IFNAME_VARS):
            return None, None
    if choice not in (None, "auto"):
        return choice, None
    ifname = facts.ifnames.get(node.name)
    if ifname:
        return ifname, None
    if choice == "auto":
        raise PlanError(f"host {node.name}: {option('socket_ifname', 'auto')}: no single interface reaches all its "
                        f"peers; name one with {option('socket_ifname', 'IFACE')}")
    if node.name not in facts.ifnames:
        return None, None  # not probed (an offline plan): nothing to choose from
    return None, (f"host {node.name}: no single interface reaches all its peers, so GLOO_SOCKET_IFNAME/"
                  "NCCL_SOCKET_IFNAME are not set there (the backends advertise its hostname's address); "
                  f"name one with {option('socket_ifname', 'IFACE')}, or {option('socket_ifname', 'none')} to "
                  "silence this")


def socket_ifname_warnings(cluster: Inventory, options: RunOptions, facts: Facts) -> list[str]:
    """The warning lines of :func:`socket_ifname_for`, one per node that has one."""
    return [w for n in cluster.nodes if (w := socket_ifname_for(n, options, facts)[1])]


#: The characters Linux refuses in an interface name (besides "." and ".." as the whole name).
_NOT_IN_IFNAME = re.compile(r"[/:\s]")
#: Nodes that share a ``--socket-ifname`` problem from this many on are named in one line.
IFNAME_GROUP_AT = 4


def socket_ifname_names(value: str) -> tuple[str, ...]:
    """The interfaces ``--socket-ifname`` *value* names: one name or a comma-separated list
    (``eth0``, ``eth0,eth1``), each an exact interface name, as GLOO_SOCKET_IFNAME reads them; the
    run sets both variables to it, and NCCL, which matches a name as a prefix, finds at least those.
    NCCL's own forms (``^docker0,lo`` to exclude, ``=eth0`` for exact names) are refused: gloo
    would look for an interface called ``^docker0`` (they go in ``--env NCCL_SOCKET_IFNAME=...``).
    Raises PlanError saying so."""
    fix = (f"pass NCCL's own forms as {option('env')} NCCL_SOCKET_IFNAME=VALUE (it wins over "
           f"{option('socket_ifname')} for that variable), or name the interfaces, e.g. "
           f"{option('socket_ifname', 'eth0,eth1')}")
    if value[:1] in ("^", "="):
        raise PlanError(Problem(None, "socket_ifname", expected="interface names, e.g. eth0 or eth0,eth1",
                                found=value, fix=fix,
                                text=f"{option('socket_ifname')} {value}: {value[0]!r} is NCCL_SOCKET_IFNAME's own "
                                     "syntax, "
                                     "which GLOO_SOCKET_IFNAME (set to the same value) does not read; " + fix))
    names = tuple(value.split(","))
    for name in names:
        if not name or len(name) > 15 or name in (".", "..") or _NOT_IN_IFNAME.search(name):
            raise PlanError(Problem(None, "socket_ifname", expected="interface names, e.g. eth0 or eth0,eth1",
                                    found=value, fix="name interfaces, separated by commas",
                                    text=f"{option('socket_ifname')} {value!r}: {name!r} is no interface name (1-15 "
                                         "characters, no '/', ':' or space); name interfaces, separated by commas"))
    return names


def _ifname_candidates(have: dict[str, Interface]) -> list[str]:
    """The interfaces a node could name instead: up, with an address, not only loopback ones."""
    return [n for n, i in have.items() if not i.down and i.addrs
            and not all(ipaddress.ip_address(a).is_loopback for a in i.addrs)]


def _ifname_found(value: str, names: tuple[str, ...], have: dict[str, Interface],
                  addrs: bool, who: str = "it") -> str:
    """What is wrong with *names* on a node with interfaces *have* ("" when nothing), naming the
    interfaces it has (with their addresses when *addrs*)."""
    parts = []
    for name in names:
        if name not in have:
            part = f"no interface {name}"
            prefixed = [n for n in have if n.startswith(name)]
            if prefixed:
                part += (f" (NCCL would match it as a prefix of {', '.join(prefixed)}, but GLOO_SOCKET_IFNAME "
                         "takes exact names)")
            parts.append(part)
        elif have[name].up is False:
            parts.append(f"{name} is down")
        elif have[name].down:
            parts.append(f"{name} is up but has no link (operstate {have[name].state})")
        elif not have[name].addrs:
            parts.append(f"{name} has no IP address")
    if not parts:
        return ""
    listed = ", ".join(i.describe(n, addrs) for n, i in have.items())
    return "; ".join(parts) + f"; {who} has {listed or 'no interfaces'}"


def _ifname_fix(have: dict[str, Interface], towards: str | None, whose: str = "its") -> str:
    """The fix: ``auto`` (and what it chooses there), or one of the node's usable interfaces."""
    auto = option("socket_ifname", "auto") + (f" (which chooses {towards})" if towards else "")
    others = _ifname_candidates(have)
    return f"use {auto}, or name one of {whose} interfaces: {', '.join(others)}" if others else f"use {auto}"


def socket_ifname_problems(cluster: Inventory, options: RunOptions, facts: Facts) -> list[Problem]:
    """``--socket-ifname IFACE[,IFACE...]`` checked on every probed node as the backends will
    match it (:func:`socket_ifname_names`): each name an interface there, up, with an address;
    else one problem per node that names what it has and the fix, or, from
    :data:`IFNAME_GROUP_AT` nodes with the same interfaces and the same problem on, one line
    for all of them. Nothing about a node where the run sets neither variable (the user set both)
    or that was not probed (an offline plan). A value the backends cannot read: PlanError."""
    value = options.socket_ifname
    if value is None or value in SOCKET_IFNAME_OFF or value == "auto":
        return []
    names = socket_ifname_names(value)
    asked = dict(options.env)
    expected = f"interface{'s' if len(names) > 1 else ''} {value} there, up, with an IP address"
    groups: dict[tuple[str, str], list[tuple[Node, dict[str, Interface]]]] = {}
    for node in cluster.nodes:
        have = facts.interfaces.get(node.name)
        if have is None or all(k in asked or k in node.env for k in IFNAME_VARS):
            continue
        shape = _ifname_found(value, names, have, addrs=False, who="each")
        if shape:
            groups.setdefault((shape, _ifname_fix(have, facts.ifnames.get(node.name))), []).append((node, have))
    problems = []
    for key, members in groups.items():  # in inventory order: each group where its first node is
        if len(members) >= IFNAME_GROUP_AT:
            node, have = members[0]
            fix = _ifname_fix(have, facts.ifnames.get(node.name), whose="their")
            problems.append((node, Problem(None, "socket_ifname", expected=expected, found=key[0], fix=fix,
                                           text=f"{option('socket_ifname', value)}: {len(members)} nodes: {key[0]}: "
                                                f"{compact([n.name for n, _ in members])}; {fix}")))
            continue
        for node, have in members:
            found = _ifname_found(value, names, have, addrs=True)
            problems.append((node, Problem(node.name, "socket_ifname", expected=expected, found=found, fix=key[1],
                                           text=f"host {node.name}: {option('socket_ifname', value)}: {found}; "
                                                f"{key[1]}")))
    order = {n.name: i for i, n in enumerate(cluster.nodes)}
    return [p for _, p in sorted(problems, key=lambda np: order[np[0].name])]


def make_plan(cluster: Inventory, options: RunOptions, facts: Facts) -> Plan:
    """The plan: one part per node in rank order, from what the user asked and what the probe found.

    Args:
        cluster: the inventory's nodes (their order is the node ranks').
        options: the run's options, as the command line or the API gave them.
        facts: what the probe found on the nodes (addresses, homes, GPUs, CPUs, a free master port).

    Raises:
        PlanError: an option that is wrong on its own or for this cluster, naming it and the fix.
    """
    check_options(cluster, options, facts)
    ordered = node_order(cluster)
    master = ordered[0]
    master_addr = master_address(master, len(ordered), facts)
    check_script_args(options)
    port = facts.master_port
    nodes = [node_plan(node, rank, options, facts, master_addr)
             for rank, node in enumerate(ordered)]
    world = sum(n.nproc for n in nodes)
    return Plan(
        run_id=options.run_id, inventory=cluster.source, group=cluster.group, master=master.name,
        master_addr=master_addr, master_port=port, nnodes=len(ordered),
        world_size=world, script=options.script, args=tuple(options.args),
        max_restarts=options.max_restarts, nodes=tuple(nodes), rdzv=options.rdzv, launcher=options.launcher,
        init_method=options.init_method, debug=options.debug, local_rank_arg=options.local_rank_arg,
        unresolved=tuple(n.name for n in ordered if n.name in facts.unresolved),
        module=options.module, secret_env=secret_env(cluster, options),
        script_local_rank=options.script_local_rank and options.launcher == "torchrun",
        wait=options.wait and any(n.gpus for n in nodes), exit_guard=options.exit_guard,
        hang_timeout=float(options.hang_timeout), on_hang=options.on_hang,
        pdb=pdb_ranks(options.pdb, world), debugpy=pdb_ranks(options.debugpy, world, "debugpy"))


def check_options(cluster: Inventory, options: RunOptions, facts: Facts) -> None:
    """The run's options, each checked on its own and against the cluster (PlanError)."""
    check_own_options(options)
    if not cluster.nodes:
        raise PlanError(f"inventory {cluster.source}: no nodes in group {cluster.group!r}")
    if not is_port(facts.master_port):
        raise PlanError(f"master port {facts.master_port!r} is not a TCP port (1-65535)")
    if options.init_method == "file":
        missing = [n.name for n in cluster.nodes if not n.shared_dir]
        if missing:
            raise PlanError(f"{option('init_method', 'file')} needs ddpfab_shared_dir (a directory every node shares, e.g. "
                            f"on NFS) in the inventory; not set for {', '.join(missing)}")
    ifname_problems = socket_ifname_problems(cluster, options, facts)
    if ifname_problems:
        raise PlanError(ifname_problems)


def check_own_options(options: RunOptions) -> None:
    """The run's options that need no node to be checked (PlanError): a run refuses them before it
    contacts any (the copy of the code included), its dry run too."""
    check_run_id(options.run_id)
    if not options.script:
        raise PlanError("no training script given")
    if options.exit_guard not in EXIT_GUARD_MODES:
        raise PlanError(f"{option('exit_guard')} must be one of {', '.join(EXIT_GUARD_MODES)}, got {options.exit_guard!r}")
    if options.max_restarts < 0:
        raise PlanError(f"{option('max_restarts')} must be >= 0, got {options.max_restarts}")
    if not isinstance(options.hang_timeout, (int, float)) or isinstance(options.hang_timeout, bool) \
            or not 0 <= options.hang_timeout < float("inf"):
        raise PlanError(f"{option('hang_timeout')} must be a number of seconds >= 0 (0: off), got "
                        f"{options.hang_timeout!r}")
    if options.on_hang not in ON_HANG:
        raise PlanError(f"{option('on_hang')} must be one of {', '.join(ON_HANG)}, got {options.on_hang!r}")
    nproc_per_node(options.nproc_per_node)
    if options.module:
        check_module_name(options.script)
    bad_keys = [k for k in options.secret_env if not _ENV_KEY.fullmatch(k)]
    if bad_keys:
        raise PlanError(f"{option('secret_env')} {bad_keys[0]!r}: expected an environment variable name (letters, "
                        "digits, '_')")
    for what, value, allowed in (("rdzv", options.rdzv, RDZV_STYLES), ("launcher", options.launcher, LAUNCHERS),
                                 ("init_method", options.init_method, INIT_METHODS)):
        if value not in allowed:
            raise PlanError(f"{option(what)} {value!r}: expected one of {', '.join(allowed)}")
    if options.pdb and options.debugpy:
        raise PlanError(f"{option('pdb')} with {option('debugpy')}: a rank is debugged one way; pick one "
                        f"({option('debugpy')}: from VS Code)")
    for which in ("pdb", "debugpy"):
        spec = getattr(options, which).strip()
        if spec not in ("", "all"):
            pdb_spans(spec, which)


def master_address(master: Node, nnodes: int, facts: Facts) -> str:
    """The master's address as every peer dials it: an IP literal, not a loopback one when there
    are peers (an offline plan may keep a name the controller could not resolve, marked as such)."""
    master_addr = facts.addresses.get(master.name)
    if master_addr is None:
        raise PlanError(f"host {master.name}: no resolved address for the master")
    try:
        ip = ipaddress.ip_address(master_addr)
        master_addr = str(ip)
    except ValueError:
        if master.name not in facts.unresolved or not is_address(master_addr):
            raise PlanError(f"host {master.name}: master address {master_addr!r} is not an IP literal") from None
        ip = None
    if ip is not None and ip.is_loopback and nnodes > 1:
        raise PlanError(f"host {master.name}: its data address {master.data_addr} resolves to {master_addr}, "
                        "a loopback address the other nodes cannot reach; set ddpfab_data_addr "
                        "(or ansible_host) to an address on the network the nodes share")
    return master_addr


def check_script_args(options: RunOptions) -> None:
    """How the script takes its local rank, and the placeholders in its arguments (PlanError)."""
    if options.local_rank_arg not in LOCAL_RANK_ARGS:
        raise PlanError(f"local rank argument {options.local_rank_arg!r}: expected one of {', '.join(LOCAL_RANK_ARGS)}")
    used = placeholders_in(options.args)
    if options.rdzv == "c10d" and "node_rank" in used:
        raise PlanError(f"{{{{node_rank}}}} in a script argument needs {option('rdzv', 'static')}: with c10d, "
                        "torchrun assigns node ranks at rendezvous and ddpfab cannot know them beforehand (read "
                        "GROUP_RANK in the script)")
    expand_placeholders(tuple(options.args), dict.fromkeys(PLACEHOLDERS, ""))  # an unknown name: PlanError


def node_plan(node: Node, rank: int, options: RunOptions, facts: Facts, master_addr: str) -> NodePlan:
    """Node *node*'s part, at node rank *rank*: its procs, dirs and environment."""
    nproc = nproc_for(node, options, facts.gpus.get(node.name), facts.cpus.get(node.name))
    home = facts.homes.get(node.name)
    try:
        workdir = remote_workdir(node.workdir, home) if node.workdir is not None else facts.cwd
    except PlanError as exc:
        raise PlanError(f"host {node.name}: {exc}") from None
    remote_dir = remote_path(f"{options.remote_runs_dir.rstrip('/')}/{options.run_id}", home)
    return NodePlan(
        name=node.name, ssh_host=node.host, ssh_port=node.port, ssh_user=node.user,
        node_rank=rank, nproc=nproc, data_addr=facts.addresses.get(node.name, node.data_addr),
        workdir=workdir, remote_dir=remote_dir, env=node_env(node, options, facts, master_addr, remote_dir),
        shared_dir=node.shared_dir, **node_python(node), setup=node.setup, conda_env=node.conda_env,
        gpus=gpu_lease(node, options, nproc, facts.gpus.get(node.name)), gpu_pin=tuple(node.gpu_ids or ()))


def node_env(node: Node, options: RunOptions, facts: Facts, master_addr: str, remote_dir: str) -> dict[str, str]:
    """The env of *node*'s ranks: ddpfab's base (and debug) env, the inventory's per-node env
    (ddpfab_env, the GPU list), what the command line asked, then what ddpfab sets for the run
    (its id, the init method's URL, NCCL's flight recorder, the socket interface) unless asked."""
    asked = dict(options.env)
    env = dict(BASE_ENV)
    if options.debug:
        env.update(DEBUG_ENV)
    if node.gpu_ids:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(node.gpu_ids)
    env.update(node.env)
    env.update(asked)
    env["DDPFAB_RUN_ID"] = options.run_id
    init_url = init_method_url(options.init_method, master_addr=master_addr, master_port=facts.master_port,
                               shared_dir=node.shared_dir, run_id=options.run_id)
    if init_url:
        env[INIT_METHOD_VAR] = init_url
    if node.gpus:  # NCCL: its flight recorder, dumped into the run's record dir
        recorder = {**FLIGHT_RECORDER_ENV, **dict.fromkeys(FLIGHT_RECORDER_FILE_VARS,
                                                           f"{remote_dir}/{FLIGHT_RECORDER_PREFIX}")}
        env.update({k: v for k, v in recorder.items() if k not in asked and k not in node.env})
    if options.debug and not node.gpus and "TORCH_DISTRIBUTED_DEBUG" not in asked \
            and "TORCH_DISTRIBUTED_DEBUG" not in node.env:
        env.update(DEBUG_ENV_GLOO)
    ifname, _ = socket_ifname_for(node, options, facts)
    if ifname:
        for key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            if key not in asked and key not in node.env:
                env[key] = ifname
    return env


def pdb_ranks(spec: str, world_size: int, field: str = "pdb") -> str:
    """``--pdb``'s (or ``--debugpy``'s) ranks as the plan keeps them: "all", or the global ranks in
    order, separated by commas ("" when *spec* is empty: no debugger).

    Args:
        spec: "all", or ranks and ranges separated by commas (``"5"``, ``"0,3-4"``).
        world_size: the job's number of ranks; a rank at or beyond it is refused.
        field: the option it came from (``pdb`` or ``debugpy``), as errors name it (:func:`option`).
    """
    spec = spec.strip()
    if spec in ("", "all"):
        return spec
    spans = pdb_spans(spec, field)
    beyond = min((first if first >= world_size else world_size for first, last in spans if last >= world_size),
                 default=None)
    if beyond is not None:
        raise PlanError(f"{option(field, spec)}: rank {beyond} is not in this job (its ranks are 0-{world_size - 1})")
    return ",".join(str(r) for r in sorted({r for first, last in spans for r in range(first, last + 1)}))


def pdb_spans(spec: str, field: str = "pdb") -> list[tuple[int, int]]:
    """``--pdb``'s (or ``--debugpy``'s) ranks and ranges (not "all") as (first, last) pairs, or a
    PlanError naming the spelling: what can be said of them before the job's size is known."""
    spans = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if not m or (m.group(2) is not None and int(m.group(2)) < int(m.group(1))):
            raise PlanError(f"{option(field)} takes 'all' or ranks and ranges separated by commas (5, 0,3-4), got {spec!r}")
        spans.append((int(m.group(1)), int(m.group(2) or m.group(1))))
    return spans


def secret_env(cluster: Inventory, options: RunOptions) -> tuple[str, ...]:
    """The keys marked secret for a run: ``--secret-env``'s, then every node's ``ddpfab_secret_env``
    (one set for the whole plan: masking a key on every node where one node marks it is harmless)."""
    keys = dict.fromkeys(options.secret_env)
    for node in cluster.nodes:
        keys.update(dict.fromkeys(node.secret_env))
    return tuple(keys)
