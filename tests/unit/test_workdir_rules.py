"""The workdir rules every command shares (ddpfab/node/workdir.py), with hypothesis for the text rules."""

from __future__ import annotations

import os
import pwd
import string

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ddpfab.node import workdir
from ddpfab.node.workdir import lexical_problem, node_problem, resolve
from ddpfab.planning import plan

SEGMENT = st.text(alphabet=string.ascii_letters + string.digits + "_-. ", min_size=1, max_size=8).filter(
    lambda s: s not in (".", ".."))


@given(st.lists(SEGMENT, min_size=1, max_size=5), st.sampled_from([chr(c) for c in range(32)] + ["\x7f"]),
       st.booleans())
def test_any_control_character_is_refused_trailing_newline_included(parts, ctrl, at_end):
    path = "/" + "/".join(parts)
    bad = path + ctrl if at_end else "/" + ctrl + path[1:]
    why = lexical_problem(bad)
    assert why and "control character" in why
    with pytest.raises(workdir.WorkdirError):
        resolve(bad, "/home/u")


def test_a_yaml_block_newline_is_named():
    assert "trailing newline" in lexical_problem("/opt/ddpfab/proj\n")


@given(st.lists(SEGMENT, min_size=0, max_size=3), st.lists(SEGMENT, min_size=0, max_size=3))
def test_dotdot_anywhere_is_refused(before, after):
    path = "/" + "/".join([*before, "..", *after])
    assert "'..'" in lexical_problem(path)


@pytest.mark.parametrize("raw", ["~root", "~root/x", "~nobody/proj", "relative/dir", "", "./x"])
def test_other_users_homes_and_relative_paths_are_refused(raw):
    assert lexical_problem(raw)


@given(st.lists(SEGMENT, min_size=1, max_size=5))
def test_resolve_is_absolute_normalised_and_agrees_with_the_plan(parts):
    rel = "/".join(parts)
    got = resolve("~/" + rel, "/home/u")
    assert got.startswith("/home/u/") and "//" not in got and got == os.path.normpath(got)
    assert resolve("/srv//" + rel + "/", None) == os.path.normpath("/srv/" + rel)
    # the plan's workdir is the same function's answer
    assert plan.remote_workdir("~/" + rel, "/home/u") == got


def test_home_relative_stays_relative_when_the_home_is_unknown():
    assert resolve("~/proj", None) == "proj" and resolve("~", None) == "."


@pytest.mark.parametrize("path", ["/", "/etc", "/usr/local/src/p", "/var/lib", "/tmp", "/opt", "/proc/1", "/home"])
def test_system_dirs_are_refused(path):
    assert "system directory" in node_problem(path)


def test_any_users_home_itself_is_refused_but_not_a_dir_inside(tmp_path):
    root_home = pwd.getpwuid(0).pw_dir
    assert node_problem(root_home)
    assert "home directory" in node_problem(str(tmp_path), home=str(tmp_path))
    assert node_problem(str(tmp_path / "proj"), home=str(tmp_path)) is None


def test_symlinks_are_resolved_before_judging(tmp_path):
    (tmp_path / "to_etc").symlink_to("/etc")
    assert "/etc" in node_problem(str(tmp_path / "to_etc"))
    (tmp_path / "to_root").symlink_to("/")
    assert "system directory" in node_problem(str(tmp_path / "to_root" / "."))


def test_mount_points_are_refused():
    mounts = [line.split()[4] for line in open("/proc/self/mountinfo")]
    candidates = [m for m in mounts if m not in workdir.SYSTEM_DIRS and not m.startswith(workdir.SYSTEM_TREES)
                  and os.path.isdir(m) and "\\" not in m]
    assert candidates, "no mount point outside the system dirs on this machine"
    assert "mount point" in node_problem(candidates[0])


def test_torchrun_logs_stay_out_of_the_workdir_in_offline_plans_and_emitted_scripts(tmp_path):
    """An offline plan does not know the nodes' homes: the run dir stays home-relative, and the
    shell line anchors torchrun's --log-dir at $HOME, since after `cd WORKDIR` a relative path
    would put the per-rank logs into the project."""
    import subprocess

    from ddpfab.hosts.inventory import Inventory, Node
    from ddpfab.planning import emit, render
    from ddpfab.planning.plan import Facts, RunOptions, make_plan

    c = Inventory("inv", "all", (Node(name="n1", host="10.0.0.1", workdir="/opt/proj"),))
    p = make_plan(c, RunOptions("train.py", run_id="r1"), Facts(addresses={"n1": "10.0.0.1"}, master_port=29500,
                                                                 cwd="/here"))
    node = p.nodes[0]
    line = render.shell_line(p, node)
    assert '--log-dir="$HOME"/.ddpfab/runs/r1/torchrun' in line
    script = emit.write(p, tmp_path / "emit")[0].read_text()
    assert '--log-dir="$HOME"/.ddpfab/runs/r1/torchrun' in script
    # what a shell makes of it: an absolute path under the home, not under the workdir
    words = line.split(" && ", 1)[1]
    got = subprocess.run(["bash", "-c", f"set -- {words}; for a; do case $a in --log-dir=*) echo $a;; esac; done"],
                         capture_output=True, text=True, env={"HOME": "/home/u"}).stdout.strip()
    assert got == "--log-dir=/home/u/.ddpfab/runs/r1/torchrun"
    online = make_plan(c, RunOptions("train.py", run_id="r1"), Facts(addresses={"n1": "10.0.0.1"}, master_port=29500,
                                                                      cwd="/here", homes={"n1": "/home/u"}))
    assert "--log-dir=/home/u/.ddpfab/runs/r1/torchrun" in render.shell_line(online, online.nodes[0])


def test_which_finds_what_shutil_which_finds_on_the_path(tmp_path, monkeypatch):
    """The node program's PATH lookup (without shutil): the first executable file on PATH, not a
    directory or a file without the execute bit; None where there is none."""
    import shutil

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "tool").write_text("#!/bin/sh\n")  # not executable: skipped
    (tmp_path / "a" / "dir-tool").mkdir()  # a directory: skipped
    (tmp_path / "b" / "tool").write_text("#!/bin/sh\n")
    (tmp_path / "b" / "tool").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'a'}:{tmp_path / 'b'}:/usr/bin:/bin")
    for name in ("tool", "dir-tool", "sh", "no-such-tool-here"):
        assert workdir.which(name) == shutil.which(name), name
    assert workdir.which("tool") == str(tmp_path / "b" / "tool") and workdir.which("dir-tool") is None
    monkeypatch.setenv("PATH", "")  # an empty PATH names no directory, not this one
    monkeypatch.chdir(tmp_path / "b")
    assert workdir.which("tool") is None and shutil.which("tool") is None
