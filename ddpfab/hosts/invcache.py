"""A cache of parsed inventories: Ansible's answer, reused while nothing it read has changed.

Every ddpfab command starts by reading the inventory, and importing Ansible to do so costs about
0.3 s, more than connecting to a handful of hosts. The cache keeps the resulting nodes as JSON,
keyed by everything that can change Ansible's answer:

- the inventory file, or every file under an inventory directory, and the ``group_vars/`` and
  ``host_vars/`` next to it (path and content hash);
- the Ansible configuration: every ``ANSIBLE_*`` environment variable and the ansible.cfg files
  Ansible would look at; the versions of ansible-core and ddpfab; the group asked for.

Not cached, always parsed by Ansible: an inventory with Jinja templating anywhere (``{{``/``{%``:
a lookup or an environment variable can change its value with no file changing), an executable
(script) inventory, and an inventory plugin config (``plugin:``). ``DDPFAB_INVENTORY_CACHE=0``
switches the cache off. Entries are private to the user (0600 in a 0700 directory).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import tempfile
from pathlib import Path

from ddpfab.version import __version__

#: Bump when the cached node format changes.
FORMAT = 6
#: Files bigger than this are not read for the templating check (and so never cached).
MAX_SCAN_BYTES = 4 << 20
_DYNAMIC = (b"{{", b"{%", b"plugin:")
_DATA_SUFFIXES = (".yml", ".yaml", ".ini", ".toml", ".json", "")
#: Entries kept; the oldest go first.
MAX_ENTRIES = 64


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ddpfab" / "inventory"


def _inputs(path: Path) -> list[tuple[str, str]] | None:
    """(path, content hash) of every file Ansible reads for *path*, or None when the inventory
    must not be cached. Contents, not mtimes: an edit within one timestamp tick is still seen."""
    files: list[Path] = []
    roots = [path] if path.is_dir() else []
    if path.is_file():
        files.append(path)
    base = path if path.is_dir() else path.parent
    roots += [base / "group_vars", base / "host_vars"]
    for root in roots:
        if root.is_dir():
            for dirpath, dirnames, filenames in os.walk(root):
                dirnames.sort()
                files += [Path(dirpath, f) for f in sorted(filenames)]
        elif root.is_file():
            files.append(root)
    out = []
    for f in files:
        try:
            if f.stat().st_size > MAX_SCAN_BYTES or (os.access(f, os.X_OK) and f.suffix not in _DATA_SUFFIXES):
                return None  # a script inventory: its output may change at any time
            data = f.read_bytes()
        except OSError:
            return None
        if any(mark in data for mark in _DYNAMIC):
            return None
        out.append((str(f.resolve()), hashlib.sha256(data).hexdigest()))
    return out


def ansible_version() -> str:
    """ansible-core's version, read from its release.py: importlib.metadata takes 0.2 s to find it."""
    try:
        spec = importlib.util.find_spec("ansible")
        if spec is None or spec.origin is None:
            return "?"
        found = re.search(r"__version__\s*=\s*['\"]([^'\"]+)", Path(spec.origin).with_name("release.py").read_text())
        return found.group(1) if found else "?"
    except Exception:  # noqa: BLE001 - unknown version: the key still differs from a known one
        return "?"


def key(paths: Path | list[Path], group: str) -> str | None:
    """The cache key for (*paths*, *group*), or None when this inventory is not cacheable.

    *paths*: one inventory, or several (a repeated ``-i``, merged in that order: the order is
    part of the key, as the later source's variables win)."""
    if os.environ.get("DDPFAB_INVENTORY_CACHE", "1") in ("0", "false", "no", "off"):
        return None
    paths = [paths] if isinstance(paths, Path) else list(paths)
    inputs = []
    for path in paths:
        found = _inputs(path)
        if found is None:
            return None
        inputs.append(found)

    h = hashlib.sha256()
    h.update(json.dumps([FORMAT, __version__, ansible_version(), [str(p.resolve()) for p in paths],
                         group]).encode())
    configs: list[list[str | None] | None] = []
    for c in (os.environ.get("ANSIBLE_CONFIG"), "ansible.cfg", "~/.ansible.cfg", "/etc/ansible/ansible.cfg"):
        try:
            configs.append([c, Path(os.path.expanduser(c)).resolve().read_bytes().hex()] if c else None)
        except OSError:
            configs.append([c, None])
    h.update(json.dumps([inputs, configs]).encode())
    h.update(json.dumps(sorted((k, v) for k, v in os.environ.items() if k.startswith("ANSIBLE_"))).encode())
    return h.hexdigest()


def get(k: str | None) -> list[dict] | None:
    if k is None:
        return None
    try:
        data = json.loads((cache_dir() / f"{k}.json").read_text())
    except (OSError, ValueError):
        return None
    nodes = data.get("nodes") if isinstance(data, dict) and data.get("format") == FORMAT else None
    return nodes if isinstance(nodes, list) else None


def put(k: str | None, nodes: list[dict]) -> None:
    """Store *nodes* under *k*; a cache that cannot be written is no error (the next load parses)."""
    if k is None:
        return
    d = cache_dir()
    try:
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-")
        with os.fdopen(fd, "w") as fh:
            json.dump({"format": FORMAT, "nodes": nodes}, fh)
        os.replace(tmp, d / f"{k}.json")
        entries = sorted(d.glob("*.json"), key=lambda e: e.stat().st_mtime)
        for old in entries[:-MAX_ENTRIES]:  # every edit of an inventory makes a new key
            old.unlink(missing_ok=True)
    except OSError:
        pass
