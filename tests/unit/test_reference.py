"""The docs that cannot drift: the command reference, the exit codes and the masking rule are
generated from the code (scripts/docs_reference.py, a hook of mkdocs.yml), and the site builds
with `mkdocs build --strict` (a broken link, a missing anchor or a page left out of the nav fails).

- Every option of every command has a help text and is on its command's page; the checker itself
  names an option added without help (shown on a parser made here).
- The site has one page per command, the exit-code table and every word of the masking rule.
- The README is a tour of at most 200 lines; the blocks it shares with the docs are the same.
"""

from __future__ import annotations

import argparse
import html
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ddpfab import masking
from ddpfab.cli import build_parser
from ddpfab.cli.errors import EXIT_CODES, EXIT_USAGE
from ddpfab.launch.hangwatch import EXIT_HUNG

from .test_docs import REPO, docs_reference

ref = docs_reference


def toy_parser(help_text: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ddpfab")
    sub = parser.add_subparsers(dest="command")
    run = sub.add_parser("run", description="Run it.")
    run.add_argument("--steps", type=int, default=3, help="how many steps")
    run.add_argument("--new-flag", help=help_text)
    lab = sub.add_parser("lab").add_subparsers(dest="lab_command")
    lab.add_parser("up").add_argument("--hosts", type=int, default=2, help="how many hosts, 'gpu*' | all")
    return parser


def test_the_checker_names_an_option_added_without_help():
    assert ref.missing_help(toy_parser(None)) == ["run --new-flag"]
    assert ref.missing_help(toy_parser("  ")) == ["run --new-flag"]
    assert ref.missing_help(toy_parser("what the new flag does")) == []
    assert [name for name, _ in ref.leaf_parsers(toy_parser(None))] == ["run", "lab up"]


def test_a_command_page_shows_usage_description_and_every_option_with_its_default():
    parser = toy_parser("what the new flag does")
    leaves = dict(ref.leaf_parsers(parser))
    page = ref.command_page("run", leaves["run"])
    assert page.startswith("# ddpfab run\n\n```\nddpfab run [-h] [--steps STEPS] [--new-flag NEW_FLAG]\n```\n\nRun it.\n")
    assert "| <code>--steps STEPS</code> | <code>3</code> | how many steps |" in page
    assert "| <code>--new-flag NEW_FLAG</code> |  | what the new flag does |" in page
    assert "-h" not in page.split("```")[2]  # --help is not an option to document
    # a help text shows as written: a glob's * is not emphasis, a | does not split the table's row
    assert "| <code>--hosts HOSTS</code> | <code>2</code> | how many hosts, 'gpu\\*' \\| all |" in ref.command_page(
        "lab up", leaves["lab up"])


def test_every_option_of_every_command_has_help_and_is_on_its_page():
    parser = build_parser()
    assert ref.missing_help(parser) == []
    pages = ref.pages()
    leaves = ref.leaf_parsers(parser)
    assert {"run", "plan", "check", "sync", "fetch", "exec", "hold", "doctor", "lab up", "export slurm"} <= {
        name for name, _ in leaves}
    for name, sub in leaves:
        page = pages[ref.page_name(name)]
        for action in ref.options(sub):
            for spelling in action.option_strings or [action.metavar or action.dest]:
                assert f"<code>{html.escape(spelling)}" in page, (name, spelling)


def test_the_exit_code_page_is_the_code_table():
    page = ref.pages()["reference/exit-codes.md"]
    codes = [code for code, _ in EXIT_CODES]
    assert str(EXIT_USAGE) in codes and str(EXIT_HUNG) in codes
    for code, meaning in EXIT_CODES:
        assert f"| {code} | " in page
    assert "## By command" in page


def test_the_masking_page_lists_every_word_of_the_rule():
    page = ref.pages()["reference/masking.md"]
    for word in (*masking.SECRET_PARTS, *masking.SECRET_WORDS):
        assert f"`{word}`" in page, word
    # the examples it gives are masked by the rule it states
    for key in re.findall(r"`([A-Z_]+)`", page.split("(`DB_PASS`", 1)[1].split(")", 1)[0]) + ["DB_PASS"]:
        assert masking.secret_key(key), key


def test_the_site_builds_strict_with_a_page_per_command(tmp_path):
    site = tmp_path / "site"
    res = subprocess.run([str(Path(sys.executable).parent / "mkdocs"), "build", "--strict", "--site-dir", str(site)],
                         cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert res.returncode == 0, res.stderr
    for name, _ in ref.leaf_parsers(build_parser()):
        page = site / "reference" / name.replace(" ", "-") / "index.html"
        assert page.is_file(), name
        assert f"ddpfab {name}" in page.read_text()
    for page in ("troubleshooting", "changelog", "reference/exit-codes", "reference/masking", "lab"):
        assert (site / page / "index.html").is_file(), page


def test_the_site_refuses_a_broken_link(tmp_path):
    # the same config over a copy of docs/ with one link broken: --strict fails, naming it
    docs = tmp_path / "docs"
    subprocess.run(["cp", "-r", str(REPO / "docs"), str(docs)], check=True)
    (docs / "troubleshooting.md").write_text((docs / "troubleshooting.md").read_text() + "\n[gone](gone.md)\n")
    config = (REPO / "mkdocs.yml").read_text().replace("scripts/docs_reference.py",
                                                         str(REPO / "scripts" / "docs_reference.py"))
    (tmp_path / "mkdocs.yml").write_text(config)
    res = subprocess.run([str(Path(sys.executable).parent / "mkdocs"), "build", "--strict", "--site-dir",
                          str(tmp_path / "site")], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert res.returncode != 0 and "gone.md" in res.stderr, res.stderr


def _block(text: str, heading: str, lang: str) -> str:
    section = text.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(rf"```{lang}\n(.*?)```", section, re.S)
    assert len(blocks) == 1, heading
    return blocks[0]


def test_the_readme_is_a_short_tour_whose_blocks_are_the_docs_own():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    headings = re.findall(r"^## (.+)$", readme, re.M)
    assert headings[:6] == ["Quick start", "Install", "Try it on the local lab", "Using it on your machines",
                            "When a job fails or hangs", "Debugging a rank"], headings
    assert (_block(readme, "## Try it on the local lab", "sh")
            == _block("\n" + (REPO / "docs" / "lab.md").read_text().split("\n## ", 1)[0].split("\n", 1)[1] + "\n## ",
                      "", "sh"))
    library = (REPO / "docs" / "library.md").read_text()
    assert _block(readme, "## As a library", "python") == _block("\n" + library.split("\n", 1)[1], "", "python")


@pytest.mark.parametrize("page", sorted(p.name for p in (REPO / "docs").glob("*.md")))
def test_every_page_of_docs_is_in_the_nav(page):
    # mkdocs --strict says so too; this names the page without building the site
    assert f": {page}\n" in (REPO / "mkdocs.yml").read_text(), page
