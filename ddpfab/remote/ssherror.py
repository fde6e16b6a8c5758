"""The SSH layer's failure: one host, what went wrong there, what to do."""

from __future__ import annotations

from ddpfab.problems import NodeError
from ddpfab.remote.target import Target


class SSHError(NodeError):
    """Connecting to or running on one host failed; the message names the host and what to do."""

    def __init__(self, node: str, message: str, kind: str = "ssh", found: str | None = None):
        super().__init__(node, message, kind, found)


def hop_error(node: str, t: Target, what: str, kind: str = "ssh", at: str | None = "") -> SSHError:
    """An SSHError about hop *t* of *node*'s route: ``host N (AT): WHAT``, or through a jump host
    ``host N: jump host J (AT): WHAT`` (*at*: the address, default the hop's; None: none). Its
    ``found`` leaves out the node (``WHAT``, or ``jump host J (AT): WHAT``)."""
    at = f" ({at or t.where})" if at is not None else ""
    hop = f"jump host {t.name}{at}: " if t.jump_of else ""
    return SSHError(node, f"{t.label}{at}: {what}", kind, found=hop + what)


