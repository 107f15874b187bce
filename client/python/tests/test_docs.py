"""The README's, docs/' and the changelog's relative links lead somewhere: every linked file exists
in the checkout and every #anchor names a heading of the linked page (GitHub's slugs)."""

from __future__ import annotations

import re
import shutil
import subprocess

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


def test_every_release_names_the_commit_that_set_its_version():
    """The CHANGELOG once named a tag no clone had; each release now names its commit, which must
    exist in this checkout's history and carry that version in CMakeLists.txt."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    text = (ROOT / "CHANGELOG.md").read_text()
    releases = re.findall(r"^## (\d+\.\d+\.\d+)\b(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert len(releases) >= 2, "the CHANGELOG lists no releases"
    for version, body in releases:
        m = re.search(r"\b[Cc]ommit ([0-9a-f]{7,40})\b", body)
        assert m, f"{version}: name the commit of the release"
        r = subprocess.run(["git", "-C", str(ROOT), "show", f"{m.group(1)}:CMakeLists.txt"],
                           capture_output=True, text=True)
        if r.returncode != 0 and "shallow" in subprocess.run(
                ["git", "-C", str(ROOT), "rev-parse", "--is-shallow-repository"],
                capture_output=True, text=True).stdout.replace("true", "shallow"):
            pytest.skip("a shallow clone lacks the release commits")
        assert r.returncode == 0, f"{version}: commit {m.group(1)} is not in this history"
        assert re.search(rf"project\(attnd VERSION {re.escape(version)}\b", r.stdout), \
            f"{version}: commit {m.group(1)} does not carry that version"
