"""Prints a digest of each of its secrets (never the value): the job sees what setup and env set."""

import hashlib
import os
import time

for key in ("HF_TOKEN", "WANDB_API_KEY"):
    print(f"{key} sha256 {hashlib.sha256(os.environ.get(key, '').encode()).hexdigest()}", flush=True)
time.sleep(float(os.environ.get("SECRET_JOB_SLEEP", "4")))
