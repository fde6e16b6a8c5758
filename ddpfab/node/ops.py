"""The node program's operations beyond the workdir's (the node side of :mod:`ddpfab.node`).

What a node runs is one program: :mod:`ddpfab.node.workdir`, :mod:`ddpfab.node.treehash`,
:mod:`ddpfab.node.loop` (the request loop, the workdir's operations), :mod:`ddpfab.node.leases`,
:mod:`ddpfab.node.resources`, :mod:`ddpfab.node.agent`, :mod:`ddpfab.node.stacks` and this file, in
that order, as one source text (:func:`ddpfab.remote.nodeprogram.program`); on the controller each is an ordinary
module, so every operation is unit-tested as a function. This file adds its operations to the
loop's (the end of the file). Standard library only, Python 3.6+, no ddpfab imports beyond those
modules (which come first in the shipped text).
"""

# _socket, the C module: socket.py brings selectors and enum, a quarter of a facts call's start
# (docs/design.md, "Start-up costs"); select.poll for the same reason
import _socket
import base64
import errno
import fnmatch
import hashlib
import importlib.util
import io
import json
import os
import select
import shutil
import subprocess
import sys
import threading
import time

try:  # as a module of ddpfab; on a node their source comes first in the same program. Relative on
    # purpose: on a node with ddpfab installed, an absolute import would load that (other) version.
    from .agent import (ABSENT, TMUX_PID, detach_stdin, ended_state, read_result, session_processes,
                        signal_tmux_launch, stop_job, tmux_session)
    from .agent import main as supervise_job
    from .leases import LEASE_DIR, LeaseError, lease_state, reserve_port, tickets, uses_leases
    from .loop import OPS, RAW, TAKEOVER, NodeOpError, raw_writer, handle, read_exactly, reply
    from .resources import res_facts
    from .stacks import op_stacks
    from .treehash import node_workdir, rel_ok
    from .workdir import WorkdirError, which
except ImportError:
    supervise_job = main  # type: ignore[name-defined]  # noqa: F821 - agent.py's main, defined earlier in the shipped text

#: The environment from before the node's setup lines (ddpfab.hosts.nodeenv.prefix hands it over as hex
#: of ``env -0``), taken out of the environment at once: nothing this program starts inherits it.
_ENV0 = os.environ.pop("DDPFAB_ENV0", None)
#: The environment this program started with: a run's supervisor that was its preparation first
#: gives the job this, whatever the facts' look at site (its .pth files, sitecustomize) changed.
_ENV_AT_START = dict(os.environ)
#: Variables a shell sets by itself, and those the prefix sets: not the setup's changes.
_SHELL_VARS = ("_", "SHLVL", "PWD", "OLDPWD", "DDPFAB_PYTHON", "DDPFAB_PYTHON_FROM", "DDPFAB_ENV0")


# -- facts: what the plan and the preflight checks need ------------------------------------------
def _port_free(port):
    s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
    s.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
    try:
        s.bind(("", port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def _torch_version(spec):
    """torch's version from torch/version.py's ``__version__ = '...'`` line (importlib.metadata
    takes 20+ ms, and re 1.4 ms)."""
    try:
        with open(os.path.join(list(spec.submodule_search_locations)[0], "version.py")) as fh:
            for line in fh:
                name, eq, value = line.partition("=")
                value = value.strip()
                end = value.find(value[:1], 1) if value[:1] in ("'", '"') else -1
                if eq and name.strip() == "__version__" and end > 1:
                    return value[1:end]
        raise OSError("no __version__ line")
    except OSError:
        try:
            from importlib import metadata
            return metadata.version("torch")
        except Exception:  # noqa: BLE001 - a fact we could not read is None
            return None


def local_addrs():
    """This host's addresses -> interface: IPv4 by SIOCGIFADDR, IPv6 from /proc/net/if_inet6."""
    found = {}
    try:
        import fcntl
        s = _socket.socket(_socket.AF_INET, _socket.SOCK_DGRAM)
        try:
            for _, name in _socket.if_nameindex():
                try:  # SIOCGIFADDR: the interface's primary IPv4 address (a struct ifreq: the name, zeros)
                    r = fcntl.ioctl(s.fileno(), 0x8915, name.encode()[:15].ljust(256, b"\0"))
                    found.setdefault(_socket.inet_ntoa(r[20:24]), name)
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
                found.setdefault(_socket.inet_ntop(_socket.AF_INET6, bytes.fromhex(f[0])), f[-1])
    except (OSError, ValueError, IndexError):
        pass
    return found


def _net_attr(dev, attr):
    """/sys/class/net/DEV/ATTR, stripped; None where it cannot be read."""
    try:
        with open("/sys/class/net/%s/%s" % (dev, attr)) as fh:
            return fh.read().strip()
    except (OSError, ValueError):
        return None


def interfaces(mine=None):
    """Each network interface -> ``{"up": IFF_UP set, "state": its operstate, "addrs": [...]}``
    (what gloo and NCCL look at when a SOCKET_IFNAME names it: both skip an interface that is not
    up or has no address); "up" is None where the flags cannot be read. *mine*: ``local_addrs()``
    when the caller has it. None where the interfaces cannot be listed."""
    try:
        names = [name for _, name in _socket.if_nameindex()]
    except OSError:
        return None
    mine = local_addrs() if mine is None else mine
    out = {}
    for name in names:
        try:
            flags = int(_net_attr(name, "flags") or "", 16)
        except ValueError:
            flags = None
        out[name] = {"up": None if flags is None else bool(flags & 0x1), "state": _net_attr(name, "operstate"),
                     "addrs": [a for a, dev in mine.items() if dev == name]}
    return out


def route_dev(addr, mine):
    """The interface towards *addr*: the kernel's choice of source address (a UDP connect sends
    nothing) mapped to the interface that holds it; ``ip route get`` only for what that cannot map."""
    try:
        fam = _socket.AF_INET6 if ":" in addr else _socket.AF_INET
        s = _socket.socket(fam, _socket.SOCK_DGRAM)
        try:
            s.connect((addr, 9))
            src = s.getsockname()[0]
        finally:
            s.close()
        if src == addr:
            return "lo"
        if src in mine:
            return mine[src]
    except (OSError, TypeError, ValueError):  # (ValueError, TypeError: no address at all, e.g. a NUL byte)
        pass
    try:
        words = subprocess.run(["ip", "-o", "route", "get", addr], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, universal_newlines=True, timeout=5).stdout.split()
        return words[words.index("dev") + 1] if "dev" in words else None
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def _mtu(dev):
    """Interface *dev*'s MTU, None where it cannot be read."""
    try:
        with open("/sys/class/net/%s/mtu" % dev) as fh:
            return int(fh.read())
    except (OSError, ValueError):
        return None


def env_changes(before_hex, after):
    """What the setup lines changed: ``{"set": {KEY: VALUE}, "unset": [KEY]}`` from the hex of
    ``env -0`` before them and the environment *after*; None when *before_hex* is not that."""
    try:
        raw = bytes.fromhex(before_hex)
    except (TypeError, ValueError):
        return None
    before = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.decode("utf-8", "replace").partition("=")
        if sep:
            before[key] = value
    ignored = _SHELL_VARS + (("LC_CTYPE",) if _coerced_locale(before, after) else ())
    return {"set": {k: v for k, v in sorted(after.items()) if before.get(k) != v and k not in ignored},
            "unset": sorted(k for k in before if k not in after and k not in ignored)}


def _coerced_locale(before, after):
    """Whether *after*'s LC_CTYPE is this interpreter's own (PEP 538: Python 3.7+ sets it to a
    UTF-8 locale at start when the locale is C or POSIX), not the setup's: none was set before,
    LC_ALL neither, LANG C, POSIX or unset. (A setup that exported the very same value where the
    locale was C changes nothing for python either: each rank's interpreter does the same.)"""
    if "LC_CTYPE" in before or before.get("LC_ALL") or before.get("LANG", "C") not in ("C", "POSIX", ""):
        return False
    return after.get("LC_CTYPE") in ("C.UTF-8", "C.utf8", "UTF-8")


def _find_port(req, session):
    """A free port in ``find_port`` = [lo, hi, start], looked for from start; on a node that leases
    (:func:`ddpfab.node.leases.uses_leases`) also one no other run has reserved, reserved here for
    run ``reserve_for`` (the session keeps the reservation's descriptor while it lives)."""
    lo, hi, start = req["find_port"]
    span = hi - lo + 1
    reserve = req.get("reserve_for") if isinstance(req.get("reserve_for"), str) and uses_leases() else None
    for i in range(span):
        port = lo + (start - lo + i) % span
        if not _port_free(port):
            continue
        if reserve:
            fds = reserve_port(port, reserve)
            if fds is None:
                continue  # another job's, probed at the same time or waiting for its start
            session.setdefault("port_leases", []).extend(fds)
        return port
    return None


#: [True] once site has run in this program (see _with_site); the loader's prelude runs it for a
#: legacy virtualenv (ddpfab.node._FIRST_USE sets _LEGACY_SITE; absent where this is a module)
_SITE_RUN = [True] if globals().get("_LEGACY_SITE") else []


def _with_site():
    """The node python's installed packages on sys.path, as a plain start has them: the program
    runs without site (``python -S``, :func:`ddpfab.remote.nodeprogram.argv`) until an operation needs them."""
    if sys.flags.no_site and not _SITE_RUN:
        _SITE_RUN.append(True)
        import site
        site.main()


def _site_packages():
    """The site-packages directories a plain start of this python puts on its path, for the
    python itself or its venv; None where the user's own come first (they exist, no venv) or this
    site cannot say (a legacy virtualenv's own site.py): then only site can tell."""
    import site
    exe_dir = os.path.dirname(os.path.abspath(sys.executable))
    if any(os.path.isfile(os.path.join(d, "pyvenv.cfg")) for d in (exe_dir, os.path.dirname(exe_dir))):
        # a venv, as site sets it up (without site, sys.prefix is the base python's); built here:
        # Debian's getsitepackages() leaves a venv's own out while sys.prefix is the base's
        version = "python%d.%d" % sys.version_info[:2]
        return [os.path.join(os.path.dirname(exe_dir), lib, version, "site-packages")
                for lib in sorted({"lib", getattr(sys, "platlibdir", "lib")})]
    user = getattr(site, "getusersitepackages", None)
    if user is None or not hasattr(site, "getsitepackages") or os.path.isdir(user()):
        return None
    return site.getsitepackages()


def _torch_spec():
    """Where torch would be imported from, or None. First looked for in the site-packages
    directories alone (:func:`_site_packages`), which costs a fraction of running site, whose
    ``.pth`` hooks are most of this program's start on a venv with editable installs. Where torch
    is not there (a ``.pth`` that adds it, a venv that sees the system's packages, the user's own
    site), site runs and the search is a plain start's."""
    if sys.flags.no_site and not _SITE_RUN:
        from importlib.machinery import PathFinder
        dirs = _site_packages()
        spec = PathFinder.find_spec("torch", sys.path + dirs) if dirs is not None else None
        if spec is not None:
            return spec
        _with_site()
    return importlib.util.find_spec("torch")


#: The most packages a node reports (a python with more is no training venv; the list stays small).
MAX_PACKAGES = 3000


def _package_dirs():
    """The directories this python's plain start imports installed packages from: the
    site-packages of :func:`_site_packages`, and where site has run (it decides, or torch is
    found only through it: a ``.pth``, the system's packages) every dir on sys.path too."""
    dirs = _site_packages()
    if dirs is None:
        _with_site()
    if _SITE_RUN:  # every dir site put on sys.path (a .pth names any dir), not the cwd's ''
        dirs = (dirs or []) + [p for p in sys.path if p and p not in (dirs or []) and os.path.isdir(p)]
    return dirs


def installed_packages():
    """``{name: version}`` of the distributions in :func:`_package_dirs`, by their metadata dirs
    (``NAME-VERSION.dist-info``, ``NAME-VERSION[-pyX.Y].egg-info``), names as pip compares them
    (lower case, ``-`` for runs of ``-_.``). A listing, no metadata read: importlib.metadata
    reads every package's METADATA file (tens of ms on a full venv). The first directory wins
    for a name, as the first on sys.path is what an import finds."""
    found = {}
    for d in _package_dirs():
        try:
            names = sorted(os.listdir(d))
        except OSError:
            continue
        for entry in names:
            stem, dot, kind = entry.rpartition(".")
            if not dot or kind not in ("dist-info", "egg-info"):
                continue
            parts = stem.split("-")
            name = "-".join(w for w in parts[0].lower().replace("_", "-").replace(".", "-").split("-") if w)
            if name and name not in found and len(found) < MAX_PACKAGES:
                found[name] = parts[1] if len(parts) > 1 else None
    return found


def _address_of(name):
    """*name*'s IPv4 address as this node resolves it (``gethostbyname``). An ASCII name goes as
    bytes, which skips the IDNA codec (with re, 2.2 ms of a facts); any other as text, encoded so.
    What is no host name at all (a NUL byte, a label IDNA refuses) is an OSError like a name that
    does not resolve: one fact about that name, not the end of the facts."""
    try:
        name = name.encode("ascii")
    except UnicodeError:
        pass
    try:
        return _socket.gethostbyname(name)
    except (TypeError, ValueError) as exc:
        raise OSError("not a host name (%s)" % exc) from None


def op_facts(req, session):
    """Hostname, python, torch, workdir and script, a free port (or whether the user's is free),
    name resolution, the interface towards each peer, GPUs; with ``full`` torch is imported."""
    spec = _torch_spec()
    out = {"hostname": _socket.gethostname(), "python": sys.version.split()[0], "executable": sys.executable,
           "home": os.path.expanduser("~"), "torch": spec is not None,
           "cpus": os.cpu_count(),  # what torchrun's --nproc-per-node cpu counts
           "python_from": os.environ.get("DDPFAB_PYTHON_FROM")}
    if _ENV0 is not None:
        out["env_changes"] = env_changes(_ENV0, os.environ)
    if req.get("port"):
        out["port_free"] = _port_free(req["port"])
    if req.get("find_port"):
        out["free_port"] = _find_port(req, session)
        session["free_port"] = out["free_port"]
    wd = os.path.expanduser(req["workdir"])
    out["workdir_exists"] = os.path.isdir(wd)
    if req.get("run_dir") and os.path.lexists(os.path.expanduser(req["run_dir"])):
        out["run_dir_used"] = os.path.expanduser(req["run_dir"])
    if req.get("script"):
        out["script_exists"] = os.path.isfile(os.path.join(wd, os.path.expanduser(req["script"])))
    out["time"] = time.time()
    try:
        out["hostname_addr"] = _address_of(out["hostname"])
    except OSError as exc:
        out["hostname_addr"], out["hostname_error"] = None, str(exc)
    out["launcher"] = bool(spec and spec.submodule_search_locations and any(
        os.path.exists(os.path.join(d, "distributed", "run.py")) for d in spec.submodule_search_locations))
    out["torch_version"] = _torch_version(spec) if spec and spec.submodule_search_locations else None
    out["resolved"] = {}
    for name in req.get("resolve", []):
        try:
            out["resolved"][name] = _address_of(name)
        except OSError as exc:
            out["resolved"][name] = "error: %s" % exc
    _facts_routes(req, out)
    if which("nvidia-smi"):
        _facts_driver(out)
    if req.get("leases"):
        out["leases"] = _leases_or_error()
    if req.get("resources"):
        out["resources"] = res_facts(req, out)
    if req.get("packages"):
        out["packages"] = installed_packages()
        if len(out["packages"]) >= MAX_PACKAGES:  # cut short: the controller compares no such list
            out["packages_capped"] = True
    if req.get("full") and out["torch"]:
        _facts_torch(out)
    return out


def _facts_routes(req, out):
    """Into the facts *out*: the interface towards each of the request's peers, their MTUs, and
    the host's interfaces when asked: what the network checks compare across nodes (``routes``
    is there always, empty without peers)."""
    out["routes"] = {}
    mine = local_addrs() if req.get("peers") or req.get("interfaces") else {}
    if req.get("interfaces"):
        out["interfaces"] = interfaces(mine)
    if req.get("peers"):
        for peer, addr in req["peers"].items():
            out["routes"][peer] = route_dev(addr, mine)
        # what a path-MTU or an advertised-address problem is reported with
        out["mtus"] = {dev: _mtu(dev) for dev in set(out["routes"].values()) if dev}
        if out.get("hostname_addr"):
            out["hostname_iface"] = mine.get(out["hostname_addr"])
            if out["hostname_iface"]:
                out["mtus"][out["hostname_iface"]] = _mtu(out["hostname_iface"])


def _facts_driver(out):
    """Into the facts *out*: the GPUs and the driver version as nvidia-smi lists them, known
    without importing torch; a nvidia-smi that fails is a fact too, not the end of the facts."""
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True, timeout=20)
        lines = [ln.strip() for ln in q.stdout.splitlines() if ln.strip()]
        out["nvidia_gpus"], out["driver"] = len(lines), (lines[0] if lines else None)
    except (OSError, subprocess.SubprocessError) as exc:
        out["nvidia_error"] = str(exc)


def _facts_torch(out):
    """Into the facts *out*: torch's own view (version, CUDA, GPUs, NCCL), which only importing
    it gives, hence only for a ``full`` facts; a torch that fails to import is reported."""
    _with_site()  # torch's own imports may need what site adds
    try:
        import torch
        out["torch_version"] = torch.__version__
        out["cuda"] = torch.version.cuda
        out["cuda_available"] = torch.cuda.is_available()
        out["gpus"] = torch.cuda.device_count() if out["cuda_available"] else 0
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if out["cuda_available"] else None
    except Exception as exc:  # noqa: BLE001 - a broken torch is a fact to report
        out["torch_import_error"] = repr(exc)[-300:]


# -- the data-plane probe (ddpfab.health.mesh plans it and reads the results) ----------------------------
class Listeners(object):
    """Listening sockets and the one thread that accepts on all of them; a connection is closed
    when the peer has closed it, so the TIME_WAIT stays on the client's ephemeral port, not on
    ours (a TIME_WAIT on the master port would make it look busy to a bind without SO_REUSEADDR)."""

    def __init__(self):
        self.poll = select.poll()
        self.socks = {}  # fd -> [socket, "listen" or the bytes received on it]
        self.lock = threading.Lock()
        self.thread = None
        self.closed = False

    def _watch(self, s, what):
        with self.lock:
            self.socks[s.fileno()] = [s, what]
            self.poll.register(s.fileno(), select.POLLIN)
        if self.closed:  # accepted as close() ran, after its look at the sockets (it sets closed first)
            s.close()

    def _unwatch(self, fd):
        with self.lock:
            self.poll.unregister(fd)
            return self.socks.pop(fd)

    def add(self, port):
        s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
        s.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
            s.listen(4096)
        except OSError:
            s.close()
            raise
        s.setblocking(False)
        self._watch(s, "listen")
        return s.getsockname()[1]

    def start(self):
        if self.thread is None:
            self.thread = threading.Thread(target=self._serve, daemon=True)
            self.thread.start()

    def close(self):
        """Stop listening now: the thread ends at its next look. Not under the lock, which the
        thread holds while it waits (up to 200 ms); a shutdown ends a listener at once, where a
        close waits for that wait to let go of the socket."""
        self.closed = True
        for s, _ in list(self.socks.values()):
            try:
                s.shutdown(_socket.SHUT_RDWR)
            except OSError:
                pass  # (a connection the peer closed)
            s.close()

    def _serve(self):
        while not self.closed:
            with self.lock:
                events = self.poll.poll(200)
            for fd, _ in events:
                try:
                    self._event(fd)
                except (KeyError, OSError):  # its socket was closed meanwhile (close())
                    continue

    def _event(self, fd):
        s, what = self.socks[fd]
        if what == "listen":
            try:
                c = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM, 0, s._accept()[0])
            except OSError:
                return
            c.setblocking(False)
            self._watch(c, 0)
            return
        # a connect probe closes without sending; a bulk probe sends its bytes, half-closes
        # and waits for the count and as many bytes back (:func:`_bulk_answer`)
        try:
            data = s.recv(1 << 16)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            self.socks[fd][1] += len(data)
            return
        _, count = self._unwatch(fd)
        if count:
            threading.Thread(target=_bulk_answer, args=(s, count), daemon=True).start()
        else:
            s.close()


def _bulk_answer(s, count, timeout=10.0):
    """Answer a bulk probe: the count of bytes that arrived, then as many bytes back (so both
    directions of both ports carry full-size segments); closed after the peer closes, so the
    TIME_WAIT is the peer's. Its own thread: the answer may wait on a path that loses it."""
    try:
        s.setblocking(True)
        s.settimeout(timeout)
        s.sendall(("%d\n" % count).encode() + b"\0" * min(count, BULK_ANSWER_MAX))
        s.shutdown(_socket.SHUT_WR)
        while s.recv(1 << 16):
            pass
    except OSError:
        pass
    finally:
        s.close()


def op_mesh_listen(req, session):
    """Listen on an ephemeral port and (on the master) on the master port; ``master_port``
    ``"found"`` is the port this session's ``facts`` found free. Listening lasts until stdin EOF."""
    lis = session.setdefault("listeners", Listeners())
    # port 0: the kernel draws it from ip_local_port_range, where gloo's and NCCL's listeners live
    ports = {"ephemeral": lis.add(0), "ephemeral_range": _ephemeral_range()}
    want = session.get("free_port") if req.get("master_port") == "found" else req.get("master_port")
    if want:
        try:
            ports["master"] = lis.add(int(want))
        except OSError as exc:
            ports["master_error"] = str(exc)
    lis.start()
    return ports


def _ephemeral_range():
    """This node's ip_local_port_range as [lo, hi], None where it cannot be read."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            lo, hi = (int(x) for x in fh.read().split())
        return [lo, hi]
    except (OSError, ValueError):
        return None


#: The most bytes a bulk probe's listener sends back.
BULK_ANSWER_MAX = 1 << 20


def _bulk(s, size, timeout):
    """Send *size* bytes on connected socket *s* and read the listener's count of what arrived
    and as many bytes back: "ok", or "stalled" when that does not complete within *timeout*
    seconds (the connect passed, so small packets pass; full-size segments are lost both ways
    or one way: a path-MTU black hole)."""
    end = time.monotonic() + timeout
    chunk = b"\0" * (1 << 16)
    sent = 0
    try:
        while sent < size:
            left = end - time.monotonic()
            if left <= 0:
                return "stalled", sent
            s.settimeout(left)
            sent += s.send(chunk[:min(len(chunk), size - sent)])
        s.shutdown(_socket.SHUT_WR)
        got = b""
        want = len(b"%d\n" % size) + min(size, BULK_ANSWER_MAX)
        while len(got) < want:
            left = end - time.monotonic()
            if left <= 0:
                return "stalled", sent
            s.settimeout(left)
            more = s.recv(1 << 16)
            if not more:
                break
            got += more
        line, _, back = got.partition(b"\n")
        return ("ok" if line == str(size).encode() and len(back) == min(size, BULK_ANSWER_MAX) else "short"), sent
    except _socket.timeout:
        return "stalled", sent
    except OSError as exc:
        return (exc.strerror or str(exc)), sent


#: Connect errors that are not an answer from the target's side, so the next attempt may succeed:
#: EHOSTUNREACH is what the kernel says when nobody answered its ARP requests for 3 s (on the same
#: L2 segment, right after a link came back or under load), as well as a router's ICMP.
_RETRIED_ERRNOS = (errno.EHOSTUNREACH,)


def _connect_one(target, attempts, deadline):
    """Connect to one target; a timed-out or host-unreachable connect is retried with the next
    timeout, a refused one (or any other error) is an answer and ends the attempts. A target
    with ``bytes`` then gets that many bytes sent within ``timeout`` seconds (:func:`_bulk`)."""
    tries, t0, result = [], time.monotonic(), "not probed (deadline)"
    for timeout in attempts:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
        s.settimeout(min(timeout, left))
        a0, retry = time.monotonic(), False
        try:
            s.connect((target["addr"], target["port"]))
            result = "ok"
            if target.get("bytes"):
                result, sent = _bulk(s, int(target["bytes"]), float(target.get("timeout", 5.0)))
                tries.append(round((time.monotonic() - a0) * 1000, 1))
                return dict(target, result=result, sent=sent, attempts=len(tries),
                            ms=round((time.monotonic() - t0) * 1000, 1))
        except _socket.timeout:
            result, retry = "timed out", True
        except ConnectionRefusedError:
            result = "refused"
        except OSError as exc:
            result, retry = exc.strerror or str(exc), exc.errno in _RETRIED_ERRNOS
        finally:
            s.close()
        tries.append(round((time.monotonic() - a0) * 1000, 1))
        if not retry:
            break
    return dict(target, result=result, attempts=len(tries), ms=round((time.monotonic() - t0) * 1000, 1))


def op_mesh_connect(req, session):
    """Connect to every target (``addr``, ``port``) with at most ``concurrency`` connects in flight,
    until ``deadline`` seconds from now; one result per target, in order."""
    targets, attempts = req["targets"], req["attempts"]
    deadline = time.monotonic() + req["deadline"]
    results = [None] * len(targets)
    todo, taking = iter(range(len(targets))), threading.Lock()

    def worker():
        while True:
            with taking:
                i = next(todo, None)
            if i is None:
                return
            results[i] = _connect_one(targets[i], attempts, deadline)

    threads = [threading.Thread(target=worker) for _ in range(min(int(req["concurrency"]), len(targets)))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return {"probes": results}


# -- job control (ddpfab ps / stop / attach / logs) -----------------------------------------------
def _runs_root(req):
    return os.path.expanduser(req.get("root") or "~/.ddpfab/runs")


def _cmdline_has(pid, word):
    try:
        with open("/proc/%d/cmdline" % int(pid), "rb") as fh:
            return word.encode() in fh.read().split(b"\0")
    except (OSError, TypeError, ValueError):
        return False


def _tmux_record(d, rid):
    """Run *rid*'s record on this node when a ``run --tmux`` window launched it: running while a
    process of its session carries the run, else ended (its exit code, when its controller
    recorded it here at the end)."""
    sid = tmux_session(d)
    try:
        started = os.stat(os.path.join(d, TMUX_PID)).st_mtime
    except OSError:
        return None
    if sid is None:
        return None
    running = bool(session_processes(sid, rid))
    code = None
    if not running:
        try:
            with open(os.path.join(d, "exit_code")) as fh:
                code = int(fh.read().strip())
        except (OSError, ValueError):
            code = None
    rec = {"run_id": rid, "state": "running" if running else "exited", "exit_code": code,
           "started": started, "agent_pid": sid, "dir": d, "tmux": True}
    try:  # what ended it from outside the run (ddpfab stop), as stop_job wrote it
        with open(os.path.join(d, "stopped")) as fh:
            rec["stopped"] = fh.read(200).strip()
        if not running:
            rec["state"] = "stopped"
    except OSError:
        pass
    return rec


def op_ps(req, session):
    """The run records under the runs dir (``root``), each with its state: running (its
    supervisor lives), exited, stopped or cancelled (with its exit code, and for the last two
    what stopped it: :func:`ended_state`) or dead; a ``run --tmux`` launch too (``tmux``: no
    supervisor, no exit code here); only ``run_id`` when given."""
    root, only, runs = _runs_root(req), req.get("run_id"), []
    for rid in (sorted(os.listdir(root)) if os.path.isdir(root) else []):
        if only and rid != only:
            continue
        d = os.path.join(root, rid)
        try:
            with open(os.path.join(d, "agent.json")) as fh:
                rec = json.load(fh)
            pid = int(rec["agent_pid"])
        except (OSError, ValueError, KeyError, TypeError):
            tmux = _tmux_record(d, rid)
            if tmux:
                runs.append(tmux)
            continue
        state, code, why = "dead", None, None
        try:
            with open(os.path.join(d, "exit_code")) as fh:
                text = fh.read().strip()
            code = int(text) if text.lstrip("-").isdigit() else -1
            result = read_result(d)
            state = ended_state(result)
            if state != "exited":  # what stopped it, in the supervisor's words
                why = str(result.get("stopped"))[:200]
        except OSError:
            if _cmdline_has(pid, rid):
                state = "running"
        runs.append({"run_id": rid, "state": state, "exit_code": code, "started": rec.get("started"),
                     "agent_pid": pid, "dir": d})
        if why:
            runs[-1]["stopped"] = why
    out = {"runs": runs, "now": time.time()}
    if req.get("leases"):
        out["leases"] = _leases_or_error()
    return out


def _leases_or_error():
    """Every GPU's lease state (:func:`ddpfab.node.leases.lease_state`), or ``{"error": why}``."""
    try:
        return {"gpus": lease_state()}
    except (LeaseError, OSError, subprocess.SubprocessError) as exc:
        return {"error": str(exc)}


def op_leases(req, session):
    """This node's GPU leases: each GPU free, leased (by whom) or busy without a lease."""
    out = dict(_leases_or_error(), now=time.time())
    out["queue"] = tickets() if os.path.isdir(LEASE_DIR) else []
    return out


def op_stop(req, session):
    """End run ``dir``'s job: its supervisor, then what is left by the job marker."""
    why = req.get("why")
    said, code = stop_job(req["dir"], float(req.get("grace", 3)), why if isinstance(why, str) else None)
    return {"said": said, "stopped": code == 0, "known": said != ABSENT}


def op_signal_tmux(req, session):
    """Send ``signal`` (``TERM``, ``KILL``, ...) to what is left of run ``run_id``'s ``run --tmux``
    launch in ``dir``: how many processes got it."""
    return {"signalled": signal_tmux_launch(req["dir"], req["run_id"], req["signal"])}


def op_rank_logs(req, session):
    """torchrun's per-rank log dir (``<dir>/torchrun``) as a base64 tar.gz."""
    d = os.path.join(os.path.expanduser(req["dir"]), "torchrun")
    if not os.path.isdir(d):
        raise NodeOpError("no per-rank logs in %s" % d)
    import tarfile  # here: one op needs it, every start of the node program would pay for it

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.add(d, arcname=".")
    return {"tar_gz": base64.b64encode(buf.getvalue()).decode()}


#: How long ``follow`` waits for a run dir that is not there yet (a supervisor still starting).
FOLLOW_WAIT_S = 30


def follow(req):
    """Stream run ``dir``'s output.log from the start to stdout, raw, until the job has ended;
    exit with its exit code (255: unknown). Ends when stdin does (ddpfab attach went away)."""
    def link():
        while os.read(0, 4096):
            pass
        os._exit(0)

    threading.Thread(target=link, daemon=True).start()
    d = os.path.expanduser(req["dir"])
    log, done = os.path.join(d, "output.log"), os.path.join(d, "exit_code")
    # a supervisor just started makes its run dir after its python starts (an attempt of a run with
    # restarts is followed as soon as its manifest exists): a dir still missing after that is no run
    wait = req.get("wait_s", FOLLOW_WAIT_S)
    give_up = time.monotonic() + (wait if isinstance(wait, (int, float)) and not isinstance(wait, bool) else 0)
    while not os.path.exists(log):
        if os.path.exists(done):
            break
        if not os.path.isdir(d) and time.monotonic() > give_up:  # never started here, or pruned
            sys.stderr.write("ddpfab: no record of this run here (%s): it never started on this node, or its "
                             "record was removed\n" % d)
            return 255
        time.sleep(0.1)
    pos, out = 0, sys.stdout.buffer
    while True:
        finished = os.path.exists(done)
        try:
            with open(log, "rb") as fh:
                fh.seek(pos)
                chunk = fh.read()
        except OSError:
            chunk = b""
        if chunk:
            pos += len(chunk)
            out.write(chunk)
            out.flush()
        elif finished:
            break
        else:
            time.sleep(0.1)
    try:
        with open(done) as fh:
            return int(fh.read().strip() or 255)
    except (OSError, ValueError):
        return 255


def supervise(req):
    """Become the job's supervisor (:mod:`ddpfab.node.agent`); ``spec`` is the job as data. With
    ``adopted`` in it, this program was the run's preparation first (its facts, hash and mesh
    probe: ``ddpfab.launch.runner``): its stderr joins its stdout, as a session started for the
    supervisor has them, and the job gets the environment the program started with (not what
    site's hooks in the facts may have changed), less the python its prefix chose for the probe,
    which a session started with that python decided does not have."""
    spec = req["spec"]
    if spec.get("detached"):
        detach_stdin()
    if spec.get("adopted"):
        os.dup2(1, 2)
        os.environ.clear()
        os.environ.update({k: v for k, v in _ENV_AT_START.items() if k not in ("DDPFAB_PYTHON", "DDPFAB_PYTHON_FROM")})
    return supervise_job(spec)


# -- the perf check's files (ddpfab.launch.perfcheck) ------------------------------------------------------
def op_perf_place(req, session):
    """Make the fresh run dir ``dir`` (relative to home; refused if it exists) and write ``files``
    (name -> text) into it; the dirs it made, for :func:`op_perf_clean`."""
    home = os.path.expanduser("~")
    made, path = [], home
    for part in req["dir"].split("/"):
        path = os.path.join(path, part)
        if not os.path.isdir(path):
            os.mkdir(path, 0o700)
            made.append(path)
    if path not in made:
        raise NodeOpError("run dir %s exists already; refusing to use it" % path)
    for name, text in req["files"].items():
        fd = os.open(os.path.join(path, os.path.basename(name)), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
    return {"made": made}


def op_perf_clean(req, session):
    """Remove the run dir the perf check made (it must hold ``marker``, the shipped script: proof it
    is ours), then the parents it made, if empty (what a user put there stays)."""
    home = os.path.expanduser("~")
    run_dir = os.path.join(home, req["dir"])
    if os.path.realpath(run_dir) != os.path.join(os.path.realpath(home), req["dir"]) or not os.path.isfile(
            os.path.join(run_dir, os.path.basename(req["marker"]))):
        raise NodeOpError("%s is not the perf check's run dir; left alone" % run_dir)
    shutil.rmtree(run_dir)
    for d in reversed(req["made"]):
        if d != run_dir:
            try:
                os.rmdir(d)
            except OSError:
                pass
    return {"removed": run_dir}


# -- replicate: a file of the workdir, from rank 0's node to the others (ddpfab.launch.replicate) ---------
#: Top-level names in a workdir that look like a file a script resumes from (the preflight's
#: candidates when they differ between nodes; fnmatch, case-insensitive).
RESUME_PATTERNS = ("*snapshot*.pt", "*checkpoint*", "*.ckpt")
REPLICA_CHUNK = 1 << 20


def replica_path(req):
    """``(real workdir, real path)`` of the request's ``path``: relative, without ``..``, not into
    ddpfab's state, and inside the workdir as this node resolves it (a symlinked parent that leads
    out of it is refused; the last component itself is not followed)."""
    rel = req["path"]
    if not rel_ok(rel) or any(ord(c) < 32 or ord(c) == 127 for c in rel):
        raise NodeOpError("the path %r is refused: write it relative to the workdir, without '..', control "
                          "characters or ddpfab's own .ddpfab/" % (rel,))
    _, real_wd = node_workdir(req)
    parent = os.path.realpath(os.path.join(real_wd, os.path.dirname(rel)))
    if parent != real_wd and not parent.startswith(real_wd.rstrip("/") + "/"):
        raise NodeOpError("%s leads out of the workdir %s (through a symlink to %s)" % (rel, real_wd, parent))
    return real_wd, os.path.join(parent, os.path.basename(rel))


def _sha256_fd(fd):
    h = hashlib.sha256()
    while True:
        block = os.read(fd, REPLICA_CHUNK)
        if not block:
            return h.hexdigest()
        h.update(block)


def _replica_file(req, path, digest):
    """What is at workdir path *path* here: kind missing, file (with bytes and, with *digest*,
    sha256), link, dir or other; a refused path as ``error``."""
    try:
        _, real = replica_path(dict(req, path=path))
        st = os.lstat(real)
    except FileNotFoundError:
        return {"kind": "missing"}
    except (NodeOpError, WorkdirError, OSError) as exc:
        return {"kind": "error", "error": str(exc)}
    if not stat_is_reg(st.st_mode):
        return {"kind": "link" if os.path.islink(real) else "dir" if os.path.isdir(real) else "other"}
    out = {"kind": "file", "bytes": st.st_size, "mtime": st.st_mtime}
    if digest:
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            out["sha256"] = _sha256_fd(fd)
        finally:
            os.close(fd)
    return out


def stat_is_reg(mode):
    return (mode & 0o170000) == 0o100000


def op_replica_stat(req, session):
    """Per path of ``paths`` (with ``hash``: and its sha256) what this node's workdir holds; with
    ``scan``, also the top-level regular files named like a resume file (:data:`RESUME_PATTERNS`),
    without a hash (a preflight must stay cheap). A workdir not there yet holds nothing."""
    _, real_wd = node_workdir(req)
    files = {p: _replica_file(req, p, req.get("hash", False)) for p in req.get("paths", [])}
    found = {}
    if req.get("scan") and os.path.isdir(real_wd):
        for name in sorted(os.listdir(real_wd)):
            if name not in files and any(fnmatch.fnmatch(name.lower(), pat) for pat in RESUME_PATTERNS):
                info = _replica_file(req, name, False)
                if info["kind"] == "file":
                    found[name] = info
    return {"files": files, "scan": found}


def replica_send(req, write_raw):
    """``replica_send`` (takes the session over): one reply line with the file's ``bytes``, then
    exactly those bytes of it. A regular file inside the workdir only (never through a symlink)."""
    try:
        _, real = replica_path(req)
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW)
    except (NodeOpError, WorkdirError, OSError) as exc:
        write_raw(reply(req.get("id"), "replica_send", error=str(exc)).encode())
        return 1
    try:
        st = os.fstat(fd)
        if not stat_is_reg(st.st_mode):
            write_raw(reply(req.get("id"), "replica_send", error="%s is not a regular file" % req["path"]).encode())
            return 1
        write_raw(reply(req.get("id"), "replica_send", {"bytes": st.st_size}).encode())
        left = st.st_size
        while left > 0:  # the size announced is the size sent: a file growing meanwhile is cut there
            block = os.read(fd, min(REPLICA_CHUNK, left))
            if not block:
                break  # shrank meanwhile: the receivers' hash check refuses it
            write_raw(block)
            left -= len(block)
        return 0
    finally:
        os.close(fd)


def replica_receive(req, fd):
    """``replica_receive``: read exactly ``bytes`` bytes from *fd* (they follow the request) into a
    new file beside ``path``, check its sha256 against ``sha256``, then rename it onto ``path``:
    only that path is replaced (a symlink there is replaced, not followed), and a copy that fails
    its check leaves the old file as it was. Its result: the sha256 it found."""
    size, want = int(req["bytes"]), req["sha256"]
    tmp = None
    try:
        _, real = replica_path(req)
        if os.path.isdir(real) and not os.path.islink(real):
            raise NodeOpError("%s is a directory here; replicate replaces only a file" % real)
        parent = os.path.dirname(real)
        if not os.path.isdir(parent):
            os.makedirs(parent)
        tmp = os.path.join(parent, ".%s.ddpfab-%d" % (os.path.basename(real), os.getpid()))
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    except Exception:
        tmp = None
        raise
    finally:
        if tmp is None:
            read_exactly(fd, size)  # drain what was sent for it: the stream ends cleanly
    h, left = hashlib.sha256(), size
    try:
        with os.fdopen(out, "wb") as fh:
            while left > 0:
                block = os.read(fd, min(REPLICA_CHUNK, left))
                if not block:
                    raise NodeOpError("the copy ended after %d of %d bytes" % (size - left, size))
                h.update(block)
                fh.write(block)
                left -= len(block)
            fh.flush()
            os.fsync(fh.fileno())
        got = h.hexdigest()
        if got != want:
            raise NodeOpError("the copy's sha256 is %s, rank 0's node sent %s (did the file change while it was "
                              "copied?); the old file is left as it was" % (got[:12], want[:12]))
        os.replace(tmp, real)
        tmp = None
        return {"sha256": got, "bytes": size}
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


# -- what this part adds to the loop's operations (ddpfab.node.loop) -----------------------------
def _serve_replica_send(req, session, fd, write):
    return replica_send(req, raw_writer())


def _serve_replica_receive(req, session, fd, write):
    text = handle(req, session, lambda r, _s: replica_receive(r, fd))
    write(text)
    return 0 if json.loads(text)["ok"] else 1


OPS.update({
    "facts": op_facts, "mesh_listen": op_mesh_listen, "mesh_connect": op_mesh_connect,
    "ps": op_ps, "stop": op_stop, "signal_tmux": op_signal_tmux, "leases": op_leases, "rank_logs": op_rank_logs,
    "stacks": op_stacks,
    "perf_place": op_perf_place, "perf_clean": op_perf_clean, "replica_stat": op_replica_stat,
})
TAKEOVER.update({"supervise": supervise, "follow": follow})
RAW.update({"replica_send": _serve_replica_send, "replica_receive": _serve_replica_receive})
