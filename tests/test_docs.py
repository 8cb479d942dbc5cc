"""The docs as pages: README.md is a front page (at most 120 lines) whose map reaches every page under docs/, and
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
                     r"a commit before the latest|at the latest commit|"
                     # a statement dated by the project's own past: what was, what changed, what is now
                     r"\bno longer\b|\bused to\b|\bpreviously\b|\bat first\b|\bwe (?:added|fixed|changed)\b|"
                     r"\bnew:|\bso far\b|\bnow\b(?! and then)|\bsince then\b|"
                     r"\b(?:an?|the) (?:earlier|previous|older|old) (?:versions?|runs?|paths?|code|trees?|commits?|"
                     r"implementations?|measurements?|counts?)\b|\b(?:earlier|previous) versions?\b|"
                     r"\b(?:this|that|it) replaced\b|\bthe tree before\b|\b(?:this|that) tree\b|"
                     r"\b(?:sessions?|rounds?|commits?|versions?|releases?) ago\b|"
                     r"\b(?:was|were|got|been) (?:fixed|added|removed|changed|replaced|introduced)\b|"
                     r"\bwere made exact\b|(?:\(|\. )before:|\(was \d|\bre-?measured\b|\buntil\b[^.]{0,80}\bwent\b|"
                     r"\bfor want of\b|\bnone has been lent\b|"
                     r"\b\d[\d,.]*(?: ?(?:s|ms|CPU-s))? -> \d[\d,.]* ?(?:s|ms|CPU-s)\b", re.I)
FENCED = re.compile(r"^```.*?^```", re.S | re.M)  # a page's code blocks: program output, quoted as it is


def history_words(page: pathlib.Path) -> list[str]:
  """Each match of HISTORY in ``page``'s prose (its fenced blocks blanked, line numbers kept)."""
  text = FENCED.sub(lambda m: "\n" * m.group(0).count("\n"), page.read_text())
  return [f"{page.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}: '{' '.join(m.group(0).split())}'"
          for m in HISTORY.finditer(text.replace("\n", " "))]  # a phrase may wrap (same length: same positions)


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


# The phrasings of the project's history the user pages held, each with the words the check must name.
PLANTED_HISTORY = [
    ("all restored silently before. Now a checkpoint whose bytes are bad is set aside", "Now"),
    ("the eval split is now a seeded draw per document", "now"),
    ("The documents equal the old path's (332 documents where the old exact count took 357)", "the old path"),
    ('"before" is the in-memory preparation this replaced, at commit 9e1fbed', "this replaced"),
    ("(Before: the export restored the whole model: 15.7 GB import.)", "Before:"),
    ("after the whole metrics.jsonl an earlier version wrote", "an earlier version"),
    ("| previous version's bytes per record |; the previous version uploaded the whole file", "previous version"),
    ("(Workdirs that earlier versions recorded are still read.)", "earlier versions"),
    ("measured in CI for the tree before the fault matrix; This tree, run by .ci/run", "the tree before"),
    ("CPU step times are noisy (an earlier run: dropless 1446)", "an earlier run"),
    ("An XLA pass hoisted the mask out of its loop until the block's slices went behind a barrier", "until the"),
    ("measured before the loss and the projections were made exact", "were made exact"),
    ("The cuts so far, each measured: a cold run 2072 s -> 1772 s", "so far"),
    ("test_moe + test_checkpoint 334 -> 292 CPU-s", "334 -> 292 CPU-s"),
    ("496 CPU-s two sessions ago, 150 now", "sessions ago"),
    ("a run's end no longer forces a full collection", "no longer"),
    ("paths on gs:// are untested here, for want of one", "for want of"),
    ("needs a real chip; none has been\nlent.", "none has been lent"),
    ("It used to restore the whole model; previously the export was slower; at first it failed", "used to"),
    ("Import peak 7.5 GB (was 15.7)", "(was 1"),
]


@pytest.mark.parametrize("text, named", PLANTED_HISTORY, ids=[n for _, n in PLANTED_HISTORY])
def test_the_history_check_finds_each_phrasing_the_pages_held(tmp_path, text, named):
  page = tmp_path / "docs" / "p.md"
  page.parent.mkdir()
  page.write_text(f"Present tense.\n\n{text}\n\n```text\nan error line that says it no longer holds the lease\n```\n")
  global ROOT
  saved, ROOT = ROOT, tmp_path
  try:
    found = history_words(page)
  finally:
    ROOT = saved
  assert found and all(w.startswith("docs/p.md:3: ") for w in found), found  # the prose's, not the code block's
  assert any(named.lower() in w.lower() for w in found), found


def test_the_history_check_passes_the_present_tense():
  """Words that look like history and are not: the same check on sentences of the current pages finds nothing."""
  text = ("A few lines now and then. Merged now and then. The previous one is restored; the previous start's steps. "
          "It expired more than 5 minutes ago. Earlier checkpoints are intact. The old one aside, the new one in. "
          "The choice biases fixed on both. Decodes until every row hits EOS. 64x more text (25 MB -> 1.6 GB). A "
          "restart compiles the very step it compiled before: it is kept.")
  assert HISTORY.findall(text) == []


TESTING = ROOT / "docs" / "testing.md"
# The suite's size and times: stated in docs/testing.md and nowhere else.
SUITE_FIGURES = re.compile(r"\b\d[\d,]{2,} tests\b|\b\d+m\d{2}s\b|\b\d+ s (?:cold|of it the suite)|"
                           r"\b\d+ tests collected|fast tier is \d+|not slow\W+\d+ s|"
                           r"\b\d[\d,]* s against [\d,]+(?: s)? with (?:two|three|four|\d)\b|"  # workers compared
                           r"\btest_\w+ alone: \d+ s\b")
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


def test_the_suite_figure_check_finds_timings_of_workers_and_files():
  sources = {"docs/design.md": "three workers (cold, 1,025 s against 1,072 s with two); "
                               "(test_distributed alone: 169 s)"}
  assert [m.split("'")[1] for m in suite_figures_outside_testing(sources)] == [
      "1,025 s against 1,072 s with two", "test_distributed alone: 169 s"]


def test_the_figure_check_finds_a_stale_figure():
  sources = {"docs/testing.md": "Size: 608 tests.", "README.md": "The suite: 530 tests, 721 s cold.",
             "docs/a.md": "The estimator is within 5% of the TPU compiler.",
             "tools/estimate.py": "the peak the TPU compiler reports, within 15%"}
  assert suite_figures_outside_testing(sources) == [
      "README.md: '530 tests' (the suite's figures live in docs/testing.md only)",
      "README.md: '721 s cold' (the suite's figures live in docs/testing.md only)"]
  assert estimator_accuracy(sources) == {"5": {"docs/a.md"}, "15": {"tools/estimate.py"}}


# One quantity, one value: each quantity the pages (and a few files that quote them) state, by the phrasings it is
# stated with. Every match of a quantity's patterns must agree, a less precise value being the other rounded
# (41.6 and 41.56 agree, 1.173 and 1.176 do not), and each quantity must be stated somewhere. A pattern is a regex
# whose groups are the value (searched in the text with its whitespace collapsed), or (regex, the value it states).
# PLANTED: for each quantity, text with two values that disagree, as the pages once held them.
_8B_V5P = r"\| Llama 3 8B, v5p-128 \| [\d.]+ \| "
_REMAT_FULL = r"`tools/estimate.py` total \(GiB\) \|[-| ]*\| `full` \| "  # the remat table's full row
FIGURES: dict[str, list] = {
    "Llama 3 8B on v5p-128, full remat, 1 x 8k tokens a chip: the TPU compiler's peak per chip (GiB)": [
        _8B_V5P + r"[\d.]+ \| \*\*[\d.]+\*\* \| [\d.]+ / ([\d.]+) \|",
        r"\| `none` \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+% \| ([\d.]+) \| [\d.]+ \|",
        _REMAT_FULL + r"([\d.]+) \| 0 \| [\d.]+ \|",
        r"full remat on `v5p:4x4x4` \([\d.]+ GiB against the compiler's ([\d.]+)"],
    "Llama 3 8B on v5p-128, full remat, 1 x 8k tokens a chip: the TPU compiler's estimated step (s)": [
        _8B_V5P + r"([\d.]+) \|", r"\| `none` \| ([\d.]+) \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+% \|"],
    "Llama 3 8B on v5p-128, full remat, 1 x 8k tokens a chip: tools/estimate.py's total (GiB)": [
        _REMAT_FULL + r"[\d.]+ \| 0 \| ([\d.]+) \|", r"full remat on `v5p:4x4x4` \(([\d.]+) GiB against"],
    "Llama 3 8B, 8k tokens, save_dots on v5p-128 and v6e-64: the estimator against the compiler (%, range)": [
        r"differ from the compiler's by (-?[\d.]+)% to \+?([\d.]+)% in these eight cases",
        r"lands between (-?[\d.]+)% and \+?([\d.]+)%"],
    "the estimator's bound against the TPU compiler (%)": [
        r"within (\d+(?:\.\d+)?)% of the (?:TPU )?compiler", r"compiler reports, within (\d+(?:\.\d+)?)%"],
    "Llama 3.2 1B on one H200, cudnn, 4,096 x 16 tokens, save_dots, bf16: the step (s)": [
        r"\| `cudnn` \| 4,096 x 16 \| save_dots \| ([\d.]+) \|", r"at 4,096 x 16 tokens \([\d.]+ s against ([\d.]+)"],
    "Llama 3.2 1B on one H200, cudnn, 4,096 x 16 tokens, save_dots, bf16: MFU (%)": [
        r"\| `cudnn` \| 4,096 x 16 \| save_dots \| [\d.]+ \| [\d,]+ \| \*\*([\d.]+)%\*\*",
        r"MFU of the bf16 peak against ([\d.]+)%"],
    "Llama 3.2 1B on one H200, 4,096 x 16 tokens: fp8's step against bf16's (x faster)": [
        r"\*\*(\d\.\d+)x\*\* and \*\*\d\.\d+x\*\* faster than bf16", r"step is (\d\.\d+)x faster"],
    "Llama 3.2 1B on one H200, 4,096 x 16 tokens: fp8's MFU (% of the bf16 peak)": [
        r"\b([\d.]+)% and [\d.]+% of the bf16 peak", r"([\d.]+)% MFU of the bf16 peak", r"\b([\d.]+)% with fp8"],
    "Muon's best learning rate against AdamW's (x)": [
        r"Muon's best learning rate is (\d+)x AdamW's", r"on `cpu_50m` it is (\d+)x AdamW's",
        (r"updates scaled to AdamW's RMS so `lr` carries over", "1")],
    "the float16 test's steps": [r"8 x 64 tokens, (\d+) steps", r"the float16 run trains (\d+) steps"],
    "the float16 test's overflowing steps": [
        r"with (\d+) overflowing steps skipped", r"measured: (\d+) times, from step",
        r"\((\d+) overflows, [\d.]+% from"],
    "the float16 test's loss above bfloat16's (%)": [
        r"the mean of the last 10 steps, ([\d.]+)% above it", r"last-10-step loss ([\d.]+)% above",
        r"\(\d+ overflows, ([\d.]+)% from bfloat16\)"],
    "DeepSeek-V3 671B on v5p-2048: the TPU compiler's peak per chip (GiB)": [
        r"peak memory \(HBM 95 GiB\) \| \*\*([\d.]+) GiB\*\*", r"the TPU compiler puts the step's peak at ([\d.]+) GiB",
        r"GiB against the compiler's ([\d.]+) on `v5p:8x8x16`"],
    "DeepSeek-V3 671B on 1024 chips: tools/estimate.py's figure per chip (GiB)": [
        r"([\d.]+) GiB per chip on 1024 chips", r"\(([\d.]+) GiB against the compiler's [\d.]+ on `v5p:8x8x16`"],
    "cpu_50m's parameters (M)": [
        r"`cpu_50m` \(([\d.]+)M", r"`configs/cpu_50m.py` \(([\d.]+)M parameters", r"cpu_50m \(([\d.]+)M\)",
        r"cpu_50m shape \| ([\d.]+)M"],
    "tiny's parameters (M)": [r"`tiny` \(([\d.]+)M params", r"tiny \(([\d.]+)M\)"],
    "distributed.max_restarts_per_hour's default": [
        r"\| `distributed\.max_restarts_per_hour` \| int \| `(\d+)`", r"max_restarts_per_hour` \((\d+) by default",
        r"\((\d+) by default; `--config\.distributed\.max_restarts_per_hour=0`"],
    "distributed.heartbeat_timeout_s's default (s)": [
        r"\| `distributed\.heartbeat_timeout_s` \| float \| `([\d.]+)`", r"heartbeat_timeout_s` \((\d+) s by default\)",
        r"heartbeat_timeout_s` \((\d+) s; tested"],
    "Kimi K2 on v5p-2048 with MuonClip: the TPU compiler's peak per chip (GiB)": [
        r"a chip's peak \(HBM 95 GiB\) \| \*\*([\d.]+) GiB\*\*", r"puts its step's peak at ([\d.]+) GiB"],
}
PLANTED = {  # quantity -> {source: text}, the values disagreeing
    0: {"docs/benchmarks.md": "| Llama 3 8B, v5p-128 | 1.2572 | 1.2256 | **0.975** | 8.57 / 6.79 |",
        "docs/parallelism.md": "| `model.remat` | TPU compiler's peak HBM per chip (GiB) | host memory (GiB) | "
                               "`tools/estimate.py` total (GiB) |\n|---|---|---|---|\n| `full` | 10.6 | 0 | 11.7 |\n"
                               "| `none` | 1.2963 | 38.19 | 18.40 | 1.16 | 79.7% | 8.63 | 11.32 |"},
    1: {"docs/benchmarks.md": "| Llama 3 8B, v5p-128 | 1.2572 | 1.2256 | **0.975** | 8.57 / 6.79 |",
        "docs/parallelism.md": "| `none` | 1.2963 | 38.19 | 18.40 | 1.16 | 79.7% | 8.63 | 11.32 |"},
    2: {"docs/parallelism.md": "`tools/estimate.py` total (GiB) |\n|---|---|---|---|\n| `full` | 10.6 | 0 | 11.7 |",
        "docs/recipes/size_a_slice.md": "full remat on `v5p:4x4x4` (9.7 GiB against the compiler's 6.79"},
    3: {"docs/multihost.md": "The estimator's figures differ from the compiler's by -5.2% to +4.1% in these eight "
                             "cases.",
        "docs/recipes/size_a_slice.md": "`v6e:8x8` lands between -5.2% and +0.4%"},
    4: {"docs/a.md": "The estimator is within 5% of the TPU compiler.",
        "tools/estimate.py": "the peak the TPU compiler reports, within 15%"},
    5: {"docs/benchmarks.md": "| `cudnn` | 4,096 x 16 | save_dots | 1.173 | 55,868 | **51.0%** | 102.8 |",
        "docs/parallelism.md": "the step is 1.12x faster at 4,096 x 16 tokens (1.047 s against 1.176, 57.1% MFU of the "
                               "bf16 peak against 50.9%)"},
    6: {"docs/benchmarks.md": "| `cudnn` | 4,096 x 16 | save_dots | 1.173 | 55,868 | **51.0%** | 102.8 |",
        "docs/parallelism.md": "57.1% MFU of the bf16 peak against 50.9%"},
    7: {"docs/benchmarks.md": "to 1.047 s at 4,096 x 16: **1.12x** and **1.11x** faster than bf16 on the same H200",
        "docs/parallelism.md": "the step is 1.21x faster at 4,096 x 16 tokens"},
    8: {"README.md": "Llama 3.2 1B at 51% MFU in bf16, 57% with fp8",
        "docs/benchmarks.md": "1.12x and 1.11x faster than bf16 on the same H200, 55.1% and 57.3% of the bf16 peak"},
    9: {"docs/configuration.md": "`muon` (Newton-Schulz on each layer's matrices, updates scaled to AdamW's RMS so "
                                 "`lr` "
                                 "carries over; AdamW for embeddings, head, norms)",
        "docs/benchmarks.md": "Muon's best learning rate is 10x AdamW's (3e-3 against 3e-4)."},
    10: {"docs/parallelism.md": "Measured (`tests/test_loss_scale.py`, `configs/tiny.py` with 2 layers, 8 x 64 tokens, "
                                "200 steps, CPU)",
         "docs/design.md": "the float16 run trains 100 steps with a scale period of 8 (7 overflows, 0.85% from "
                           "bfloat16)"},
    11: {"docs/parallelism.md": "with 4 overflowing steps skipped as the scale grew to 2^20 and back",
         "tests/test_loss_scale.py": "# halves several times in 100 steps (measured: 7 times, from step 27; float16's"},
    12: {"docs/parallelism.md": "ends within 1% of the bfloat16 run's loss (the mean of the last 10 steps, 1.0% above "
                                "it)",
         "docs/design.md": "the float16 run trains 100 steps with a scale period of 8 (7 overflows, 0.85% from "
                           "bfloat16)"},
    13: {"docs/benchmarks.md": "| peak memory (HBM 95 GiB) | **41.56 GiB** (arguments 19.12, temporaries 36.79) |",
         "docs/models.md": "the TPU compiler puts the step's peak at 42.6 GiB of a v5p chip's 95"},
    14: {"docs/models.md": "34.2 GiB per chip on 1024 chips (expert 64 x fsdp 16) by the estimator",
         "docs/recipes/size_a_slice.md": "DeepSeek-V3 at pod scale (36.1 GiB against the compiler's 41.6 on "
                                         "`v5p:8x8x16`"},
    15: {"docs/configuration.md": "`cpu_50m` (50.7M, CPU benchmark size)",
         "docs/benchmarks.md": "`configs/cpu_50m.py` (48M parameters, 16 x 256 tokens a step"},
    16: {"docs/configuration.md": "`tiny` (0.85M params, well under a second per step on CPU)",
         "docs/huggingface.md": "| tiny (0.58M) | 16 + 32 | 5,667 | 817 | 6.9x |"},
    17: {"docs/configuration.md": "| `distributed.max_restarts_per_hour` | int | `6` | more restartable exits |",
         "docs/operations.md": "`distributed.max_restarts_per_hour` (10 by default; 0: no limit) bounds that"},
    18: {"docs/configuration.md": "| `distributed.heartbeat_timeout_s` | float | `30.0` | a process not heard from |",
         "docs/multihost.md": "within `distributed.heartbeat_timeout_s` (60 s; tested with 5 s) instead of hanging"},
    19: {"docs/benchmarks.md": "| a chip's peak (HBM 95 GiB) | **37.48 GiB** (arguments 13.58, temporaries 33.98) |",
         "docs/models.md": "the TPU compiler puts its step's peak at 44.49 GiB of a v5p chip's 95"},
}
FIGURE_FILES = ["tools/estimate.py", "tests/test_loss_scale.py"]  # code that quotes a quantity too


def _numbers(value: str) -> list[str]:
  return [n.replace(",", "") for n in re.findall(r"-?\d[\d,]*(?:\.\d+)?", value)]


def agree(a: str, b: str) -> bool:
  """Whether two stated values are one: the same numbers, a less precise one the other's rounding."""
  import decimal
  xs, ys = _numbers(a), _numbers(b)
  if len(xs) != len(ys):
    return False
  for x, y in zip(xs, ys):
    x, y = decimal.Decimal(x), decimal.Decimal(y)
    coarse, fine = (x, y) if x.as_tuple().exponent >= y.as_tuple().exponent else (y, x)
    if fine.quantize(decimal.Decimal(1).scaleb(coarse.as_tuple().exponent), decimal.ROUND_HALF_UP) != coarse:
      return False
  return True


def figure_values(sources: dict[str, str], patterns: list) -> dict[str, set[str]]:
  """value -> where it is stated, for one quantity's patterns."""
  found: dict[str, set[str]] = {}
  for name, text in sources.items():
    flat = " ".join(text.split())
    for pattern in patterns:
      regex, constant = pattern if isinstance(pattern, tuple) else (pattern, None)
      for m in re.finditer(regex, flat):
        value = constant or " to ".join(g for g in m.groups() if g is not None)
        found.setdefault(value, set()).add(name)
  return found


def figure_conflicts(sources: dict[str, str], figures: dict[str, list] = FIGURES, stated: bool = True) -> list[str]:
  """Each quantity stated with values that disagree (and, with ``stated``, each stated nowhere)."""
  out = []
  for quantity, patterns in figures.items():
    found = figure_values(sources, patterns)
    if not found and stated:
      out.append(f"{quantity}: stated nowhere (a page reworded it? update its patterns in tests/test_docs.py FIGURES)")
    values = sorted(found)
    if any(not agree(a, b) for a in values for b in values):
      out.append(f"{quantity}: stated with different values: " +
                 "; ".join(f"{v} in {', '.join(sorted(found[v]))}" for v in values))
  return out


def test_each_quantity_is_stated_with_one_value():
  sources = figure_sources()
  sources.update({f: (ROOT / f).read_text() for f in FIGURE_FILES})
  assert figure_conflicts(sources) == []


@pytest.mark.parametrize("index", range(len(FIGURES)), ids=lambda i: list(FIGURES)[i][:60])
def test_the_one_value_check_finds_a_planted_conflict(index):
  quantity = list(FIGURES)[index]
  conflicts = figure_conflicts(PLANTED[index], {quantity: FIGURES[quantity]})
  assert len(conflicts) == 1 and "stated with different values" in conflicts[0], conflicts
  fixed = {name: text for name, text in list(PLANTED[index].items())[:1]}  # one place: one value
  assert figure_conflicts(fixed, {quantity: FIGURES[quantity]}) == []


def test_rounded_values_agree_and_others_do_not():
  assert agree("41.6", "41.56") and agree("51", "51.4") and agree("-5.2 to 0.4", "-5.2 to 0.4")
  assert not agree("1.173", "1.176") and not agree("6.79", "8.63") and not agree("10", "1")
  assert not agree("-5.2 to 4.1", "-5.2 to 0.4") and not agree("0.9", "2.0")


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


# --- The reference pages: the config's keys, the errors users meet, the version. -----------------------------------

def test_the_configuration_page_holds_the_generated_table_of_every_key():
  """docs/configuration.md's key table is tools/config_reference.py's: a line for every key of base_config() and of
  each model family's base_config(model=NAME) (the objectives' groups, preference and rl, included), none stale."""
  from tools import config_reference
  assert config_reference.missing() == []
  page = (ROOT / "docs" / "configuration.md").read_text()
  assert config_reference.on_page(page) == config_reference.table(), \
      "docs/configuration.md's key table is stale: python tools/config_reference.py --write"


def test_the_key_table_check_finds_a_key_without_a_line_and_a_stale_table():
  from jaxtrain import config as config_lib
  from tools import config_reference
  cfgs = {"llama": config_lib.base_config()}
  meanings = {k: v for k, v in config_reference.MEANINGS.items() if k in config_lib.flat_keys(cfgs["llama"])}
  cfg = config_lib.base_config()
  cfg.train.new_key = 3  # a component adds a key to its defaults() and no line to MEANINGS
  assert config_reference.missing({"llama": cfg}, {**meanings, "optim.gone": ("no config has it", "data.md")}) == [
      "train.new_key: a key of base_config(model='llama') with no line in tools/config_reference.py MEANINGS",
      "optim.gone: a line in tools/config_reference.py MEANINGS for a key no config has"]
  table = config_reference.table(cfgs, meanings)
  page = f"# Configuration\n\nProse.\n\n{table}\n\nMore prose.\n"
  assert config_reference.on_page(page) == table
  stale = page.replace("| `train.steps` | int | `1000` |", "| `train.steps` | int | `100` |")
  assert stale != page and config_reference.on_page(stale) != table
  assert config_reference.on_page("# Configuration without markers\n") is None


TROUBLESHOOTING = ROOT / "docs" / "troubleshooting.md"


def source_text(folders=("jaxtrain", "tools")) -> str:
  """The Python source of ``folders``, string literals that Python joins (``"a " "b"``, over lines too) joined."""
  text = "\n".join(p.read_text() for folder in folders for p in sorted((ROOT / folder).rglob("*.py")))
  return re.sub(r"([\"'])\s*\n?\s*[fFrR]{0,2}\1(?=\S)", "", text)


def troubleshooting_errors(page: str, source: str, root: pathlib.Path = ROOT) -> list[str]:
  """What is wrong with the page's entries: each ``### `phrase` `` heading's phrase (parts split by ' ... ') must be
  in ``source`` and, in order, in the entry's example (its fenced block), and each entry must name a test
  (``tests/x.py::test_y``) that exists."""
  errors = []
  entries = re.split(r"^### ", page, flags=re.M)[1:]
  if not entries:
    return ["no entries (### headings)"]
  for entry in entries:
    heading, _, body = entry.partition("\n")
    phrase = re.match(r"`([^`]+)`", heading)
    if not phrase:
      errors.append(f"{heading}: the heading quotes no error phrase in backticks")
      continue
    parts = phrase.group(1).split(" ... ")
    errors += [f"{heading}: '{part}' is not in the source of jaxtrain/ or tools/" for part in parts
               if part not in source]
    example = " ".join(re.findall(r"^```\w*\n(.*?)^```", body, re.S | re.M))
    if not re.search(".*?".join(map(re.escape, parts)), example, re.S):
      errors.append(f"{heading}: its example does not show it")
    tests = re.findall(r"`(tests/[\w/]+\.py)::(test_\w+)`", body)
    if not tests:
      errors.append(f"{heading}: names no test that produces it")
    for file, name in tests:
      path = root / file
      if not path.is_file() or not re.search(rf"^def {name}\(", path.read_text(), re.M):
        errors.append(f"{heading}: {file}::{name} does not exist")
  return errors


def test_every_error_on_the_troubleshooting_page_is_in_the_source_with_its_test():
  assert troubleshooting_errors(TROUBLESHOOTING.read_text(), source_text()) == []


def test_the_troubleshooting_check_finds_a_reworded_error_and_a_missing_test():
  source = 'raise ConfigError(key, "unknown config " "key", fix)\nraise UserError(p, f"needs the {x} package, which ' \
           'is not "\n                "installed", f"pip install {x}")\n'
  page = ("# T\n\n### `unknown config key`\n\n```text\njaxtrain: error: a: unknown config key; b\n```\n\n"
          "- **Test**: `tests/test_cli.py::test_user_mistake_gives_one_line_and_exit_2`.\n\n"
          "### `package, which is not installed`\n\n```text\ngs://b needs the gcsfs package, which is not installed\n"
          "```\n\n- **Test**: `tests/test_cli.py::test_user_mistake_gives_one_line_and_exit_2`.\n")
  joined = re.sub(r"([\"'])\s*\n?\s*[fFrR]{0,2}\1(?=\S)", "", source)
  assert troubleshooting_errors(page, joined) == []
  broken = page.replace("### `unknown config key`", "### `unknown configuration key`").replace(
      "test_user_mistake_gives_one_line_and_exit_2`.\n\n### `package", "test_no_such_test`.\n\n### `package")
  assert troubleshooting_errors(broken, joined) == [
      "`unknown configuration key`: 'unknown configuration key' is not in the source of jaxtrain/ or tools/",
      "`unknown configuration key`: its example does not show it",
      "`unknown configuration key`: tests/test_cli.py::test_no_such_test does not exist"]


def version_errors(version: str, setup_cfg: str, changelog: str) -> list[str]:
  """jaxtrain.__version__ is the package's version (setup.cfg reads it, or states the same) and the changelog's
  newest release."""
  errors = []
  declared = re.search(r"^version\s*=\s*(.+)$", setup_cfg, re.M)
  if not declared or declared.group(1).strip() not in ("attr: jaxtrain.__version__", version):
    errors.append(f"setup.cfg's version is {declared.group(1).strip() if declared else 'missing'}, not {version}")
  releases = re.findall(r"^## (\d+\.\d+\.\d+)\b", changelog, re.M)
  if not releases or releases[0] != version:
    errors.append(f"CHANGELOG.md's newest release is {releases[0] if releases else 'missing'}, not {version}")
  return errors


def test_the_version_is_setup_cfgs_and_the_changelogs_newest_release():
  import jaxtrain
  assert re.fullmatch(r"\d+\.\d+\.\d+", jaxtrain.__version__)
  assert version_errors(jaxtrain.__version__, (ROOT / "setup.cfg").read_text(),
                        (ROOT / "CHANGELOG.md").read_text()) == []


def test_the_version_check_finds_a_version_that_disagrees():
  changelog = "# Changelog\n\n## Versions\n\n## 0.2.0\n\n## 0.1.0\n"
  assert version_errors("0.2.0", "version = attr: jaxtrain.__version__\n", changelog) == []
  assert version_errors("0.2.0", "version = 0.1.0\n", changelog.replace("## 0.2.0\n\n", "")) == [
      "setup.cfg's version is 0.1.0, not 0.2.0", "CHANGELOG.md's newest release is 0.1.0, not 0.2.0"]


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
