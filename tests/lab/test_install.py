"""ddpfab as a new user gets it: a wheel installed in a fresh venv outside the checkout, the
ddpfab.cluster collection installed with ansible-galaxy (no Galaxy server), each used on lab hosts.

- The wheel (and the sdist) carry the Ansible content. What a user does with that venv, from a
  directory that is not the checkout (`ddpfab lab up`, `provision` with the wheel's collection,
  a run in the venv provision made), is tests/lab/test_first_hour.py, on the same venv.
- `ansible-galaxy collection build` + `install -p` into a temp path, then a user's playbook using
  the roles by FQCN, twice: the second run reports changed=0.

The controller venv (the session's `dist` fixture, tests/lab/conftest.py, shared with
test_first_hour) gets ddpfab's dependencies from pip's configured index (no torch: the
controller does not need it); the nodes' torch comes from the local wheel mirror, as in
tests/lab/test_provision.py. Each test brings up a lab of its own, under the test subnet's /16.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

from ddpfab import lab as labmod
from ddpfab.remote import provision

from .conftest import session_subnet

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
#: what an installed ddpfab must carry besides its modules
PACKAGE_DATA = ["ddpfab/py.typed", "ddpfab/ansible/ansible.cfg", "ddpfab/ansible/provision.yml",
                "ddpfab/ansible/firewall.yml", "ddpfab/ansible/inventory/example.yml",
                "ddpfab/ansible/examples/site.yml",
                "ddpfab/ansible/collections/ansible_collections/ddpfab/cluster/galaxy.yml",
                "ddpfab/ansible/collections/ansible_collections/ddpfab/cluster/changelogs/changelog.yaml",
                "ddpfab/ansible/collections/ansible_collections/ddpfab/cluster/playbooks/provision.yml",
                "ddpfab/ansible/collections/ansible_collections/ddpfab/cluster/roles/ddpfab_python/tasks/main.yml",
                "ddpfab/ansible/collections/ansible_collections/ddpfab/cluster/plugins/filter/ddpfab_firewall.py"]



def sh(argv: list, *, cwd: Path, env: dict | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    res = subprocess.run([str(a) for a in argv], cwd=cwd, env={**os.environ, "NO_COLOR": "1", **(env or {})},
                         capture_output=True, text=True, timeout=timeout)
    print(f"$ {' '.join(map(str, argv))}  (exit {res.returncode})\n{(res.stdout + res.stderr)[-4000:]}")
    return res


def test_wheel_and_sdist_carry_the_ansible_content_and_the_licence(dist):
    wheel = set(zipfile.ZipFile(dist["wheel"]).namelist())
    assert set(PACKAGE_DATA) <= wheel, sorted(set(PACKAGE_DATA) - wheel)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in wheel)
    with tarfile.open(dist["sdist"]) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    assert set(PACKAGE_DATA) <= names and "LICENSE" in names, sorted(set(PACKAGE_DATA) - names)
    meta = zipfile.ZipFile(dist["wheel"]).read(next(n for n in wheel if n.endswith("METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in meta and "Classifier: Typing :: Typed" in meta
    assert {ln.split(":", 1)[1].split(",")[0].strip() for ln in meta.splitlines() if ln.startswith("Project-URL:")} == {
        "Homepage", "Documentation", "Issues", "Source"}, meta[:2000]


def test_collection_builds_installs_offline_and_a_user_playbook_uses_it_by_fqcn(tmp_path):
    built = tmp_path / "built"
    res = sh([BIN / "ansible-galaxy", "collection", "build", provision.collection_dir(), "--output-path", built],
             cwd=tmp_path)
    assert res.returncode == 0
    tarball = next(built.glob("ddpfab-cluster-*.tar.gz"))
    colls = tmp_path / "collections"
    res = sh([BIN / "ansible-galaxy", "collection", "install", "--offline", "-p", colls, tarball], cwd=tmp_path)
    assert res.returncode == 0
    installed = colls / "ansible_collections" / "ddpfab" / "cluster"
    assert (installed / "roles" / "ddpfab_base" / "tasks" / "main.yml").is_file()
    assert (installed / "MANIFEST.json").is_file()
    user = tmp_path / "user"  # the user's own playbook dir: no ansible.cfg, no adjacent collections
    user.mkdir()
    shutil.copy(provision.ansible_dir() / "examples" / "site.yml", user / "site.yml")
    lab_dir = tmp_path / "lab"
    the_lab, _ = labmod.up(lab_dir, hosts=1, subnet=session_subnet(62))
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
        env.update({"ANSIBLE_COLLECTIONS_PATH": str(colls), "ANSIBLE_NOCOLOR": "1", "HOME": str(tmp_path),
                    "ANSIBLE_SSH_CONTROL_PATH_DIR": str(tmp_path / "cp"), "PATH": f"{BIN}{os.pathsep}{env['PATH']}"})
        counts = []
        for _ in range(2):
            res = subprocess.run([str(BIN / "ansible-playbook"), "-i", str(the_lab.inventory), "site.yml"], cwd=user,
                                 env=env, capture_output=True, text=True, timeout=600)
            print(res.stdout[-4000:] + res.stderr[-2000:])
            assert res.returncode == 0
            assert "ddpfab.cluster.ddpfab_base : " in res.stdout  # the role ran, named by its FQCN
            counts.append({h.host: h.counts for h in provision.parse_recap(res.stdout)})
        assert counts[0]["node1"]["failed"] == 0 and counts[0]["node1"]["changed"] > 0
        assert counts[1]["node1"]["changed"] == 0 and counts[1]["node1"]["failed"] == 0, counts[1]
    finally:
        labmod.down(lab_dir)
