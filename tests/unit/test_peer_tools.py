"""What users of the peer tools bring: Ansible host lists and -e/--limit, pdsh ranges, DeepSpeed
hostfiles, per-host env and GPU lists, placeholders in script args, legacy --local_rank scripts,
flags > env > config defaults, shell completion, the CLI's --json and did-you-mean rules.
(No hosts: Ansible parses, the planner plans; the lab tests run the same on real hosts.)"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10: pytest itself brings tomli there
    import tomli as tomllib

from ddpfab import cli
from ddpfab.api import planner_options
from ddpfab.cli import completion, config
from ddpfab.cli import run as run_cli
from ddpfab.hosts import inventory
from ddpfab.hosts.inventory import Inventory, InventoryError, Node
from ddpfab.planning import render
from ddpfab.planning.plan import Facts, PlanError, RunOptions, make_plan

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("DDPFAB_INVENTORY", raising=False)
    monkeypatch.setenv("DDPFAB_CONFIG", "")


# -- inventories --------------------------------------------------------------------------------
def test_pdsh_ranges_expand_with_padding_lists_and_several_brackets():
    assert inventory.expand_ranges("node[01-04]") == ["node01", "node02", "node03", "node04"]
    assert inventory.expand_ranges("n[1-2,5]") == ["n1", "n2", "n5"]
    assert inventory.expand_ranges("r[1-2]n[8-9]") == ["r1n8", "r1n9", "r2n8", "r2n9"]
    assert inventory.expand_ranges("gpu[1:3]") == ["gpu1", "gpu2", "gpu3"]
    with pytest.raises(InventoryError, match="counts down"):
        inventory.expand_ranges("n[4-1]")
    with pytest.raises(InventoryError, match="expected digits"):
        inventory.expand_ranges("n[a-c]")


def test_host_lists_load_in_order_single_host_needs_the_comma():
    assert [n.name for n in inventory.load("b1,a2,").nodes] == ["b1", "a2"]
    assert [n.name for n in inventory.load("solo,").nodes] == ["solo"]
    assert [n.name for n in inventory.load("node[01-03],x9").nodes] == ["node01", "node02", "node03", "x9"]
    with pytest.raises(InventoryError, match="a host list ends with a comma"):
        inventory.load("solo")
    with pytest.raises(InventoryError, match="more than once"):
        inventory.load("a,a,")
    with pytest.raises(InventoryError, match="not a host name"):
        inventory.load("a,b;rm -rf,")


def test_hostfile_slots_become_each_hosts_nproc(tmp_path):
    hf = tmp_path / "hostfile"
    hf.write_text("# DeepSpeed hostfile\nworker-1 slots=4\nworker-2 slots=2 max_slots=8\n\nworker-3\n")
    nodes = inventory.load(str(hf)).nodes
    assert [(n.name, n.nproc) for n in nodes] == [("worker-1", 4), ("worker-2", 2), ("worker-3", None)]
    plan = make_plan(Inventory(str(hf), "all", nodes), RunOptions("t.py"), _facts(nodes))
    assert [n.nproc for n in plan.nodes] == [4, 2, 1] and plan.world_size == 7
    # an INI inventory without slots= stays an Ansible inventory
    ini = tmp_path / "hosts.ini"
    ini.write_text("[gpus]\nworker-1\nworker-2\n")
    assert ini.as_posix() == inventory.ansible_source(str(ini))
    assert inventory.parse_hostfile("a slots=2\n[group]\n") is None


def test_limit_keeps_group_order_and_suggests_on_no_match(tmp_path):
    inv = tmp_path / "inv.yml"
    inv.write_text("all:\n  children:\n    rack1: {hosts: {n1: {}, n2: {}}}\n    rack2: {hosts: {n3: {}, n4: {}}}\n")
    assert [n.name for n in inventory.load(str(inv), limit="n4:n1").nodes] == ["n1", "n4"]
    assert [n.name for n in inventory.load(str(inv), limit="all:!rack1").nodes] == ["n3", "n4"]
    assert [n.name for n in inventory.load(str(inv), "rack2", limit="n*").nodes] == ["n3", "n4"]
    with pytest.raises(InventoryError, match=r"matches no host.*did you mean 'rack1'"):
        inventory.load(str(inv), limit="rakc1")
    with pytest.raises(InventoryError, match=r"no group 'rak2' \(did you mean 'rack2'"):
        inventory.load(str(inv), "rak2")


def test_extra_vars_override_every_host_like_ansibles_e(tmp_path):
    inv = tmp_path / "inv.yml"
    inv.write_text("all:\n  vars: {ddpfab_python: /usr/bin/python3}\n  hosts: {n1: {ddpfab_nproc_per_node: 2}, n2: {}}\n")
    vars_file = tmp_path / "v.yml"
    vars_file.write_text("ddpfab_workdir: /opt/code\n")
    nodes = inventory.load(str(inv), extra_vars=["ddpfab_python=/opt/venv/bin/python", f"@{vars_file}",
                                                 '{"ddpfab_nproc_per_node": 3}']).nodes
    assert {n.python for n in nodes} == {"/opt/venv/bin/python"}
    assert {n.workdir for n in nodes} == {"/opt/code"} and {n.nproc for n in nodes} == {3}
    with pytest.raises(InventoryError, match="expected KEY=VALUE"):
        inventory.load(str(inv), extra_vars=["justaword"])


def test_per_host_env_and_gpu_lists_reach_the_plan(tmp_path):
    inv = tmp_path / "inv.yml"
    inv.write_text(
        "all:\n"
        "  vars: {ddpfab_env: {NCCL_IB_HCA: mlx5_0, SHARED: group}}\n"
        "  hosts:\n"
        "    a: {ddpfab_gpu_ids: [0, 2], ddpfab_env: {NCCL_IB_HCA: mlx5_1, ONLY_A: 'yes'}}\n"
        "    b: {ddpfab_gpu_ids: '1'}\n"
        "    c: {ddpfab_gpu_ids: [0, 1, 2], ddpfab_nproc_per_node: 1}\n")
    nodes = inventory.load(str(inv)).nodes
    plan = make_plan(Inventory(str(inv), "all", nodes), RunOptions("t.py", env=(("SHARED", "cli"),)), _facts(nodes))
    a, b, c = plan.nodes
    assert (a.nproc, b.nproc, c.nproc) == (2, 1, 1)  # the list's length, unless nproc is set
    assert a.env["CUDA_VISIBLE_DEVICES"] == "0,2" and b.env["CUDA_VISIBLE_DEVICES"] == "1"
    # Ansible's precedence: a's ddpfab_env replaces the group's; the command line wins over both
    assert (a.env["NCCL_IB_HCA"], a.env["ONLY_A"], a.env["SHARED"]) == ("mlx5_1", "yes", "cli")
    assert b.env["NCCL_IB_HCA"] == "mlx5_0" and "ONLY_A" not in b.env
    assert "CUDA_VISIBLE_DEVICES=0,2" in render.shell_line(plan, a)
    bad = tmp_path / "bad.yml"
    bad.write_text("all: {hosts: {a: {ddpfab_env: {'BAD KEY': 1}}}}\n")
    with pytest.raises(InventoryError, match="not an environment variable name"):
        inventory.load(str(bad))
    bad.write_text("all: {hosts: {a: {ddpfab_gpu_ids: [0, 0]}}}\n")
    with pytest.raises(InventoryError, match="lists a GPU twice"):
        inventory.load(str(bad))


# -- plan: placeholders and the legacy launcher -------------------------------------------------
def _nodes(n=3):
    return tuple(Node(name=f"n{i}", host=f"10.0.0.{i}", data_addr=f"10.0.0.{i}") for i in range(1, n + 1))


def _facts(nodes):
    return Facts(addresses={n.name: f"10.0.0.{i}" for i, n in enumerate(nodes, 1)}, master_port=29511, cwd="/w")


def test_placeholders_expand_per_node_and_survive_replay():
    nodes = _nodes()
    args = ("--out", "ckpt/{{node_rank}}-of-{{ nnodes }}", "--peer={{master_addr}}:{{master_port}}",
            "{{run_id}}/{{node_name}}/{{nproc}}/{{world_size}}", "{not_a_placeholder}", "$NODE_RANK")
    plan = make_plan(Inventory("x", "all", nodes), RunOptions("t.py", args=args, run_id="r1"), _facts(nodes))
    for node in plan.nodes:
        argv = render.argv(plan, node)
        tail = list(argv[argv.index("t.py") + 1:])
        assert tail == ["--out", f"ckpt/{node.node_rank}-of-3", "--peer=10.0.0.1:29511",
                        f"r1/{node.name}/1/3", "{not_a_placeholder}", "$NODE_RANK"]
    assert plan.args == args  # the template is recorded; each node's argv holds its values
    # replay re-plans from the recorded options (the template), under a new run id and port
    again = make_plan(Inventory("x", "all", nodes), RunOptions("t.py", args=plan.args, run_id="r2"),
                      dataclasses.replace(_facts(nodes), master_port=29600))
    assert render.argv(again, again.nodes[2])[-4:] == ("--peer=10.0.0.1:29600", "r2/n3/1/3", "{not_a_placeholder}", "$NODE_RANK")
    with pytest.raises(PlanError, match=r"\{\{node_rnk\}\} is unknown \(did you mean 'node_rank'"):
        make_plan(Inventory("x", "all", nodes), RunOptions("t.py", args=("{{node_rnk}}",)), _facts(nodes))
    with pytest.raises(PlanError, match="needs rdzv='static'"):
        make_plan(Inventory("x", "all", nodes), RunOptions("t.py", args=("{{node_rank}}",), rdzv="c10d"), _facts(nodes))


def test_legacy_launcher_passes_the_spelling_the_script_declares(tmp_path, monkeypatch):
    nodes = _nodes(2)
    dash = make_plan(Inventory("x", "all", nodes), RunOptions("t.py", args=("--a",), launcher="legacy"), _facts(nodes))
    argv = render.argv(dash, dash.nodes[0])
    assert "--use-env" not in argv and argv[-2:] == ("t.py", "--a")
    under = make_plan(Inventory("x", "all", nodes), RunOptions("t.py", args=("--a",), launcher="legacy",
                                                             local_rank_arg="--local_rank"), _facts(nodes))
    argv = render.argv(under, under.nodes[0])
    assert argv[1:3] == ("-m", "torch.distributed.launch")
    assert argv[-4:] == ("--use-env", "t.py", "--local_rank=${local_rank}", "--a")
    # the CLI reads the script to pick the spelling
    monkeypatch.chdir(tmp_path)
    (tmp_path / "old.py").write_text('p.add_argument("--local_rank", type=int)\n')
    (tmp_path / "new.py").write_text('p.add_argument("--local-rank", "--local_rank", type=int)\n')
    for script, want in (("old.py", "--local_rank"), ("new.py", "--local-rank"), ("missing.py", "--local-rank")):
        args = cli.build_parser().parse_args(["run", "-i", "a,", "--launcher", "legacy", script])
        assert planner_options(args.script, args.args, run_cli.options(args)).local_rank_arg == want
    args = cli.build_parser().parse_args(["run", "-i", "a,", "--launcher", "legacy",
                                          "--local-rank-style", "underscore", "new.py"])
    assert planner_options(args.script, args.args, run_cli.options(args)).local_rank_arg == "--local_rank"


# -- defaults: flags > env > config -------------------------------------------------------------
def test_flags_win_over_environment_over_project_config(tmp_path, monkeypatch):
    proj = tmp_path / "proj"
    (proj / "sub").mkdir(parents=True)
    (proj / "ddpfab.yml").write_text("inventory: inv/cluster.yml\ngroup: gpus\nlimit: 'gpus:!n9'\n"
                                     "extra_vars: {ddpfab_python: /opt/v/bin/python}\n")
    monkeypatch.delenv("DDPFAB_CONFIG")
    ns = argparse.Namespace(_cluster_args=True, inventory=None, group=None, limit=None, extra_vars=["k=v"])
    config.apply(ns, environ={}, cwd=str(proj / "sub"))  # found in a parent dir
    # -i is repeatable: a default is the one-item list a single -i gives
    assert ns.inventory == [str(proj / "inv/cluster.yml")] and ns.group == "gpus" and ns.limit == "gpus:!n9"
    assert ns.extra_vars == [{"ddpfab_python": "/opt/v/bin/python"}, "k=v"]  # -e after: it wins
    ns = argparse.Namespace(_cluster_args=True, inventory=None, group=None, limit=None)
    config.apply(ns, environ={"DDPFAB_INVENTORY": "a,b,", "DDPFAB_GROUP": "all"}, cwd=str(proj))
    assert (ns.inventory, ns.group) == (["a,b,"], "all")
    ns = argparse.Namespace(_cluster_args=True, inventory=["flag.yml"], group="g", limit=None)
    config.apply(ns, environ={"DDPFAB_INVENTORY": "env.yml"}, cwd=str(proj))
    assert (ns.inventory, ns.group) == (["flag.yml"], "g")
    (proj / "ddpfab.yml").write_text("inventroy: x.yml\n")
    with pytest.raises(config.ConfigError, match=r"unknown setting 'inventroy' \(did you mean 'inventory'"):
        config.apply(argparse.Namespace(_cluster_args=True, inventory=None), environ={}, cwd=str(proj))


def test_no_inventory_anywhere_is_one_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["check"]) == 2
    err = capsys.readouterr().err
    assert err.count("ddpfab: error:") == 1 and "DDPFAB_INVENTORY" in err and "ddpfab.yml" in err


# -- CLI polish -------------------------------------------------------------------------------
def test_json_without_dry_run_starts_nothing(capsys):
    assert cli.main(["run", "-i", "a,b,", "--json", "t.py"]) == 2
    err = capsys.readouterr().err
    assert "needs --dry-run" in err and "nothing was started" in err


def test_a_mistyped_script_gets_a_suggestion_before_any_connection(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    # hosts that do not exist: the error must come before any connection is tried
    assert cli.main(["run", "-i", "nohost1.invalid,nohost2.invalid,", "trian.py"]) == 2
    err = capsys.readouterr().err
    assert "script trian.py not found" in err and "did you mean 'train.py'" in err
    assert err.count("\n") == 1


def test_every_option_has_help():
    def walk(parser, path):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from walk(sub, f"{path} {name}")
            elif not isinstance(action, (argparse._HelpAction, argparse._VersionAction)) and action.dest != "command":
                yield path, action

    missing = [f"{p}: {a.option_strings or a.dest}" for p, a in walk(cli.build_parser(), "ddpfab")
               if not a.help and a.option_strings]
    assert missing == []


def test_completion_completes_commands_options_and_files(tmp_path):
    # bash's function; zsh's native one, and both shells' registration: tests/unit/test_completion.py
    text = completion.script(cli.build_parser(), "bash")
    (tmp_path / "train.py").write_text("")
    probe = (f"{text}\n"
             "complete_at() { COMP_WORDS=(\"$@\"); COMP_CWORD=$(($# - 1)); _ddpfab_complete; echo \"${COMPREPLY[*]}\"; }\n"
             "complete_at ddpfab pro\ncomplete_at ddpfab run --lim\ncomplete_at ddpfab lab u\n"
             "complete_at ddpfab provision --ask-b\ncomplete_at ddpfab run tra\n")
    out = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, cwd=tmp_path, check=True).stdout
    assert out.splitlines() == ["provision", "--limit", "up", "--ask-become-pass", "train.py"]
    assert cli.main(["completion", "bash"]) == 0


# -- packaging, lab python, progress lines ------------------------------------------------------
def test_collection_metadata_matches_the_package():
    import yaml

    from ddpfab import __version__
    from ddpfab.remote import provision

    galaxy = yaml.safe_load((provision.collection_dir() / "galaxy.yml").read_text())
    assert (galaxy["namespace"], galaxy["name"], galaxy["version"]) == ("ddpfab", "cluster", __version__)
    assert galaxy["license"] == ["Apache-2.0"]
    # the project URLs: all four, one repository, the same in the package's and the collection's metadata
    urls = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["urls"]
    assert set(urls) == {"Homepage", "Documentation", "Issues", "Source"}
    assert all(u.startswith(urls["Source"]) for u in urls.values()), urls
    assert (galaxy["repository"], galaxy["homepage"], galaxy["documentation"], galaxy["issues"]) == (
        urls["Source"], urls["Homepage"], urls["Documentation"], urls["Issues"])
    for meta in (provision.collection_dir() / "roles").glob("*/meta/main.yml"):
        assert yaml.safe_load(meta.read_text())["galaxy_info"]["license"] == "Apache-2.0", meta
    assert "Apache License" in (REPO / "LICENSE").read_text()[:200]
    assert (REPO / "ddpfab" / "py.typed").is_file()


def test_lab_nodes_get_this_python_with_torch_else_the_provisioned_venv(monkeypatch):
    import importlib.util

    from ddpfab import lab

    assert lab.node_python("/x/bin/python") == ("/x/bin/python", "--python")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "torch" else real(name))
    python, why = lab.node_python(None)
    assert python == "/opt/ddpfab/venv/bin/python" and "ddpfab provision" in why


def test_progress_lines_come_while_working_and_stop_with_the_work():
    import io
    import time

    from ddpfab.launch.progress import Ticker

    out = io.StringIO()
    with Ticker(lambda s: f"copying, {s:.0f} s", enabled=True, every=0.05, stream=out):
        time.sleep(0.3)
    lines = out.getvalue().splitlines()
    assert lines and all(ln.startswith("ddpfab: copying, ") for ln in lines)
    time.sleep(0.2)
    assert out.getvalue().splitlines() == lines  # nothing after the work ended
    quiet = io.StringIO()
    with Ticker(lambda s: "x", enabled=False, every=0.01, stream=quiet):
        time.sleep(0.1)
    assert quiet.getvalue() == ""
