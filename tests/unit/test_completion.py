"""The completion scripts, installed each way the help documents, in the real shells: a zsh file
on $fpath (``#compdef``) and ``eval``; bash's ``eval``. Registered, and completing on a terminal."""

from __future__ import annotations

import os
import pty
import re
import select
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from ddpfab import cli
from ddpfab.cli import completion

ZSH = shutil.which("zsh") or "zsh (not installed: scripts/setup.sh --test installs it)"


def _script(shell: str, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(completion.script(cli.build_parser(), shell))
    return path


def _clean_env(home: Path) -> dict[str, str]:
    """No user's rc files: a fresh ZDOTDIR/HOME, a plain terminal."""
    home.mkdir(exist_ok=True)
    return {"PATH": os.environ["PATH"], "HOME": str(home), "ZDOTDIR": str(home), "TERM": "dumb"}


def _type_on_terminal(argv: list[str], env: dict[str, str], steps: list[tuple[str, str]], cwd: Path) -> str:
    """Start *argv* on a pseudo-terminal; for each (keys, expected regex) type the keys and read
    until the output matches (10 s at most). Returns everything it printed."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: the shell
        os.chdir(cwd)
        os.execvpe(argv[0], argv, env)
    out = b""
    try:
        for keys, expected in steps:
            mark = len(out)
            os.write(fd, keys.encode())
            deadline = time.monotonic() + 10
            while not re.search(expected, out[mark:].decode(errors="replace")):
                assert time.monotonic() < deadline, f"{keys!r}: no {expected!r} in {out[mark:]!r}"
                if select.select([fd], [], [], 0.1)[0]:
                    out += os.read(fd, 65536)
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        os.close(fd)
    return out.decode(errors="replace")


@pytest.mark.parametrize("how", ["fpath", "eval", "eval-first"])
def test_zsh_completion_registers_and_completes(how, tmp_path):
    if how == "fpath":  # as the help says: the script saved as _ddpfab in a directory on $fpath
        fdir = _script("zsh", tmp_path / "functions" / "_ddpfab").parent
        setup = f"fpath=({fdir} $fpath); autoload -Uz compinit; compinit -u -D"
    elif how == "eval":  # eval'd in ~/.zshrc after compinit
        script = _script("zsh", tmp_path / "ddpfab.zsh")
        setup = f'autoload -Uz compinit; compinit -u -D; eval "$(cat {script})"'
    else:  # eval'd in a ~/.zshrc that runs no compinit (plain zsh has none)
        setup = f'eval "$(cat {_script("zsh", tmp_path / "ddpfab.zsh")})"'
    env = _clean_env(tmp_path / "home")
    res = subprocess.run([ZSH, "-c", f"{setup}; print -r -- ${{_comps[ddpfab]}}"], capture_output=True, text=True,
                         env=env, timeout=60)
    assert res.stdout.strip() == "_ddpfab" and res.stderr == "", res
    # and it completes: a subcommand, a sub-subcommand's list, an option
    (tmp_path / "train.py").write_text("")
    _type_on_terminal([ZSH, "-f", "-i"], env, [
        (setup + "\n", r"[#%$] "),
        ("ddpfab chec\t", r"ddpfab check "),
        ("\x15ddpfab lab \t\t", r"down\s+status\s+up"),
        ("\x15ddpfab run --no-sy\t", r"--no-sync "),
        ("\x15ddpfab run tra\t", r"train\.py"),
    ], tmp_path)


def test_bash_completion_registers_on_eval(tmp_path):
    script = _script("bash", tmp_path / "ddpfab.bash")
    res = subprocess.run(["bash", "--norc", "--noprofile", "-c", f'eval "$(cat {script})"; complete -p ddpfab'],
                         capture_output=True, text=True, env=_clean_env(tmp_path / "home"), timeout=60)
    assert res.stdout.strip() == "complete -o filenames -F _ddpfab_complete ddpfab" and res.stderr == "", res
