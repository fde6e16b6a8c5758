"""``ddpfab export {slurm,pytorchjob,trainjob}``: the same job for a scheduler."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ddpfab.cli.common import add_cluster_args, add_env_args, add_script_args, nproc_type
from ddpfab.cli.errors import die
from ddpfab.cli.run import options as run_options
from ddpfab.hosts import inventory
from ddpfab.planning import plan as planmod
from ddpfab.planning import render
from ddpfab.planning.emit import write_private
from ddpfab.planning.export import (
    DEFAULT_TRAINJOB_RUNTIME,
    ExportError,
    dump_manifest,
    inventory_gpus,
    not_in_containers,
    plan_for_export,
    to_pytorchjob,
    to_sbatch,
    to_trainjob,
)


def register(subparsers) -> None:
    """Add ``export {slurm,pytorchjob,trainjob}`` to the ddpfab command line."""
    export = subparsers.add_parser(
        "export", help="write the same job as a Slurm sbatch script or a Kubeflow manifest",
        description="Make the plan `ddpfab run` would run (offline: no host is contacted) and write it "
                    "for a scheduler: the same torchrun flags, script, arguments and environment.")
    sub = export.add_subparsers(dest="export_target", required=True)
    slurm = sub.add_parser("slurm", help="an sbatch script (srun starts torchrun once per node)")
    pyjob = sub.add_parser("pytorchjob", help="a Kubeflow PyTorchJob (kubeflow.org/v1) manifest")
    trjob = sub.add_parser("trainjob", help="a Kubeflow Trainer TrainJob (trainer.kubeflow.org/v1alpha1)")
    for p in (slurm, pyjob, trjob):
        add_cluster_args(p, ssh=False)
        p.add_argument("--nproc-per-node", "--nproc_per_node", type=nproc_type, metavar="N|gpu|cpu|auto",
                       help="processes per node (default: inventory, GPUs, or 1)")
        p.add_argument("--master-port", "--master_port", type=int, help="MASTER_PORT (default 29500)")
        add_env_args(p)
        p.add_argument("--max-restarts", "--max_restarts", type=int, default=0, help="torchrun's in-node restarts (default 0)")
        p.add_argument("--run-id", help="the run id (default: time + random suffix)")
        p.add_argument("--gpus-per-node", type=int,
                       help="GPUs per node to request (default: the inventory's ddpfab_gpus if all nodes agree)")
        p.add_argument("-o", "--output", help="write to this file instead of standard output")
    slurm.add_argument("--partition", help="#SBATCH --partition")
    slurm.add_argument("--time", dest="time_limit", help="#SBATCH --time (e.g. 1-00:00:00)")
    slurm.add_argument("--account", help="#SBATCH --account")
    slurm.add_argument("--cpus-per-task", type=int,
                       help="#SBATCH --cpus-per-task: CPUs for torchrun and all the ranks of a node")
    slurm.add_argument("--job-name", help="#SBATCH --job-name (default: ddpfab-<run id>)")
    slurm.add_argument("--job-output", help="#SBATCH --output (default: Slurm's slurm-%%j.out)")
    slurm.add_argument("--sbatch", action="append", default=[], metavar="--NAME=VALUE",
                       help="another #SBATCH option, e.g. --sbatch=--qos=high (repeatable)")
    for p in (pyjob, trjob):
        p.add_argument("--image", required=True, help="container image with torch and the training code")
        p.add_argument("--python", default="python3", help="the image's python with torch (default: python3)")
        p.add_argument("--name", help="the job's name (default: ddpfab-<run id>)")
        p.add_argument("--namespace", help="the job's namespace (default: kubectl's)")
        p.add_argument("--format", choices=("yaml", "json"), default="yaml", help="output format (default: yaml)")
    pyjob.add_argument("--workdir", help="the container's working dir (default: the image's WORKDIR)")
    trjob.add_argument("--runtime", default=DEFAULT_TRAINJOB_RUNTIME,
                       help=f"training runtime to reference (default: {DEFAULT_TRAINJOB_RUNTIME})")
    trjob.add_argument("--runtime-kind", default="ClusterTrainingRuntime",
                       choices=("ClusterTrainingRuntime", "TrainingRuntime"))
    for p in (slurm, pyjob, trjob):
        add_script_args(p, "training script, relative to the nodes' workdir", "arguments for the script")
        p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    # slow to import: see LAZY in ddpfab/cli/__init__.py
    from ddpfab.launch.runs import new_run_id

    try:
        planmod.master_port(args.master_port, offline=True)  # the port's one rule (raises PlanError)
        options = planmod.RunOptions(
            script=args.script, args=tuple(args.args), nproc_per_node=args.nproc_per_node,
            master_port=args.master_port, env=run_options(args).env_pairs(), max_restarts=args.max_restarts,
            run_id=args.run_id or new_run_id())
        cluster, plan = plan_for_export(args.inventory, args.group, options, limit=args.limit,
                                        extra_vars=args.extra_vars)
        if not args.output:  # printed: secret values masked by key; -o writes them to a private file
            masked = render.masked(plan)
            if masked != plan:
                sys.stderr.write("ddpfab: secret env values are masked (***) on stdout; -o FILE writes them "
                                 "into a private file\n")
            plan = masked
        gpus = args.gpus_per_node if args.gpus_per_node is not None else inventory_gpus(cluster)
        if args.export_target != "slurm" and (note := not_in_containers(plan)):
            sys.stderr.write(f"ddpfab: note: {note}\n")
        if args.export_target == "slurm":
            text = to_sbatch(plan, job_name=args.job_name, gpus_per_node=gpus, cpus_per_task=args.cpus_per_task,
                             partition=args.partition, time_limit=args.time_limit, account=args.account,
                             output=args.job_output, sbatch_args=tuple(args.sbatch))
        elif args.export_target == "pytorchjob":
            text = dump_manifest(to_pytorchjob(plan, image=args.image, python=args.python, name=args.name,
                                               namespace=args.namespace, workdir=args.workdir,
                                               gpus_per_node=gpus), args.format)
        else:
            text = dump_manifest(to_trainjob(plan, image=args.image, python=args.python, name=args.name,
                                             namespace=args.namespace, runtime=args.runtime,
                                             runtime_kind=args.runtime_kind, gpus_per_node=gpus), args.format)
    except (inventory.InventoryError, planmod.PlanError, ExportError) as exc:
        return die(str(exc))
    if args.output:  # it holds the real env values, secrets too: private from the start

        try:
            write_private(Path(args.output), text, 0o700 if args.export_target == "slurm" else 0o600)
        except OSError as exc:
            return die(f"-o {args.output}: {exc.strerror or exc}")
        sys.stderr.write(f"ddpfab: wrote {args.output}\n")
    else:
        sys.stdout.write(text)
    return 0
