"""Quoting for the remote shell, checked against a real /bin/sh (what sshd runs the command with):
the plan's shell line (:func:`ddpfab.planning.render.shell_line`), run by sh, starts exactly the argv the
supervisor would exec (:func:`ddpfab.planning.render.argv`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ddpfab.hosts.inventory import Inventory, Node
from ddpfab.planning import render
from ddpfab.planning.plan import Facts, RunOptions, make_plan, placeholders_in

NASTY = ["with space", "it's", '"dq"', "$HOME", "${PATH}", "a;b", "x && y", "`id`", "$(id)", "*", "?",
         "~", "héllo ✓ 日本", "", "new\nline", "tab\there", "back\\slash", "-n", "--", "!", "#comment"]

ECHO_ARGV = "import json, os, sys; print(json.dumps({'argv': sys.argv[1:], 'cwd': os.getcwd(), 'env': dict(os.environ)}))"


def run_sh(command: str) -> dict:
    out = subprocess.run(["/bin/sh", "-c", command], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def echo_python(tmp_path) -> str:
    """A stand-in for the node's python: prints the argv it got (the launcher's words and the
    script's arguments), its cwd and env."""
    path = tmp_path / "python"
    if not path.exists():
        path.write_text(f"#!/bin/sh\nexec {sys.executable} -c \"{ECHO_ARGV}\" \"$@\"\n")
        path.chmod(0o755)
    return str(path)


def one_node_plan(python: str, workdir: str, args, env: dict[str, str]):
    c = Inventory("inv.yml", "all", (Node("n1", "10.0.0.1", python=python, workdir=workdir),))
    return make_plan(c, RunOptions("t.py", args=tuple(args), env=tuple(env.items()), run_id="r1"),
                     Facts(addresses={"n1": "10.0.0.1"}, master_port=29500, cwd=workdir, homes={"n1": "/home/u"}))


def test_nasty_args_env_and_workdir_survive_the_shell(tmp_path):
    workdir = tmp_path / "dir with space ' and $dollar"
    workdir.mkdir()
    env = {"K1": "v a l", "K2": "$HOME;`id`", "K3": "", "K4": "ü"}
    plan = one_node_plan(echo_python(tmp_path), str(workdir), NASTY, env)
    got = run_sh(render.shell_line(plan, plan.nodes[0]))
    assert got["argv"][-len(NASTY):] == NASTY
    assert got["argv"] == list(render.argv(plan, plan.nodes[0])[1:])
    assert got["cwd"] == str(workdir)
    assert {k: got["env"][k] for k in env} == env


text = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=30)


@settings(max_examples=60, deadline=None)
@given(args=st.lists(text, max_size=6), value=text)
def test_any_args_and_env_values_arrive_unchanged(tmp_path_factory, args, value):
    assume(not placeholders_in(args))  # {{name}} is filled in per node (tests/unit/test_peer_tools.py)
    plan = one_node_plan(echo_python(tmp_path_factory.getbasetemp()), os.getcwd(), args, {"DDPFAB_TEST_VALUE": value})
    got = run_sh(render.shell_line(plan, plan.nodes[0]))
    assert got["argv"] == list(render.argv(plan, plan.nodes[0])[1:])
    assert got["argv"][len(got["argv"]) - len(args):] == args
    assert got["env"]["DDPFAB_TEST_VALUE"] == value
