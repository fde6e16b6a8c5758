"""What the nodes are: the Ansible inventory (and its cache), the node's python and environment
(decided once), did-you-mean for names, and `ddpfab provision` (Ansible makes hosts ready)."""
