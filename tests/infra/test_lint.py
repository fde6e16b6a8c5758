"""ansible-lint (production profile) and yamllint over playbooks/ and roles/, so CI enforces both;
and the ddpfab.cluster collection as users get it: built with ansible-galaxy, installed offline,
clean under the production profile, with the metadata Galaxy's checks read (changelog, tags,
meta/runtime.yml).

Configuration: .ansible-lint and .yamllint at the repo root. Missing tools are a failure, not a
skip: they are in the `test` extra (pip install -e '.[test]'). Galaxy is never contacted: every
ansible-lint runs --offline, and ansible-galaxy installs the built tarball --offline.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
COLLECTION = REPO / "ddpfab" / "ansible" / "collections" / "ansible_collections" / "ddpfab" / "cluster"
#: Galaxy's categories, one of which a collection's tags must name (ansible-lint's galaxy[tags])
GALAXY_CATEGORIES = {"application", "cloud", "database", "eda", "infrastructure", "linux", "monitoring",
                     "networking", "security", "storage", "tools", "windows"}


def _tool(name: str) -> str:
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.is_file() else shutil.which(name)
    if not found:
        pytest.fail(f"{name} is not installed: pip install -e '.[test]'")
    return found


def _run(argv: list, cwd: Path = REPO, **env_extra: str) -> subprocess.CompletedProcess:
    # no ANSIBLE_* of this process: ddpfab.hosts.inventory makes Ansible's inventory parsing strict through
    # them when another test loaded an inventory in this worker, and a syntax check has none to parse
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env = {**clean, "NO_COLOR": "1", "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}", **env_extra}
    return subprocess.run([str(a) for a in argv], cwd=cwd, env=env, check=False, capture_output=True, text=True,
                          timeout=300)


def test_yamllint_passes_on_playbooks_and_roles():
    proc = _run([_tool("yamllint"), "--strict", "playbooks", "roles", ".yamllint", ".ansible-lint",
                 COLLECTION / "galaxy.yml", COLLECTION / "meta", COLLECTION / "changelogs"])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ansible_lint_production_profile_passes():
    proc = _run([_tool("ansible-lint"), "--profile", "production", "--offline", "playbooks", "roles"])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "Profile 'production' was required, and it passed" in out, out


def _users_ansible(home: Path) -> dict[str, str]:
    """Ansible settings of a user's machine: no ansible.cfg of ours (an empty one), a HOME of its own,
    and never a Galaxy server, whatever this machine's config says (an unroutable local one)."""
    cfg = home / "empty-ansible.cfg"
    cfg.touch()
    return {"ANSIBLE_CONFIG": str(cfg), "HOME": str(home), "ANSIBLE_GALAXY_SERVER": "http://127.0.0.1:9"}


@pytest.fixture(scope="module")
def built_collection(tmp_path_factory) -> tuple[Path, Path]:
    """(the tarball ansible-galaxy builds from the package's collection, the tree it installs offline)."""
    tmp = tmp_path_factory.mktemp("collection")
    galaxy = _tool("ansible-galaxy")
    proc = _run([galaxy, "collection", "build", COLLECTION, "--output-path", tmp / "built"], cwd=tmp)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tarball = next((tmp / "built").glob("ddpfab-cluster-*.tar.gz"))
    # as a user installs it: not over the repo's ansible.cfg, whose collections_path already holds it
    proc = _run([galaxy, "collection", "install", "--offline", "-p", tmp / "installed", tarball], cwd=tmp,
                **_users_ansible(tmp))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return tarball, tmp / "installed"


def _lint_production(where: Path, collections: Path) -> str:
    """ansible-lint --profile production --offline in *where*, outside the repository (no config of ours),
    with *collections* on the collections path so the playbooks' FQCN roles resolve; its output."""
    proc = _run([_tool("ansible-lint"), "--profile", "production", "--offline"], cwd=where,
                **_users_ansible(where.parent), ANSIBLE_COLLECTIONS_PATH=str(collections))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "Profile 'production' was required, and it passed" in out, out
    return out


def test_built_collection_carries_changelog_tags_and_runtime(built_collection):
    _, installed = built_collection
    coll = installed / "ansible_collections" / "ddpfab" / "cluster"
    info = json.loads((coll / "MANIFEST.json").read_text())["collection_info"]
    galaxy = yaml.safe_load((COLLECTION / "galaxy.yml").read_text())
    assert info["version"] == galaxy["version"]
    assert GALAXY_CATEGORIES & set(info["tags"]), info["tags"]
    changelog = yaml.safe_load((coll / "changelogs" / "changelog.yaml").read_text())
    # the newest release in the changelog is the version built: a version bump needs its entry
    newest = max(changelog["releases"], key=lambda v: tuple(int(x) for x in v.split(".")))
    assert newest == galaxy["version"], (newest, galaxy["version"])
    assert changelog["releases"][newest]["changes"]["release_summary"].strip()
    assert str(changelog["releases"][newest]["release_date"])
    assert yaml.safe_load((coll / "meta" / "runtime.yml").read_text())["requires_ansible"]


def test_built_collection_passes_ansible_lint_production_offline(built_collection):
    _, installed = built_collection
    _lint_production(installed / "ansible_collections" / "ddpfab" / "cluster", installed)


def test_collection_source_passes_galaxy_metadata_checks_under_production(built_collection, tmp_path):
    # galaxy[...] (changelog, tags, runtime, version, repository, licence) read galaxy.yml, which the
    # built tarball turns into MANIFEST.json: lint the source as Galaxy's import does, in a copy outside
    # the repository so the repo's own .ansible-lint (which excludes ddpfab/) plays no part
    _, installed = built_collection
    src = tmp_path / "ansible_collections" / "ddpfab" / "cluster"
    shutil.copytree(COLLECTION, src, symlinks=True)
    out = _lint_production(src, installed)
    assert "galaxy" not in out.split("Rule Violation Summary")[-1], out
