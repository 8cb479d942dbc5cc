"""The docs as pages: README.md is a front page (at most 250 lines) whose map reaches every page under docs/, and
every link between the pages (files, and #anchors to their headings) resolves, and docs/design.md's module table and
configs list are the package's. The commands on the pages are run by tests/test_readme.py."""

import pathlib
import re

import pytest

from tests import readme

ROOT = readme.ROOT
LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
  """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
  text = re.sub(r"[`*_]", "", heading.strip().lower())
  return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: pathlib.Path) -> set[str]:
  text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)  # a '#' in a code block is no heading
  return {slug(m) for m in re.findall(r"^#+ (.+)$", text, re.M)}


def links(page: pathlib.Path) -> list[str]:
  text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
  return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]  # http(s):, mailto: are not ours


def broken(page: pathlib.Path) -> list[str]:
  out = []
  for target in links(page):
    path, _, anchor = target.partition("#")
    file = (page.parent / path).resolve() if path else page
    if not file.exists():
      out.append(f"{page.relative_to(ROOT)}: {target}: no such file")
    elif anchor and file.suffix == ".md" and anchor not in anchors(file):
      out.append(f"{page.relative_to(ROOT)}: {target}: no heading '#{anchor}' in {file.relative_to(ROOT)}")
  return out


@pytest.mark.parametrize("page", readme.pages(), ids=lambda p: p.name)
def test_links_resolve(page):
  assert broken(page) == []


def test_the_link_check_finds_a_broken_link(tmp_path):
  page = tmp_path / "page.md"
  (tmp_path / "other.md").write_text("# Other page\n\n## A section\n")
  page.write_text("[ok](other.md#a-section) [no file](missing.md) [no anchor](other.md#nowhere) "
                  "![image](x.png) [web](https://example.com)\n```\n[in code](nope.md)\n```\n")
  global ROOT
  saved, ROOT = ROOT, tmp_path
  try:
    assert broken(page) == ["page.md: missing.md: no such file",
                            "page.md: other.md#nowhere: no heading '#nowhere' in other.md"]
  finally:
    ROOT = saved


def test_readme_is_a_front_page_whose_map_reaches_every_page():
  text = readme.README.read_text()
  assert len(text.splitlines()) <= 250
  linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(readme.README)}
  pages = set((ROOT / "docs").glob("*.md"))
  assert pages and {p.resolve() for p in pages} <= linked, sorted(p.name for p in pages if p.resolve() not in linked)
  for page in pages:  # and every page leads back
    assert "../README.md" in links(page), page.name


def test_slugs_match_githubs():
  assert slug("Preparing at scale: Apache Beam") == "preparing-at-scale-apache-beam"
  assert slug("Streaming raw files: `data.source=raw`") == "streaming-raw-files-datasourceraw"
  assert slug("Fine-tuning data (SFT)") == "fine-tuning-data-sft"


def test_the_exit_code_table_is_the_one_main_uses():
  from jaxtrain import exits
  text = (ROOT / "docs" / "operations.md").read_text()
  rows = re.findall(r"^\| (\d+) \| (.+?) \| (\w+) \|$", text, re.M)
  assert {int(code): meaning for code, meaning, _ in rows} == exits.CODES
  assert {int(code) for code, _, act in rows if act == "restart"} == {exits.RESTART}


def design_modules() -> list[str]:
  """The package paths docs/design.md's module table names (its second column), relative to jaxtrain/: a name with
  no folder in a cell takes the folder of the cell's first name (`models/attention.py`, `lora.py`)."""
  text = (ROOT / "docs" / "design.md").read_text()
  table = text.split("## What each module owns", 1)[1].split("\n## ", 1)[0]
  named = []
  for row in re.findall(r"^\|[^|\n]*\|([^|\n]*)\|", table, re.M):
    names = re.findall(r"`([^`]+)`", row)
    folder = names[0].rpartition("/")[0] if names and "/" in names[0].rstrip("/") else ""
    named += [n if "/" in n or not folder else f"{folder}/{n}" for n in names]
  return named


def test_the_design_pages_module_table_names_every_module_and_only_modules_that_exist():
  """docs/design.md's map stays true: every module of the package is in its module table (itself, or its folder:
  `data/`), every name there is a module or folder that exists, and its list of configs is configs/."""
  package = ROOT / "jaxtrain"
  named = design_modules()
  missing = [n for n in named if not (package / n).exists()]
  assert not missing, f"docs/design.md's module table names what does not exist: {missing}"
  files = [p.relative_to(package).as_posix() for p in package.rglob("*.py") if p.name != "__init__.py"]
  unlisted = [f for f in files if f not in named and not any(n.endswith("/") and f.startswith(n) for n in named)]
  assert not unlisted, f"modules docs/design.md's module table does not name: {unlisted}"
  listed = re.search(r"^configs/ +(.+?)\n(?=\S)", (ROOT / "docs" / "design.md").read_text(), re.M | re.S)
  assert listed, "docs/design.md lists no configs/"
  assert sorted(re.findall(r"\w+", listed.group(1))) == sorted(p.stem for p in (ROOT / "configs").glob("[!_]*.py"))
