"""Docs that stay true: the figures they quote from bench/results, and the files they name.

- Every benchmark figure README.md and docs/*.md quote sits behind a `<!-- bench:KEY -->` marker
  (bench/markers.py) and equals what bench/report.py computes from bench/results/*.json, rounded as
  printed; docs/benchmarks.md is exactly what bench/report.py writes from those results.
- Every relative link and every file or path the docs name (backticked, a `*.md` or a path under one
  of the repository's top directories in prose; code blocks aside) is a file of this repository:
  no design notes or lab recipes that live somewhere else. Paths on the nodes (absolute, `~/...`),
  placeholders (`<run-id>`, `DIR/...`), API groups and sysctls (`nvidia.com/gpu`) and the few names
  of what ddpfab or another tool makes at run time (ELSEWHERE) are not files here.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

import pytest
import tomllib
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _load_report() -> ModuleType:
    # bench/ is scripts, not a package: load report.py by path; it puts bench/ on sys.path for its
    # own imports (common, markers)
    return _load("ddpfab_bench_report", BENCH / "report.py")


report = _load_report()
docs_reference = _load("ddpfab_docs_reference", REPO / "scripts" / "docs_reference.py")
markers = report.markers
Figure = markers.Figure


@pytest.fixture(scope="module")
def figures() -> dict:
    return report.quoted(report.load_all())


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


# -- quoted benchmark figures -----------------------------------------------------------------------
def test_every_quoted_benchmark_figure_equals_bench_results(figures):
    found = []
    for path in markers.quoting_files():
        text = path.read_text()
        found += [m["key"] for m in markers.MARKER.finditer(text)]
        assert markers.problems(text, figures, _rel(path)) == []
    # each figure report.quoted() computes is quoted somewhere (a marker lost in an edit shows here)
    assert set(figures) <= set(found), sorted(set(figures) - set(found))
    # the two figures the README and docs/benchmarks.md once disagreed on (issue 24)
    readme = (REPO / "README.md").read_text()
    assert f"<!-- bench:launch.own -->{markers.render(figures['launch.own'], '0.00')}" in readme
    assert markers.render(figures["launch.own"], "0.00") in (REPO / "docs" / "benchmarks.md").read_text()


def test_no_marker_starts_a_line():
    # in CommonMark a line starting with `<!--` opens an HTML block even inside a paragraph: the
    # rest of that line would render as raw HTML, out of its sentence
    for path in markers.quoting_files():
        for n, line in enumerate(path.read_text().splitlines(), 1):
            assert not line.lstrip().startswith("<!-- bench:"), f"{_rel(path)}:{n}: {line}"


def test_the_readme_benchmarks_section_quotes_no_figure_without_a_marker():
    text = (REPO / "README.md").read_text()
    section = text[text.index("\n## Benchmarks\n"):]
    section = section[:section.index("\n## ", 1)]
    bare = markers.MARKER.sub("", section)
    assert re.findall(r"\d+(?:\.\d+)?(?: s\b|x\b)", bare) == []
    assert section.count("<!-- bench:") >= 10


def test_a_stale_an_unknown_and_a_missing_figure_are_each_named_with_file_and_line():
    figs = {"a.t": Figure(0.843, " s"), "a.r": Figure((0.4821, 3.898), " s"), "a.v": Figure("not met"),
            "a.n": Figure(5), "a.x": Figure(8.8235, "x")}
    text = ("spends <!-- bench:a.t -->+1.2 s, gone in <!-- bench:a.r -->0.5-3.9 s;\n"
            "<!-- bench:a.v -->met, of <!-- bench:a.n -->5 and <!-- bench:a.x -->8.8x faster;\n"
            "then <!-- bench:a.gone -->3 s and <!-- bench:a.t --> nothing")
    # a.r (0.48-3.90 printed to one decimal), a.n and a.x are current
    assert markers.problems(text, figs, "README.md") == [
        "README.md:1: bench:a.t: says '+1.2 s', bench/results say '+0.8 s' (run bench/report.py)",
        "README.md:2: bench:a.v: says 'met', bench/results say 'not met' (run bench/report.py)",
        f"README.md:3: bench:a.gone: no such figure (bench/report.py quoted() names {', '.join(sorted(figs))})",
        "README.md:3: bench:a.t: no figure after the marker (expected '0.84 s')",
    ]
    # rewritten as printed: the sign and the decimals kept, the unit the figure's own
    assert markers.update(text, figs).splitlines() == [
        "spends <!-- bench:a.t -->+0.8 s, gone in <!-- bench:a.r -->0.5-3.9 s;",
        "<!-- bench:a.v -->not met, of <!-- bench:a.n -->5 and <!-- bench:a.x -->8.8x faster;",
        "then <!-- bench:a.gone -->3 s and <!-- bench:a.t -->0.84 s nothing",
    ]
    assert markers.problems(markers.update(text, figs), figs)[:1] == [
        f":3: bench:a.gone: no such figure (bench/report.py quoted() names {', '.join(sorted(figs))})"]


def test_benchmarks_page_is_what_report_writes_from_the_results():
    shown = {p.name for p in (REPO / "docs").glob("bench-*.png")}
    assert (REPO / "docs" / "benchmarks.md").read_text() == report.page(report.load_all(), shown), (
        "docs/benchmarks.md is not what bench/report.py makes of bench/results: run .venv/bin/python bench/report.py")


# -- files the docs name ------------------------------------------------------------------------------
#: Relative names the docs use for what ddpfab, the user or another tool makes at run time (or for
#: things that are not files: an API group, a sysctl), not files of this repository.
ELSEWHERE = {
    "ddpfab.yml", ".ddpfab.yml", "./ddpfab.yml",  # the user's project config
    "manifest.json", "agent.json", "perf.json", "report.html", "README.txt", "pyvenv.cfg",  # run records, outputs
    "runs/", "wandb/", "__pycache__/", ".git/info/exclude", "torch/version.py", "debian/bookworm64",
    "task/affinity", "task/cgroup",  # torchrun's and Slurm's
}
#: prefixes of run-time paths: a run's records, a workdir's own records, the lab's output dir
ELSEWHERE_PREFIXES = ("runs/", ".ddpfab/", "DIR/")
#: `nvidia.com/gpu`, `kubeflow.org/v1`, `net.ipv4.neigh...`: a dotted name first, not a path
DOTTED = re.compile(r"[\w-]+\.[\w.-]+/")
NAMING = re.compile(r"\.(md|py|ya?ml|json|txt|cfg|sh|toml|png|svg|html|rst|log|ini)$")
LINK = re.compile(r"\]\(([^)\s]+)\)")
TICKED = re.compile(r"`([^`\n]+)`")
PROSE_MD = re.compile(r"(?<![\w./`-])([\w./-]*\w\.md)\b(?!`)")
#: a path of this repository in prose: a word with a slash, a file's extension, and a top-level
#: directory of the repository first (pkg/a.py in an example is the user's)
PROSE_PATH = re.compile(r"(?<![\w./~-])((?:bench|ddpfab|docs|examples|inventory|playbooks|roles|scripts|tests)"
                        r"/(?:[\w.-]+/)*[\w-]+\.(?:md|py|ya?ml|json|txt|cfg|sh|toml))\b")


def doc_files() -> list[Path]:
    roles = REPO / "ddpfab" / "ansible" / "collections" / "ansible_collections" / "ddpfab" / "cluster"
    return [REPO / "README.md", REPO / "bench" / "README.md", REPO / "bench" / "perf_gpu" / "README.md",
            *sorted((REPO / "docs").rglob("*.md")), roles / "README.md", *sorted(roles.glob("roles/*/README.md")),
            REPO / "tests" / "fixtures" / "kubeflow" / "README.md", REPO / "inventory" / "example.yml",
            roles / "galaxy.yml", roles / "changelogs" / "changelog.yaml"]


@cache
def tracked() -> tuple[frozenset[str], frozenset[str]]:
    """(tracked files, their directories), repo-relative; a symlink's own path and its target's both count."""
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    files = set(out.strip("\0").split("\0"))
    dirs = {str(parent) for f in files for parent in Path(f).parents if str(parent) != "."}
    return frozenset(files), frozenset(dirs)


def tracked_path(path: Path) -> bool:
    """Whether *path* (followed through symlinks like roles/ and playbooks/) is a tracked file or directory."""
    files, dirs = tracked()
    path = path.resolve()
    if not path.is_relative_to(REPO.resolve()):
        return False
    rel = str(path.relative_to(REPO.resolve()))
    return rel in files or rel in dirs


def in_repo(ref: str, doc: Path, link: bool = False) -> bool:
    """Whether *ref*, named in *doc*, is in the repository. A link must resolve from the doc's dir,
    as a reader's click does; a name may also be relative to the repository's root, or a tracked
    path's tail (a role README's `defaults/main.yml`, bench/README.md's `fanout.py`)."""
    ref = ref.rstrip("/").removeprefix("./")
    if tracked_path(doc.parent / ref) or link:
        return tracked_path(doc.parent / ref)
    files, dirs = tracked()
    return tracked_path(REPO / ref) or any(p == ref or p.endswith("/" + ref) for p in files | dirs)


def named(text: str, doc: Path) -> list[tuple[int, str]]:
    """(line, reference) for each file the doc names: links (`link:TARGET`), path-like backticked
    words, `*.md` in prose."""
    if doc.suffix != ".md":  # a YAML file: its comments only
        text = "\n".join(ln.split("#", 1)[1] if "#" in ln else "" for ln in text.splitlines())
    refs = []
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if fenced:  # a code block: commands and the user's own files, e.g. `inventory: inventory/cluster.yml`
            continue
        for m in LINK.finditer(line):
            refs.append((n, "link:" + m.group(1)))
        for m in TICKED.finditer(line):
            word = m.group(1)
            if re.search(r"\s|[<>{}*$=]|://", word) or word.startswith(("-", "/", "~", "http")):
                continue  # a command, a placeholder, a URL, or a path on a node
            word = word.split(":", 1)[0] if NAMING.search(word.split(":", 1)[0]) else word  # `file.py:function`
            if "/" in word or NAMING.search(word):
                refs.append((n, word))
        prose = re.sub(r"\S+://\S+", " ", TICKED.sub(" ", LINK.sub(" ", line)))
        refs += sorted({(n, m.group(1)) for pattern in (PROSE_MD, PROSE_PATH) for m in pattern.finditer(prose)})
    return refs


@cache
def generated_pages() -> dict[str, str]:
    return docs_reference.pages()


def generated_page(path: Path) -> str | None:
    """The text of the docs page the site generates at *path* (the reference, the changelog), else None."""
    docs = (REPO / "docs").resolve()
    if not path.is_relative_to(docs):
        return None
    return generated_pages().get(str(path.relative_to(docs)))


def broken(doc: Path) -> list[str]:
    out = []
    for n, ref in named(doc.read_text(), doc):
        link = ref.startswith("link:")
        ref = ref.removeprefix("link:")
        target, _, anchor = ref.partition("#")
        if (re.match(r"[a-z]+:", target) or DOTTED.match(target) or target in ELSEWHERE
                or target.startswith(ELSEWHERE_PREFIXES)):
            continue  # a URL (http:, mailto:), an API group or sysctl, or something made at run time
        page = (doc.parent / target).resolve() if target else doc
        made = generated_page(page)
        if target and made is None and not in_repo(target, doc, link):
            out.append(f"{_rel(doc)}:{n}: {ref!r} is not a file of this repository")
        elif anchor and target.endswith(".md") or (not target and anchor):
            if anchor not in anchors(made if made is not None else page.read_text()):
                out.append(f"{_rel(doc)}:{n}: {ref!r}: {_rel(page)} has no heading #{anchor}")
    return out


def anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to dashes."""
    heads = re.findall(r"^#+\s+(.+?)\s*$", markdown, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


@pytest.mark.parametrize("doc", doc_files(), ids=_rel)
def test_every_file_a_doc_names_is_in_the_repository(doc):
    assert doc.is_file()
    assert broken(doc) == []


def test_a_name_from_outside_the_repository_is_found():
    doc = REPO / "docs" / "example.md"  # not a file: broken() is given its text below
    text = ("Design notes: `DESIGN.md` in the shared folder; the lab recipe in `shared/LAB.md` (see LAB.md).\n"
            "[sync](sync.md#no-such-heading), [bench](README.md), `ddpfab/node/agent.py:watch_workers`, `fanout.py`,\n"
            "`~/.ddpfab/runs/<run-id>/`, `runs/R/manifest.json`, `/etc/hosts`, `ddpfab/nothere.py`, `K=a/b.py`.\n"
            "In prose docs/gone.md and bench/gone.py, not pkg/a.py nor https://example.org/x/README.md.\n"
            "```yaml\ninventory: inventory/cluster.yml   # `the user's.md`\n```\n")
    found = named(text, doc)
    assert {ref for _, ref in found} == {
        "DESIGN.md", "shared/LAB.md", "LAB.md", "link:sync.md#no-such-heading", "link:README.md",
        "ddpfab/node/agent.py", "fanout.py", "runs/R/manifest.json", "ddpfab/nothere.py", "docs/gone.md", "bench/gone.py"}
    bad = {ref for _, ref in found if not ref.startswith(ELSEWHERE_PREFIXES)
           and not in_repo(ref.removeprefix("link:").partition("#")[0], doc, ref.startswith("link:"))}
    # README.md is a file of the repository, but not beside docs/example.md, where the link leads
    assert bad == {"DESIGN.md", "shared/LAB.md", "LAB.md", "link:README.md", "ddpfab/nothere.py", "docs/gone.md",
                   "bench/gone.py"}
    assert "no-such-heading" not in anchors((REPO / "docs" / "sync.md").read_text())
    assert "the-no-change-re-sync-as-fast-as-before-ownership" in anchors((REPO / "docs" / "sync.md").read_text())


# -- the install section -----------------------------------------------------------------------------
def test_the_install_section_names_extras_and_a_torch_that_exist():
    text = (REPO / "README.md").read_text()
    install = text[text.index("\n## Install\n"):]
    install = install[:install.index("\n## ", 1)]
    assert text.index("\n## Quick start\n") < text.index("\n## Install\n") < text.index("\n## Using it on your machines\n")
    for route in ("pip install .", "pip wheel --no-deps -w dist .", "pip install dist/ddpfab-*.whl", "pipx install ."):
        assert route in install, route
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = re.findall(r"'\.\[(\w+)\]'", install)
    assert extras and set(extras) <= set(project["optional-dependencies"]), extras
    # the torch to install first is the one scripts/setup.sh installs, and the node extra keeps it
    pinned = re.findall(r"pip install torch==([\w.]+)", install)
    assert len(pinned) == 1 and {pinned[0]} == set(re.findall(r"\btorch==([\w.]+)",
                                                              (REPO / "scripts" / "setup.sh").read_text()))
    torch = next(Requirement(r) for r in project["optional-dependencies"]["node"] if r.startswith("torch"))
    assert torch.specifier.contains(pinned[0]), (str(torch), pinned)


def test_every_code_block_of_the_docs_is_closed():
    """An unclosed fence turns the rest of a page into code (docs/lab.md's "A lab at scale" was)."""
    pages = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md"))]
    unclosed = [p.relative_to(REPO) for p in pages
                if sum(1 for line in p.read_text().splitlines() if line.lstrip().startswith("```")) % 2]
    assert not unclosed, f"a code block left open in: {unclosed}"
