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
