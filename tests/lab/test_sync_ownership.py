"""Sync owns only what it placed, refuses what it cannot prove is its own, leaves nothing behind,
and brings results back: on real lab hosts.

Every workdir is under /opt on the nodes (an overlay: the nodes' own copy, never the controller's
directory). Tests that could destroy something first check that the path is inside an overlay
(`findmnt`), since a lab host's `/` is the real machine's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

import ddpfab as ddpfab_pkg
from ddpfab import lab as labmod

from .helpers import ddpfab, host_tmp_leftovers, wait_no_processes
from .test_sync import NODES, git, listing_there, on_node, run_sync, write_inventory

TRAIN = r'''
import json, os
# a dataset that only the nodes have, in a gitignored dir
assert open("data/train.txt").read() == "node-only dataset\n", "the dataset is gone"
epoch = 0
if os.path.exists("snapshot.pt"):
    epoch = json.load(open("snapshot.pt"))["epoch"] + 1
    print("RESUMED from epoch", epoch - 1, flush=True)
json.dump({"epoch": epoch}, open("snapshot.pt", "w"))
os.makedirs("checkpoints", exist_ok=True)
open("checkpoints/epoch%d.pt" % epoch, "w").write("weights %d\n" % epoch)
os.makedirs("wandb/run-1", exist_ok=True)
with open("wandb/run-1/events.log", "a") as fh:
    fh.write("epoch %d\n" % epoch)
print("EPOCH", epoch, flush=True)
'''


def overlay(lab, node: str, path: str) -> None:
    """Fail unless *path* (or the nearest existing dir above it) is inside one of the node's
    overlays: a lab host writing anywhere else writes on the real machine."""
    probe = path
    while True:
        res = on_node(lab, node, f"test -e {probe!r} && findmnt -n -o FSTYPE --target {probe!r}", check=False)
        if res.returncode == 0:
            assert res.stdout.strip() == "overlay", f"{node}:{probe} is not inside an overlay: {res.stdout!r}"
            return
        probe = os.path.dirname(probe.rstrip("/")) or "/"


#: Per dir, what a snapshot of it records: ``tree``, everything under it by name, size, mode and
#: times, the change time included, which nothing can set back (a created, changed or chmod-ed file
#: shows); ``content``, the same and every file's sha256 (small trees).
SNAPSHOT_FIND = {"tree": "find . -xdev -printf '%p %s %y %m %T@ %C@\\n' | sort",
                 "content": "find . -xdev -printf '%p %s %y %m %T@ %C@\\n' | sort && "
                            "find . -xdev -type f -exec sha256sum {} + | sort"}
#: What sshd itself writes into a lab host's overlays at every login (the test's own logins too).
LOGIN_RECORDS = {"upper_var/log/wtmp", "upper_var/log/btmp", "upper_var/log/lastlog"}


def snapshot(lab, node: str, dirs: dict[str, str]) -> dict[str, str]:
    """Each of *dirs* (path: a key of SNAPSHOT_FIND) as *node* sees it, or that it is absent; one login."""
    parts = [f"echo '=== {path}'; if [ -e {path!r} ]; then (cd {path!r} && {SNAPSHOT_FIND[how]}); else echo ABSENT; fi"
             for path, how in dirs.items()]
    out = on_node(lab, node, "; ".join(parts)).stdout
    return dict(zip(dirs, out.split("=== ")[1:], strict=True))


def written(lab, node: str) -> dict[str, tuple[int, int, int, int]]:
    """Everything *node* ever wrote into its overlays (/etc, /opt, /var, /root, /usr, /home, /tmp and
    its shares), at any depth: their upper layers, read here. The node's own writes only: what
    changes on this machine under the overlays' lower dirs (other work's) does not show."""
    store = Path(lab.store) / node
    out = {}
    for upper in sorted(store.glob("upper*")):
        for dirpath, dirnames, filenames in os.walk(upper):
            for name in dirnames + filenames:
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, store)
                if rel not in LOGIN_RECORDS:
                    st = os.lstat(path)
                    out[rel] = (st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    return out


@pytest.fixture
def trainproj(tmp_path) -> Path:
    root = tmp_path / "trainproj"
    root.mkdir()
    (root / "train.py").write_text(TRAIN)
    (root / "model.py").write_text("LAYERS = 2\n")
    (root / ".gitignore").write_text("data/\nsnapshot.pt\ncheckpoints/\nwandb/\n")
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "init")
    return root


def test_training_outputs_and_node_data_survive_three_runs_and_the_second_resumes(lab, tmp_path, trainproj):
    workdir = "/opt/ddpfab/outputs"
    for node in NODES:
        overlay(lab, node, workdir)
    inv = write_inventory(lab, tmp_path / "inv.yml", workdir)
    assert run_sync("-i", str(inv), str(trainproj)).returncode == 0
    for node in NODES:  # the dataset is copied onto the nodes by hand, under the gitignored data/
        on_node(lab, node, f"mkdir -p {workdir}/data && echo node-only dataset > {workdir}/data/train.txt")
    runs = tmp_path / "runs"
    outputs = []
    for i in range(3):
        # a code change before every run: each run does a real copy, not only the hash check
        (trainproj / "model.py").write_text(f"LAYERS = {i + 3}\n")
        git(trainproj, "commit", "-qam", f"change {i}")
        res = ddpfab("run", "-i", str(inv), "--runs-dir", str(runs), "train.py", cwd=trainproj, timeout=240)
        assert res.returncode == 0, res.stdout + res.stderr
        assert res.stdout.count(f"EPOCH {i}") == len(NODES), res.stdout
        assert f"rank 0's workdir: node1:{workdir}" in res.stderr
        outputs.append(res.stdout)
    assert outputs[1].count("RESUMED from epoch 0") == len(NODES)
    assert outputs[2].count("RESUMED from epoch 1") == len(NODES)
    for node in NODES:
        there = listing_there(lab, node, workdir)
        assert {"data/train.txt", "snapshot.pt", "checkpoints/epoch0.pt", "checkpoints/epoch1.pt",
                "checkpoints/epoch2.pt", "wandb/run-1/events.log"} <= set(there), node
        assert on_node(lab, node, f"cat {workdir}/wandb/run-1/events.log").stdout == "epoch 0\nepoch 1\nepoch 2\n"
        # torchrun's per-rank logs are in the node's run dir, never in the project's workdir
        assert not [p for p in there if "torchrun" in p or p.startswith("attempt_")], there


def test_a_file_that_became_a_directory_and_back_syncs_every_time(lab, tmp_path):
    """``item`` a file, then a directory ``item/f``, then a file again: the third sync was refused on
    every node ("a directory that ddpfab did not place"), and every later one too."""
    workdir = "/opt/ddpfab/flip"
    for node in NODES:
        overlay(lab, node, workdir)
    inv = write_inventory(lab, tmp_path / "inv.yml", workdir)
    proj = tmp_path / "flip"
    proj.mkdir()
    (proj / "train.py").write_text("print('hi')\n")
    for shape in ("file", "dir", "file", "dir"):
        item = proj / "item"
        if item.is_dir():
            (item / "f").unlink()
            item.rmdir()
        elif item.exists():
            item.unlink()
        if shape == "dir":
            item.mkdir()
            (item / "f").write_text("in a dir\n")
        else:
            item.write_text("a file\n")
        res = run_sync("-i", str(inv), str(proj))
        assert res.returncode == 0, (shape, res.stdout + res.stderr)
        for node in NODES:
            there = listing_there(lab, node, workdir)
            assert ("item/f" in there) == (shape == "dir") and ("item" in there), (shape, node, there)
    assert run_sync("-i", str(inv), str(proj)).returncode == 0


def test_a_keep_pattern_is_never_overwritten_deleted_or_hashed(lab, tmp_path, trainproj):
    workdir = "/opt/ddpfab/keep"
    inv = write_inventory(lab, tmp_path / "inv.yml", workdir)
    (trainproj / "configs").mkdir()
    (trainproj / "configs" / "local.yaml").write_text("lr: 0.1\n")
    assert run_sync("-i", str(inv), str(trainproj)).returncode == 0
    on_node(lab, "node1", f"echo 'lr: 0.5  # tuned on this node' > {workdir}/configs/local.yaml")
    (trainproj / "configs" / "local.yaml").write_text("lr: 0.2\n")
    res = run_sync("-i", str(inv), "--keep", "configs/", str(trainproj))
    assert res.returncode == 0, res.stderr
    assert "tuned on this node" in on_node(lab, "node1", f"cat {workdir}/configs/local.yaml").stdout
    (trainproj / "configs" / "local.yaml").unlink()
    (trainproj / ".ddpfabkeep").write_text("configs/\n")
    assert run_sync("-i", str(inv), str(trainproj)).returncode == 0
    assert "tuned on this node" in on_node(lab, "node1", f"cat {workdir}/configs/local.yaml").stdout


BAD_WORKDIRS = {
    "trailing newline": "/opt/ddpfab/nl\n",
    "tab": "/opt/ddpfab/a\tb",
    "dotdot": "/opt/ddpfab/x/../../ddpfab-escape",
    "other user's ~": "~ddpfabalice/proj",
    "another user's home": "/opt/ddpfab-homes/ddpfabalice",
    "system dir": "/var/lib",
    "symlink to a system dir": "/opt/ddpfab/to-etc",
    "non-empty foreign dir": "/opt/ddpfab/foreign",
}


#: Every dir a bad workdir above could resolve to, as the node might take it, with its parent where
#: a dir could be created next to them, as the node sees them (before and after each refusal). The
#: overlays' upper layers (``written``) cover the same dirs at any depth, and the rest of the node.
WATCHED = {
    "/opt/ddpfab": "content",  # newline, tab, the `..` path taken literally, the symlink, the foreign dir
    "/opt/ddpfab-escape": "content",  # where the `..` leads ...
    "/opt": "tree",  # ... inside its parent
    "/opt/ddpfab-homes": "content",  # ~ddpfabalice and her home
    "/root/.cache": "tree",  # ddpfab's per-user caches on the node (a tmpfs of its own on lab hosts)
    "/var/lib": "tree",  # the system dir
    "/etc": "tree",  # the symlink's target
}


@pytest.fixture(scope="module")
def hostile_nodes(lab):
    """On every node: a second user whose home is under /opt, a symlink to /etc, a foreign dir."""
    for node in NODES:
        overlay(lab, node, "/opt/ddpfab-homes")
        overlay(lab, node, "/etc/passwd")
        on_node(lab, node, "id ddpfabalice >/dev/null 2>&1 || (mkdir -p /opt/ddpfab-homes && "
                           "useradd -m -d /opt/ddpfab-homes/ddpfabalice ddpfabalice && "
                           "echo her thesis > /opt/ddpfab-homes/ddpfabalice/thesis.tex); "
                           "mkdir -p /opt/ddpfab/foreign && echo precious > /opt/ddpfab/foreign/results.csv && "
                           "ln -sfn /etc /opt/ddpfab/to-etc")
    return True


@pytest.mark.parametrize("case", list(BAD_WORKDIRS))
def test_a_bad_workdir_is_refused_and_nothing_on_the_node_changes(lab, tmp_path, trainproj, hostile_nodes, case):
    raw = BAD_WORKDIRS[case]
    before = {n: (snapshot(lab, n, WATCHED), written(lab, n)) for n in NODES}
    inv = tmp_path / "inv.yml"
    data = yaml.safe_load(labmod.render_inventory(lab, sys.executable))
    data["all"]["vars"]["ddpfab_workdir"] = raw
    inv.write_text(yaml.safe_dump(data, sort_keys=False))
    res = run_sync("-i", str(inv), str(trainproj))
    assert res.returncode == 1, res.stdout + res.stderr
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("ddpfab: error:")]
    assert errors and all("refusing to sync" in ln for ln in errors), res.stderr
    expected = {"trailing newline": "trailing newline", "tab": "control character", "dotdot": "'..'",
                "other user's ~": "~user", "another user's home": "home directory",
                "system dir": "system directory", "symlink to a system dir": "(/etc) is a system directory",
                "non-empty foreign dir": "--adopt"}[case]
    assert expected in errors[0], errors[0]
    for n in NODES:
        seen, wrote = snapshot(lab, n, WATCHED), written(lab, n)
        assert {p: seen[p] for p in WATCHED if seen[p] != before[n][0][p]} == {}, f"{n} changed; before: {before[n][0]}"
        assert {p for p in wrote.keys() | before[n][1].keys() if wrote.get(p) != before[n][1].get(p)} == set(), n
    # `ddpfab plan` takes the workdir through the same rules (the text ones; it does not log in)
    if case in ("trailing newline", "tab", "dotdot", "other user's ~"):
        plan = ddpfab("plan", "-i", str(inv), "--offline", "train.py", cwd=trainproj)
        assert plan.returncode == 2 and expected in plan.stderr, plan.stderr


def test_adopting_a_foreign_dir_deletes_nothing_that_was_there(lab, tmp_path, trainproj):
    workdir = "/opt/ddpfab/adopt-me"
    for node in NODES:
        overlay(lab, node, workdir)
        on_node(lab, node, f"rm -rf {workdir} && mkdir -p {workdir} && echo precious > {workdir}/results.csv && "
                           f"echo their train > {workdir}/train.py")
    inv = write_inventory(lab, tmp_path / "inv.yml", workdir)
    refused = run_sync("-i", str(inv), "--json", str(trainproj))
    assert refused.returncode == 1, refused.stderr
    report = json.loads(refused.stdout)
    assert {n: r["state"] for n, r in report["nodes"].items()} == dict.fromkeys(NODES, "not-ours")
    assert [(p["node"], p["check"], p["fix"]) for p in report["problems"]] == [
        (n, "workdir", "ddpfab sync --adopt") for n in NODES]
    run = ddpfab("run", "-i", str(inv), "train.py", cwd=trainproj, timeout=180)  # the hint comes from that state
    assert run.returncode != 0 and "(to take such a directory over: `ddpfab sync --adopt`)" in run.stderr, run.stderr
    res = run_sync("-i", str(inv), "--adopt", str(trainproj))
    assert res.returncode == 0, res.stderr
    assert "moved to" in res.stderr
    for node in NODES:
        there = listing_there(lab, node, workdir, state=True)
        assert "results.csv" in there
        kept = [p for p in there if p.startswith(".ddpfab/kept/") and p.endswith("/train.py")]
        assert kept and on_node(lab, node, f"cat {workdir}/{kept[0]}").stdout == "their train\n"
    (trainproj / "model.py").unlink()
    assert run_sync("-i", str(inv), str(trainproj)).returncode == 0  # owned now: no --adopt needed
    assert "results.csv" in listing_there(lab, "node2", workdir)


# -- nothing is left behind ------------------------------------------------------------------
def _slow_links(lab, rate: str | None) -> None:
    """Shape (or unshape) what the controller sends to every node (the bridge side of its veth)."""
    for h in lab.hosts:
        subprocess.run(["tc", "qdisc", "del", "dev", h.veth, "root"], capture_output=True)
        if rate:
            subprocess.run(["tc", "qdisc", "add", "dev", h.veth, "root", "tbf", "rate", rate, "burst", "32kbit",
                            "latency", "400ms"], check=True)


def _cmdlines() -> dict[int, str]:
    """Every process's command line here, but this one's."""
    out = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        if int(entry) != os.getpid():
            try:
                out[int(entry)] = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(
                    errors="replace")
            except OSError:
                continue
    return out


def _descendants_ctl_dir(pid: int) -> str | None:
    """The sync's private temp dir, read from the command line of a child of *pid* (rsync's remote
    shell names its relay socket there, the reaper the dir itself)."""
    for child, cmd in _cmdlines().items():
        m = re.search(r"(/tmp/ddpfab-sync-[^/ ]+)", cmd)
        try:
            ppid = int(Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        if ppid == pid and m:
            return m.group(1)
    return None


def _controller_processes_with(text: str) -> list[str]:
    return [f"{pid}: {cmd[:200]}" for pid, cmd in _cmdlines().items() if text in cmd]


#: The prefixes of every temp dir the package makes in the controller's /tmp, read from its code (so
#: a new kind is covered too): the sync's, the provisioner's.
PRODUCT_TMP_PREFIXES = tuple(sorted({m for f in Path(ddpfab_pkg.__file__).parent.rglob("*.py")
                                     for m in re.findall(r'prefix="(ddpfab-[\w-]+)"', f.read_text())}))


def _product_tmp_dirs() -> set[str]:
    return {e.path for e in os.scandir("/tmp") if e.name.startswith(PRODUCT_TMP_PREFIXES)}


def _start_slow_sync(lab, tmp_path, trainproj, workdir: str, *extra: str) -> tuple[subprocess.Popen, str, dict]:
    """A sync of a large file over shaped links, once its copy runs on the nodes; its control dir;
    what the controller's and the nodes' temp dirs held before it started."""
    # ~48 s at 8 Mbit/s: the copy is still running when the test signals, even on a loaded machine
    (trainproj / "weights.bin").write_bytes(os.urandom(48 * 2**20))
    inv = write_inventory(lab, tmp_path / "inv.yml", workdir)
    tmpdir = tmp_path / "tmpdir"  # where ddpfab and its children put temp files by default: here, its own
    tmpdir.mkdir(exist_ok=True)
    before = {"tmp": _product_tmp_dirs(), "nodes": {n: set(host_tmp_leftovers(lab, n)) for n in NODES},
              "tmpdir": tmpdir, "cache": tmp_path / "cache"}
    proc = subprocess.Popen([sys.executable, "-m", "ddpfab", "sync", "-i", str(inv), *extra, str(trainproj)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "NO_COLOR": "1", "TMPDIR": str(tmpdir),
                                 "XDG_CACHE_HOME": str(before["cache"])})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # until this sync's copy runs on the nodes (not another's, ending)
        if any("rsync --server" in cmd and workdir in cmd for n in NODES for _, cmd in lab.processes(n)):
            break
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    else:
        pytest.fail("the copy never started")
    ctl = _descendants_ctl_dir(proc.pid)
    assert ctl and os.path.isdir(ctl)
    return proc, ctl, before


def _assert_nothing_left(lab, proc: subprocess.Popen, ctl: str, workdir: str, before: dict) -> None:
    deadline = time.monotonic() + 10
    while (os.path.exists(ctl) or _controller_processes_with(ctl)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(ctl), f"{ctl} left behind"
    assert not _controller_processes_with(ctl), _controller_processes_with(ctl)  # masters, rsync, agent, watcher
    # no SSH master socket anywhere: none bound by any process under its dir or ddpfab's temp dir
    sockets = [ln.split()[-1] for ln in Path("/proc/net/unix").read_text().splitlines()[1:] if len(ln.split()) > 7]
    assert not [p for p in sockets if p.startswith((ctl, str(before["tmpdir"])))], sockets
    # no temp dir of any kind: nothing in its TMPDIR; no dir of ddpfab's in /tmp that was not there
    # before, except another sync's (in a test running beside this one: its ssh processes name it,
    # and it goes when that sync ends)
    assert list(before["tmpdir"].iterdir()) == []
    new = _product_tmp_dirs() - before["tmp"]
    while new and time.monotonic() < deadline + 10:
        time.sleep(0.2)
        live = " ".join(_cmdlines().values())
        new = {d for d in _product_tmp_dirs() - before["tmp"] if d not in live}
    assert not new, f"left in /tmp: {new} ({PRODUCT_TMP_PREFIXES})"
    # nor a digest-cache temp file of the killed process's (the cache is this test's own)
    assert not list(before["cache"].rglob(f"*.{proc.pid}.tmp")) and not list(before["cache"].rglob(".tmp-*"))
    wait_no_processes(lab, timeout=10, names=list(NODES))  # the remote rsync ends too
    for node in NODES:
        there = listing_there(lab, node, workdir, state=True)
        partial = [p for p in there if re.search(r"(^|/)\.[^/]+\.[A-Za-z0-9]{6}$", p)]
        assert not partial, f"{node}: rsync temp files left: {partial}"
        assert not [p for p in there if p.startswith((".ddpfab/stage/s-", ".ddpfab/sync.json."))], there
        # the node's /tmp gained nothing, nor its digest cache a temp file
        assert set(host_tmp_leftovers(lab, node)) - before["nodes"][node] == set(), node
        assert on_node(lab, node, "find /root/.cache -name '*.tmp' 2>/dev/null").stdout == "", node


@pytest.mark.parametrize("fanout", ["star", "tree"])
def test_sigkill_mid_sync_leaves_no_master_agent_or_temp_dir(lab, tmp_path, trainproj, fanout):
    workdir = f"/opt/ddpfab/killed-{fanout}"
    _slow_links(lab, "8mbit")
    try:
        proc, ctl, before = _start_slow_sync(lab, tmp_path, trainproj, workdir, "--fanout", fanout)
        if fanout == "tree":
            assert _controller_processes_with(f"ssh-agent -D -a {ctl}/agent.sock")
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
        _assert_nothing_left(lab, proc, ctl, workdir, before)
    finally:
        _slow_links(lab, None)


def test_ctrl_c_mid_sync_exits_130_with_one_line(lab, tmp_path, trainproj):
    workdir = "/opt/ddpfab/interrupted"
    _slow_links(lab, "8mbit")
    try:
        proc, ctl, before = _start_slow_sync(lab, tmp_path, trainproj, workdir)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130
        assert err.strip().splitlines() == [
            "ddpfab: sync interrupted: nothing is left running; files already copied stay, the next sync completes "
            "them"], err
        _assert_nothing_left(lab, proc, ctl, workdir, before)
    finally:
        _slow_links(lab, None)
    assert run_sync("-i", str(tmp_path / "inv.yml"), str(trainproj)).returncode == 0  # and the next sync completes


# -- results come back -------------------------------------------------------------------------
def test_fetch_a_checkpoint_from_rank_0_matches_its_sha256_there(lab, tmp_path, trainproj):
    workdir = "/opt/ddpfab/fetch"
    inv = write_inventory(lab, tmp_path / "inv.yml", workdir)
    assert run_sync("-i", str(inv), str(trainproj)).returncode == 0
    for node in NODES:
        on_node(lab, node, f"mkdir -p {workdir}/checkpoints && head -c 20000000 /dev/urandom > "
                           f"{workdir}/checkpoints/model.pt")
    there = on_node(lab, "node1", f"sha256sum {workdir}/checkpoints/model.pt").stdout.split()[0]
    local = tmp_path / "results"
    res = ddpfab("fetch", "-i", str(inv), "--node-rank", "0", "checkpoints/model.pt", str(local))
    assert res.returncode == 0, res.stderr
    assert hashlib.sha256((local / "model.pt").read_bytes()).hexdigest() == there
    assert f"fetched node1:{workdir}/checkpoints/model.pt" in res.stdout
    assert "100%" in res.stderr  # rsync's progress line, for a large file
    # a dir, from another node, by name; an existing destination is not overwritten
    res = ddpfab("fetch", "-i", str(inv), "--node", "node2", "checkpoints", str(local))
    assert res.returncode == 0 and (local / "checkpoints" / "model.pt").exists(), res.stderr
    again = ddpfab("fetch", "-i", str(inv), "--node", "node2", "checkpoints", str(local))
    assert again.returncode == 1 and "--overwrite" in again.stderr
    # --overwrite replaces the directory: what only this side had is gone, not merged in
    (local / "checkpoints" / "stale.pt").write_text("from an older fetch")
    again = ddpfab("fetch", "-i", str(inv), "--node", "node2", "--overwrite", "checkpoints", str(local))
    assert again.returncode == 0, again.stderr
    assert sorted(p.name for p in (local / "checkpoints").iterdir()) == ["model.pt"]
    for bad, why in (("../../../etc/shadow", "'..'"), ("/etc/shadow", "outside the workdir"),
                     ("./.", "is the workdir itself"), (str(workdir), "is the workdir itself")):
        res = ddpfab("fetch", "-i", str(inv), bad, str(tmp_path / "nope"))
        assert res.returncode == 1 and why in res.stderr, res.stderr
        assert not (tmp_path / "nope").exists()


@contextlib.contextmanager
def small_disk(kind: str, where: Path):
    """A filesystem of about 4 MiB on this machine (the controller), mounted at *where*: a tmpfs, or
    ext4 on a loop device (where a directory costs a block, and root has reserved blocks)."""
    where.mkdir()
    if kind == "tmpfs":
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(where)], check=True)
    else:
        image = where.with_suffix(".img")
        subprocess.run(["truncate", "-s", "5M", str(image)], check=True)
        subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
        subprocess.run(["mount", "-o", "loop", str(image), str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)  # (a loop device goes with it)


def _files_on(disk: Path) -> list[str]:
    return sorted(str(p.relative_to(disk)) for p in disk.rglob("*") if "lost+found" not in p.parts)


@pytest.mark.parametrize("kind", ["tmpfs", "ext4"])
def test_fetch_into_a_disk_too_small_says_so_and_a_disk_that_fills_gives_its_space_back(lab, tmp_path, trainproj,
                                                                                       kind):
    """This machine's disk, not the node, is named: refused before copying when LOCAL_DIR has less room
    than the node's file; when the disk fills during the copy (--overwrite of a directory skips the
    first check: only its changed files are copied), the unfinished copy goes and the space comes back."""
    workdir = f"/opt/ddpfab/fetch-full-{kind}"
    inv = write_inventory(lab, tmp_path / "inv.yml", workdir)
    assert run_sync("-i", str(inv), str(trainproj)).returncode == 0
    on_node(lab, "node1", f"mkdir -p {workdir}/ckpt && head -c 12000000 /dev/urandom > {workdir}/ckpt/model.pt")
    with small_disk(kind, tmp_path / "small") as small:
        res = ddpfab("fetch", "-i", str(inv), "--node", "node1", "ckpt/model.pt", str(small))
        assert res.returncode == 1, res.stderr
        assert re.search(rf"LOCAL_DIR {re.escape(str(small))}: this machine's disk there has [0-9.]+ [KM]iB free, "
                         rf"11 MiB needed for {workdir}/ckpt/model.pt from node1 \(a file\): free space here, or give "
                         r"a LOCAL_DIR on another disk; nothing was copied", res.stderr), res.stderr
        assert "host node1" not in res.stderr and _files_on(small) == []
        print(res.stderr)
        (small / "ckpt").mkdir()
        (small / "ckpt" / "model.pt").write_text("an older copy")
        res = ddpfab("fetch", "-i", str(inv), "--node", "node1", "--overwrite", "ckpt", str(small))
        assert res.returncode == 1, res.stderr
        assert f"LOCAL_DIR {small}: this machine's disk there filled up during the copy of {workdir}/ckpt " \
               "from node1 (rsync exit " in res.stderr, res.stderr
        assert f"what it had copied ({small}/ckpt/.ddpfab-partial) was removed; it has " in res.stderr, res.stderr
        assert "host node1" not in res.stderr
        print(res.stderr)
        left = _files_on(small)
        assert ".ddpfab-partial" not in " ".join(left), left  # nothing unfinished of rsync's stays
        free = os.statvfs(small)
        assert free.f_bfree * free.f_frsize > 3 << 20  # the space is back
