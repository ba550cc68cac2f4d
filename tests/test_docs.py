"""The docs stay true: docs/SETTINGS.md is what `shardconsole settings --markdown` writes from the settings
tables, README links every page of docs/, and every relative link of README and docs/ names a file
that exists. (Their commands run in tests/test_readme_examples.py.)"""

from __future__ import annotations

import re

from conftest import REPO, shardconsole

DOCS = REPO / "docs"


def test_the_settings_reference_is_what_the_settings_command_writes():
    res = shardconsole("settings", "--markdown")
    assert res.returncode == 0, res.stderr
    committed = (DOCS / "SETTINGS.md").read_text()
    assert committed == res.stdout, (
        "docs/SETTINGS.md differs from the settings tables: run `shardconsole settings --markdown > docs/SETTINGS.md`")
    # every key `--set` takes is in it, in its own row
    from shardconsole.settings import config as C
    from dataclasses import fields
    for table, cls in C.TABLES.items():
        for f in fields(cls):
            assert f"| `{table}.{f.name}` |" in committed, f"{table}.{f.name}"


def test_the_settings_markdown_refuses_a_preset():
    res = shardconsole("settings", "--markdown", "--preset", "tiny-cpu")
    assert res.returncode == 2 and "--markdown" in res.stderr and "Traceback" not in res.stderr


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
ANCHORED = re.compile(r"\]\(([^)#\s]*)#([^)\s]+)\)")


def _anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces to dashes."""
    heads = re.findall(r"^#{1,6} (.+)$", re.sub(r"^```.*?^```", "", text, flags=re.M | re.S), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_readme_links_every_page_of_docs_and_every_link_resolves():
    readme = (REPO / "README.md").read_text()
    linked = set(LINK.findall(readme))
    pages = sorted(p.relative_to(REPO).as_posix() for p in DOCS.glob("*.md"))
    assert not [p for p in pages if p not in linked], "docs pages README does not link"
    broken = []
    for doc in [REPO / "README.md", *DOCS.glob("*.md")]:
        for target in LINK.findall(doc.read_text()):
            if re.match(r"[a-z]+:", target):       # http(s): not checked here (no network)
                continue
            if not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(REPO)} -> {target}")
        for target, anchor in ANCHORED.findall(doc.read_text()):
            page = doc.parent / target if target else doc
            if page.suffix == ".md" and page.exists() and anchor not in _anchors(page.read_text()):
                broken.append(f"{doc.relative_to(REPO)} -> {target}#{anchor}")
    assert not broken, broken


def test_the_readme_is_a_guide_of_at_most_300_lines():
    assert len((REPO / "README.md").read_text().splitlines()) <= 300


PAGES = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")


def test_every_code_fence_is_closed():
    """An open fence renders the rest of the page as code (docs/TUNE.md did, issue 65)."""
    open_at = []
    for page in PAGES:
        fence, line_no = None, 0
        for i, line in enumerate(page.read_text().splitlines(), 1):
            m = FENCE.match(line)
            if m is None:
                continue
            mark = m.group(1)
            if fence is None:
                fence, line_no = mark, i
            elif mark[0] == fence[0] and len(mark) >= len(fence) and not line.strip()[len(mark):]:
                fence = None
        if fence is not None:
            open_at.append(f"{page.relative_to(REPO)}:{line_no}")
    assert not open_at, f"code fences opened and never closed: {open_at}"


def test_help_names_every_subcommand():
    from shardconsole.cli import main
    main._register_optional()
    res = shardconsole("--help")
    assert res.returncode == 0, res.stderr
    text = " ".join(res.stdout.split())      # argparse wraps the description
    missing = [name for name in main.SUBCOMMANDS if not re.search(rf"[ ,]{re.escape(name)}[ ,(]", text)]
    assert not missing, f"`shardconsole --help` leaves out {missing}"


PACKAGES = sorted(p.name for p in (REPO / "shardconsole").iterdir() if p.is_dir() and not p.name.startswith("_"))
# a repo path (shardconsole/..., tests/..., docs/...), or a file path under the package (backends/engine/loop.py)
REPO_PATH = re.compile(r"(?<![\w./-])((?:shardconsole|tests|docs|benchmarks|scripts|presets)/[\w./*-]*[\w*])")
PACKAGE_FILE = re.compile(r"(?<![\w./-])((?:%s)/[\w./-]*\.(?:py|md|toml|json|sh))\b" % "|".join(PACKAGES))


def test_every_path_the_docs_name_exists():
    """docs/ARCHITECTURE.md named four files that had been gone for months (issue 65)."""
    missing = []
    for page in PAGES:
        text = page.read_text()
        for path in REPO_PATH.findall(text):
            path = path.rstrip(".")
            if not (list(REPO.glob(path)) if "*" in path else (REPO / path).exists()):
                missing.append(f"{page.relative_to(REPO)}: {path}")
        for path in PACKAGE_FILE.findall(text):
            if not (REPO / "shardconsole" / path).exists() and not (REPO / path).exists():
                missing.append(f"{page.relative_to(REPO)}: {path} (under shardconsole/)")
    assert not missing, missing


MODULE = re.compile(r"`([\w-]+\.py)`")
OTHER_PROJECTS = {"zero_to_fp32.py"}       # DeepSpeed's script, written into its checkpoints


def test_every_module_the_docs_name_by_file_name_exists():
    """A module named bare (`trainstate.py`) is a file of the repo: the Ranks section named offload.py and
    offload_overlap.py long after they became backends/offload/ (issue 65)."""
    ours = {p.name for d in ("shardconsole", "tests", "benchmarks", "scripts") for p in (REPO / d).rglob("*.py")}
    missing = [f"{page.relative_to(REPO)}: {name}" for page in PAGES for name in MODULE.findall(page.read_text())
               if name not in ours | OTHER_PROJECTS]
    assert not missing, missing
