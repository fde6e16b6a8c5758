"""The known_hosts file is parsed once per version of it, and every connection still checks
against what the file says now (ddpfab/remote/sshopen.py: _known_entries)."""

from __future__ import annotations

import os

import paramiko
import pytest

from ddpfab.remote import ssh, sshopen
from ddpfab.remote.target import Target


def _line(host: str, key: paramiko.PKey) -> str:
    return f"{host} {key.get_name()} {key.get_base64()}\n"


@pytest.fixture
def known(tmp_path):
    keys = {f"10.0.0.{i}": paramiko.ECDSAKey.generate() for i in range(1, 4)}
    path = tmp_path / "known_hosts"
    path.write_text("".join(_line(h, k) for h, k in keys.items()))
    return path, keys


def _client_keys(path, host: str) -> paramiko.HostKeys:
    return sshopen._connection("n1", Target("n1", host, known_hosts=(str(path),))).client.get_host_keys()


def test_every_connection_sees_the_files_keys_and_the_file_is_parsed_once(known):
    path, keys = known
    first, second = _client_keys(path, "10.0.0.1"), _client_keys(path, "10.0.0.2")
    for hk in (first, second):
        assert {h: hk.lookup(h)["ecdsa-sha2-nistp256"] for h in keys} == keys
    assert sshopen._known_entries(path) is sshopen._known_entries(path)  # one parse for an unchanged file


def test_a_key_one_connection_records_stays_its_own(known):
    path, _ = known
    first, second = _client_keys(path, "10.0.0.1"), _client_keys(path, "10.0.0.2")
    new = paramiko.ECDSAKey.generate()
    first.add("10.0.0.9", new.get_name(), new)  # what accept-new does on one connection
    first.add("10.0.0.1", new.get_name(), new)  # (paramiko replaces a host's key of a type in place)
    assert second.lookup("10.0.0.9") is None and _client_keys(path, "10.0.0.3").lookup("10.0.0.9") is None
    assert second.lookup("10.0.0.1")["ecdsa-sha2-nistp256"] == known[1]["10.0.0.1"]


def test_a_changed_file_is_read_again(known):
    path, keys = known
    _client_keys(path, "10.0.0.1")
    replaced = paramiko.ECDSAKey.generate()
    text = path.read_text().replace(keys["10.0.0.2"].get_base64(), replaced.get_base64())
    path.write_text(text + _line("10.0.0.7", replaced))
    st = path.stat()  # a rewrite within the clock's resolution must still count as a change
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    hk = _client_keys(path, "10.0.0.1")
    assert hk.lookup("10.0.0.2")["ecdsa-sha2-nistp256"] == replaced
    assert hk.lookup("10.0.0.7")["ecdsa-sha2-nistp256"] == replaced


def test_an_unreadable_known_hosts_is_an_error_naming_the_node_and_the_file(tmp_path):
    path = tmp_path / "kh"
    path.mkdir()  # exists, cannot be read as a file
    with pytest.raises(ssh.SSHError) as err:
        _client_keys(path, "10.0.0.1")
    assert err.value.node == "n1" and f"cannot read known_hosts {path}" in str(err.value)
