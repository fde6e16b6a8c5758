"""Every option means the same in every command: the parser is walked, and each command that takes
an inventory is run with the defaults of cli/config.py ($DDPFAB_INVENTORY, ddpfab.yml) and, where it
accepts them, --limit and -e; the inventory it then loads must be the one they name, limited and
with the variables. A run's record names its own inventory: stop, logs, attach and replay use it
over the defaults, and a flag over the record."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import tempfile

import pytest

from ddpfab import cli
from ddpfab.api import Cluster
from ddpfab.hosts import inventory
from ddpfab.hosts.inventory import Inventory, Node
from ddpfab.launch.replay import MANIFEST_KIND, SCHEMA_VERSION, recorded_options
from ddpfab.planning.plan import Facts, RunOptions, make_plan
from ddpfab.transfer.fetch import FetchError, check_local_dir, pick_node

#: The rest of a command line that reaches the inventory (positional arguments, a mode).
ARGS = {
    "run": ["--dry-run", "--offline", "t.py"],
    "plan": ["--offline", "t.py"],
    "check": ["--fast"],
    "sync": [],
    "fetch": ["ckpt.pt"],
    "exec": ["--", "true"],
    "hold": ["--status"],
    "export slurm": ["t.py"],
    "export pytorchjob": ["--image", "img", "t.py"],
    "export trainjob": ["--image", "img", "t.py"],
    "ps": [],
    "queue": [],
    "stop": ["r1"],
    "logs": ["r1"],
    "provision": [],
}
#: Modes of a command that load the inventory on a path of their own.
MODES = {"check --perf": ["check", "--perf"], "check --perf --history": ["check", "--perf", "--history"]}
#: Commands that take -i but plan from a run's record, which wins over the defaults (tested below).
FROM_RECORD = {"attach", "replay", "doctor", "debug", "shell"}


def leaf_parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command path, its parser) for every command that runs (argparse has no public walk)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from leaf_parsers(sub, (*path, name))
            return
    yield " ".join(path), parser


def options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings}


class Loaded(inventory.InventoryError):
    pass


#: The settings cli/config.py reads from the environment (DDPFAB_CONFIG aside).
DEFAULT_VARS = ("DDPFAB_INVENTORY", "DDPFAB_GROUP", "DDPFAB_LIMIT", "DDPFAB_SSH_CONFIG", "DDPFAB_KNOWN_HOSTS")


@pytest.fixture
def clean(monkeypatch, tmp_path):
    """No defaults from this machine: a clean directory, no DDPFAB_* settings, no config."""
    for var in DEFAULT_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("DDPFAB_CONFIG", "")
    monkeypatch.setenv("DDPFAB_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def recorder(monkeypatch, clean):
    """inventory.load records what it is asked and refuses (nothing goes further); the defaults
    come from the environment only, in a clean directory."""
    calls: list[dict] = []

    def load(source, group="all", limit=None, extra_vars=()):
        # -i is repeatable: a list of sources (one here), recorded as the one path it names
        sources = [str(s) for s in ([source] if isinstance(source, (str, os.PathLike)) else source)]
        calls.append({"source": ",".join(sources), "group": group, "limit": limit, "extra_vars": list(extra_vars or ())})
        raise Loaded(f"recorded {','.join(sources)}")

    monkeypatch.setattr(inventory, "load", load)
    return calls


def _provision_calls(monkeypatch) -> list[tuple]:
    """provision hands the inventory to ansible-playbook: what it would hand, recorded instead."""
    from ddpfab.cli import provision as provision_cli

    seen: list[tuple] = []
    monkeypatch.setattr(provision_cli, "run_playbook", lambda inv, **kw: seen.append((inv, kw["options"])) or 0)
    return seen


def test_every_inventory_command_honours_the_defaults_limit_and_extra_vars(recorder, monkeypatch, tmp_path, capsys):
    ansible = _provision_calls(monkeypatch)
    commands = dict(leaf_parsers(cli.build_parser()))
    takes_inventory = {name for name, p in commands.items() if "--inventory" in options(p)}
    assert takes_inventory == set(ARGS) | FROM_RECORD, "a command takes -i: add it to ARGS (or FROM_RECORD)"
    inv = tmp_path / "cluster.yml"
    inv.write_text("all:\n  hosts:\n    n1: {ansible_host: 10.0.0.1}\n    n2: {ansible_host: 10.0.0.2}\n")
    monkeypatch.setenv("DDPFAB_INVENTORY", str(inv))
    for name, argv in [*((n, [*n.split(), *a]) for n, a in ARGS.items()), *((m, [*a]) for m, a in MODES.items())]:
        parser = commands[" ".join(w for w in name.split() if not w.startswith("-"))]
        extra = []
        if "--limit" in options(parser):
            extra += ["--limit", "n2"]
        if "--extra-vars" in options(parser):
            extra += ["-e", "ddpfab_marker=1"]
        recorder.clear()
        ansible.clear()
        argv = [*argv[:len(name.split())], *extra, *argv[len(name.split()):]]
        code = cli.main(argv)
        err = capsys.readouterr().err
        if name == "provision":  # ansible-playbook gets the inventory, the limit and the variables
            assert code == 0 and ansible, err
            source, opts = ansible[0]
            assert (source, opts.limit, opts.extra_vars) == ([str(inv)], "n2", ("ddpfab_marker=1",)), ansible
            continue
        assert code == 2 and f"recorded {inv}" in err, (name, err)
        assert recorder[0]["source"] == str(inv), (name, recorder)
        if "--limit" in extra:
            assert recorder[0]["limit"] == "n2", (name, recorder)
        if "-e" in extra:
            assert "ddpfab_marker=1" in recorder[0]["extra_vars"], (name, recorder)


def test_the_project_config_is_a_default_of_ps_and_stop(recorder, monkeypatch, tmp_path, capsys):
    (tmp_path / "ddpfab.yml").write_text("inventory: cluster.yml\ngroup: gpus\n")
    monkeypatch.delenv("DDPFAB_CONFIG")  # the config is found in the current dir
    for argv in (["ps"], ["stop", "r1"]):
        recorder.clear()
        assert cli.main(argv) == 2
        assert recorder[0]["source"] == str(tmp_path / "cluster.yml") and recorder[0]["group"] == "gpus", recorder
        assert "-i/--inventory is required" not in capsys.readouterr().err


def _record(tmp_path, inventory_path: str) -> None:
    """runs/r1/manifest.json of a run planned on *inventory_path* (what replay validates)."""
    cluster = Inventory(inventory_path, "all", (Node("n1", "10.0.0.1"), Node("n2", "10.0.0.2")))
    options = RunOptions("t.py", run_id="r1")
    plan = make_plan(cluster, options, Facts(addresses={"n1": "10.0.0.1", "n2": "10.0.0.2"}, master_port=29500,
                                             cwd=str(tmp_path)))
    manifest = {"kind": MANIFEST_KIND, "schema_version": SCHEMA_VERSION, "run_id": "r1", "plan": plan.to_dict(),
                "options": recorded_options(options, str(tmp_path))}
    (tmp_path / "runs" / "r1").mkdir(parents=True)
    (tmp_path / "runs" / "r1" / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("command", ["stop", "logs", "attach", "replay", "doctor"])
def test_a_runs_record_wins_over_the_defaults_and_a_flag_over_the_record(command, recorder, monkeypatch, tmp_path,
                                                                         capsys):
    _record(tmp_path, str(tmp_path / "recorded.yml"))
    monkeypatch.setenv("DDPFAB_INVENTORY", str(tmp_path / "env.yml"))
    assert cli.main([command, "r1"]) == 2
    assert recorder[-1]["source"] == str(tmp_path / "recorded.yml"), recorder
    recorder.clear()
    assert cli.main([command, "-i", str(tmp_path / "flag.yml"), "r1"]) == 2
    assert recorder[-1]["source"] == str(tmp_path / "flag.yml"), recorder
    assert "Traceback" not in capsys.readouterr().err


def test_the_configs_limit_and_extra_vars_reach_provision(clean, monkeypatch):
    monkeypatch.delenv("DDPFAB_CONFIG")
    (clean / "cluster.yml").write_text("all:\n  hosts:\n    n1: {ansible_host: 10.0.0.1}\n")
    (clean / "ddpfab.yml").write_text("inventory: cluster.yml\nlimit: n1\nextra_vars: {ddpfab_python: /v/bin/python}\n")
    calls = _provision_calls(monkeypatch)
    assert cli.main(["provision", "-e", "ddpfab_x=1"]) == 0
    source, opts = calls[0]
    # the config's variables first, as one JSON -e; the command line's after them (it wins, as in Ansible)
    assert (source, opts.limit) == ([str(clean / "cluster.yml")], "n1")
    assert opts.extra_vars == (json.dumps({"ddpfab_python": "/v/bin/python"}), "ddpfab_x=1")


def test_the_fetch_a_run_suggests_fetches_from_its_rank_0_whatever_limit_picked_it(tmp_path, monkeypatch, capsys):
    # `run -l b,c` makes b rank 0; the suggested `fetch ... --rank 0` without the limit picked a
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cluster = inventory.load("a,b,c,", limit="b,c")
    plan = make_plan(cluster, RunOptions("t.py"), Facts({"b": "10.0.0.2", "c": "10.0.0.3"}, 29500, "/w"))
    Cluster(cluster, inventory=["a,b,c,"])._say_where_rank0_is(plan)
    hint = capsys.readouterr().err
    words = shlex.split(hint.split("copy results here with: ddpfab ", 1)[1].rstrip(")\n"))
    args = cli.build_parser().parse_args([w if w != "PATH" else "ckpt.pt" for w in words])
    assert pick_node(inventory.load(args.inventory, "all", limit=args.limit), args.node, args.rank).name == "b"


@pytest.mark.parametrize("command", ["stop", "attach", "logs", "doctor", "replay"])
@pytest.mark.parametrize("bad", ["../..", "..", "a/b", ".", "", "x\ny", "-x"])
def test_every_run_id_argument_is_a_run_id_or_exit_2(command, bad, capsys):
    """A RUN_ID names runs/<id> here and ~/.ddpfab/runs/<id> on the nodes: `logs ../..` read each
    node's ~/output.log and wrote it outside ./runs. Each command checks it as --run-id does."""
    with pytest.raises(SystemExit) as exc:
        cli.build_parser().parse_args([command, "--", bad] if bad.startswith("-") else [command, bad])
    assert exc.value.code == 2
    assert "run id" in capsys.readouterr().err
    assert cli.build_parser().parse_args([command, "20261202-213851-8c6937"]).run_id == "20261202-213851-8c6937"


@pytest.mark.parametrize("command", [["run"], ["plan"], ["export", "slurm"], ["export", "pytorchjob", "--image", "i"]])
def test_a_missing_script_names_the_script_alone(command, capsys):
    """A script's arguments are optional: argparse used to name them as required beside it."""
    with pytest.raises(SystemExit) as exc:
        cli.build_parser().parse_args([*command, "-i", "inv.yml"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.rstrip().endswith("the following arguments are required: script")
    args = cli.build_parser().parse_args([*command, "-i", "inv.yml", "train.py", "--epochs", "3"])
    assert (args.script, args.args) == ("train.py", ["--epochs", "3"])
    assert cli.build_parser().parse_args([*command, "-i", "inv.yml", "train.py"]).args == []


@pytest.mark.parametrize("command", [["run", "-i", "x,", "t.py"], ["ps"], ["logs", "20261202-213851-8c6937"],
                                     ["replay", "20261202-213851-8c6937"], ["check", "-i", "x,", "--perf"]])
def test_the_runs_dir_has_one_meaning_in_every_command(command, capsys, monkeypatch):
    """'~' is the home in every command (quoted, it made a ./~ dir and printed ~/x); empty is refused
    (the run dirs went straight into the current directory)."""
    args = cli.build_parser().parse_args([command[0], "--runs-dir", "~/recs", *command[1:]])
    assert args.runs_dir == os.path.expanduser("~/recs")
    with pytest.raises(SystemExit) as exc:
        cli.build_parser().parse_args([command[0], "--runs-dir", "", *command[1:]])
    assert exc.value.code == 2 and "--runs-dir: is empty" in capsys.readouterr().err


def test_emit_names_an_empty_dir_and_a_link_for_what_they_are(tmp_path, capsys):
    from ddpfab.planning import emit

    with pytest.raises(SystemExit) as exc:
        cli.build_parser().parse_args(["plan", "-i", "x,", "--emit", "", "t.py"])
    assert exc.value.code == 2 and "--emit: is empty" in capsys.readouterr().err
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(emit.EmitError, match="is a symbolic link; give the directory itself"):
        emit.write(None, str(tmp_path / "link"), {})
    assert list((tmp_path / "real").iterdir()) == []


def test_ddpfab_runs_dir_means_the_same_in_the_cli_and_the_api(monkeypatch):
    from ddpfab.api import Options

    monkeypatch.setenv("DDPFAB_RUNS_DIR", "~/rr")
    assert cli.build_parser().parse_args(["ps"]).runs_dir == Options().runs_dir == os.path.expanduser("~/rr")
    monkeypatch.setenv("DDPFAB_RUNS_DIR", "")  # set but empty: as unset, not a refusal of a flag never given
    assert cli.build_parser().parse_args(["ps"]).runs_dir == Options().runs_dir == "runs"


def _as_nobody(fn) -> str:
    """*fn*'s result (a string) when run in a child process as the user nobody."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: modules are imported already, so no file of the checkout is read as nobody
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            os.write(write, fn().encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as fh:
        out = fh.read()
    os.waitpid(pid, 0)
    return out


def test_fetch_into_a_dir_this_user_cannot_write_is_refused_before_any_host_is_asked():
    """rsync's failure to write here was reported as 'host node1: rsync failed'."""
    def verdict(path: str) -> str:
        try:
            check_local_dir(path)
        except FetchError as exc:
            return str(exc)
        return "ok"

    dirs = [tempfile.mkdtemp(dir="/tmp") for _ in range(2)]
    try:
        os.chmod(dirs[0], 0o755)  # root's: nobody cannot write in it, nor make a dir below it
        os.chmod(dirs[1], 0o777)
        assert _as_nobody(lambda: verdict(f"{dirs[0]}/out")) == f"LOCAL_DIR {dirs[0]}/out: {dirs[0]} is not writable " \
                                                                "here (by nobody); give another LOCAL_DIR"
        assert _as_nobody(lambda: verdict(dirs[0])).startswith(f"LOCAL_DIR {dirs[0]}: {dirs[0]} is not writable")
        assert _as_nobody(lambda: verdict(f"{dirs[1]}/out")) == "ok"
    finally:
        for d in dirs:
            shutil.rmtree(d)


@pytest.mark.parametrize("command", ["stop", "logs", "doctor"])
def test_a_runs_recorded_extra_vars_take_a_flags_over_them_and_a_masked_one_given_again(command, recorder, clean,
                                                                                          monkeypatch, capsys):
    """`stop RUN_ID` reaches the nodes as the run did (its -e, recorded); a -e given to it wins, and
    is how a variable the record masks (a secret) is given again. The project config's -e, which
    the record holds as the run had it, is not applied a second time over it."""
    _record(clean, str(clean / "recorded.yml"))
    path = clean / "runs" / "r1" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["extra_vars"] = {"ansible_port": 2222, "ansible_user": "alice", "vault_pass": "***"}
    path.write_text(json.dumps(manifest))
    (clean / "ddpfab.yml").write_text("extra_vars: {ansible_user: carol}\n")
    monkeypatch.delenv("DDPFAB_CONFIG")  # the config is found in the current dir
    assert cli.main([command, "r1"]) == 2
    assert recorder[-1]["extra_vars"] == [{"ansible_port": 2222, "ansible_user": "alice"}], recorder
    assert "vault_pass are recorded masked" in capsys.readouterr().err
    recorder.clear()
    assert cli.main([command, "-e", "ansible_user=bob", "-e", "vault_pass=s3", "r1"]) == 2
    assert recorder[-1]["extra_vars"] == [{"ansible_port": 2222, "ansible_user": "bob", "vault_pass": "s3"}], recorder
    assert "recorded masked" not in capsys.readouterr().err


def test_a_value_the_record_masks_comes_from_the_project_config_when_it_has_one(recorder, clean, monkeypatch,
                                                                                capsys):
    _record(clean, str(clean / "recorded.yml"))
    path = clean / "runs" / "r1" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["extra_vars"] = {"ansible_user": "alice", "vault_pass": "***"}
    path.write_text(json.dumps(manifest))
    (clean / "ddpfab.yml").write_text("extra_vars: {ansible_user: carol, vault_pass: from-config}\n")
    monkeypatch.delenv("DDPFAB_CONFIG")
    assert cli.main(["stop", "r1"]) == 2
    assert recorder[-1]["extra_vars"] == [{"ansible_user": "alice", "vault_pass": "from-config"}], recorder
    err = capsys.readouterr().err
    assert "recorded masked" not in err and "from-config" not in err


@pytest.mark.parametrize("command", [["check"], ["run", "t.py"], ["ps"], ["exec", "--", "true"]])
def test_a_missing_inventory_says_which_default_named_it(command, clean, monkeypatch, capsys):
    """`DDPFAB_INVENTORY=/tmp/gone.yml ddpfab check` said only `inventory /tmp/gone.yml: no such
    file or directory`, which a user who never typed that path cannot place."""
    (clean / "t.py").write_text("pass\n")
    monkeypatch.setenv("DDPFAB_INVENTORY", str(clean / "gone.yml"))
    assert cli.main(command) == 2
    assert "gone.yml: no such file or directory (named by $DDPFAB_INVENTORY" in capsys.readouterr().err
    monkeypatch.delenv("DDPFAB_INVENTORY")
    monkeypatch.delenv("DDPFAB_CONFIG")
    (clean / "ddpfab.yml").write_text("inventory: lost.yml\n")
    assert cli.main(command) == 2
    assert f"lost.yml: no such file or directory (named by `inventory:` in {clean / 'ddpfab.yml'}" in capsys.readouterr().err
    assert cli.main([*command[:1], "-i", "typed.yml", *command[1:]]) == 2
    assert capsys.readouterr().err.rstrip().endswith("typed.yml: no such file or directory")  # (a file's name: no host hint)
