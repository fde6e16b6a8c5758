"""Quoting for the remote shell, checked against a real /bin/sh (what sshd runs the command with)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from ddpfab.plan import shell_command

NASTY = ["with space", "it's", '"dq"', "$HOME", "${PATH}", "a;b", "x && y", "`id`", "$(id)", "*", "?",
         "~", "héllo ✓ 日本", "", "new\nline", "tab\there", "back\\slash", "-n", "--", "!", "#comment"]

ECHO_ARGV = "import json, os, sys; print(json.dumps({'argv': sys.argv[1:], 'cwd': os.getcwd(), 'env': dict(os.environ)}))"


def run_sh(command: str) -> dict:
    out = subprocess.run(["/bin/sh", "-c", command], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_nasty_args_env_and_workdir_survive_the_shell(tmp_path):
    workdir = tmp_path / "dir with space ' and $dollar"
    workdir.mkdir()
    env = {"K1": "v a l", "K2": "$HOME;`id`", "K3": "", "K4": "ü"}
    cmd = shell_command(str(workdir), env, (sys.executable, "-c", ECHO_ARGV, *NASTY))
    got = run_sh(cmd)
    assert got["argv"] == NASTY
    assert got["cwd"] == str(workdir)
    assert {k: got["env"][k] for k in env} == env


text = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=30)


@settings(max_examples=60, deadline=None)
@given(args=st.lists(text, max_size=6), value=text)
def test_any_args_and_env_values_arrive_unchanged(args, value):
    cmd = shell_command(os.getcwd(), {"DDPFAB_TEST_VALUE": value}, (sys.executable, "-c", ECHO_ARGV, *args))
    got = run_sh(cmd)
    assert got["argv"] == args
    assert got["env"]["DDPFAB_TEST_VALUE"] == value
