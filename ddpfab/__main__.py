import signal
import sys


def _before_start(signum, frame):
    # a Ctrl-C while ddpfab itself is still being imported (seconds on a loaded machine): nothing has
    # started yet, so one line and the exit code of the signal, not a KeyboardInterrupt traceback
    if sys.stderr is not None:  # None where the shell closed it (2>&-): the exit code still says it
        sys.stderr.write(f"ddpfab: interrupted by {signal.Signals(signum).name} before it started; nothing was started\n")
    raise SystemExit(128 + signum)


for _signum in (signal.SIGINT, signal.SIGTERM):
    signal.signal(_signum, _before_start)

# the signal handlers first: a Ctrl-C while the rest is still being imported ends cleanly too
from ddpfab.launch.interrupt import run_interruptible  # noqa: E402


def _main() -> int:
    from ddpfab.cli import unguarded_main
    from ddpfab.cli.errors import closed_stdout_ends_quietly

    return closed_stdout_ends_quietly(unguarded_main)


raise SystemExit(run_interruptible(_main))
