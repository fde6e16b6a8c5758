"""Private keys stay home: the key rule, the selection that applies it (git or walk), its one line,
the flag and the ``.ddpfabignore`` negation that send keys on purpose, and ownership (a key left
out is never deleted on a node). Fast, no hosts."""

from __future__ import annotations

import builtins
import os
import subprocess
from pathlib import Path

import pytest

from ddpfab import cli
from ddpfab.api import Cluster, Options
from ddpfab.cli import run as run_cli
from ddpfab.hosts import inventory
from ddpfab.launch import replay
from ddpfab.optionnames import spelled_by
from ddpfab.transfer import keys, sync

OPENSSH = b"-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmU=\n-----END OPENSSH PRIVATE KEY-----\n"
HEADERS = ("OPENSSH PRIVATE KEY", "RSA PRIVATE KEY", "PRIVATE KEY", "EC PRIVATE KEY", "DSA PRIVATE KEY",
           "ENCRYPTED PRIVATE KEY")
CERT = b"-----BEGIN CERTIFICATE-----\nMIIBszCCAVmgAwIBAgIU\n-----END CERTIFICATE-----\n"


@pytest.fixture(autouse=True)
def _own_cache_home(tmp_path, monkeypatch):
    """Digest caches go to a temp dir, not the user's ~/.cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def write(root: Path, spec: dict[str, bytes | str]) -> Path:
    for rel, content in spec.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content if isinstance(content, bytes) else content.encode())
    return root


def git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(root), "-c", "user.email=t@t", "-c", "user.name=t", *args], check=True,
                   capture_output=True)


#: A project with keys beside its code: what is left out, what is sent.
PROJECT = {
    "train.py": "print('train')\n",
    "id_map.py": "IDS = {}\n",  # an id_* name that is no key name
    "lab/id_ed25519": OPENSSH,
    "lab/id_ed25519.pub": "ssh-ed25519 AAAAC3Nza lab\n",
    "lab/nodes/node1/ssh_host_ed25519_key": OPENSSH,
    "certs/server.pem": CERT + b"-----BEGIN PRIVATE KEY-----\nMIIEvQ\n-----END PRIVATE KEY-----\n",
    "certs/ca.pem": CERT,
    "deploy/.ssh/config": "Host *\n",
    ".env": "TOKEN=x\n",
}
LEFT_OUT = ["certs/server.pem", "deploy/.ssh/config", "lab/id_ed25519", "lab/nodes/node1/ssh_host_ed25519_key"]


# -- the rule ----------------------------------------------------------------------------------
@pytest.mark.parametrize("header", HEADERS)
def test_a_file_starting_with_a_private_key_header_is_a_key_whatever_its_name(tmp_path, header):
    path = tmp_path / "anything"
    path.write_bytes(f"-----BEGIN {header}-----\nMIIEvQIBADANBg\n-----END {header}-----\n".encode())
    assert keys.is_private_key(path)
    path.write_bytes(b"\n  " + path.read_bytes())  # blank lines before the armour
    assert keys.is_private_key(path)


def test_other_armour_and_text_that_mentions_a_header_are_no_keys(tmp_path):
    for rel, content in (("cert.crt", CERT), ("key.pub", b"-----BEGIN PUBLIC KEY-----\nMIIBIj\n-----END PUBLIC KEY-----\n"),
                         ("notes.md", b"Keys start with -----BEGIN OPENSSH PRIVATE KEY----- (do not commit them)\n"),
                         ("tiny", b"-----BEGIN")):
        assert not keys.is_private_key(write(tmp_path, {rel: content}) / rel), rel


@pytest.mark.parametrize("name", ["id_rsa", "id_dsa", "id_ecdsa", "id_ed25519", "id_ecdsa_sk", "id_ed25519_sk",
                                  "id_rsa_work", "id_ed25519.github", "id_rsa-old"])
def test_openssh_key_names_are_keys_without_reading_them(tmp_path, name):
    path = tmp_path / name
    path.write_text("")  # empty: the name alone decides
    assert keys.key_name(name) and keys.is_private_key(path)


@pytest.mark.parametrize("name", ["id_rsa.pub", "id_ed25519.pub", "id_ed25519_sk.pub", "id_map.py", "id_", "ids.txt",
                                  "my_id_rsa_notes.txt"])
def test_public_keys_and_other_id_names_are_kept(tmp_path, name):
    path = tmp_path / name
    path.write_text("ssh-ed25519 AAAAC3Nza user@host\n")
    assert not keys.key_name(name) and not keys.is_private_key(path)


def test_a_pem_or_key_file_counts_only_when_it_holds_a_private_key_anywhere(tmp_path):
    write(tmp_path, {"ca.pem": CERT, "chain.pem": CERT * 3 + OPENSSH.replace(b"OPENSSH ", b""),
                     "tls.key": b"Bag Attributes\n    localKeyID: 01\n" + OPENSSH, "notes.txt": CERT + OPENSSH})
    assert not keys.is_private_key(tmp_path / "ca.pem")
    assert keys.is_private_key(tmp_path / "chain.pem")  # the bundle's key after its certificates
    assert keys.is_private_key(tmp_path / "tls.key")
    assert not keys.is_private_key(tmp_path / "notes.txt")  # elsewhere only a file's start counts


def test_a_big_file_is_never_read_and_a_link_is_no_key(tmp_path, monkeypatch):
    big = tmp_path / "weights.pem"
    big.write_bytes(OPENSSH + b"\0" * keys.KEY_SIZE_LIMIT)
    (tmp_path / "link").symlink_to(tmp_path / "key")
    (tmp_path / "key").write_bytes(OPENSSH)
    opened = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda f, *a, **k: opened.append(str(f)) or real_open(f, *a, **k))
    monkeypatch.setattr(builtins, "open", lambda f, *a, **k: pytest.fail(f"read whole: {f}"))
    assert not keys.is_private_key(big)
    assert not keys.is_private_key(tmp_path / "link")  # rsync sends a link as a link
    assert opened == []
    assert keys.is_private_key(tmp_path / "key") and opened == [str(tmp_path / "key")]


def test_files_under_a_ssh_dir_are_withheld_at_any_depth(tmp_path):
    write(tmp_path, {".ssh/known_hosts": "x\n", "a/.ssh/config": "Host *\n", "ssh/config": "x\n", "a/.sshrc": "x\n"})
    assert [rel for rel in (".ssh/known_hosts", "a/.ssh/config", "ssh/config", "a/.sshrc")
            if keys.withheld(str(tmp_path), rel)] == [".ssh/known_hosts", "a/.ssh/config"]


def test_the_line_says_how_many_where_and_how_to_send_them():
    line = keys.left_out_line(LEFT_OUT)
    assert line.startswith("sync: left out 3 private keys and 1 file in .ssh/ (certs/server.pem, "
                           "deploy/.ssh/config, lab/id_ed25519, ...): they never leave this machine; "
                           "include_keys=True sends them")
    assert keys.left_out_line(["lab/id_ed25519"]).startswith("sync: left out 1 private key (lab/id_ed25519):")
    with spelled_by(run_cli.flag):  # the command line's user reads its flag
        assert "machine; --include-keys sends them" in keys.left_out_line(LEFT_OUT)


# -- the selection -----------------------------------------------------------------------------
@pytest.mark.parametrize("in_git", [True, False], ids=["git", "walk"])
def test_the_selection_leaves_keys_out_whatever_made_the_list(tmp_path, in_git):
    root = write(tmp_path / "p", PROJECT)
    if in_git:
        git(root, "init", "-q")
        git(root, "add", "-A")
    sel = sync.select(root)
    assert sel.source == ("git" if in_git else "walk")
    assert sel.left_out == LEFT_OUT
    assert not set(LEFT_OUT) & set(sel.files)
    assert {"train.py", "id_map.py", "lab/id_ed25519.pub", "certs/ca.pem", ".env"} <= set(sel.files)
    everything = sync.select(root, include_keys=True)
    assert everything.left_out == [] and set(LEFT_OUT) <= set(everything.files)
    assert sorted(everything.files) == sorted(sel.files + LEFT_OUT)
    assert sync.local_tree(sel)["tree_hash"] != sync.local_tree(everything)["tree_hash"]


@pytest.mark.parametrize("in_git", [True, False], ids=["git", "walk"])
def test_a_ddpfabignore_negation_sends_the_key_it_names_and_only_that(tmp_path, in_git):
    root = write(tmp_path / "p", {**PROJECT, ".ddpfabignore": "!lab/id_ed25519\n!deploy/.ssh/\n"})
    if in_git:
        git(root, "init", "-q")
    sel = sync.select(root)
    assert sel.left_out == ["certs/server.pem", "lab/nodes/node1/ssh_host_ed25519_key"]
    assert {"lab/id_ed25519", "deploy/.ssh/config"} <= set(sel.files)
    (root / ".ddpfabignore").write_text("!lab/id_ed25519\nlab/\n")  # the last rule wins, as in git
    assert not [rel for rel in sync.select(root).files if rel.startswith("lab/")]


def test_a_key_left_out_is_never_deleted_on_a_node_even_where_ddpfab_placed_it(tmp_path):
    """Ownership: a placed key that is still here but now left out is released, as an ignored
    file is; only a placed file gone from here is deleted."""
    root = write(tmp_path / "p", PROJECT)
    sel = sync.select(root)
    placed = sorted(set(sel.files) | set(LEFT_OUT) | {"gone.py"})
    assert sync.deletions(sel, placed) == ["gone.py"]


def test_a_result_carries_what_was_left_out_and_replay_hashes_the_tree_as_the_run_sent_it(tmp_path):
    root = write(tmp_path / "p", PROJECT)
    sel = sync.select(root)
    result = sel.result(tree_hash="h", bytes=0, fanout="star")
    assert result.to_dict()["left_out"] == LEFT_OUT and result.include_keys is False
    assert sync.local_tree(replay._current_tree({"src": str(root)}))["tree_hash"] == sync.local_tree(sel)["tree_hash"]
    everything = sync.local_tree(sync.select(root, include_keys=True))["tree_hash"]
    assert sync.local_tree(replay._current_tree({"src": str(root), "include_keys": True}))["tree_hash"] == everything


# -- the commands ------------------------------------------------------------------------------
def test_sync_list_says_the_line_and_include_keys_lists_them(tmp_path, capsys):
    root = write(tmp_path / "p", PROJECT)
    assert cli.main(["sync", "--list", str(root)]) == 0
    out, err = capsys.readouterr()
    assert not set(LEFT_OUT) & set(out.splitlines())
    assert err.count("left out") == 1 and "sync: left out 3 private keys and 1 file in .ssh/" in err
    assert cli.main(["sync", "--list", "--include-keys", str(root)]) == 0
    out, err = capsys.readouterr()
    assert set(LEFT_OUT) <= set(out.splitlines()) and "left out" not in err


def test_sync_and_run_take_include_keys_and_run_passes_it_to_the_api():
    import argparse

    from ddpfab.cli import sync as sync_cli

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    run_cli.register(sub)
    sync_cli.register(sub)
    assert run_cli.options(parser.parse_args(["run", "-i", "h1,", "--include-keys", "t.py"])).include_keys is True
    assert run_cli.options(parser.parse_args(["run", "-i", "h1,", "t.py"])).include_keys is False
    assert parser.parse_args(["sync", "--include-keys"]).include_keys is True
    assert Options.of().include_keys is False


def test_a_run_dry_run_says_the_same_line_as_its_sync_would(tmp_path, monkeypatch):
    root = write(tmp_path / "p", PROJECT)
    monkeypatch.chdir(root)
    said: list[str] = []
    cluster = Cluster(inventory.load("192.0.2.1,192.0.2.2,"), say=said.append)  # TEST-NET: nothing answers
    runs = str(tmp_path / "runs")
    assert cluster.run("train.py", dry_run=True, offline=True, runs_dir=runs).exit_code == 0
    assert [s for s in said if "left out" in s] == [keys.left_out_line(LEFT_OUT)]
    said.clear()
    assert cluster.run("train.py", dry_run=True, offline=True, runs_dir=runs, include_keys=True).exit_code == 0
    assert cluster.run("train.py", dry_run=True, offline=True, runs_dir=runs, sync=False).exit_code == 0
    assert not [s for s in said if "left out" in s]
