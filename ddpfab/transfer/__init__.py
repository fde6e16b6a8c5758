"""Moving files: `ddpfab sync` (code to every node, owning only what it placed) and `ddpfab fetch`."""
