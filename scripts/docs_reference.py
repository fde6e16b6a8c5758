"""The docs' reference pages, generated from the code at build time so they cannot drift.

- one page per command (``reference/run.md``, ``reference/lab-up.md``, ...), from the argparse
  parser the command line itself builds: usage, description, every option with its default and help;
- ``reference/exit-codes.md`` from ``ddpfab.cli.errors.EXIT_CODES``, then the notes per command
  (``docs/_partials/exit-codes-by-command.md``);
- ``reference/masking.md`` from the masking rule's own tables (``ddpfab.masking``);
- ``changelog.md``, the repository's CHANGELOG.md.

MkDocs loads this file as a hook (``hooks:`` in mkdocs.yml): ``on_config`` lists the pages under
"Reference" in the nav, ``on_files`` adds them to the site. ``tests/unit/test_reference.py`` uses
the same functions (every option has a help text; every option is on its command's page).
"""

from __future__ import annotations

import argparse
import html
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PARTIALS = REPO / "docs" / "_partials"
REFERENCE = "Reference"


def leaf_parsers(parser: argparse.ArgumentParser, prefix: str = "") -> list[tuple[str, argparse.ArgumentParser]]:
    """Every command's own parser, as (``"run"``, parser), (``"lab up"``, parser), in ``--help``'s order."""
    out = []
    for action in parser._actions:  # argparse has no public walk; _actions is stable since 3.2
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                full = f"{prefix} {name}".strip()
                out += leaf_parsers(sub, full) or [(full, sub)]
    return out


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The arguments a command's page shows: all but ``--help`` and the hidden ones."""
    return [a for a in parser._actions
            if not isinstance(a, argparse._HelpAction) and a.help is not argparse.SUPPRESS]


def missing_help(parser: argparse.ArgumentParser) -> list[str]:
    """``"COMMAND OPTION"`` for each argument of every command that has no help text to show."""
    return [f"{name} {(a.option_strings or [a.dest])[0]}" for name, sub in leaf_parsers(parser)
            for a in options(sub) if not (a.help or "").strip()]


def page_name(command: str) -> str:
    return "reference/" + command.replace(" ", "-") + ".md"


def _cell(text: str) -> str:
    """*text* as one Markdown table cell, shown as written: no emphasis from a glob's ``*``, no HTML."""
    text = " ".join(text.split())
    for char, escaped in (("\\", "\\\\"), ("*", "\\*"), ("<", "&lt;"), (">", "&gt;"), ("|", "\\|")):
        text = text.replace(char, escaped)
    return text


def _code(words: list[str]) -> str:
    """Each of *words* as code in a table cell (HTML: a Markdown code span would show ``\\|`` for ``|``)."""
    return ", ".join("<code>" + html.escape(w).replace("|", "&#124;") + "</code>" for w in words)


def _default(action: argparse.Action) -> list[str]:
    if action.option_strings and action.nargs == 0:  # a flag: present or not
        return []
    default = action.default
    if default in (None, argparse.SUPPRESS, [], ""):
        return []
    return [str(default)]


def _spelling(action: argparse.Action) -> list[str]:
    if not action.option_strings:
        return [str(action.metavar or action.dest)]
    metavar = ""
    if action.nargs != 0:
        metavar = action.metavar if isinstance(action.metavar, str) else (
            "{" + ",".join(map(str, action.choices)) + "}" if action.choices else action.dest.upper())
        metavar = " " + metavar
    return [s + metavar for s in action.option_strings]


def command_page(command: str, parser: argparse.ArgumentParser) -> str:
    """The reference page of one command: usage, description, then a table of its arguments."""
    usage = " ".join(parser.format_usage().removeprefix("usage: ").split())
    lines = [f"# ddpfab {command}", "", "```", usage, "```", ""]
    if parser.description:
        lines += [" ".join(parser.description.split()), ""]
    lines += ["| argument | default | what it does |", "|---|---|---|"]
    for action in options(parser):
        help_text = (action.help or "") % {"default": action.default, "prog": parser.prog} if "%(" in (
            action.help or "") else (action.help or "")
        lines.append(f"| {_code(_spelling(action))} | {_code(_default(action))} | {_cell(help_text)} |")
    if parser.epilog:
        lines += ["", " ".join(parser.epilog.split())]
    return "\n".join(lines) + "\n"


def exit_codes_page() -> str:
    from ddpfab.cli.errors import EXIT_CODES
    lines = ["# Exit codes", "", "One table for every command (`ddpfab/cli/errors.py`, `EXIT_CODES`;",
             "`tests/unit/test_exit_codes.py` walks each command's error paths against it). Nothing ddpfab",
             "refuses ends in a traceback.", "", "| code | meaning |", "|---|---|"]
    lines += [f"| {code} | {_cell(meaning)} |" for code, meaning in EXIT_CODES]
    return "\n".join(lines) + "\n\n" + (PARTIALS / "exit-codes-by-command.md").read_text()


def masking_page() -> str:
    from ddpfab.masking import MASK, SECRET_PARTS, SECRET_WORDS
    parts = ", ".join(f"`{p}`" for p in SECRET_PARTS)
    words = ", ".join(f"`{w}`" for w in sorted(SECRET_WORDS))
    return "\n".join([
        "# The masking rule", "",
        "One rule (`ddpfab/masking.py`) decides which values ddpfab never shows: in manifests, printed",
        "plans, `--dry-run` and its `--json`, exports to stdout, logs and the record of ddpfab's own",
        f"command line, a secret's value shows as `{MASK}`. It goes by the variable's key, never by",
        "searching text for values. A key is secret when:", "",
        f"- it contains, in any case, one of {parts};",
        f"- one of its words (split at `_`, trailing digits dropped) is one of {words}",
        "  (`DB_PASS`, `MYSQL_PWD`, `GITHUB_PAT`, `AWS_ACCESS_KEY_ID`);",
        "- you mark it: `--secret-env KEY` (repeatable) or the inventory list `ddpfab_secret_env: [KEY, ...]`.", "",
        "Any other value keeps its text but for a URL's credentials: `postgres://user:pw@db/x` shows as",
        f"`postgres://user:{MASK}@db/x`, `https://TOKEN@host/...` as `https://{MASK}@host/...`.", "",
        "Setup lines (`ddpfab_setup`) follow the same rule: an assignment whose key is secret shows as",
        f"`KEY={MASK}` (`export HF_TOKEN={MASK}`). See [Environment and secrets](../environment.md).", ""])


def pages() -> dict[str, str]:
    """Every generated page: its path under docs/ -> its Markdown."""
    from ddpfab.cli import build_parser
    out = {page_name(name): command_page(name, sub) for name, sub in leaf_parsers(build_parser())}
    out["reference/exit-codes.md"] = exit_codes_page()
    out["reference/masking.md"] = masking_page()
    out["changelog.md"] = (REPO / "CHANGELOG.md").read_text()
    return out


def reference_nav() -> list[dict[str, str]]:
    from ddpfab.cli import build_parser
    nav = [{f"ddpfab {name}": page_name(name)} for name, _ in leaf_parsers(build_parser())]
    return nav + [{"Exit codes": "reference/exit-codes.md"}, {"The masking rule": "reference/masking.md"}]


# -- MkDocs hooks -------------------------------------------------------------------------------------
def on_config(config: Any, **_: Any) -> Any:
    """Fill the nav's "Reference" section (written empty in mkdocs.yml) with the generated pages."""
    for entry in config["nav"]:
        if isinstance(entry, dict) and REFERENCE in entry:
            entry[REFERENCE] = reference_nav()
            return config
    raise ValueError(f"mkdocs.yml's nav has no {REFERENCE!r} section for the generated pages")


def on_files(files: Any, config: Any, **_: Any) -> Any:
    from mkdocs.structure.files import File
    for path, text in pages().items():
        files.append(File.generated(config, path, content=text))
    return files
