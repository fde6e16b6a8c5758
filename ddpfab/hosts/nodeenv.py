"""The node's environment and its python: decided in one place, applied the same way everywhere.

Every command that starts something on a node (the probe, ``check``, ``sync``, ``ps``/``stop``,
``fetch``, the launch's supervisor, ``exec``, emitted scripts) starts it through :func:`prefix`:
the node's ``ddpfab_setup`` lines and ``ddpfab_conda_env`` activation (:func:`setup_lines`), each
guarded so that a failing one stops the command with :data:`SETUP_FAILED` and says which line on
stderr, then (where the python is not yet decided) the one choice of the node's python
(:func:`choose_python`). So what ``check`` reports is what the job runs with.

The python, in order (the first that applies):

1. ``ddpfab_python`` in the inventory (``inventory``): always wins;
2. the env ``ddpfab_conda_env`` activated (``ddpfab_conda_env``: ``$CONDA_PREFIX/bin/python``);
3. an env the ``ddpfab_setup`` lines activated (``ddpfab_setup``: ``$VIRTUAL_ENV`` or
   ``$CONDA_PREFIX``, only looked at when there are setup lines: a stray variable of a login
   script does not count);
4. the venv ``ddpfab provision`` made (``provisioned venv``): the python its role records in
   :data:`MARKER`, else the role's default venv :data:`DEFAULT_VENV`;
5. ``python3`` (``default``).

The node decides 2-5 (only it can see them) in :func:`choose_python`'s shell and tells the
controller through ``DDPFAB_PYTHON_FROM``; the probe's facts carry it back, and the run launches
exactly that interpreter (:func:`decided`). Without the node (``--offline``) it is not known:
:data:`ON_NODE`, and emitted scripts carry the same choice in their shell.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import replace
from typing import Any

from ddpfab.masking import mask_setup_line

#: Exit status of a command whose setup line failed (nothing else ddpfab starts on a node exits
#: so: the node program exits 0-2, a missing python 127). stderr carries :data:`SETUP_MARK`.
SETUP_FAILED = 96
SETUP_MARK = "ddpfab-setup-failed"
#: The one-line record the ``ddpfab_python`` role leaves: the venv's python, as an absolute path.
MARKER = "/etc/ddpfab/python"
#: The role's default venv (found also on nodes provisioned before the role left :data:`MARKER`).
DEFAULT_VENV = "/opt/ddpfab/venv"
#: Where the python came from (the facts' ``python_from``; anything else a node says is refused).
SOURCES = ("inventory", "ddpfab_conda_env", "ddpfab_setup", "provisioned venv", "default")
#: The python of a node not asked yet (an offline plan): the node's shell chooses it.
ON_NODE = "$DDPFAB_PYTHON"
ON_NODE_FROM = "decided on the node (not known offline)"
#: ... as a shell word (:func:`prefix` sets it)
ON_NODE_WORD = '"$DDPFAB_PYTHON"'
#: The variables the prefix sets itself (not the user's environment's changes).
OWN_VARS = ("DDPFAB_PYTHON", "DDPFAB_PYTHON_FROM", "DDPFAB_ENV0")


def conda_line(env: str) -> str:
    """The shell line that activates conda env *env* (a name or a path) the way ``conda activate``
    does in an interactive shell: conda's POSIX hook first, from ``$CONDA_EXE``, ``conda`` on PATH
    or the usual install places (a non-interactive SSH shell has not run conda's init block)."""
    where = " ".join(('"${CONDA_EXE:-}"', '"$(command -v conda 2>/dev/null)"', '"$HOME/miniforge3/bin/conda"',
                      '"$HOME/miniconda3/bin/conda"', '"$HOME/anaconda3/bin/conda"', "/opt/conda/bin/conda"))
    return (f'__c=$(for c in {where}; do [ -n "$c" ] && [ -x "$c" ] && {{ echo "$c"; break; }}; done); '
            f'[ -n "$__c" ] && eval "$("$__c" shell.posix hook)" && conda activate {shlex.quote(env)}')


def setup_lines(setup: tuple[str, ...], conda_env: str | None) -> tuple[str, ...]:
    """The node's setup as the lines run in order: ``ddpfab_setup``'s, then the conda activation."""
    return (*setup, *((conda_line(conda_env),) if conda_env else ()))


def parse_setup(host: str, value: Any) -> tuple[str, ...]:
    """``ddpfab_setup``: a string (one line per line) or a list of strings; blank lines dropped.
    ValueError (naming *host*) for anything else."""
    if value is None or value == "":
        return ()
    items = value.splitlines() if isinstance(value, str) else value if isinstance(value, list) else None
    if items is None or not all(isinstance(i, str) for i in items):
        raise ValueError(f"host {host}: ddpfab_setup must be shell lines (a string or a list of strings), "
                         f"got {value!r}")
    lines = tuple(i.strip() for i in items if i.strip())
    bad = [i for i in lines if "\x00" in i or "\n" in i]
    if bad:
        raise ValueError(f"host {host}: ddpfab_setup line {bad[0]!r} holds a NUL or a newline")
    return lines


def parse_conda_env(host: str, value: Any) -> str | None:
    """``ddpfab_conda_env``: an env name or an absolute path (ValueError naming *host* otherwise)."""
    if value is None or value == "":
        return None
    text = str(value)
    if isinstance(value, (dict, list, bool)) or not re.fullmatch(r"[A-Za-z0-9_.+\-/~]+", text) \
            or ("/" in text and not text.startswith(("/", "~"))):
        raise ValueError(f"host {host}: ddpfab_conda_env must be an env name (e.g. train) or an absolute path, "
                         f"got {value!r}")
    return text


def _guarded(lines: tuple[str, ...]) -> str:
    """*lines* in order, each stopping the command when it fails, naming itself on stderr."""
    return "".join(f"{{ {line}\n}} || {{ __e=$?; echo '{SETUP_MARK}: line {i} exit '\"$__e\" >&2; "
                   f"exit {SETUP_FAILED}; }}\n" for i, line in enumerate(lines, 1))


def choose_python(node_has_setup: bool, conda_env: bool, marker: str = MARKER, venv: str = DEFAULT_VENV) -> str:
    """The shell that sets ``DDPFAB_PYTHON`` and ``DDPFAB_PYTHON_FROM`` on the node (rules 2-5 of
    the module's list): the one place the choice is made. (*marker* and *venv*: the role's
    :data:`MARKER` and :data:`DEFAULT_VENV`; other paths only for tests.)"""
    tests = []
    if conda_env:
        tests.append(('[ -n "${CONDA_PREFIX:-}" ] && [ -x "$CONDA_PREFIX/bin/python" ]', '"$CONDA_PREFIX/bin/python"',
                      "ddpfab_conda_env"))
    elif node_has_setup:
        tests += [('[ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]', '"$VIRTUAL_ENV/bin/python"',
                   "ddpfab_setup"),
                  ('[ -n "${CONDA_PREFIX:-}" ] && [ -x "$CONDA_PREFIX/bin/python" ]', '"$CONDA_PREFIX/bin/python"',
                   "ddpfab_setup")]
    tests += [(f'{{ read -r __p < {shlex.quote(marker)}; }} 2>/dev/null && case "$__p" in /*) [ -x "$__p" ];; *) false;; esac',
               '"$__p"', "provisioned venv"),
              (f"[ -x {shlex.quote(venv + '/bin/python')} ]", shlex.quote(f"{venv}/bin/python"), "provisioned venv")]
    branches = "; ".join(f"{'if' if i == 0 else 'elif'} {test}; then DDPFAB_PYTHON={value}; "
                         f"DDPFAB_PYTHON_FROM={shlex.quote(source)}" for i, (test, value, source) in enumerate(tests))
    return f"{branches}; else DDPFAB_PYTHON=python3; DDPFAB_PYTHON_FROM=default; fi; " \
           "export DDPFAB_PYTHON DDPFAB_PYTHON_FROM"


def prefix(node: Any, *, record_env: bool = False, export_python: bool = False) -> str:
    """The shell that goes before anything ddpfab starts on *node* (a Node or a NodePlan): its
    setup lines, then, when its python is still to be decided, :func:`choose_python`. With
    *record_env* the environment from before the setup goes along as ``DDPFAB_ENV0`` (the facts
    report what the setup changed); with *export_python* a decided python is exported too (exec).
    Empty for a node with nothing to set up and an explicit python."""
    lines = tuple(getattr(node, "setup", ()) or ())
    out = ""
    if lines and record_env:
        out += 'DDPFAB_ENV0=$(env -0 2>/dev/null | od -An -v -tx1 | tr -d " \\n"); export DDPFAB_ENV0\n'
    out += _guarded(lines)
    if undecided(node):
        out += choose_python(bool(lines), bool(getattr(node, "conda_env", None))) + "\n"
    elif export_python:
        out += (f"DDPFAB_PYTHON={shlex.quote(node.python)}; DDPFAB_PYTHON_FROM="
                f"{shlex.quote(node.python_from or 'inventory')}; export DDPFAB_PYTHON DDPFAB_PYTHON_FROM\n")
    if export_python:  # `python`, `pip`, `torchrun` in the command are that python's
        out += 'case "$DDPFAB_PYTHON" in /*) PATH="${DDPFAB_PYTHON%/*}:$PATH"; export PATH;; esac\n'
    return out


#: The shell that goes first in a command for a node with a :func:`prefix`: it reads that prefix
#: from the session's stdin (``N`` then N lines: :func:`setup_stdin`) and runs it in this shell, so
#: the setup lines (where sites export tokens) are in no process's argv; what follows on stdin is
#: left unread for the program the command then execs (a shell's ``read`` takes a byte at a time).
BOOTSTRAP = ('IFS= read -r __n || exit 96; __s=; while [ "$__n" -gt 0 ]; do IFS= read -r __l || exit 96; '
             '__s="$__s$__l\n"; __n=$((__n - 1)); done; eval "$__s"; unset __s __l __n\n')


def setup_stdin(node: Any, *, record_env: bool = False, export_python: bool = False,
                then: str = "") -> tuple[str, bytes]:
    """(the shell that goes first in *node*'s command, the bytes that go first on its stdin): the
    node's :func:`prefix` (same arguments) and the shell *then* travel on stdin, read by
    :data:`BOOTSTRAP`; ("", b"") when both are empty. Every command ddpfab starts on a node starts
    this way."""
    script = prefix(node, record_env=record_env, export_python=export_python) + (then + "\n" if then else "")
    if not script:
        return "", b""
    lines = script.rstrip("\n").split("\n")
    # surrogateescape: a command's undecodable bytes (an argv, a piped script) travel as they came
    return BOOTSTRAP, (f"{len(lines)}\n" + "".join(f"{line}\n" for line in lines)).encode("utf-8", "surrogateescape")


def undecided(node: Any) -> bool:
    """*node*'s python is the node's to choose (no ``ddpfab_python``, no probe yet)."""
    return not getattr(node, "python_from", "") or node.python == ON_NODE


def python_word(node: Any) -> str:
    """*node*'s python as a shell word: the decided one quoted, else the choice's variable."""
    return ON_NODE_WORD if undecided(node) else shlex.quote(node.python)


def decided(node: Any, facts: dict) -> Any:
    """*node* with the python its probe ran under (the facts' ``executable`` and ``python_from``):
    every later step on it runs that interpreter. An explicit python stays as written."""
    if not undecided(node):
        return node
    source = facts.get("python_from")
    executable = facts.get("executable")
    if source not in SOURCES or not isinstance(executable, str) or not executable.startswith("/") \
            or re.search(r"[\x00-\x1f\x7f]", executable):
        return node
    return replace(node, python=executable, python_from=source)


def node_setup_failure(node, exit_code: int | None, stderr: str) -> str | None:
    """:func:`setup_failure` of *node*'s own setup lines, its ``ddpfab_secret_env`` masked."""
    return setup_failure(tuple(getattr(node, "setup", ()) or ()), exit_code, stderr,
                         tuple(getattr(node, "secret_env", ()) or ()))


def setup_failure(lines: tuple[str, ...], exit_code: int | None, stderr: str, marked: tuple[str, ...] = ()) -> str | None:
    """What failed, when *exit_code* says a setup line did: ``setup line N `LINE` failed (exit X)``
    (the line's text from the inventory, not from the node, its secrets masked: *marked*, the
    node's ``ddpfab_secret_env``); None otherwise."""
    if exit_code != SETUP_FAILED or not lines:
        return None
    # the last one: a line's own output may come first
    m = next(reversed(list(re.finditer(rf"{SETUP_MARK}: line (\d+) exit (\d+)", stderr))), None)
    if m is None or not 1 <= int(m.group(1)) <= len(lines):
        return f"a setup line failed (exit {exit_code})"
    n = int(m.group(1))
    return (f"setup line {n} `{mask_setup_line(lines[n - 1], marked)}` failed there (exit {m.group(2)}); "
            "fix it in ddpfab_setup/ddpfab_conda_env")


def env_changes(facts: dict) -> dict | None:
    """The facts' ``env_changes`` validated (``{"set": {KEY: VALUE}, "unset": [KEY]}``), None when
    absent or not of that shape."""
    ch = facts.get("env_changes")
    if not isinstance(ch, dict):
        return None
    got_set, unset = ch.get("set"), ch.get("unset")
    if not isinstance(got_set, dict) or not isinstance(unset, list) \
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in got_set.items()) \
            or not all(isinstance(k, str) for k in unset):
        return None
    return {"set": dict(got_set), "unset": list(unset)}


def torch_fix(node: Any) -> str:
    """What to do when *node*'s python cannot import torch, by where that python came from."""
    source = getattr(node, "python_from", "") or ""
    if source == "inventory":
        return "ddpfab_python names a python without torch: point it at one with torch, or remove it to use " \
               "the venv ddpfab provision makes"
    if source in ("ddpfab_conda_env", "ddpfab_setup"):
        return f"install torch in the environment {source} activates, or set ddpfab_python"
    if source == "provisioned venv":
        return f"the provisioned venv ({node.python}) lacks torch: run ddpfab provision --roles python again, " \
               "or set ddpfab_python"
    return "provision the node (ddpfab provision) or set ddpfab_python"


def describe(node: Any) -> str:
    """``PYTHON (from SOURCE)``, for plans and dry runs."""
    if undecided(node):
        return f"{ON_NODE_FROM}: the provisioned venv when there, else python3"
    return f"{node.python} (from {node.python_from or 'inventory'})"
