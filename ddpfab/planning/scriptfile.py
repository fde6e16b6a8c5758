"""The run's script as a file: where it is (a script path, or ``-m MODULE``'s file) and which
local-rank argument it declares. Decided here once, for the real run, the dry run, the nodes'
probe, replay's hash and the launch's local-rank argument.

Module mode (``ddpfab run -m pkg.train`` or ``-- -m pkg.train``, torchrun's ``-m``): the module's
file is ``pkg/train.py`` or, for a package, ``pkg/train/__main__.py``, relative to the directory
that is synced (the workdir on the nodes). When the module's top-level package is not in that
directory (``pkg/`` nor ``pkg.py``) it is taken to be installed in the nodes' python and is not
checked (there is no file to look for); when it is, the module's file must be there, here before
the copy and on every node after it, the same as a script's.
"""

from __future__ import annotations

import os
import re

from ddpfab.hosts.suggest import files_like
from ddpfab.planning.plan import LOCAL_RANK_ARGS
from ddpfab.problems import DdpfabError

#: How much of a script is read to find its arguments.
READ_LIMIT = 1 << 20


class ScriptError(DdpfabError):
    """The script or module is not where the run would look for it; the message says where it looked."""

    check = "script"


def module_candidates(module: str) -> tuple[str, str]:
    """The files ``python -m MODULE`` runs from a directory: ``a/b.py``, else ``a/b/__main__.py``."""
    path = module.replace(".", "/")
    return f"{path}.py", f"{path}/__main__.py"


def is_local_module(module: str, root: str) -> bool:
    """Whether *module*'s top-level package (or module) is in *root* (else: installed, not checked)."""
    top = module.split(".", 1)[0]
    return os.path.isdir(os.path.join(root, top)) or os.path.isfile(os.path.join(root, f"{top}.py"))


def module_file(module: str, root: str) -> str | None:
    """The relative path of *module*'s file under *root*, or None when none of its candidates is there."""
    return next((c for c in module_candidates(module) if os.path.isfile(os.path.join(root, c))), None)


def file_to_check(script: str, module: bool, root: str) -> str | None:
    """The path (relative to the workdir, or absolute) the nodes must have before the launch, or
    None when nothing is checked (a module installed in the nodes' python).

    Args:
        script: the script, or the module with *module*.
        module: module mode.
        root: the directory here the code is synced from.
    """
    if not module:
        return script
    if not is_local_module(script, root):
        return None
    return module_file(script, root) or module_candidates(script)[0]


def local_file(script: str, module: bool, root: str) -> str | None:
    """The script's (or module's) file here, or None when there is none to read."""
    if module:
        found = module_file(script, root)
        return os.path.join(root, found) if found else None
    path = script if os.path.isabs(script) else os.path.join(root, script)
    return path if os.path.isfile(path) else None


def declared_local_rank(path: str | None) -> str | None:
    """The local-rank argument the script at *path* declares (an option string in quotes,
    ``"--local_rank"`` or ``"--local-rank"``), or None (none declared, or nothing to read). A
    script that declares both gets the dashed one (torch 2.x's)."""
    if not path:
        return None
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            text = fh.read(READ_LIMIT)
    except OSError:
        return None
    underscore = re.search(r"""["']--local_rank["']""", text)
    dash = re.search(r"""["']--local-rank["']""", text)
    if dash:
        return LOCAL_RANK_ARGS[0]
    return LOCAL_RANK_ARGS[1] if underscore else None


def check_here(script: str, module: bool, root: str, names: list[str] | None = None) -> None:
    """A ScriptError when the script (or a module of this directory) is not in *root*: it is
    synced from here. *names*: ``.py`` files to suggest from."""
    if module:
        if is_local_module(script, root) and module_file(script, root) is None:
            a, b = module_candidates(script)
            raise ScriptError(f"module {script} not found in {root}: neither {a} nor {b}, and its package "
                              f"{script.split('.', 1)[0]} is here")
        return
    if os.path.isabs(script):  # a file on the nodes: nothing here says what it is
        return
    path = os.path.join(root, script)
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "__main__.py")):
        raise ScriptError(f"script {script} is a directory without a __main__.py: python cannot run it; "
                          "give its script (or -m MODULE)")
    if os.path.exists(path):
        return
    raise ScriptError(f"script {script} not found in {root}")


def suggestion(script: str, root: str) -> str:
    """`` (did you mean 'train.py'?)`` for a *script* that is not in *root*: the ``.py`` files of
    its directory there that look like it; "" when none does (or it cannot be listed)."""
    return files_like(script, root, ".py")
