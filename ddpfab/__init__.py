"""ddpfab: start and debug multi-node PyTorch training on bare-metal GPU boxes over plain SSH.

The public surface is small: load a cluster from an Ansible inventory, make a plan, run it.
Every ddpfab exception is a :class:`ddpfab.DdpfabError` carrying its problems as data.
"""

__version__ = "0.1.0"

__all__ = ["DdpfabError", "__version__"]


def __getattr__(name: str) -> object:
    # on first use, so that `import ddpfab` (a training script's `from ddpfab import dist`) stays light
    if name == "DdpfabError":
        from ddpfab.problems import DdpfabError
        return DdpfabError
    raise AttributeError(f"module 'ddpfab' has no attribute {name!r}")
