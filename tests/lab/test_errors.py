"""Bad input and unready hosts: one clear line naming the host or file, and nothing started anywhere."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from ddpfab import lab as labmod

from .helpers import ddpfab

REPORT = "tests/lab/scripts/report.py"
pytestmark = pytest.mark.usefixtures("no_leftovers")


def _nothing_started(lab, runs_dir):
    assert all(lab.processes(n) == [] for n in ("node1", "node2", "node3"))
    assert not runs_dir.exists() or not any(runs_dir.iterdir()), "no run record for a run that never started"


def _error_lines(res):
    return [ln for ln in res.stderr.splitlines() if ln.startswith("ddpfab: error:")]


def test_unknown_host_key_is_refused_naming_the_host(lab, inventory2, tmp_path):
    known = tmp_path / "known_hosts"
    known.write_text("".join(ln + "\n" for ln in lab.known_hosts.read_text().splitlines() if "node2" not in ln))
    runs = tmp_path / "runs"
    res = ddpfab("run", "-i", str(inventory2), "--known-hosts", str(known), "--runs-dir", str(runs), REPORT)
    assert res.returncode == 2
    errors = _error_lines(res)
    assert any("node2" in ln and "host key not in" in ln for ln in errors), res.stderr
    assert not any("node1" in ln for ln in errors[:-1])
    _nothing_started(lab, runs)
    # opting in accepts and records the new key, then the run goes ahead
    res = ddpfab("run", "-i", str(inventory2), "--known-hosts", str(known), "--accept-new-host-keys",
                 "--runs-dir", str(runs), "--dry-run", REPORT)
    assert res.returncode == 0, res.stderr
    assert lab.host("node2").address in known.read_text()


def test_changed_host_key_is_refused_even_with_accept_new(lab, inventory2, tmp_path):
    other = tmp_path / "otherkey"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    fake = (tmp_path / "otherkey.pub").read_text().split()[:2]
    lines = []
    for ln in lab.known_hosts.read_text().splitlines():
        if ln.startswith(lab.host("node1").address + ","):
            ln = f"{ln.split()[0]} {fake[0]} {fake[1]}"
        lines.append(ln)
    known = tmp_path / "known_hosts"
    known.write_text("\n".join(lines) + "\n")
    runs = tmp_path / "runs"
    res = ddpfab("run", "-i", str(inventory2), "--known-hosts", str(known), "--accept-new-host-keys",
                 "--runs-dir", str(runs), REPORT)
    assert res.returncode == 2
    assert any("node1" in ln and "CHANGED" in ln for ln in _error_lines(res)), res.stderr
    _nothing_started(lab, runs)


def test_unreachable_host_is_named(lab, tmp_path):
    inv = tmp_path / "inv.yml"
    text = labmod.render_inventory(lab, sys.executable, names=["node1", "node2"])
    # an address inside the lab subnet where no host lives: traffic stays in the lab
    ghost = lab.subnet.rsplit(".", 1)[0] + ".99"
    text = text.replace("  vars:", f"    ghost:\n      ansible_host: {ghost}\n  vars:", 1)
    text = text.replace("ConnectTimeout=5", "ConnectTimeout=3")
    inv.write_text(text)
    runs = tmp_path / "runs"
    start = time.monotonic()
    res = ddpfab("run", "-i", str(inv), "--runs-dir", str(runs), REPORT)
    assert res.returncode == 2
    errors = _error_lines(res)
    assert any("ghost" in ln and ghost in ln and "unreachable" in ln for ln in errors), res.stderr
    assert time.monotonic() - start < 20
    _nothing_started(lab, runs)


def test_a_missing_key_file_is_named_as_such_not_as_an_unreachable_host(lab, inventory2, tmp_path):
    """``ansible_ssh_private_key_file`` naming no file was "unreachable: [Errno 2] No such file or
    directory: ...; check ansible_host/ansible_port and that sshd runs there", after three tries."""
    missing = tmp_path / "no-such-key"
    for argv in (["check", "-l", "node1"], ["exec", "-l", "node1", "--", "true"]):
        started = time.monotonic()
        res = ddpfab(*argv[:1], "-i", str(inventory2), "-e", f"ansible_ssh_private_key_file={missing}", *argv[1:])
        assert res.returncode != 0 and f"cannot read {missing} here" in res.stdout + res.stderr, res.stdout + res.stderr
        assert "ansible_ssh_private_key_file" in res.stdout + res.stderr and "sshd runs there" not in res.stdout + res.stderr
        assert time.monotonic() - started < 10 and "Traceback" not in res.stderr


def test_a_mistyped_host_name_is_matched_against_the_ssh_config(lab, tmp_path):
    """An inventory of host names as the lab's ssh_config spells them (README, on your machines),
    one of them mistyped (nod2): the dry run and the run both end before starting, naming the
    host, that its name does not resolve, the ssh_config's name it missed and where to fix it."""
    inv = tmp_path / "inv.yml"
    inv.write_text(f"all:\n  hosts:\n    node1:\n    nod2:\n  vars:\n    ddpfab_python: {sys.executable}\n")
    config = str(lab.dir / "ssh_config")
    runs = tmp_path / "runs"
    for dry in (["--dry-run"], []):
        res = ddpfab("run", "-i", str(inv), "--ssh-config", config, "--runs-dir", str(runs), *dry, REPORT)
        assert res.returncode == 2, res.stdout + res.stderr
        assert any(ln.startswith("ddpfab: error: host nod2 (nod2:22): the name nod2 does not resolve (")
                   and "(did you mean 'node2'" in ln and ln.endswith(f"a Host entry with a HostName in {config}")
                   for ln in _error_lines(res)), res.stderr
        assert "Traceback" not in res.stderr
    _nothing_started(lab, runs)


def test_explicit_master_port_in_use_on_master(lab, inventory2, tmp_path):
    port = 29555
    listener = subprocess.Popen(
        ["ip", "netns", "exec", lab.host("node1").netns, sys.executable, "-c",
         f"import socket,time;s=socket.socket();s.bind(('0.0.0.0',{port}));s.listen();print('up',flush=True);"
         "time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    try:
        assert listener.stdout.readline().strip() == "up"
        runs = tmp_path / "runs"
        res = ddpfab("run", "-i", str(inventory2), "--master-port", str(port), "--runs-dir", str(runs), REPORT)
        assert res.returncode == 2
        assert any("node1" in ln and str(port) in ln and "in use" in ln for ln in _error_lines(res)), res.stderr
        # processes of the host's own (the listener lives in its netns, not its PID namespace)
        _nothing_started(lab, runs)
        # without --master-port ddpfab picks a free one, and never the busy one
        res = ddpfab("run", "-i", str(inventory2), "--dry-run", "--json", REPORT)
        assert res.returncode == 0
        assert f'"master_port": {port}' not in res.stdout
    finally:
        listener.kill()


@pytest.mark.parametrize("content, expect", [
    ("", "no hosts"),
    ("all:\n  hosts:\n    node1:\n      ansible_host: [unclosed\n", "cannot be parsed"),
    ("[group\nnode1\n", "cannot be parsed"),
    ("all:\n  hosts:\n    node1:\n      ddpfab_nproc_per_node: many\n", "must be an integer"),
    ("all:\n  hosts:\n    node1:\n      ansible_port: 70000\n", "1-65535"),
    ("all:\n  hosts:\n    node1:\n      ansible_host: 'x; rm -rf /'\n", "neither an IP address nor a host name"),
])
def test_bad_inventory_is_one_clear_line(content, expect, tmp_path):
    inv = tmp_path / "inv.yml"
    if content.startswith("["):
        inv = tmp_path / "inv.ini"
    inv.write_text(content)
    res = ddpfab("run", "-i", str(inv), "--runs-dir", str(tmp_path / "runs"), REPORT)
    assert res.returncode == 2
    errors = _error_lines(res)
    assert len(errors) == 1, res.stderr
    assert expect in errors[0] and (str(inv) in errors[0] or "host node1" in errors[0]), res.stderr
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "runs").exists()


def test_missing_inventory_file(tmp_path):
    res = ddpfab("run", "-i", str(tmp_path / "nope.yml"), REPORT)
    assert res.returncode == 2
    assert _error_lines(res) == [f"ddpfab: error: inventory {tmp_path / 'nope.yml'}: no such file or directory"]


def test_python_without_torch_is_refused(lab, tmp_path):
    inv = tmp_path / "inv.yml"
    inv.write_text(labmod.render_inventory(lab, "/usr/bin/python3", names=["node1", "node2"]))
    res = ddpfab("run", "-i", str(inv), "--runs-dir", str(tmp_path / "runs"), REPORT)
    assert res.returncode == 2
    errors = _error_lines(res)
    assert any("node1" in ln and "cannot import torch" in ln for ln in errors), res.stderr
    assert any("node2" in ln and "cannot import torch" in ln for ln in errors), res.stderr


def test_perf_check_with_zero_processes_is_one_clear_line(lab, inventory2, tmp_path):
    # refused as torchrun's vocabulary is read (argparse's type, every command alike), before any node
    # is reached: one error line, exit 2, nothing left (it was a PlanError traceback)
    runs = tmp_path / "runs"
    res = ddpfab("check", "-i", str(inventory2), "--perf", "--nproc-per-node", "0", "--runs-dir", str(runs))
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    errors = [ln for ln in res.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1 and "--nproc-per-node" in errors[0] and "must be >= 1, got 0" in errors[0], res.stderr
    _nothing_started(lab, runs)


def test_port_probe_leaves_the_port_free(lab, inventory2):
    """The probe binds and releases: the port it reports is connectable-free right after."""
    res = ddpfab("run", "-i", str(inventory2), "--dry-run", "--json", REPORT)
    assert res.returncode == 0
    port = int(res.stdout.split('"master_port": ')[1].split(",")[0])
    with socket.socket() as s:
        s.settimeout(1)
        assert s.connect_ex((lab.host("node1").address, port)) != 0  # nobody listens there
