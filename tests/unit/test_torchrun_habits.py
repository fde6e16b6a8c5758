"""torchrun's habits in ddpfab: --nproc-per-node gpu|cpu|auto, the underscore spellings, -m module
mode, a script that parses --local_rank, and the dry run refusing what the real run refuses."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.elastic.utils.api import macros

from ddpfab import cli
from ddpfab.api import planner_options
from ddpfab.cli import run as run_cli
from ddpfab.health import check
from ddpfab.hosts.inventory import Inventory, Node
from ddpfab.launch import replay, runner
from ddpfab.health import probe
from ddpfab.planning import emit, render, scriptfile
from ddpfab.planning.plan import Facts, PlanError, RunOptions, make_plan, nproc_for, parse_nproc

GPU_NODE, CPU_NODE = Node("g", "10.0.0.1"), Node("c", "10.0.0.2")
TWO = Inventory("inv.yml", "all", (GPU_NODE, CPU_NODE))


def probed(gpus: dict[str, int], cpus: dict[str, int]) -> Facts:
    return Facts(addresses={"g": "10.0.0.1", "c": "10.0.0.2"}, master_port=29500, cwd="/w", gpus=gpus, cpus=cpus,
                 homes={"g": "/root", "c": "/root"})


def offline() -> Facts:
    return Facts(addresses={"g": "10.0.0.1", "c": "10.0.0.2"}, master_port=29500, cwd="/w")


@pytest.mark.parametrize("text, want", [("gpu", "gpu"), ("GPU", "gpu"), ("cpu", "cpu"), ("auto", "auto"), ("4", 4),
                                        (" 2 ", 2)])
def test_nproc_words_and_numbers_parse(text, want):
    assert parse_nproc(text) == want


@pytest.mark.parametrize("text", ["0", "-1", "two", "gpus", "", "1.5"])
def test_nproc_nonsense_is_refused_by_the_parser_with_torchruns_words(text, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.build_parser().parse_args(["run", "-i", "a,", "--nproc-per-node", text, "t.py"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--nproc-per-node" in err and ("gpu, cpu or auto" in err or ">= 1" in err)


def test_each_word_is_decided_per_node_from_its_facts():
    facts = probed(gpus={"g": 8, "c": 0}, cpus={"g": 64, "c": 16})
    auto = make_plan(TWO, RunOptions("t.py", nproc_per_node="auto"), facts)
    assert [(n.name, n.nproc) for n in auto.nodes] == [("g", 8), ("c", 16)] and auto.world_size == 24
    cpu = make_plan(TWO, RunOptions("t.py", nproc_per_node="cpu"), facts)
    assert [n.nproc for n in cpu.nodes] == [64, 16]
    # the plan holds the number: torchrun gets what ddpfab decided, the same in every rendering
    assert "--nproc-per-node=64" in render.argv(cpu, cpu.nodes[0])
    with pytest.raises(PlanError, match=r"host c: nproc_per_node='gpu': it has no GPU"):
        make_plan(TWO, RunOptions("t.py", nproc_per_node="gpu"), facts)
    only_gpus = Inventory("inv.yml", "all", (GPU_NODE,))
    assert make_plan(only_gpus, RunOptions("t.py", nproc_per_node="gpu"), facts).nodes[0].nproc == 8


def test_a_gpu_list_counts_before_the_probe_and_the_inventory_offline():
    listed = Node("g", "10.0.0.1", gpu_ids=("2", "3"), gpus=8)
    assert nproc_for(listed, RunOptions("t.py", nproc_per_node="gpu"), gpus=8, cpus=64) == 2
    stated = Node("g", "10.0.0.1", gpus=4)
    assert nproc_for(stated, RunOptions("t.py", nproc_per_node="gpu")) == 4  # offline: ddpfab_gpus
    assert nproc_for(stated, RunOptions("t.py", nproc_per_node="gpu"), gpus=2) == 2  # probed wins


@pytest.mark.parametrize("word", ["gpu", "cpu", "auto"])
def test_an_offline_plan_refuses_a_count_it_cannot_know_naming_the_node(word):
    with pytest.raises(PlanError, match=rf"host g: nproc_per_node='{word}': its (GPU|CPU) count is not known"):
        make_plan(TWO, RunOptions("t.py", nproc_per_node=word), offline())


def test_the_probes_counts_reach_the_plan():
    raw = {"g": {"nvidia_gpus": 2, "cpus": 32}, "c": {"cpus": 4}, "x": {"gpus": 1, "nvidia_gpus": 3, "cpus": True}}
    assert {n: probe.gpu_count(r) for n, r in raw.items()} == {"g": 2, "c": 0, "x": 1}
    assert {n: probe.cpu_count(r) for n, r in raw.items()} == {"g": 32, "c": 4, "x": None}
    facts = {n: probe.NodeFacts(n, address=f"10.0.0.{i}", raw=r) for i, (n, r) in enumerate(raw.items(), 1)}
    got = runner.plan_facts(facts, 29500, "/w")
    assert got.gpus == {"g": 2, "c": 0, "x": 1} and got.cpus == {"g": 32, "c": 4}


@pytest.mark.parametrize("command", [["run"], ["plan"], ["check"], ["export", "slurm"]])
def test_torchruns_underscore_spellings_mean_the_same(command):
    parser = cli.build_parser()
    tail = [] if command == ["check"] else ["t.py"]
    dashed = vars(parser.parse_args([*command, "-i", "a,", "--nproc-per-node", "2", "--master-port", "29511", *tail]))
    under = vars(parser.parse_args([*command, "-i", "a,", "--nproc_per_node", "2", "--master_port", "29511", *tail]))
    assert dashed == under and dashed["nproc_per_node"] == 2 and dashed["master_port"] == 29511
    if command != ["check"]:
        a = vars(parser.parse_args([*command, "-i", "a,", "--max-restarts", "3", "t.py"]))
        b = vars(parser.parse_args([*command, "-i", "a,", "--max_restarts", "3", "t.py"]))
        assert a == b and a["max_restarts"] == 3


def _options(*words: str) -> RunOptions:
    args = cli.build_parser().parse_args(["run", "-i", "a,", "--no-forward-env", *words])
    return planner_options(args.script, args.args, run_cli.options(args))


def test_module_mode_as_torchrun_writes_it_or_as_an_option_is_one_plan(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    after = _options("--run-id", "r", "--", "-m", "pkg.train", "--lr", "1")
    option = _options("--run-id", "r", "-m", "pkg.train", "--lr", "1")
    assert after == option
    assert (after.script, after.module, after.args) == ("pkg.train", True, ("--lr", "1"))
    plan = make_plan(Inventory("inv.yml", "all", (GPU_NODE,)), after, probed({"g": 0}, {"g": 2}))
    argv = render.argv(plan, plan.nodes[0])
    assert argv[-4:] == ("-m", "pkg.train", "--lr", "1")
    assert argv.index("-m", 3) > argv.index("--max-restarts=0")  # torchrun's -m: after its other flags
    assert shlex.split(render.shell_line(plan, plan.nodes[0]))[-len(argv):] == list(argv)  # the line ends in the argv
    assert "module (-m): pkg.train --lr 1" in emit.readme(plan)
    legacy = make_plan(Inventory("inv.yml", "all", (GPU_NODE,)), RunOptions("pkg.train", module=True, launcher="legacy"),
                       probed({"g": 0}, {"g": 2}))
    assert render.argv(legacy, legacy.nodes[0])[-2:] == ("-m", "pkg.train")
    with pytest.raises(PlanError, match="needs a module name"):
        _options("--", "-m")
    with pytest.raises(PlanError, match="expected a module name"):
        make_plan(TWO, RunOptions("pkg/train.py", module=True), offline())


def test_which_file_a_module_must_have_is_decided_once(tmp_path):
    (tmp_path / "pkg" / "tool").mkdir(parents=True)
    (tmp_path / "pkg" / "train.py").write_text("")
    (tmp_path / "pkg" / "tool" / "__main__.py").write_text("")
    root = str(tmp_path)
    assert scriptfile.file_to_check("pkg.train", True, root) == "pkg/train.py"
    assert scriptfile.file_to_check("pkg.tool", True, root) == "pkg/tool/__main__.py"
    assert scriptfile.file_to_check("pkg.missing", True, root) == "pkg/missing.py"  # its package is here: checked
    assert scriptfile.file_to_check("torch.utils.collect_env", True, root) is None  # installed: not checked
    assert scriptfile.file_to_check("t.py", False, root) == "t.py"
    with pytest.raises(scriptfile.ScriptError, match="neither pkg/missing.py nor pkg/missing/__main__.py"):
        scriptfile.check_here("pkg.missing", True, root)
    scriptfile.check_here("pkg.train", True, root)
    scriptfile.check_here("torch.utils.collect_env", True, root)


def _dry(tmp_path: Path, *words: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddpfab", "run", "-i", "10.0.0.1,", "--dry-run", "--offline",
                           "--no-forward-env", *words], capture_output=True, text=True, cwd=tmp_path, timeout=60)


def test_the_dry_run_refuses_a_missing_script_as_the_real_run_does(tmp_path):
    (tmp_path / "train.py").write_text("")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "train.py").write_text("")
    missing = _dry(tmp_path, "trian.py")
    assert missing.returncode == 2 and "script trian.py not found" in missing.stderr
    assert "did you mean" in missing.stderr and "train.py" in missing.stderr
    assert _dry(tmp_path, "--", "-m", "pkg.nope").returncode == 2
    assert _dry(tmp_path, "--no-sync", "trian.py").returncode == 0  # not synced: the nodes' workdir decides
    ok = _dry(tmp_path, "--", "-m", "pkg.train")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.rstrip().endswith("-m pkg.train")


SCRIPTS = {"underscore.py": 'p.add_argument("--local_rank", type=int, default=0)\n',
           "dash.py": "p.add_argument('--local-rank', type=int, default=0)\n",
           "both.py": 'p.add_argument("--local-rank", "--local_rank", type=int, default=0)\n',
           "env.py": 'local_rank = int(os.environ["LOCAL_RANK"])\n'}


@pytest.mark.parametrize("script, spelling", [("underscore.py", "--local_rank"), ("dash.py", "--local-rank"),
                                              ("both.py", "--local-rank"), ("env.py", None)])
def test_a_script_that_parses_its_local_rank_gets_each_ranks_under_torchrun(tmp_path, monkeypatch, script, spelling):
    monkeypatch.chdir(tmp_path)
    for name, text in SCRIPTS.items():
        (tmp_path / name).write_text(text)
    options = _options("--run-id", "r", "--nproc-per-node", "2", script, "--lr", "1")
    plan = make_plan(Inventory("inv.yml", "all", (GPU_NODE,)), options, probed({"g": 0}, {"g": 2}))
    argv = list(render.argv(plan, plan.nodes[0]))
    assert argv[1:3] == ["-m", "torch.distributed.run"]
    if spelling is None:  # reads LOCAL_RANK: given nothing it does not parse
        assert argv[-3:] == [script, "--lr", "1"] and not plan.script_local_rank
        return
    assert argv[-4:] == [script, f"{spelling}=${{local_rank}}", "--lr", "1"]
    # torchrun's own substitution (its agent runs it on every worker's args): each rank its own
    script_args = argv[argv.index(script) + 1:]
    assert [macros.substitute(script_args, str(r))[0] for r in range(2)] == [f"{spelling}=0", f"{spelling}=1"]


def test_a_local_rank_module_is_read_from_its_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "train.py").write_text(SCRIPTS["underscore.py"])
    options = _options("--run-id", "r", "-m", "pkg.train")
    assert (options.local_rank_arg, options.script_local_rank) == ("--local_rank", True)


def test_plans_and_options_recorded_before_these_fields_still_replay():
    # exit_guard="off", hang_timeout=0: what a ddpfab before the exit guard and the hang watch ran
    # (and what such a record means)
    plan = make_plan(TWO, RunOptions("t.py", run_id="r", exit_guard="off", hang_timeout=0),
                     probed({"g": 0, "c": 0}, {"g": 1, "c": 1}))
    old = {k: v for k, v in replay.as_recorded(plan).items() if k not in replay.LATER_PLAN_FIELDS}
    assert replay.differences(old, plan) == []
    recorded = replay.recorded_options(RunOptions("t.py", run_id="r", nproc_per_node="auto"), "/w")
    assert recorded["nproc_per_node"] == "auto"
    manifest = {"kind": replay.MANIFEST_KIND, "schema_version": replay.SCHEMA_VERSION, "plan": json.loads(plan.to_json()),
                "options": {k: v for k, v in recorded.items() if k not in replay.LATER_OPTION_FIELDS}}
    options, _ = replay.validate(manifest, "m.json")
    assert (options.nproc_per_node, options.module, options.secret_env) == ("auto", False, ())


def test_a_manifest_with_a_wrongly_typed_new_plan_field_is_refused():
    plan = make_plan(TWO, RunOptions("t.py", run_id="r"), probed({"g": 0, "c": 0}, {"g": 1, "c": 1}))
    options = replay.recorded_options(RunOptions("t.py", run_id="r"), "/w")
    for key, bad in (("module", "yes"), ("secret_env", "KEY"), ("script_local_rank", 1)):
        manifest = {"kind": replay.MANIFEST_KIND, "schema_version": replay.SCHEMA_VERSION, "options": options,
                    "plan": {**json.loads(plan.to_json()), key: bad}}
        with pytest.raises(replay.ManifestError, match=f"plan.{key}: expected"):
            replay.validate(manifest, "m.json")


def test_check_names_a_node_where_the_asked_count_cannot_be():
    raw = {"g": {"nvidia_gpus": 2, "cpus": 8}, "c": {"cpus": 4}}  # "x" did not answer: left to the probe's failure
    cluster = Inventory("inv.yml", "all", (GPU_NODE, CPU_NODE, Node("x", "10.0.0.3")))
    nproc, refused = check._nprocs(cluster, RunOptions("check", nproc_per_node="gpu"), raw)
    assert nproc == {"g": 2} and [(r.node, r.check, r.status) for r in refused] == [("c", "gpus", "fail")]
    assert "it has no GPU" in refused[0].found
    assert check._nprocs(cluster, RunOptions("check", nproc_per_node="auto"), raw) == ({"g": 2, "c": 4}, [])
