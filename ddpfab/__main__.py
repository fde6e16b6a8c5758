# the signal handlers first: a Ctrl-C while the rest is still being imported ends cleanly too
from ddpfab.launch.interrupt import run_interruptible


def _main() -> int:
    from ddpfab.cli import unguarded_main
    from ddpfab.cli.errors import closed_stdout_ends_quietly

    return closed_stdout_ends_quietly(unguarded_main)


raise SystemExit(run_interruptible(_main))
