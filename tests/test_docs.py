"""The README and docs/ stay true to the code: in-process, no runs.

docs/architecture.md names every fsdp_zero/*.py module and no other; the README stays short and
links every docs/ page; every relative link (and #anchor) in them resolves; and the blocks that
scripts/docs.py generates (the config reference, the DeepSpeed key table) are current.

Covers: fsdp_zero/config/schema.py, fsdp_zero/config/deepspeed.py
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import shutil
from pathlib import Path

import pytest

from tests.conftest import REPO

DOCS = REPO / "docs"
README = REPO / "README.md"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _docs_script():
    spec = importlib.util.spec_from_file_location("_docs_script", REPO / "scripts" / "docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code, where neither links nor headings live."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors for the headings of ``page``: lower case, punctuation dropped, spaces as hyphens."""
    seen: dict[str, int] = {}
    anchors = set()
    for line in re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M).splitlines():
        if m := re.match(r"#{1,6} (.*)", line):
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


def _links(page: Path) -> list[str]:
    return [t for t in _LINK.findall(_prose(page.read_text())) if not re.match(r"[a-z]+:", t)]


def test_the_architecture_tables_name_every_module_under_its_subpackage():
    text = (DOCS / "architecture.md").read_text()
    named, misplaced, heading = set(), [], None
    for line in text.splitlines():
        if line.startswith("### "):
            # "": the root
            heading = m.group(1) if (m := re.match(r"### `fsdp_zero/(\w+)/`", line)) else ""
        elif (m := re.match(r"\| `(fsdp_zero/[^`]*)` \|", line)) and heading is not None:
            cell = m.group(1)
            assert re.fullmatch(r"fsdp_zero/(\w+/)?\w+\.py", cell), (
                f"docs/architecture.md: one module per row, not {cell}"
            )
            named.add(cell)
            if cell.count("/") != (2 if heading else 1) or (
                heading and not cell.startswith(f"fsdp_zero/{heading}/")
            ):
                misplaced.append(cell)
    modules = {
        p.relative_to(REPO).as_posix()
        for p in (REPO / "fsdp_zero").rglob("*.py")
        if p.name != "__init__.py" or p.parent.name == "fsdp_zero"
    }
    assert not modules - named, f"docs/architecture.md: add a row for {sorted(modules - named)}"
    assert not named - modules, (
        f"docs/architecture.md names modules that do not exist: {sorted(named - modules)}"
    )
    assert misplaced == [], "docs/architecture.md: rows under another subpackage's heading"


def test_the_readme_is_short_and_links_every_docs_page():
    lines = README.read_text().count("\n")
    assert lines < 200, f"README.md has {lines} lines; move detail into docs/"
    linked = {t.split("#")[0] for t in _links(README) if t.startswith("docs/")}
    pages = {f"docs/{p.name}" for p in DOCS.glob("*.md")}
    assert not linked - pages, f"README.md links pages that do not exist: {sorted(linked - pages)}"
    assert not pages - linked, f"README.md does not link {sorted(pages - linked)}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_resolves(page):
    for target in _links(page):
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        assert resolved.exists(), f"{page.relative_to(REPO)}: link {target!r}: no such file"
        if anchor:
            assert resolved.suffix == ".md", (
                f"{page.relative_to(REPO)}: link {target!r}: an anchor into a non-page"
            )
            assert anchor in _anchors(resolved), (
                f"{page.relative_to(REPO)}: link {target!r}: no such heading; "
                f"{resolved.name} has {sorted(_anchors(resolved))}"
            )


def test_the_generated_blocks_are_current():
    assert _docs_script().main(["--check"]) == 0, "run `make docs` (python scripts/docs.py)"


def test_a_stale_block_is_named(tmp_path):
    docs = _docs_script()
    shutil.copytree(DOCS, tmp_path / "docs")
    page = tmp_path / "docs" / "deepspeed.md"
    page.write_text(page.read_text().replace("| `train_batch_size` |", "| `train_batch_sizes` |"))
    assert docs.update(tmp_path / "docs", write=False) == [
        "docs/deepspeed.md: block 'deepspeed-keys' is stale"
    ]
    assert docs.update(tmp_path / "docs") and docs.update(tmp_path / "docs", write=False) == []
    assert page.read_text() == (DOCS / "deepspeed.md").read_text()


@dataclasses.dataclass
class _Section:
    """A section as config.py writes one, with a method after its fields."""

    # Above, on two lines
    # of comment.
    first: int = 1  # and beside it
    second: str = "x"
    # parted from `third` by a blank line

    third: bool = False

    def check(self) -> None:
        # inside a method: no field's comment
        local: int = 2  # nor this
        del local

    # a field after the method
    fourth: float = 0.5


def test_field_comments_come_from_the_source_beside_each_field():
    comments = _docs_script().source_comments(_Section)
    assert comments == {
        "first": "Above, on two lines of comment. and beside it",
        "second": "",
        "third": "",
        "fourth": "a field after the method",
    }
    assert "inside a method" not in str(comments)


def test_the_config_reference_has_every_key_once():
    from fsdp_zero.config.schema import Config

    def keys(cls: type, prefix: str) -> list[str]:
        out = []
        for f in dataclasses.fields(cls):
            kind = f.default_factory  # a section's sub-section: field(default_factory=WrapConfig)
            if dataclasses.is_dataclass(kind):
                out += keys(kind, f"{prefix}{f.name}.")
            else:
                out.append(f"{prefix}{f.name}")
        return out

    reference = _docs_script().config_reference()
    for key in keys(Config, ""):
        assert reference.count(f"| `{key}` |") == 1, key
