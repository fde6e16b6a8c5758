"""`ddpfab check` on lab hosts: healthy, then one injected fault at a time (real firewalls, real
port clashes, a real /etc/hosts on one host). Each fault must fail its own check, on the right host,
and nothing else."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest

from ddpfab import lab as labmod

from .helpers import ddpfab

REPORT = "tests/lab/scripts/report.py"
PORT = 29577
pytestmark = pytest.mark.usefixtures("no_leftovers")


def check(inventory, *extra) -> tuple[int, dict, float]:
    start = time.monotonic()
    res = ddpfab("check", "-i", str(inventory), "--json", *extra)
    took = time.monotonic() - start
    assert res.returncode in (0, 1), res.stderr
    return res.returncode, json.loads(res.stdout), took


def fails(report) -> set[tuple[str, str]]:
    return {(r["node"], r["check"]) for r in report["results"] if r["status"] == "fail"}


@pytest.fixture
def inventory3(lab, tmp_path):
    path = tmp_path / "inventory.yml"
    path.write_text(labmod.render_inventory(lab, sys.executable))
    return path


@contextmanager
def firewall_only_master_port(lab, host: str, port: int):
    """INPUT DROP except lo, established, ssh and the master port: the setup that makes gloo hang."""
    rules = [["-A", "INPUT", "-i", "lo", "-j", "ACCEPT"],
             ["-A", "INPUT", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"],
             ["-A", "INPUT", "-p", "tcp", "--dport", "22", "-j", "ACCEPT"],
             ["-A", "INPUT", "-p", "tcp", "--dport", str(port), "-j", "ACCEPT"],
             ["-P", "INPUT", "DROP"]]
    for r in rules:
        lab.netns_exec(host, ["iptables", *r], check=True)
    try:
        yield
    finally:
        lab.netns_exec(host, ["iptables", "-P", "INPUT", "ACCEPT"], check=True)
        lab.netns_exec(host, ["iptables", "-F", "INPUT"], check=True)


def test_healthy_lab_passes_every_check_in_seconds(inventory3):
    code, report, took = check(inventory3)
    assert code == 0, report
    assert fails(report) == set()
    checks = {r["check"] for r in report["results"]}
    assert {"ssh", "torch", "python", "launcher", "hostname", "mesh", "master-port", "clock", "iface"} <= checks
    print(f"healthy 3-node check: {report['seconds']:.2f} s (CLI wall {took:.2f} s)")
    assert took < 30


def test_master_port_only_firewall_is_caught_and_run_refuses(lab, inventory3, tmp_path):
    with firewall_only_master_port(lab, "node1", PORT):
        code, report, _ = check(inventory3, "--fast", "--master-port", str(PORT))
        assert code == 1
        assert fails(report) == {("node1", "mesh")}
        # and `run` says why instead of hanging in gloo's connectFullMesh for ~5x the timeout
        start = time.monotonic()
        res = ddpfab("run", "-i", str(inventory3), "--master-port", str(PORT), "--runs-dir", str(tmp_path / "r"),
                     REPORT)
        assert res.returncode == 2
        assert "host node1: mesh" in res.stderr and "nothing was started" in res.stderr
        assert time.monotonic() - start < 20
        assert not (tmp_path / "r").exists()


def test_master_port_in_use(lab, inventory3):
    listener = subprocess.Popen(
        ["ip", "netns", "exec", lab.host("node1").netns, sys.executable, "-c",
         f"import socket,time;s=socket.socket();s.bind(('0.0.0.0',{PORT}));s.listen();print('up',flush=True);"
         "time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    try:
        assert listener.stdout.readline().strip() == "up"
        code, report, _ = check(inventory3, "--fast", "--master-port", str(PORT))
    finally:
        listener.kill()
        listener.wait()
    assert code == 1
    assert fails(report) == {("node1", "master-port")}


def test_node_without_torch(lab, inventory3, tmp_path):
    # the same python version, without torch: a fresh venv (the lab hosts see /tmp's files)
    bare = tmp_path / "bare-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    hv = tmp_path / "host_vars"
    hv.mkdir()
    (hv / "node3.yml").write_text(f"ddpfab_python: {bare}/bin/python\n")
    code, report, _ = check(inventory3, "--fast")
    assert code == 1
    assert fails(report) == {("node3", "torch")}


def test_changed_host_key(lab, inventory3, tmp_path):
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "k")], check=True)
    fake = (tmp_path / "k.pub").read_text().split()[:2]
    known = tmp_path / "known_hosts"
    known.write_text("".join(
        (f"{ln.split()[0]} {fake[0]} {fake[1]}" if ln.startswith(lab.host("node2").address + ",") else ln) + "\n"
        for ln in lab.known_hosts.read_text().splitlines()))
    code, report, _ = check(inventory3, "--fast", "--known-hosts", str(known))
    assert code == 1
    assert fails(report) == {("node2", "ssh")}
    msg = next(r["found"] for r in report["results"] if r["node"] == "node2" and r["check"] == "ssh")
    assert "CHANGED" in msg
    assert [(p["node"], p["check"], p["found"]) for p in report["problems"]] == [("node2", "ssh", msg)]
    assert "node2" not in msg  # the node is named by the report, once
    # an unknown key is a different failure
    known.write_text("".join(ln + "\n" for ln in lab.known_hosts.read_text().splitlines()
                             if not ln.startswith(lab.host("node2").address + ",")))
    code, report, _ = check(inventory3, "--fast", "--known-hosts", str(known))
    msg = next(r["found"] for r in report["results"] if r["node"] == "node2" and r["check"] == "ssh")
    assert "not in" in msg and "CHANGED" not in msg


def test_hostname_resolving_to_loopback(lab, inventory3):
    """node3's own /etc/hosts maps its name to 127.0.1.1 (the Debian installer default)."""
    fake_hosts = "127.0.1.1 node3\n" + (lab.dir / "hosts").read_text()
    subprocess.run(["ssh", "-F", str(lab.ssh_config), "node3",
                    "cat > /etc/hosts.ddpfab-fault && mount --bind /etc/hosts.ddpfab-fault /etc/hosts"],
                   input=fake_hosts, text=True, check=True)
    try:
        code, report, _ = check(inventory3, "--fast")
    finally:
        subprocess.run(["ssh", "-F", str(lab.ssh_config), "node3",
                        "umount /etc/hosts && rm /etc/hosts.ddpfab-fault"], check=True)
    assert code == 1
    assert fails(report) == {("node3", "hostname")}


def test_a_login_banner_is_named_by_check_and_rsync_is_said_to_fail(lab, inventory3):
    """An `echo` in node2's ~/.bashrc: check said all passed while sync and fetch failed with rsync's
    "protocol version mismatch". (Each lab host's /root is its own overlay: checked first.)"""
    ssh = ["ssh", "-F", str(lab.ssh_config)]
    marker = "# ddpfab-test-banner"
    subprocess.run([*ssh, "node2", "touch /root/.ddpfab-overlay-probe"], check=True)
    try:
        for other in ("node1", "node3"):
            assert subprocess.run([*ssh, other, "test -e /root/.ddpfab-overlay-probe"]).returncode == 1
    finally:
        subprocess.run([*ssh, "node2", "rm -f /root/.ddpfab-overlay-probe"], check=True)
    subprocess.run([*ssh, "node2", f"echo 'echo Welcome to node2 {marker}' >> /root/.bashrc"], check=True)
    try:
        assert "Welcome to node2" in subprocess.run([*ssh, "node2", "true"], capture_output=True, text=True).stdout
        code, report, _ = check(inventory3, "--fast")
    finally:
        subprocess.run([*ssh, "node2", f"sed -i '/{marker}/d' /root/.bashrc"], check=True)
    assert code == 1 and fails(report) == {("node2", "shell")}, report["results"]
    r = next(r for r in report["results"] if r["node"] == "node2" and r["check"] == "shell")
    assert "Welcome to node2" in r["found"] and "rsync" in r["fix"]
    assert check(inventory3, "--fast")[0] == 0


def test_unreachable_node(lab, tmp_path):
    text = labmod.render_inventory(lab, sys.executable)
    ghost = lab.subnet.rsplit(".", 1)[0] + ".98"
    text = text.replace("  vars:", f"    ghost:\n      ansible_host: {ghost}\n  vars:", 1)
    text = text.replace("ConnectTimeout=5", "ConnectTimeout=2")
    inv = tmp_path / "inv.yml"
    inv.write_text(text)
    code, report, _ = check(inv, "--fast")
    assert code == 1
    assert fails(report) == {("ghost", "ssh")}
