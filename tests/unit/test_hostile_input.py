"""Hostile input: property-based tests of inventory loading, env handling and output prefixes.

Whatever the input, the outcome is a Inventory/plan or one of ddpfab's own clear errors: never a
traceback from deep inside, never a value that reaches a shell unquoted.
"""

from __future__ import annotations

import io
import json
import shlex

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddpfab.hosts.inventory import InventoryError, load
from ddpfab.launch.execute import Printer
from ddpfab.launch.runs import MASK, mask_plan
from ddpfab.planning import render
from ddpfab.planning.plan import Facts, Plan, PlanError, RunOptions, forwarded_env, make_plan, parse_env, read_env_file

names = st.text(alphabet=st.sampled_from("abcXYZ019-_.;$`'\" |&*[]:{}()!\\/\n\t#é"), min_size=1, max_size=12)
values = st.one_of(st.integers(-5, 70000), st.text(max_size=12), st.booleans(), st.none(),
                   st.lists(st.integers(), max_size=2))
var_names = st.sampled_from(["ansible_host", "ansible_port", "ansible_user", "ddpfab_nproc_per_node",
                             "ddpfab_gpus", "ddpfab_data_addr", "ddpfab_workdir", "ddpfab_master",
                             "ddpfab_python", "ansible_ssh_common_args"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(hosts=st.dictionaries(names, st.dictionaries(var_names, values, max_size=3), min_size=1, max_size=3))
def test_any_yaml_inventory_loads_or_fails_clearly(tmp_path, hosts):
    path = tmp_path / "inv.yml"
    path.write_text(yaml.safe_dump({"all": {"hosts": hosts}}))
    try:
        cluster = load(path)
    except InventoryError as exc:
        assert str(exc).strip() and "\n" not in str(exc).strip(), str(exc)
        return
    for node in cluster.nodes:
        # what survives loading is safe to hand to SSH and to the plan
        assert shlex.quote(node.host) == node.host or node.host.replace(".", "").isalnum()
        assert node.nproc is None or node.nproc >= 1
        assert node.port is None or 1 <= node.port <= 65535
    facts = Facts(addresses={n.name: "10.0.0.1" for n in cluster.nodes}, master_port=29500, cwd="/w")
    plan = make_plan(cluster, RunOptions("t.py"), facts)
    assert Plan.from_json(plan.to_json()) == plan


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=80))
def test_any_ini_inventory_loads_or_fails_clearly(tmp_path, text):
    path = tmp_path / "inv.ini"
    path.write_text(text)
    try:
        load(path)
    except InventoryError:
        pass


def test_duplicate_hosts_are_one_node(tmp_path):
    path = tmp_path / "inv.yml"
    path.write_text("all:\n  children:\n    a:\n      hosts:\n        n1:\n    b:\n      hosts:\n        n1:\n")
    assert [n.name for n in load(path).nodes] == ["n1"]


def test_env_file_parsing_and_errors(tmp_path):
    pairs = read_env_file("# comment\n\nA=1\nexport B='two words'\nC=\"q\"\nD=x=y\n", "f.env")
    assert parse_env(pairs) == (("A", "1"), ("B", "two words"), ("C", "q"), ("D", "x=y"))
    try:
        read_env_file("JUSTAWORD\n", "f.env")
    except PlanError as exc:
        assert "f.env, line 1" in str(exc)
    else:
        raise AssertionError("a line without = must be an error")


def test_only_allowlisted_prefixes_are_forwarded():
    env = {"NCCL_DEBUG": "INFO", "TORCH_SHOW_CPP_STACKTRACES": "1", "GLOO_SOCKET_IFNAME": "eth0",
           "AWS_SECRET_ACCESS_KEY": "x", "HOME": "/root", "PATH": "/bin"}
    assert dict(forwarded_env(env)) == {"NCCL_DEBUG": "INFO", "TORCH_SHOW_CPP_STACKTRACES": "1",
                                       "GLOO_SOCKET_IFNAME": "eth0"}


def test_secrets_are_masked_in_manifests_and_dry_runs():
    from ddpfab.hosts.inventory import Inventory, Node

    c = Inventory("i", "all", (Node("a", "10.0.0.1"),))
    plan = make_plan(c, RunOptions("t.py", env=(("WANDB_API_KEY", "s3cr3t-value"), ("HF_TOKEN", "hf_abc"),
                                                  ("LR", "0.1"))),
                     Facts({"a": "10.0.0.1"}, 29500, "/w"))
    masked = json.dumps(mask_plan(plan.to_dict()))
    assert "s3cr3t-value" not in masked and "hf_abc" not in masked
    assert masked.count(MASK) == 2 and '"LR": "0.1"' in masked
    shown = render.masked(plan)  # a dry run prints this plan's shell lines
    line = render.shell_line(shown, shown.nodes[0])
    assert "s3cr3t-value" not in line and "hf_abc" not in line
    assert line.count(MASK) == 2 and "LR=0.1" in line


def test_printer_maps_local_rank_tags_to_global_ranks():
    from ddpfab.hosts.inventory import Inventory, Node

    c = Inventory("i", "all", (Node("a", "10.0.0.1", nproc=2), Node("b", "10.0.0.2", nproc=3)))
    plan = make_plan(c, RunOptions("t.py"), Facts({"a": "10.0.0.1", "b": "10.0.0.2"}, 29500, "/w"))
    out = io.StringIO()
    p = Printer(plan, out, color=False)
    p.line("b", "[default2]:hello")
    p.line("a", "[default1]:x")
    p.line("b", "torchrun says")
    assert out.getvalue().splitlines() == ["b r4| hello", "a r1| x", "b n1| torchrun says"]
