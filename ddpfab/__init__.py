"""ddpfab: start and debug multi-node PyTorch training on bare-metal GPU boxes over plain SSH.

The public surface is small: load a cluster from an Ansible inventory, make a plan, run it.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
