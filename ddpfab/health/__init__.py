"""Is the cluster fit to train: `ddpfab check` (facts and the data-plane mesh), `check --perf` (the node
benchmark, its analysis and report) and the known failure signatures in ranks' output."""
