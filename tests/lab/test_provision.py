"""`ddpfab provision` on lab hosts: from a locked-down box to ready to train, idempotently.

One lab of four hosts for the module. Each host starts with INPUT policy DROP (ACCEPT for lo,
established and tcp/22 first, as a careful admin would leave it). The inventory holds node1-3;
node4 is a bystander on the same subnet that must not get in. Provisioning (torch install
included) happens once, in the `provisioned` fixture; the tests after it look at the result and
then change the inventory or the firewall settings, in file order.

Speed: the inventory sets ddpfab_python_pip_compile: false (the torch install is about 3x faster
without byte-compiling) and PIP_RETRIES=0 (lab hosts have no route out, and pip would retry pypi.org
five times for every package). docs/provisioning.md has the measured times.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from ddpfab import lab as labmod
from ddpfab.remote import provision

from .conftest import session_subnet

REPO = Path(__file__).resolve().parents[2]
SUBNET = os.environ.get("DDPFAB_PROVISION_SUBNET") or session_subnet(50)
MEMBERS = ["node1", "node2", "node3"]
OUTSIDER = "node4"
TORCH = "2.13.0"
#: Host python for the listener/connector probes inside the hosts' network namespaces.
PROBE_PYTHON = "/usr/bin/python3"
#: A stand-in nvidia-smi (two H200s); lab hosts see the controller's checkout.
FAKE_SMI = str(REPO / "ddpfab/lab/fake-nvidia-smi")

LISTEN = r"""
import socket, sys, threading
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", int(sys.argv[1])))
srv.listen(64)
print(srv.getsockname()[1], flush=True)
def serve():
    while True:
        conn, _ = srv.accept()
        conn.close()
threading.Thread(target=serve, daemon=True).start()
sys.stdin.read()  # until the test closes our stdin
"""

CONNECT = r"""
import json, socket, sys, concurrent.futures as cf
def probe(target):
    addr, port = target.rsplit(":", 1)
    try:
        socket.create_connection((addr, int(port)), timeout=float(sys.argv[1])).close()
        return "ok"
    except ConnectionRefusedError:
        return "refused"
    except OSError as exc:
        return "timeout" if isinstance(exc, (socket.timeout, TimeoutError)) else type(exc).__name__
with cf.ThreadPoolExecutor(32) as pool:
    print(json.dumps(dict(zip(sys.argv[2:], pool.map(probe, sys.argv[2:])))))
"""


# -- helpers ------------------------------------------------------------------------------------
def write_inventory(lab: labmod.Lab, names: list[str], path: Path, **extra_vars) -> Path:
    inv = yaml.safe_load(labmod.render_inventory(lab, sys.executable, names=names))
    # fast torch install: no byte-compiling, and no retrying pypi.org from hosts without a route
    # out (pip's config here adds local indexes; pypi.org stays first and costs 5 retries a package)
    inv["all"]["vars"]["ddpfab_python_pip_compile"] = False
    inv["all"]["vars"]["ddpfab_python_pip_environment"] = {"PIP_RETRIES": "0"}
    inv["all"]["vars"].update(extra_vars)
    path.write_text(yaml.safe_dump(inv, sort_keys=False))
    return path


def cli_provision(*args: str) -> tuple[int, str, float]:
    """`python -m ddpfab provision ARGS`: exit code, output, seconds."""
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "ddpfab", "provision", *args], cwd=REPO, check=False,
                          capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    print(out[-6000:])
    return proc.returncode, out, time.monotonic() - t0


def play(inventory: Path, playbook: str = "provision", **kwargs) -> tuple[int, str, float]:
    """provision.run_playbook, with its output captured (and echoed for pytest's report)."""
    buf = io.StringIO()
    t0 = time.monotonic()
    rc = provision.run_playbook(inventory, playbook, out=buf, **kwargs)
    out = buf.getvalue()
    print(out[-6000:])
    return rc, out, time.monotonic() - t0


def recap(out: str) -> dict[str, dict[str, int]]:
    return {h.host: h.counts for h in provision.parse_recap(out)}


def lock_down(lab: labmod.Lab, name: str) -> None:
    """INPUT policy DROP with lo, established and ssh accepted first, inside the host's netns."""
    for rule in (["-i", "lo"], ["-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED"], ["-p", "tcp", "--dport", "22"]):
        lab.netns_exec(name, ["iptables", "-w", "-A", "INPUT", *rule, "-j", "ACCEPT"], check=True)
    lab.netns_exec(name, ["iptables", "-w", "-P", "INPUT", "DROP"], check=True)


class Listeners:
    """A TCP listener on an ephemeral (or given) port in each named host's network namespace."""

    def __init__(self, lab: labmod.Lab, names: list[str], port: int = 0):
        self.procs = {}
        self.ports = {}
        self.lab = lab
        for name in names:
            argv = ["ip", "netns", "exec", lab.host(name).netns, PROBE_PYTHON, "-c", LISTEN, str(port)]
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            self.procs[name] = proc
        for name, proc in self.procs.items():
            self.ports[name] = int(proc.stdout.readline())

    def target(self, name: str) -> str:
        return f"{self.lab.host(name).address}:{self.ports[name]}"

    def close(self) -> None:
        for proc in self.procs.values():
            proc.stdin.close()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def reach(lab: labmod.Lab, src: str, targets: list[str], timeout: float = 1.5) -> dict[str, str]:
    """From host *src*'s network namespace, try a TCP connection to each 'addr:port'."""
    proc = lab.netns_exec(src, [PROBE_PYTHON, "-c", CONNECT, str(timeout), *targets],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def matrix(lab: labmod.Lab, sources: list[str], listeners: Listeners) -> dict[tuple[str, str], str]:
    """(source, destination) -> ok / refused / timeout, for every listener other than the source."""
    result = {}
    for src in sources:
        dests = [d for d in listeners.ports if d != src]
        got = reach(lab, src, [listeners.target(d) for d in dests])
        for d in dests:
            result[(src, d)] = got[listeners.target(d)]
    return result


# -- fixtures -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plab(tmp_path_factory):
    lab_dir = tmp_path_factory.mktemp("provlab")
    the_lab, _ = labmod.up(lab_dir, hosts=4, subnet=SUBNET)
    try:
        for h in the_lab.hosts:
            lock_down(the_lab, h.name)
        yield the_lab
    finally:
        labmod.down(lab_dir)


@pytest.fixture(scope="module")
def provisioned(plab):
    """node1-3 provisioned twice with `ddpfab provision` (the CLI); the outputs and timings."""
    inv = write_inventory(plab, MEMBERS, plab.dir / "inventory3.yml")
    rc1, out1, t1 = cli_provision("--inventory", str(inv))
    rc2, out2, t2 = cli_provision("--inventory", str(inv)) if rc1 == 0 else (None, "", 0.0)
    print(f"\nprovision timings: first run {t1:.1f} s, second run {t2:.1f} s")
    return {"inventory": inv, "rc1": rc1, "out1": out1, "t1": t1, "rc2": rc2, "out2": out2, "t2": t2}


# -- tests --------------------------------------------------------------------------------------
def test_provision_under_drop_policy_then_second_run_changes_nothing(provisioned):
    assert provisioned["rc1"] == 0, "first provision failed (output above)"
    first = recap(provisioned["out1"])
    assert sorted(first) == MEMBERS
    assert all(c["failed"] == 0 and c["unreachable"] == 0 and c["changed"] > 0 for c in first.values()), first
    assert provisioned["rc2"] == 0
    second = recap(provisioned["out2"])
    assert sorted(second) == MEMBERS
    assert {h: c["changed"] for h, c in second.items()} == {h: 0 for h in MEMBERS}, second


def run_testinfra(plab, tmp_path: Path, **expect) -> None:
    """tests/infra/test_node.py against each member, one pytest per host, in parallel; *expect* is
    what the module checks (members, backend, ...); every host's run must pass."""
    expect_file = tmp_path / f"expect-{expect['backend']}.json"
    expect_file.write_text(json.dumps({"members": [plab.host(n).address for n in MEMBERS], "torch": TORCH,
                                       "venv": "/opt/ddpfab/venv", "ssh_ports": [22], **expect}))
    cp = tmp_path / f"cp-{expect['backend']}"
    cp.mkdir()
    procs = {n: subprocess.Popen(
        [sys.executable, "-m", "pytest", str(REPO / "tests/infra/test_node.py"),
         f"--hosts=ssh://{n}?controlpath={cp}/{n}&controlpersist=5", f"--ssh-config={plab.ssh_config}",
         "-p", "no:cacheprovider", "-q", "-rfE"],
        cwd=REPO, env={**os.environ, "DDPFAB_INFRA_EXPECT": str(expect_file)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for n in MEMBERS}
    results = {n: (p.communicate(timeout=300)[0], p.returncode) for n, p in procs.items()}
    for n in MEMBERS:  # close the multiplexed connections now rather than when they time out
        subprocess.run(["ssh", "-F", str(plab.ssh_config), "-o", f"ControlPath={cp}/{n}", "-O", "exit", n],
                       check=False, capture_output=True)
    for n, (out, rc) in results.items():
        print(f"--- testinfra ({expect['backend']}) on {n} (exit {rc})\n{out[-3000:]}")
    assert {n: rc for n, (_, rc) in results.items()} == {n: 0 for n in MEMBERS}, "testinfra failed (output above)"
    assert all(" passed" in out and "failed" not in out for out, _ in results.values())


def test_testinfra_on_every_member(plab, provisioned, tmp_path):
    assert provisioned["rc1"] == 0
    run_testinfra(plab, tmp_path, backend="iptables", persist_file="/etc/iptables/rules.v4")


def test_members_reach_each_other_on_ephemeral_ports_outsider_does_not(plab, provisioned):
    assert provisioned["rc1"] == 0
    with Listeners(plab, MEMBERS) as listeners:
        got = matrix(plab, MEMBERS + [OUTSIDER], listeners)
    members = {k: v for k, v in got.items() if k[0] in MEMBERS}
    outsider = {k: v for k, v in got.items() if k[0] == OUTSIDER}
    assert set(members.values()) == {"ok"}, members
    assert len(outsider) == 3 and "ok" not in outsider.values(), outsider


def test_gpu_role_records_what_nvidia_smi_reports(plab, provisioned):
    """CPU lab hosts get a stand-in nvidia-smi (two H200s) to exercise the GPU path."""
    assert "a CPU host" in " ".join(provisioned["out1"].split())  # what the real hosts are
    rc, _, _ = play(provisioned["inventory"], tags=["gpu"], limit="node1",
                    extra_args=["-e", f"ddpfab_gpu_nvidia_smi={FAKE_SMI}", "-e", "ddpfab_gpus=2"])
    assert rc == 0
    fact = json.loads(_read_remote(plab, "node1", "/etc/ansible/facts.d/ddpfab_gpu.fact"))
    assert fact["count"] == 2 and fact["driver"] == "570.133.20" and fact["cuda"] == "12.8"
    assert [g["name"] for g in fact["gpus"]] == ["NVIDIA H200", "NVIDIA H200"]
    assert fact["gpus"][1]["memory_mib"] == 143771


def test_failures_are_clear_and_name_each_failed_host(plab, provisioned):
    """node1 expects 4 GPUs but has 2; node2's clock is "too far off" (a negative bound: lab hosts
    share the controller's clock); node3 is fine. One run, two failed hosts, each named."""
    inv = write_inventory(plab, MEMBERS, plab.dir / "inventory3-bad.yml")
    data = yaml.safe_load(inv.read_text())
    data["all"]["hosts"]["node1"].update(ddpfab_gpus=4, ddpfab_gpu_nvidia_smi=FAKE_SMI)
    data["all"]["hosts"]["node2"].update(ddpfab_timesync_max_skew_s=-1)
    inv.write_text(yaml.safe_dump(data, sort_keys=False))
    rc, out, _ = play(inv, tags=["timesync", "gpu"])
    assert rc != 0
    flat = " ".join(out.split())
    assert "node1 has 2 GPU(s) (NVIDIA H200, NVIDIA H200) but the inventory expects 4" in flat
    assert "The clock of node2 is off by between" in flat and "ddpfab_timesync_max_skew_s=-1" in flat
    assert "no systemd" in flat  # chrony is skipped with a message, not a failure
    named = [line for line in out.splitlines() if line.startswith("ddpfab provision: ")]
    assert len(named) == 2 and named[0].startswith("ddpfab provision: node1: FAILED") \
        and named[1].startswith("ddpfab provision: node2: FAILED"), named
    assert recap(out)["node3"]["failed"] == 0


def test_host_removed_from_inventory_loses_access(plab, provisioned):
    assert provisioned["rc1"] == 0
    inv2 = write_inventory(plab, ["node1", "node2"], plab.dir / "inventory2.yml")
    # meanwhile someone inserted a rule above ddpfab's jump on node1: the run puts the jump back on top
    plab.netns_exec("node1", ["iptables", "-w", "-I", "INPUT", "1", "-p", "udp", "--dport", "9", "-j", "ACCEPT"],
                    check=True)
    rc, out, _ = play(inv2, "firewall")
    assert rc == 0
    node1_input = plab.netns_exec("node1", ["iptables", "-w", "-S", "INPUT"], check=True, capture_output=True,
                                  text=True).stdout.splitlines()
    assert [r for r in node1_input if r.startswith("-A ")][:2] == [
        "-A INPUT -j DDPFAB-INPUT", "-A INPUT -p udp -m udp --dport 9 -j ACCEPT"], node1_input
    assert {h: c["changed"] > 0 for h, c in recap(out).items()} == {"node1": True, "node2": True}
    with Listeners(plab, ["node1", "node2"]) as listeners:
        got = matrix(plab, ["node1", "node2", "node3"], listeners)
    assert got[("node1", "node2")] == "ok" and got[("node2", "node1")] == "ok", got
    assert got[("node3", "node1")] != "ok" and got[("node3", "node2")] != "ok", got
    chain = plab.netns_exec("node1", ["iptables", "-w", "-S", "DDPFAB-INPUT"], check=False,
                            capture_output=True, text=True).stdout
    assert plab.host("node3").address not in chain


def test_nftables_backend_ports_mode_confines_and_opens_the_ephemeral_range(plab, provisioned, tmp_path):
    """Switch node1-3 to nftables with a narrowed ephemeral range and ddpfab's own drop policy."""
    assert provisioned["rc1"] == 0
    for n in MEMBERS:  # the admin's own iptables lock-down goes; ddpfab's table takes over
        plab.netns_exec(n, ["iptables", "-w", "-P", "INPUT", "ACCEPT"], check=True)
        plab.netns_exec(n, ["iptables", "-w", "-F", "INPUT"], check=True)
    inv = write_inventory(plab, MEMBERS, plab.dir / "inventory3-nft.yml",
                          ddpfab_firewall_backend="nftables", ddpfab_firewall_mode="ports",
                          ddpfab_firewall_local_port_range="40000 40999", ddpfab_firewall_input_policy="drop")
    rc, out, _ = play(inv, "firewall")
    assert rc == 0
    for n in MEMBERS:
        def netns(*argv: str, host: str = n) -> subprocess.CompletedProcess:
            return plab.netns_exec(host, list(argv), check=False, capture_output=True, text=True)
        assert netns("iptables", "-w", "-S", "DDPFAB-INPUT").returncode != 0  # the old backend's chain is gone
        table = netns("nft", "list", "table", "inet", "ddpfab").stdout
        assert "policy drop" in table and "40000-40999" in table
        assert netns("cat", "/proc/sys/net/ipv4/ip_local_port_range").stdout.split() == ["40000", "40999"]
    with Listeners(plab, MEMBERS) as listeners:  # ephemeral ports, now from 40000-40999
        assert all(40000 <= p <= 40999 for p in listeners.ports.values()), listeners.ports
        got = matrix(plab, MEMBERS + [OUTSIDER], listeners)
    assert {v for k, v in got.items() if k[0] in MEMBERS} == {"ok"}, got
    assert {v for k, v in got.items() if k[0] == OUTSIDER} == {"refused"}, got  # rejected, not just dropped
    with Listeners(plab, ["node1"], port=12345) as listeners:  # outside the range: dropped by the policy
        assert reach(plab, "node2", [listeners.target("node1")], timeout=1.0) == {listeners.target("node1"): "timeout"}
    rc, out, _ = play(inv, "firewall")
    assert rc == 0
    assert {h: c["changed"] for h, c in recap(out).items()} == {h: 0 for h in MEMBERS}
    run_testinfra(plab, tmp_path, backend="nftables")  # the same testinfra module, nftables side


def _read_remote(lab: labmod.Lab, name: str, path: str) -> str:
    """A file's content as host *name* sees it (over SSH)."""
    proc = subprocess.run(["ssh", "-F", str(lab.ssh_config), name, "cat", path], check=False,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout
