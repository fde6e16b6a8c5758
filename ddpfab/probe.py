"""One parallel pass over the nodes that gathers the facts the plan needs, before anything starts.

Each node runs a tiny stdlib-only python snippet (its own ``ddpfab_python``) that reports its
hostname, python, whether torch is importable, whether the workdir and script exist, and on the
master a free port (or whether the user's port is free). Connecting is also where host keys are
verified, so an unknown key, an unreachable host or a busy port stops the run before any node
has started anything.
"""

from __future__ import annotations

import ipaddress
import json
import os
import random
import shlex
import socket
import time
from dataclasses import dataclass, field

from fabric import Connection

from . import ssh
from .inventory import Cluster, Node
from .plan import DEFAULT_PORT_RANGE

PROBE_SNIPPET = r"""
import importlib.util, json, os, socket, sys
req = json.loads(sys.argv[1])
out = {"hostname": socket.gethostname(), "python": sys.version.split()[0],
       "executable": sys.executable, "home": os.path.expanduser("~"), "torch": importlib.util.find_spec("torch") is not None}
def free(port):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("", port))
        return True
    except OSError:
        return False
    finally:
        s.close()
if req.get("port"):
    out["port_free"] = free(req["port"])
if req.get("find_port"):
    lo, hi, start = req["find_port"]
    span = hi - lo + 1
    out["free_port"] = next((lo + (start - lo + i) % span for i in range(span)
                             if free(lo + (start - lo + i) % span)), None)
wd = os.path.expanduser(req["workdir"])
out["workdir_exists"] = os.path.isdir(wd)
if req.get("script"):
    out["script_exists"] = os.path.isfile(os.path.join(wd, os.path.expanduser(req["script"])))
# facts for the preflight checks (ddpfab/check.py); cheap ones always, torch import only if "full"
import shutil, subprocess, time
out["time"] = time.time()
try:
    out["hostname_addr"] = socket.gethostbyname(out["hostname"])
except OSError as exc:
    out["hostname_addr"], out["hostname_error"] = None, str(exc)
spec = importlib.util.find_spec("torch") if out["torch"] else None
out["launcher"] = bool(spec and spec.submodule_search_locations and any(
    os.path.exists(os.path.join(d, "distributed", "run.py")) for d in spec.submodule_search_locations))
out["torch_version"] = None
if spec and spec.submodule_search_locations:  # torch/version.py: importlib.metadata takes 20+ ms
    try:
        import re
        with open(os.path.join(list(spec.submodule_search_locations)[0], "version.py")) as fh:
            out["torch_version"] = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)", fh.read(), re.M).group(1)
    except (OSError, AttributeError):
        try:
            from importlib import metadata
            out["torch_version"] = metadata.version("torch")
        except Exception:
            pass
out["resolved"] = {}
for name in req.get("resolve", []):
    try:
        out["resolved"][name] = socket.gethostbyname(name)
    except OSError as exc:
        out["resolved"][name] = "error: %s" % exc
# the interface towards each peer: the kernel's choice of source address (a UDP connect sends
# nothing) mapped to the interface that holds it; `ip route get` only for what that cannot map
def local_addrs():
    found = {}
    try:
        import fcntl, struct
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            for _, name in socket.if_nameindex():
                try:  # SIOCGIFADDR: the interface's primary IPv4 address
                    r = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
                    found.setdefault(socket.inet_ntoa(r[20:24]), name)
                except OSError:
                    pass
        finally:
            s.close()
    except (ImportError, OSError):
        pass
    try:
        with open("/proc/net/if_inet6") as fh:
            for line in fh:
                f = line.split()
                found.setdefault(socket.inet_ntop(socket.AF_INET6, bytes.fromhex(f[0])), f[-1])
    except (OSError, ValueError, IndexError):
        pass
    return found
def route_dev(addr, mine):
    try:
        fam = socket.AF_INET6 if ":" in addr else socket.AF_INET
        s = socket.socket(fam, socket.SOCK_DGRAM)
        try:
            s.connect((addr, 9))
            src = s.getsockname()[0]
        finally:
            s.close()
        if src == addr:
            return "lo"
        if src in mine:
            return mine[src]
    except OSError:
        pass
    try:
        words = subprocess.run(["ip", "-o", "route", "get", addr], capture_output=True, text=True,
                               timeout=5).stdout.split()
        return words[words.index("dev") + 1] if "dev" in words else None
    except (OSError, subprocess.SubprocessError):
        return None
out["routes"] = {}
if req.get("peers"):
    mine = local_addrs()
    for peer, addr in req["peers"].items():
        out["routes"][peer] = route_dev(addr, mine)
if shutil.which("nvidia-smi"):
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        lines = [ln.strip() for ln in q.stdout.splitlines() if ln.strip()]
        out["nvidia_gpus"], out["driver"] = len(lines), (lines[0] if lines else None)
    except (OSError, subprocess.SubprocessError) as exc:
        out["nvidia_error"] = str(exc)
if req.get("full") and out["torch"]:
    try:
        import torch
        out["torch_version"] = torch.__version__
        out["cuda"] = torch.version.cuda
        out["cuda_available"] = torch.cuda.is_available()
        out["gpus"] = torch.cuda.device_count() if out["cuda_available"] else 0
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if out["cuda_available"] else None
    except Exception as exc:
        out["torch_import_error"] = repr(exc)[-300:]
print(json.dumps(out))
"""


class ProbeError(Exception):
    """A node is not ready for the run; ``problems`` holds one clear line per host."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


@dataclass
class NodeFacts:
    name: str
    hostname: str = ""
    python: str = ""
    home: str = ""
    torch: bool = False
    address: str = ""
    free_port: int | None = None
    port_free: bool | None = None
    workdir_exists: bool = True
    script_exists: bool | None = None
    raw: dict = field(default_factory=dict)


def resolve(node: Node, conn: Connection | None = None) -> str:
    """The node's data address as an IP literal (names are resolved here, on the controller).

    A name the controller cannot resolve that is only the default (no ddpfab_data_addr, no
    ansible_host: a host list reached through ssh_config's HostName) is the address the node's
    open SSH connection *conn* goes to: the one way ddpfab reaches the node."""
    try:
        return str(ipaddress.ip_address(node.data_addr))
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(node.data_addr, None, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror as exc:
        peer = _peer_address(conn) if node.data_addr in (node.host, node.name) else None
        if peer:
            return peer
        raise ssh.SSHError(node.name, f"host {node.name}: data address {node.data_addr!r} does not resolve "
                                      f"({exc.strerror}); set ddpfab_data_addr to an IP address") from None
    return infos[0][4][0]


def _peer_address(conn: Connection | None) -> str | None:
    transport = conn.client.get_transport() if conn is not None and conn.is_connected else None
    try:
        return str(ipaddress.ip_address(transport.getpeername()[0])) if transport else None
    except (OSError, ValueError, IndexError):
        return None


def probe_node(conn: Connection, node: Node, *, workdir: str, script: str | None,
               port: int | None = None, find_port: bool = False, peers: dict[str, str] | None = None,
               resolve_names: list[str] | None = None, full: bool = False) -> NodeFacts:
    req: dict = {"workdir": workdir, "script": script, "peers": peers or {}, "resolve": resolve_names or [],
                 "full": full}
    if port:
        req["port"] = port
    if find_port:
        lo, hi = DEFAULT_PORT_RANGE
        # start at a random place so two jobs probing at once rarely pick the same port
        req["find_port"] = [lo, hi, random.randint(lo, hi)]
    command = f"{shlex.quote(node.python)} -c {shlex.quote(PROBE_SNIPPET)} {shlex.quote(json.dumps(req))}"
    sent = time.time()
    res = ssh.run(conn, node.name, command, timeout=60)
    received = time.time()
    if res.exit_code == 127:
        raise ssh.SSHError(node.name, f"host {node.name}: python {node.python!r} not found there; set "
                                      "ddpfab_python to the python that has torch", kind="python")
    if res.exit_code != 0:
        raise ssh.SSHError(node.name, f"host {node.name}: probe with {node.python} failed "
                                      f"(exit {res.exit_code}): {res.stderr.strip()[-300:]}", kind="python")
    data = json.loads(res.stdout.strip().splitlines()[-1])
    return NodeFacts(name=node.name, hostname=data["hostname"], python=data["python"], home=data["home"], torch=data["torch"],
                     free_port=data.get("free_port"), port_free=data.get("port_free"),
                     workdir_exists=data["workdir_exists"], script_exists=data.get("script_exists"),
                     raw={**data, "controller_sent": sent, "controller_received": received})


def gather(cluster: Cluster, conns: dict[str, Connection], master: Node, *, cwd: str, script: str | None,
           master_port: int | None, full: bool = False) -> tuple[dict[str, NodeFacts], list[str]]:
    """Probe every node in parallel; return the facts and a list of problems (empty = ready)."""
    addresses = {}
    for n in cluster.nodes:
        try:
            addresses[n.name] = resolve(n, conns.get(n.name))
        except ssh.SSHError:
            addresses[n.name] = n.data_addr
    names = sorted({n.data_addr for n in cluster.nodes if n.data_addr != addresses[n.name]})

    def one(node: Node) -> NodeFacts:
        is_master = node.name == master.name
        facts = probe_node(conns[node.name], node, workdir=node.workdir or cwd,
                           script=script or None,  # absolute paths too: the node joins and checks it
                           port=master_port if is_master else None,
                           find_port=is_master and master_port is None,
                           peers={k: v for k, v in addresses.items() if k != node.name},
                           resolve_names=names, full=full)
        facts.address = resolve(node, conns[node.name])
        return facts

    results = ssh.parallel([n for n in cluster.nodes if n.name in conns], one)
    facts: dict[str, NodeFacts] = {}
    problems: list[str] = []
    for node in cluster.nodes:
        if node.name not in results:
            continue
        res = results[node.name]
        if isinstance(res, BaseException):
            problems.append(str(res) if isinstance(res, ssh.SSHError) else f"host {node.name}: probe failed: {res!r}")
            continue
        facts[node.name] = res
        workdir = node.workdir or cwd
        if not res.workdir_exists:
            problems.append(f"host {node.name}: workdir {workdir} does not exist there; create it, sync the "
                            "code, or set ddpfab_workdir")
        elif script and res.script_exists is False:
            problems.append(f"host {node.name}: script {script} not found in {workdir}; sync the code first")
        if not res.torch:
            problems.append(f"host {node.name}: {node.python} cannot import torch (python {res.python}); "
                            "provision the node (ddpfab provision) or set ddpfab_python")
        if node.name == master.name:
            if master_port is not None and res.port_free is False:
                problems.append(f"host {node.name}: --master-port {master_port} is already in use there; "
                                "pick another port or leave --master-port out to get a free one")
            if master_port is None and res.free_port is None:
                lo, hi = DEFAULT_PORT_RANGE
                problems.append(f"host {node.name}: no free port in {lo}-{hi}; pass --master-port")
    return facts, problems
