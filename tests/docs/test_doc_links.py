"""Every relative link of README.md and docs/*.md reaches a file, and its ``#anchor`` a heading there
(anchors as GitHub makes them), so a renamed heading cannot leave a link dangling."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but ``-`` and ``_`` dropped, spaces to
    ``-``; a repeated anchor gets ``-1``, ``-2``, ..."""
    seen: dict[str, int] = {}
    found = set()
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
    for heading in re.findall(r"^#+ (.+?)\s*$", text, re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def links(page: Path) -> list[tuple[str, str]]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
    return [(target.partition("#")[0], target.partition("#")[2]) for target in LINK.findall(text)
            if not re.match(r"[a-z]+:", target)]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(REPO).as_posix())
def test_every_relative_link_reaches_its_file_and_heading(page: Path) -> None:
    broken = []
    for path, anchor in links(page):
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{path}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{path}#{anchor}: no such heading")
    assert not broken, broken
