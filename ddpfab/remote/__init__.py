"""Reaching nodes: one connection target per node (ssh_config + inventory + host-key policy), the
SSH runner every command uses, its helper processes' reaper, `ddpfab exec`, and the holder that
keeps the connections open between commands (`ddpfab hold`)."""
