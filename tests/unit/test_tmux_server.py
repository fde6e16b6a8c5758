"""Which tmux server a ``--tmux`` run's session is on, and how a terminal elsewhere reaches it."""

from __future__ import annotations

import os

from ddpfab.launch import tmuxrun


def test_the_server_is_the_one_this_terminal_is_in_else_the_default():
    assert tmuxrun.server_socket({"TMUX": "/tmp/tmux-0/np42,123,0"}) == "/tmp/tmux-0/np42"  # tmux -L np42
    uid = os.getuid()
    assert tmuxrun.server_socket({"TMUX_TMPDIR": "/run/t"}) == f"/run/t/tmux-{uid}/default"
    assert tmuxrun.server_socket({}) == f"/tmp/tmux-{uid}/default"
    assert tmuxrun.server_socket({"TMUX": "", "TMUX_TMPDIR": ""}) == f"/tmp/tmux-{uid}/default"


def test_the_attach_line_names_the_socket_only_when_it_is_another_server(monkeypatch):
    monkeypatch.delenv("TMUX", raising=False)
    monkeypatch.delenv("TMUX_TMPDIR", raising=False)
    assert tmuxrun.attach_line("ddpfab-r1", None) == "tmux attach -t ddpfab-r1"
    assert tmuxrun.attach_line("ddpfab-r1", tmuxrun.server_socket()) == "tmux attach -t ddpfab-r1"
    assert tmuxrun.attach_line("ddpfab-r1", "/tmp/tmux-0/np 42") == "tmux -S '/tmp/tmux-0/np 42' attach -t ddpfab-r1"
