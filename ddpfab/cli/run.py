"""``ddpfab run`` and ``ddpfab plan``: make the plan, then start it (or print it, or emit it)."""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shlex
import sys
from collections.abc import Callable, Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

from ddpfab.api import Options
from ddpfab.cli import recover as recovery
from ddpfab.cli.common import (add_cluster_args, add_env_args, add_floors_arg, add_include_keys_arg, add_runs_dir_arg,
                               add_script_args, api_cluster, nonempty_path, nproc_type)
from ddpfab.cli.errors import EXIT_FAILED, die, print_problems, refuse
from ddpfab.cli.perf import add_run_arguments as add_perf_arguments
from ddpfab.hosts import inventory
from ddpfab.launch.cause import CauseKind
from ddpfab.optionnames import NO_VALUE
from ddpfab.planning import plan as planmod
from ddpfab.planning.plan import EXIT_GUARD_MODES, HANG_TIMEOUT_S, ON_HANG


def _add_run_args(p: argparse.ArgumentParser) -> None:
    """Everything that shapes the plan: shared by `run` and `plan`."""
    add_cluster_args(p)
    _add_size_args(p)
    _add_env_args(p)
    _add_watch_args(p)
    _add_style_args(p)
    _add_output_args(p)


def _add_size_args(p: argparse.ArgumentParser) -> None:
    """The job's size: processes, GPUs, the master port."""
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=nproc_type, metavar="N|gpu|cpu|auto",
                   help="processes per node (default: inventory, GPUs, or 1); as torchrun: gpu = the node's GPUs, "
                        "cpu = its CPUs, auto = its GPUs if any, else its CPUs (decided per node from the probe)")
    p.add_argument("--master-port", "--master_port", type=int,
                   help="MASTER_PORT (default: a port found free on the master)")
    p.add_argument("--gpus-per-node", type=int, metavar="N",
                   help="GPUs each node's supervisor leases for the job, free ones (default: one per process, "
                        "or the inventory's ddpfab_gpu_ids); the job sees exactly those (CUDA_VISIBLE_DEVICES)")
    p.add_argument("--wait", action="store_true",
                   help="GPUs leased or busy: wait in each node's queue, in arrival order, instead of refusing")


def _add_env_args(p: argparse.ArgumentParser) -> None:
    """The job's environment and the preflight's checks."""
    add_env_args(p)
    p.add_argument("--secret-env", action="append", default=[], metavar="KEY",
                   help="mask KEY's value wherever the run is shown or recorded (repeatable; also the inventory's "
                        "ddpfab_secret_env list), besides the keys the built-in rule masks (docs: the masking rule)")
    p.add_argument("--no-check", action="store_true",
                   help="skip the preflight checks (firewall/data plane, hostnames, versions)")
    add_floors_arg(p)
    p.add_argument("--socket-ifname", metavar="IFACE|auto|none",
                   help="set GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME; auto = the interface each node "
                        "reaches its peers through (default where neither variable is set; a node "
                        "without one such interface then gets none, with a warning); none/off = never; "
                        "IFACE = exact interface names, comma-separated (eth0,eth1), as gloo reads them: "
                        "each must be up, with an address, on every node, or the run is refused before it "
                        "starts (not checked with --offline); NCCL-only forms (^lo, =eth0, a prefix like "
                        "eth) are refused: use --env NCCL_SOCKET_IFNAME=...")


def _add_watch_args(p: argparse.ArgumentParser) -> None:
    """How failures, hangs and debuggers are handled."""
    p.add_argument("--max-restarts", "--max_restarts", type=int, default=0,
                   help="torchrun's in-node restarts (default 0)")
    p.add_argument("--exit-guard", choices=EXIT_GUARD_MODES, default="on",
                   help="the ranks' exit guard (docs/exit-race.md): on (default) = each rank "
                        "records that it finished and leaves without the interpreter teardown where gloo can abort "
                        "it; record = only record (a finished rank that aborts is reported as such, not as a "
                        "failure); off = nothing in the ranks' interpreter")
    p.add_argument("--hang-timeout", type=float, default=HANG_TIMEOUT_S, metavar="SECONDS",
                   help=f"when no rank has printed for SECONDS, run `ddpfab doctor` by itself: print which rank "
                        f"is stopped, gone or elsewhere and where the others wait (default {HANG_TIMEOUT_S:g}; 0: off)")
    p.add_argument("--on-hang", choices=ON_HANG, default="report",
                   help="when the doctor finds a hang: report (default: keep waiting) or stop (end the job at once, "
                        "exit code 124)")
    p.add_argument("--pdb", nargs="?", const="all", default="", metavar="RANKS",
                   help="a rank that reaches breakpoint() or raises an uncaught exception waits in pdb, driven from "
                        "this terminal over the run's SSH connection: RANKS = all (the default without a value) or "
                        "global ranks and ranges (5, 0,3-4); the others run as without it")
    p.add_argument("--debugpy", nargs="?", const="all", default="", metavar="RANKS",
                   help="debugpy in these ranks (RANKS as --pdb): each waits for a DAP client (VS Code) before the "
                        "script runs, its port forwarded to this machine's loopback over the run's SSH connection; "
                        "breakpoint() stops there; the launch.json entries are printed and kept in the run's dir")


def _add_style_args(p: argparse.ArgumentParser) -> None:
    """The run's id and its launch style."""
    p.add_argument("--run-id", help="the run id (default: time + random suffix)")
    p.add_argument("--rdzv", choices=("static", "c10d"), default="static",
                   help="static: node_rank fixed in inventory order (default); c10d: torchrun's c10d rendezvous "
                        "on the master (torchrun assigns node ranks)")
    p.add_argument("--launcher", choices=("torchrun", "legacy"), default="torchrun",
                   help="torchrun (default), or legacy: torch.distributed.launch, which passes --local-rank=N "
                        "to scripts written for it (--local_rank=N to a script that declares only that spelling)")
    p.add_argument("--local-rank-style", choices=("auto", "dash", "underscore"), default="auto",
                   help="how the script gets its local rank as an argument: --local-rank (dash) or --local_rank "
                        "(underscore); auto (default) reads the script here: the legacy launcher passes the "
                        "spelling it declares (else the dash), torchrun passes it only to a script that declares "
                        "one (torchrun itself sets only LOCAL_RANK)")
    p.add_argument("--init-method", choices=("env", "tcp", "file"), default="env",
                   help="for scripts that call init_process_group via ddpfab.dist: env:// (default), "
                        "tcp://MASTER:PORT, or file:// in the inventory's ddpfab_shared_dir (DDPFAB_INIT_METHOD)")
    p.add_argument("--debug", action="store_true",
                   help="NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET TORCH_DISTRIBUTED_DEBUG=DETAIL "
                        "TORCH_CPP_LOG_LEVEL=INFO (--env wins; TORCH_DISTRIBUTED_DEBUG=INFO on nodes without "
                        "ddpfab_gpus: DETAIL crashes DDP on gloo); per-rank logs: ddpfab logs --ranks RUN_ID")


def _add_output_args(p: argparse.ArgumentParser) -> None:
    """How the plan is made and shown, and the script itself."""
    p.add_argument("--offline", action="store_true",
                   help="plan without contacting the hosts; port = --master-port or 29500 (run: with --dry-run)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (run: only with --dry-run)")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no progress lines (copies, rendezvous waits); they are off anyway when stderr is not a terminal")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="every line of the job's output: torchrun's failure reports and the tracebacks of ranks "
                        "that lost their peer are folded otherwise (the node logs keep them: ddpfab logs RUN_ID)")
    p.add_argument("-m", "--module", action="store_true",
                   help="SCRIPT is a module, run as `python -m SCRIPT` (torchrun's -m; `-- -m pkg.train` too)")
    add_script_args(p, "training script, relative to the nodes' workdir (with -m: a module)",
                    "arguments for the script, passed unchanged except the per-node placeholders "
                    "{{node_rank}} {{nnodes}} {{nproc}} {{world_size}} {{master_addr}} {{master_port}} "
                    "{{run_id}} {{node_name}} (quote them for the shell)")


def _add_run_command_args(run: argparse.ArgumentParser) -> None:
    """Every option of ``ddpfab run``."""
    _add_run_args(run)
    run.add_argument("--no-sync", action="store_true",
                     help="do not sync the current directory to the nodes' workdirs first")
    run.add_argument("--fanout", choices=("star", "tree"), default="star",
                     help="sync: star = controller to every node; tree = nodes forward to each other")
    run.add_argument("--compress", action="store_true", help="sync: rsync --compress (slow uplinks)")
    add_include_keys_arg(run, "sync: ")
    run.add_argument("--replicate", action="append", default=[], metavar="PATH",
                     help="copy PATH (a file, relative to the workdir: a checkpoint saved by rank 0 only) from rank "
                          "0's node to every other node before the launch, verified by hash on each; repeatable; "
                          "adds to the inventory's ddpfab_replicate. Nothing to copy (a first run): said, and on")
    run.add_argument("--tmux", action="store_true",
                     help="each node's launch in a window of a tmux session (ddpfab-RUN_ID), with a terminal there: "
                          "Ctrl-C and the keyboard reach that node's torchrun; the first node to fail stops the others")
    run.add_argument("--detach", action="store_true",
                     help="start the job and return; it runs on without ddpfab (see attach, logs, ps, stop)")
    add_runs_dir_arg(run)
    run.add_argument("--dry-run", action="store_true",
                     help="print the plan and each node's exact command; start nothing")
    run.add_argument("--no-color", action="store_true", help="no colours in the output")
    recovery.add_arguments(run)
    add_perf_arguments(run)  # --perf-check


def register(sub) -> None:
    run = sub.add_parser("run", help="launch torchrun on every node of the inventory",
                         description="Launch SCRIPT with torchrun on every node; ARGS pass through unchanged.")
    _add_run_command_args(run)
    run.set_defaults(func=cmd_run)

    plan = sub.add_parser("plan", help="print (or --emit as shell scripts) exactly what `run` would start",
                          description="Make the plan `ddpfab run` would make (contacting the hosts for a free "
                                      "port, unless --offline) and print it; --emit DIR writes one shell script "
                                      "per node that reproduces the run by hand over plain SSH.")
    _add_run_args(plan)
    plan.add_argument("--emit", metavar="DIR", type=nonempty_path,
                      help="write DIR/rank<node rank>-<host>.sh per node (the exact env and launcher command) and "
                           "DIR/README.txt (which to run where, with the ssh command line); private files, "
                           "and a non-empty DIR that ddpfab did not write is refused")
    plan.add_argument("--force", action="store_true",
                      help="--emit into a non-empty directory anyway (only ddpfab's own files are written)")
    add_runs_dir_arg(plan, "where --emit records the run (its scripts start a job ddpfab sees)")
    plan.add_argument("--tmux", action="store_true",
                      help="with --emit: a tmux session (ddpfab-RUN_ID), a window per node in DIR with that node's "
                           "line typed at the prompt, not run: Enter in a window starts that node")
    plan.set_defaults(func=cmd_plan)


#: ``run``/``plan`` flags that say "not": flag's dest -> the :class:`ddpfab.api.Options` field it negates.
NEGATED = {"no_check": "check", "no_sync": "sync", "no_forward_env": "forward_env", "no_color": "color"}
_NEGATING = {field: dest for dest, field in NEGATED.items()}
#: Options the messages name by the short flag users type (Ansible's ``-e``, as every example here).
_SHORT = {"extra_vars": "-e"}


def flag(field: str, value: Any = NO_VALUE, negating: Mapping[str, str] = _NEGATING) -> str:
    """Option *field* as the command line spells it (the messages of the library, which name
    :class:`ddpfab.api.Options` fields and keyword arguments, under :func:`spelled_by`):
    ``--exit-guard``, ``--exit-guard off``, ``--no-sync`` for ``sync=False``, ``--wait`` for
    ``wait=True``. *negating*: field -> the dest of the ``--no-X`` flag that says it is False."""
    if field in negating and (value is NO_VALUE or value is False):
        return "--" + negating[field].replace("_", "-")
    name = _SHORT.get(field) or "--" + field.replace("_", "-")
    if field in negating:  # True: the default, which no flag says
        return f"without --{negating[field].replace('_', '-')}"
    if value is NO_VALUE or value is True:
        return name
    return f"{name} {shlex.quote(str(value))}"


def speller(args: argparse.Namespace) -> Callable[[str, Any], str]:
    """:func:`flag` for the command *args* ran. A command whose flags differ from run's says so in
    its parser's defaults: ``negated`` (dest -> field: sync's ``--no-wait`` is ``wait=False``,
    where run's ``--wait`` means another thing) and ``renamed`` (field -> its own flag's field:
    replay's ``--new-run-id`` is the run id that run calls ``--run-id``)."""
    own, renamed = getattr(args, "negated", None) or {}, getattr(args, "renamed", None) or {}
    if not (own or renamed):
        return flag
    negating = _NEGATING | {field: dest for dest, field in own.items()}

    def spell(field: str, value: Any = NO_VALUE) -> str:
        return flag(renamed.get(field, field), value, negating)
    return spell


def options(args: argparse.Namespace) -> Options:
    """The run's :class:`ddpfab.api.Options` from the parsed command line: every option under its
    own name (``--nproc-per-node`` is ``nproc_per_node``), the ``--no-X`` flags negated. The one
    mapping from command line to API."""
    given = {f.name: getattr(args, f.name) for f in fields(Options) if hasattr(args, f.name)}
    given.update({field: not getattr(args, dest) for dest, field in NEGATED.items() if hasattr(args, dest)})
    given["color"] = False if getattr(args, "no_color", False) else None
    return Options.of(**given)


def cmd_run(args: argparse.Namespace) -> int:
    # slow to import: see LAZY in ddpfab/cli/__init__.py
    from ddpfab.launch import recover, runner
    from ddpfab.remote.target import TargetError

    refusal = misplaced_dry_run(getattr(args, "argv", []))
    if refusal:
        return die([refusal, "nothing was started"])
    try:
        cluster = api_cluster(args)
        # --detach with restarts: the restarts outlive this command, so this command line runs again
        # as their supervisor, in a process of its own
        result = cluster.run(args.script, args.args, options(args), supervise=lambda run_id: recover.start_detached(
            args.argv[1:], run_id, args.runs_dir))
    except (inventory.InventoryError, planmod.PlanError, TargetError) as exc:
        return refuse(args, exc, "run")  # (its problems, as data with --json)
    except runner.RunError as exc:
        if args.json:
            print_problems(exc.problems, "run")
        return die(exc.problems + ["nothing was started"])
    if args.dry_run:
        return print_plan(result.plan, args.json, offline=args.offline, targets=cluster.targets())
    # the summary was printed once already, with the manifest's path
    hint = own_options_hint(result.outcomes)
    if hint:
        sys.stderr.write(f"ddpfab: hint: {hint}\n")
    return result.exit_code


class _OptionRecorder(argparse.ArgumentParser):
    """A parser that records the option strings added to it, and those that take a value."""

    def __init__(self) -> None:
        super().__init__(add_help=False)
        self.option_strings: set[str] = set()
        self.taking_value: set[str] = set()

    def add_argument(self, *args, **kwargs):
        action = super().add_argument(*args, **kwargs)
        self.option_strings.update(action.option_strings)
        if action.nargs not in (0, "?"):
            self.taking_value.update(action.option_strings)
        return action


@functools.cache
def _run_options() -> _OptionRecorder:
    """``ddpfab run``'s options, recorded once (the checks of its arguments each look at them)."""
    recorder = _OptionRecorder()
    _add_run_command_args(recorder)
    return recorder


#: ``--pdb``'s value: "all", or ranks and ranges (the plan checks them: ddpfab.planning.plan.pdb_ranks).
PDB_RANKS = re.compile(r"\s*(all|\d+(-\d+)?(\s*,\s*\d+(-\d+)?)*)\s*")


def _ranks_wait(spec: str) -> str:
    """``rank 3 waits`` or ``ranks 0,2 wait`` for a plan's RANKS (``all`` or ranks and commas)."""
    many = spec == "all" or "," in spec
    return f"ranks {spec} wait" if many else f"rank {spec} waits"


def _meant_as_ranks(argv: list[str], i: int) -> bool:
    """Whether ``argv[i]``, after a ``--pdb``, is its RANKS: ranks as written, or a mistyped try at
    them (ranks' characters only: ``-1``, ``,``; or a bare word, no path and no ``.py``, that is no
    file here, before one that is), so that the ranks' own check says what is wrong with it rather
    than taking it for the script. A script that is only on the nodes is a path or a ``.py``."""
    word = argv[i]
    if word == "--":  # the end of ddpfab's options, the script after it: no ranks written
        return False
    if PDB_RANKS.fullmatch(word) or re.fullmatch(r"[\d\s,-]+", word):
        return True
    return ("/" not in word and not word.endswith(".py") and i + 1 < len(argv) and not os.path.exists(word)
            and os.path.isfile(argv[i + 1]))


def spell_pdb(argv: list[str]) -> list[str]:
    """``run``/``plan`` arguments with a ``--pdb`` that has no RANKS written ``--pdb=all``, so that
    the script after it is not taken for its value. Only ddpfab's own options are looked at: the
    words from the script on are the script's, a ``--pdb`` among them included."""
    if not argv or argv[0] not in ("run", "plan"):
        return argv
    out = list(argv)
    _script_at(out, spell=True)
    return out


def _script_at(argv: list[str], spell: bool = False) -> int:
    """Where the script's words begin in ``run``/``plan`` arguments *argv* (its ``--`` included
    when one comes first; ``len(argv)`` when there is none). Only ddpfab's own options are
    skipped, each with its value. With *spell*, a ``--pdb`` or ``--debugpy`` without RANKS is
    rewritten in place as ``=all`` (:func:`spell_pdb`)."""
    taking_value = _run_options().taking_value
    i = 1
    while i < len(argv):
        word = argv[i]
        if word == "--" or not word.startswith("-") or word == "-":
            return i  # the script (or the -- before it)
        if word in ("--pdb", "--debugpy") and (i + 1 == len(argv) or not _meant_as_ranks(argv, i + 1)):
            if spell:
                argv[i] = f"{word}=all"
        elif word in taking_value or word in ("--pdb", "--debugpy"):
            i += 1  # its value
        i += 1
    return len(argv)


def misplaced_dry_run(argv: list[str]) -> str:
    """The refusal of a ``ddpfab run`` whose ``--dry-run`` comes after the script (so the script
    would get it and the job would start: the opposite of what it asks), unless a ``--`` before it
    says that it is the script's; else ""."""
    if not argv or argv[0] != "run":
        return ""
    at = _script_at(list(argv))
    if at >= len(argv) or argv[at] == "--":
        return ""
    after = argv[at + 1:]
    if "--dry-run" not in after[:after.index("--") if "--" in after else None]:
        return ""  # (a -- between them gives it to the script as well: torchrun drops that one)
    script = argv[at]
    return (f"--dry-run comes after the script, so {script} would get it and the job would start: put it "
            f"before the script (ddpfab run --dry-run ... {script} ...), or, for the script's own --dry-run, "
            f"write -- before the script (ddpfab run ... -- {script} ... --dry-run)")


def run_option_strings() -> set[str]:
    """Every option string of ``ddpfab run`` (``--nproc-per-node``, ``-q``, ...)."""
    return set(_run_options().option_strings)


def own_options_hint(outcomes: dict) -> str:
    """When the script's argument parser refused options that are ddpfab's own (given after the
    script, so the script got them): which, and where they belong; else ""."""
    refused: set[str] = set()
    for out in outcomes.values():
        cause = getattr(out, "cause", None)
        if cause is None or cause.kind is not CauseKind.USAGE or "unrecognized arguments:" not in (cause.exception or ""):
            continue
        refused.update(w.split("=", 1)[0] for w in cause.exception.split("unrecognized arguments:", 1)[1].split())
    ours = sorted(refused & run_option_strings())
    if not ours:
        return ""
    them = "it" if len(ours) == 1 else "them"
    return (f"{', '.join(ours)} {'is an option' if len(ours) == 1 else 'are options'} of ddpfab run, given after "
            f"the script, so the script got {them}: put {them} before the script "
            "(ddpfab run [OPTIONS] SCRIPT [SCRIPT ARGS])")


def cmd_plan(args: argparse.Namespace) -> int:
    """`ddpfab plan`: the plan `run` would make, printed, or emitted as one shell script per node."""
    # slow to import: see LAZY in ddpfab/cli/__init__.py
    from ddpfab.launch import runner, tmuxrun
    from ddpfab.planning import emit
    from ddpfab.remote.target import TargetError

    if args.tmux:
        if not args.emit:
            return die("plan --tmux: the windows run the emitted scripts; give --emit DIR")
        try:
            tmuxrun.refuse(True)
        except planmod.PlanError as exc:
            return die(str(exc))
    try:
        cluster = api_cluster(args)
        targets = cluster.targets()
        if not args.emit:
            return print_plan(cluster.plan(args.script, args.args, options(args)), args.json, offline=args.offline,
                              targets=targets)
        emitted = cluster.emit(args.script, args.args, options(args), directory=args.emit, force=args.force)
    except (inventory.InventoryError, planmod.PlanError, TargetError) as exc:
        return refuse(args, exc, "plan")
    except runner.RunError as exc:
        if args.json:
            print_problems(exc.problems, "plan")
        return die(exc.problems + ["nothing was planned"])
    except (emit.EmitError, OSError) as exc:
        return die(str(exc))
    plan, written = emitted.plan, emitted.files
    for path in written:
        sys.stderr.write(f"ddpfab: wrote {path}\n")
    if emitted.manifest:
        sys.stderr.write(f"ddpfab: run {plan.run_id} recorded ({emitted.manifest}): once its scripts run, ddpfab ps, "
                         f"stop, logs, attach and doctor {plan.run_id} see it\n")
    print((written[-1]).read_text(), end="")
    if args.tmux:
        try:
            session = tmuxrun.open_plan_session(plan, Path(args.emit).resolve(), targets)
        except tmuxrun.TmuxError as exc:  # (a session of that name already there: tmux's words say so)
            return die([*exc.problems, f"the scripts are written in {args.emit}; no tmux session was opened"],
                       EXIT_FAILED)
        sys.stderr.write(f"ddpfab: tmux session {session}: a window per node, its line typed, not run "
                         f"(tmux attach -t {session}; Enter in a window starts that node)\n")
        client = tmuxrun.attach(session)
        if client is not None:
            client.wait()
    return 0


def print_plan(plan, as_json: bool, offline: bool, targets: dict | None = None) -> int:
    # slow to import: see LAZY in ddpfab/cli/__init__.py
    from ddpfab.hosts import nodeenv
    from ddpfab.launch.runs import mask_plan
    from ddpfab.planning import render
    from ddpfab.planning.emit import ssh_target
    from ddpfab.remote.target import ssh_line

    if as_json:
        print(json.dumps(mask_plan(plan.to_dict()), indent=2, ensure_ascii=False))
        return 0
    masked = mask_plan(plan.to_dict())
    shown = render.masked(plan)  # what is printed is rendered from the masked plan
    print(f"# ddpfab plan {plan.run_id}: {plan.nnodes} nodes, world size {plan.world_size}, "
          f"master {plan.master} {plan.master_addr}:{plan.master_port}")
    if offline:
        print("# offline: the master port was not checked on the host")
    if plan.unresolved:
        print(f"# {plan.unresolved_note()}")
    if any(n.gpus for n in plan.nodes):  # what each node's supervisor leases before it starts (docs/shared-gpus.md)
        leased = ", ".join(f"{n.name} {n.gpus}" + (f" (pinned {','.join(n.gpu_pin)})" if n.gpu_pin else "")
                           for n in plan.nodes if n.gpus)
        print(f"# GPU leases: {leased}; {'waits for them (--wait)' if plan.wait else 'refused if taken'}")
    print("# Paste each command into an SSH session on its node (any order; they wait for each other).")
    if plan.pdb:  # the supervisor installs it: a pasted command runs without it
        print(f"# pdb: {_ranks_wait(plan.pdb)} in pdb at "
              "breakpoint() and uncaught exceptions (ddpfab's node supervisor installs it; a command pasted by "
              "hand runs without it)")
    if plan.debugpy:  # likewise
        print(f"# debugpy: {_ranks_wait(plan.debugpy)} "
              "for a DAP client (ddpfab's node supervisor installs it; a command pasted by hand runs without it)")
    if plan.exit_guard != "off":  # the supervisor installs it: a pasted command runs without it
        print(f"# exit guard: {plan.exit_guard} (ddpfab's node supervisor puts it on the ranks' PYTHONPATH; "
              "a command pasted by hand runs without it)")
    by_name = {n.name: n for n in plan.nodes}
    for node in masked["nodes"]:
        print(f"\n# python on {node['name']}: {nodeenv.describe(by_name[node['name']])}")
        print(f"# {node['name']} (node_rank {node['node_rank']}, {node['nproc']} procs): "
              f"{ssh_line(ssh_target(by_name[node['name']], targets))}")
        print(render.shell_line(shown, shown.node(node["name"])))
    return 0
