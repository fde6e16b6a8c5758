"""Jobs started by hand from ``plan --emit``'s scripts, seen by ddpfab as any job.

Each script starts the node's supervisor as ``ddpfab run --detach`` does (the same command, the
same input: the node program and the job as data, env values included, on its stdin, never in a
command line), with its output on the terminal that started it, and its input from there when it
is a terminal (a ``breakpoint()`` is driven there): Ctrl-C there, or that terminal going away,
ends the node's job tree. The run is recorded when the scripts are written, so
``ddpfab ps``, ``stop``, ``logs``, ``attach`` and ``doctor`` work on it from the controller.
"""

from __future__ import annotations

import base64
import shlex

from ddpfab.launch.execute import agent_spec
from ddpfab.planning import render
from ddpfab.planning.plan import NodePlan, Plan
from ddpfab.remote import nodeprogram as nodeprog

#: The heredoc's end in a script (base64 never has a "-")
END = "DDPFAB-INPUT"
#: Where the script keeps its own stdin for the supervisor, whose stdin is its input: the job's
#: input when it is a terminal (``ssh -t NODE sh SCRIPT``, a ``plan --tmux`` window)
TERMINAL_FD = 3


def supervised(plan: Plan, node: NodePlan) -> tuple[str, bytes]:
    """(the shell line that starts *node*'s supervisor, its stdin): ``run --detach``'s, with the
    job's output on this terminal too."""
    spec = {**agent_spec(plan, node, detach=True), "console": True, "terminal": TERMINAL_FD}
    return (nodeprog.command(node, *nodeprog.supervisor_words(plan.run_id)),
            nodeprog.setup_head(node) + nodeprog.supervisor_input(spec))


def script_body(plan: Plan, node: NodePlan) -> str:
    """The lines of *node*'s script after its header: what the supervisor will start (as comments,
    secret values masked), the run id's check, then the supervisor with its input."""
    command, stdin = supervised(plan, node)
    shown = render.masked(plan)
    launch = render.script_lines(shown, shown.node(node.name), prefix=False)
    d = shlex.quote(node.remote_dir)
    return ("# The job ddpfab's node supervisor starts here (secret values masked; they are in its input):\n"
            + "".join(f"#   {line}\n" for line in launch)
            + f"if [ -e {d}/agent.json ]; then\n"
            f"  echo 'ddpfab: run {plan.run_id} was started on this node already; make a new plan "
            "(ddpfab plan --emit DIR)' >&2\n  exit 1\nfi\n"
            f"mkdir -p -m 700 {d}\n"
            f"if [ -t 0 ]; then exec {TERMINAL_FD}<&0; else exec {TERMINAL_FD}</dev/null; fi\n"
            f"base64 -d <<'{END}' | sh -c {shlex.quote(command)}\n"
            f"{base64.encodebytes(stdin).decode()}{END}\n")
