"""Known failure signatures in a node's output, and what to tell the user when one shows up.

A hint never changes a run's outcome: a rank that aborted still failed the job. It names the known
cause and the fix, in the run's output and in its manifest, so nobody hunts a bug in their model.
"""

from __future__ import annotations

#: What libstdc++ prints when a thread object is destroyed while still joinable; gloo's worker
#: threads do that when the interpreter tears down around them.
EXIT_ABORT_LINE = "terminate called without an active exception"

EXIT_ABORT_HINT = (
    "a rank aborted (SIGABRT, 'terminate called without an active exception'): if it had finished "
    "its work, this is the known gloo race at interpreter exit (pytorch issue 190489), not your "
    "training. Fix: end the script with ddpfab.dist.finish(); without ddpfab.dist, call "
    "dist.barrier() and dist.destroy_process_group(), flush stdout/stderr, then os._exit(0)")


def hint_for(line: str) -> str | None:
    """The hint a node's output *line* calls for, or None."""
    if EXIT_ABORT_LINE in line:
        return EXIT_ABORT_HINT
    return None
