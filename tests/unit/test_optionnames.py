"""An option named in a message is spelled as its reader writes it: a library caller reads the
field of :class:`ddpfab.api.Options` (``hang_timeout``), a command-line user the flag
(``--hang-timeout``); the library decides the message, the CLI only the spelling."""

from __future__ import annotations

from dataclasses import fields

import pytest

from ddpfab import cli
from ddpfab.api import Cluster, Options
from ddpfab.cli import run as run_cli
from ddpfab.hosts import inventory
from ddpfab.optionnames import option, python_name, spelled_by
from ddpfab.planning.plan import PlanError

from .test_cli_defaults import leaf_parsers, options


def test_every_option_the_command_line_spells_is_one_of_its_flags():
    run_flags = options(dict(leaf_parsers(cli.build_parser()))["run"])
    for field in fields(Options):
        assert run_cli.flag(field.name) in run_flags, field.name
        if field.type == "bool":
            assert run_cli.flag(field.name, False if field.default else True) in run_flags, field.name


def test_values_and_negations_read_as_each_reader_writes_them():
    assert [python_name("exit_guard", "off"), python_name("sync", False), python_name("runs_dir")] == [
        "exit_guard='off'", "sync=False", "runs_dir"]
    assert [run_cli.flag("exit_guard", "off"), run_cli.flag("sync", False), run_cli.flag("runs_dir"),
            run_cli.flag("wait", True), run_cli.flag("env", "A=b c"), run_cli.flag("extra_vars")] == [
        "--exit-guard off", "--no-sync", "--runs-dir", "--wait", "--env 'A=b c'", "-e"]
    assert option("hang_timeout") == "hang_timeout"
    with spelled_by(run_cli.flag):
        assert option("hang_timeout") == "--hang-timeout"
    assert option("hang_timeout") == "hang_timeout"  # only within


def test_a_library_caller_reads_field_names_and_the_command_line_user_flags(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    cluster = Cluster(inventory.load("192.0.2.1,192.0.2.2,"))  # TEST-NET: nothing answers there
    with pytest.raises(PlanError) as raised:
        cluster.run("train.py", hang_timeout=-1, dry_run=True, offline=True)
    assert str(raised.value).startswith("hang_timeout must be") and "--" not in str(raised.value)
    code = cli.main(["plan", "-i", "192.0.2.1,192.0.2.2,", "--offline", "--hang-timeout", "-1", "train.py"])
    err = capsys.readouterr().err
    assert code != 0 and "--hang-timeout must be" in err and "hang_timeout" not in err


def test_a_command_whose_own_no_flag_negates_a_keyword_spells_it_so(tmp_path, monkeypatch, capsys):
    """sync's ``wait=False`` is its ``--no-wait``, while run's ``wait`` stays ``--wait``; replay's
    new id is named ``--new-run-id``, never ``--run-id`` (which replay has not)."""
    parser = cli.build_parser()
    sync_speller = run_cli.speller(parser.parse_args(["sync", "-i", "h1,"]))
    assert [sync_speller("wait", False), sync_speller("wait", True), sync_speller("sync", False)] == [
        "--no-wait", "without --no-wait", "--no-sync"]
    assert run_cli.speller(parser.parse_args(["run", "-i", "h1,", "t.py"]))("wait", True) == "--wait"
    assert run_cli.speller(parser.parse_args(["replay", "r1"]))("run_id") == "--new-run-id"
    monkeypatch.chdir(tmp_path)
    code = cli.main(["replay", "some-run", "--new-run-id", "../up"])
    err = capsys.readouterr().err
    assert code != 0 and "--new-run-id '../up': expected" in err, err
    with pytest.raises(PlanError, match=r"^new_run_id '\.\./up'"):
        Cluster(inventory.load("192.0.2.1,")).replay("some-run", new_run_id="../up", runs_dir=tmp_path)
