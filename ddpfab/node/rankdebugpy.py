"""debugpy in a rank of ``ddpfab run --debugpy``: the rank waits for a DAP client (VS Code)
before its script runs, and ``breakpoint()`` stops in that client. Standard library only (debugpy
is the rank python's, imported at run time): the node supervisor writes this file beside the
ranks' ``sitecustomize`` (:mod:`ddpfab.node.exitguard`), which installs it in the ranks that
:data:`RANKS_VAR` names.

How a client reaches the rank: debugpy listens on the node's loopback, on a port the kernel
picks (two jobs on one node never collide), and the rank prints :data:`LISTENS` on its stderr.
ddpfab sees that line in the rank's output and forwards a port on the controller's loopback to it
over the node's SSH connection (:mod:`ddpfab.launch.dapforward`). A loopback port is reachable by
every user of the node: debug on nodes that are yours.
"""

import os
import sys

#: Which ranks listen: ``all``, or global ranks separated by commas (as ``--pdb``'s).
RANKS_VAR = "DDPFAB_DEBUGPY"
#: The pid of the rank it is installed in: processes it starts (DataLoader workers) stay without.
OWNER_VAR = "DDPFAB_DEBUGPY_PID"
#: The line a listening rank prints; ddpfab matches it (launch/dapforward.py, its LISTENS).
LISTENS = "ddpfab-debugpy: rank %d (local rank %d) waits for a debugger on 127.0.0.1:%d (pid %d)"


def wanted(spec, rank):
    """Whether *spec* (:data:`RANKS_VAR`'s value) names global rank *rank*."""
    return spec == "all" or str(rank) in spec.split(",")


def install(environ=None):
    """Listen and wait for a client if this process is a rank that :data:`RANKS_VAR` names; True
    if it did. Without debugpy in the rank's python the rank runs on, and says why."""
    env = os.environ if environ is None else environ
    spec, rank, local = env.get(RANKS_VAR), env.get("RANK", ""), env.get("LOCAL_RANK", "")
    if not spec or not rank.isdigit() or not local.isdigit() or not wanted(spec, int(rank)) or env.get(OWNER_VAR):
        return False
    env[OWNER_VAR] = str(os.getpid())
    # pydevd's notice about frozen stdlib modules, once per rank, is noise here
    env.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    stream = sys.__stderr__ or sys.stderr
    try:
        import debugpy
    except ImportError:
        stream.write("ddpfab: rank %s runs without debugpy: %s has none (pip install debugpy, or ddpfab's node "
                     "extra)\n" % (rank, sys.executable))
        return False
    _, port = debugpy.listen(("127.0.0.1", 0))
    stream.write(LISTENS % (int(rank), int(local), port, os.getpid()) + "\n")
    stream.flush()
    sys.breakpointhook = debugpy.breakpoint
    debugpy.wait_for_client()
    return True
