"""Prints READY, then a line every half second for five minutes: a job that keeps writing."""

import os
import time

print("READY", os.environ["RANK"], flush=True)
for step in range(600):
    print("tick", step, flush=True)
    time.sleep(0.5)
