"""One transport: only ddpfab/remote/ builds ssh, scp, rsync or ssh-agent command lines.

Everything else reaches nodes through the node's runner (ddpfab/remote/noderunner.py) or renders
OpenSSH options through ddpfab/remote/target.py, so an SSH change is made once."""

from __future__ import annotations

import ast
from pathlib import Path

import ddpfab

ROOT = Path(ddpfab.__file__).parent
PROGRAMS = {"ssh", "scp", "rsync", "ssh-agent", "ssh-add"}


def argv_programs(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, program) of every list or tuple display whose first item is one of PROGRAMS (a
    literal, or the same name in an f-string), and of every shell string that starts with one."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.List, ast.Tuple)) and node.elts:
            first = node.elts[0]
            if isinstance(first, ast.Constant) and first.value in PROGRAMS:
                found.append((node.lineno, first.value))
            elif isinstance(first, ast.JoinedStr) and len(first.values) == 1 and \
                    isinstance(first.values[0], ast.Constant) and first.values[0].value in PROGRAMS:
                found.append((node.lineno, first.values[0].value))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            word = node.value.split(" ", 1)[0]
            if word in PROGRAMS and " -" in node.value:  # "ssh -o ...": a command line in one string
                found.append((node.lineno, word))
    return found


def test_the_scan_finds_each_way_of_writing_a_command_line():
    code = ('a = ["ssh", "-o", "X=1", "h"]\nb = ("rsync", "-a")\nc = [f"scp", x]\n'
            'd = "ssh -F /dev/null h"\ne = ["ssh-add", "-q"]\nf = ["echo", "ssh"]\ng = "ssh is fine in prose"\n')
    assert argv_programs(ast.parse(code)) == [(1, "ssh"), (2, "rsync"), (3, "scp"), (4, "ssh"), (5, "ssh-add")]


def test_only_the_remote_package_builds_ssh_rsync_or_agent_command_lines():
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] == "remote":
            continue
        for line, program in argv_programs(ast.parse(path.read_text(), str(path))):
            offenders.append(f"ddpfab/{rel}:{line}: {program}")
    assert offenders == [], "build these in ddpfab/remote/ (noderunner.py, target.py):\n" + "\n".join(offenders)


def test_the_runner_module_is_where_they_are_built():
    # the scan must see the real ones, or its silence above proves nothing
    found = {p for _, p in argv_programs(ast.parse((ROOT / "remote" / "noderunner.py").read_text()))}
    assert {"rsync", "ssh", "ssh-agent", "ssh-add"} <= found
