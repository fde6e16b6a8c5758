"""ddpfab.api without a network: the one mapping from the command line to the API's options, and
the options' own rules. (The API on real hosts: tests/lab/test_api.py.)"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import fields

import pytest

from ddpfab import cli
from ddpfab.api import Cluster, Options, planner_options
from ddpfab.cli import run as run_cli
from ddpfab.hosts import inventory
from ddpfab.planning import render
from ddpfab.planning.plan import PlanError

from .test_cli_defaults import leaf_parsers

#: `run` options that are not the run's but say which nodes and how to reach them (Cluster.load's),
#: or how the command prints (--json), and the positionals (the script and its arguments).
NOT_RUN_OPTIONS = {"inventory", "group", "limit", "extra_vars", "accept_new_host_keys", "known_hosts", "ssh_config",
                   "json", "script", "args", "help", "no_color"}


def test_every_run_option_is_an_api_option_and_every_api_option_a_run_option():
    parser = dict(leaf_parsers(cli.build_parser()))["run"]
    dests = {a.dest for a in parser._actions} - NOT_RUN_OPTIONS
    negated = set(run_cli.NEGATED)
    names = {f.name for f in fields(Options)}
    assert sorted(dests - negated - names) == []  # a new flag needs its Options field
    assert {run_cli.NEGATED[d] for d in dests & negated} | (dests - negated) | {"color"} == names


def test_the_command_line_and_keywords_make_the_same_options(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text("")
    args = cli.build_parser().parse_args(
        ["run", "-i", "a,", "--nproc-per-node", "2", "--env", "A=1", "--no-sync", "--no-check", "--no-forward-env",
         "--replicate", "ck.pt", "--max-job-restarts", "1", "--retry-on", "script", "--no-color", "--run-id", "r1",
         "t.py", "x"])
    assert run_cli.options(args) == Options(
        nproc_per_node=2, env=("A=1",), sync=False, check=False, forward_env=False, replicate=("ck.pt",),
        max_job_restarts=1, retry_on=("script",), color=False, run_id="r1", runs_dir=args.runs_dir)
    planned = planner_options(args.script, args.args, run_cli.options(args))
    assert planned == planner_options("t.py", ["x"], Options.of(
        nproc_per_node=2, env={"A": "1"}, forward_env=False, run_id="r1"))
    assert planned.env == (("A", "1"),) and planned.args == ("x",)


def test_options_name_a_misspelt_keyword_and_env_layers_in_the_command_lines_order(tmp_path, monkeypatch):
    with pytest.raises(PlanError, match="'nproc_per_nod'.*nproc_per_node"):
        Options.of(nproc_per_nod=2)
    env_file = tmp_path / "env"
    env_file.write_text("A=file\nB=file\n")
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    monkeypatch.setenv("SECRET", "s3")
    pairs = dict(Options.of(env_file=[str(env_file)], env=["B=flag", "SECRET"]).env_pairs())
    assert pairs == {"NCCL_DEBUG": "WARN", "A": "file", "B": "flag", "SECRET": "s3"}
    assert "NCCL_DEBUG" not in dict(Options.of(forward_env=False).env_pairs())
    with pytest.raises(PlanError, match="env file"):
        Options.of(env_file=[str(tmp_path / "missing")]).env_pairs()


def test_refusals_before_any_host_is_contacted_are_the_commands(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    cluster = Cluster(inventory.load("192.0.2.1,192.0.2.2,"))  # TEST-NET: nothing answers there
    with pytest.raises(PlanError, match="did you mean 'train.py'"):
        cluster.run("trian.py")
    with pytest.raises(PlanError, match="not a TCP port"):
        cluster.run("train.py", master_port=70000)
    with pytest.raises(PlanError, match="retry_on nodes: expected one of"):
        cluster.run("train.py", retry_on=["nodes"])
    with pytest.raises(PlanError, match="given twice"):
        cluster.run("train.py", (), Options(), nproc_per_node=1)
    with pytest.raises(PlanError, match="list of words"):
        cluster.run("train.py", "--lr 1")
    (tmp_path / "adir").mkdir()  # was "not found in the nodes' workdir; sync the code first" from every node
    for script, module, says in (("adir", False, "a directory without a __main__.py"), ("", False, "empty name"),
                                 ("", True, "expected a module name"), ("a..b", True, "expected a module name"),
                                 ("pkg/train", True, "expected a module name")):
        with pytest.raises(PlanError, match=says):
            cluster.run(script, module=module, dry_run=True, offline=True)
    (tmp_path / "adir" / "__main__.py").write_text("")  # python runs a directory by its __main__.py
    assert cluster.run("adir", dry_run=True, offline=True).exit_code == 0
    (tmp_path / "afile").write_text("")  # a file where the run records go (was a NotADirectoryError traceback)
    for runs_dir, dry in (("afile", False), ("afile/sub", False), ("afile", True)):
        with pytest.raises(PlanError, match="afile is not a directory"):
            cluster.run("train.py", runs_dir=str(tmp_path / runs_dir), dry_run=dry, offline=dry)
    # offline, the dry run plans without a host
    outcome = cluster.run("train.py", ["--lr", "{{node_rank}}"], dry_run=True, offline=True, master_port=29999)
    assert outcome.exit_code == 0 and outcome.manifest is None
    assert [render.argv(outcome.plan, n)[-2:] for n in outcome.plan.nodes] == [("--lr", "0"), ("--lr", "1")]
    assert outcome.plan.master_port == 29999


def test_import_ddpfab_loads_no_api_and_ddpfab_cluster_no_ssh_stack():
    code = ("import sys; import ddpfab; assert 'ddpfab.api' not in sys.modules; c = ddpfab.Cluster; "
            "print(c.__module__, sorted(m for m in ('paramiko', 'fabric', 'ansible') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["ddpfab.api", "[]"]


def test_bytes_that_are_not_utf8_are_refused_by_name_not_by_a_traceback(tmp_path, monkeypatch, capsys):
    """A shell hands python undecodable bytes as surrogates: the manifest's write, the env's
    encoding and exec's channel each failed with a traceback (or 'unreachable')."""
    bad = (tmp_path / "bad").as_posix()
    (tmp_path / "bad").write_bytes(b"X=\xff\n")
    with pytest.raises(PlanError, match=r"env file .*bad: not UTF-8 text \(byte 0xff at offset 2\)"):
        Options.of(env_file=[bad]).env_pairs()
    (tmp_path / "bom").write_bytes(b"\xef\xbb\xbfFOO=1\n")
    assert dict(Options.of(env_file=[str(tmp_path / "bom")], forward_env=False).env_pairs()) == {"FOO": "1"}
    word = b"\xff".decode("utf-8", "surrogateescape")
    for argv in (["run", "-i", "n1,", "t.py", word], ["run", "-i", "n1,", "--env", "X=" + word, "t.py"],
                 ["exec", "-i", "n1,", "--", "echo " + word]):
        assert cli.unguarded_main(argv) == 2
        assert "is not UTF-8 text" in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ddpfab.yml").write_bytes(b"inventory: \xff\n")
    assert cli.unguarded_main(["plan", "--offline", "t.py"]) == 2
    assert "ddpfab.yml: cannot be read" in capsys.readouterr().err


def test_a_run_that_syncs_from_a_home_is_refused_in_the_dry_run_too(tmp_path, monkeypatch):
    """The real run refused it with a SyncError traceback; the dry run let it pass."""
    home = tmp_path / "h"
    home.mkdir()
    (home / "t.py").write_text("")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(home)
    cluster = Cluster.load("n1,", say=lambda line: None)
    for dry in (dict(dry_run=True, offline=True), dict(dry_run=True), {}):
        with pytest.raises(PlanError, match="refusing to sync from .*it is a home directory"):
            cluster.run("t.py", runs_dir=str(tmp_path / "runs"), **dry)
    assert cluster.run("t.py", runs_dir=str(tmp_path / "runs"), dry_run=True, offline=True, sync=False).exit_code == 0
