"""Every way ddpfab reaches a node goes through the jump host the inventory or ssh_config names.

One lab of three hosts for the module: node1 and node2 are the cluster, node3 the jump host. The
nodes' own firewall (iptables in their network namespace) accepts SSH only from the jump host and
rejects it from anywhere else, so a command that succeeds went through the jump host; the ACCEPT
rule's counter shows that it did. Two routes: ``-o ProxyJump=`` in ``ansible_ssh_common_args``, and
``ProxyJump`` in an ``--ssh-config`` file. Over both: run (2 nodes, gloo all_reduce, detached),
ps, logs, stop, exec, sync, check, fetch, provision (a one-task playbook), the script ``plan
--emit`` writes and the ssh line ``run --dry-run`` prints. Then the jump host's key in known_hosts
is changed, and every one of them must refuse, naming the jump host.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from ddpfab import lab as labmod

from .conftest import extra_subnet, own_lab
from .helpers import ddpfab, reports, wait_no_processes

REPORT = "tests/lab/scripts/report.py"
#: The route every command is tried over; the other one (ssh_config) is tried with one command of
#: each rendering: exec (Fabric, as run/check/ps/logs/stop), sync and fetch (OpenSSH), provision
#: (Ansible) and the ssh lines of plan --emit and run --dry-run, to keep the module's time modest.
EVERY_COMMAND = "inventory"
NODES = ("node1", "node2")
WORKDIR = "/opt/ddpfab-bastion-test"  # only the nodes have it (an overlay): a real copy
PLAYBOOK = """\
- name: Reach every node
  hosts: all
  gather_facts: false
  tasks:
    - name: Ping
      ansible.builtin.ping:
"""


def _ssh_rules(lab, name: str) -> dict[str, int]:
    """New SSH connections the node's rules saw: {"ACCEPT": from the jump host, "REJECT": others}."""
    out = lab.netns_exec(name, ["iptables", "-L", "INPUT", "-v", "-n", "-x"], capture_output=True, text=True,
                         check=True).stdout
    counts = {}
    for line in out.splitlines():
        words = line.split()
        if len(words) > 3 and words[2] in ("ACCEPT", "REJECT") and "dpt:22" in line and "ESTABLISHED" not in line:
            counts[words[2]] = int(words[0])
    return counts


@pytest.fixture(scope="module")
def bastion(tmp_path_factory):
    with own_lab(tmp_path_factory, "bastion", hosts=3, subnet=extra_subnet(142)) as lab:
        jump = lab.host("node3").address
        for name in NODES:  # SSH only from the jump host; everything else (gloo) as before
            # packets of open connections first (uncounted: a connection closing late is not a new
            # one); then ACCEPT counts new connections from the jump host, REJECT attempts from
            # anywhere else; DROP takes stray packets of connections made before the rules
            for rule in (["-A", "INPUT", "-p", "tcp", "--dport", "22", "-m", "conntrack", "--ctstate",
                          "ESTABLISHED,RELATED", "-j", "ACCEPT"],
                         ["-A", "INPUT", "-p", "tcp", "--dport", "22", "-s", jump, "-j", "ACCEPT"],
                         ["-A", "INPUT", "-p", "tcp", "--dport", "22", "-m", "conntrack", "--ctstate", "NEW",
                          "-j", "REJECT", "--reject-with", "tcp-reset"],
                         ["-A", "INPUT", "-p", "tcp", "--dport", "22", "-j", "DROP"]):
                lab.netns_exec(name, ["iptables", *rule], check=True)
        tmp = tmp_path_factory.mktemp("bastion-client")
        # route 1: the inventory's ssh args name the jump host
        inv = yaml.safe_load(labmod.render_inventory(lab, sys.executable, names=list(NODES)))
        # every host shares the same loaded cores, and a jump doubles the handshakes: more time
        # than the lab's 5 s before a slow banner counts as a dead host
        inv["all"]["vars"]["ansible_ssh_common_args"] = inv["all"]["vars"]["ansible_ssh_common_args"].replace(
            "ConnectTimeout=5", "ConnectTimeout=30") + f" -o ProxyJump=root@{jump}"
        by_inventory = tmp / "inventory.yml"
        by_inventory.write_text(yaml.safe_dump(inv))
        # route 2: the user's ssh_config does (the inventory names the hosts only)
        config = tmp / "ssh_config"
        config.write_text(re.sub(r"(Host node[12]\n)", r"\1  ProxyJump node3\n",
                                 lab.ssh_config.read_text().replace("ConnectTimeout 5", "ConnectTimeout 30")))
        by_config = tmp / "inventory-by-config.yml"
        by_config.write_text(yaml.safe_dump({"all": {"hosts": {n: None for n in NODES}, "vars": {
            "ansible_python_interpreter": "/usr/bin/python3", "ddpfab_python": sys.executable,
            "ddpfab_nproc_per_node": 1}}}))
        playbook = tmp / "ping.yml"
        playbook.write_text(PLAYBOOK)
        project = tmp / "project"
        project.mkdir()
        (project / "train.txt").write_text("reached through the jump host\n")
        yield SimpleNamespace(lab=lab, jump=jump, tmp=tmp, playbook=playbook, project=project, routes={
            "inventory": ["-i", str(by_inventory)],
            "ssh_config": ["-i", str(by_config), "--ssh-config", str(config)]})


def test_the_nodes_refuse_ssh_from_anywhere_but_the_jump_host(bastion):
    lab = bastion.lab
    before = _ssh_rules(lab, "node1")["REJECT"]
    base = ["ssh", "-F", str(lab.ssh_config), "-o", "ConnectTimeout=5"]
    direct = subprocess.run([*base, "node1", "true"], capture_output=True, text=True, timeout=30)
    assert direct.returncode == 255 and "refused" in direct.stderr, direct.stderr
    assert _ssh_rules(lab, "node1")["REJECT"] == before + 1  # the counter sees a direct attempt
    via = subprocess.run([*base, "-J", "node3", "node1", "hostname"], capture_output=True, text=True, timeout=30)
    assert via.returncode == 0 and via.stdout.strip() == "node1", via.stderr


def _emitted_ssh(out_dir: Path, node: str) -> list[str]:
    """The ssh command line an emitted node script says to run it with (its '#   ssh ...' line)."""
    script = next(out_dir.glob(f"rank*-{node}.sh")).read_text()
    line = next(ln for ln in script.splitlines() if ln.startswith("#   ssh "))
    return shlex.split(line[1:].split(" 'sh -s' <")[0])


def _dry_run_ssh(stdout: str, node: str) -> list[str]:
    line = next(ln for ln in stdout.splitlines() if ln.startswith(f"# {node} ("))
    return shlex.split(line.split("procs): ", 1)[1])


def _no_direct(lab, before: dict, what: str) -> None:
    """No node saw an SSH connection from anywhere but the jump host since *before*."""
    now = {n: _ssh_rules(lab, n) for n in NODES}
    assert all(now[n]["REJECT"] == before[n]["REJECT"] for n in NODES), (what, before, now)


@pytest.mark.parametrize("route", ["inventory", "ssh_config"])
def test_every_command_goes_through_the_jump_host(bastion, route, tmp_path):
    lab, how = bastion.lab, bastion.routes[route]
    before = {n: _ssh_rules(lab, n) for n in NODES}
    runs = tmp_path / "runs"
    res = ddpfab("exec", *how, "--", "hostname")
    assert res.returncode == 0 and all(n in res.stdout for n in NODES), res.stdout + res.stderr
    _no_direct(lab, before, res.args[3])
    res = ddpfab("sync", *how, "-e", f"ddpfab_workdir={WORKDIR}", str(bastion.project), timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    _no_direct(lab, before, res.args[3])
    # (fetch reads the node's workdir: the controller's cwd there, as the lab shares it)
    res = ddpfab("fetch", *how, "--node", "node2", "train.txt", str(tmp_path), cwd=bastion.project)
    assert res.returncode == 0, res.stdout + res.stderr
    _no_direct(lab, before, res.args[3])
    assert (tmp_path / "train.txt").read_text() == "reached through the jump host\n"
    if route == EVERY_COMMAND:  # the other route reaches the same Fabric path as exec does
        res = ddpfab("check", *how, timeout=180)
        assert res.returncode == 0, res.stdout + res.stderr
        _no_direct(lab, before, res.args[3])
        # a real 2-node gloo all_reduce (the code synced through the jump host first), detached
        res = ddpfab("run", *how, "--runs-dir", str(runs), "--detach", "--env", "REPORT_HANG=600", REPORT, timeout=180)
        assert res.returncode == 0, res.stdout + res.stderr
        _no_direct(lab, before, res.args[3])
        run_id = next(runs.iterdir()).name
        res = ddpfab("ps", *how, "--runs-dir", str(runs), "--json")
        assert res.returncode == 0, res.stderr
        _no_direct(lab, before, res.args[3])
        assert {r["run_id"]: r["state"] for r in json.loads(res.stdout)["runs"]}[run_id] == "running"
        deadline = time.monotonic() + 90
        while True:  # the ranks' output, fetched from the nodes
            res = ddpfab("logs", *how, "--runs-dir", str(runs), run_id)
            assert res.returncode == 0, res.stdout + res.stderr
            got = [r for n in NODES for r in reports((runs / run_id / f"{n}.remote.log").read_text())]
            if len(got) == 2 or time.monotonic() > deadline:
                break
            time.sleep(2)
        assert sorted(r["rank"] for r in got) == [0, 1] and {r["sum"] for r in got} == {3.0}, got
        res = ddpfab("stop", *how, "--runs-dir", str(runs), run_id)
        assert res.returncode == 0 and res.stdout.count("stopped") == 2, res.stdout + res.stderr
        _no_direct(lab, before, res.args[3])
        wait_no_processes(lab, timeout=10, names=NODES)
    res = ddpfab("provision", *how, "--playbook", str(bastion.playbook), timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    _no_direct(lab, before, res.args[3])
    assert re.search(r"node1\s*: ok=1", res.stdout) and re.search(r"node2\s*: ok=1", res.stdout), res.stdout
    # the ssh lines ddpfab writes for people: the emitted script's and the dry run's
    emitted = tmp_path / "emit"
    res = ddpfab("plan", *how, "--offline", "--emit", str(emitted), REPORT)
    assert res.returncode == 0, res.stdout + res.stderr
    _no_direct(lab, before, res.args[3])
    dry = ddpfab("run", *how, "--dry-run", "--offline", REPORT)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    _no_direct(lab, before, dry.args[3])
    for node in NODES:
        for argv in (_emitted_ssh(emitted, node), _dry_run_ssh(dry.stdout, node)):  # (emitted: from its dir)
            got = subprocess.run([*argv, "hostname"], capture_output=True, text=True, timeout=60, cwd=emitted)
            assert got.returncode == 0 and got.stdout.strip() == node, (argv, got.stderr)
    after = {n: _ssh_rules(lab, n) for n in NODES}
    for n in NODES:  # every connection came from the jump host; none was tried directly
        assert after[n]["ACCEPT"] > before[n]["ACCEPT"] and after[n]["REJECT"] == before[n]["REJECT"], (before, after)


@pytest.fixture
def changed_jump_key(bastion):
    """The jump host's key in the lab's known_hosts replaced by another: as if it were an impostor."""
    known = bastion.lab.known_hosts
    good = known.read_text()
    other = bastion.tmp / "impostor_key"
    if not other.exists():
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    ktype, key = Path(f"{other}.pub").read_text().split()[:2]
    lines = [f"{ln.split()[0]} {ktype} {key}" if ln.split()[0].startswith(bastion.jump + ",") else ln
             for ln in good.splitlines()]
    assert lines != good.splitlines()
    known.write_text("\n".join(lines) + "\n")
    try:
        yield
    finally:
        known.write_text(good)


@pytest.mark.parametrize("route", ["inventory", "ssh_config"])
def test_a_changed_jump_host_key_is_refused_by_every_command(bastion, route, changed_jump_key, tmp_path):
    lab, how, jump = bastion.lab, bastion.routes[route], bastion.jump
    before = {n: _ssh_rules(lab, n) for n in NODES}
    runs = tmp_path / "runs"
    (runs / "r-old").mkdir(parents=True)  # a run record for ps/logs/stop to look for on the nodes
    jump_name = f"root@{jump}" if route == "inventory" else "node3"
    named = f"jump host {jump_name} ({jump}:22): host key CHANGED"
    commands = {
        "exec": ["exec", *how, "--", "hostname"],
        "sync": ["sync", *how, "-e", f"ddpfab_workdir={WORKDIR}", str(bastion.project)],
        "fetch": ["fetch", *how, "--node", "node2", "train.txt", str(tmp_path)],
    }
    if route == EVERY_COMMAND:
        commands.update({
            "check": ["check", *how],
            "run": ["run", *how, "--runs-dir", str(runs), REPORT],
            "ps": ["ps", *how, "--runs-dir", str(runs)],
            "logs": ["logs", *how, "--runs-dir", str(runs), "r-old"],
            "stop": ["stop", *how, "--runs-dir", str(runs), "r-old"],
        })
    for what, argv in commands.items():
        res = ddpfab(*argv, timeout=180)
        assert res.returncode != 0, (what, res.stdout + res.stderr)
        assert named in res.stdout + res.stderr, (what, res.stdout + res.stderr)
    res = ddpfab("provision", *how, "--playbook", str(bastion.playbook), timeout=180)
    for node in NODES:  # Ansible's own message names no jump host; ddpfab's line does
        assert f"ddpfab provision: {node}: UNREACHABLE (host {node}: {named}" in res.stdout, res.stdout
    assert res.returncode != 0
    emitted = tmp_path / "emit"
    assert ddpfab("plan", *how, "--offline", "--emit", str(emitted), REPORT).returncode == 0
    dry = ddpfab("run", *how, "--dry-run", "--offline", REPORT)
    for argv in (_emitted_ssh(emitted, "node1"), _dry_run_ssh(dry.stdout, "node1")):
        got = subprocess.run([*argv, "hostname"], capture_output=True, text=True, timeout=60, cwd=emitted)
        assert got.returncode == 255 and f"Host key for {jump} has changed" in got.stderr, got.stderr
    after = {n: _ssh_rules(lab, n) for n in NODES}
    assert after == before, "a node was reached although the jump host's key was wrong"
    shutil.rmtree(runs, ignore_errors=True)
