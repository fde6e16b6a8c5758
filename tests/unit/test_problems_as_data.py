"""Problems are data: every ddpfab exception carries its problems (node, check, expected, found, fix),
and no decision reads the text of an exception, a problem or a message.

The text scan is an AST walk over ddpfab/: inside an ``except ... as exc`` handler, the exception's
text (``str(exc)``, ``repr(exc)``, ``f"{exc}"``, ``exc.args``, ``exc.message``, ``exc.strerror``...)
and anywhere, the text of a problem or a message (``.text``, ``str(problem)``, a variable named for a
message: ``problem``, ``msg``, ``why``, ``error``...) must not appear in a condition: an if/while/
ternary/assert test, a comparison or ``in``, a ``.startswith``/``.endswith`` call, or a regular
expression's match/search. Printing and formatting them is what they are for, and is allowed.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import pkgutil
from pathlib import Path

import pytest

import ddpfab
from ddpfab.remote import nodeprogram as nodeprog
from ddpfab.problems import DdpfabError, NodeError, Problem
from ddpfab.transfer.sync import SyncError

PACKAGE = Path(ddpfab.__file__).parent
#: Files shipped to nodes and run there without ddpfab installed: stdlib only, so they cannot
#: import ddpfab.problems. Their exceptions reach the controller as replies (the node program's
#: ``error``/``code``) and become problems there (ddpfab.node.as_problem, PlanError for a workdir).
#: Shipped stdlib-only to nodes (the node program's sources, the ranks' exit guard, the perf
#: check's files): they cannot import problems.py; their failures become problems on the controller.
SHIPPED = {f"node/{Path(m.__file__).name}" for m in nodeprog.SOURCES} | {"node/exitguard.py", "dist.py",
                                                                       "health/perfnode.py"}
#: Not problems but signals: SIGINT/SIGTERM as a KeyboardInterrupt, which ``except Exception``
#: must never catch (so it cannot also be an Exception); its data is its signal number.
SIGNALS = {"ddpfab.launch.interrupt.Interrupted"}
#: Names whose value is the text of a message or a problem.
MESSAGE_NAMES = {"message", "msg", "problem", "problems", "why", "reason", "error", "err", "errmsg", "detail"}
#: Attributes that hold such text.
MESSAGE_ATTRS = {"text", "message", "msg", "error", "problems", "why", "reason", "detail", "strerror", "args"}
#: String methods and regex methods that decide by text.
TEXT_TESTS = {"startswith", "endswith", "match", "fullmatch", "search", "findall", "finditer", "__contains__",
              "find", "index", "rfind", "count"}


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


class _TextDecisions(ast.NodeVisitor):
    """Finds conditions that read an exception's or a message's text (see the module doc)."""

    def __init__(self, rel: str):
        self.rel = rel
        self.exc_names: list[set[str]] = [set()]  # the names bound by the enclosing except handlers
        self.tainted: list[set[str]] = [set()]  # names assigned from such text in those handlers
        self.found: list[str] = []

    # -- what counts as text ------------------------------------------------------------------
    def _is_exc(self, node: ast.AST) -> bool:
        return isinstance(node, ast.Name) and node.id in self.exc_names[-1]

    def _is_text(self, node: ast.AST) -> bool:
        """Whether *node* is (or holds) the text of an exception, a problem or a message; a data
        field of one (``p.node``, ``exc.errno``, ``record["result"]``) is not text."""
        if isinstance(node, ast.Name):
            return node.id in self.tainted[-1] or node.id in MESSAGE_NAMES
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in ("str", "repr", "format") and node.args:
                return self._is_exc(node.args[0]) or self._is_text(node.args[0])
            if isinstance(func, ast.Attribute):  # a method of text is text: str(exc).lower()
                return self._is_text(func.value) or any(self._is_text(a) for a in node.args)
            return False
        if isinstance(node, ast.Attribute):
            if node.attr in ("text", "message", "msg", "error", "why", "reason"):
                return True
            return node.attr in MESSAGE_ATTRS and (self._is_exc(node.value) or self._is_text(node.value))
        if isinstance(node, ast.Subscript):
            key = node.slice
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                return False  # a record's field
            return self._is_text(node.value)
        if isinstance(node, ast.FormattedValue):
            return self._is_exc(node.value) or self._is_text(node.value)
        return any(self._is_text(child) for child in ast.iter_child_nodes(node))

    def _names_message(self, node: ast.AST) -> bool:
        return (isinstance(node, ast.Name) and (node.id in MESSAGE_NAMES or node.id in self.tainted[-1])) or (
            isinstance(node, ast.Attribute) and node.attr in ("text", "message", "msg", "error", "problems"))

    # -- what counts as a decision -------------------------------------------------------------
    def _decides_by_text(self, test: ast.AST) -> bool:
        for sub in ast.walk(test):
            if isinstance(sub, ast.Compare):
                # `x in TEXT`, `TEXT == "..."`: a comparison of text with text (not `x is None`)
                if all(isinstance(op, (ast.Is, ast.IsNot)) for op in sub.ops):
                    continue
                if any(isinstance(c, ast.Constant) and isinstance(c.value, str) for c in [sub.left, *sub.comparators]) \
                        or any(isinstance(op, (ast.In, ast.NotIn)) for op in sub.ops):
                    if any(self._is_text(c) for c in [sub.left, *sub.comparators]):
                        return True
            if isinstance(sub, ast.Call) and self._text_test_call(sub):
                return True
        return False

    def _text_test_call(self, call: ast.Call) -> bool:
        func = call.func
        if not isinstance(func, ast.Attribute) or func.attr not in TEXT_TESTS:
            return False
        subject = [func.value] if func.attr in ("startswith", "endswith", "find", "index", "rfind", "count",
                                                 "__contains__") else list(call.args[1:2] or call.args[:1])
        return any(self._is_text(s) for s in subject)

    def _flag(self, node: ast.AST, test: ast.AST) -> None:
        if self._decides_by_text(test):
            self.found.append(f"{self.rel}:{node.lineno}: {ast.unparse(test)[:100]}")

    # -- walking -------------------------------------------------------------------------------
    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        names = set(self.exc_names[-1]) | ({node.name} if node.name else set())
        self.exc_names.append(names)
        self.tainted.append(set(self.tainted[-1]))
        self.generic_visit(node)
        self.tainted.pop()
        self.exc_names.pop()

    def visit_Assign(self, node: ast.Assign) -> None:
        if self.exc_names[-1] and self._is_text(node.value):
            self.tainted[-1].update(t.id for t in node.targets if isinstance(t, ast.Name))
        self.generic_visit(node)

    def visit_If(self, node: ast.If) -> None:
        self._flag(node, node.test)
        self.generic_visit(node)

    visit_While = visit_IfExp = visit_Assert = visit_If

    def _iterates_messages(self, target: ast.AST, it: ast.AST) -> None:
        """`for p in exc.problems`, `[... for line in lines if ...]` of messages: *p* is a message."""
        if self._names_message(it) or (isinstance(it, ast.Name) and it.id in self.tainted[-1]):
            self.tainted[-1].update(t.id for t in ast.walk(target) if isinstance(t, ast.Name))

    def visit_For(self, node: ast.For) -> None:
        self._iterates_messages(node.target, node.iter)
        self.generic_visit(node)

    def _scoped(self, node: ast.AST) -> None:
        # a comprehension's names are its own: `[p.to_dict() for p in problems]` taints no later `p`
        self.tainted.append(set(self.tainted[-1]))
        self.generic_visit(node)
        self.tainted.pop()

    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _scoped

    def visit_comprehension(self, node: ast.comprehension) -> None:
        self._iterates_messages(node.target, node.iter)
        for cond in node.ifs:
            self._flag(cond, cond)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        # a decision outside an if: `match = PATTERN.match(message)`, `lost = err.startswith("lost")`
        if self._text_test_call(node):
            self.found.append(f"{self.rel}:{node.lineno}: {ast.unparse(node)[:100]}")
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        if self._decides_by_text(node):
            self.found.append(f"{self.rel}:{node.lineno}: {ast.unparse(node)[:100]}")
        self.generic_visit(node)


def text_decisions(source: str, rel: str = "<test>") -> list[str]:
    finder = _TextDecisions(rel)
    finder.visit(ast.parse(source))
    return sorted(set(finder.found))


def test_no_decision_reads_an_exceptions_or_a_messages_text():
    found = []
    for path in _modules():
        found += text_decisions(path.read_text(encoding="utf-8"), str(path.relative_to(PACKAGE)))
    assert not found, "decisions made by reading text (use the problem's node/check or the exception's type/kind):\n" \
        + "\n".join(found)


@pytest.mark.parametrize("source", [
    "try:\n    f()\nexcept OSError as exc:\n    if 'denied' in str(exc):\n        pass\n",
    "try:\n    f()\nexcept OSError as exc:\n    lost = str(exc).startswith('lost')\n",
    "try:\n    f()\nexcept OSError as exc:\n    text = f'{exc}'\n    if text.endswith('x'):\n        pass\n",
    "try:\n    f()\nexcept OSError as e:\n    code = 1 if e.args[0] == 'busy' else 2\n",
    "try:\n    f()\nexcept OSError as e:\n    m = re.search('host (\\\\S+)', e.strerror)\n",
    "if out.error.startswith('lost'):\n    pass\n",
    "m = PATTERN.match(problem)\n",
    "hosts = [p for p in problems if 'node1' in str(p)]\n",
    "if p.text == 'x':\n    pass\n",
])
def test_the_scan_finds_a_decision_by_text(source):
    assert text_decisions(source), source


@pytest.mark.parametrize("source", [
    "try:\n    f()\nexcept OSError as exc:\n    die(f'cannot read: {exc}')\n",
    "try:\n    f()\nexcept OSError as exc:\n    raise Err(str(exc)) from None\n",
    "try:\n    f()\nexcept OSError as exc:\n    if exc.errno == 2:\n        pass\n",
    "try:\n    f()\nexcept MyError as exc:\n    hosts = {p.node for p in exc.problems if p.node is not None}\n",
    "try:\n    f()\nexcept MyError as exc:\n    if exc.kind == 'busy':\n        pass\n",
    "if problem is None:\n    pass\n",
    "out = [p.to_dict() for p in self.problems]\nfor p in probes:\n    if p['result'] == 'ok':\n        pass\n",
])
def test_the_scan_lets_printing_and_data_fields_pass(source):
    assert not text_decisions(source), source


def _exception_classes() -> list[type]:
    classes = {}
    for info in pkgutil.walk_packages(ddpfab.__path__, "ddpfab."):
        rel = info.name.removeprefix("ddpfab.").replace(".", "/")
        if f"{rel}.py" in SHIPPED or info.name in ("ddpfab.__main__",):
            continue
        module = importlib.import_module(info.name)
        for _, obj in inspect.getmembers(module, inspect.isclass):
            name = f"{obj.__module__}.{obj.__qualname__}"
            if issubclass(obj, BaseException) and obj.__module__ == info.name and name not in SIGNALS:
                classes[name] = obj
    return list(classes.values())


def test_every_ddpfab_exception_is_a_DdpfabError():
    classes = _exception_classes()
    assert len(classes) >= 20, [c.__name__ for c in classes]  # the walk found them
    assert [c.__name__ for c in classes if not issubclass(c, DdpfabError)] == []


def test_ddpfab_exports_the_base_lazily():
    assert ddpfab.DdpfabError is DdpfabError


def test_a_ddpfab_errors_problems_round_trip_through_dicts():
    err = DdpfabError([Problem("node1", "ssh", expected="a key on record", found="a changed key",
                               fix="check the host, then remove its line from known_hosts"),
                       "nothing was started"], check="run")
    assert [p.node for p in err.problems] == ["node1", None]
    assert [p.check for p in err.problems] == ["ssh", "run"]
    again = DdpfabError.from_dict(json.loads(json.dumps(err.to_dict())))
    assert [(p.node, p.check, p.expected, p.found, p.fix) for p in again.problems] == [
        (p.node, p.check, p.expected, p.found, p.fix) for p in err.problems]
    assert again.to_dict() == err.to_dict() and str(again) == str(err)
    assert type(again) is DdpfabError and again.nodes() == ["node1"]
    # a subclass comes back as itself, its problems as data (its text is not re-parsed)
    sync = SyncError.from_dict(SyncError(Problem("node2", "workdir", text="host node2: refusing")).to_dict())
    assert type(sync) is SyncError and sync.problems[0].about("node2", "workdir")
    with pytest.raises(ValueError):
        DdpfabError.from_dict({"problems": [{"node": 3, "check": "x"}]})


def test_a_node_error_is_one_problem_about_its_node():
    err = NodeError("node10", "host node10: unreachable: refused", "unreachable", found="unreachable: refused")
    (problem,) = err.problems
    assert (problem.node, problem.check, problem.found, str(problem)) == (
        "node10", "unreachable", "unreachable: refused", "host node10: unreachable: refused")
    assert problem.about("node10") and not problem.about("node1")
    assert str(err) == "host node10: unreachable: refused"


def test_sync_and_fetch_refusals_name_their_node_as_data():
    """What recover and --json read: the node a refusal is about, without cutting it off the text."""
    from ddpfab.hosts.inventory import Node
    from ddpfab.transfer.fetch import FetchError, located
    from ddpfab.transfer.sync import check_workdir

    with pytest.raises(SyncError) as sync:
        check_workdir(Node(name="node10", host="192.0.2.10", workdir="relative/dir"), "/w")
    assert [(p.node, p.check) for p in sync.value.problems] == [("node10", "workdir")]
    assert str(sync.value).startswith("host node10: refusing to sync: ")
    with pytest.raises(FetchError) as fetch:
        located("node1", {"path": "/w/..", "bytes": 3})
    assert [(p.node, p.check) for p in fetch.value.problems] == [("node1", "locate")] and fetch.value.code == 1


def test_a_node_programs_refusal_keeps_its_code_as_the_problems_kind():
    """The node side's exceptions (stdlib-only) travel as a reply's code; the controller's error
    names the node and takes the code as its kind."""
    import subprocess
    import sys

    from ddpfab.remote import nodeprogram as nodeprog

    reqs = nodeprog.numbered({"op": "hash", "workdir": "~x"})  # another user's home: refused on the node
    proc = subprocess.run(nodeprog.argv(sys.executable, "ddpfab-node"), input=nodeprog.stdin_for(*reqs),
                          capture_output=True, timeout=60)
    [reply] = nodeprog.match_replies("node2", reqs, proc.stdout.splitlines(), proc.returncode, proc.stderr.decode())
    assert not reply.ok and "another user's home" in reply.error
    with pytest.raises(nodeprog.NodeProgramError) as err:
        reply.value("node2")
    assert (err.value.node, err.value.kind) == ("node2", "workdir")
    assert err.value.problems[0].about("node2", "workdir")
