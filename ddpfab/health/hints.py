"""Known failure signatures in a node's output, and what to tell the user when one shows up.

Each :class:`Signature` is a few fixed patterns of what torch, gloo, NCCL or libstdc++ print (the
texts below are theirs, as torch 2.x prints them), matched line by line as the output streams. A
signature never changes a run's outcome by itself: it names the known cause, with the node it was
seen on, in the run's closing lines and in its manifest, so nobody hunts a bug in their model. (The
one outcome that is decided differently, a rank that aborts at exit after finishing its work, is
decided from the ranks' done records, :mod:`ddpfab.node.exitguard`, never from these lines.)
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ddpfab.optionnames import option


@dataclass(frozen=True)
class Signature:
    """A known cause, recognised in a node's output.

    Args:
        key: its name in manifests (``cuda_oom``).
        what: what was seen, short (``CUDA out of memory``).
        patterns: any one of them in a line is the signature.
        advice: the cause and the fix (:attr:`hint`); a function when it names an option, which is
            spelled when the hint is read (:func:`ddpfab.optionnames.option`).
    """

    key: str
    what: str
    patterns: tuple[re.Pattern, ...]
    advice: str | Callable[[], str]

    @property
    def hint(self) -> str:
        """The cause and the fix, options named as the reader spells them."""
        return self.advice if isinstance(self.advice, str) else self.advice()

    def matches(self, line: str) -> bool:
        return any(p.search(line) for p in self.patterns)


#: What libstdc++ prints when a thread object is destroyed while still joinable; torch's C++
#: threads (gloo's, autograd's) do that when the interpreter tears down around them.
EXIT_ABORT_LINE = "terminate called without an active exception"


def exit_abort_hint() -> str:
    """What a rank's abort at exit is, and what ddpfab does about it (its exit guard named as the
    reader spells options)."""
    return ("a rank aborted (SIGABRT, 'terminate called without an active exception'): if it had finished "
            "its work, this is the known race at interpreter exit (pytorch issue 190489; the atexit fix, PR "
            f"179291, was abandoned), not your training. ddpfab's exit guard ({option('exit_guard', 'on')}, the "
            "default) leaves each rank without that teardown; with ddpfab.dist end the script with ddist.finish()")


def _re(*texts: str) -> tuple[re.Pattern, ...]:
    return tuple(re.compile(t) for t in texts)


SIGNATURES: tuple[Signature, ...] = (
    Signature("exit_abort", "a rank aborted at exit ('terminate called without an active exception')",
              _re(re.escape(EXIT_ABORT_LINE)), exit_abort_hint),
    Signature("gloo_loopback", "gloo bound to the loopback address",
              _re(r"Unable to resolve hostname to a \(local\) address", r"Using the loopback address as fallback"),
              lambda: "gloo could not resolve this node's hostname to an address of its own and bound to 127.0.0.1, "
              f"which no peer can reach (the job then hangs or fails to connect). Fix: {option('socket_ifname', 'auto')} "
              "(or GLOO_SOCKET_IFNAME=IFACE), or make the hostname resolve to the node's data-plane address "
              "in /etc/hosts; `ddpfab check` names the hosts whose name resolves to loopback"),
    Signature("nccl_connect", "an NCCL connection error",
              _re(r"NCCL WARN .*(Connect to \S+ failed|socketStartConnect|socketFinalizeAccept|Call to connect returned)",
                  r"\bncclRemoteError\b", r"remote process exited or there was a network error",
                  r"\bncclSystemError\b.*(socket|connect)"),
              lambda: "NCCL could not connect to a peer, or a peer went away: a firewall on the ports NCCL uses, the "
              f"wrong interface (set {option('socket_ifname')} / NCCL_SOCKET_IFNAME), or a crashed rank on another "
              "node (look for the first failure above). `ddpfab check` tests the data plane between every pair of nodes"),
    Signature("collective_timeout", "a collective timed out",
              _re(r"Watchdog caught collective operation timeout", r"Timed out waiting \d+ms for (recv|send) operation"),
              "a collective did not complete in time: one rank is stuck, slow or gone (the ranks that time out "
              "are the waiting ones, not the culprit), or a path-MTU black hole drops large messages. Look for "
              "the node that stopped printing first; `ddpfab check` tests bulk transfers between nodes"),
    Signature("cuda_oom", "CUDA out of memory",
              _re(r"CUDA out of memory\.", r"\bOutOfMemoryError\b.*CUDA"),
              "a GPU ran out of memory: lower the batch size per GPU, use gradient accumulation or activation "
              "checkpointing, or check for other processes on that GPU (`ddpfab check` lists them)"),
    Signature("dataloader_bus_error", "a DataLoader worker killed by a bus error (shared memory)",
              _re(r"Unexpected bus error encountered in worker", r"DataLoader worker \(pid \d+\) is killed by signal: Bus error",
                  r"dataloader's workers are out of shared memory"),
              "a DataLoader worker ran out of shared memory (/dev/shm is too small on that node: containers "
              "default to 64 MB). Fix: a larger /dev/shm (docker --shm-size, or remount the tmpfs), fewer "
              "num_workers, or smaller batches per worker"),
    # python -m's own words for a module it cannot find (no traceback, so no exception to name)
    Signature("module_not_found", "python -m found no such module",
              _re(r"python[\d.]*: No module named \S+", r"python[\d.]*: Error while finding module specification"),
              "the node's python found no module by that name. With -m: check its name (a dotted module path, "
              "not a file name), that it is in the workdir (the code is synced there) or installed in the node's "
              "python, and that its package has an __init__.py (and a __main__.py to run a package). For "
              "torch.distributed.run itself: that python has no torch (`ddpfab check` names the python it "
              "runs)"),
)


def signature_of(line: str) -> Signature | None:
    """The signature a node's output *line* shows, or None."""
    for sig in SIGNATURES:
        if sig.matches(line):
            return sig
    return None


def seen_on(found: Iterable[tuple[str, Signature]]) -> list[tuple[Signature, list[str]]]:
    """(signature, the nodes it was seen on) for each distinct signature in *found* ((node,
    signature) pairs), in the order first seen."""
    nodes: dict[str, list[str]] = {}
    sigs: dict[str, Signature] = {}
    for node, sig in found:
        sigs.setdefault(sig.key, sig)
        if node not in nodes.setdefault(sig.key, []):
            nodes[sig.key].append(node)
    return [(sigs[k], nodes[k]) for k in sigs]


def verdict_lines(found: Iterable[tuple[str, Signature]]) -> list[str]:
    """``seen on node2: CUDA out of memory. HINT`` for each distinct signature, its nodes named."""
    return [f"seen on {', '.join(nodes)}: {sig.what}. {sig.hint}" for sig, nodes in seen_on(found)]
