"""The lab itself: idempotent, isolated, coexisting, and gone without a trace after `down`."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from ddpfab import lab as labmod

from .conftest import session_subnet
from .helpers import ddpfab

#: the second lab's subnet
SECOND = session_subnet(8)


def _traces(lab_dir: Path) -> list[str]:
    """The network namespaces, links and FORWARD rules named for the lab in *lab_dir* (other labs,
    of parallel test workers say, come and go meanwhile and must not count)."""
    lid = labmod.lab_id(Path(lab_dir).resolve())
    found = []
    for argv in (["ip", "netns", "list"], ["ip", "-o", "link"], ["iptables", "-S", "FORWARD"]):
        out = subprocess.run(argv, capture_output=True, text=True).stdout
        found += [ln.split(" state ")[0] for ln in out.splitlines() if lid in ln]
    return sorted(found)


def test_second_lab_coexists_and_down_removes_only_its_own(lab, tmp_path):
    other = tmp_path / "other"
    assert _traces(other) == []
    first_lab = _traces(lab.dir)
    assert first_lab
    try:
        res = ddpfab("lab", "up", "--hosts", "2", "--dir", str(other), "--subnet", SECOND)
        assert res.returncode == 0, res.stderr
        assert f"node1={SECOND.rsplit('.', 1)[0]}.11" in res.stdout
        again = ddpfab("lab", "up", "--hosts", "2", "--dir", str(other), "--subnet", SECOND)
        assert again.returncode == 0 and "already up" in again.stdout and "warning" not in again.stderr
        other_size = ddpfab("lab", "up", "--hosts", "3", "--dir", str(other), "--subnet", SECOND)
        assert other_size.returncode == 0 and "has hosts 2, not 3: it is left as it is" in other_size.stderr
        second = labmod.Lab.load(other)
        assert second.bridge != lab.bridge
        # both labs answer; each host has its own hostname, PID namespace and address
        out = subprocess.run(["ssh", "-F", str(second.ssh_config), "node2", "hostname; echo $$"],
                             capture_output=True, text=True, timeout=10)
        assert out.returncode == 0 and out.stdout.split()[0] == "node2", out.stderr
        assert all(lab.alive().values())
        assert second.host("node1").pid_namespace() != lab.host("node1").pid_namespace()
        # a write to an overlaid system dir stays on that host
        subprocess.run(["ssh", "-F", str(second.ssh_config), "node1", "echo hi > /opt/ddpfab-lab-probe"], check=True)
        assert not Path("/opt/ddpfab-lab-probe").exists()
        assert _traces(other)
        res = ddpfab("lab", "down", "--dir", str(other))
        assert res.returncode == 0
        assert _traces(other) == []
        assert _traces(lab.dir) == first_lab
        assert not Path(second.store).exists()
        assert not other.exists(), "up made the dir: down removes it"
        # a dir that was there before up stays, with what the user keeps in it
        other.mkdir()
        (other / "notes.txt").write_text("mine")
        assert ddpfab("lab", "up", "--hosts", "1", "--dir", str(other), "--subnet", SECOND).returncode == 0
        assert ddpfab("lab", "down", "--dir", str(other)).returncode == 0
        assert sorted(p.name for p in other.iterdir()) == ["notes.txt"] and _traces(other) == []
    finally:  # whatever failed above, the second lab goes: a failed test must leave no lab behind
        labmod.down(other)
    assert all(lab.alive().values()), "taking down one lab must not touch the other"


def test_lab_hosts_have_their_own_firewall_tables(lab):
    rules = lab.netns_exec("node3", ["iptables", "-S", "INPUT"], capture_output=True, text=True)
    assert rules.returncode == 0 and "-P INPUT ACCEPT" in rules.stdout
    lab.netns_exec("node3", ["iptables", "-A", "INPUT", "-p", "tcp", "--dport", "9", "-j", "DROP"], check=True)
    try:
        assert "--dport 9" not in subprocess.run(["iptables", "-S", "INPUT"], capture_output=True, text=True).stdout
        assert "--dport 9" not in lab.netns_exec("node2", ["iptables", "-S", "INPUT"], capture_output=True,
                                                 text=True).stdout
    finally:
        lab.netns_exec("node3", ["iptables", "-D", "INPUT", "-p", "tcp", "--dport", "9", "-j", "DROP"], check=True)


def test_not_root_is_a_one_line_error():
    # a world-readable copy of the package and the system python: the checkout and its venv may
    # sit in a directory that user `nobody` cannot enter
    import shutil
    import tempfile

    pkg_root = Path(tempfile.mkdtemp(prefix="ddpfab-nobody-"))
    try:
        shutil.copytree(Path(labmod.__file__).parents[1], pkg_root / "ddpfab")  # the whole package (lab is a subpackage)
        subprocess.run(["chmod", "-R", "a+rX", str(pkg_root)], check=True)
        env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(pkg_root)}
        res = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3",
                              "-m", "ddpfab", "lab", "up", "--dir", str(pkg_root / "lab")],
                             capture_output=True, text=True, env=env, cwd="/")
    finally:
        shutil.rmtree(pkg_root)
    assert res.returncode != 0
    assert res.stderr.strip().count("\n") == 0, res.stderr
    assert "needs root" in res.stderr
