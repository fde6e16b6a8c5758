"""The package's layout shows its architecture: a library with no import cycle, and a
command-line layer (``ddpfab/cli/``) that the library never imports.

The graph is read from the source with :mod:`ast`, so an import inside a function counts as
much as one at the top: a cycle hidden in a function body is still a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "ddpfab"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py") if "ansible" not in p.relative_to(PACKAGE).parts}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The ddpfab modules *name* imports, anywhere in the file (module level and in functions)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from . import x` imports the module x when there is one, else a name of the package
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "__import__"
              and node.args and isinstance(node.args[0], ast.Constant)):
            targets = [node.args[0].value]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import ddpfab.cli.run` names ddpfab.cli.run
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {name: _imports(name, path, known) for name, path in mods.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of *graph* as a path (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_cycle_finder_finds_a_cycle_and_accepts_a_tree():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_graph_sees_imports_inside_functions(tmp_path):
    (tmp_path / "m.py").write_text("def f():\n    from . import n\n    import ddpfab.o\n")
    assert _imports("ddpfab.m", tmp_path / "m.py", {"ddpfab", "ddpfab.m", "ddpfab.n", "ddpfab.o"}) == {
        "ddpfab.n", "ddpfab.o"}


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert "ddpfab.planning.plan" in graph and graph["ddpfab.__main__"], "the graph missed the package"
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_library_does_not_import_argparse_or_the_cli():
    """Only ddpfab.cli.* (and the ``python -m ddpfab`` entry) parse command lines and print for them."""
    graph = import_graph()
    offenders = []
    for name, path in _modules().items():
        if name in ("ddpfab.__main__", "ddpfab.cli") or name.startswith("ddpfab.cli."):
            continue
        offenders += [f"{name} imports {m}" for m in sorted(graph[name]) if m == "ddpfab.cli" or m.startswith("ddpfab.cli.")]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import) and any(a.name == "argparse" for a in node.names) or (
                    isinstance(node, ast.ImportFrom) and node.module == "argparse" and not node.level):
                offenders.append(f"{name} imports argparse")
    assert offenders == []


def test_stream_lines_splits_across_chunks_and_keeps_the_last_partial_line():
    from ddpfab.remote.streams import lines

    chunks = iter([b"a\r\nb", b"c\n\xff\n", b"", b"never read"])
    seen: list[bytes] = []
    assert list(lines(lambda n: next(chunks), on_chunk=seen.append)) == ["a", "bc", "\ufffd"]
    assert seen == [b"a\r\nb", b"c\n\xff\n"]
    tail = iter([b"x\ny", b""])
    assert list(lines(lambda n: next(tail))) == ["x", "y"]


def test_a_problem_travels_as_data_and_prints_as_its_sentence():
    from ddpfab.problems import Problem

    p = Problem("node1", "master_port", expected="port 29500 free", found="in use", fix="pick another port",
                text="host node1: --master-port 29500 is already in use there; pick another port")
    assert Problem.from_dict(p.to_dict()) == p
    assert str(p) == p.text and p.to_dict()["text"] == p.text
    built = Problem("node2", "workdir", expected="/w exists", found="missing", fix="create it")
    assert str(built) == "host node2: workdir: expected /w exists, found missing; create it"
    assert Problem.from_dict(built.to_dict()).node == "node2"
    import pytest

    with pytest.raises(ValueError):
        Problem.from_dict({"node": 3, "check": "x"})


#: The top level holds only the entry points and what every layer shares (problems, results, the
#: masking rule, options' names, folded host lists); everything else lives in the subpackage that owns its capability.
TOP_LEVEL = {"ddpfab", "ddpfab.__main__", "ddpfab.api", "ddpfab.dist", "ddpfab.hostlist", "ddpfab.masking",
             "ddpfab.optionnames", "ddpfab.problems", "ddpfab.results", "ddpfab.version"}


def test_modules_live_in_the_subpackage_of_their_capability_and_each_says_what_it_owns():
    mods = _modules()
    loose = sorted(name for name in mods if name.count(".") == 1 and name not in TOP_LEVEL
                   and not (PACKAGE / name.split(".")[1]).is_dir())
    assert loose == [], f"modules beside the core: {loose}; move each into the subpackage that owns it"
    for pkg in sorted(p for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()):
        doc = ast.get_docstring(ast.parse((pkg / "__init__.py").read_text(encoding="utf-8")))
        assert doc and len(doc.split()) >= 8, f"ddpfab/{pkg.name}/__init__.py: say what the subpackage owns"
