"""Renderings of a plan's launch: the plan holds it as data, these pure functions write it out.

One node's launch (:func:`command`) is made of parts, each a tuple of argv words: the program
(``PYTHON -m MODULE``), the job's size, the rendezvous flags (node rank and master, or c10d's
endpoint), the launcher's other flags, torchrun's log dir, the legacy launcher's ``--use-env``, and
the script with its arguments (``{{placeholders}}`` filled in with the node's values), in that order
(the order schema-2 manifests recorded). Every consumer renders those same parts:

- :func:`argv`: what the node's supervisor execs (no shell in between);
- :func:`shell_line`: ``cd WORKDIR && env K=V ... ARGV`` for dry-run output and pasting into an
  SSH session; :func:`script_lines` the same as an emitted script's ``cd``, ``export`` and ``exec`` lines;
- :func:`shell_words`: the launch as shell words, the rendezvous flags optionally left out or given
  as a scheduler's references (sbatch and Kubeflow exports, :mod:`ddpfab.planning.export`).

Nothing parses a rendering back: a consumer that needs a part asks for the part. They agree by
construction, and ``tests/unit/test_render.py`` checks it: the shell renderings, split with
:func:`shlex.split`, give exactly :func:`argv`. What is shown is rendered from :func:`masked`
(secret env values masked by key, never by text).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, replace

from ddpfab.hosts import nodeenv
from ddpfab.masking import mask_env, mask_setup
from ddpfab.planning.plan import LAUNCHERS, NodePlan, Plan, expand_placeholders, host_port


@dataclass(frozen=True)
class Rendezvous:
    """A node's rendezvous values as the launcher's flags take them.

    Args:
        node_rank: the node rank, or a scheduler's reference to it (``$(RANK)``).
        master_addr: the master's address, or a reference (``$(MASTER_ADDR)``).
        master_port: the master's port, or a reference (``$(MASTER_PORT)``).
    """

    node_rank: str
    master_addr: str
    master_port: str


@dataclass(frozen=True)
class Command:
    """One node's launch in its parts, each a tuple of argv words.

    Args:
        program: ``(python, "-m", module)``.
        size: ``--nnodes`` and ``--nproc-per-node``.
        rendezvous: node rank and master (static), or c10d's backend, endpoint, id and host flag.
        flags: the launcher's other flags (restarts, output relay).
        log_dir: torchrun's per-rank log dir on the node (``--log-dir``); relative to the node
            user's home when the plan was made offline.
        legacy: ``--use-env`` for the legacy launcher with ``--local_rank`` scripts, else empty.
        script: the script and its arguments, placeholders filled in; in module mode
            ``("-m", MODULE, *args)`` (the launcher's own ``-m`` flag, last of its flags).
    """

    program: tuple[str, ...]
    size: tuple[str, ...]
    rendezvous: tuple[str, ...]
    flags: tuple[str, ...]
    log_dir: str
    legacy: tuple[str, ...]
    script: tuple[str, ...]

    def argv(self) -> tuple[str, ...]:
        return (*self.program, *self.size, *self.rendezvous, *self.flags, f"--log-dir={self.log_dir}", *self.legacy,
                *self.script)


def placeholder_values(plan: Plan, node: NodePlan) -> dict[str, object]:
    """The values the ``{{name}}`` placeholders of the script's arguments take on *node*."""
    return {"node_rank": node.node_rank, "nnodes": plan.nnodes, "nproc": node.nproc, "world_size": plan.world_size,
            "master_addr": plan.master_addr, "master_port": plan.master_port, "run_id": plan.run_id,
            "node_name": node.name}


def rendezvous_flags(plan: Plan, node: NodePlan, where: Rendezvous | None = None) -> tuple[str, ...]:
    """*rdzv* "static": ``--node-rank`` and ``--master-addr/--master-port``. "c10d": torchrun's c10d
    rendezvous on the master's address and port (``--rdzv-id`` = the run id), no node rank:
    torchrun assigns them. ddpfab still decides who hosts the rendezvous store: the master is told
    ``is_host=1``, the others ``is_host=0`` (torchrun would otherwise guess from host names).

    Args:
        plan, node: the node's plan.
        where: the values to give instead of the plan's (a scheduler's references).
    """
    where = where or Rendezvous(str(node.node_rank), plan.master_addr, str(plan.master_port))
    if plan.rdzv == "c10d":
        return ("--rdzv-backend=c10d", f"--rdzv-endpoint={host_port(where.master_addr, where.master_port)}",
                f"--rdzv-id={plan.run_id}", f"--rdzv-conf=is_host={1 if where.node_rank == '0' else 0}")
    return static_rendezvous(where)


def static_rendezvous(where: Rendezvous) -> tuple[str, ...]:
    """Static rendezvous flags for *where* (the plan's values or a scheduler's references)."""
    return (f"--node-rank={where.node_rank}", f"--master-addr={where.master_addr}",
            f"--master-port={where.master_port}")


def command(plan: Plan, node: NodePlan, where: Rendezvous | None = None) -> Command:
    """*node*'s launch: the launcher through the node's own python (``-m torch.distributed.run``),
    never a `torchrun` found on PATH that may belong to another environment.

    ``--tee=3`` makes torchrun relay each rank's output line by line with a ``[default<local
    rank>]:`` prefix (ranks writing to one shared pipe would interleave mid-line) and keeps a full
    per-rank log under the log dir on the node.

    *launcher* "legacy" runs ``torch.distributed.launch`` (deprecated, still in torch 2.13; same
    flags as torchrun) without ``--use-env``, so each worker also gets ``--local-rank=N`` as its
    first argument, as scripts written for it expect; with *local_rank_arg* "--local_rank" it runs
    with ``--use-env`` and passes ``--local_rank=${local_rank}`` itself (torch substitutes each
    worker's local rank), for scripts written for torch 1.x.

    Under torchrun, a script that declares a local-rank argument (*script_local_rank*) gets it the
    same way: ``LOCAL_RANK_ARG=${local_rank}`` before its own arguments, which torchrun's agent
    substitutes per worker (torch.distributed.elastic.utils.macros); torchrun itself only sets
    LOCAL_RANK, and a script that parses ``--local_rank`` with a default would get that default.

    Module mode (*module*): ``-m MODULE`` after the launcher's flags, as ``torchrun -m`` takes it.

    Args:
        plan, node: the node's plan.
        where: rendezvous values instead of the plan's (see :func:`rendezvous_flags`).
    """
    script_args = expand_placeholders(plan.args, placeholder_values(plan, node))
    legacy: tuple[str, ...] = ()
    if plan.launcher == "legacy" and plan.local_rank_arg == "--local_rank":
        legacy = ("--use-env",)
        script_args = ("--local_rank=${local_rank}", *script_args)
    elif plan.launcher == "torchrun" and plan.script_local_rank:
        script_args = (f"{plan.local_rank_arg}=${{local_rank}}", *script_args)
    script = ("-m", plan.script) if plan.module else (plan.script,)
    return Command(program=(node.python, "-m", LAUNCHERS[plan.launcher]),
                   size=(f"--nnodes={plan.nnodes}", f"--nproc-per-node={node.nproc}"),
                   rendezvous=rendezvous_flags(plan, node, where),
                   flags=(f"--max-restarts={plan.max_restarts}", "--tee=3"), log_dir=f"{node.remote_dir}/torchrun",
                   legacy=legacy, script=(*script, *script_args))


def argv(plan: Plan, node: NodePlan) -> tuple[str, ...]:
    """What *node*'s supervisor execs, word for word."""
    return command(plan, node).argv()


def home_path_word(path: str) -> str:
    """*path* as a shell word; a relative path (an offline plan: the node's home is not known) is
    anchored at ``$HOME``, as the plan means it (``ddpfab run`` resolves it against the SSH user's
    home): after ``cd WORKDIR`` it would otherwise land in the project's workdir."""
    if path.startswith("/"):
        return shlex.quote(path)
    return '"$HOME"/' + shlex.quote(path)


def log_dir_word(path: str) -> str:
    """``--log-dir=PATH`` as one shell word (see :func:`home_path_word`)."""
    return shlex.quote(f"--log-dir={path}") if path.startswith("/") else "--log-dir=" + home_path_word(path)


def shell_words(cmd: Command, rendezvous: bool = True, log_dir: bool = True) -> list[str]:
    """*cmd* as shell words (each quoted), without the rendezvous flags or the log dir when asked
    (a scheduler puts its own in, or has no node-local log dir)."""
    words = [shlex.quote(w) for w in (*cmd.program, *cmd.size, *(cmd.rendezvous if rendezvous else ()), *cmd.flags)]
    if cmd.program[0] == nodeenv.ON_NODE:  # the python the node chooses (nodeenv.prefix sets it)
        words[0] = nodeenv.ON_NODE_WORD
    if log_dir:
        words.append(log_dir_word(cmd.log_dir))
    return words + [shlex.quote(w) for w in (*cmd.legacy, *cmd.script)]


def env_command(plan: Plan, node: NodePlan) -> str:
    """``env K=V ... ARGV``: the node's environment and launch as one shell command."""
    env = " ".join(shlex.quote(f"{k}={v}") for k, v in node.env.items())
    return f"env {env} {' '.join(shell_words(command(plan, node)))}"


def shell_line(plan: Plan, node: NodePlan) -> str:
    """The one shell line a node runs: paste it into an SSH session and you get the same run."""
    return f"{nodeenv.prefix(node)}cd {shlex.quote(node.workdir)} && {env_command(plan, node)}"


def script_lines(plan: Plan, node: NodePlan, prefix: bool = True) -> list[str]:
    """The same as a script's lines: the node's setup (:func:`ddpfab.hosts.nodeenv.prefix`; unless
    *prefix* is false, when the caller puts it first itself), ``cd``, one ``export K=V`` per
    variable, then ``exec`` (the launcher replaces the shell). Exports, not ``exec env K=V``: the env program's argv would show a
    secret value to every user (``ps``) until it execs; a shell builtin has no argv."""
    exports = [f"export {shlex.quote(f'{k}={v}')}" for k, v in node.env.items()]
    return [*(nodeenv.prefix(node).splitlines() if prefix else ()), f"cd {shlex.quote(node.workdir)}", *exports,
            f"exec {' '.join(shell_words(command(plan, node)))}"]


def masked(plan: Plan) -> Plan:
    """*plan* with every secret value masked, in its env and its setup lines, by key (:mod:`ddpfab.masking`): render
    this one wherever the plan is shown."""
    return replace(plan, nodes=tuple(replace(n, env=mask_env(n.env, plan.secret_env),
                                             setup=mask_setup(n.setup, plan.secret_env)) for n in plan.nodes))
