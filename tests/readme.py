"""The commands README.md and the pages under docs/ (and docs/recipes/) show a user typing: every line of their
fenced ```bash blocks (backslash continuations joined, trailing ``# comments`` dropped). Tests run them as
written, so the docs cannot drift from the code.

Standard library only: ``.ci/run`` calls ``python3 tests/readme.py test-command`` before anything is installed
and runs what it prints, so CI runs exactly the README's test command.
"""

from __future__ import annotations

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def pages() -> list[pathlib.Path]:
  """README.md, then every page under docs/ and docs/recipes/."""
  return [README] + sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "docs" / "recipes").glob("*.md"))


def commands(text: str | None = None) -> list[str]:
  """The commands of ``text``; by default, of every page."""
  if text is None:
    return [c for page in pages() for c in commands(page.read_text())]
  found = []
  for block in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M):
    for line in re.sub(r"\\\n\s*", "", block).splitlines():
      line = re.sub(r"\s+#.*$", "", line).strip()
      if line and not line.startswith("#"):
        found.append(line)
  return found


def command(containing: str) -> str:
  """The one command of the README and docs/ pages that contains ``containing``."""
  matches = [c for c in commands() if containing in c]
  if len(matches) != 1:
    raise LookupError(f"README.md and docs/ have {len(matches)} commands containing {containing!r}: {matches}")
  return matches[0]


def quick_start() -> tuple[str, str]:
  """(install and train, install and test): the two commands of the Quick start section."""
  section = README.read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
  train, test = commands(section)[:2]
  return train, test


if __name__ == "__main__":
  if sys.argv[1:] != ["test-command"]:
    sys.exit("usage: python3 tests/readme.py test-command")
  print(quick_start()[1])
