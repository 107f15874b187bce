"""The README's, docs/' and the changelog's relative links lead somewhere: every linked file exists
in the checkout and every #anchor names a heading of the linked page (GitHub's slugs)."""

from __future__ import annotations

import re

import pytest

from attnd_process import ROOT

PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # no headings in code
    return {_slug(m) for m in re.findall(r"^#+\s+(.*)$", text, re.M)}


def _links(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return [m for m in LINK.findall(text) if not re.match(r"[a-z]+://|mailto:", m)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    links = _links(page)
    for link in links:
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        assert target.exists(), f"{page.name}: {link} -> {target} does not exist"
        if anchor and target.suffix == ".md":
            assert anchor in _anchors(target), f"{page.name}: {link}: no heading #{anchor}"


def test_the_check_can_fail():
    assert _slug("The Helm chart") == "the-helm-chart"
    assert _slug("`attnd --help`: flags") == "attnd---help-flags"
    assert "the-helm-chart" in _anchors(ROOT / "docs" / "lifecycle.md")
    assert any("lifecycle.md" in link for link in _links(ROOT / "README.md"))
