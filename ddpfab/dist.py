"""Helpers for training scripts started by ddpfab (or torchrun): read the distributed environment,
pick backend and device, initialise, and a few small collectives.

    from ddpfab import dist as ddist

    env = ddist.init()                 # validates the env, picks nccl/gloo and the device, inits
    ddist.print0(f"world size {env.world_size} on {env.backend}")
    hosts = ddist.all_gather_object(socket.gethostname())
    ...
    ddist.finish()                     # the script's last line: see finish() for why

This file depends on the standard library and torch only (torch is imported when first needed, so
:func:`read_env` works anywhere) and imports nothing else from ddpfab, so a node can get it in any
of three ways:

- the node has ddpfab installed in the python that runs the job (``pip install ddpfab[node]``):
  ``from ddpfab import dist``;
- the node has the repository checkout at the same path as the controller (what ``ddpfab sync`` and
  a shared filesystem give): put the checkout on ``sys.path`` first, as ``examples/train_dist.py``
  does (``ddpfab/__init__.py`` imports nothing heavy);
- copy this one file next to your script and ``import dist``.

The init method: ``env://`` unless the launcher says otherwise in ``DDPFAB_INIT_METHOD``
(``ddpfab run --init-method tcp|file``): ``tcp://MASTER_ADDR:PORT`` or ``file:///shared/dir/F``.
For tcp:// and file:// the rank and world size are passed explicitly, from RANK and WORLD_SIZE.
"""

from __future__ import annotations

import atexit
import os
import re
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, NoReturn

INIT_METHOD_VAR = "DDPFAB_INIT_METHOD"
#: What every init method needs from the launcher.
REQUIRED = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
#: What env:// needs on top.
REQUIRED_ENV_INIT = ("MASTER_ADDR", "MASTER_PORT")
#: Seconds the process group waits for peers and collectives (torch's default is 30 minutes).
DEFAULT_TIMEOUT_S = float(os.environ.get("DDPFAB_PG_TIMEOUT", "600"))
_LOCAL_RANK_ARG = re.compile(r"^--local[-_]rank(?:=(.*))?$")


class DistEnvError(RuntimeError):
    """The distributed environment is missing or inconsistent; the message lists what and why."""


@dataclass(frozen=True)
class DistEnv:
    """What this process learnt from its launcher, and (after :func:`init`) how it initialised.

    Args:
        rank, world_size, local_rank: this process among all and on its node.
        local_world_size: processes on this node (LOCAL_WORLD_SIZE), None if not set.
        node_rank: the node's rank (GROUP_RANK, set by torchrun), None if not set.
        master_addr, master_port: the rendezvous address (env:// only; None if not set).
        init_method: the URL handed to ``init_process_group``.
        restart: torchrun's restart count of the worker group (TORCHELASTIC_RESTART_COUNT).
        backend, device: filled in by :func:`init`.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int | None = None
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    init_method: str = "env://"
    restart: int = 0
    backend: str | None = None
    device: Any = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def local_rank_from_argv(argv: Sequence[str]) -> int | None:
    """``--local-rank=N`` / ``--local_rank N``: what ``torch.distributed.launch`` (without
    ``--use-env``) passes to each worker."""
    for i, word in enumerate(argv):
        m = _LOCAL_RANK_ARG.match(word)
        if m:
            value = m.group(1) if m.group(1) is not None else (argv[i + 1] if i + 1 < len(argv) else "")
            try:
                return int(value)
            except ValueError:
                raise DistEnvError(f"ddpfab.dist: {word} {value!r}: the local rank must be an integer") from None
    return None


def _int(environ: Mapping[str, str], key: str, problems: list[str], minimum: int = 0) -> int | None:
    raw = environ.get(key)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        problems.append(f"{key}={raw!r} is not an integer")
        return None
    if value < minimum:
        problems.append(f"{key}={value} must be >= {minimum}")
    return value


def read_env(environ: Mapping[str, str] | None = None, argv: Sequence[str] | None = None) -> DistEnv:
    """The distributed environment of this process, validated.

    Raises :class:`DistEnvError` naming every missing or bad variable at once, and how to get
    them (start the script through a launcher).
    """
    env = os.environ if environ is None else environ
    argv = sys.argv[1:] if argv is None else argv
    init_method = env.get(INIT_METHOD_VAR) or "env://"
    scheme = init_method.split("://", 1)[0] if "://" in init_method else ""
    if scheme not in ("env", "tcp", "file"):
        raise DistEnvError(f"ddpfab.dist: {INIT_METHOD_VAR}={init_method!r}: expected env://, tcp://HOST:PORT "
                           "or file:///path")
    needed = REQUIRED + (REQUIRED_ENV_INIT if scheme == "env" else ())
    arg_local_rank = local_rank_from_argv(argv)
    missing = [k for k in needed if not env.get(k) and not (k == "LOCAL_RANK" and arg_local_rank is not None)]
    if missing:
        raise DistEnvError(
            f"ddpfab.dist: cannot initialise torch.distributed: missing environment variable"
            f"{'s' if len(missing) > 1 else ''} {', '.join(missing)} (init method {init_method}). The launcher "
            "sets them: start this script with `ddpfab run` or torchrun (python -m torch.distributed.run), "
            "not plain python; for a manual run export " + ", ".join(needed) + " yourself.")
    problems: list[str] = []
    rank = _int(env, "RANK", problems)
    world = _int(env, "WORLD_SIZE", problems, minimum=1)
    local_rank = _int(env, "LOCAL_RANK", problems)
    if local_rank is None:
        local_rank = arg_local_rank
    elif arg_local_rank is not None and arg_local_rank != local_rank:
        problems.append(f"--local-rank={arg_local_rank} disagrees with LOCAL_RANK={local_rank}")
    port = _int(env, "MASTER_PORT", problems, minimum=1)
    if port is not None and port > 65535:
        problems.append(f"MASTER_PORT={port} is not a TCP port (1-65535)")
    if rank is not None and world is not None and rank >= world:
        problems.append(f"RANK={rank} must be < WORLD_SIZE={world}")
    local_world = _int(env, "LOCAL_WORLD_SIZE", problems, minimum=1)
    if local_world is not None and local_rank is not None and local_rank >= local_world:
        problems.append(f"LOCAL_RANK={local_rank} must be < LOCAL_WORLD_SIZE={local_world}")
    node_rank = _int(env, "GROUP_RANK", problems)
    restart = _int(env, "TORCHELASTIC_RESTART_COUNT", problems) or 0
    if scheme == "tcp" and not re.match(r"^tcp://(\[[0-9a-fA-F:.]+\]|[^:/\[\]]+):\d+/?$", init_method):
        problems.append(f"{INIT_METHOD_VAR}={init_method!r} must be tcp://HOST:PORT")
    if scheme == "file" and not init_method.startswith("file:///"):
        problems.append(f"{INIT_METHOD_VAR}={init_method!r} must name an absolute path (file:///dir/file)")
    if problems:
        raise DistEnvError("ddpfab.dist: bad distributed environment: " + "; ".join(problems))
    return DistEnv(rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world,
                   node_rank=node_rank, master_addr=env.get("MASTER_ADDR") or None, master_port=port,
                   init_method=init_method, restart=restart)


def pick_backend(cuda_available: bool | None = None) -> str:
    """nccl when this process can use CUDA, else gloo."""
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    return "nccl" if cuda_available else "gloo"


def pick_device(local_rank: int, cuda_available: bool | None = None, device_count: int | None = None):
    """``cuda:<local_rank>`` when CUDA is usable, else the CPU; a local rank with no GPU of its own
    is an error (more processes than GPUs on this node), not a silent oversubscription."""
    import torch

    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    if not cuda_available:
        return torch.device("cpu")
    if device_count is None:
        device_count = torch.cuda.device_count()
    if local_rank >= device_count:
        raise DistEnvError(f"ddpfab.dist: LOCAL_RANK={local_rank} but this node has {device_count} visible GPU"
                           f"{'s' if device_count != 1 else ''} (CUDA_VISIBLE_DEVICES="
                           f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); lower --nproc-per-node or "
                           "ddpfab_nproc_per_node to the GPU count")
    return torch.device("cuda", local_rank)


def init_url(env: DistEnv) -> str:
    """The URL for ``init_process_group``. A file:// store file is used once: after a torchrun
    restart (TORCHELASTIC_RESTART_COUNT > 0) each attempt gets its own file."""
    if env.init_method.startswith("file://") and env.restart:
        return f"{env.init_method}.restart{env.restart}"
    return env.init_method


def init(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
         environ: Mapping[str, str] | None = None, argv: Sequence[str] | None = None) -> DistEnv:
    """Validate the environment, choose backend and device, set the device, init the default group.

    Returns the :class:`DistEnv` with ``backend`` and ``device`` filled in.
    """
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    env = read_env(environ, argv)
    cuda = torch.cuda.is_available()
    backend = backend or pick_backend(cuda)
    device = pick_device(env.local_rank, cuda_available=cuda)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if backend == "gloo" and dist.get_debug_level() == dist.DebugLevel.DETAIL:
        # torch 2.13 crashes (SIGSEGV) in the DDP constructor on gloo under DETAIL: its logger casts
        # DETAIL's wrapper process group to ProcessGroupGloo. INFO still logs DDP's setup.
        dist.set_debug_level(dist.DebugLevel.INFO)
        sys.stderr.write("ddpfab.dist: TORCH_DISTRIBUTED_DEBUG=DETAIL lowered to INFO on gloo (DETAIL crashes "
                         "DistributedDataParallel on gloo in this torch)\n")
    url = init_url(env)
    kwargs: dict[str, Any] = {}
    if not url.startswith("env://"):
        kwargs = {"rank": env.rank, "world_size": env.world_size}
    dist.init_process_group(backend=backend, init_method=url, timeout=timedelta(seconds=timeout_s), **kwargs)
    return replace(env, backend=backend, device=device)


def _require_numpy() -> None:
    try:
        import numpy  # noqa: F401
    except ImportError:
        raise RuntimeError("ddpfab.dist: object collectives (all_gather_object, broadcast_object) need numpy "
                           "in the node's python, and torch's CPU wheel does not install it: "
                           "pip install numpy (or ddpfab[node])") from None


def all_gather(tensor) -> list:
    """Every rank's copy of *tensor* (same shape and dtype on all ranks), in rank order."""
    import torch
    import torch.distributed as dist

    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(out, tensor.contiguous())
    return out


def all_gather_object(obj: Any) -> list:
    """Every rank's picklable *obj*, in rank order."""
    import torch.distributed as dist

    _require_numpy()
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """*obj* from rank *src* on every rank."""
    import torch.distributed as dist

    _require_numpy()
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def rank() -> int:
    """This process's global rank: from the process group once initialised, else RANK (0 if unset)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:
        pass
    return int(os.environ.get("RANK", "0") or 0)


def print0(*args: Any, **kwargs: Any) -> None:
    """``print`` on rank 0 only (flushed, so it streams through the launcher at once)."""
    if rank() == 0:
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


def cleanup() -> None:
    """Destroy the default process group if there is one (safe to call twice).

    At the very end of a script prefer :func:`finish`, which also leaves the process without the
    interpreter teardown that gloo can abort.

    A barrier first: a rank that tears gloo down while a peer's last collective is still in
    flight can abort the peer ("terminate called without an active exception", seen here with
    torch 2.13 + gloo), failing a run that had finished its work."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


def finish(exit_code: int = 0) -> NoReturn:
    """End the script: :func:`cleanup`, then leave the process the way ``sys.exit`` would, but
    without the interpreter's final teardown. Call it as the script's last statement.

    Why: after training has finished and the process group is destroyed, gloo's worker threads can
    still be alive when the interpreter tears itself down; freeing what they hold then aborts the
    process (SIGABRT, "terminate called without an active exception": pytorch issue 190489, and
    PR 179291, abandoned). A rank that did all its work then fails the job. Everything a normal exit
    does first still happens here: non-daemon threads are joined, ``atexit`` handlers run (logging,
    wandb and the like flush there), stdout and stderr are flushed; then ``os._exit`` skips the
    teardown where the abort happens.

    Args:
        exit_code: the process's exit status.
    """
    cleanup()
    current = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not current and not thread.daemon and thread is not threading.main_thread():
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken: nothing left to save
            pass
    os._exit(exit_code)
