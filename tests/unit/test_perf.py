"""The perf check's pure parts: pair schedule, report validation, verdict, history, report files."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddpfab.health import perf, perfreport


# -- schedule ---------------------------------------------------------------------------------------
def _pairs(rounds):
    return [p for r in rounds for p in r]


@given(st.integers(min_value=0, max_value=80), st.integers(min_value=2, max_value=20), st.integers(min_value=3, max_value=12))
@settings(max_examples=200, deadline=None)
def test_schedule_rounds_are_matchings_of_distinct_pairs(n, all_pairs_max, max_rounds):
    rounds = perf.schedule(n, all_pairs_max, max_rounds)
    for r in rounds:
        nodes = [x for p in r for x in p]
        assert len(nodes) == len(set(nodes)), f"a node is in two transfers of one round: {r}"
        assert all(0 <= a < b < n for a, b in r)
    pairs = _pairs(rounds)
    assert len(pairs) == len(set(pairs)), "a pair measured twice wastes a round"
    if n < 2:
        assert rounds == []


@given(st.integers(min_value=2, max_value=40))
@settings(max_examples=60, deadline=None)
def test_schedule_is_all_pairs_up_to_the_limit_and_ring_plus_peers_beyond(n):
    rounds = perf.schedule(n, all_pairs_max=16, max_rounds=8)
    pairs = set(_pairs(rounds))
    if n <= 16:
        assert pairs == {(a, b) for a in range(n) for b in range(a + 1, n)}
        assert len(rounds) <= n
    else:
        ring = {(min(i, (i + 1) % n), max(i, (i + 1) % n)) for i in range(n)}
        assert ring <= pairs, "the ring's neighbours must all be measured"
        assert len(rounds) <= 8
        for node in range(n):
            peers = {b if a == node else a for a, b in pairs if node in (a, b)}
            assert len(peers) >= 5, f"node {node} meets only {len(peers)} peers: a bad node and a bad link look alike"


def test_node_config_carries_the_rounds_and_every_size():
    cfg = perf.PerfOptions().node_config(4)
    assert len(cfg["rounds"]) == 3 and all(len(r) == 2 for r in cfg["rounds"])
    assert "nproc_per_node" not in cfg and cfg["passes"] == 2
    json.dumps(cfg)  # goes to the nodes as JSON


# -- validation -----------------------------------------------------------------------------------------
def node_report(rank: int, gflops=(10.0,), mem=5.0, links=(), device="cpu"):
    return {"node_rank": rank, "device": device, "backend": "gloo", "compute": {"per_device": list(gflops)},
            "memory": {"gbs": mem}, "links": [{"peer": p, "gbs": g, "lat_us": lat} for p, g, lat in links],
            "all_reduce": [{"bytes": 4096, "s": 0.001, "busbw_gbs": 0.01}, {"bytes": 1 << 24, "s": 0.1, "busbw_gbs": 0.2}],
            "rounds_skipped": 0, "seconds": 3.0}


@pytest.mark.parametrize("mutate, field", [
    (lambda r: r.update(compute={"per_device": []}), "compute.per_device"),
    (lambda r: r.update(memory={"gbs": "fast"}), "memory.gbs"),
    (lambda r: r.update(memory={"gbs": float("nan")}), "memory.gbs"),
    (lambda r: r["links"].append({"peer": 1, "gbs": -1, "lat_us": 3}), "links.gbs"),
    (lambda r: r.update(node_rank=True), "node_rank"),
    (lambda r: r.update(links="__import__('os')"), "links"),
])
def test_a_malformed_node_report_is_refused_with_host_and_field(mutate, field):
    rep = node_report(0)
    mutate(rep)
    with pytest.raises(perf.PerfDataError) as exc:
        perf.validate_report("node3", rep)
    assert "host node3" in str(exc.value) and field in str(exc.value)


# -- verdict ---------------------------------------------------------------------------------------------
def cluster(n, gflops=None, mem=None, link=None, lat=None):
    """n nodes, every pair measured from both ends; link(a, b) -> GB/s."""
    names = [f"node{i + 1}" for i in range(n)]
    gflops = gflops or {}
    mem = mem or {}
    link = link or (lambda a, b: 1.0)
    lat = lat or (lambda a, b: 50.0)
    reports = {}
    for i, name in enumerate(names):
        links = [(j, link(i, j), lat(i, j)) for j in range(n) if j != i]
        reports[name] = perf.validate_report(name, node_report(i, (gflops.get(i, 10.0),), mem.get(i, 5.0), links))
    return reports, names


def test_a_healthy_cluster_with_ordinary_spread_has_no_straggler():
    spread = [1.0, 0.7, 1.3, 0.9, 1.1, 0.8, 1.2, 0.95]
    reports, names = cluster(8, gflops={i: 10 * s for i, s in enumerate(spread)},
                             mem={i: 5 * s for i, s in enumerate(reversed(spread))},
                             link=lambda a, b: 0.5 + 0.1 * ((a * 7 + b * 3) % 5),
                             lat=lambda a, b: 40 + 10 * ((a + b) % 4))
    res = perf.analyze(reports, names)
    assert res.findings == [] and res.stragglers == []
    assert set(res.node_figures) == set(names)
    assert len(res.links) == 28


def test_one_node_with_a_throttled_link_is_named_and_no_other():
    slow = 3
    reports, names = cluster(6, link=lambda a, b: 0.004 if slow in (a, b) else 1.0 + 0.1 * ((a + b) % 3))
    res = perf.analyze(reports, names)
    assert res.stragglers == ["node4"]
    (f,) = res.findings
    assert f.kind == "link" and f.ratio < 0.01
    assert "its link to every peer is slow" in f.text and "check its NIC" in f.text
    assert "node4: link bandwidth 0.00" in f.text


def test_three_nodes_tell_a_bad_node_from_a_bad_link():
    reports, names = cluster(3, link=lambda a, b: 0.01 if 2 in (a, b) else 1.0)
    assert perf.analyze(reports, names).stragglers == ["node3"]
    reports, names = cluster(3, link=lambda a, b: 0.01 if {a, b} == {0, 2} else 1.0)
    res = perf.analyze(reports, names)
    assert res.stragglers == ["node1--node3"]
    assert res.findings[0].kind == "pair" and "both nodes are fine with their other peers" in res.findings[0].text


def test_slow_compute_is_named_with_its_figure_and_the_median():
    reports, names = cluster(4, gflops={2: 2.5})
    res = perf.analyze(reports, names)
    assert res.stragglers == ["node3"]
    (f,) = res.findings
    assert f.kind == "compute" and f.ratio == pytest.approx(0.25)
    assert "node3: slow compute: matmul 0.25x of median (2.5 vs 10 GFLOP/s)" in f.text


def test_a_starved_cpu_that_also_slows_its_links_is_explained_not_blamed_on_the_nic():
    reports, names = cluster(4, gflops={1: 2.0}, link=lambda a, b: 0.1 if 1 in (a, b) else 1.0)
    res = perf.analyze(reports, names)
    assert [f.kind for f in res.findings] == ["compute", "link"]
    assert res.stragglers == ["node2"]
    assert "starved CPU may be the cause" in res.findings[1].text


def test_a_starved_cpu_explains_one_slow_link_too():
    reports, names = cluster(3, gflops={1: 0.5}, link=lambda a, b: 0.001 if {a, b} == {1, 2} else 1.0)
    res = perf.analyze(reports, names)
    assert res.stragglers == ["node2"], res.findings
    (f,) = res.findings
    assert f.kind == "compute" and f.text.endswith("its link to node3 is slow too (gloo moves data on the CPU)")


def test_one_slow_gpu_of_eight_is_named_by_index():
    names = ["gpu1", "gpu2", "gpu3"]
    reports = {}
    for i, n in enumerate(names):
        per = [300.0] * 8
        if i == 1:
            per[5] = 90.0
        reports[n] = perf.validate_report(n, node_report(i, per, 20.0, [(j, 20.0, 5.0) for j in range(3) if j != i],
                                                         device="NVIDIA H200"))
    res = perf.analyze(reports, names)
    (f,) = res.findings
    assert f.subject == "gpu2" and "(GPU 5 of 8)" in f.text and "nvidia-smi" in f.text


def test_high_latency_alone_is_named():
    reports, names = cluster(5, lat=lambda a, b: 5000.0 if 4 in (a, b) else 50.0)
    res = perf.analyze(reports, names)
    assert res.stragglers == ["node5"] and res.findings[0].kind == "latency"


def test_a_single_node_is_not_compared_with_anything():
    reports, names = cluster(1)
    res = perf.analyze(reports, names)
    assert res.findings == [] and "single node" in res.notes[0]


def test_all_reduce_is_compared_with_the_median_link():
    reports, names = cluster(3)
    res = perf.analyze(reports, names)
    perf.add_all_reduce(res, reports, names)
    assert res.all_reduce[-1]["busbw_gbs"] == 0.2
    assert "0.20x of the median link" in res.notes[-1]


def test_render_names_the_straggler_and_links_the_report():
    reports, names = cluster(4, gflops={3: 1.0})
    res = perf.analyze(reports, names)
    text = perf.render(res, "/r/report.html", 12.3)
    assert "STRAGGLER node4: slow compute" in text
    assert "1 straggler(s) among 4 nodes: node4 (12.3 s)" in text
    assert text.endswith("report: /r/report.html")
    row = [ln for ln in text.splitlines() if ln.startswith("node4")][0]
    assert row.endswith("<")


# -- history --------------------------------------------------------------------------------------------
def test_history_shows_a_node_degrading():
    records = []
    for t, g in enumerate([10.0, 9.8, 6.0, 3.0]):
        reports, names = cluster(3, gflops={1: g})
        res = perf.analyze(reports, names)
        records.append({"time": 1000.0 + t, "run_id": f"perf-{t}", "result": res.to_dict()})
    hist = perf.history(list(reversed(records)))
    assert [r["compute_gflops"] for r in hist["node2"]] == [10.0, 9.8, 6.0, 3.0]
    assert [r["straggler"] for r in hist["node2"]] == [False, False, False, True]
    text = perf.render_history(hist)
    assert "node2: 4 check(s)" in text and "compute 0.30x of its first" in text
    assert perf.history(records, nodes=["node1"]).keys() == {"node1"}


# -- report files ------------------------------------------------------------------------------------------
def test_report_svgs_parse_and_mark_the_slow_node(tmp_path):
    reports, names = cluster(4, link=lambda a, b: 0.003 if 2 in (a, b) else 1.0)
    res = perf.analyze(reports, names)
    record = {"run_id": "perf-x", "time": 0.0, "inventory": "inv.yml", "seconds": 1.0, "result": res.to_dict()}
    paths = perfreport.write(tmp_path, record, perf.render(res))
    for key in ("nodes_svg", "links_svg"):
        root = ET.fromstring(paths[key].read_text())
        assert root.tag.endswith("svg")
    bars = paths["nodes_svg"].read_text()
    assert 'fill="#e15759">node3</text>' in bars  # the straggler's label is red
    assert bars.count(f'fill="{perfreport.SLOW}"><title>node3 link') == 1
    heat = paths["links_svg"].read_text()
    assert "node1--node3: 0.003 GB/s" in heat
    page = paths["html"].read_text()
    assert "stragglers found" in page and "node3: link bandwidth" in page


# -- command line -------------------------------------------------------------------------------------------
def test_the_perf_options_parse_without_eating_the_script():
    from ddpfab.cli import build_parser

    args = build_parser().parse_args(["run", "-i", "inv.yml", "--perf-check", "train.py", "--epochs", "3"])
    assert args.perf_check and not args.perf_check_warn and args.script == "train.py" and args.args == ["--epochs", "3"]
    args = build_parser().parse_args(["check", "-i", "inv.yml", "--perf", "--history", "--runs-dir", "/r"])
    assert args.perf and args.history and args.runs_dir == "/r"


def test_history_of_an_empty_or_foreign_runs_dir(tmp_path):
    from ddpfab.launch.perfcheck import load_records

    (tmp_path / "perf-x").mkdir()
    (tmp_path / "perf-x" / "perf.json").write_text('{"schema": 1, "time": "yesterday"}')
    (tmp_path / "20260101-run").mkdir()  # an ordinary run: no perf.json, not a record
    records, bad = load_records(tmp_path)
    assert records == [] and bad == [str(tmp_path / "perf-x" / "perf.json")]
    assert load_records(tmp_path / "missing") == ([], [])
    assert perf.render_history(perf.history([])).startswith("no perf checks recorded yet")
