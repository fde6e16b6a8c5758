"""Private keys stay home: the one rule for which files a sync leaves out because they are secrets.

A sync copies the project to every node, so a private key kept beside the code (an ``id_ed25519``,
a ``server.pem``, a lab's host keys, a ``.ssh/`` directory) would be copied to every node too. The
selection (:func:`ddpfab.transfer.sync.select`) leaves such files out by default, whichever way its
file list was made (``git ls-files`` or the directory walk), and says so in one line
(:func:`left_out_line`). ``--include-keys`` sends them all; a ``.ddpfabignore`` negation
(``!lab/id_ed25519``) sends the one it names.

What counts (:func:`withheld`):

- anything under a ``.ssh/`` directory (keys, ``config``, ``known_hosts``, ``authorized_keys``);
- an OpenSSH key file by its name: ``id_rsa``, ``id_ed25519``, ``id_ecdsa_sk``, ``id_rsa_work``...
  (not ``*.pub``; ``id_map.py`` is no key name);
- a regular file whose content starts with a private key's armour (``-----BEGIN OPENSSH PRIVATE
  KEY-----``, ``-----BEGIN RSA PRIVATE KEY-----``, ``-----BEGIN PRIVATE KEY-----``, PuTTY's
  ``PuTTY-User-Key-File-``...), and a ``*.pem`` / ``*.key`` file that holds such a header
  anywhere (a certificate bundle with its key). Only files under :data:`KEY_SIZE_LIMIT` are read,
  and only their first :data:`HEAD_BYTES` (a whole ``.pem``/``.key``), so a big tree stays fast.

Symlinks are not keys: rsync sends a link as a link, never what it points to.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable

from ddpfab.optionnames import option

#: Files this size or larger are never read for a key header (a key is a few KiB at most).
KEY_SIZE_LIMIT = 64 * 1024
#: How much of a file's start is read for a key header (a ``.pem``/``.key`` is read whole).
HEAD_BYTES = 512
#: Where a private key's header is searched anywhere in the file, not only at its start.
KEY_SUFFIXES = (".pem", ".key")
#: A directory whose whole content is left out.
SSH_DIR = ".ssh"

#: A private key's first line: PEM/OpenSSH armour (``-----BEGIN ... PRIVATE KEY-----``, the PGP
#: ``PRIVATE KEY BLOCK`` and the SSH2 ``---- BEGIN ... PRIVATE KEY ----`` too) or a PuTTY key.
KEY_HEADER = re.compile(rb"-{4,5} ?BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)? ?-{4,5}|PuTTY-User-Key-File-\d+:")
#: OpenSSH's default key file names (``ssh-keygen -t TYPE``), with an optional suffix of the user's.
KEY_NAME = re.compile(r"id_(?:rsa|dsa|ecdsa|ed25519|xmss)(?:_sk)?(?:[-_.@].*)?", re.DOTALL)


def key_name(name: str) -> bool:
    """Whether a file called *name* is an OpenSSH private key by its name alone (``id_ed25519``,
    ``id_rsa_work``; never ``id_rsa.pub``)."""
    return bool(KEY_NAME.fullmatch(name)) and not name.endswith(".pub")


def key_content(head: bytes, anywhere: bool = False) -> bool:
    """Whether *head* (a file's first bytes, or its whole content with *anywhere*) is a private
    key's: it starts with a key header (after blanks), or holds one anywhere when *anywhere*."""
    if anywhere:
        return KEY_HEADER.search(head) is not None
    return KEY_HEADER.match(head.lstrip(b"\xef\xbb\xbf \t\r\n")) is not None


def is_private_key(path: str | os.PathLike, st: os.stat_result | None = None) -> bool:
    """Whether the file at *path* is a private key: by its name, else by a bounded read of its
    content (only a regular file under :data:`KEY_SIZE_LIMIT`). *st*: its ``lstat`` when known.
    A file that cannot be read is not taken for a key (rsync then reports it as it would)."""
    name = os.path.basename(os.fspath(path))
    try:
        st = st or os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode):
        return False
    if key_name(name):
        return True
    if st.st_size >= KEY_SIZE_LIMIT or st.st_size < 20:
        return False
    anywhere = name.lower().endswith(KEY_SUFFIXES)
    try:  # os.open: a tree of thousands of small files is read here, the cheapest way there is
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return False
    try:
        head = os.read(fd, KEY_SIZE_LIMIT if anywhere else HEAD_BYTES)
    except OSError:
        return False
    finally:
        os.close(fd)
    return key_content(head, anywhere)


def in_ssh_dir(rel: str) -> bool:
    """Whether the relative path *rel* is inside a ``.ssh/`` directory (at any depth)."""
    return SSH_DIR in rel.split("/")[:-1]


def withheld(root: str, rel: str) -> bool:
    """The rule: whether the selected path *rel* under *root* stays on this machine unless asked
    for (``--include-keys``, or a ``.ddpfabignore`` negation): inside a ``.ssh/`` directory, or a
    private key (:func:`is_private_key`)."""
    return in_ssh_dir(rel) or is_private_key(os.path.join(root, rel))


def left_out_line(paths: list[str], shown: int = 3) -> str:
    """The one line a sync (or its dry run, or ``--list``) says about the *paths* it left out:
    how many, the first *shown* of them, and how to send them."""
    in_ssh = sum(1 for p in paths if in_ssh_dir(p))
    keys = len(paths) - in_ssh
    what = " and ".join([f"{keys} private key{'s' * (keys != 1)}"] * bool(keys)
                        + [f"{in_ssh} file{'s' * (in_ssh != 1)} in .ssh/"] * bool(in_ssh))
    names = ", ".join(paths[:shown]) + (", ..." if len(paths) > shown else "")
    return (f"sync: left out {what} ({names}): they never leave this machine; {option('include_keys', True)} sends them "
            "(a `!PATH` line in .ddpfabignore, the one it names)")


def split(root: str, files: list[str], asked: Callable[[str], bool]) -> tuple[list[str], list[str]]:
    """*files* (relative to *root*) as ``(sent, left_out)``: left out, each path :func:`withheld`
    that *asked* (a ``.ddpfabignore`` negation naming it) does not send on purpose."""
    sent: list[str] = []
    left_out: list[str] = []
    for rel in files:
        (left_out if withheld(root, rel) and not asked(rel) else sent).append(rel)
    return sent, left_out
