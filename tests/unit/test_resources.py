"""The node's resources (issue 25): the node program's facts read from this machine's real /proc
and statvfs, and their evaluation, pure: facts in, findings out, grouped across nodes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from ddpfab.health import resourcecheck
from ddpfab.health.check import CheckOptions, evaluate, grouped_problems
from ddpfab.hosts.inventory import Inventory, Node
from ddpfab.node import ops
from ddpfab.node import resources as noderes
from ddpfab.planning.plan import PlanError

GIB, MIB = 2**30, 2**20
C = Inventory("inv.yml", "all", (Node("a", "10.0.0.1"), Node("b", "10.0.0.2"), Node("c", "10.0.0.3")))


def fs(free, path="/w", mount="/", fstype="ext4", total=100 * GIB):
    return {"path": path, "at": path, "free": free, "total": total, "mount": mount, "fstype": fstype}


def res(**over):
    base = {"shm": fs(8 * GIB, "/dev/shm", "/dev/shm", "tmpfs", 8 * GIB),
            "paths": {"workdir": fs(50 * GIB), "runs": fs(50 * GIB, "~/.ddpfab/runs"), "cache": fs(50 * GIB, "~/.cache")},
            "nofile": [65536, 65536], "memlock": [8 * MIB, 8 * MIB], "infiniband": False,
            "mem_available": 16 * GIB, "mem_total": 32 * GIB}
    base.update(over)
    return base


def fact(**over):
    base = {"hostname": "h", "python": "3.11.7", "torch": True, "torch_version": "2.13.0+cpu", "launcher": True,
            "hostname_addr": "10.0.0.9", "cuda": None, "cuda_available": False, "gpus": 0, "nccl": None,
            "routes": {"x": "eth0"}, "time": 1000.0, "controller_sent": 999.9, "controller_received": 1000.1,
            "resources": res()}
    base.update(over)
    return base


def checked(facts, nproc=2, **opts):
    return evaluate(C, "a", facts, {}, None, CheckOptions(**opts), {n: nproc for n in "abc"})


def failing(results):
    return sorted((r.node, r.check) for r in results if r.status == "fail")


def test_a_healthy_node_passes_every_resource_check():
    results = checked({n: fact(hostname=n) for n in "abc"})
    assert failing(results) == []
    assert {r.check for r in results} >= {"shm", "disk", "nofile", "memlock", "memory", "leftovers"}
    assert not [r for r in results if r.status == "warn"]  # a CPU node's 8 MiB memlock is no warning


def test_a_small_dev_shm_fails_that_node_only_with_the_remount_fix():
    facts = {n: fact(hostname=n) for n in "abc"}
    facts["b"] = fact(resources=res(shm=fs(60 * MIB, "/dev/shm", "/dev/shm", "tmpfs", 64 * MIB)))
    results = checked(facts, nproc=4)
    assert failing(results) == [("b", "shm")]
    (p,) = grouped_problems(results)
    assert p.node == "b" and "/dev/shm 60 MiB free of 64 MiB (tmpfs)" in p.found
    assert "at least 1 GiB free for 4 processes" in p.expected  # 256 MiB x 4
    assert "mount -o remount,size=2G /dev/shm" in p.fix and "--shm-size=2g" in p.fix


def test_the_shm_floor_is_the_larger_of_the_minimum_and_per_process_and_an_option_overrides_it():
    assert resourcecheck.Floors().shm_for(1) == 512 * MIB and resourcecheck.Floors().shm_for(8) == 2 * GIB
    facts = {n: fact(resources=res(shm=fs(700 * MIB, "/dev/shm", "/dev/shm", "tmpfs"))) for n in "abc"}
    assert failing(checked(facts, nproc=1)) == []
    assert failing(checked(facts, nproc=4)) == [(n, "shm") for n in "abc"]
    assert failing(checked(facts, nproc=4, floors=resourcecheck.parse_floors("shm=600M"))) == []


def test_full_workdir_fails_naming_path_and_filesystem_a_full_cache_only_warns():
    facts = {n: fact() for n in "abc"}
    facts["c"] = fact(resources=res(paths={"workdir": fs(5 * MIB, "/root/job", "/root/job", "tmpfs"),
                                           "runs": fs(50 * GIB, "~/.ddpfab/runs"),
                                           "cache": fs(10 * MIB, "~/.cache", "/root/.cache", "xfs")}))
    results = checked(facts)
    assert failing(results) == [("c", "disk")]
    (p,) = grouped_problems(results)
    assert p.found == "the workdir /root/job: 5 MiB free on /root/job (tmpfs)" and p.expected == "at least 1 GiB free"
    (w,) = grouped_problems(results, "warn")
    assert w.node == "c" and "~/.cache" in w.found and "xfs" in w.found


def test_a_low_open_files_limit_fails_with_where_to_raise_it():
    facts = {n: fact() for n in "abc"}
    facts["a"] = fact(resources=res(nofile=[256, 4096]))
    results = checked(facts)
    assert failing(results) == [("a", "nofile")]
    (p,) = grouped_problems(results)
    assert p.found == "open files limit 256 (hard 4096)" and "limits.conf" in p.fix
    assert failing(checked(facts, floors=resourcecheck.parse_floors("nofile=200"))) == []


def test_locked_memory_fails_with_infiniband_warns_on_a_gpu_node_and_is_shown_elsewhere():
    low = res(memlock=[64 * 1024, 64 * 1024])
    by = {r.node: r.status for r in checked({"a": fact(resources=dict(low, infiniband=True)),
                                             "b": fact(resources=low, nvidia_gpus=2),
                                             "c": fact(resources=res(memlock=[-1, -1]), nvidia_gpus=2)})
          if r.check == "memlock"}
    assert by == {"a": "fail", "b": "warn", "c": "pass"}


def test_little_available_memory_fails_below_the_floor():
    facts = {n: fact() for n in "abc"}
    facts["b"] = fact(resources=res(mem_available=300 * MIB))
    assert failing(checked(facts)) == [("b", "memory")]
    assert failing(checked(facts, floors=resourcecheck.parse_floors("mem=256M"))) == []


def test_a_process_on_the_master_port_is_named_with_its_run_and_the_stop_fix():
    holder = {"pid": 4242, "user": "alice", "cmd": "python -m torch.distributed.run x.py", "age_s": 7300,
              "run_id": "r-old"}
    facts = {n: fact() for n in "abc"}
    facts["a"] = fact(resources=res(port_holders=[holder]))
    results = checked(facts, master_port=29511)
    assert failing(results) == [("a", "leftovers")]
    (p,) = grouped_problems(results)
    assert p.found == ("port 29511 held by pid 4242 (user alice, `python -m torch.distributed.run x.py`, up 2 h, "
                       "ddpfab run r-old)")
    assert p.fix.startswith("ddpfab stop r-old")
    assert resourcecheck.port_holders(facts["a"])[0].startswith(" by pid 4242 (user alice")
    assert resourcecheck.port_holders(fact()) == ("", "")


def gpu_leases(busy_pid):
    return {"gpus": [{"gpu": "0", "uuid": "G0", "state": "busy", "holder": None,
                      "procs": [{"pid": busy_pid, "name": "other-tool"}]},
                     {"gpu": "1", "uuid": "G1", "state": "free", "holder": None, "procs": []}]}


def test_a_gpu_used_without_a_lease_fails_when_the_job_needs_it_and_names_the_process():
    who = {"pid": 77, "user": "bob", "cmd": "python eval.py", "age_s": 90, "run_id": None}
    facts = {n: fact() for n in "abc"}
    facts["b"] = fact(leases=gpu_leases(77), nvidia_gpus=2, resources=res(gpu_holders=[who]))
    results = checked(facts, nproc=2)
    assert failing(results) == [("b", "leftovers")]
    (p,) = grouped_problems(results)
    assert p.found == "GPU 0 in use without a ddpfab lease by pid 77 (user bob, `python eval.py`, up 2 min)"
    assert p.fix == "kill 77 (if it is a left-over)"
    # one process fits on the free GPU: shown, not failed; and run's preflight leaves it to the lease refusal
    assert failing(checked(facts, nproc=1)) == []
    assert failing(checked(facts, nproc=2, busy_gpus_fail=False)) == []
    assert [r.status for r in checked(facts, nproc=2, busy_gpus_fail=False)
            if r.node == "b" and r.check == "leftovers"] == ["warn"]


def test_a_node_without_resource_facts_is_not_judged():
    assert resourcecheck.evaluate("a", {"hostname": "h"}, 2, resourcecheck.Floors()) == []


@pytest.mark.parametrize("spec,want", [
    ("shm=2G,disk=5G", resourcecheck.Floors(shm=2 * GIB, disk=5 * GIB)),
    ("mem=1.5GiB,nofile=4096", resourcecheck.Floors(mem=int(1.5 * GIB), nofile=4096)),
    ("disk=512M", resourcecheck.Floors(disk=512 * MIB)), (None, resourcecheck.Floors())])
def test_floors_parse(spec, want):
    assert resourcecheck.parse_floors(spec) == want


@pytest.mark.parametrize("spec", ["shm", "swap=1G", "shm=lots", "nofile=1k", "disk=-1G"])
def test_bad_floors_are_a_plan_error_naming_the_item(spec):
    with pytest.raises(PlanError, match="resource_floors|not a size"):
        resourcecheck.parse_floors(spec)


# -- the node side, on this machine ---------------------------------------------------------------
def test_the_node_facts_read_this_machine(tmp_path):
    out = ops.op_facts({"workdir": str(tmp_path), "resources": True}, {})["resources"]
    st = os.statvfs("/dev/shm")
    assert out["shm"]["mount"] == "/dev/shm" and out["shm"]["total"] == st.f_blocks * st.f_frsize
    assert out["paths"]["workdir"]["at"] == str(tmp_path)
    import resource
    assert out["nofile"][0] == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert 0 < out["mem_available"] <= out["mem_total"]


def test_a_path_not_there_yet_is_judged_by_its_nearest_existing_parent(tmp_path):
    got = noderes.res_filesystem(str(tmp_path / "not" / "yet"), noderes.res_mounts())
    assert got["at"] == str(tmp_path) and got["free"] > 0


def test_the_holder_of_a_listening_port_is_named_with_its_command_and_run(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = f"import socket,time; s=socket.socket(); s.bind(('127.0.0.1',{port})); s.listen(); print('up',flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "DDPFAB_JOB": "r-leftover"})
    try:
        assert proc.stdout.readline().strip() == "up"
        out = ops.op_facts({"workdir": str(tmp_path), "resources": True, "port": port}, {})
        assert out["port_free"] is False
        (who,) = out["resources"]["port_holders"]
        assert who["pid"] == proc.pid and who["run_id"] == "r-leftover" and "socket.socket()" in who["cmd"]
        assert 0 <= who["age_s"] < 60
    finally:
        proc.kill()
        proc.wait()
    time.sleep(0.1)
    assert noderes.res_port_holders(port) == []


def test_records_are_data_malformed_resources_are_not_judged_and_node_text_is_escaped():
    bad = res(shm={"free": "lots"}, paths={"workdir": {"free": True}}, nofile=["1", 2], memlock="x",
              mem_available=None, port_holders=[{"pid": "1"}, {"pid": 9, "user": "u", "cmd": "evil\x1b[2J", "age_s": "x"}])
    found = {(f.check, f.status): f for f in resourcecheck.evaluate("a", fact(resources=bad), 2, resourcecheck.Floors(),
                                                                 master_port=29500)}
    assert set(found) == {("disk", "pass"), ("leftovers", "fail")}
    assert found[("leftovers", "fail")].found == "port 29500 held by pid 9 (user u, `evil\\x1b[2J`, age unknown)"


def test_a_daemon_on_the_master_port_is_never_a_kill_to_suggest():
    """--master-port 22 on the lab suggested `kill 1` (the host's sshd is its pid 1)."""
    for who in ({"pid": 1, "user": "root", "cmd": "sshd: /usr/sbin/sshd -D", "age_s": 60, "run_id": None},
                {"pid": 812, "user": "postgres", "cmd": "postgres -D /var/lib/pg", "age_s": 60, "run_id": None}):
        facts = {n: fact() for n in "abc"}
        facts["a"] = fact(resources=res(port_holders=[who]))
        (p,) = grouped_problems(checked(facts, master_port=22))
        assert "kill" not in p.fix and p.fix == "pick another master_port (or leave it out)"
        assert resourcecheck.port_holders(facts["a"])[1] == ""
    left = {"pid": 900, "user": "bob", "cmd": "python train.py", "age_s": 60, "run_id": None}
    facts = {n: fact() for n in "abc"}
    facts["a"] = fact(resources=res(port_holders=[left]))
    (p,) = grouped_problems(checked(facts, master_port=29500))
    assert p.fix == "kill 900 (if it is a left-over), or pick another master_port (or leave it out)"
