"""The docs as pages: README.md is a front page (at most 250 lines) whose map reaches every page under docs/, and
every link between the pages (files, and #anchors to their headings) resolves, and docs/design.md's module table and
configs list are the package's. The commands on the pages are run by tests/test_readme.py."""

import os
import pathlib
import re
import subprocess
import sys

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
  assert len(text.splitlines()) <= 120
  linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(readme.README)}
  pages = set((ROOT / "docs").glob("*.md")) | set((ROOT / "docs" / "recipes").glob("*.md"))
  assert pages and {p.resolve() for p in pages} <= linked, sorted(p.name for p in pages if p.resolve() not in linked)
  for page in pages:  # and every page leads back
    assert os.path.relpath(readme.README, page.parent) in links(page), page.name


def test_the_benchmark_notes_are_linked_once_from_the_user_docs_and_their_links_resolve():
  """The measurement history (benchmarks/NOTES.md) is reachable from one place, docs/benchmarks.md."""
  linking = [(page.name, t) for page in readme.pages() for t in links(page)
             if (page.parent / t.partition("#")[0]).resolve() == NOTES.resolve()]
  assert [name for name, _ in linking] == ["benchmarks.md"], linking
  assert broken(NOTES) == []


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


# --- Every command the pages quote, checked against the tools' real flags and the config's real keys. ---------------

NOTES = ROOT / "benchmarks" / "NOTES.md"  # the benchmarks' history: linked once, its links checked, no rules on words
ABSL_BUILTIN = {"helpfull", "helpshort", "help", "flagfile", "logtostderr", "alsologtostderr", "v", "verbosity"}
ENV = r"(?:[A-Z_][A-Z0-9_]*=\S+\s+)*"  # VAR=value prefixes
COMMAND = re.compile(rf"^{ENV}(?:python3? |tools/|sbatch |bash tools/)")


def command_lines(text: str) -> list[str]:
  """Every command a page shows: its fenced ```bash lines (as tests/readme.py reads them), its indented code blocks'
  lines, and its inline code spans that start like a command (``python ...``, ``tools/...``, ``sbatch ...``, with
  ``VAR=value`` prefixes); spans may wrap lines. Other fenced blocks (```text: syntax, not commands) are skipped."""
  found = list(readme.commands(text))
  prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
  for block in re.findall(r"(?:^|\n\n)((?:    .*\S.*(?:\n|$))+)", prose):  # indented code blocks
    for line in re.sub(r"\\\n\s*", "", block).splitlines():
      line = re.sub(r"\s+#.*$", "", line).strip()
      if COMMAND.match(line) or line.startswith("for "):
        found.append(line)
  for span in re.findall(r"`([^`]+)`", re.sub(r"^    \S.*$", "", prose, flags=re.M)):
    for part in re.split(r"\s*(?:&&|\|\||;)\s*", " ".join(span.split())):  # each command of `a && b`
      if COMMAND.match(part):
        found.append(part)
  return found


def tool_flags(path: pathlib.Path) -> set[str]:
  """The flags a tool defines: absl's ``flags.DEFINE_*("name"`` (config_flags' too) and argparse's
  ``add_argument("--name"``, read from its source."""
  source = path.read_text()
  absl = set(re.findall(r"DEFINE_\w+\(\s*\"(\w+)\"", source))
  return absl | set(re.findall(r"add_argument\(\s*\"--(\w+)\"", source)) | ABSL_BUILTIN


_CONFIGS: dict[str, object] = {}


def config_for(spec: str | None):
  """The config a command names (``configs/x.py[:variant]``), or base_config() for one that is not in the repository
  (a file the user's own import wrote, a placeholder)."""
  from jaxtrain import config as config_lib
  spec = spec or ""
  path = spec.partition(":")[0]
  if spec not in _CONFIGS:
    _CONFIGS[spec] = (config_lib.load_file(str(ROOT / spec)) if path and (ROOT / path).is_file()
                      else config_lib.base_config())
  return _CONFIGS[spec]


def unknown_key(key: str, spec: str | None) -> bool:
  import ml_collections
  node = config_for(spec)
  for part in key.split("."):
    if not isinstance(node, ml_collections.ConfigDict) or part not in node:
      return True
    node = node[part]
  return False


def check_command(line: str) -> list[str]:
  """What is wrong with one command: an unknown tool or file, a flag the tool does not define, a config key the
  named config does not have; a TPU launcher command without CONFIG=."""
  m = re.match(r"for \w+ in [^;]+; do (.+?); done$", line)
  if m:
    line = m.group(1)
  line = line.split(" | ")[0].split(" && ")[-1]
  line = re.sub(r"\s+2>&1\b.*$", "", line)
  if not COMMAND.match(line):
    return []  # pip, gcloud, sacct, tail: not this repository's
  if len(line.split()) <= 2 and "..." in line:
    return []  # a placeholder: `python ...`, `tools/...`
  env = dict(re.findall(r"([A-Z_][A-Z0-9_]*)=(\S+)\s+", re.match(ENV, line).group(0)))
  words = re.sub(r"[\[\]]", "", line[re.match(ENV, line).end():]).split()
  words = [w for w in words if w not in ("...", "|")]
  if words[0] in ("python", "python3"):
    words = words[1:]
  elif words[0] == "sbatch":
    words = words[1:]
    while words and words[0].startswith("-"):  # sbatch's own options come before the script
      words = words[1:]
  elif words[0] == "bash":
    words = words[1:]
  if words[:2] == ["-m", "pytest"]:
    return [f"{w}: no such test file" for w in words[2:] if w.startswith("tests/") and not (ROOT / w).exists()]
  if words[0] == "-m":
    module, args = words[1], words[2:]
    source = ROOT / (module.replace(".", "/") + ".py")
  else:
    source, args = ROOT / words[0], words[1:]
  if not source.exists():
    return [f"{words[0]}: no such tool"]
  if source.is_dir() or not args and not env and words[0] != "-m" or source.suffix == ".yaml":
    return []  # a folder or a file named, not run
  if "--" in args:
    args = args[:args.index("--")]  # what follows goes to another program (maxtext_step.py)
  errors = []
  if source.suffix in (".sh", ".sbatch"):  # the launchers: CONFIG WORKDIR [jaxtrain.main flags] or CONFIG= env
    if source.name == "tpu_vm.sh":
      if "CONFIG" not in env:
        errors.append("tools/launch/tpu_vm.sh without CONFIG=: it would train configs/llama3_8b.py")
      spec = env.get("CONFIG")
      read = set(re.findall(r"\$\{?([A-Z_][A-Z0-9_]*)", source.read_text()))
      errors += [f"tools/launch/tpu_vm.sh reads no {k}" for k in env if k not in read]
    else:
      positional = [a for a in args if not a.startswith("--")]
      spec = positional[0] if positional else None
      if spec and not (ROOT / spec.partition(":")[0]).is_file() and spec.startswith("configs/"):
        errors.append(f"{spec}: no such config")
    source, flags = ROOT / "jaxtrain" / "main.py", tool_flags(ROOT / "jaxtrain" / "main.py")
  else:
    flags = tool_flags(source)
    spec = next((a.split("=", 1)[1] for a in args if a.startswith("--config=")), None)
  for arg in args:
    if not arg.startswith("--"):
      continue
    name, _, value = arg[2:].partition("=")
    if name.startswith("config.") and source == ROOT / "jaxtrain" / "main.py":
      key = name[len("config."):]
      if unknown_key(key, spec):
        errors.append(f"--config.{key}: no such config key")
    elif name not in flags:
      errors.append(f"--{name}: {source.relative_to(ROOT)} has no such flag")
    elif name in ("set", "config_value") and value:
      key = value.split("=", 1)[0]
      if unknown_key(key, spec):
        errors.append(f"--{name}={key}: no such config key")
  return errors


def command_errors(pages) -> list[str]:
  return [f"{page.relative_to(ROOT)}: `{line}`: {error}" for page in pages
          for line in command_lines(page.read_text()) for error in check_command(line)]


def test_every_command_on_the_pages_uses_real_flags_and_keys():
  assert command_errors(readme.pages()) == []


def test_the_command_check_finds_an_unknown_flag_a_missing_config_and_an_unknown_key(tmp_path):
  page = tmp_path / "page.md"
  page.write_text(
      "Size it: `python tools/estimate.py --config=configs/llama3_8b.py --devices=64 --set=mesh.context=4`, then\n"
      "`python tools/bench_topology.py --set=mesh.context=4` and `pip install -e . && python -m jaxtrain.main\n"
      "--config=configs/tiny.py --config.train.stepz=3`, on a pod\n"
      "`TPU_NAME=a ZONE=b PROJECT=c WORKDIR=gs://d tools/launch/tpu_vm.sh`.\n\n"
      "    python tools/nothing.py --x=1\n\n"
      "```bash\nsbatch --nodes=2 tools/launch/slurm.sbatch configs/tiny.py runs/x --config.optim.lrr=1\n```\n")
  errors = [f"{line}: {error}" for line in command_lines(page.read_text()) for error in check_command(line)]
  text = "\n".join(errors)
  assert "--set: tools/bench_topology.py has no such flag" in text
  assert "--config.train.stepz: no such config key" in text
  assert "tools/launch/tpu_vm.sh without CONFIG=" in text
  assert "tools/nothing.py: no such tool" in text
  assert "--config.optim.lrr: no such config key" in text
  assert not any("estimate.py" in e for e in errors), errors  # a real command passes
  assert len(errors) == 5, errors



# --- Words of the project's development, figures in one place, references from the code. ---------------------------

HISTORY = re.compile(r"this round|latest round|previous round|the round before|issue's bound|\(issue:|"
                     r"earlier stretch|stretch of work|previous session|earlier session|this session|"
                     r"a commit before the latest|at the latest commit", re.I)


def history_words(page: pathlib.Path) -> list[str]:
  text = page.read_text()
  return [f"{page.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}: '{m.group(0)}'"
          for m in HISTORY.finditer(text)]


def test_no_words_of_the_projects_development_in_the_user_docs():
  """User docs speak to users in the present tense; history belongs in benchmarks/NOTES.md or the git log."""
  assert [w for page in readme.pages() for w in history_words(page)] == []


def test_the_history_check_finds_development_words(tmp_path):
  page = tmp_path / "docs" / "p.md"
  page.parent.mkdir()
  page.write_text("Fast.\nThis round made it faster (the issue's bound: 1.2x; issue: TPU performance).\n")
  global ROOT
  saved, ROOT = ROOT, tmp_path
  try:
    assert history_words(page) == ["docs/p.md:2: 'This round'", "docs/p.md:2: 'issue's bound'"]
  finally:
    ROOT = saved


TESTING = ROOT / "docs" / "testing.md"
# The suite's size and times: stated in docs/testing.md and nowhere else.
SUITE_FIGURES = re.compile(r"\b\d[\d,]{2,} tests\b|\b\d+m\d{2}s\b|\b\d+ s (?:cold|of it the suite)|"
                           r"\b\d+ tests collected|fast tier is \d+|not slow\W+\d+ s")
# The estimator's accuracy against the TPU compiler: one value wherever it is quoted, tools/estimate.py's docstring
# included, and the bound tests/test_tpu_compile.py holds it to.
ESTIMATOR_ACCURACY = re.compile(r"within (\d+(?:\.\d+)?)% of the (?:TPU )?compiler|compiler reports, within "
                                r"(\d+(?:\.\d+)?)%")


def suite_figures_outside_testing(sources: dict[str, str]) -> list[str]:
  return [f"{name}: '{m.group(0)}' (the suite's figures live in docs/testing.md only)"
          for name, text in sources.items() if name != "docs/testing.md" for m in SUITE_FIGURES.finditer(text)]


def estimator_accuracy(sources: dict[str, str]) -> dict[str, set[str]]:
  """value -> where it is quoted."""
  found: dict[str, set[str]] = {}
  for name, text in sources.items():
    for m in ESTIMATOR_ACCURACY.finditer(" ".join(text.split())):
      found.setdefault(m.group(1) or m.group(2), set()).add(name)
  return found


def figure_sources() -> dict[str, str]:
  sources = {page.relative_to(ROOT).as_posix(): page.read_text() for page in readme.pages()}
  sources["tools/estimate.py"] = (ROOT / "tools" / "estimate.py").read_text()
  return sources


def test_each_figure_is_quoted_in_one_place_or_with_one_value():
  sources = figure_sources()
  assert suite_figures_outside_testing(sources) == []
  assert SUITE_FIGURES.search(sources["docs/testing.md"]), "docs/testing.md states no suite figures"
  accuracy = estimator_accuracy(sources)
  assert len(accuracy) == 1, f"the estimator's accuracy is quoted with different values: {accuracy}"
  bound = re.search(r'figures\["total"\] == pytest.approx\(figures\["compiled_peak"\], rel=([\d.]+)\)',
                    (ROOT / "tests" / "test_tpu_compile.py").read_text())
  assert bound and {f"{100 * float(bound.group(1)):g}"} == set(accuracy), (accuracy, bound)


def test_the_figure_check_finds_a_stale_figure():
  sources = {"docs/testing.md": "Size: 608 tests.", "README.md": "The suite: 530 tests, 721 s cold.",
             "docs/a.md": "The estimator is within 5% of the TPU compiler.",
             "tools/estimate.py": "the peak the TPU compiler reports, within 15%"}
  assert suite_figures_outside_testing(sources) == [
      "README.md: '530 tests' (the suite's figures live in docs/testing.md only)",
      "README.md: '721 s cold' (the suite's figures live in docs/testing.md only)"]
  assert estimator_accuracy(sources) == {"5": {"docs/a.md"}, "15": {"tools/estimate.py"}}


def _whole_suite_collected(session) -> bool:
  """Whether this pytest session collected every test of tests/ (the suite's own run: each xdist worker collects
  all of it) with none deselected (-k, -m, --deselect)."""
  files = {item.path for item in session.items}
  return (not session.config.getoption("keyword") and not session.config.getoption("markexpr")
          and not session.config.getoption("deselect")
          and files == {p for p in (ROOT / "tests").glob("test_*.py")})


@pytest.mark.slow  # collects the whole suite where this run has not: seconds
def test_the_stated_test_count_is_the_collected_one(request):
  """docs/testing.md's count of tests is pytest's, within 10% (tests come and go between measurements)."""
  stated = int(re.search(r"Size: (\d[\d,]*) tests", TESTING.read_text()).group(1).replace(",", ""))
  if _whole_suite_collected(request.session):
    collected = len(request.session.items)
  else:
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-p", "no:randomly",
                             str(ROOT / "tests")], capture_output=True, text=True, timeout=300, cwd=ROOT)
    collected = int(re.search(r"^(\d+) tests? collected", result.stdout, re.M).group(1))
  assert abs(collected - stated) <= 0.1 * stated, f"docs/testing.md says {stated} tests; pytest collects {collected}"


CODE_REFERENCE = re.compile(r"((?:docs/[\w/]+|benchmarks/NOTES)\.md)(#[\w-]+)?(?:,?\s*(?:#\s*)?\"([^\"\n]+)\")?")


def code_reference_errors(files, root: pathlib.Path = ROOT) -> list[str]:
  """A page a comment or docstring cites must exist; an #anchor or a quoted "Section" after it must be one of its
  headings (a quoted section: the start of one, ignoring case)."""
  errors = []
  for file in files:
    text = file.read_text()
    for m in CODE_REFERENCE.finditer(text):
      page, anchor, section = ROOT / m.group(1), m.group(2), m.group(3)
      where = f"{file.relative_to(root)}: {m.group(0)!r}"
      if not page.is_file():
        errors.append(f"{where}: no such page")
        continue
      headings = re.findall(r"^#+ (.+)$", re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M), re.M)
      if anchor and anchor[1:] not in anchors(page):
        errors.append(f"{where}: no heading '{anchor}'")
      if section and not any(h.lower().startswith(section.lower()) for h in headings):
        errors.append(f"{where}: no section \"{section}\"")
  return errors


def test_the_pages_the_code_cites_exist_with_the_sections_named():
  files = [p for folder in ("jaxtrain", "tools", "configs", "tests") for p in sorted((ROOT / folder).rglob("*"))
           if p.suffix in (".py", ".sh", ".sbatch", ".yaml") and p.name != "test_docs.py"]
  assert code_reference_errors(files) == []


def test_the_code_reference_check_finds_a_missing_section(tmp_path):
  scratch = tmp_path / "x.py"
  scratch.write_text('see docs/benchmarks.md "Defaults per target" and docs/nothing.md, docs/benchmarks.md#nowhere, '
                     'docs/benchmarks.md "TPU: defaults per target", benchmarks/NOTES.md, "The TPU step"')
  errors = code_reference_errors([scratch], tmp_path)
  assert [e.split(": ", 2)[2] for e in errors] == ['no section "Defaults per target"', "no such page",
                                                   "no heading '#nowhere'"], errors
