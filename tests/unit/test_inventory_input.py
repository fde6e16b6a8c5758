"""Inventory input as strict as Ansible's and as familiar as the peers' (issue 24): hostfile values
and duplicates refused with file:line, repeated -i merged in order, Ansible's range forms (by
Ansible's own expander), user@host and host:port entries, --limit @FILE, -e with a quoted value.
(No hosts: Ansible parses; the lab test in test_peer_inventories.py connects through such entries.)"""

from __future__ import annotations

import argparse
import json
import os
import string
import subprocess
import sys
from pathlib import Path

import pytest
from ansible.plugins.inventory import expand_hostname_range
from hypothesis import given, settings
from hypothesis import strategies as st

from ddpfab import cli
from ddpfab.cli import config
from ddpfab.hosts import invcache, inventory
from ddpfab.remote import provision
from ddpfab.hosts.inventory import InventoryError
from ddpfab.launch import replay
from ddpfab.planning.plan import Facts, RunOptions, make_plan
from ddpfab.remote.target import HostKeyPolicy, resolve

from .test_peer_tools import private_cache  # noqa: F401,E402 - the same autouse fixture: no cache, no defaults

REPO = Path(__file__).resolve().parents[2]


def names(source, **kw) -> list[str]:
    return [n.name for n in inventory.load(source, **kw).nodes]


# -- hostfiles ----------------------------------------------------------------------------------
@pytest.mark.parametrize("text, where, says", [
    ("worker-1 slots=four\nworker-2 slots=2\n", ":1:", "slots='four' for host worker-1 is not a whole number"),
    ("# hosts\nworker-1 slots=0\n", ":2:", "slots=0 for host worker-1: a host needs at least one slot"),
    ("w1 slots=2\nw2 slots=1\nw1 slots=1\n", ":3:", "host w1 is listed again (first on line 1)"),
    ("w1 slots=2 gpus=4\n", ":1:", "'gpus=4' after host w1"),
    ("w1 slots=2\nw2 slots=-1\n", ":2:", "slots='-1' for host w2 is not a whole number"),
    ("w1 slots=4 max_slots=2\n", ":1:", "slots=4 exceeds max_slots=2"),
    ("w1 slots=2 slots=3\n", ":1:", "slots given twice"),
    ("w;1 slots=2\n", ":1:", "'w;1' is not a host name"),
])
def test_hostfile_mistakes_are_refused_naming_file_and_line(tmp_path, text, where, says):
    hf = tmp_path / "hostfile"
    hf.write_text(text)
    with pytest.raises(InventoryError) as err:
        inventory.load(str(hf))
    assert f"{hf}{where}" in str(err.value) and says in str(err.value)


def test_a_broken_hostfile_is_a_hostfile_never_an_ini_inventory(tmp_path, capsys):
    # today's bug: `slots=four` was read as an INI inventory (1 process, exit 0)
    assert inventory.is_hostfile("worker-1 slots=four\n")
    assert inventory.is_hostfile("a\nb  slots = 2  # spaces around '=' as MPI allows\n")
    assert inventory.parse_hostfile("a\nb slots = 2\n") == [("a", None), ("b", 2)]
    # INI (a section) and YAML (a key) stay Ansible inventories, whatever their vars say
    assert not inventory.is_hostfile("[gpus]\nw1 slots=4\n")
    assert not inventory.is_hostfile("all:\n  hosts:\n    w1: {note: x slots=4}\n")
    assert not inventory.is_hostfile("w1\nw2\n")  # no slots word: a plain INI list of hosts
    hf = tmp_path / "hostfile"
    hf.write_text("worker-1 slots=four\n")
    assert cli.main(["run", "-i", str(hf), "--dry-run", "--offline", "t.py"]) == 2
    err = capsys.readouterr().err
    assert err.count("ddpfab: error:") == 1 and f"{hf}:1:" in err and "Traceback" not in err


# -- repeated -i ---------------------------------------------------------------------------------
def test_repeated_inventories_merge_in_order_as_ansible_does(tmp_path, capsys):
    one, two = tmp_path / "one.yml", tmp_path / "two.yml"
    one.write_text("all:\n  hosts:\n    a: {}\n    b: {ddpfab_nproc_per_node: 1}\n")
    two.write_text("all:\n  hosts:\n    b: {ddpfab_nproc_per_node: 3}\n    c: {}\n")
    merged = inventory.load([str(one), str(two)])
    # hosts in first-seen order; a host in both gets the later source's vars
    assert [(n.name, n.nproc) for n in merged.nodes] == [("a", None), ("b", 3), ("c", None)]
    assert merged.sources == (str(one), str(two))
    # the order is part of the cache key: the other order is its own answer, not a cached one
    assert [(n.name, n.nproc) for n in inventory.load([str(two), str(one)]).nodes] == \
        [("b", 1), ("c", None), ("a", None)]
    assert invcache.key([one, two], "all") != invcache.key([two, one], "all")
    # a host list and a hostfile merge like files
    hf = tmp_path / "hostfile"
    hf.write_text("x1 slots=2\n")
    assert names(["h1,h2,", str(hf)]) == ["h1", "h2", "x1"]
    # every command: -i is repeatable (not only the last kept)
    assert cli.main(["plan", "-i", str(one), "-i", "z9,", "--offline", "--json", "t.py"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert [n["name"] for n in plan["nodes"]] == ["a", "b", "z9"]
    # a host in two sources that reaches one machine under two names is still refused
    with pytest.raises(InventoryError, match="listed twice"):
        inventory.load(["m1,", "10.1.1.1,", "m2,"], extra_vars=["ansible_host=10.1.1.1"])


# -- host lists: Ansible's range forms, user@host, host:port -----------------------------------
def test_host_lists_take_every_range_form_ansible_takes_and_pdshs():
    assert names("node[a:c],") == ["nodea", "nodeb", "nodec"]
    assert names("node[1:10:3],") == ["node1", "node4", "node7", "node10"]
    assert names("node[01:04],") == ["node01", "node02", "node03", "node04"]
    assert names("node[01-04],") == ["node01", "node02", "node03", "node04"]  # pdsh, as before
    assert names("r[1:2]n[8-9],x") == ["r1n8", "r1n9", "r2n8", "r2n9", "x"]


@pytest.mark.parametrize("source, says", [
    ("node[01:4],", "'node[01:4]': host range must specify equal-length begin and end formats"),
    ("node[1:a],", "'node[1:a]': bounds must be numbers or single letters"),
    ("node[3:1],", "'node[3:1]' makes no host: it counts down"),
    ("n[1:5:0],", "'n[1:5:0]': step 0 must be >= 1"),
    ("n[1:9999999],", "makes more than 100000 hosts"),
    ("n[a-c],", "expected digits like [01-04]"),
    ("a@b@c,", "entry 'a@b@c': 'a@b' is not a user name"),
    ("h1,h2:99999,", "entry 'h2:99999': port '99999' must be a number in 1-65535"),
    ("a:b:22,", "entry 'a:b:22': an IPv6 address with a port is written [ADDR]:PORT"),
    ("ok,bad;rm -rf,", "entry 'bad;rm -rf': 'bad;rm -rf' is not a host name"),
    ("u@h1,h1:2222,", "names h1 more than once"),
])
def test_host_list_mistakes_are_refused_naming_the_entry(source, says):
    with pytest.raises(InventoryError) as err:
        inventory.load(source)
    assert says in str(err.value)


def test_user_at_host_and_host_port_reach_the_nodes_target():
    nodes = {n.name: n for n in inventory.load("root@10.0.0.3:2222,[fd00::7]:2200,alice@gpu1,gpu2:2201,::1,").nodes}
    assert (nodes["10.0.0.3"].user, nodes["10.0.0.3"].port) == ("root", 2222)
    assert (nodes["fd00::7"].host, nodes["fd00::7"].port) == ("fd00::7", 2200)
    assert (nodes["gpu1"].user, nodes["gpu1"].port) == ("alice", None)
    assert (nodes["gpu2"].user, nodes["gpu2"].port) == (None, 2201)
    assert nodes["::1"].port is None  # a bare IPv6 literal has no port
    target = resolve(nodes["10.0.0.3"], HostKeyPolicy(), ssh_config="/dev/null")
    assert (target.user, target.host, target.port) == ("root", "10.0.0.3", 2222)
    target = resolve(nodes["fd00::7"], HostKeyPolicy(), ssh_config="/dev/null")
    assert (target.host, target.port) == ("fd00::7", 2200)
    # without the comma it is no host list (as in Ansible), and the error says what to add
    with pytest.raises(InventoryError, match=r"for a single host write root@gpu1:2222,"):
        inventory.load("root@gpu1:2222")
    # a range with a user and a port: every host of it gets both
    ranged = inventory.load("ops@gpu[1:2]:2022,").nodes
    assert [(n.name, n.user, n.port) for n in ranged] == [("gpu1", "ops", 2022), ("gpu2", "ops", 2022)]


_PADDED = st.integers(0, 120).flatmap(
    lambda lo: st.tuples(st.just(lo), st.integers(lo, lo + 40), st.integers(1, 7), st.integers(0, 4)))


@settings(max_examples=60, deadline=None)
@given(_PADDED, st.sampled_from(["n", "gpu-", "r1n"]), st.sampled_from(["", "-ib", ".lab"]))
def test_numeric_ranges_expand_as_ansibles_expander_does(bounds, head, tail):
    lo, hi, step, pad = bounds
    width = max(pad, len(str(hi)))
    beg, end = (str(lo).zfill(width), str(hi).zfill(width)) if pad else (str(lo), str(hi))
    if pad and (not beg.startswith("0") or len(beg) == 1):
        beg, end = str(lo), str(hi)  # Ansible pads only from a leading zero
    word = f"{head}[{beg}:{end}:{step}]{tail}"
    assert inventory.expand_ranges(word) == expand_hostname_range(word)
    # pdsh's dash form of a step-1 range is the same hosts as Ansible's colon form
    assert inventory.expand_ranges(f"{head}[{beg}-{end}]{tail}") == expand_hostname_range(f"{head}[{beg}:{end}]{tail}")


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(string.ascii_letters), st.sampled_from(string.ascii_letters), st.integers(1, 3))
def test_letter_ranges_expand_as_ansibles_expander_does(a, b, step):
    lo, hi = sorted((a, b), key=string.ascii_letters.index)
    word = f"rack[{lo}:{hi}:{step}]-n[1:2]"
    assert inventory.expand_ranges(word) == expand_hostname_range(word)


# -- --limit @FILE, -e with quotes -------------------------------------------------------------
def test_limit_from_a_file_of_patterns_as_in_ansible(tmp_path, capsys):
    inv = tmp_path / "inv.yml"
    inv.write_text("all:\n  children:\n    rack1: {hosts: {n1: {}, n2: {}}}\n    rack2: {hosts: {n3: {}, n4: {}}}\n")
    patterns = tmp_path / "retry"
    patterns.write_text("n4\n\nrack1\n!n2\n")
    assert names(str(inv), limit=f"@{patterns}") == ["n1", "n4"]
    assert names(str(inv), limit=f"@{patterns},n3") == ["n1", "n3", "n4"]  # mixed with patterns, as Ansible
    patterns.write_text("n3\n")  # the file's content is the cache key, not its name
    assert names(str(inv), limit=f"@{patterns}") == ["n3"]
    patterns.write_text("n1\nn2 n3\n")
    with pytest.raises(InventoryError, match=rf"{patterns}:2: 'n2 n3' is not one host pattern"):
        inventory.load(str(inv), limit=f"@{patterns}")
    patterns.write_text("\n\n")
    with pytest.raises(InventoryError, match="names no host pattern"):
        inventory.load(str(inv), limit=f"@{patterns}")
    with pytest.raises(InventoryError, match=r"limit='@.*nope': No such file"):
        inventory.load(str(inv), limit=f"@{tmp_path / 'nope'}")
    patterns.write_bytes(b"\xef\xbb\xbfn1\r\nn3\r\n")  # a byte-order mark and CRLF, as Notepad writes them
    assert names(str(inv), limit=f"@{patterns}") == ["n1", "n3"]
    patterns.write_text("n1\nn4x\n")  # a typo in a file is named, not dropped
    with pytest.raises(InventoryError, match=r"'n4x' of that file matches no host.*did you mean 'n4'"):
        inventory.load(str(inv), limit=f"@{patterns}")
    patterns.write_text("rack2\n")
    assert cli.main(["plan", "-i", str(inv), "--limit", f"@{patterns}", "--offline", "--json", "t.py"]) == 0
    assert [n["name"] for n in json.loads(capsys.readouterr().out)["nodes"]] == ["n3", "n4"]


def test_extra_vars_take_one_quoted_value_as_ansible_does(tmp_path):
    node = inventory.load("h1,", extra_vars=["ddpfab_workdir='/srv/my code' ddpfab_python=\"/opt/a b/python\""]).nodes[0]
    assert (node.workdir, node.python) == ("/srv/my code", "/opt/a b/python")
    with pytest.raises(InventoryError, match="expected KEY=VALUE .*found 'stray'"):
        inventory.load("h1,", extra_vars=["ddpfab_python=/x stray"])
    with pytest.raises(InventoryError, match="found 'b'"):
        inventory.load("h1,", extra_vars=["key=a b"])  # unquoted: b is a word of its own, as in Ansible


def test_a_run_of_several_inventories_records_them_for_replay_and_reads_them_back_validated(tmp_path):
    one, two = tmp_path / "one.yml", tmp_path / "two.yml"
    one.write_text("all:\n  hosts:\n    a: {ansible_host: 10.0.0.1}\n")
    two.write_text("all:\n  hosts:\n    b: {ansible_host: 10.0.0.2}\n")
    cluster = inventory.load([str(one), str(two)])
    plan = make_plan(cluster, RunOptions("t.py"), Facts({"a": "10.0.0.1", "b": "10.0.0.2"}, 29500, "/w"))
    manifest = {"plan": plan.to_dict(), **replay.manifest_fields(cluster, plan)}
    assert manifest["plan"]["inventory"] == f"{one} + {two}"  # shown; the sources are recorded apart
    assert replay.recorded_inventory(manifest) == [str(one), str(two)]
    assert inventory.load(replay.recorded_inventory(manifest)).nodes == cluster.nodes
    # one inventory: the manifest is as before, the plan's inventory is the source
    single = inventory.load(str(one))
    plan1 = make_plan(single, RunOptions("t.py"), Facts({"a": "10.0.0.1"}, 29500, "/w"))
    fields = replay.manifest_fields(single, plan1)
    assert "inventory_sources" not in fields
    assert replay.recorded_inventory({"plan": plan1.to_dict(), **fields}) == str(one)
    with pytest.raises(InventoryError, match="inventory_sources must be a list of inventories"):
        replay.recorded_inventory({**manifest, "inventory_sources": [str(one), 7]})


def test_provision_hands_ansible_playbook_every_inventory_in_order(tmp_path):
    one = tmp_path / "one.yml"
    one.write_text("all:\n  hosts:\n    a: {}\n")
    argv = provision.build_command([str(one), "root@b1:2222,"])
    sources = [argv[i + 1] for i, w in enumerate(argv) if w == "-i"]
    assert sources[0] == str(one) and len(sources) == 2
    generated = json.loads(Path(sources[1]).read_text().split("\n", 1)[1])  # a host list: a generated file
    assert generated == {"all": {"hosts": {"b1": {"ansible_user": "root", "ansible_port": 2222}}}}


def test_a_host_list_is_expanded_once_later_commands_do_not_import_ansible(tmp_path):
    """Ansible's range expander costs an import of ansible (0.4 s, more than a small `exec`): the
    expanded list is kept, named by the list's text, and the inventory cache does the rest."""
    probe = ("import sys; from ddpfab.hosts import inventory; "
             "print([n.name for n in inventory.load(sys.argv[1]).nodes], 'ansible' in sys.modules)")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    runs = [subprocess.run([sys.executable, "-c", probe, "ops@n[1:7:3]:2022,"], capture_output=True, text=True,
                           env=env, cwd=REPO, check=True).stdout.split("] ")
            for _ in range(2)]
    assert runs[0] == ["['n1', 'n4', 'n7'", "True\n"]  # the first expands (and parses) with Ansible
    assert runs[1] == ["['n1', 'n4', 'n7'", "False\n"]  # the second finds both kept


def test_defaults_give_the_inventory_as_a_repeated_flag_would(tmp_path):
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "ddpfab.yml").write_text("inventory: [inv/a.yml, 'h1,h2,']\n")
    ns = argparse.Namespace(_cluster_args=True, inventory=None, group=None)
    config.apply(ns, environ={}, cwd=str(proj))
    assert ns.inventory == [str(proj / "inv/a.yml"), "h1,h2,"]  # paths relative to the config, lists as given
    ns = argparse.Namespace(_cluster_args=True, inventory=None, group=None)
    config.apply(ns, environ={"DDPFAB_INVENTORY": "e.yml"}, cwd=str(proj))
    assert ns.inventory == ["e.yml"]
    (proj / "ddpfab.yml").write_text("inventory: [a.yml, 3]\n")
    with pytest.raises(config.ConfigError, match="inventory must be a string or a list of strings"):
        config.apply(argparse.Namespace(_cluster_args=True, inventory=None), environ={}, cwd=str(proj))


def test_a_hostfile_saved_with_a_bom_and_crlf_reads_as_without(tmp_path):
    # Windows editors (Notepad's "UTF-8 with BOM") write both; the BOM is no part of the first host
    hf = tmp_path / "hostfile"
    hf.write_bytes(b"\xef\xbb\xbfworker-1 slots=2\r\nworker-2\tslots=1  \r\n\r\n# spare\r\n")
    nodes = inventory.load(str(hf)).nodes
    assert [(n.name, n.nproc) for n in nodes] == [("worker-1", 2), ("worker-2", 1)]


def test_a_hostfile_takes_the_ip_literals_a_host_list_takes(tmp_path):
    # one rule for a host word in both forms: an IPv6 literal is a host in `-i '::1,'`, so in a hostfile too
    hf = tmp_path / "hostfile"
    hf.write_text("10.0.0.1 slots=1\nfe80::1 slots=2\n")
    assert names(str(hf)) == ["10.0.0.1", "fe80::1"] == names("10.0.0.1,fe80::1,")


def test_a_parse_error_takes_the_line_of_its_own_origin():
    from ddpfab.hosts.inventory import _inner_reason

    chatter = """[WARNING]: a deprecation in another file
Origin: /i/x.yml:1:1

[WARNING]: Failed to parse /i/b.yml with yaml plugin: mapping values are not allowed here
Origin: /i/b.yml:7:3

[WARNING]: Failed to parse /i/a.ini with ini plugin: bad section
Origin: /i/a.ini:2
"""
    assert _inner_reason(chatter).endswith("mapping values are not allowed here (at /i/b.yml line 7, column 3)")
    later = "[WARNING]: Failed to parse inventory\nOrigin: <plugin>\nstuff\nOrigin: /i/c.yml:4:1\n"
    assert _inner_reason(later).endswith("(at /i/c.yml line 4, column 1)")
    before = "Origin: /i/d.yml:9:2\n[WARNING]: Failed to parse inventory with 'auto' plugin\n"
    assert _inner_reason(before).endswith("(at /i/d.yml line 9, column 2)")


def test_a_runs_limit_and_extra_vars_are_recorded_for_replay_a_secret_masked_by_its_key(tmp_path):
    """replay (and stop, logs, attach) loaded the inventory without the run's -e and --limit: a run
    with -e ddpfab_workdir=... was refused as 'the inventory changed', and --force planned another
    workdir."""
    from ddpfab.api import Cluster as ApiCluster

    inv = tmp_path / "inv.yml"
    inv.write_text("all:\n  hosts:\n    a: {ansible_host: 10.0.0.1}\n    b: {ansible_host: 10.0.0.2}\n")
    api = ApiCluster.load(str(inv), limit="b", extra_vars=["ddpfab_workdir=/srv/x ansible_password=hunter2"],
                          say=lambda line: None)
    record = api._selection()
    assert record == {"limit": "b", "extra_vars": {"ddpfab_workdir": "/srv/x", "ansible_password": "***"}}
    limit, variables, masked = replay.recorded_selection(record)
    assert (limit, variables, masked) == ("b", {"ddpfab_workdir": "/srv/x"}, ["ansible_password"])
    limit, variables, masked = replay.recorded_selection(record, ["ansible_password=again"])
    assert masked == [] and variables == {"ddpfab_workdir": "/srv/x", "ansible_password": "again"}
    again = inventory.load(str(inv), limit=limit, extra_vars=(variables,))
    assert [(n.name, n.workdir) for n in again.nodes] == [("b", "/srv/x")]
    assert replay.inventory_fingerprint(again) == replay.inventory_fingerprint(api.parsed)
    assert ApiCluster.load(str(inv), say=lambda line: None)._selection() == {}
    for bad in ({"limit": ""}, {"limit": 3}, {"extra_vars": ["x"]}, {"extra_vars": {"": 1}}):
        with pytest.raises(replay.ManifestError):
            replay.recorded_selection(bad)
    args = cli.build_parser().parse_args(["replay", "20261202-213851-8c6937", "-e", "ansible_password=x"])
    assert args.replay_extra_vars == ["ansible_password=x"]


def test_a_bad_ansible_host_is_blamed_on_ansible_host_not_on_the_data_address_it_defaults(tmp_path):
    inv = tmp_path / "inv.yml"
    inv.write_text('all:\n  hosts:\n    a: {ansible_host: "10.0.0.1 x"}\n')
    with pytest.raises(InventoryError, match=r"host a: ansible_host '10.0.0.1 x' is neither"):
        inventory.load(str(inv))


def test_recorded_extra_vars_mask_a_secret_at_any_depth_and_keep_only_json(tmp_path):
    import datetime

    from ddpfab.masking import holds_mask, recordable

    given = {"db": {"password": "hunter2", "host": "h"}, "d": datetime.date(2024, 1, 1), "n": [1, {"token": "t"}]}
    kept = recordable(given)
    assert kept == {"db": {"password": "***", "host": "h"}, "d": "2024-01-01", "n": [1, {"token": "***"}]}
    json.dumps(kept)  # a record holds it
    assert holds_mask(kept["db"], "db") and holds_mask(kept["n"], "n") and not holds_mask(kept["d"], "d")
    limit, variables, masked = replay.recorded_selection({"extra_vars": kept})
    assert masked == ["db", "n"] and variables == {"d": "2024-01-01"}
    vars_file = tmp_path / "vars.yml"
    vars_file.write_text("d: 2024-01-01\n")
    from ddpfab.api import Cluster as ApiCluster

    api = ApiCluster.load("h1,", extra_vars=iter([f"@{vars_file}"]), say=lambda line: None)
    assert api._selection() == {"extra_vars": {"d": "2024-01-01"}}  # an iterator read once, a date as text
