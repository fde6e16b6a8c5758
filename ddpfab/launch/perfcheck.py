"""``ddpfab check --perf`` and ``ddpfab run --perf-check``: run the node benchmark as a job.

The benchmark (:mod:`ddpfab.health.perfnode`) is started exactly like a training job: the same connect,
probe, preflight and plan (:func:`ddpfab.launch.runner.prepare`), the same supervisor and torchrun
(:func:`ddpfab.launch.runner.run`), so a check that passes has exercised the path the job will take,
and its record is a run like any other (``runs/<id>/manifest.json`` and node logs), plus
``perf.json`` and the report (``report.html``, ``nodes.svg``, ``links.svg``).

What it places on the nodes is its own: a fresh run dir ``~/.ddpfab/runs/<id>`` (refused if it
exists) holding the script, ``dist.py`` and the supervisor's record. It is removed afterwards, and
``~/.ddpfab/runs`` and ``~/.ddpfab`` too when this check created them and they are empty again.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

from ddpfab.remote import nodeprogram as nodeprog
from ddpfab.health import perf, perfreport
from ddpfab.hosts import inventory
from ddpfab.launch import runner
from ddpfab.launch.cause import RANK_TAG, Fold
from ddpfab.launch.execute import Printer, RunResult
from ddpfab.launch.runs import new_run_id
from ddpfab.optionnames import option
from ddpfab.planning.plan import RunOptions, forwarded_env
from ddpfab.problems import DdpfabError, Problem
from ddpfab.remote import ssh

#: The node-side files (name in the node's run dir -> source here): read, never imported here (torch).
SHIPPED = {"perfnode.py": Path(perf.__file__).with_name("perfnode.py"), "dist.py": Path(__file__).parents[1] / "dist.py"}
REMOTE_RUNS = ".ddpfab/runs"

class PerfError(DdpfabError):
    """The check could not run; ``problems`` has one problem per host or cause."""

    check = "perf"

    def __init__(self, problems: Problem | str | list[Problem | str], code: int = 2):
        super().__init__(problems)
        self.code = code  # the exit code: 2, or 130/143 when interrupted


class CapturePrinter(Printer):
    """Keeps each node's ``DDPFAB_PERF`` record; other lines go to the node logs only (and to
    *echo* when given: ``--verbose``)."""

    def __init__(self, plan, echo=None):
        super().__init__(plan, stream=sys.stderr, color=False)
        self.records: dict[str, str] = {}
        self.echo = echo

    def line(self, node: str, text: str, fold: Fold = Fold.SHOW, local: int | None = None) -> None:
        tag = RANK_TAG.match(text)
        body = text[tag.end():] if tag else text
        if body.startswith(perf.MARKER):
            self.records[node] = body[len(perf.MARKER):]
        elif self.echo:
            super().line(node, text, fold, local)

    def note(self, text: str) -> None:
        if self.echo:
            super().note(text)


def _place(cluster, conns, rel_dir: str) -> dict[str, list[str]]:
    files = {name: path.read_text() for name, path in SHIPPED.items()}
    results = ssh.parallel(cluster.nodes, lambda n: nodeprog.call(
        conns[n.name], n, {"op": "perf_place", "dir": rel_dir, "files": files}, timeout=60)[0])
    problems = [str(e) for e in results.failed.values()]
    problems += [f"host {n}: could not place the benchmark in ~/{rel_dir}: {r.error}"
                 for n, r in results.succeeded.items() if not r.ok]
    made = {n: [str(d) for d in r.result.get("made", [])] for n, r in results.succeeded.items() if r.ok}
    if problems:
        _clean(cluster, conns, rel_dir, made)
        raise PerfError(problems)
    return made


def _clean(cluster, conns, rel_dir: str, made: dict[str, list[str]]) -> list[str]:
    nodes = [n for n in cluster.nodes if n.name in made]
    results = ssh.parallel(nodes, lambda n: nodeprog.call(
        conns[n.name], n, {"op": "perf_clean", "dir": rel_dir, "made": made[n.name], "marker": "perfnode.py"},
        timeout=60)[0])
    why = {**results.failed, **{n: r.error for n, r in results.succeeded.items() if not r.ok}}
    return [f"host {name}: could not remove ~/{rel_dir}: {e}" for name, e in why.items()]


def run_check(cluster: inventory.Inventory, policy: ssh.HostKeyPolicy, runs_dir: str | os.PathLike,
              options: perf.PerfOptions | None = None, ssh_config: str | None = None,
              preflight: bool = True, echo: bool = False, env: tuple[tuple[str, str], ...] | None = None,
              socket_ifname: str | None = None) -> tuple[dict, Path]:
    """Run the benchmark on every node, analyze it and write the record and the report.

    *options*: the benchmark's (default: :class:`perf.PerfOptions`' defaults). *env* and
    *socket_ifname* are the job's (``run --perf-check``), so the check talks over the
    interfaces the job will use; by default the forwarded NCCL_/GLOO_/TORCH_ variables.

    Returns the record (``perf.json``: run id, time, inventory, seconds, the analysis) and the run
    dir. Raises :class:`PerfError` (or ``runner.RunError``) when it cannot run; nothing is left on
    the nodes either way.
    """
    options = options or perf.PerfOptions()
    started = time.monotonic()
    run_id = "perf-" + new_run_id()
    rel_dir = f"{REMOTE_RUNS}/{run_id}"
    # the job's workdir is its own run dir: it holds the script (the user's workdir may not exist yet)
    pcluster = replace(cluster, nodes=tuple(replace(n, workdir=f"~/{rel_dir}") for n in cluster.nodes))
    helper = runner.connect_all(pcluster, policy, ssh_config)  # for placing and cleaning up
    try:
        made = _place(pcluster, helper, rel_dir)
        try:
            run_opts = _job_options(options, len(cluster.nodes), run_id, env, socket_ifname)
            prepared = runner.prepare(pcluster, run_opts, policy, ssh_config, preflight=preflight,
                                      new_run_dir=False)  # _place made it: the job's workdir
            printer = CapturePrinter(prepared.plan, echo=echo)
            try:
                result, manifest = runner.run(prepared, runs_dir, printer)
            finally:
                prepared.close()
        finally:
            left = _clean(pcluster, helper, rel_dir, made)
    finally:
        for c in helper.values():
            c.close()
    run_dir = manifest.parent
    order = [n.name for n in sorted(prepared.plan.nodes, key=lambda n: n.node_rank)]
    reports = _node_reports(order, printer.records, result, run_dir, left)
    res = _analysis(reports, order, options, left)
    record = {"schema": perf.SCHEMA, "run_id": run_id, "time": time.time(), "inventory": cluster.source,
              "seconds": round(time.monotonic() - started, 3),
              "bench_seconds": max(r["seconds"] for r in reports.values()),  # the benchmark alone, on the nodes
              "result": res.to_dict()}
    write_record(run_dir, record)
    return record, run_dir


def _job_options(options: perf.PerfOptions, nodes: int, run_id: str, env: tuple[tuple[str, str], ...] | None,
                 socket_ifname: str | None) -> RunOptions:
    """The benchmark job's options: the shipped script with the node config as its argument, in
    the check's own run dir, over the job's *env* (default: the forwarded variables) and interfaces."""
    cfg = options.node_config(nodes)
    return RunOptions(script="perfnode.py", args=(json.dumps(cfg, separators=(",", ":")),),
                      nproc_per_node=options.nproc_per_node, run_id=run_id,
                      env=forwarded_env(dict(os.environ)) if env is None else env,
                      socket_ifname=socket_ifname, remote_runs_dir=REMOTE_RUNS)


def _node_reports(order: list[str], records: dict[str, str], result: RunResult, run_dir: Path, left: list[str]
                  ) -> dict[str, dict]:
    """node -> its benchmark report (*records*: the ``DDPFAB_PERF`` lines), validated (they are
    data). Raises :class:`PerfError` when the job was interrupted or failed, or a node's record
    is missing or malformed; *left* (what could not be cleaned up) goes with the first two."""
    missing = [n for n in order if n not in records]
    if result.interrupted:
        raise PerfError([f"the perf check was {result.summary}"] + left, code=result.exit_code)
    if result.exit_code != 0 or missing:
        raise PerfError([f"the benchmark job failed: {result.summary}"] +
                        [f"host {n}: no perf record (its output: {run_dir / (n + '.log')})" for n in missing] + left)
    reports = {}
    try:
        for n in order:
            reports[n] = perf.validate_report(n, json.loads(records[n]))
    except perf.PerfDataError as exc:
        raise PerfError(exc.problems) from None
    except ValueError as exc:  # not JSON
        raise PerfError(Problem(n, perf.PerfDataError.check, text=str(exc))) from None
    return reports


def _analysis(reports: dict[str, dict], order: list[str], options: perf.PerfOptions, left: list[str]
              ) -> perf.PerfResult:
    """The nodes' reports judged (stragglers, links, all_reduce), with notes on the link rounds the
    budget cut and on what could not be cleaned up (*left*)."""
    res = perf.analyze(reports, order)
    perf.add_all_reduce(res, reports, order)
    skipped = max(r["rounds_skipped"] for r in reports.values())
    if skipped:
        res.notes.append(f"{skipped} link round(s) skipped: the {options.budget_s:g} s budget ran out")
    res.notes += left
    return res


def before_run(cluster: inventory.Inventory, policy: ssh.HostKeyPolicy, opts, env: tuple[tuple[str, str], ...],
               ssh_config: str | None = None, say=None) -> dict:
    """``run --perf-check`` (``perf_check=True``): the check, with the job's *env* and
    ``socket_ifname``, its table given to *say*; returns the manifest's ``perf`` entry. *opts*:
    the run's options (:class:`ddpfab.api.Options`: ``runs_dir``, ``nproc_per_node``,
    ``socket_ifname``, ``perf_check_warn``). Raises ``runner.RunError`` (nothing started) on a
    straggler unless ``perf_check_warn``."""
    say = say or (lambda text: sys.stderr.write(text + "\n"))
    try:
        record, run_dir = run_check(cluster, policy, opts.runs_dir, perf.PerfOptions(nproc_per_node=opts.nproc_per_node),
                                    ssh_config, env=env, socket_ifname=opts.socket_ifname)
    except PerfError as exc:
        raise runner.RunError([f"perf check: {p}" for p in exc.problems]) from None
    result = record["result"]
    say(perf.render(result_of(record), str(run_dir / "report.html"), record["seconds"]))
    entry = {"run_id": record["run_id"], "record": str(run_dir / "perf.json"), "report": str(run_dir / "report.html"),
             "ok": result["ok"], "stragglers": result["stragglers"], "findings": [f["text"] for f in result["findings"]],
             "medians": result["medians"],
             "nodes": {n: {k: f[k] for k in ("compute_gflops", "memory_gbs", "link_gbs", "latency_us")}
                       for n, f in result["node_figures"].items()}}
    if result["findings"] and not opts.perf_check_warn:
        raise runner.RunError([f"perf check: {f['text']}" for f in result["findings"]] +
                              [f"perf check found stragglers (report: {run_dir / 'report.html'}; "
                               f"start anyway with {option('perf_check_warn', True)})"])
    return entry


def write_record(run_dir: Path, record: dict) -> dict[str, Path]:
    path = run_dir / "perf.json"
    path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    table = perf.render(result_of(record), str(run_dir / "report.html"), record["seconds"])
    paths = perfreport.write(run_dir, record, table)
    return {"json": path, **paths}


def result_of(record: dict) -> perf.PerfResult:
    r = record["result"]
    return perf.PerfResult(nodes=r["nodes"], node_figures=r["node_figures"], links=r["links"],
                           all_reduce=r["all_reduce"], medians=r["medians"],
                           findings=[perf.Finding(**f) for f in r["findings"]], notes=r["notes"],
                           thresholds=r["thresholds"])


def load_records(runs_dir: str | os.PathLike) -> tuple[list[dict], list[str]]:
    """Every ``perf.json`` under *runs_dir* that reads as a record (data, validated); the others
    are named in the second list, not used."""
    records, bad = [], []
    root = Path(runs_dir)
    for path in sorted(root.glob("*/perf.json")) if root.is_dir() else []:
        try:
            rec = json.loads(path.read_text(encoding="utf-8"))
            res = rec["result"]
            ok = (rec.get("schema") == perf.SCHEMA and isinstance(rec["time"], (int, float))
                  and isinstance(rec["run_id"], str) and isinstance(res["node_figures"], dict)
                  and all(isinstance(f.get("compute_gflops"), (int, float)) for f in res["node_figures"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            ok = False
        if ok:
            records.append(rec)
        else:
            bad.append(str(path))
    return records, bad
