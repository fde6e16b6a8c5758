"""The node's python and environment (ddpfab.hosts.nodeenv): decided once, by one rule, rendered the
same everywhere. The node side runs for real here: the shell ddpfab sends (sh), the node program
started by it, a venv made by the test."""

from __future__ import annotations

import os
import subprocess
import venv
from dataclasses import replace
from pathlib import Path

import pytest

from ddpfab.remote import nodeprogram as nodeprog
from ddpfab.cli import main as cli_main
from ddpfab.health import check
from ddpfab.hosts import nodeenv
from ddpfab.hosts.inventory import Inventory, InventoryError, Node, load
from ddpfab.node import ops
from ddpfab.planning import render
from ddpfab.planning.export import ExportError, to_sbatch
from ddpfab.planning.plan import Facts, RunOptions, make_plan
from ddpfab.health.probe import decide, to_facts

from .test_export import cluster as export_cluster
from .test_export import fake_slurm, run_sbatch  # noqa: F401 - the fake Slurm fixture
from .test_export import plan_of as export_plan_of

FACTS = Facts(addresses={"a": "10.0.0.1", "b": "10.0.0.2"}, master_port=29500, cwd="/work/proj")


def plan_of(*nodes: Node):
    return make_plan(Inventory("inv", "all", tuple(nodes)), RunOptions("train.py", run_id="r1"), FACTS)


def inventory(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "inv.yml"
    path.write_text(body)
    return path


def sh(script: str, env: dict | None = None, stdin: bytes = b"") -> subprocess.CompletedProcess:
    """*script* as the node's login shell runs it (sh -c), in a clean environment."""
    base = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root")}
    return subprocess.run(["/bin/sh", "-c", script], input=stdin, capture_output=True, env={**base, **(env or {})},
                          timeout=60)


def choice(tmp_path: Path, *, setup: bool = False, conda: bool = False, env: dict | None = None) -> tuple[str, str]:
    """What the node's shell chooses, with the role's marker and venv under *tmp_path*."""
    script = nodeenv.choose_python(setup, conda, marker=str(tmp_path / "marker"), venv=str(tmp_path / "venv")) + \
        '; printf "%s\\n%s\\n" "$DDPFAB_PYTHON" "$DDPFAB_PYTHON_FROM"'
    out = sh(script, env).stdout.decode().splitlines()
    return out[0], out[1]


def fake_python(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o755)
    return path


# -- the inventory says, or the node decides ---------------------------------------------------
def test_an_explicit_python_wins_and_is_planned_as_written(tmp_path):
    c = load(inventory(tmp_path, "all:\n  hosts:\n    a: {ansible_host: 10.0.0.1, ddpfab_python: /srv/py/bin/python}\n"
                                 "    b: {ansible_host: 10.0.0.2}\n"))
    a, b = c.nodes
    assert (a.python, a.python_from) == ("/srv/py/bin/python", "inventory") and not nodeenv.undecided(a)
    assert b.python_from == "" and nodeenv.undecided(b)
    plan = make_plan(c, RunOptions("train.py", run_id="r1"), FACTS)
    assert (plan.node("a").python, plan.node("a").python_from) == ("/srv/py/bin/python", "inventory")
    assert render.argv(plan, plan.node("a"))[0] == "/srv/py/bin/python"
    # offline, b's python is the node's to choose: said so, and its shell line chooses it there
    assert (plan.node("b").python, plan.node("b").python_from) == (nodeenv.ON_NODE, nodeenv.ON_NODE_FROM)
    assert "not known" in nodeenv.describe(plan.node("b"))
    line = render.shell_line(plan, plan.node("b"))
    assert nodeenv.MARKER in line and '"$DDPFAB_PYTHON" -m torch.distributed.run' in line
    assert nodeenv.MARKER not in render.shell_line(plan, plan.node("a"))
    # the explicit one is even kept when its node's probe reports another interpreter
    assert nodeenv.decided(a, {"executable": "/usr/bin/python3", "python_from": "default"}) == a


def test_the_probe_decides_an_undecided_node_from_validated_facts():
    node = Node("a", "10.0.0.1", python_from="")
    got = nodeenv.decided(node, {"executable": "/opt/ddpfab/venv/bin/python", "python_from": "provisioned venv"})
    assert (got.python, got.python_from) == ("/opt/ddpfab/venv/bin/python", "provisioned venv")
    # records are data: an unknown source or a relative/odd executable decides nothing
    for bad in ({"executable": "/x/python", "python_from": "rm -rf /"}, {"executable": "python3", "python_from": "default"},
                {"executable": ["/x"], "python_from": "default"},
                {"executable": "/x/py\nthon", "python_from": "default"}, {}):
        assert nodeenv.undecided(nodeenv.decided(node, bad)), bad
    facts = to_facts(node, {"hostname": "h", "python": "3.11.7", "home": "/root", "torch": True,
                            "workdir_exists": True, "executable": "/opt/ddpfab/venv/bin/python",
                            "python_from": "provisioned venv"}, 0.0, 0.0)
    assert (facts.executable, facts.python_from) == ("/opt/ddpfab/venv/bin/python", "provisioned venv")
    cluster = decide(Inventory("inv", "all", (node,)), {"a": facts})
    plan = make_plan(cluster, RunOptions("train.py", run_id="r1"), Facts({"a": "10.0.0.1"}, 29500, "/w"))
    assert render.argv(plan, plan.nodes[0])[:3] == ("/opt/ddpfab/venv/bin/python", "-m", "torch.distributed.run")
    assert plan.nodes[0].python_from == "provisioned venv"


def test_the_nodes_shell_chooses_setup_env_then_provisioned_venv_then_python3(tmp_path):
    assert choice(tmp_path) == ("python3", "default")
    fake_python(tmp_path / "venv" / "bin" / "python")  # the role's default venv, no marker (older role)
    assert choice(tmp_path) == (f"{tmp_path}/venv/bin/python", "provisioned venv")
    custom = fake_python(tmp_path / "custom" / "bin" / "python")
    (tmp_path / "marker").write_text(f"{custom}\n")  # a custom ddpfab_python_venv, recorded by the role
    assert choice(tmp_path) == (str(custom), "provisioned venv")
    act = fake_python(tmp_path / "act" / "bin" / "python").parent.parent
    # an activated env counts only when the node has setup lines (a stray variable does not)
    assert choice(tmp_path, env={"VIRTUAL_ENV": str(act)}) == (str(custom), "provisioned venv")
    assert choice(tmp_path, setup=True, env={"VIRTUAL_ENV": str(act)}) == (f"{act}/bin/python", "ddpfab_setup")
    assert choice(tmp_path, setup=True, conda=True, env={"CONDA_PREFIX": str(act)}) == \
        (f"{act}/bin/python", "ddpfab_conda_env")
    (tmp_path / "marker").write_text("relative/python\n")  # not an absolute path: not taken
    assert choice(tmp_path)[0] == f"{tmp_path}/venv/bin/python"


def test_setup_lines_and_conda_env_from_the_inventory_are_validated(tmp_path):
    c = load(inventory(tmp_path, "all:\n  vars:\n    ddpfab_setup: |\n      module load cuda/12.4\n\n"
                                 "      export A=1\n  hosts:\n    a: {ddpfab_conda_env: train}\n    b: {}\n"))
    a, b = c.nodes
    assert b.setup == ("module load cuda/12.4", "export A=1") and b.conda_env is None
    assert a.setup[:2] == b.setup and "conda activate train" in a.setup[2] and a.conda_env == "train"
    for bad, match in (("ddpfab_setup: {a: 1}", "ddpfab_setup must be shell lines"),
                       ("ddpfab_conda_env: 'x; rm -rf /'", "ddpfab_conda_env must be"),
                       ("ddpfab_conda_env: rel/path", "ddpfab_conda_env must be")):
        with pytest.raises(InventoryError, match=match):
            load(inventory(tmp_path, f"all:\n  hosts:\n    a: {{{bad}}}\n"))


def test_a_failing_setup_line_stops_the_command_and_is_named_with_its_node():
    node = Node("gpu07", "10.0.0.7", python="python3", python_from="inventory",
                setup=("export A=1", "false", "echo never"))
    res = sh(nodeprog.command(node, "ddpfab-node"), stdin=nodeprog.setup_head(node) + nodeprog.stdin_for())
    assert res.returncode == nodeenv.SETUP_FAILED and b"never" not in res.stdout
    err = nodeprog.start_failure(node, res.returncode, res.stderr.decode())
    assert err is not None and err.kind == "setup" and err.node == "gpu07"
    assert str(err).startswith("host gpu07: setup line 2 `false` failed there (exit 1)")
    # the same status without setup lines, or another status, is no setup failure
    assert nodeprog.start_failure(Node("n", "h"), nodeenv.SETUP_FAILED, res.stderr.decode()) is None
    assert nodeenv.setup_failure(node.setup, 1, res.stderr.decode()) is None


def test_a_missing_python_and_its_fallback_are_named_in_one_sentence_for_every_command():
    """The real shell line with a fallback (sync's: the node's python, else python3), neither of
    them there: the runner's one problem names both, the node and the fix (sync adds no words)."""
    node = Node("gpu07", "10.0.0.7", python="/nowhere/bin/python", python_from="inventory")
    res = sh(nodeprog.command(node, "ddpfab-node", fallback="no-such-python3"), stdin=nodeprog.setup_head(node) + nodeprog.stdin_for())
    err = nodeprog.start_failure(node, res.returncode, res.stderr.decode(), fallback="no-such-python3")
    assert res.returncode == 127 and err is not None and err.kind == "python" and err.node == "gpu07"
    assert str(err) == ("host gpu07: neither /nowhere/bin/python nor no-such-python3 found there; the node "
                        "program needs a python (3.6+, standard library only) on the nodes")
    # without a fallback, only the node's own python is named
    alone = nodeprog.start_failure(node, 127, "")
    assert alone is not None and "nor" not in str(alone) and "'/nowhere/bin/python' not found there" in str(alone)


def test_the_probe_runs_in_the_setup_environment_and_reports_what_it_changed(tmp_path):
    """The real node command (sh, setup lines, the choice, the node program) on this machine: a
    setup line that activates a venv makes that venv's python the one that answers, and the facts
    say what the setup changed, secrets included only to be masked by key later."""
    env_dir = tmp_path / "other env"
    venv.create(env_dir, with_pip=False)
    (env_dir / "lib" / "marker_pkg").mkdir(parents=True)
    node = Node("a", "10.0.0.1", python_from="",
                setup=(f". '{env_dir}/bin/activate'", "export HF_TOKEN=s3cret", "unset GONE"))
    req = nodeprog.numbered({"op": "facts", "workdir": str(tmp_path), "script": None, "peers": {}, "resolve": []})
    res = sh(nodeprog.command(node, "ddpfab-node"), env={"GONE": "1"}, stdin=nodeprog.setup_head(node) + nodeprog.stdin_for(*req))
    reply = nodeprog.match_replies("a", req, res.stdout.decode().splitlines(), res.returncode, res.stderr.decode())[0]
    facts = reply.value("a")
    assert facts["python_from"] == "ddpfab_setup"
    assert Path(facts["executable"]).parent == env_dir / "bin"
    decided = nodeenv.decided(node, facts)
    assert decided.python == facts["executable"] and decided.python_from == "ddpfab_setup"
    changes = nodeenv.env_changes(facts)
    assert changes["set"]["VIRTUAL_ENV"] == str(env_dir) and changes["set"]["HF_TOKEN"] == "s3cret"
    assert changes["set"]["PATH"].startswith(f"{env_dir}/bin:") and changes["unset"] == ["GONE"]
    assert not set(changes["set"]) & set(nodeenv.OWN_VARS)
    # no locale here: python's own LC_CTYPE (PEP 538) is not the setup's (check said "setup sets LC_CTYPE")
    assert "LC_CTYPE" not in changes["set"], changes
    # and what the node program starts (the supervisor's job) does not inherit the hand-over
    assert "DDPFAB_ENV0" not in res.stdout.decode()


def test_env_changes_are_read_back_as_data():
    before = "\0".join(["A=1", "B=2", "C=3"]).encode().hex()
    got = ops.env_changes(before, {"A": "1", "B": "two", "D": "4", "_": "/bin/x"})
    assert got == {"set": {"B": "two", "D": "4"}, "unset": ["C"]}
    assert ops.env_changes("not hex", {}) is None
    # LC_CTYPE that the interpreter set itself where the locale was C (PEP 538) is no setup's change;
    # one a setup exported where another locale was in force is
    assert ops.env_changes("".encode().hex(), {"LC_CTYPE": "C.UTF-8"}) == {"set": {}, "unset": []}
    assert ops.env_changes("LANG=C".encode().hex(), {"LANG": "C", "LC_CTYPE": "C.UTF-8"})["set"] == {}
    assert ops.env_changes("LANG=de_DE.UTF-8".encode().hex(), {"LANG": "de_DE.UTF-8", "LC_CTYPE": "C.UTF-8"}) == {
        "set": {"LC_CTYPE": "C.UTF-8"}, "unset": []}
    assert nodeenv.env_changes({"env_changes": {"set": {"A": 1}, "unset": []}}) is None
    assert nodeenv.env_changes({"env_changes": {"set": {"A": "1"}, "unset": "B"}}) is None
    assert nodeenv.env_changes({"env_changes": {"set": {"A": "1"}, "unset": ["B"]}}) == {"set": {"A": "1"},
                                                                                       "unset": ["B"]}


def test_the_torch_fix_says_what_fits_where_the_python_came_from():
    provisioned = Node("a", "h", python="/opt/ddpfab/venv/bin/python", python_from="provisioned venv")
    assert "provision the node" not in nodeenv.torch_fix(provisioned)
    assert "/opt/ddpfab/venv/bin/python" in nodeenv.torch_fix(provisioned)
    assert "remove it" in nodeenv.torch_fix(Node("a", "h", python="/x", python_from="inventory"))
    assert "ddpfab_setup activates" in nodeenv.torch_fix(Node("a", "h", python="/x", python_from="ddpfab_setup"))
    assert "provision the node" in nodeenv.torch_fix(Node("a", "h", python="python3", python_from="default"))


def test_emitted_scripts_and_the_dry_run_apply_the_same_setup(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('train')\n")  # a dry run refuses a missing script, as a run would
    """The setup lines and the choice come first in the emitted script (before `set -eu`, as ddpfab
    runs them) and in the dry run's line; running the script's prefix chooses as the node would."""
    inv = inventory(tmp_path, "all:\n  vars:\n    ddpfab_setup: [export SITE=1]\n  hosts:\n"
                              "    a: {ansible_host: 10.0.0.1}\n    b: {ansible_host: 10.0.0.2, ddpfab_python: /p/bin/python}\n")
    out = tmp_path / "emit"
    assert cli_main(["plan", "-i", str(inv), "--offline", "--emit", str(out), "train.py"]) == 0
    script_a, script_b = sorted(out.glob("rank*.sh"))
    text = script_a.read_text()
    assert text.index("export SITE=1") < text.index("set -eu") < text.index('exec "$DDPFAB_PYTHON" -m')
    assert "/p/bin/python -m torch.distributed.run" in script_b.read_text() and \
        nodeenv.MARKER not in script_b.read_text()
    assert cli_main(["run", "-i", str(inv), "--dry-run", "--offline", "train.py"]) == 0
    shown = capsys.readouterr().out
    assert "# python on a: decided on the node (not known offline)" in shown
    assert "# python on b: /p/bin/python (from inventory)" in shown
    assert shown.count("export SITE=1") == 2


def test_an_sbatch_export_runs_the_setup_and_the_nodes_own_choice_on_each_task(fake_slurm, tmp_path):
    """An offline plan whose python is the node's to choose, with a setup line: each Slurm task's
    shell runs the setup, then the choice (here the env the setup activated), then the launch."""
    bindir, recorder_python, records = fake_slurm
    env_bin = tmp_path / "site env" / "bin"
    env_bin.mkdir(parents=True)
    (env_bin / "python").symlink_to(recorder_python)
    setup = (f"export VIRTUAL_ENV='{env_bin.parent}'", "export SITE_FLAG=on-the-task")
    c = export_cluster(2, python_from="", setup=setup)
    plan = export_plan_of(c, cwd=str(tmp_path), homes={})
    text = to_sbatch(plan)
    got = run_sbatch(text, bindir, records, tmp_path)
    for rec in got:
        assert rec["env"]["SITE_FLAG"] == "on-the-task" and rec["env"]["DDPFAB_PYTHON_FROM"] == "ddpfab_setup"
        assert rec["argv"][:2] == ["-m", "torch.distributed.run"]
    # a node with other setup lines cannot be one scheduler command
    odd = Inventory("inv", "all", (*c.nodes[:1], replace(c.nodes[1], setup=("module load x",))))
    with pytest.raises(ExportError, match="another setup.*ddpfab_setup"):
        to_sbatch(export_plan_of(odd))


def test_a_kubeflow_export_says_setup_lines_are_not_part_of_a_pod(tmp_path, capsys):
    """A pod runs the image's environment: the inventory's setup lines and conda env are named as
    left out (once, on stderr), not dropped silently; the manifest itself stays clean YAML."""
    inv = inventory(tmp_path, "all:\n  vars:\n    ddpfab_setup: [module load cuda/12.4]\n"
                              "    ddpfab_conda_env: train\n  hosts:\n    a: {ansible_host: 10.0.0.1}\n")
    assert cli_main(["export", "pytorchjob", "-i", str(inv), "--image", "img:1", "train.py"]) == 0
    out, err = capsys.readouterr()
    assert "ddpfab_setup and ddpfab_conda_env of the inventory are not part of a Kubeflow job" in err
    assert "module load" not in out and "note" not in out
    (tmp_path / "p").mkdir()
    plain = inventory(tmp_path / "p", "all:\n  hosts:\n    a: {ansible_host: 10.0.0.1}\n")
    assert cli_main(["export", "pytorchjob", "-i", str(plain), "--image", "img:1", "train.py"]) == 0
    assert "note" not in capsys.readouterr().err


def test_check_says_which_python_each_node_runs_and_what_its_setup_sets():
    """From the probe's facts to ``ddpfab check``'s words: the interpreter and where it came from,
    the setup's changed keys (never their values), and a torch failure's fix by source."""
    nodes = (Node("a", "10.0.0.1", python_from=""), Node("b", "10.0.0.2", python_from=""))
    venv_facts = {"hostname": "a", "python": "3.11.7", "torch": True, "launcher": True, "torch_version": "2.13.0",
                  "executable": "/opt/ddpfab/venv/bin/python", "python_from": "provisioned venv",
                  "env_changes": {"set": {"HF_TOKEN": "s3cret", "PATH": "/x"}, "unset": []}}
    facts = {"a": venv_facts, "b": {**venv_facts, "torch": False, "env_changes": None}}
    results = check.evaluate(Inventory("inv", "all", nodes), "a", facts, {}, None, check.CheckOptions(), {"a": 1, "b": 1})
    text = check.render(check.Report(nodes=["a", "b"], results=results))
    assert "python a, b: /opt/ddpfab/venv/bin/python (from provisioned venv)" in text
    assert "setup a: setup sets HF_TOKEN, PATH" in text and "s3cret" not in text
    torch_fail = next(r for r in results if r.node == "b" and r.check == "torch")
    assert "provision the node" not in torch_fail.fix and "lacks torch" in torch_fail.fix


def test_exec_runs_after_the_setup_with_the_nodes_python_first_on_path(tmp_path):
    py = fake_python(tmp_path / "env" / "bin" / "python")
    node = Node("a", "h", python=str(py), python_from="inventory", setup=("export SITE_FLAG=1",))
    res = sh(nodeenv.prefix(node, export_python=True) + 'echo "$SITE_FLAG $DDPFAB_PYTHON_FROM"; command -v python')
    assert res.stdout.decode().splitlines() == ["1 inventory", str(py)]


def test_a_conda_env_is_activated_through_condas_own_hook_and_its_python_chosen(tmp_path):
    """``ddpfab_conda_env``: conda found (here through $CONDA_EXE, a stand-in whose POSIX hook
    defines ``conda activate`` as conda's does: CONDA_PREFIX and PATH), the env activated, its
    python the node's; a conda that cannot activate the env is a named setup failure."""
    env = tmp_path / "envs" / "train"
    py = fake_python(env / "bin" / "python")
    conda = tmp_path / "conda"
    conda.write_text('#!/bin/sh\n[ "$1 $2" = "shell.posix hook" ] || exit 2\n'
                     "echo 'conda() { [ \"$1\" = activate ] && [ -d \"$2\" ] || return 1; "
                     "CONDA_PREFIX=\"$2\"; PATH=\"$2/bin:$PATH\"; export CONDA_PREFIX PATH; }'\n")
    conda.chmod(0o755)
    node = Node("a", "h", python_from="", setup=nodeenv.setup_lines((), str(env)), conda_env=str(env))
    res = sh(nodeenv.prefix(node) + 'echo "$DDPFAB_PYTHON $DDPFAB_PYTHON_FROM"', env={"CONDA_EXE": str(conda)})
    assert res.stdout.decode().split() == [str(py), "ddpfab_conda_env"], res.stderr
    missing = replace(node, setup=nodeenv.setup_lines((), str(tmp_path / "nope")), conda_env=str(tmp_path / "nope"))
    res = sh(nodeenv.prefix(missing) + "echo ran", env={"CONDA_EXE": str(conda)})
    assert res.returncode == nodeenv.SETUP_FAILED and b"ran" not in res.stdout
    assert "setup line 1 `" in nodeenv.setup_failure(missing.setup, res.returncode, res.stderr.decode())


def test_a_python_that_ends_without_a_word_is_named_as_the_cause():
    """`-e ddpfab_python=/bin/false` said only "probe: no reply (exit 1)" (and "skip syncing with
    --no-sync"): a program that sent nothing and said nothing did not run; its python is why."""
    reqs = nodeprog.numbered({"op": "facts"})
    (reply,) = nodeprog.match_replies("n1", reqs, [], 1, "", "/bin/false")
    assert not reply.ok and "/bin/false" in reply.error and "ddpfab_python" in reply.error
    (killed,) = nodeprog.match_replies("n1", reqs, [], -1, "", "/usr/bin/python3")  # a signal (OOM killer)
    assert "ddpfab_python" not in killed.error
    (said,) = nodeprog.match_replies("n1", reqs, [], 1, "Traceback ...\nSyntaxError: x", "/usr/bin/python2")
    assert "SyntaxError" in said.error and "ddpfab_python" not in said.error  # its own words say why
