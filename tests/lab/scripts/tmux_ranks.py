"""A rank that says where it runs, then waits (the `run --tmux` tests end it with Ctrl-C); with
BREAK_RANK set, that rank stops at a breakpoint() instead and every rank ends when it goes on."""

import os
import socket
import time

rank = int(os.environ["RANK"])
print(f"rank {rank} on {socket.gethostname()} ready", flush=True)
if "BREAK_RANK" not in os.environ:
    time.sleep(300)
elif rank == int(os.environ["BREAK_RANK"]):
    breakpoint()
    print(f"rank {rank} went on", flush=True)
