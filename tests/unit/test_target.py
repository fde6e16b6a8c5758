"""ddpfab.remote.target: one decision of how to reach a node, the same in every rendering."""

from __future__ import annotations

import os
import re
import shlex
import subprocess

import pytest

from ddpfab.hosts.inventory import InventoryError, Node, parse_ssh_args
from ddpfab.remote.target import (
    HostKeyPolicy,
    Target,
    TargetError,
    ansible_vars,
    config_alias,
    host_names,
    host_path,
    openssh_options,
    resolve,
    scp_argv,
    ssh_argv,
    ssh_config_text,
    ssh_problem,
    unresolved,
)

CONFIG = """\
Host bastion
  HostName 10.1.1.1
  User jumper
  IdentityFile /k/jump
  UserKnownHostsFile /kh/jump_known
Host inner
  HostName 10.2.2.2
  ProxyJump bastion
Host n1
  HostName 10.0.0.5
  Port 2200
  User cfguser
  ProxyJump inner
Host *
  ServerAliveInterval 30
"""


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "ssh_config"
    path.write_text(CONFIG)
    return str(path)


def node(name="n1", host=None, args="", **kw) -> Node:
    return Node(name=name, host=host or name, ssh_options=parse_ssh_args(args), **kw)


def refused(tmp_path, match: str, config_text: str = "", policy: HostKeyPolicy | None = None, **node_kw) -> None:
    """resolve() of node(**node_kw) with an ssh_config of *config_text* raises a TargetError matching *match*."""
    cfg = tmp_path / "cfg"
    cfg.write_text(config_text)
    with pytest.raises(TargetError, match=match):
        resolve(node(**node_kw), policy or HostKeyPolicy(), str(cfg))


def test_ssh_config_gives_address_port_user_and_a_chain_of_checked_jump_hosts(config):
    t = resolve(node(key_file="/k/id", args="-o UserKnownHostsFile=/kh/nodes"), HostKeyPolicy(), config)
    assert (t.host, t.port, t.user, t.identity_files) == ("10.0.0.5", 2200, "cfguser", ("/k/id",))
    assert [h.host for h in t.chain()] == ["10.0.0.5", "10.2.2.2", "10.1.1.1"]
    inner, bastion = t.jump, t.jump.jump
    # the jump host's own ssh_config wins; what it does not say comes from the node it serves
    assert bastion.known_hosts == ("/kh/jump_known",) and bastion.identity_files == ("/k/jump",)
    assert inner.known_hosts == ("/kh/nodes",) and inner.identity_files == ("/k/id",)
    assert bastion.label == "host n1: jump host bastion" and t.label == "host n1"
    assert ("ServerAliveInterval".lower(), "30") in t.tuning


def test_inventory_wins_over_ssh_config_as_on_the_ssh_command_line(config):
    t = resolve(node(port=22, user="root", args="-o ProxyJump=root@10.9.9.9:23 -o HostName=10.0.0.6"),
                HostKeyPolicy(), config)
    assert (t.host, t.port, t.user) == ("10.0.0.6", 22, "root")
    assert (t.jump.name, t.jump.host, t.jump.port, t.jump.user, t.jump.jump) == (
        "root@10.9.9.9:23", "10.9.9.9", 23, "root", None)


def test_a_jump_list_goes_through_its_hosts_in_order(config):
    t = resolve(node("x", "10.0.0.7", args="-J a@10.3.3.3,bastion"), HostKeyPolicy(), config)
    assert [h.host for h in t.chain()] == ["10.0.0.7", "10.1.1.1", "10.3.3.3"]


def test_policy_known_hosts_and_accept_new_apply_to_every_hop(config):
    t = resolve(node(), HostKeyPolicy(known_hosts="/pinned", accept_new=True), config)
    assert all(h.known_hosts == ("/pinned",) and h.accept_new for h in t.chain())


def test_openssh_rendering_hands_the_jump_host_the_same_policy(config):
    t = resolve(node(key_file="/k/id", args="-o UserKnownHostsFile=/kh/nodes"), HostKeyPolicy(), config)
    argv = ssh_argv(t, "hostname")
    assert argv[:3] == ["ssh", "-F", "/dev/null"] and argv[-2:] == ["10.0.0.5", "hostname"]
    proxy = next(a for a in argv if a.startswith("ProxyCommand="))[len("ProxyCommand="):]
    inner = shlex.split(proxy)
    assert inner[-3:] == ["10.2.2.2", "-W", "[%h]:%p"]
    assert "StrictHostKeyChecking=yes" in inner and "UserKnownHostsFile=/kh/nodes" in inner
    innermost = shlex.split(next(a for a in inner if a.startswith("ProxyCommand="))[len("ProxyCommand="):])
    # one level deeper, ssh's own %-tokens are escaped once per level
    assert innermost[-3:] == ["10.1.1.1", "-W", "[%%h]:%%p"] and "UserKnownHostsFile=/kh/jump_known" in innermost
    assert "-J" not in argv and not any(a.lower().startswith("proxyjump") for a in argv)


def test_scp_and_ansible_render_the_same_target(config):
    t = resolve(node(key_file="/k/id"), HostKeyPolicy(), config)
    scp = scp_argv(t, "f.sh")
    assert scp[scp.index("-P") + 1] == "2200" and "User=cfguser" in scp and "-l" not in scp
    assert scp[-2:] == ["f.sh", "10.0.0.5:"]
    av = ansible_vars(t, "/cp/%C")
    assert av["ansible_host"] == "10.0.0.5" and av["ansible_ssh_extra_args"] == av["ansible_ssh_common_args"] == ""
    # the ssh_config's User is Ansible's login user too (its become decision reads it)
    assert av["ansible_user"] == "cfguser"
    # ssh_args: the first on Ansible's ssh command line, so OpenSSH takes ddpfab's values
    ssh_args = shlex.split(av["ansible_ssh_args"])
    assert ssh_args[:len(openssh_options(t))] == openssh_options(t) and "ControlPath=/cp/%C" in ssh_args


@pytest.mark.parametrize("args, named", [
    ("-o HostKeyAlias=x", "hostkeyalias"),
    ("-o KnownHostsCommand=/bin/x", "knownhostscommand"),
    ("-o LocalForward=1:a:2", "localforward"),
    ("-o StrictHostKeyChecking=no", "StrictHostKeyChecking=no"),
    ("-o 'ProxyCommand=nc %h %p' -o ProxyJump=b", "both ProxyJump and ProxyCommand"),
])
def test_an_option_that_cannot_be_honoured_is_an_error_naming_it_and_the_host(args, named):
    with pytest.raises(TargetError, match="host n1") as exc:
        resolve(node(args=args), HostKeyPolicy(), os.devnull)
    assert named in str(exc.value)


def test_an_unsupported_option_in_the_ssh_config_is_named_with_the_file(tmp_path):
    cfg = tmp_path / "cfg"
    cfg.write_text("Host n1\n  CertificateFile /c\n")
    with pytest.raises(TargetError, match=rf"certificatefile=/c \(from ssh_config {cfg}\)"):
        resolve(node(), HostKeyPolicy(), str(cfg))


def test_an_unsupported_ssh_flag_in_the_inventory_is_refused():
    with pytest.raises(InventoryError, match="'-A'"):
        parse_ssh_args("-A -o User=x")
    assert parse_ssh_args("-q -J b -l u -p2222 -C") == {"proxyjump": "b", "user": "u", "port": "2222",
                                                        "compression": "yes"}


def test_include_is_followed(tmp_path):
    (tmp_path / "part.conf").write_text("Host n1\n  HostName 10.4.4.4\n")
    cfg = tmp_path / "cfg"
    cfg.write_text(f"Include {tmp_path}/*.conf\n")
    assert resolve(node(), HostKeyPolicy(), str(cfg)).host == "10.4.4.4"


def test_a_config_is_parsed_once_while_what_was_read_is_unchanged(tmp_path, monkeypatch):
    """Every node's resolve read the same file: it is parsed once, and again as soon as it, a file
    it includes, or the directory an Include searched changes (each lookup is kept only with its
    parse, and not at all under a Match exec, whose command may answer otherwise)."""
    import paramiko

    parsed = []
    real = paramiko.SSHConfig.from_text
    monkeypatch.setattr(paramiko.SSHConfig, "from_text", lambda text: parsed.append(text) or real(text))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.conf").write_text("Host n1\n  User one\n")
    cfg = tmp_path / "cfg"
    cfg.write_text(f"Include {tmp_path}/d/*.conf\nHost n1\n  HostName 10.4.4.4\n")

    def user() -> str | None:
        return resolve(node(), HostKeyPolicy(), str(cfg)).user
    assert [user() for _ in range(5)] == ["one"] * 5 and len(parsed) == 1
    (tmp_path / "d" / "a.conf").write_text("Host n1\n  User two\n")  # an included file changes
    assert user() == "two" and len(parsed) == 2
    (tmp_path / "d" / "0.conf").write_text("Host n1\n  User three\n")  # a file joins the Include
    assert user() == "three" and len(parsed) == 3
    cfg.write_text("Host n1\n  HostName 10.4.4.4\n  Port 2201\n")  # the file itself
    assert resolve(node(), HostKeyPolicy(), str(cfg)).port == 2201 and len(parsed) == 4
    assert resolve(node(), HostKeyPolicy(), str(cfg)).port == 2201 and len(parsed) == 4
    calls = []
    monkeypatch.setattr(paramiko.SSHConfig, "lookup", lambda self, host: calls.append(host) or {"hostname": host})
    cfg.write_text("Match exec true\n  Port 2202\nHost n1\n  HostName 10.4.4.4\n")
    resolve(node(), HostKeyPolicy(), str(cfg)), resolve(node(), HostKeyPolicy(), str(cfg))
    assert len(calls) == 2 and len(parsed) == 5
    cfg.write_text("Host n1\n  HostName 10.4.4.4\n")
    resolve(node(), HostKeyPolicy(), str(cfg)), resolve(node(), HostKeyPolicy(), str(cfg))
    assert len(calls) == 3 and len(parsed) == 6


def test_the_same_config_under_another_home_is_read_as_that_home_reads_it(tmp_path, monkeypatch):
    """A relative Include is under ~/.ssh: the same bytes mean another file for another home."""
    for home, user in (("a", "alice"), ("b", "bob")):
        (tmp_path / home / ".ssh").mkdir(parents=True)
        (tmp_path / home / ".ssh" / "part.conf").write_text(f"Host n1\n  User {user}\n")
    cfg = tmp_path / "cfg"
    cfg.write_text("Include part.conf\n")
    got = []
    for home in ("a", "b", "a"):
        monkeypatch.setenv("HOME", str(tmp_path / home))
        got.append(resolve(node(), HostKeyPolicy(), str(cfg)).user)
    assert got == ["alice", "bob", "alice"]


def _config_file(beside: str, text: str) -> str:
    path = os.path.join(os.path.dirname(beside), "other_config")
    with open(path, "w") as fh:
        fh.write(text)
    return path


def test_a_host_name_that_does_not_resolve_is_matched_against_the_known_names(config):
    """A typo in the inventory (``bastoin``) resolves to nothing: both transports' words name the
    ssh_config's closest Host name and where the fix goes; patterns are never suggested; a jump
    host keeps the node's ssh_config."""
    assert {"bastion", "inner", "n1", "localhost"} <= set(host_names(config)) and "*" not in host_names(config)
    t = resolve(node("bastoin"), HostKeyPolicy(), config)
    assert t.ssh_config == config and resolve(node("n1"), HostKeyPolicy(), config).jump.ssh_config == config
    said = unresolved(t, "Name or service not known")
    assert said == ("the name bastoin does not resolve (Name or service not known) (did you mean 'bastion'?); fix "
                    f"the host's name or its ansible_host in the inventory, or give it a Host entry with a HostName in {config}")
    openssh = "ssh: Could not resolve hostname bastoin: Name or service not known\r\n"
    assert ssh_problem(t, 255, openssh) == f"host bastoin (bastoin:22): {said}"
    # the hop whose name it is, through two jump hosts too (the message comes through the inner one)
    outer = Target("bastoin", "bastoin", jump_of="n1")
    chain = Target("n1", "10.0.0.5", jump=Target("inner", "10.2.2.2", jump=outer, jump_of="n1"))
    assert ssh_problem(chain, 255, openssh + "kex_exchange_identification: Connection closed by remote host").startswith(
        "host n1: jump host bastoin (bastoin:22): the name bastoin does not resolve")
    # OpenSSH prints at most 100 characters of the name
    long = Target("n1", "a" * 120 + ".example")
    assert ssh_problem(long, 255, f"ssh: Could not resolve hostname {'a' * 100}: Name or service not known").startswith(
        f"host n1 ({long.host}:22): the name {long.host} does not resolve")
    # a Host entry without a HostName is a name too, never its own suggestion, in any case
    lone = resolve(node("gpu-node-7"), HostKeyPolicy(), _config_file(config, "Host GPU-node-7\n  User x\n"))
    assert "did you mean" not in unresolved(lone, "Name or service not known")
    # a resolver that could not answer is not a typo
    assert "did you mean" not in ssh_problem(t, 255, "ssh: Could not resolve hostname bastoin: "
                                                       "Temporary failure in name resolution")


def test_an_openssh_failure_names_the_hop_that_failed():
    jump = Target("bastion", "10.1.1.1", known_hosts=("/kh",), jump_of="n1")
    t = Target("n1", "10.0.0.5", known_hosts=("/kh",), jump=jump)
    changed = ("@@@ WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED! @@@\nHost key for 10.1.1.1 has changed and you "
               "have requested strict checking.\nHost key verification failed.\n"
               "kex_exchange_identification: Connection closed by remote host")
    assert ssh_problem(t, 255, changed).startswith("host n1: jump host bastion (10.1.1.1:22): host key CHANGED")
    direct = "Host key for 10.0.0.5 has changed and you have requested strict checking."
    assert ssh_problem(t, 255, direct).startswith("host n1 (10.0.0.5:22): host key CHANGED")


@pytest.mark.parametrize("config_text, args", [
    ("Host n1\n  HostName -oProxyCommand=touch\n", ""),
    ("", "-J '-oProxyCommand=touch /tmp/x'"),
    ("", "-o 'HostName=a b'"),
    ("Host n1\n  ProxyJump bastion\nHost bastion\n  HostName -oProxyCommand=x\n", ""),
])
def test_a_host_name_or_jump_host_that_is_no_address_is_refused(tmp_path, config_text, args):
    """It would become an ssh argument (``ssh ... -oProxyCommand=...`` runs the command)."""
    refused(tmp_path, r"host n1.*is neither an IP address nor a host name", config_text, args=args)


def test_the_destination_comes_after_the_end_of_options():
    t = Target("n1", "10.0.0.5")
    assert ssh_argv(t, "true")[-3:] == ["--", "10.0.0.5", "true"]
    assert scp_argv(t, "f")[-3:] == ["--", "f", "10.0.0.5:"]
    with pytest.raises(TargetError, match="host n1"):
        Target("n1", "-oProxyCommand=x")


@pytest.mark.parametrize("args, config_text, policy, source", [
    ("-o StrictHostKeyChecking=accept-new -o UserKnownHostsFile=/dev/null", "", HostKeyPolicy(),
     "ansible_ssh"),
    ("-o UserKnownHostsFile=/dev/null", "", HostKeyPolicy(accept_new=True), "ansible_ssh"),
    ("-J bastion", "Host bastion\n  UserKnownHostsFile /dev/null\n", HostKeyPolicy(accept_new=True), "ssh_config"),
    ("", "", HostKeyPolicy(known_hosts="/dev/null", accept_new=True), "--known-hosts"),
    ("-o UserKnownHostsFile=/tmp", "", HostKeyPolicy(), "ansible_ssh"),
])
def test_a_known_hosts_file_that_records_nothing_is_refused(tmp_path, args, config_text, policy, source):
    """/dev/null plus accept-new would accept any key: no host-key check at all."""
    refused(tmp_path, r"host n1.*UserKnownHostsFile .* \(from [^)]*" + re.escape(source), config_text, policy,
            args=args)


def _ssh_g(argv: list[str]) -> dict[str, list[str]]:
    """OpenSSH's own reading of an ssh argv (``ssh -G``: local, no connection)."""
    out = subprocess.run(["ssh", "-G", *argv], capture_output=True, text=True, check=True).stdout
    seen: dict[str, list[str]] = {}
    for line in out.splitlines():
        key, _, value = line.partition(" ")
        seen.setdefault(key, []).append(value)
    return seen


def test_a_repeated_option_keeps_its_first_value_as_openssh_does(tmp_path):
    args = "-o UserKnownHostsFile=/etc/kh -o UserKnownHostsFile=/dev/null -p 2200 -o Port=2300 -i /k/a -i /k/b"
    opts = parse_ssh_args(args)
    assert opts["userknownhostsfile"] == "/etc/kh" and opts["port"] == "2200"
    assert opts["identityfile"] == ["/k/a", "/k/b"]
    seen = _ssh_g(["-F", "/dev/null", *shlex.split(args), "h"])
    assert seen["userknownhostsfile"] == ["/etc/kh"] and seen["port"] == ["2200"]
    cfg = tmp_path / "cfg"
    cfg.write_text("Host n1\n  IdentityFile /k/c\n")
    t = resolve(node(args=args, key_file="/k/inv"), HostKeyPolicy(), str(cfg))
    # every key is offered, in OpenSSH's order (Ansible's own -o IdentityFile comes first)
    assert t.identity_files == ("/k/inv", "/k/a", "/k/b", "/k/c")
    assert [w for w in ssh_argv(t) if w.startswith("/k/")] == list(t.identity_files)


@pytest.mark.parametrize("args, config_text, found", [
    ("-p 70000", "", "must be 1-65535"),
    ("-J h:99999", "", "must be 1-65535"),
    ("", "Host *\n  Port 2_2\n", "is not a whole number"),
    ("-p 0", "", "must be 1-65535"),
    ("-o ConnectTimeout=0", "", "must be at least 1"),
    ("-o ConnectTimeout=1e3", "", "is not a whole number"),
])
def test_a_port_or_timeout_out_of_range_is_refused(tmp_path, args, config_text, found):
    refused(tmp_path, rf"host n1.*{found}", config_text, args=args)


@pytest.mark.parametrize("config_text, name, loop", [
    ("Host a\n  ProxyJump b\nHost b\n  ProxyJump a\n", "a", "a -> b -> a"),
    ("Host 10.0.0.5\n  ProxyJump 10.0.0.5\n", "10.0.0.5", "10.0.0.5 -> 10.0.0.5"),
    ("Host a\n  ProxyJump b\nHost b\n  ProxyJump c\nHost c\n  ProxyJump b\n", "a", "a -> b -> c -> b"),
])
def test_a_proxyjump_loop_is_an_error_naming_it(tmp_path, config_text, name, loop):
    refused(tmp_path, rf"host {re.escape(name)}: .*ProxyJump loop {re.escape(loop)}", config_text, name=name)


def test_an_ipv6_host_is_bare_for_ssh_and_bracketed_only_in_host_path():
    jump = Target("j", "fd00::9", port=2222, jump_of="n1")
    t = Target("n1", "fd00::5", port=2200, jump=jump)
    argv = ssh_argv(t, "true")
    assert argv[-2:] == ["fd00::5", "true"]
    seen = _ssh_g(argv[1:-1])  # OpenSSH's own reading: the address, not a name "[fd00::5]"
    assert seen["hostname"] == ["fd00::5"] and seen["port"] == ["2200"]
    inner = shlex.split(next(a for a in argv if a.startswith("ProxyCommand="))[len("ProxyCommand="):])
    assert inner[-1] == "fd00::9" or inner[inner.index("-W") - 1] == "fd00::9"
    assert scp_argv(t, "f")[-1] == "[fd00::5]:" and host_path(t, "/w") == "[fd00::5]:/w"


def test_several_known_hosts_files_are_quoted_one_by_one(tmp_path):
    cfg = tmp_path / "cfg"
    cfg.write_text('Host *\n  UserKnownHostsFile "/x/my kh" /x/kh2\n  GlobalKnownHostsFile /g/a "/g/b c"\n')
    t = resolve(node(), HostKeyPolicy(), str(cfg))
    assert t.known_hosts == ("/x/my kh", "/x/kh2") and t.global_known_hosts == ("/g/a", "/g/b c")
    opts = openssh_options(t)
    assert 'UserKnownHostsFile="/x/my kh" /x/kh2' in opts and 'GlobalKnownHostsFile=/g/a "/g/b c"' in opts
    odd = Target("n1", "10.0.0.5", known_hosts=('/x/a"b', "/x/c\\d"))
    # OpenSSH's own reading keeps the quote and the backslash in the names
    assert _ssh_g([*openssh_options(odd), "h"])["userknownhostsfile"] == ['/x/a"b /x/c\\d']


def _fabric_proxy_output(t: Target) -> None:
    """Run *t*'s ProxyCommand the way the runner does (paramiko, from the Fabric gateway)."""
    import paramiko

    from ddpfab.remote.sshopen import _connection

    proc = paramiko.ProxyCommand(_connection("n1", t).gateway).process
    proc.wait(10)


@pytest.mark.parametrize("where", ["inventory", "ssh_config"])
def test_a_proxycommand_runs_the_same_in_fabric_and_openssh(tmp_path, monkeypatch, where):
    """Tokens from the final port and user (the ssh_config's %p is not 22 when ansible_port says
    2222), shell syntax honoured by the runner too: OpenSSH runs ``$SHELL -c 'exec CMD'``."""
    out = tmp_path / "out"
    # "$T_OUT" is the shell's (paramiko alone would pass it on as it is); the inner sh holds
    # ssh's pipe until the line is written (ssh ends its ProxyCommand when the pipe closes)
    monkeypatch.setenv("T_OUT", str(out))
    monkeypatch.chdir(tmp_path)
    command = "sh -c 'echo %h %n %p %r 100%% >> \"$0\"' \"$T_OUT\""
    cfg = tmp_path / "cfg"
    cfg.write_text(f"Host *\n  ProxyCommand {command}\n" if where == "ssh_config" else "")
    args = f"-o {shlex.quote('ProxyCommand=' + command)}" if where == "inventory" else ""
    t = resolve(node(host="10.0.0.5", args=args, port=2222, user="alice"), HostKeyPolicy(), str(cfg))
    assert t.proxy_command == "sh -c 'echo 10.0.0.5 10.0.0.5 2222 alice 100% >> \"$0\"' \"$T_OUT\""
    _fabric_proxy_output(t)
    subprocess.run(ssh_argv(t, "true"), capture_output=True, timeout=30, stdin=subprocess.DEVNULL)
    assert out.read_text().splitlines() == ["10.0.0.5 10.0.0.5 2222 alice 100%"] * 2


def test_a_proxycommand_token_openssh_does_not_take_is_refused():
    with pytest.raises(TargetError, match=r"host n1: ProxyCommand .* has %C"):
        resolve(node(args="-o 'ProxyCommand=nc %C'"), HostKeyPolicy(), os.devnull)


@pytest.mark.parametrize("main, part, host", [
    ("Include {part}\nPort 2200\n", "Host other\n  User bob\n", "n1"),    # top level again after the file
    ("Host n1\n  Include {part}\nHost *\n  Port 2300\n", "Port 2201\nUser bob\n", "n1"),  # options of the block
    ("Host n1\n  Include {part}\nHost *\n  Port 2300\n", "Port 2201\nUser bob\n", "n2"),
    ("Include={part}\n", "Host n1\n  Port 2202\n", "n1"),
])
def test_include_means_what_it_means_to_openssh(tmp_path, main, part, host):
    (tmp_path / "part").write_text(part)
    cfg = tmp_path / "cfg"
    cfg.write_text(main.format(part=tmp_path / "part"))
    t = resolve(node(host), HostKeyPolicy(), str(cfg))
    seen = _ssh_g(["-F", str(cfg), host])
    assert (str(t.port), t.user or "root") == (seen["port"][0], seen["user"][0])


def test_an_include_of_host_blocks_inside_a_host_block_is_refused(tmp_path):
    """OpenSSH applies the file's blocks only within the outer block; flat text cannot say that."""
    (tmp_path / "part").write_text("Host *\n  User bob\n")
    refused(tmp_path, r"host n1: .*Include .* under 'Host special' .*Host/Match blocks",
            f"Host special\n  Include {tmp_path / 'part'}\n  Port 2200\n")


def test_proxycommand_none_in_the_inventory_cancels_the_ssh_configs_proxyjump(tmp_path):
    """ProxyJump and ProxyCommand are one setting to OpenSSH: the first given wins, even 'none'."""
    cfg = tmp_path / "cfg"
    cfg.write_text("Host n1\n  ProxyJump 10.9.9.9\nHost *\n  ProxyCommand nc %h %p\n")
    t = resolve(node(args="-o ProxyCommand=none"), HostKeyPolicy(), str(cfg))
    assert (t.jump, t.proxy_command) == (None, None)
    seen = _ssh_g(["-F", str(cfg), "-o", "ProxyCommand=none", "n1"])
    assert "proxyjump" not in seen and "proxycommand" not in seen
    # in the file alone, the first block's wins over a later block's other one
    t = resolve(node(), HostKeyPolicy(), str(cfg))
    assert (t.jump.host, t.proxy_command) == ("10.9.9.9", None)
    assert _ssh_g(["-F", str(cfg), "n1"])["proxyjump"][0].strip("[]") == "10.9.9.9"


def test_keepalive_keeps_the_users_own_interval():
    t = resolve(node(args="-o ServerAliveInterval=60"), HostKeyPolicy(), os.devnull)
    assert _ssh_g([*openssh_options(t, keepalive=True), "h"])["serveraliveinterval"] == ["60"]
    assert _ssh_g([*openssh_options(t, keepalive=True), "h"])["serveralivecountmax"] == ["6"]


def test_the_runner_reads_the_global_known_hosts_file_too(tmp_path):
    from ddpfab.remote.sshopen import _connection

    glob_kh = tmp_path / "global"
    glob_kh.write_text("10.0.0.5 ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl\n")
    t = Target("n1", "10.0.0.5", known_hosts=(str(tmp_path / "user"),), global_known_hosts=(str(glob_kh),))
    client = _connection("n1", t).client
    assert client.get_host_keys().lookup("10.0.0.5") is None  # not where new keys are written
    assert client._system_host_keys.lookup("10.0.0.5") is not None


@pytest.mark.parametrize("args", ["-o ForwardAgent=yes", "-o PreferredAuthentications=password",
                                  "-o ForwardX11=yes"])
def test_an_own_option_whose_value_ddpfab_would_override_is_refused(args):
    with pytest.raises(TargetError, match=r"host n1: ssh option .* cannot be honoured"):
        resolve(node(args=args), HostKeyPolicy(), os.devnull)
    # the values ddpfab uses anyway are fine
    resolve(node(args="-o ForwardAgent=no -o PreferredAuthentications=publickey,password -o ControlMaster=auto"),
            HostKeyPolicy(), os.devnull)


def test_accept_new_with_a_known_hosts_file_it_cannot_write_is_refused(tmp_path):
    """OpenSSH only warns when it cannot record the new key, and accepts any key again next time."""
    kh = tmp_path / "known_hosts"
    kh.write_text("")
    # root may write any file its mode forbids, but not an immutable one
    lock, unlock = (["chattr", "+i", str(kh)], ["chattr", "-i", str(kh)]) if os.geteuid() == 0 else (
        ["chmod", "444", str(kh)], ["chmod", "644", str(kh)])
    subprocess.run(lock, check=True)
    try:
        refused(tmp_path, r"host n1: accept-new needs to record new host keys in .*not writable",
                policy=HostKeyPolicy(known_hosts=str(kh), accept_new=True))
        assert resolve(node(), HostKeyPolicy(known_hosts=str(kh)), os.devnull).known_hosts == (str(kh),)
    finally:
        subprocess.run(unlock, check=True)


def test_an_openssh_failure_names_an_ipv6_hop():
    jump = Target("bastion", "fd00::9", port=2222, known_hosts=("/kh",), jump_of="n1")
    t = Target("n1", "fd00::5", known_hosts=("/kh",), jump=jump)
    changed = "Host key for [fd00::9]:2222 has changed and you have requested strict checking."
    assert ssh_problem(t, 255, changed).startswith("host n1: jump host bastion ([fd00::9]:2222): host key CHANGED")
    unknown = "No ED25519 host key is known for fd00::5 and you have requested strict checking."
    assert ssh_problem(t, 255, unknown).startswith("host n1 ([fd00::5]:22): host key not in")


def test_the_ssh_config_file_connects_exactly_as_the_options(tmp_path):
    key = tmp_path / "my key"  # (ssh -i skips a file that does not exist)
    key.write_text("")
    jump = Target("bastion", "10.1.1.1", port=2222, user="hop", known_hosts=("/kh",), jump_of="n1")
    nodes = {
        "node1": Target("node1", "10.0.0.5", port=2201, user="alice", identity_files=(str(key),),
                        identities_only=True, known_hosts=("/a/my kh", "/a/kh2"), accept_new=True,
                        tuning=(("ServerAliveInterval", "7"),)),
        "node2": Target("node2", "10.0.0.6", known_hosts=("/kh",), jump=jump),
        "odd name": Target("odd name", "10.0.0.7"),  # not a plain word: no block, its long line is used
        "node3": Target("node3", "fe80::1%eth0"),  # a scoped IPv6 address: its % is no ssh token
    }
    config = tmp_path / "ssh_config"
    config.write_text(ssh_config_text(nodes))
    for name in ("node1", "node2", "node3"):
        t = nodes[name]
        by_file, by_options = _ssh_g(["-F", str(config), name]), _ssh_g([*openssh_options(t), t.host])
        assert by_file.pop("host") == [name] and by_options.pop("host") == [t.host]
        assert by_file == by_options, name  # every setting OpenSSH would use
    assert "odd name" not in config.read_text() and config_alias("odd name") is None
    assert config_alias("node-1.lab") == "node-1.lab" and config_alias("n*") is None


def test_only_a_failure_to_read_a_key_file_is_said_as_the_key_file():
    """paramiko's ProxyCommand raises FileNotFoundError(filename='nc') for a missing program: that
    is not the key file (a review found it told to check ansible_ssh_private_key_file)."""
    from ddpfab.remote import sshopen

    missing = FileNotFoundError(2, "No such file or directory", "/home/u/.ssh/lab_key")
    assert sshopen._key_file(missing, ("/home/u/.ssh/lab_key",))
    assert sshopen._key_file(missing, "/home/u/.ssh/lab_key")  # paramiko's key_filename may be one path
    assert not sshopen._key_file(FileNotFoundError(2, "No such file or directory", "nc"), ("/home/u/.ssh/lab_key",))
    assert not sshopen._key_file(EOFError(), ("/home/u/.ssh/lab_key",))
