"""The documentation points only at files the repository holds.

A user has the repository and nothing beside it: every relative link in the
Markdown files must resolve to a file inside the checkout (and its #anchor to
a heading there), no text may reach out of it with ../, every *.md file named
must exist in it, and every repository path written in backticks must exist,
so a moved or renamed file cannot leave the docs pointing at nothing.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Not the repository's: tools' own folders (a cache's README.md is theirs,
# and present only once the tool ran, which changed the set of tests).
SKIPPED_DIRS = {
    ".git",
    ".venv",
    "build",
    "test-artifacts",
    "node_modules",
    ".tierckpt",
    ".pytest_cache",
    ".hypothesis",
    ".mypy_cache",
    ".ruff_cache",
}
# Top-level folders whose paths the docs name in backticks.
TOP_LEVEL = ("service", "client", "migrations", "tests", "benchmarks", "examples", "deploy", "docs")
# Written by the tools, not kept in the repository.
GENERATED = {"benchmarks/results/latest.json"}

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
PARENT_PATH = re.compile(r"(?:\.\./)+[\w.-][\w./-]*")
MD_NAME = re.compile(r"[\w./-]*\b[\w-]+\.md\b")
BACKTICKED_PATH = re.compile(r"`((?:" + "|".join(TOP_LEVEL) + r")/[^`\s]*)`")
PLACEHOLDER = re.compile(r"[*{}<>…]|\bNAME\b")


def files(*patterns: str) -> Iterator[Path]:
    for pattern in patterns:
        for path in sorted(ROOT.glob(pattern)):
            relative = path.relative_to(ROOT)
            if path.is_file() and not SKIPPED_DIRS & set(relative.parts):
                yield path


MARKDOWN = sorted(set(files("*.md", "**/*.md")))
# Text a user reads beside the Markdown: deployment files and examples.
OTHER_TEXT = sorted(set(files("deploy/**/*", "examples/**/*", "Dockerfile", "*.yml")))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, flags=re.M)}


def inside(path: Path) -> bool:
    return path.resolve().is_relative_to(ROOT)


def test_the_documentation_set_is_found() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in MARKDOWN}
    assert {"README.md", "docs/API.md", "docs/configuration.md"} <= names


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve_inside_the_repository(path: Path) -> None:
    broken = []
    for target in LINK.findall(path.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part) if file_part else path
        if not inside(resolved) or not resolved.is_file():
            broken.append(f"{target}: no such file in the repository")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading #{anchor} in {file_part or path.name}")
    assert broken == []


@pytest.mark.parametrize(
    "path", MARKDOWN + OTHER_TEXT, ids=lambda p: p.relative_to(ROOT).as_posix()
)
def test_no_path_leads_out_of_the_repository(path: Path) -> None:
    text = path.read_text(errors="replace")
    outside = [m for m in PARENT_PATH.findall(text) if not inside(path.parent / m)]
    assert outside == [], f"{path.name} names files outside the repository"
    known = {p.name for p in MARKDOWN}
    unknown = sorted({m for m in MD_NAME.findall(text) if Path(m).name not in known})
    assert unknown == [], f"{path.name} names Markdown files the repository does not have"


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_repository_paths_in_backticks_exist(path: Path) -> None:
    missing = []
    for written in BACKTICKED_PATH.findall(path.read_text()):
        clean = written.split("#")[0].rstrip("/.,:;")
        if PLACEHOLDER.search(clean) or clean in GENERATED:
            continue
        if not (ROOT / clean).exists():
            missing.append(written)
    assert missing == []
