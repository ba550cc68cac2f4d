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
