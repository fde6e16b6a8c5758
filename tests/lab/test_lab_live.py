"""The lab's edit-run loop: the dir a lab is brought up from is live on its hosts.

Hosts see the controller's dirs through overlays, and an overlay keeps a file that its lower dir
replaced by rename (``sed -i``, most editors' save): every run then failed its tree check, and
the advice it gave (``--checksum``, ``--no-sync``) could not work or ran the old code.
"""

from __future__ import annotations

import subprocess

from ddpfab import lab as labmod

from .conftest import extra_subnet
from .helpers import ddpfab, host_sh

SCRIPT = 'import os\nprint("version A on rank", os.environ["RANK"])\n'


def test_an_edit_by_rename_reaches_the_hosts_and_a_stale_shared_view_is_named(tmp_path):
    work = tmp_path / "proj"
    work.mkdir()
    (work / "train.py").write_text(SCRIPT)
    lab_dir = work / "lab"
    up = ddpfab("lab", "up", "--hosts", "2", "--dir", str(lab_dir), "--subnet", extra_subnet(181), cwd=work)
    assert up.returncode == 0, up.stderr
    inv = str(lab_dir / "inventory.yml")
    try:
        assert labmod.Lab.load(lab_dir).live == str(work)
        first = ddpfab("run", "-i", inv, "train.py", cwd=work, timeout=180)
        assert first.returncode == 0, first.stderr
        assert "version A on rank 1" in first.stdout, first.stdout
        # the host has looked the file up: an overlay would keep this one after the rename
        subprocess.run(["sed", "-i", "s/version A/version B/", str(work / "train.py")], check=True)
        second = ddpfab("run", "-i", inv, "train.py", cwd=work, timeout=180)
        assert second.returncode == 0, second.stderr
        assert "version B on rank 0" in second.stdout and "version B on rank 1" in second.stdout, second.stdout
        assert "version A" not in second.stdout

        # a node that sees this very dir with other contents (NFS's cache, a --share dir's overlay):
        # here node2 alone sees another train.py, bound over it in its own mount namespace
        lab = labmod.Lab.load(lab_dir)
        other = host_sh(lab, "node2", f"mkdir -p /root/stale && echo 'print(\"old\")' > /root/stale/t.py && "
                                      f"mount --bind /root/stale/t.py {work}/train.py")
        assert other.returncode == 0, other.stderr
        stale = ddpfab("run", "-i", inv, "train.py", cwd=work, timeout=180)
        err = stale.stderr
        assert stale.returncode != 0 and "nothing was started" in err, err
        assert "host node2:" in err and "its view lags this machine's" in err and "host node1:" not in err, err
        # no advice that cannot work: nothing is copied to a shared dir, and skipping sync runs old code
        assert "--no-sync" not in err.replace("--no-sync would run the old code", ""), err
        assert "sync --checksum" not in err, err
    finally:
        ddpfab("lab", "down", "--dir", str(lab_dir), cwd=work)
    assert (work / "train.py").read_text() == SCRIPT.replace("version A", "version B")
