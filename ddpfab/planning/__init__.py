"""Every decision about a run, as data: the probe pass that gathers facts, the pure plan, and its
renderings (the launch command, emitted scripts, Slurm/Kubeflow exports, masked secrets)."""
