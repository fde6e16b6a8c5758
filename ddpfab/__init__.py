"""ddpfab: start and debug multi-node PyTorch training on bare-metal GPU boxes over plain SSH.

The public surface is small: load a cluster from an Ansible inventory, make a plan, run it
(:mod:`ddpfab.api`)::

    cluster = ddpfab.Cluster.load("lab.yml")
    result = cluster.run("train.py", nproc_per_node=2)

``import ddpfab`` stays light (training scripts import :mod:`ddpfab.dist` from it): the API is
imported on first use of one of its names, and it imports Fabric/paramiko only inside its calls.
"""

from ddpfab.version import __version__

#: The public names that live in :mod:`ddpfab.api`, loaded on first use.
_API = ("Cluster", "Options", "RunOutcome")

__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name in _API:
        from ddpfab import api

        return getattr(api, name)
    raise AttributeError(f"module 'ddpfab' has no attribute {name!r}")
