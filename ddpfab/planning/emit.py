"""``ddpfab plan --emit DIR``: the plan as one self-contained shell script per node, plus a README.

Each script is the node's launch rendered by :func:`ddpfab.planning.render.script_lines` as ``set -eu;
cd WORKDIR; export K=V ...; exec ARGV`` (no secret value in any process's argv): the same
renderer parts that give the argv ``ddpfab run`` hands the node supervisor, so what runs by hand
over plain SSH is what ddpfab runs. What ddpfab adds around it and a script does not: the node
supervisor (output relay, ``~/.ddpfab/runs/<id>/output.log``, ending the job tree when the link
goes), and the run record.

Pure text functions plus :func:`write`; no SSH here.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from ddpfab.hosts import nodeenv
from ddpfab.optionnames import option
from ddpfab.planning.plan import NodePlan, Plan
from ddpfab.planning.render import script_lines
from ddpfab.problems import DdpfabError
from ddpfab.remote.target import Target, config_alias, config_scp_argv, config_ssh_argv, scp_argv, ssh_argv, ssh_config_text

README = "README.txt"
#: The ssh_config beside the scripts: a block per node, so that a line says ``ssh -F ssh_config NODE``
SSH_CONFIG = "ssh_config"


def script_name(node: NodePlan) -> str:
    """``rank1-node2.sh``: node rank 1's script, to run on node2."""
    return f"rank{node.node_rank}-{node.name}.sh"


def ssh_target(node: NodePlan, targets: dict[str, Target] | None = None) -> Target:
    """How to reach *node*: its resolved :class:`ddpfab.remote.target.Target` (inventory + ssh_config +
    host-key policy, jump hosts included), else what the plan records (address, port, user)."""
    if targets and node.name in targets:
        return targets[node.name]
    return Target(node.name, node.ssh_host, node.ssh_port or 22, node.ssh_user)


def ssh_words(node: NodePlan, targets: dict[str, Target] | None, tty: bool = False) -> list[str]:
    """How a line beside the scripts reaches *node*: ``ssh -F ssh_config NODE`` (the emitted
    ssh_config holds every option), or every option on the line where the node has no block."""
    if targets and node.name in targets and config_alias(node.name):
        return config_ssh_argv(SSH_CONFIG, node.name, tty=tty)
    return ssh_argv(ssh_target(node, targets), tty=tty)


def scp_words(node: NodePlan, targets: dict[str, Target] | None) -> list[str]:
    """``scp`` of *node*'s script to its home there, the same way as :func:`ssh_words`."""
    if targets and node.name in targets and config_alias(node.name):
        return config_scp_argv(SSH_CONFIG, node.name, script_name(node))
    return scp_argv(ssh_target(node, targets), script_name(node))


def self_remove(node: NodePlan) -> str:
    """The script's line that removes the copy :func:`interactive_line` put in the node's home as
    it starts it (``sh`` reads on from the open file): a copy that holds secret values is not left
    there, whatever happens next. Only that copy, and only when it is the file running: run by
    another name or path, from another directory, or on stdin (``sh -s``, whose $0 is ``sh``),
    nothing is removed."""
    name = shlex.quote(script_name(node))
    return (f'case $0 in {name}) [ "$(cd -P . && pwd)" != "$(cd -P "$HOME" && pwd)" ] || rm -f -- "$HOME"/{name} '
            ';; esac  # the copy made to run it here\n')


def interactive_line(node: NodePlan, targets: dict[str, Target] | None) -> str:
    """From the emit dir: *node*'s script copied to its home there, then run with a terminal (so
    Ctrl-C and a dropped connection end torchrun and its workers)."""
    return (f"{shlex.join(scp_words(node, targets))} && {shlex.join(ssh_words(node, targets, tty=True))} "
            f"sh {script_name(node)}")


def node_script(plan: Plan, node: NodePlan, ssh_line: str = "", body: str | None = None) -> str:
    """*node*'s script: its header, then *body* (a job ddpfab sees:
    :func:`ddpfab.launch.handrun.script_body`), else the launch itself, without ddpfab's supervisor."""
    how = f"#   {ssh_line} 'sh -s' < {script_name(node)}\n" if ssh_line else ""
    head = (
        "#!/bin/sh\n"
        f"# ddpfab plan {plan.run_id}: node {node.name} (node_rank {node.node_rank} of {plan.nnodes}, "
        f"{node.nproc} procs; world size {plan.world_size}; master {plan.master_addr}:{plan.master_port}; "
        f"rdzv {plan.rdzv}, launcher {plan.launcher}, init {plan.init_method}).\n"
        + (f"# {plan.unresolved_note()}\n" if plan.unresolved else "")
        + f"# Run it on {node.name} (start every node's script; any order, they wait for each other), from this directory:\n"
        f"{how}"
        f"{self_remove(node)}")
    if body is not None:
        return (head + "# It starts ddpfab's node supervisor with the job, as `ddpfab run` does: ddpfab ps, stop, logs,\n"
                f"# attach and doctor {plan.run_id} see it; Ctrl-C ends it. It holds secret env values: keep it private.\n"
                "set -eu\n" + body)
    lines = "\n".join(script_lines(plan, node, prefix=False))
    return (head
            + "# Exactly the command `ddpfab run` would start there (ddpfab.planning.render), without ddpfab's\n"
            "# supervisor. It may hold secret env values: keep it private.\n"
            # the node's setup before `set -eu`: as ddpfab runs it (activate scripts trip over -u)
            f"{nodeenv.prefix(node)}"
            "set -eu\n"
            f"{lines}\n")


def readme(plan: Plan, targets: dict[str, Target] | None = None, supervised: bool = False) -> str:
    lines = [
        (f"ddpfab plan {plan.run_id}: {plan.nnodes} nodes, world size {plan.world_size}, "
         f"master {plan.master} {plan.master_addr}:{plan.master_port}"),
        f"{'module (-m)' if plan.module else 'script'}: {plan.script} {shlex.join(plan.args)}".rstrip(),
        (f"launch style: rdzv {plan.rdzv}, launcher {plan.launcher}, init method {plan.init_method}"
         + (", debug logging" if plan.debug else "")),
        *([plan.unresolved_note()] if plan.unresolved else []),
        "",
        "Start every node's script on that node, in any order, within the rendezvous timeout; they wait",
        *(["for each other. Each starts ddpfab's node supervisor with the job, as `ddpfab run` does:",
           f"`ddpfab ps`, `ddpfab stop {plan.run_id}`, `logs`, `attach` and `doctor` see it. From this",
           "directory, non-interactively (output comes back; the job ends when its output can no longer",
           "reach you, or with `ddpfab stop`):"] if supervised else
          ["for each other. From this directory, non-interactively (output comes back; Ctrl-C does NOT",
           "stop the remote job):"]),
        "",
    ]
    for node in sorted(plan.nodes, key=lambda n: n.node_rank):
        lines.append(f"  # {node.name}: node_rank {node.node_rank}, {node.nproc} procs")
        lines.append(f"  {shlex.join(ssh_words(node, targets))} 'sh -s' < {script_name(node)}")
    lines += [
        "",
        "Interactively (a terminal, so Ctrl-C / a dropped connection ends torchrun and its workers; the",
        "copy in the node's home removes itself as it starts):",
        "",
    ]
    for node in sorted(plan.nodes, key=lambda n: n.node_rank):
        lines.append(f"  {interactive_line(node, targets)}")
    if plan.pdb and supervised:
        lines += [
            "",
            f"With --pdb {plan.pdb}, a rank that stops at breakpoint() or an uncaught exception waits in",
            "pdb: drive it from its node's terminal (the interactive line), or from here with",
            f"`ddpfab debug {plan.run_id} --rank {plan.pdb if plan.pdb.isdigit() else 'R'}`.",
        ]
    lines += [
        "",
        f"The master port {plan.master_port} was free on {plan.master} when this was planned; if it is",
        "taken by the time you run, plan again (or pass --master-port).",
        f"torchrun keeps each rank's full log under {plan.nodes[0].remote_dir}/torchrun on every node.",
        "These files may contain secret env values (--env, --env-file): keep them private.",
    ]
    return "\n".join(lines) + "\n"


class EmitError(DdpfabError):
    """The scripts cannot be written where asked; the message says why and what to do."""

    check = "emit"


#: The list of files ddpfab wrote into an emit dir: all that a later emit there may replace.
MARKER = ".ddpfab-emit"


def own_files(out: Path) -> list[str] | None:
    """The names a previous emit recorded in *out* (its marker read as data: plain names), or None
    when ddpfab never wrote there."""
    marker = out / MARKER
    if marker.is_symlink() or not marker.is_file():
        return None
    try:
        text = marker.read_text(encoding="utf-8")
    except (OSError, ValueError):  # unreadable, or not what ddpfab writes: no list of ddpfab's
        return None
    return [n for n in text.splitlines() if n and "/" not in n and n != MARKER]


def write(plan: Plan, directory: str | os.PathLike, targets: dict[str, Target] | None = None,
          force: bool = False, bodies: dict[str, str] | None = None) -> list[Path]:
    """Write every node's script and the README into *directory*: files 0700/0600 (they may hold
    secrets), a new directory 0700. An existing directory is never re-moded, and one that is not
    empty is refused unless ddpfab emitted there before (its ``.ddpfab-emit`` lists what it
    wrote: only those files are replaced) or *force* (then ddpfab writes its own files and
    touches nothing else). *bodies*: node -> its script's body after the header (a job ddpfab
    sees); a node without one gets the launch itself."""
    out = Path(directory)
    if not out.exists():
        out.mkdir(parents=True, mode=0o700)
        os.chmod(out, 0o700)  # (mkdir's mode is filtered by the umask)
    elif out.is_symlink():  # private files are not written through a link someone may point elsewhere
        raise EmitError(f"emit directory {out}: is a symbolic link; give the directory itself ({os.path.realpath(out)})")
    elif not out.is_dir():
        raise EmitError(f"emit directory {out}: exists and is not a directory; pick a new directory")
    ours = own_files(out)
    if ours is None and any(out.iterdir()) and not force:
        raise EmitError(f"emit directory {out}: not empty and ddpfab did not write it; pick a new or empty "
                        f"directory, or {option('force', True)} to add ddpfab's files there (nothing else is touched)")
    for name in ours or []:  # a previous emit's scripts: the directory holds exactly this plan
        old = out / name
        if old.is_file() and not old.is_symlink():
            old.unlink()
    written = []
    for node in sorted(plan.nodes, key=lambda n: n.node_rank):
        path = out / script_name(node)
        write_private(path, node_script(plan, node, shlex.join(ssh_words(node, targets)), (bodies or {}).get(node.name)),
                      0o700)
        written.append(path)
    if targets:
        write_private(out / SSH_CONFIG, ssh_config_text({n.name: ssh_target(n, targets) for n in plan.nodes}), 0o600)
        written.append(out / SSH_CONFIG)
    path = out / README
    write_private(path, readme(plan, targets, supervised=bool(bodies)), 0o600)
    written.append(path)
    write_private(out / MARKER, "".join(f"{p.name}\n" for p in written), 0o600)
    return written


def write_private(path: Path, text: str, mode: int) -> None:
    """A new file with *mode* from the start, then renamed over *path* (never writes through a
    link, never leaves an old file's looser mode)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
