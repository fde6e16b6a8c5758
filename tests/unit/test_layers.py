"""The packages' layers, as import-linter's "layers" contract: a package imports only packages
below it (or itself), at module level or inside a function alike; every package has its place.

    base modules (version, problems, results, masking, optionnames, hostlist, dist)
    < node (the program the nodes run: standard library only)
    < hosts (what the nodes are) < remote (reaching them) < lab (namespace hosts)
    < planning (every decision, pure) < health (facts, checks, the doctor)
    < transfer (sync, fetch) < launch (running a plan) < api < cli < the entry points

A test of the checker itself shows it failing on a deliberately wrong import."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "ddpfab"

#: Bottom first. A name is a subpackage, a top-level module, or ``__init__``/``__main__``.
LAYERS = ("version", "problems", "results", "masking", "optionnames", "hostlist", "dist", "node", "hosts", "remote", "lab",
          "planning", "health", "transfer", "launch", "api", "cli", "__main__", "__init__")


def _unit(module: str) -> str:
    """The layer unit of a dotted ddpfab module name: its subpackage or top-level module."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imported_modules(path: Path, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, dotted name) for every ddpfab import in *path*, wherever it is in the file
    (``from ddpfab.x import y``: ``ddpfab.x.y``, a module or a name in ``ddpfab.x``)."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return [(line, name) for line, name in found if name == "ddpfab" or name.startswith("ddpfab.")]


def layer_violations(root: Path, layers: tuple[str, ...] = LAYERS) -> list[str]:
    """Every import in the package at *root* (named ``ddpfab``) of a unit above its own, and every
    unit that has no layer, as ``path:line: a imports b``."""
    rank = {unit: i for i, unit in enumerate(layers)}
    units = {p.stem if p.is_file() else p.name for p in root.iterdir()
             if (p.suffix == ".py" or (p / "__init__.py").is_file())}
    out = [f"{root.name}/{u}: not in the layers" for u in sorted(units - set(rank))]
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if "ansible" in rel.parts:  # the Ansible collection's plugins run inside Ansible
            continue
        dotted = ".".join((root.name, *rel.with_suffix("").parts))
        is_package = path.name == "__init__.py"
        module = dotted.removesuffix(".__init__") if is_package else dotted
        own = "__init__" if module == root.name else _unit(module)
        for line, name in imported_modules(path, module, is_package):
            target = _unit(name)
            if name.count(".") == 1 and target not in units:
                target = "__init__"  # ``from ddpfab import name``: a name of the package's __init__
            if rank.get(target, -1) > rank.get(own, len(layers)):
                out.append(f"{root.name}/{rel}:{line}: {own} imports {target} (a layer above it)")
    return sorted(set(out))


def test_every_import_goes_down_the_layers():
    assert layer_violations(PACKAGE) == []


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "ddpfab"
    for rel, text in {"__init__.py": "", "node/__init__.py": "", "remote/__init__.py": "",
                      "cli/__init__.py": "", **files}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_the_checker_fails_on_a_lower_package_importing_a_higher_one(tmp_path):
    layers = ("node", "remote", "cli", "__init__")
    root = _tree(tmp_path, {
        "remote/ssh.py": "from ddpfab.node import agent\n",  # down: fine
        "node/agent.py": "import os\n\ndef f():\n    from ddpfab.remote import ssh  # up, inside a function\n",
        "node/ops.py": "from ..cli import main\n",  # up, relative
        "cli/main.py": "import ddpfab.remote.ssh\nfrom ddpfab.node import agent as a\nfrom ddpfab import remote\n",
        "remote/runner.py": "from ddpfab import __version__\n",  # the package's __init__: the top
    })
    assert layer_violations(root, layers) == [
        "ddpfab/node/agent.py:4: node imports remote (a layer above it)",
        "ddpfab/node/ops.py:1: node imports cli (a layer above it)",
        "ddpfab/remote/runner.py:1: remote imports __init__ (a layer above it)",
    ]
    (root / "node" / "agent.py").write_text("import os\n")
    (root / "node" / "ops.py").write_text("from . import agent\n")
    (root / "remote" / "runner.py").write_text("from ddpfab.node.agent import main\n")
    assert layer_violations(root, layers) == []
    (root / "extra").mkdir()
    (root / "extra" / "__init__.py").write_text("")
    assert layer_violations(root, layers) == ["ddpfab/extra: not in the layers"]


def private_names_used_across_modules(root: Path) -> list[str]:
    """``from ddpfab.x import _name`` and ``module._name`` (a ddpfab module imported here) in any
    module of *root*: a leading underscore says "this module's own"; what others use is public."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        where = path.relative_to(root.parent).as_posix()
        modules = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("ddpfab")):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        found.append(f"{where}:{node.lineno}: imports {alias.name}")
                    modules.add(alias.asname or alias.name)
            elif isinstance(node, ast.Import):
                modules.update((a.asname or a.name).split(".")[0] for a in node.names if a.name.startswith("ddpfab"))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                found.append(f"{where}:{node.lineno}: uses {node.value.id}.{node.attr}")
    return found


def test_no_private_name_is_used_across_modules():
    assert private_names_used_across_modules(PACKAGE) == []


def test_the_private_name_check_finds_both_spellings(tmp_path):
    root = _tree(tmp_path, {
        "remote/ssh.py": "def _connect():\n    pass\n\ndef connect():\n    return _connect()\n",  # its own: fine
        "cli/main.py": "from ddpfab.remote.ssh import _connect, connect\nfrom ddpfab.remote import ssh\n"
                       "ssh._connect()\nssh.connect()\n",
        "node/agent.py": "from ..remote.ssh import _connect as c\n",
    })
    assert private_names_used_across_modules(root) == [
        "ddpfab/cli/main.py:1: imports _connect",
        "ddpfab/cli/main.py:3: uses ssh._connect",
        "ddpfab/node/agent.py:1: imports _connect",
    ]
