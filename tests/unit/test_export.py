"""Exports of a plan to Slurm and Kubeflow: pure, checked field by field against the plan.

- The sbatch script runs through a real /bin/bash with stand-ins for ``scontrol`` and ``srun`` (one
  task per node with its ``SLURM_NODEID``) and a stand-in python that records what it was given:
  every hostile argument and env value must arrive byte for byte. A real Slurm runs it in
  tests/lab/test_slurm.py.
- The Kubernetes manifests are validated against the CRDs' OpenAPI schemas (made strict: unknown
  fields fail) and their ``$(VAR)`` expansion is replayed as the kubelet does it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from ddpfab.cli import export as export_cli
from ddpfab.hosts.inventory import Inventory, Node
from ddpfab.planning import export, render
from ddpfab.planning.export import ExportError, k8s_escape, launch_of, to_pytorchjob, to_sbatch, to_trainjob
from ddpfab.planning.plan import Facts, RunOptions, make_plan

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "kubeflow"
NASTY = ["with space", "it's", '"dq"', "$HOME", "${PATH}", "a;b", "x && y", "`id`", "$(id)", "$$", "$", "*",
         "?", "~", "héllo ✓ 日本", "", "new\nline", "tab\there", "back\\slash", "-n", "--", "!", "#comment",
         "--master-addr=evil", "$(RANK)"]
NASTY_ENV = (("SPACED", "v a l"), ("SHELLY", "$HOME;`id`$(id)"), ("EMPTY", ""), ("UMLAUT", "ü ✓"),
             ("KREF", "$(MASTER_ADDR)"), ("NL", "a\nb"))


def cluster(n: int = 2, **node_kw) -> Inventory:
    nodes = tuple(Node(f"node{i}", f"10.0.0.{i}", **node_kw) for i in range(1, n + 1))
    return Inventory(source="inv.yml", group="all", nodes=nodes)


def plan_of(c: Inventory | None = None, *, args=tuple(NASTY), env=NASTY_ENV, port: int = 29511, nproc: int | None = 2,
            cwd: str = "/srv/proj", homes: dict | None = None, **opts):
    c = c or cluster()
    options = RunOptions("train dir/train.py", args=tuple(args), nproc_per_node=nproc, master_port=port, env=env,
                         run_id="20250101-120000-abc123", **opts)
    facts = Facts(addresses={n.name: n.data_addr or n.host for n in c.nodes}, master_port=port, cwd=cwd,
                  homes=homes if homes is not None else {n.name: "/home/u" for n in c.nodes})
    return make_plan(c, options, facts)


# -- Slurm: content -------------------------------------------------------------------------------
def test_sbatch_asks_for_the_plans_nodes_one_task_each_and_gpus():
    plan = plan_of(cluster(3))
    text = to_sbatch(plan, gpus_per_node=8, cpus_per_task=16, partition="gpu", time_limit="1-00:00:00")
    assert text.startswith("#!/bin/bash\n")
    directives = [ln for ln in text.splitlines() if ln.startswith("#SBATCH")]
    assert directives == ["#SBATCH --job-name=ddpfab-20250101-120000-abc123", "#SBATCH --nodes=3",
                          "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8", "#SBATCH --cpus-per-task=16",
                          "#SBATCH --partition=gpu", "#SBATCH --time=1-00:00:00"]
    srun = next(ln for ln in text.splitlines() if ln.startswith("srun "))
    assert "--nodes=3 --ntasks=3 --ntasks-per-node=1 --kill-on-bad-exit=1" in srun
    assert '--node-rank="$SLURM_NODEID"' in srun
    assert "export MASTER_PORT=29511" in text
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST"' in text
    # node 0's values of the plan appear nowhere: Slurm decides rank and master
    assert "--node-rank=0" not in text and "10.0.0.1" not in text


def test_sbatch_without_gpus_requests_none_and_syntax_is_valid(tmp_path):
    text = to_sbatch(plan_of())
    assert "gpus" not in text
    path = tmp_path / "job.sh"
    path.write_text(text)
    subprocess.run(["/bin/bash", "-n", str(path)], check=True)


@pytest.mark.parametrize("bad", ["gpu part", "a\nb", "x'y", 'q"', "$(id)", ""])
def test_sbatch_directive_values_cannot_inject(bad):
    with pytest.raises(ExportError):
        to_sbatch(plan_of(), partition=bad or " ")
    with pytest.raises(ExportError):
        to_sbatch(plan_of(), sbatch_args=(f"--qos={bad}",))


def test_sbatch_extra_options_must_be_name_value():
    text = to_sbatch(plan_of(), sbatch_args=("--qos=high", "--exclusive=user"))
    assert "#SBATCH --qos=high" in text and "#SBATCH --exclusive=user" in text
    with pytest.raises(ExportError, match="--name=value"):
        to_sbatch(plan_of(), sbatch_args=("--exclusive",))


def test_heterogeneous_nodes_cannot_be_exported_and_the_error_names_the_fix():
    c = Inventory("inv.yml", "all", (Node("a", "10.0.0.1", nproc=2), Node("b", "10.0.0.2", nproc=4)))
    with pytest.raises(ExportError, match="nproc.*ddpfab_nproc_per_node"):
        launch_of(plan_of(c, nproc=None))
    c = Inventory("inv.yml", "all", (Node("a", "10.0.0.1", python="/a/python"), Node("b", "10.0.0.2")))
    with pytest.raises(ExportError, match="ddpfab_python"):
        to_sbatch(plan_of(c))
    c = Inventory("inv.yml", "all", (Node("a", "10.0.0.1", workdir="/x"), Node("b", "10.0.0.2")))
    with pytest.raises(ExportError, match="ddpfab_workdir"):
        to_pytorchjob(plan_of(c), image="img")


def test_env_names_that_are_not_identifiers_are_refused():
    # parse_env refuses them on the command line; the forwarded environment is not parsed there
    with pytest.raises(ExportError, match="NCCL_X;id"):
        to_sbatch(plan_of(env=(("NCCL_X;id", "1"),)))


# -- Slurm: through a real bash -------------------------------------------------------------------
FAKE_SCONTROL = """#!/bin/bash
[ "$1 $2" = "show hostnames" ] || { echo "fake scontrol: unexpected $*" >&2; exit 2; }
printf 'nodeA\\nnodeB\\nnodeC\\n' | head -n "${FAKE_NNODES:-2}"
"""
# srun: skip its own options, then run the command once per node, as Slurm would, with that
# node's SLURM_NODEID/SLURM_PROCID, and fail if any task fails
FAKE_SRUN = """#!/bin/bash
ntasks=1
while [ $# -gt 0 ]; do
  case "$1" in
    --ntasks=*) ntasks=${1#--ntasks=}; shift;;
    --*) shift;;
    *) break;;
  esac
done
rc=0
for ((i = 0; i < ntasks; i++)); do
  SLURM_NODEID=$i SLURM_PROCID=$i "$@" || rc=$?
done
exit $rc
"""
RECORDER = """import json, os, sys
out = os.environ["RECORD_DIR"] + "/node" + os.environ["SLURM_NODEID"] + ".json"
json.dump({"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ)}, open(out, "w"))
"""


@pytest.fixture
def fake_slurm(tmp_path):
    """(bin dir on PATH with scontrol/srun, a 'python' that records its argv per node, record dir)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
    recorder = tmp_path / "recorder.py"
    recorder.write_text(RECORDER)
    python = tmp_path / "py thon's $dir" / "python"
    python.parent.mkdir()
    python.write_text(f"#!/bin/sh\nexec {sys.executable} {recorder} \"$@\"\n")
    python.chmod(0o755)
    records = tmp_path / "records"
    records.mkdir()
    return bindir, python, records


def run_sbatch(text: str, bindir: Path, records: Path, tmp_path: Path, nnodes: int = 2,
               home: str | None = None) -> list[dict]:
    script = tmp_path / "job.sh"
    script.write_text(text)
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "RECORD_DIR": str(records), "SLURM_JOB_NODELIST": "node[A-C]",
           "FAKE_NNODES": str(nnodes), "HOME": home or str(tmp_path), "LANG": "C.UTF-8"}
    proc = subprocess.run(["/bin/bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [json.loads((records / f"node{i}.json").read_text()) for i in range(nnodes)]


def expected_argv(plan, node_rank: int, master_addr: str, log_dir: str, master_port: int | None = None) -> list[str]:
    """The plan's argv of *node_rank* (:func:`ddpfab.planning.render.command`), as the exported job must start it
    there (minus argv[0]): the scheduler's master, the log dir as the node's shell resolves it."""
    node = plan.nodes[node_rank]
    port = str(master_port or plan.master_port)
    cmd = render.command(plan, node, render.Rendezvous(str(node_rank), master_addr, port))
    return list(dataclasses.replace(cmd, log_dir=log_dir).argv()[1:])


def normalise(argv: list[str], script: str) -> tuple[list[str], set[str], list[str]]:
    """(launcher words, torchrun flags as a set, script and args): flag order is torchrun's business."""
    i = argv.index(script)
    return argv[:2], set(argv[2:i]), argv[i:]


def test_sbatch_through_bash_gives_each_node_the_plans_command(fake_slurm, tmp_path):
    bindir, python, records = fake_slurm
    workdir = tmp_path / "work dir 'q' $x"
    workdir.mkdir()
    c = cluster(2, python=str(python))
    plan = plan_of(c, cwd=str(workdir), homes={})  # homes unknown: the log dir stays home-relative
    got = run_sbatch(to_sbatch(plan), bindir, records, tmp_path)
    log_dir = f"{tmp_path}/.ddpfab/runs/{plan.run_id}/torchrun"
    for rank, rec in enumerate(got):
        want = expected_argv(plan, rank, "nodeA", log_dir)
        assert rec["argv"] == want  # word for word: the sbatch renderer agrees with the node's argv
        assert rec["argv"][-len(NASTY):] == NASTY
        assert rec["cwd"] == str(workdir)
        for key, value in NASTY_ENV:
            assert rec["env"][key] == value
        assert rec["env"]["DDPFAB_RUN_ID"] == plan.run_id
        assert (rec["env"]["MASTER_ADDR"], rec["env"]["MASTER_PORT"]) == ("nodeA", "29511")


def test_sbatch_absolute_log_dir_and_three_nodes(fake_slurm, tmp_path):
    bindir, python, records = fake_slurm
    plan = plan_of(cluster(3, python=str(python)), cwd=str(tmp_path), homes={f"node{i}": "/home/u" for i in (1, 2, 3)})
    got = run_sbatch(to_sbatch(plan), bindir, records, tmp_path, nnodes=3)
    assert [r["argv"].count(f"--node-rank={i}") for i, r in enumerate(got)] == [1, 1, 1]
    for rank, rec in enumerate(got):
        want = expected_argv(plan, rank, "nodeA", f"/home/u/.ddpfab/runs/{plan.run_id}/torchrun")
        assert normalise(rec["argv"], plan.script) == normalise(want, plan.script)


text_st = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=20)


@settings(max_examples=25, deadline=None)
@given(args=st.lists(text_st, max_size=5), value=text_st)
def test_any_args_and_env_values_survive_the_sbatch_script(tmp_path_factory, args, value):
    tmp_path = tmp_path_factory.mktemp("hyp")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
    (tmp_path / "recorder.py").write_text(RECORDER)
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} {tmp_path / 'recorder.py'} \"$@\"\n")
    python.chmod(0o755)
    records = tmp_path / "records"
    records.mkdir()
    plan = plan_of(cluster(2, python=str(python)), args=args, env=(("V", value),), cwd=str(tmp_path))
    for rec in run_sbatch(to_sbatch(plan), bindir, records, tmp_path):
        i = rec["argv"].index(plan.script)
        assert rec["argv"][i + 1:] == args
        assert rec["env"]["V"] == value


def test_a_failing_node_fails_the_script(fake_slurm, tmp_path):
    bindir, python, records = fake_slurm
    python.write_text("#!/bin/sh\n[ \"$SLURM_NODEID\" = 1 ] && exit 7\nexit 0\n")
    text = to_sbatch(plan_of(cluster(2, python=str(python)), cwd=str(tmp_path)))
    script = tmp_path / "job.sh"
    script.write_text(text)
    proc = subprocess.run(["/bin/bash", str(script)], env={"PATH": f"{bindir}:/usr/bin:/bin", "HOME": str(tmp_path),
                                                          "SLURM_JOB_NODELIST": "x"}, capture_output=True, text=True)
    assert proc.returncode == 7


# -- Kubernetes: schemas --------------------------------------------------------------------------
def _strict(schema):
    """The CRD schema as `kubectl --validate=strict` applies it: unknown fields are errors."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def crd_validator(filename: str, version: str):
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: 10x faster on these big files
    crd = yaml.load((FIXTURES / filename).read_text(), Loader=loader)
    ver = next(v for v in crd["spec"]["versions"] if v["name"] == version)
    schema = _strict(ver["schema"]["openAPIV3Schema"])
    return crd, jsonschema.Draft7Validator(schema)


@pytest.fixture(scope="module")
def pytorchjob_schema():
    return crd_validator("kubeflow.org_pytorchjobs.yaml", "v1")


@pytest.fixture(scope="module")
def trainjob_schema():
    return crd_validator("trainer.kubeflow.org_trainjobs.yaml", "v1alpha1")


def assert_valid(validator, doc):
    errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


def roundtrip(doc):
    """What kubectl would read: the YAML we print, parsed back (and the JSON form agrees)."""
    back = yaml.safe_load(export.dump_manifest(doc))
    assert back == doc
    assert json.loads(export.dump_manifest(doc, "json")) == doc
    return back


def test_strict_schema_rejects_a_misspelt_field(pytorchjob_schema):
    _, validator = pytorchjob_schema
    doc = to_pytorchjob(plan_of(), image="img")
    doc["spec"]["nprocsPerNode"] = "2"
    assert list(validator.iter_errors(doc))


# -- Kubernetes: $(VAR) expansion as the kubelet does it ------------------------------------------
def k8s_expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion of command, args and env values (third_party/forked/golang/expansion):
    ``$(NAME)`` becomes the value of NAME when defined (else stays as written), ``$$`` becomes ``$``,
    any other ``$`` stays."""
    out, i = [], 0
    while i < len(text):
        ch = text[i]
        if ch == "$" and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt == "$":
                out.append("$")
                i += 2
                continue
            if nxt == "(":
                end = text.find(")", i + 2)
                if end != -1:
                    name = text[i + 2:end]
                    out.append(env.get(name, f"$({name})"))
                    i = end + 1
                    continue
                out.append("$(")
                i += 2
                continue
            out.append("$" + nxt)
            i += 2
            continue
        out.append(ch)
        i += 1
    return "".join(out)


def test_k8s_escape_round_trips_through_the_expansion():
    env = {"HOME": "/root", "RANK": "1", "id": "X"}
    for value in NASTY + ["$(HOME)", "$$(HOME)", "a$", "$(", "$(unclosed", "$)"]:
        assert k8s_expand(k8s_escape(value), env) == value


def container_env(entries, operator_env):
    """A container's env as the pod sees it: entries in order, each expanded with those before it."""
    env = dict(operator_env)
    for e in entries:
        env[e["name"]] = k8s_expand(e["value"], env)
    return env


# -- Kubernetes: PyTorchJob -----------------------------------------------------------------------
def test_pytorchjob_is_valid_and_matches_the_plan_field_by_field(pytorchjob_schema):
    crd, validator = pytorchjob_schema
    plan = plan_of(cluster(3))
    doc = roundtrip(to_pytorchjob(plan, image="registry.local/train:1", gpus_per_node=4, namespace="ml",
                                  workdir="/code"))
    assert_valid(validator, doc)
    assert (doc["apiVersion"], doc["kind"]) == (f"{crd['spec']['group']}/v1", crd["spec"]["names"]["kind"])
    assert doc["metadata"]["name"] == "ddpfab-20250101-120000-abc123"
    assert doc["metadata"]["namespace"] == "ml"
    assert doc["metadata"]["annotations"]["ddpfab/run-id"] == plan.run_id
    spec = doc["spec"]
    assert spec["nprocPerNode"] == "2"
    replicas = spec["pytorchReplicaSpecs"]
    assert set(replicas) == {"Master", "Worker"}
    assert (replicas["Master"]["replicas"], replicas["Worker"]["replicas"]) == (1, plan.nnodes - 1)
    for rtype, first_rank in (("Master", 0), ("Worker", 1)):
        (container,) = replicas[rtype]["template"]["spec"]["containers"]
        assert container["name"] == "pytorch" and container["image"] == "registry.local/train:1"
        assert container["workingDir"] == "/code"
        assert container["ports"] == [{"name": "pytorchjob-port", "containerPort": plan.master_port, "protocol": "TCP"}]
        assert container["resources"] == {"limits": {"nvidia.com/gpu": 4}}
        for rank in range(first_rank, plan.nnodes if rtype == "Worker" else 1):
            # what the operator gives pod `rank` (RANK is the pod's node rank), then the kubelet's expansion
            operator = {"RANK": str(rank), "MASTER_ADDR": "job-master-0", "MASTER_PORT": str(plan.master_port)}
            env = container_env(container["env"], operator)
            argv = [k8s_expand(w, env) for w in container["command"] + container["args"]]
            want = [w for w in expected_argv(plan, rank, "job-master-0", "") if not w.startswith("--log-dir=")]
            assert argv[1:] == want  # word for word, flag order too: the renderers agree
            assert argv[0] == "python3"
            assert normalise(argv[1:], plan.script) == normalise(want, plan.script)
            assert argv[-len(NASTY):] == NASTY
            assert {k: env[k] for k in plan.nodes[rank].env} == plan.nodes[rank].env


def test_pytorchjob_single_node_has_no_workers_and_no_gpu_limit(pytorchjob_schema):
    _, validator = pytorchjob_schema
    doc = roundtrip(to_pytorchjob(plan_of(cluster(1)), image="img", python="/opt/venv/bin/python"))
    assert_valid(validator, doc)
    assert set(doc["spec"]["pytorchReplicaSpecs"]) == {"Master"}
    (container,) = doc["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
    assert "resources" not in container and "workingDir" not in container
    assert container["command"][:3] == ["/opt/venv/bin/python", "-m", "torch.distributed.run"]


@pytest.mark.parametrize("key", ["MASTER_ADDR", "RANK", "WORLD_SIZE", "PET_NODE_RANK"])
def test_pytorchjob_refuses_env_the_operator_sets(key):
    with pytest.raises(ExportError, match=key):
        to_pytorchjob(plan_of(env=((key, "x"),)), image="img")


def test_k8s_names_are_dns_labels():
    assert export.k8s_name("20250101-120000-ABC_def") == "ddpfab-20250101-120000-abc-def"
    assert len(export.k8s_name("x" * 200)) <= export.MAX_K8S_NAME
    with pytest.raises(ExportError):
        to_pytorchjob(plan_of(), image="img", name="Bad_Name")
    with pytest.raises(ExportError):
        to_trainjob(plan_of(), image="img", namespace="no spaces")
    with pytest.raises(ExportError, match="pytorchjob: image is required"):
        to_pytorchjob(plan_of(), image="")


# -- Kubernetes: TrainJob -------------------------------------------------------------------------
def test_trainjob_is_valid_and_matches_the_plan_field_by_field(trainjob_schema):
    crd, validator = trainjob_schema
    plan = plan_of(cluster(2))
    doc = roundtrip(to_trainjob(plan, image="img:2", gpus_per_node=2))
    assert_valid(validator, doc)
    assert (doc["apiVersion"], doc["kind"]) == (f"{crd['spec']['group']}/v1alpha1", crd["spec"]["names"]["kind"])
    spec = doc["spec"]
    assert spec["runtimeRef"] == {"name": "torch-distributed", "kind": "ClusterTrainingRuntime",
                                  "apiGroup": "trainer.kubeflow.org"}
    trainer = spec["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (plan.nnodes, 2)
    assert trainer["resourcesPerNode"] == {"limits": {"nvidia.com/gpu": 2}}
    for rank in range(plan.nnodes):
        # what the torch runtime gives node `rank`; its port is the runtime's own (29400)
        operator = {"PET_NODE_RANK": str(rank), "PET_MASTER_ADDR": "j-node-0-0.j", "PET_MASTER_PORT": "29400",
                    "PET_NNODES": "2", "PET_NPROC_PER_NODE": "2"}
        env = container_env(trainer["env"], operator)
        argv = [k8s_expand(w, env) for w in trainer["command"] + trainer["args"]]
        want = [w for w in expected_argv(plan, rank, "j-node-0-0.j", "", master_port=29400)
                if not w.startswith("--log-dir=")]
        assert argv[1:] == want
        assert normalise(argv[1:], plan.script) == normalise(want, plan.script)
        assert argv[-len(NASTY):] == NASTY
        assert {k: env[k] for k in plan.nodes[rank].env} == plan.nodes[rank].env


def test_trainjob_refuses_reserved_torch_env_and_takes_another_runtime(trainjob_schema):
    _, validator = trainjob_schema
    with pytest.raises(ExportError, match="PET_MASTER_PORT"):
        to_trainjob(plan_of(env=(("PET_MASTER_PORT", "1"),)), image="img")
    doc = to_trainjob(plan_of(), image="img", runtime="my-torch", runtime_kind="TrainingRuntime", namespace="team")
    assert_valid(validator, doc)
    assert doc["spec"]["runtimeRef"]["name"] == "my-torch" and doc["metadata"]["namespace"] == "team"
    assert "resourcesPerNode" not in doc["spec"]["trainer"]


# -- the command line -----------------------------------------------------------------------------
INVENTORY = """
all:
  vars:
    ddpfab_python: /opt/venv/bin/python
    ddpfab_workdir: /srv/code
    ddpfab_gpus: 4
  hosts:
    gpu1: {ansible_host: 10.9.0.1}
    gpu2: {ansible_host: gpu2.example.invalid}
"""


def cli(argv: list[str], capsys) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="ddpfab")
    export_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    code = args.func(args)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def inventory_file(tmp_path) -> Path:
    path = tmp_path / "inv.yml"
    path.write_text(INVENTORY)
    return path


def test_cli_slurm_uses_the_inventory_offline(inventory_file, capsys, monkeypatch):
    monkeypatch.setenv("NCCL_DEBUG", "INFO")  # forwarded like `ddpfab run` forwards it
    code, out, err = cli(["export", "slurm", "-i", str(inventory_file), "--run-id", "r1", "--master-port", "29600",
                          "--env", "A=b c", "train.py", "--lr", "0.1", ""], capsys)
    assert code == 0, err
    assert "#SBATCH --nodes=2" in out and "#SBATCH --gpus-per-node=4" in out
    assert "export MASTER_PORT=29600" in out and "export A='b c'" in out
    assert "cd -- /srv/code" in out and "/opt/venv/bin/python -m torch.distributed.run" in out
    assert "--nproc-per-node=4" in out  # ddpfab_gpus, as `ddpfab run` decides it
    assert out.rstrip().endswith("train.py --lr 0.1 ''")
    if "NCCL_DEBUG=INFO" not in out:
        from ddpfab.planning import plan as planmod
        assert not hasattr(planmod, "forwarded_env")


def test_cli_manifests_and_output_file(inventory_file, capsys, tmp_path, pytorchjob_schema, trainjob_schema):
    code, out, err = cli(["export", "pytorchjob", "-i", str(inventory_file), "--image", "img", "--run-id", "r1",
                          "--no-forward-env", "train.py"], capsys)
    assert code == 0, err
    assert_valid(pytorchjob_schema[1], yaml.safe_load(out))
    target = tmp_path / "tj.json"
    code, _, err = cli(["export", "trainjob", "-i", str(inventory_file), "--image", "img", "--format", "json",
                        "--gpus-per-node", "0", "-o", str(target), "train.py"], capsys)
    assert code == 0 and str(target) in err
    doc = json.loads(target.read_text())
    assert_valid(trainjob_schema[1], doc)
    assert "resourcesPerNode" not in doc["spec"]["trainer"]


def test_cli_errors_are_one_line_and_exit_2(inventory_file, capsys, tmp_path):
    code, _, err = cli(["export", "slurm", "-i", str(tmp_path / "missing.yml"), "t.py"], capsys)
    assert code == 2 and "no such file" in err
    code, _, err = cli(["export", "slurm", "-i", str(inventory_file), "--partition", "a b", "t.py"], capsys)
    assert code == 2 and "#SBATCH" in err
    code, _, err = cli(["export", "pytorchjob", "-i", str(inventory_file), "--image", "i", "--env", "RANK=1", "t.py"],
                       capsys)
    assert code == 2 and "RANK" in err


def test_export_module_is_cheap_to_import():
    """The export module and the whole command line (every invocation builds its parser): no yaml,
    ansible or fabric at import time."""
    code = ("import sys; import ddpfab.planning.export; import ddpfab.cli; "
            "ddpfab.cli.build_parser(); print(sorted(m for m in ('yaml', 'ansible', 'fabric', 'paramiko', 'jsonschema', 'importlib.metadata') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert out.stdout.strip() == "[]"


def test_a_per_node_placeholder_or_c10d_cannot_be_exported_and_the_error_says_why():
    with pytest.raises(ExportError, match=r"differ per node \(\{\{node_rank\}\}\)"):
        to_sbatch(plan_of(args=("--shard={{node_rank}}", "--of={{nnodes}}")))
    text = to_sbatch(plan_of(args=("--of={{nnodes}}", "--ws={{world_size}}")))  # the same on every node: filled in
    assert "--of=2 --ws=4" in text
    with pytest.raises(ExportError, match="static rendezvous"):
        to_pytorchjob(plan_of(rdzv="c10d"), image="img")


def test_an_export_addresses_the_nodes_as_the_dry_runs_offline_plan_does(tmp_path):
    """One rule for offline addresses (:func:`ddpfab.remote.address.offline_addresses`): a name the
    controller resolves becomes its IP, one it cannot is kept and marked unresolved (no 0.0.0.0
    stand-in), an IP literal is itself; the export's facts and the dry run's plan agree."""
    import ddpfab

    inv = tmp_path / "inv.yml"
    inv.write_text("all:\n  hosts:\n    a: {ansible_host: nowhere-node.invalid}\n    b: {ansible_host: localhost}\n"
                   "    c: {ansible_host: 10.0.0.3}\n")
    c = export.inventory.load(str(inv), "all")
    facts = export.offline_facts(c, None, "/x")
    assert facts.addresses == {"a": "nowhere-node.invalid", "b": "127.0.0.1", "c": "10.0.0.3"}
    assert facts.unresolved == ("a",)
    _, plan = export.plan_for_export(str(inv), "all", RunOptions("t.py", run_id="r1"), cwd="/x")
    dry = ddpfab.Cluster.load(str(inv)).plan("t.py", offline=True, run_id="r1")
    assert plan.master_addr == dry.master_addr == "nowhere-node.invalid"
    assert [n.name for n in plan.nodes] == [n.name for n in dry.nodes]
