"""Each lab test file's own lab has a /24 of its own: two files that took the same third octet
collide when the two pytest workers run them at once (the second lab's bring-up fails: every
test of that file errors)."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

LAB_TESTS = Path(__file__).resolve().parents[1] / "lab"


def test_no_two_lab_test_files_take_the_same_extra_subnet():
    users: dict[int, set[str]] = defaultdict(set)
    for path in sorted(LAB_TESTS.glob("*.py")):
        for octet in re.findall(r"extra_subnet\((\d+)\)", path.read_text()):
            users[int(octet)].add(path.name)
    assert users, "no extra_subnet(N) found: the scan is looking in the wrong place"
    shared = {octet: sorted(files) for octet, files in users.items() if len(files) > 1}
    assert not shared, f"third octets used by more than one lab test file: {shared}"


def test_the_dir_a_lab_is_brought_up_from_is_live_unless_the_hosts_own_setup_lives_there():
    from pathlib import Path

    from ddpfab.lab import live_dir

    # a project under an overlaid dir or a /tmp share: bound as it is (edits by rename show at once)
    for project in ("/root/proj", "/home/alice/code/proj", "/opt/x/y", "/tmp/ci/checkout"):
        assert live_dir(Path(project)) == project
    # the hosts see these as they are already (no overlay)
    assert live_dir(Path("/work/main")) is None and live_dir(Path("/srv/data/p")) is None
    # where the hosts' own setup writes or mounts: an overlaid dir itself, /, a home's dotfiles' dir
    for kept in ("/", "/root", "/tmp", "/etc", "/home", "/usr/local", "/root/.cache"):
        assert live_dir(Path(kept)) is None, kept
