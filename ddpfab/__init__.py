"""ddpfab: start and debug multi-node PyTorch training on bare-metal GPU boxes over plain SSH.

The public surface is small: load a cluster from an Ansible inventory, make a plan, run it
(:mod:`ddpfab.api`)::

    cluster = ddpfab.Cluster.load("lab.yml")
    result = cluster.run("train.py", nproc_per_node=2)

Every ddpfab exception is a :class:`ddpfab.DdpfabError` carrying its problems as data.
``import ddpfab`` stays light (training scripts import :mod:`ddpfab.dist` from it): the API is
imported on first use of one of its names, and it imports Fabric/paramiko only inside its calls.
"""

from ddpfab.version import __version__

#: The public names that live in :mod:`ddpfab.api`, loaded on first use.
_API = ("Cluster", "Diagnosis", "Emitted", "Fetched", "Jobs", "Logs", "Options", "Replayed", "RunOutcome", "Stopped")

__all__ = ["DdpfabError", "__version__", *_API]


def __getattr__(name: str) -> object:
    # on first use, so that `import ddpfab` (a training script's `from ddpfab import dist`) stays light
    if name == "DdpfabError":
        from ddpfab.problems import DdpfabError
        return DdpfabError
    if name in _API:
        from ddpfab import api

        return getattr(api, name)
    raise AttributeError(f"module 'ddpfab' has no attribute {name!r}")
