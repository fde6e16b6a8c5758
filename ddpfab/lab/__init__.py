"""A local multi-host lab: each host is a network namespace plus PID/mount/UTS namespaces running sshd.

Why namespaces and not containers or VMs: they need nothing but the kernel and iproute2, start in
well under a second, and still give each host what the product cares about: its own address,
sshd and host key, firewall tables, process table, hostname and writable system dirs. So the code
under test meets real SSH, real iptables, real port clashes and real torchrun (docs/lab.md).

State lives in ``DIR/lab.json``; everything the lab creates is named from a short hash of DIR, so
two labs with different dirs and subnets coexist and ``down`` removes only what its own ``up`` made.
"""

from __future__ import annotations

import hashlib
import importlib.util
import ipaddress
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ddpfab.remote.reaper import pid_alive
from ddpfab.problems import DdpfabError

DEFAULT_SUBNET = "10.213.0.0/24"
#: System dirs each host gets as a private overlay (writes stay per host, the real dirs untouched).
OVERLAY_DIRS = ("/etc", "/opt", "/var", "/root", "/usr", "/home")
#: Each host's own /tmp starts empty, as on a real machine, whatever the controller's /tmp holds:
#: when hosts saw the controller's /tmp, a cache dir there (torch's ``torchinductor_<user>``)
#: decided whether a job wrote one on a host, so the tests' results depended on the machine's past.
#: What hosts must see under it (a checkout and venv cloned under /tmp, as in CI; the lab dir) is
#: shared path by path (``up(share=...)``), each as a private overlay of the controller's dir.
PRIVATE_TMP = "/tmp"
#: Dirs each host gets as a private, empty tmpfs.
TMPFS_DIRS = ("/run",)
#: Where the overlays' upper layers live. Outside every overlaid dir on purpose: overlayfs refuses
#: an upper layer inside its own lower one, and the lab dir itself may well be under /tmp or /root.
STORE_ROOT = Path("/srv/ddpfab-lab")
HOST_OFFSET = 11  # node1 gets .11, like a small real rack
#: The kernel's IPv4 neighbour (ARP) table limits. They are one table for the whole kernel, every
#: namespace included: a real host holds one entry per peer, but N lab hosts hold N*N together, and
#: the default hard limit (gc_thresh3 = 1024) is full at 32 hosts. Beyond it the kernel logs
#: "neighbor table overflow" and connects fail with "No route to host" or time out, which looks
#: exactly like a firewall fault (that was why `check` failed on healthy 32-host labs).
NEIGH_SYSCTL = "/proc/sys/net/ipv4/neigh/default/gc_thresh{}"


#: The stand-in nvidia-smi ``lab up --gpus N`` installs on each host (no GPU is there: it answers
#: nvidia-smi's queries for N GPUs, and lists the compute processes a test writes into
#: ``/etc/ddpfab-stand-in/compute-apps`` on a host, to simulate a GPU used without a lease).
STAND_IN_SMI = Path(__file__).with_name("fake-nvidia-smi")
#: Where a host's stand-in reads its GPU count and compute processes.
STAND_IN_CONF = "/etc/ddpfab-stand-in"


class LabError(DdpfabError):
    """A lab operation failed; the message says what is missing and what to do."""

    check = "lab"


@dataclass
class LabHost:
    name: str
    address: str
    netns: str
    veth: str
    pid: int = 0  # the `unshare` process; its child is PID 1 (sshd) of the host

    def pid_namespace(self) -> str | None:
        """The host's PID namespace id (``pid:[...]``), read from its PID 1, or None if gone."""
        init = _child_pid(self.pid)
        if init is None:
            return None
        try:
            return os.readlink(f"/proc/{init}/ns/pid")
        except OSError:
            return None


@dataclass
class Lab:
    dir: Path
    subnet: str
    bridge: str
    gateway: str
    store: str = ""
    hosts: list[LabHost] = field(default_factory=list)
    forward_rules: bool = False
    #: controller dirs under /tmp that every host sees at the same path (see PRIVATE_TMP)
    shares: list[str] = field(default_factory=list)
    #: stand-in GPUs per host (``lab up --gpus N``: :data:`STAND_IN_SMI` as each host's nvidia-smi)
    gpus: int = 0
    #: ``up`` made DIR (it was not there): ``down`` removes it when nothing else is left in it
    made_dir: bool = False
    #: the dir ``up`` ran in, which every host sees live (a bind mount, see :func:`live_dir`)
    live: str | None = None

    # -- files ----------------------------------------------------------------------------
    @property
    def state_file(self) -> Path:
        return self.dir / "lab.json"

    @property
    def inventory(self) -> Path:
        return self.dir / "inventory.yml"

    @property
    def ssh_config(self) -> Path:
        return self.dir / "ssh_config"

    @property
    def shared_dir(self) -> Path:
        """A directory every host sees and writes at the same path (outside all overlays): the
        lab's stand-in for a shared filesystem such as NFS."""
        return Path(self.store) / "shared"

    @property
    def known_hosts(self) -> Path:
        return self.dir / "known_hosts"

    @property
    def key(self) -> Path:
        return self.dir / "id_ed25519"

    def save(self) -> None:
        data = asdict(self)
        data["dir"] = str(self.dir)
        self.state_file.write_text(json.dumps(data, indent=2) + "\n")

    @classmethod
    def load(cls, lab_dir: str | os.PathLike) -> Lab | None:
        path = Path(lab_dir).resolve() / "lab.json"
        if not path.exists():
            return None
        data = json.loads(path.read_text())
        hosts = [LabHost(**h) for h in data.pop("hosts")]
        data["dir"] = Path(data["dir"])
        return cls(hosts=hosts, **data)

    def host(self, name: str) -> LabHost:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(name)

    # -- introspection --------------------------------------------------------------------
    def alive(self) -> dict[str, bool]:
        """Per host: is its sshd answering on port 22?"""
        return {h.name: _port_open(h.address, 22, 0.5) for h in self.hosts}

    def processes(self, name: str, sshd: bool = False) -> list[tuple[int, str]]:
        """Every process in host *name*'s PID namespace except its sshd (with *sshd*: its sshd
        too): (pid, cmdline), the pid as this (the root) namespace numbers it.

        Read from the root namespace's /proc, so it sees what a user on the host would see with
        ``ps``, without adding an SSH session of its own to the picture.
        """
        ns = self.host(name).pid_namespace()
        if ns is None:
            return []
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                if os.readlink(f"/proc/{entry}/ns/pid") != ns:
                    continue
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(
                    "utf-8", "replace").strip()
            except OSError:
                continue
            if not cmd or (not sshd and (cmd.startswith("sshd") or cmd.startswith("/usr/sbin/sshd"))):
                continue
            found.append((int(entry), cmd))
        return found

    def netns_exec(self, name: str, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        """Run *argv* in host *name*'s network namespace only (for firewall and port fixtures)."""
        return subprocess.run(["ip", "netns", "exec", self.host(name).netns, *argv], **kwargs)


# -- helpers ------------------------------------------------------------------------------
def run_command(argv: list[str], check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, **kwargs)
    if check and proc.returncode != 0:
        raise LabError(f"`{' '.join(argv)}` failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def _child_pid(pid: int) -> int | None:
    if not pid:
        return None
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return None
    return int(children[0]) if children else None


def _port_open(addr: str, port: int, timeout: float) -> bool:
    try:
        with socket.create_connection((addr, port), timeout=timeout):
            return True
    except OSError:
        return False


def lab_id(lab_dir: Path) -> str:
    """A short, stable id for a lab dir, used to name its bridge, veths and namespaces."""
    return hashlib.sha1(str(lab_dir).encode()).hexdigest()[:6]


def check_prerequisites() -> None:
    """Fail early, in one line, when this machine cannot host a lab."""
    if os.geteuid() != 0:
        raise LabError("the lab needs root (network and PID namespaces): run it as root, e.g. with sudo")
    missing = [t for t in ("ip", "unshare", "ssh-keygen", "/usr/sbin/sshd") if not shutil.which(t)]
    if missing:
        raise LabError(
            f"the lab needs {', '.join(missing)}: apt-get install -y iproute2 util-linux openssh-server"
        )
    probe = run_command(["unshare", "--net", "--pid", "--fork", "--mount", "--uts", "true"], check=False)
    if probe.returncode != 0:
        raise LabError(f"namespaces are unavailable here ({probe.stderr.strip()}): the lab needs "
                       "unprivileged-free root with CAP_SYS_ADMIN (not a restricted container)")


# -- up ------------------------------------------------------------------------------------
INIT_SCRIPT = """#!/bin/sh
# PID 1 of lab host {name}: private hostname, system dirs, /run and /tmp, then sshd.
set -e
hostname {name}
{live_stage}for d in {overlays}; do
  id=$(echo "$d" | tr / _)
  mount -t overlay "ddpfab-lab$id" -o "lowerdir=$d,upperdir={store}/upper$id,workdir={store}/work$id" "$d"
done
# the host's own, empty /tmp; the controller's dirs it shares are mounted back from a staged view
mount --bind /tmp {store}/controller_tmp
mount -t overlay ddpfab-lab_tmp -o "lowerdir={store}/empty_tmp,upperdir={store}/upper_tmp,workdir={store}/work_tmp" /tmp
{share_mounts}umount -l {store}/controller_tmp
for d in {tmpfs}; do mount -t tmpfs -o mode=1777 "ddpfab-lab-tmp" "$d"; done
chmod 755 /run
mkdir -m755 /run/sshd
# root's shell startup as on a fresh install, not the controller's: bash sources ~/.bashrc for
# every SSH command, and an operator's pyenv/conda init there would cost every command of every host
for f in .bashrc .profile; do
  if [ -f /usr/share/base-files/dot$f ]; then cp /usr/share/base-files/dot$f /root/$f; else rm -f /root/$f; fi
done
# and no caches of the controller's (pip, torch, ddpfab's own): a host starts as a fresh machine
mkdir -p /root/.cache
mount -t tmpfs -o mode=700 ddpfab-lab-cache /root/.cache
mount --bind {labdir}/hosts /etc/hosts
mount --bind {root}/resolv.conf /etc/resolv.conf
{live_mount}exec /usr/sbin/sshd -D -e -f {root}/sshd_config
"""

SSHD_CONFIG = """ListenAddress {address}:22
HostKey {root}/ssh_host_ed25519_key
PidFile /run/sshd.pid
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
UseDNS no
StrictModes no
AuthorizedKeysFile {labdir}/authorized_keys .ssh/authorized_keys
MaxStartups 64:30:128
MaxSessions 64
AcceptEnv LANG LC_*
Subsystem sftp /usr/lib/openssh/sftp-server
"""


#: The nodes' python when the controller's has no torch: where ``ddpfab provision`` (the
#: ddpfab_python role's ddpfab_python_venv default) puts its venv.
PROVISIONED_PYTHON = "/opt/ddpfab/venv/bin/python"


def node_python(asked: str | None = None) -> tuple[str, str]:
    """The python the lab's nodes run (written as ddpfab_python) and why that one.

    Lab nodes see the controller's files, so the controller's python works when it has torch;
    otherwise (ddpfab installed alone, e.g. from a wheel) the venv ``ddpfab provision`` makes.
    """
    if asked:
        return asked, "--python"
    if importlib.util.find_spec("torch") is not None:
        return sys.executable, "this python has torch"
    return PROVISIONED_PYTHON, ("this python has no torch: run `ddpfab provision -i INVENTORY` to make it, "
                                "or pass --python")


def up(lab_dir: str | os.PathLike, hosts: int = 3, subnet: str = DEFAULT_SUBNET,
       python: str | None = None, share: list[str | os.PathLike] | tuple = (), gpus: int = 0) -> tuple[Lab, bool]:
    """Bring up a lab of *hosts* hosts in *lab_dir*; return it and whether it was already up.

    Idempotent: on a running lab it changes nothing. A half-dead lab is an error that asks for
    ``down`` first rather than a guess at repair.

    Args:
        share: controller dirs under /tmp that hosts must see (each host's /tmp is its own). The
            lab dir, the venv of *python* and the current directory are always shared; elsewhere
            hosts see the controller's files anyway (through overlays, or directly).
        gpus: stand-in GPUs per host: each host's nvidia-smi is :data:`STAND_IN_SMI` reporting
            that many (no GPU is there; CUDA is not emulated: jobs run on gloo).
    """
    check_prerequisites()
    lab_dir = Path(lab_dir).resolve()
    existing = Lab.load(lab_dir)
    if existing is not None:
        alive = existing.alive()
        if all(alive.values()):
            return existing, True
        dead = ", ".join(n for n, ok in alive.items() if not ok)
        raise LabError(f"lab in {lab_dir} is partly down ({dead} not answering): "
                       f"run `ddpfab lab down --dir {lab_dir}` first")
    net, lid, bridge = _check_new_lab(lab_dir, hosts, subnet, gpus)
    python = python or sys.executable
    lab = Lab(dir=lab_dir, subnet=str(net), bridge=bridge, gateway=str(net[1]), store=str(STORE_ROOT / lid),
              shares=tmp_shares([lab_dir, Path(python).parent.parent, Path.cwd(), *share]), gpus=gpus,
              live=live_dir(Path.cwd()))
    lab.hosts = [LabHost(name=f"node{i}", address=str(net[HOST_OFFSET + i - 1]),
                         netns=f"ddpfab-{lid}-node{i}", veth=f"dfb{lid}n{i}")
                 for i in range(1, hosts + 1)]
    lab.made_dir = not lab_dir.exists()
    lab_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(lab_dir, 0o755)
    lab.save()  # first, so that `down` can clean up after a failure half-way
    try:
        _fit_neighbour_table(hosts)
        _write_client_files(lab, python)
        _make_network(lab)
        lab.save()
        for h in lab.hosts:
            h.pid = _start_host(lab, h)
        lab.save()
        _wait_sshd(lab, timeout=15)
    except BaseException:
        down(lab_dir)
        raise
    return lab, False


def _check_new_lab(lab_dir: Path, hosts: int, subnet: str,
                   gpus: int) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, str, str]:
    """A new lab's subnet, id and bridge, once its arguments and this machine allow it (LabError else)."""
    if hosts < 1:
        raise LabError(f"--hosts must be at least 1, got {hosts}")
    if gpus < 0:
        raise LabError(f"--gpus must be 0 or more, got {gpus}")
    net = ipaddress.ip_network(subnet, strict=False)
    if net.num_addresses < HOST_OFFSET + hosts + 1:
        raise LabError(f"subnet {subnet} is too small for {hosts} hosts")
    lid = lab_id(lab_dir)
    bridge = f"dfb{lid}"
    if Path(f"/sys/class/net/{bridge}").exists():
        raise LabError(f"bridge {bridge} exists without lab state in {lab_dir}: "
                       f"run `ddpfab lab down --dir {lab_dir}` to clean it up")
    for other in _interfaces_in(net):
        raise LabError(f"subnet {subnet} is already used by interface {other}: pick another --subnet")
    return net, lid, bridge


def tmp_shares(paths: list[str | os.PathLike]) -> list[str]:
    """The dirs among *paths* that lie under /tmp, outermost only, in a stable order.

    Paths elsewhere need no share. A path overlayfs cannot take as a mount option (a comma, a colon
    or a control character in it) is refused rather than mounted wrong."""
    tmp = Path(PRIVATE_TMP)
    found: list[Path] = []
    for raw in paths:
        p = Path(os.path.abspath(raw))
        if p == tmp or not p.is_relative_to(tmp):
            continue
        if any(c in str(p) for c in ",:\\") or any(ord(c) < 32 for c in str(p)):
            raise LabError(f"cannot share {str(p)!r} with lab hosts: overlay mount options cannot hold "
                           "',', ':', '\\' or control characters; move it or rename it")
        found.append(p)
    outer = [p for p in found if not any(q != p and p.is_relative_to(q) for q in found)]
    return sorted({str(p) for p in outer})


def live_dir(cwd: Path) -> str | None:
    """The dir *cwd* if hosts must see it live, else None.

    Hosts see the controller's system dirs and shares through overlays, and an overlay does not
    notice a file replaced by rename in its lower dir (``sed -i``, most editors' save): the host
    keeps the old file, and a run from there fails its tree check or runs old code. So the dir the
    lab is brought up from, the user's project, is bind-mounted into every host as it is, the way
    a shared home on NFS is: edits show at once, and what a job writes there lands here. Not a dir
    the hosts' own setup writes in or mounts over (``/``, an overlaid dir itself, ``/root``, ``/tmp``,
    anything in ``/etc`` or ``/usr``), and not a dir outside every overlay (``/work``: hosts see it
    as it is)."""
    p = Path(os.path.abspath(cwd))
    covered = [Path(d) for d in (*OVERLAY_DIRS, PRIVATE_TMP)]
    if not any(p.is_relative_to(d) for d in covered) or p.parts[1] in ("etc", "usr"):
        return None  # not overlaid, or a system dir the lab writes in (its stand-in GPUs)
    kept = [*covered, Path("/root/.cache"), Path("/root/.bashrc"), Path("/root/.profile"), STORE_ROOT,
            *(Path(d) for d in TMPFS_DIRS)]
    if len(p.parts) < 3 or any(k.is_relative_to(p) for k in kept):
        return None
    if any(c in str(p) for c in "\n\r"):
        return None
    return str(p)


def _live_mounts(lab: Lab, store: Path) -> dict[str, str]:
    """The init's lines for :attr:`Lab.live`: the real dir is staged before the overlays hide it,
    and mounted back over the host's view at the end, after every other mount under it."""
    if not lab.live:
        return {"live_stage": "", "live_mount": ""}
    q = shlex.quote
    stage = f"{store}/live"
    return {"live_stage": f"mkdir -p {q(stage)}\nmount --bind {q(lab.live)} {q(stage)}\n",
            "live_mount": f"mkdir -p {q(lab.live)}\nmount --bind {q(stage)} {q(lab.live)}\numount -l {q(stage)}\n"}


def _share_mounts(lab: Lab, store: Path) -> str:
    """Shell lines of a host's init that mount each share over its own /tmp, privately writable."""
    lines = []
    for i, share in enumerate(lab.shares):
        rel = Path(share).relative_to(PRIVATE_TMP)
        q = shlex.quote
        dirs = f"lowerdir={store}/controller_tmp/{rel},upperdir={store}/upper_share{i},workdir={store}/work_share{i}"
        lines.append(f"mkdir -p {q(share)}\nmount -t overlay ddpfab-lab-share -o {q(dirs)} {q(share)}\n")
    return "".join(lines)


def _fit_neighbour_table(hosts: int) -> None:
    """Raise the kernel's neighbour-table limits so that every host can hold an entry for every
    other, with room for a few labs side by side (4 * hosts^2 entries, a few hundred bytes each:
    ~20 MB of kernel memory at most for 128 hosts, only if used). Only ever raised, never lowered
    (other labs on the machine may rely on the room), and not restored on `down` for that reason."""
    want = {3: 4 * hosts * hosts, 2: 2 * hosts * hosts}
    for i, value in want.items():
        path = Path(NEIGH_SYSCTL.format(i))
        try:
            if int(path.read_text()) < value:
                path.write_text(str(value))
        except (OSError, ValueError) as exc:
            if hosts > 16:
                raise LabError(f"cannot raise {path} to {value} for {hosts} hosts ({exc}); connects "
                               "between lab hosts would fail once the neighbour table is full") from None


def _interfaces_in(net: ipaddress.IPv4Network | ipaddress.IPv6Network) -> list[str]:
    out = run_command(["ip", "-j", "-4", "addr", "show"]).stdout
    found = []
    for iface in json.loads(out or "[]"):
        for a in iface.get("addr_info", []):
            if ipaddress.ip_interface(f"{a['local']}/{a['prefixlen']}").network.overlaps(net):
                found.append(iface["ifname"])
    return found


def _write_client_files(lab: Lab, python: str) -> None:
    d = lab.dir
    if not lab.key.exists():
        run_command(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "ddpfab-lab", "-f", str(lab.key)])
    shutil.copy(f"{lab.key}.pub", d / "authorized_keys")
    hosts_lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
    hosts_lines += [f"{h.address} {h.name}" for h in lab.hosts]
    (d / "hosts").write_text("\n".join(hosts_lines) + "\n")
    known, ssh_cfg = [], []
    for h in lab.hosts:
        root = d / "nodes" / h.name
        root.mkdir(parents=True, exist_ok=True)
        hostkey = root / "ssh_host_ed25519_key"
        if not hostkey.exists():
            run_command(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", h.name, "-f", str(hostkey)])
        lab.shared_dir.mkdir(parents=True, exist_ok=True)
        store = Path(lab.store) / h.name
        for suffix in [od.replace("/", "_") for od in (*OVERLAY_DIRS, PRIVATE_TMP)] + [
                f"_share{i}" for i in range(len(lab.shares))]:
            (store / f"upper{suffix}").mkdir(parents=True, exist_ok=True)
            (store / f"work{suffix}").mkdir(exist_ok=True)
        (store / "controller_tmp").mkdir(exist_ok=True)
        (store / "empty_tmp").mkdir(exist_ok=True)
        os.chmod(store / "empty_tmp", 0o1777)
        # an overlay's root takes its upper dir's mode: /tmp must be 1777 for the hosts' other users too
        os.chmod(store / "upper_tmp", 0o1777)
        if lab.gpus:
            _install_stand_in_gpus(store, lab.gpus)
        (root / "resolv.conf").write_text("")
        (root / "sshd_config").write_text(SSHD_CONFIG.format(address=h.address, root=root, labdir=d))
        (root / "init.sh").write_text(INIT_SCRIPT.format(
            name=h.name, root=root, labdir=d, store=store, overlays=" ".join(OVERLAY_DIRS), tmpfs=" ".join(TMPFS_DIRS),
            share_mounts=_share_mounts(lab, store), **_live_mounts(lab, store)))
        ktype, kdata = Path(f"{hostkey}.pub").read_text().split()[:2]
        known.append(f"{h.address},{h.name} {ktype} {kdata}")
        ssh_cfg.append(
            f"Host {h.name}\n  HostName {h.address}\n  User root\n  IdentityFile {lab.key}\n"
            f"  IdentitiesOnly yes\n  UserKnownHostsFile {lab.known_hosts}\n"
            f"  GlobalKnownHostsFile /dev/null\n  StrictHostKeyChecking yes\n  BatchMode yes\n"
            f"  ConnectTimeout 5\n")
    lab.known_hosts.write_text("\n".join(known) + "\n")
    lab.ssh_config.write_text("\n".join(ssh_cfg))
    lab.inventory.write_text(render_inventory(lab, python))


def _install_stand_in_gpus(store: Path, gpus: int) -> None:
    """The stand-in nvidia-smi in a host's /usr/local/bin and its GPU count in its /etc, written
    into the host's own overlay layers (the controller's /usr and /etc stay untouched)."""
    bin_dir = store / "upper_usr" / "local" / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(STAND_IN_SMI, bin_dir / "nvidia-smi")
    (bin_dir / "nvidia-smi").chmod(0o755)
    conf = store / ("upper" + STAND_IN_CONF.replace("/", "_", 1))  # /etc/X is upper_etc/X
    conf.mkdir(parents=True, exist_ok=True)
    (conf / "gpus").write_text(f"{gpus}\n")


def render_inventory(lab: Lab, python: str, names: list[str] | None = None) -> str:
    """A standard Ansible inventory of the lab's hosts (or of *names*), with working connection vars."""
    import yaml

    common = (f"-o UserKnownHostsFile={lab.known_hosts} -o GlobalKnownHostsFile=/dev/null "
              f"-o StrictHostKeyChecking=yes -o IdentitiesOnly=yes -o ConnectTimeout=5")
    hosts = {h.name: {"ansible_host": h.address} for h in lab.hosts if names is None or h.name in names}
    inv = {"all": {
        "hosts": hosts,
        "vars": {
            "ansible_user": "root",
            "ansible_ssh_private_key_file": str(lab.key),
            "ansible_ssh_common_args": common,
            "ansible_python_interpreter": "/usr/bin/python3",
            # the lab hosts see the controller's files, so its venv (with torch) is the nodes' python
            "ddpfab_python": python,
            "ddpfab_nproc_per_node": 1,
        },
    }}
    header = f"# ddpfab lab inventory ({lab.dir}); written by `ddpfab lab up`\n"
    return header + yaml.safe_dump(inv, sort_keys=False)


def _make_network(lab: Lab) -> None:
    prefix = ipaddress.ip_network(lab.subnet).prefixlen
    run_command(["ip", "link", "add", lab.bridge, "type", "bridge"])
    run_command(["ip", "addr", "add", f"{lab.gateway}/{prefix}", "dev", lab.bridge])
    run_command(["ip", "link", "set", lab.bridge, "up"])
    if shutil.which("iptables") and Path("/proc/sys/net/bridge/bridge-nf-call-iptables").exists():
        # bridged frames cross FORWARD (br_netfilter); a DROP policy there would cut the hosts off
        for flag in ("-i", "-o"):
            run_command(["iptables", "-I", "FORWARD", flag, lab.bridge, "-j", "ACCEPT",
                  "-m", "comment", "--comment", f"ddpfab-lab {lab.bridge}"])
        lab.forward_rules = True
    for h in lab.hosts:
        run_command(["ip", "netns", "add", h.netns])
        run_command(["ip", "link", "add", h.veth, "type", "veth", "peer", "name", "eth0", "netns", h.netns])
        run_command(["ip", "link", "set", h.veth, "master", lab.bridge, "up"])
        nsx = ["ip", "netns", "exec", h.netns]
        run_command([*nsx, "ip", "addr", "add", f"{h.address}/{prefix}", "dev", "eth0"])
        run_command([*nsx, "ip", "link", "set", "eth0", "up"])
        run_command([*nsx, "ip", "link", "set", "lo", "up"])


def _start_host(lab: Lab, h: LabHost) -> int:
    root = lab.dir / "nodes" / h.name
    with open(root / "sshd.log", "ab") as log:
        proc = subprocess.Popen(
            ["ip", "netns", "exec", h.netns, "unshare", "--pid", "--fork", "--mount-proc", "--mount",
             "--uts", "--propagation", "private", "--kill-child=SIGKILL", "--", "/bin/sh", str(root / "init.sh")],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, close_fds=True)
    return proc.pid  # `ip netns exec` execs unshare, so this is unshare's pid


def _wait_sshd(lab: Lab, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = list(lab.hosts)
    while pending:
        pending = [h for h in pending if not _port_open(h.address, 22, 0.2)]
        if not pending:
            return
        if time.monotonic() > deadline:
            h = pending[0]
            log = (lab.dir / "nodes" / h.name / "sshd.log").read_text(errors="replace").strip()
            raise LabError(f"lab host {h.name} ({h.address}): sshd did not answer within {timeout:.0f} s; "
                           f"its log says: {log[-400:] or '(nothing)'}")
        time.sleep(0.05)


# -- down ----------------------------------------------------------------------------------
def down(lab_dir: str | os.PathLike) -> bool:
    """Remove everything the lab in *lab_dir* made; return False if there was no lab there."""
    lab_dir = Path(lab_dir).resolve()
    lab = Lab.load(lab_dir)
    if lab is None:
        return False
    # killing `unshare` SIGKILLs its child (--kill-child), PID 1 of the host, and with it the
    # whole PID namespace: every job left on the host dies with it
    for h in lab.hosts:
        if h.pid and pid_alive(h.pid) and _is_lab_unshare(h.pid, lab_dir):
            os.kill(h.pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    for h in lab.hosts:
        while h.pid and pid_alive(h.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
    for h in lab.hosts:
        run_command(["ip", "netns", "del", h.netns], check=False)
        run_command(["ip", "link", "del", h.veth], check=False)
    run_command(["ip", "link", "del", lab.bridge], check=False)
    if lab.forward_rules or shutil.which("iptables"):
        for flag in ("-i", "-o"):
            while run_command(["iptables", "-D", "FORWARD", flag, lab.bridge, "-j", "ACCEPT", "-m", "comment",
                        "--comment", f"ddpfab-lab {lab.bridge}"], check=False).returncode == 0:
                pass
    netns_dir = Path("/run/netns")
    if netns_dir.is_dir() and not any(netns_dir.iterdir()):
        run_command(["umount", str(netns_dir)], check=False)
        try:
            netns_dir.rmdir()
        except OSError:
            pass
    shutil.rmtree(lab_dir / "nodes", ignore_errors=True)
    if lab.store and not (Path(lab.store) / "live").is_mount():  # the user's live dir: never followed into
        shutil.rmtree(lab.store, ignore_errors=True)
        if STORE_ROOT.is_dir() and not any(STORE_ROOT.iterdir()):
            STORE_ROOT.rmdir()
    for name in ("lab.json", "inventory.yml", "ssh_config", "known_hosts", "hosts", "authorized_keys",
                 "id_ed25519", "id_ed25519.pub"):
        (lab_dir / name).unlink(missing_ok=True)
    if lab.made_dir:
        try:
            lab_dir.rmdir()  # only if empty: what the user put there stays, and the dir with it
        except OSError:
            pass
    return True


def _is_lab_unshare(pid: int, lab_dir: Path) -> bool:
    """Guard against pid reuse: only kill a process that is this lab's `unshare`."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False
    return "unshare" in cmd and str(lab_dir) in cmd


def status(lab_dir: str | os.PathLike) -> str:
    lab = Lab.load(lab_dir)
    if lab is None:
        return f"no lab in {Path(lab_dir).resolve()}"
    alive = lab.alive()
    lines = [f"lab {lab.dir} subnet {lab.subnet} bridge {lab.bridge}"]
    for h in lab.hosts:
        state = "up" if alive[h.name] else "DOWN"
        lines.append(f"  {h.name:<8} {h.address:<15} {state:<5} {len(lab.processes(h.name))} processes besides sshd")
    lines.append(f"inventory: {lab.inventory}")
    return "\n".join(lines)
