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
from pathlib import Path
from typing import Any, NoReturn

INIT_METHOD_VAR = "DDPFAB_INIT_METHOD"
#: Set by ``ddpfab run --max-job-restarts``: how many times the whole job was started again, the
#: first attempt's run id, and every attempt's run id so far (comma-separated, oldest first).
RESTART_VAR, ROOT_VAR, LINEAGE_VAR = "DDPFAB_RESTART_COUNT", "DDPFAB_ROOT_RUN_ID", "DDPFAB_RUN_LINEAGE"
#: Checkpoints written by :func:`save_checkpoint` are named CKPT_PREFIX + step + CKPT_SUFFIX; only
#: files named so are ever found, loaded or pruned (never anything else in the directory).
CKPT_PREFIX, CKPT_SUFFIX = "ddpfab-ckpt-", ".pt"
_CKPT_NAME = re.compile(r"^ddpfab-ckpt-(\d{9})\.pt$")
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


# --- restarts and checkpoints ------------------------------------------------------------------
#
#     state = ddist.resume(ckpt_dir)                 # every rank: None, or (step, state) of the latest
#     start = state[0] + 1 if state else 0
#     for step in range(start, steps):
#         ...
#         ddist.save_checkpoint({"model": model.state_dict(), ...}, ckpt_dir, step)
#
# ``shared=True`` (the default): the directory is on storage every node sees (NFS, ddpfab_shared_dir)
# and global rank 0 writes. ``shared=False``: node-local disks; local rank 0 of every node writes its
# own copy, so a node that is lost takes only its copy with it; :func:`resume` then hands the latest
# copy any rank has to all ranks (a spare that joins has none), with collectives only, no numpy.
# Both work with every init method ddpfab offers (env://, tcp://, file://): they need the default
# process group, nothing else.


def restart_count(environ: Mapping[str, str] | None = None) -> int:
    """How many times ddpfab started the whole job again (0 on the first attempt)."""
    env = os.environ if environ is None else environ
    try:
        return int(env.get(RESTART_VAR, "0") or 0)
    except ValueError:
        raise DistEnvError(f"ddpfab.dist: {RESTART_VAR}={env.get(RESTART_VAR)!r} is not an integer") from None


def run_lineage(environ: Mapping[str, str] | None = None) -> list[str]:
    """The run ids of every attempt of this run, oldest first (just this run's id without restarts)."""
    env = os.environ if environ is None else environ
    lineage = [r for r in (env.get(LINEAGE_VAR) or "").split(",") if r]
    return lineage or ([env["DDPFAB_RUN_ID"]] if env.get("DDPFAB_RUN_ID") else [])


def checkpoint_path(directory: str | os.PathLike, step: int) -> str:
    if step < 0 or step > 999_999_999:
        raise ValueError(f"ddpfab.dist: checkpoint step {step} out of range 0..999999999")
    return os.path.join(os.fspath(directory), f"{CKPT_PREFIX}{step:09d}{CKPT_SUFFIX}")


def checkpoints(directory: str | os.PathLike) -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint in *directory*, oldest first (a save in progress
    has another name until it is complete)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = [(int(m.group(1)), os.path.join(os.fspath(directory), n)) for n in names if (m := _CKPT_NAME.match(n))]
    return sorted(found)


def latest_checkpoint(directory: str | os.PathLike) -> tuple[int, str] | None:
    """(step, path) of the newest checkpoint in *directory* as this process sees it, or None."""
    found = checkpoints(directory)
    return found[-1] if found else None


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0") or 0)


def save_checkpoint(state: Any, directory: str | os.PathLike, step: int, *, shared: bool = True,
                    keep: int | None = 3) -> str | None:
    """Save *state* (anything ``torch.save`` takes) as the checkpoint of *step*; call it on every rank.

    *shared*: global rank 0 writes into a directory every node sees; else local rank 0 of each node
    writes its own copy. The file appears complete or not at all (written under a temporary name,
    fsynced, renamed). Then checkpoints of this helper older than the newest *keep* are deleted
    (None keeps all). Returns the path on the ranks that wrote, else None.
    """
    import torch

    writer = rank() == 0 if shared else _local_rank() == 0
    if not writer:
        return None
    path = checkpoint_path(directory, step)
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    if keep is not None:
        for _, old in checkpoints(directory)[:-keep] if keep > 0 else []:
            try:
                os.unlink(old)
            except FileNotFoundError:  # another writer on a shared dir pruned it first
                pass
    return path


def resume(directory: str | os.PathLike, *, map_location: Any = "cpu", weights_only: bool = True):
    """The latest checkpoint any rank can see, as ``(step, state)`` on every rank, or None.

    Collective when the default process group is initialised: call it on every rank. Every rank
    that sees the newest step loads its own file; when some do not (a node-local directory, and a
    spare that just joined), the lowest rank that has it broadcasts the file's bytes to all.
    Without a process group it just loads what this process sees.
    """
    import io

    import torch
    import torch.distributed as dist

    mine = latest_checkpoint(directory)
    if not (dist.is_available() and dist.is_initialized()):
        return (mine[0], torch.load(mine[1], map_location=map_location, weights_only=weights_only)) if mine else None
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    step = mine[0] if mine else -1
    agree = torch.tensor([step, -step], dtype=torch.int64, device=device)
    dist.all_reduce(agree, op=dist.ReduceOp.MAX)
    newest, oldest = int(agree[0]), -int(agree[1])
    if newest < 0:
        return None
    if oldest == newest:  # every rank sees it: no bytes on the wire
        return newest, torch.load(mine[1], map_location=map_location, weights_only=weights_only)
    me, world = dist.get_rank(), dist.get_world_size()
    owner = torch.tensor([me if step == newest else world], dtype=torch.int64, device=device)
    dist.all_reduce(owner, op=dist.ReduceOp.MIN)
    src = int(owner[0])
    blob = Path(mine[1]).read_bytes() if me == src else b""
    size = torch.tensor([len(blob)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src)
    buf = (torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(device) if me == src
           else torch.empty(int(size[0]), dtype=torch.uint8, device=device))
    dist.broadcast(buf, src=src)
    if me != src:
        import ctypes  # the bytes of a contiguous CPU tensor, without numpy (not in torch's CPU wheel)

        host = buf.cpu().contiguous()
        blob = ctypes.string_at(host.data_ptr(), host.numel())
    data = blob
    return newest, torch.load(io.BytesIO(data), map_location=map_location, weights_only=weights_only)
