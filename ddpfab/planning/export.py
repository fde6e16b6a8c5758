"""Export a plan to a scheduler: a Slurm sbatch script, a Kubeflow PyTorchJob, a Kubeflow TrainJob.

The same :class:`~ddpfab.planning.plan.Plan` that ``ddpfab run`` executes over SSH is turned into what a
scheduler starts, so the job a user debugged on a few boxes is the job the cluster runs: the same
torchrun flags, script, arguments (byte for byte) and environment. Only what the scheduler decides
changes hands:

- **topology numbers come from the plan** (nodes, processes per node, restarts, port),
- **identity comes from the scheduler** (which node is rank 0 and where the master is): on Slurm
  ``$SLURM_NODEID`` and the first node of the allocation, on Kubernetes the operator's
  ``RANK``/``MASTER_ADDR``/``MASTER_PORT`` (PyTorchJob) or ``PET_*`` (TrainJob) variables.

Every function here is pure: a plan in, text or a dict out. The CLI (``register``) loads the
inventory and makes the plan with offline facts: no host is contacted.

Quoting: the sbatch script passes every user value through ``shlex.quote`` as separate words of
one ``srun`` command line (no value is ever spliced into a string that is parsed twice). Kubernetes
expands ``$(VAR)`` in a container's command, args and env values, so every ``$`` of a user value
is written as ``$$`` (Kubernetes' escape), and only ddpfab's own references stay unescaped.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
from dataclasses import dataclass
from typing import Any

from ddpfab.hosts import inventory, nodeenv
from ddpfab.optionnames import option
from ddpfab.planning import render
from ddpfab.planning.plan import Facts, make_plan, placeholders_in
from ddpfab.planning.plan import master_port as decide_port
from ddpfab.problems import DdpfabError

#: Script-argument placeholders whose value differs from node to node (a scheduler's job cannot hold them).
PER_NODE_PLACEHOLDERS = ("node_rank", "node_name")
#: Kubeflow Trainer's runtime for torchrun jobs (installed with the Trainer's default runtimes).
DEFAULT_TRAINJOB_RUNTIME = "torch-distributed"
#: The PyTorchJob operator takes MASTER_PORT from the container port with this name.
PYTORCHJOB_CONTAINER = "pytorch"
PYTORCHJOB_PORT_NAME = "pytorchjob-port"
#: Environment the Kubernetes operators set themselves; the plan must not set them too.
PYTORCHJOB_RESERVED_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
TRAINJOB_RESERVED_ENV = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
#: A value that may stand in an ``#SBATCH`` line (sbatch splits those lines itself, not a shell).
_DIRECTIVE_VALUE = re.compile(r"^[A-Za-z0-9_.:,+=%@/\-\[\]]+$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
#: Longest job name: the operators append ``-worker-<index>`` / ``-node-0-<index>`` to it.
MAX_K8S_NAME = 48


class ExportError(DdpfabError):
    """The plan cannot be exported as asked; the message says what to change."""

    check = "export"


@dataclass(frozen=True)
class Launch:
    """The part of a plan that is one command for every node, as a scheduler needs it.

    Args:
        command: node 0's launch in its parts (:func:`ddpfab.planning.render.command`); the exporter
            leaves its rendezvous flags out and puts the scheduler's in.
        nnodes: number of nodes.
        nproc: processes per node (the same on every node).
        workdir: the working dir the script runs in.
        env: the environment of every rank.
        master_port: the plan's MASTER_PORT.
        prefix: the shell every node runs first (:func:`ddpfab.hosts.nodeenv.prefix`: its setup lines,
            and the choice of its python when the plan leaves that to the node).
    """

    command: render.Command
    nnodes: int
    nproc: int
    workdir: str
    env: tuple[tuple[str, str], ...]
    master_port: int
    prefix: str = ""


def launch_of(plan) -> Launch:
    """Check that every node of *plan* runs the same command (but for its rendezvous values) and
    return it.

    A scheduler starts one command on nodes it picks itself, so per-host differences of the
    inventory (another python, another nproc, another workdir, a per-node ``{{placeholder}}`` in
    the script's arguments) cannot be carried over: they are an error that names what to set, not
    a silent choice.
    """
    if not plan.nodes:
        raise ExportError("the plan has no nodes")
    if plan.rdzv != "static":
        raise ExportError(f"{option('rdzv')} {plan.rdzv!r}: a scheduler's job is exported with static rendezvous "
                          "(the scheduler gives each node its rank and the master)")
    first, first_cmd = plan.nodes[0], render.command(plan, plan.nodes[0])
    for node in plan.nodes[1:]:
        for what, mine, theirs, fix in (
                ("python", first.python, node.python, "ddpfab_python"),
                ("setup", first.setup, node.setup, "ddpfab_setup and ddpfab_conda_env"),
                ("nproc", first.nproc, node.nproc, f"{option('nproc_per_node')} or ddpfab_nproc_per_node"),
                ("workdir", first.workdir, node.workdir, "ddpfab_workdir"),
                ("env", first.env, node.env, option("env"))):
            if mine != theirs and what == "env":  # name the keys only: values may be secrets
                keys = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
                raise ExportError(f"a scheduler starts one command on every node, but {node.name} has other "
                                  f"environment than {first.name} ({', '.join(keys)}): set {fix} for all")
            if mine != theirs:
                raise ExportError(
                    f"a scheduler starts one command on every node, but {node.name} has another {what} than "
                    f"{first.name} ({theirs!r} vs {mine!r}): set {fix} to one value for the whole group")
        if render.command(plan, node).script != first_cmd.script:
            names = ", ".join(f"{{{{{n}}}}}" for n in placeholders_in(plan.args) if n in PER_NODE_PLACEHOLDERS)
            raise ExportError(f"the script's arguments differ per node ({names}): a scheduler starts one command "
                              "on every node; read the node's rank from the environment in the script instead")
    bad = [k for k in first.env if not _ENV_NAME.match(k)]
    if bad:
        raise ExportError(f"environment variable name(s) {', '.join(map(repr, bad))} cannot be exported: "
                          "use letters, digits and '_'")
    return Launch(command=first_cmd, nnodes=plan.nnodes, nproc=first.nproc, workdir=first.workdir,
                  env=tuple(first.env.items()), master_port=plan.master_port, prefix=nodeenv.prefix(first))


# -- Slurm ----------------------------------------------------------------------------------------
def _directive(name: str, value: Any) -> str:
    text = str(value)
    if not _DIRECTIVE_VALUE.match(text):
        raise ExportError(f"--{name} {text!r}: an #SBATCH value may only hold letters, digits and _.:,+=%@/-[]")
    return f"#SBATCH --{name}={text}"


def slurm_job_name(run_id: str) -> str:
    name = re.sub(r"[^A-Za-z0-9_.\-]", "-", f"ddpfab-{run_id}")
    return name[:64]


def to_sbatch(plan, *, job_name: str | None = None, gpus_per_node: int = 0, cpus_per_task: int | None = None,
              partition: str | None = None, time_limit: str | None = None, account: str | None = None,
              output: str | None = None, sbatch_args: tuple[str, ...] = ()) -> str:
    """An sbatch script that runs *plan* on a Slurm allocation of ``plan.nnodes`` nodes.

    One task per node (``srun --ntasks-per-node=1``) starts torchrun with the plan's flags, script,
    arguments and environment; the node rank is ``$SLURM_NODEID`` and the master is the first node of
    the allocation (where the batch script itself runs), at the plan's master port.

    Args:
        plan: the plan ``ddpfab run`` would execute.
        job_name: ``--job-name`` (default ``ddpfab-<run id>``).
        gpus_per_node: ``--gpus-per-node`` when > 0.
        cpus_per_task: ``--cpus-per-task`` (the CPUs torchrun and all its ranks on a node share).
        partition, time_limit, account: the usual sbatch options, when given.
        output: ``--output`` (default: Slurm's ``slurm-%j.out`` in the submit dir).
        sbatch_args: more ``#SBATCH`` options, each one ``--name=value`` word.
    """
    launch = launch_of(plan)
    directives = _sbatch_directives(launch.nnodes, job_name or slurm_job_name(plan.run_id), gpus_per_node,
                                    cpus_per_task, partition, time_limit, account, output, sbatch_args)

    srun, words = _srun_words(launch)
    n_script = len(launch.command.legacy) + len(launch.command.script)
    lines = [
        "#!/bin/bash",
        f"# ddpfab export slurm: run {_comment(plan.run_id)} of {_comment(plan.inventory)} (group "
        f"{_comment(plan.group)}),",
        f"# {launch.nnodes} nodes x {launch.nproc} procs, world size {launch.nnodes * launch.nproc}. "
        "Submit with: sbatch THIS_FILE",
        "# The torchrun command `ddpfab run` starts over SSH; node rank and master come from Slurm.",
        *directives,
        "set -euo pipefail",
        "",
        "# the environment of every rank (srun passes it on to each task)",
        *(f"export {k}={shlex.quote(v)}" for k, v in launch.env),
        "",
        "# master: the first node of the allocation (this script runs there); node rank: $SLURM_NODEID",
        'nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        "export MASTER_ADDR=\"${nodes%%$'\\n'*}\"",
        f"export MASTER_PORT={int(launch.master_port)}",
        "",
        f"cd -- {render.home_path_word(launch.workdir)}",
        " ".join(srun) + " \\",
        "    " + " ".join(words[:-n_script]) + " \\",
        "    " + " ".join(words[-n_script:]),
        "",
    ]
    return "\n".join(lines)


def _srun_words(launch) -> tuple[list[str], list[str]]:
    """The srun line's words (srun and its inner command) and the launch's words, without its
    rendezvous flags: the fixed inner command puts the scheduler's in (read from each task's
    environment at run time) where the rendezvous flags stand in the node's argv."""
    cmd = launch.command
    words = render.shell_words(cmd, rendezvous=False)
    n_prefix = len(cmd.program) + len(cmd.size)
    slurm = render.static_rendezvous(render.Rendezvous('"$SLURM_NODEID"', '"$MASTER_ADDR"', '"$MASTER_PORT"'))
    inner = f'exec "${{@:1:{n_prefix}}}" {" ".join(slurm)} "${{@:{n_prefix + 1}}}"'
    if cmd.program[0] == nodeenv.ON_NODE:  # the python each task's shell chooses (launch.prefix)
        words[0] = shlex.quote(nodeenv.ON_NODE)
        inner = 'set -- "$DDPFAB_PYTHON" "${@:2}"; ' + inner
    inner = launch.prefix + inner
    srun = ["srun", f"--nodes={launch.nnodes}", f"--ntasks={launch.nnodes}", "--ntasks-per-node=1",
            "--kill-on-bad-exit=1", "/bin/bash", "-c", shlex.quote(inner), "ddpfab-node"]
    return srun, words


def _sbatch_directives(nnodes: int, job_name: str, gpus_per_node: int, cpus_per_task: int | None,
                       partition: str | None, time_limit: str | None, account: str | None, output: str | None,
                       sbatch_args: tuple[str, ...]) -> list[str]:
    """The ``#SBATCH`` lines of :func:`to_sbatch`, in its order; a malformed ``--sbatch`` word is an ExportError."""
    directives = [
        _directive("job-name", job_name),
        _directive("nodes", nnodes),
        _directive("ntasks-per-node", 1),
    ]
    if gpus_per_node:
        directives.append(_directive("gpus-per-node", int(gpus_per_node)))
    if cpus_per_task:
        directives.append(_directive("cpus-per-task", int(cpus_per_task)))
    for name, value in (("partition", partition), ("time", time_limit), ("account", account),
                        ("output", output)):
        if value:
            directives.append(_directive(name, value))
    for word in sbatch_args:
        name, sep, value = word.partition("=")
        if not name.startswith("--") or not sep:
            raise ExportError(f"sbatch option {word!r}: give each sbatch option as one --name=value word")
        directives.append(_directive(name[2:], value))
    return directives


def _comment(text: str) -> str:
    """*text* made safe for a one-line shell comment."""
    return re.sub(r"[\x00-\x1f\x7f]", "?", str(text))


# -- Kubernetes -----------------------------------------------------------------------------------
def k8s_escape(value: str) -> str:
    """*value* as Kubernetes must be given it so that it arrives unchanged: the kubelet expands
    ``$(VAR)`` in command, args and env values, and reads ``$$`` as a literal ``$``."""
    return value.replace("$", "$$")


def k8s_name(run_id: str) -> str:
    """A DNS-1035 label for a job from *run_id* (the operators derive pod and service names from it)."""
    name = re.sub(r"[^a-z0-9-]+", "-", f"ddpfab-{run_id}".lower()).strip("-")
    name = re.sub(r"-{2,}", "-", name)[:MAX_K8S_NAME].rstrip("-")
    return name


def _check_k8s_name(name: str) -> str:
    if len(name) > MAX_K8S_NAME or not _DNS_LABEL.match(name):
        raise ExportError(f"{option('name')} {name!r}: a job name must be a DNS label of at most {MAX_K8S_NAME} "
                          "characters (lower-case letters, digits and '-', starting with a letter)")
    return name


def _k8s_env(launch: Launch, reserved: tuple[str, ...], kind: str) -> list[dict[str, str]]:
    clash = [k for k, _ in launch.env if k in reserved]
    if clash:
        raise ExportError(f"{kind}: the operator sets {', '.join(clash)} itself; do not set it with {option('env')}")
    return [{"name": k, "value": k8s_escape(v)} for k, v in launch.env]


def _metadata(plan, name: str | None, namespace: str | None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": _check_k8s_name(name) if name else k8s_name(plan.run_id)}
    if namespace:
        if len(namespace) > 63 or not _DNS1123_LABEL.match(namespace):
            raise ExportError(f"{option('namespace')} {namespace!r}: a namespace is a DNS label (lower-case letters, "
                              "digits and '-', at most 63 characters)")
        meta["namespace"] = namespace
    meta["labels"] = {"app.kubernetes.io/managed-by": "ddpfab"}
    meta["annotations"] = {"ddpfab/run-id": plan.run_id, "ddpfab/inventory": plan.inventory,
                           "ddpfab/group": plan.group}
    return meta


def not_in_containers(plan) -> str | None:
    """What a Kubeflow job does not take from the inventory, said once before the manifest: the
    node's setup lines and conda env prepare a bare-metal node's shell; a pod runs the image's
    environment and the image's python (``--python``). None when the plan has neither."""
    first = plan.nodes[0] if plan.nodes else None
    if first is None or not (first.setup or first.conda_env):
        return None
    what = " and ".join(w for w, v in (("ddpfab_setup", first.setup), ("ddpfab_conda_env", first.conda_env)) if v)
    return (f"{what} of the inventory are not part of a Kubeflow job: its pods run the image's environment "
            f"and {option('python')}; put what they set up into the image")


def _k8s_command(launch: Launch, python: str, rank: str, addr: str, port: str) -> tuple[list[str], list[str]]:
    """(command, args) of the training container: the launch with the operator's rank and master
    (``$(VAR)`` references) as its rendezvous flags, the image's python, no node-local log dir;
    the script and its arguments as args."""
    cmd = launch.command
    where = render.static_rendezvous(render.Rendezvous(rank, addr, port))
    # only the plan's own values are escaped; ddpfab's $(VAR) references must stay live
    command = [k8s_escape(python), *(k8s_escape(w) for w in (*cmd.program[1:], *cmd.size)), *where,
               *(k8s_escape(w) for w in (*cmd.flags, *cmd.legacy))]
    return command, [k8s_escape(w) for w in cmd.script]


def _k8s_runs(kind: str, launch, image: str, python: str, node_vars: tuple[str, str, str],
              reserved: tuple[str, ...]) -> dict[str, Any]:
    """What a Kubeflow container runs: the image, the torchrun command reading the operator's
    per-node variables (*node_vars*: rank, master address, master port) and the ranks' env."""
    if not image:
        raise ExportError(f"{kind}: {option('image')} is required (an image with torch and the training code)")
    command, args = _k8s_command(launch, python, *node_vars)
    return {"image": image, "command": command, "args": args, "env": _k8s_env(launch, reserved, kind)}


def to_pytorchjob(plan, *, image: str, python: str = "python3", name: str | None = None,
                  namespace: str | None = None, workdir: str | None = None, gpus_per_node: int = 0,
                  restart_policy: str = "Never") -> dict[str, Any]:
    """A Kubeflow PyTorchJob (``kubeflow.org/v1``, training-operator) that runs *plan*.

    One Master and ``nnodes - 1`` Workers, ``nprocPerNode`` ranks each. The operator gives each pod
    ``RANK`` (its node rank), ``MASTER_ADDR`` (the master's service) and ``MASTER_PORT`` (the
    ``pytorchjob-port`` container port: the plan's port); the torchrun command reads them as
    ``$(RANK)`` etc., which works with every operator version, with or without ``PET_*``.

    Args:
        plan: the plan ``ddpfab run`` would execute.
        image: the container image (with torch and the training code).
        python: the image's python that has torch.
        name, namespace: the job's; the name defaults to ``ddpfab-<run id>``.
        workdir: the container's working dir (default: the image's WORKDIR).
        gpus_per_node: ``nvidia.com/gpu`` limit per pod when > 0.
        restart_policy: the replicas' restartPolicy (Never: a failed pod fails the job, as a failed
            node fails a ``ddpfab run``).
    """
    launch = launch_of(plan)
    container: dict[str, Any] = {
        "name": PYTORCHJOB_CONTAINER,
        **_k8s_runs("pytorchjob", launch, image, python, ("$(RANK)", "$(MASTER_ADDR)", "$(MASTER_PORT)"),
                    PYTORCHJOB_RESERVED_ENV + TRAINJOB_RESERVED_ENV),
        "ports": [{"name": PYTORCHJOB_PORT_NAME, "containerPort": int(launch.master_port), "protocol": "TCP"}],
    }
    if workdir:
        container["workingDir"] = workdir
    if gpus_per_node:
        container["resources"] = {"limits": {"nvidia.com/gpu": int(gpus_per_node)}}

    def replica(count: int) -> dict[str, Any]:
        return {"replicas": count, "restartPolicy": restart_policy,
                "template": {"spec": {"containers": [copy.deepcopy(container)]}}}

    specs = {"Master": replica(1)}
    if launch.nnodes > 1:
        specs["Worker"] = replica(launch.nnodes - 1)
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": _metadata(plan, name, namespace),
        "spec": {
            "nprocPerNode": str(launch.nproc),
            "pytorchReplicaSpecs": specs,
        },
    }


def to_trainjob(plan, *, image: str, python: str = "python3", name: str | None = None,
                namespace: str | None = None, runtime: str = DEFAULT_TRAINJOB_RUNTIME,
                runtime_kind: str = "ClusterTrainingRuntime", gpus_per_node: int = 0) -> dict[str, Any]:
    """A Kubeflow Trainer TrainJob (``trainer.kubeflow.org/v1alpha1``) on the torch runtime.

    ``numNodes`` and ``numProcPerNode`` are the plan's; the runtime's torch plugin gives each node
    ``PET_NODE_RANK``, ``PET_MASTER_ADDR`` and ``PET_MASTER_PORT``, which the torchrun command reads
    as ``$(PET_...)``. The master port is the runtime's own (the plan's port does not apply), and
    the API has no working-dir field: the image's WORKDIR is where the script is looked for.

    Args:
        plan: the plan ``ddpfab run`` would execute.
        image: the container image (with torch and the training code).
        python: the image's python that has torch.
        name, namespace: the job's; the name defaults to ``ddpfab-<run id>``.
        runtime, runtime_kind: the training runtime to reference.
        gpus_per_node: ``nvidia.com/gpu`` limit per node when > 0.
    """
    launch = launch_of(plan)
    trainer: dict[str, Any] = {
        **_k8s_runs("trainjob", launch, image, python, ("$(PET_NODE_RANK)", "$(PET_MASTER_ADDR)", "$(PET_MASTER_PORT)"),
                    TRAINJOB_RESERVED_ENV),
        "numNodes": launch.nnodes,
        "numProcPerNode": launch.nproc,
    }
    if gpus_per_node:
        trainer["resourcesPerNode"] = {"limits": {"nvidia.com/gpu": int(gpus_per_node)}}
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": _metadata(plan, name, namespace),
        "spec": {
            "runtimeRef": {"name": runtime, "kind": runtime_kind, "apiGroup": "trainer.kubeflow.org"},
            "trainer": trainer,
        },
    }


def dump_manifest(doc: dict[str, Any], fmt: str = "yaml") -> str:
    if fmt == "json":
        return json.dumps(doc, indent=2, ensure_ascii=False) + "\n"
    import yaml

    return yaml.safe_dump(doc, sort_keys=False, allow_unicode=True, width=1_000_000, default_flow_style=False)


# -- planning offline -----------------------------------------------------------------------------
def offline_facts(cluster, master_port: int | None, cwd: str, ssh_config: str | None = None):
    """Facts for an export, made as the dry run's offline plan makes them: each address by
    :func:`ddpfab.remote.address.offline_addresses` (no host contacted; a name this controller
    cannot resolve is kept and marked), the port the user's or torchrun's default 29500."""
    # slow to import (paramiko, through the probe): see LAZY in ddpfab/cli/__init__.py
    from ddpfab.remote.address import offline_addresses
    from ddpfab.remote.target import resolve_all

    addresses, unresolved = offline_addresses(cluster, resolve_all(cluster.nodes, ssh_config=ssh_config))
    return Facts(addresses=addresses, master_port=decide_port(master_port, offline=True), cwd=cwd,
                 unresolved=unresolved)


def plan_for_export(inventory_path: str, group: str, options, cwd: str | None = None, limit: str | None = None,
                    extra_vars=()):
    """(cluster, plan) for an export, made exactly as ``ddpfab run --dry-run --offline`` makes it."""
    cluster = inventory.load(inventory_path, group, limit=limit, extra_vars=extra_vars)
    return cluster, make_plan(cluster, options, offline_facts(cluster, options.master_port, cwd or os.getcwd()))


def inventory_gpus(cluster) -> int:
    """GPUs per node from the inventory's ``ddpfab_gpus``, when every node says the same; else 0."""
    counts = {n.gpus for n in cluster.nodes}
    if len(counts) != 1:
        return 0
    return counts.pop() or 0
