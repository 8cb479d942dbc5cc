"""The package's import graph (read with ``ast``, nothing imported): no cycle, and no module imports one from a
layer above its own. The layers are the ones docs/design.md declares (its ``layers`` block), so the page and the
code cannot drift apart."""

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jaxtrain"


def declared_layers() -> list[tuple[str, list[str]]]:
  """(layer name, module prefixes) from the top layer down, as docs/design.md's ```layers block lists them."""
  text = (ROOT / "docs" / "design.md").read_text()
  block = re.search(r"```layers\n(.*?)```", text, re.S)
  assert block, "docs/design.md has no ```layers block"
  layers = []
  for line in block.group(1).splitlines():
    if line.strip():
      name, _, modules = line.partition(":")
      layers.append((name.strip(), [m.strip() for m in modules.split(",") if m.strip()]))
  return layers


def modules() -> dict[str, pathlib.Path]:
  out = {}
  for path in sorted(PACKAGE.rglob("*.py")):
    parts = path.relative_to(ROOT).with_suffix("").parts
    out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return out


def imports(name: str, path: pathlib.Path, known: set[str]) -> set[tuple[str, int]]:
  """The jaxtrain modules ``name`` imports (at the top or inside functions alike), with the line."""
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  out = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
      targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    else:
      continue
    for target in targets:
      while target and target not in known:  # `import jaxtrain.data.loader as x` names the module itself
        target = target.rpartition(".")[0]
      if target.startswith("jaxtrain") and target != name:
        out.add((target, node.lineno))
  return out


def layer_of(module: str, layers) -> int:
  best = max(((len(p), i) for i, (_, prefixes) in enumerate(layers) for p in prefixes
              if module == p or module.startswith(p + ".")), default=None)
  assert best is not None, f"{module} is in no layer of docs/design.md: add it to the ```layers block"
  return best[1]


def graph():
  mods = modules()
  return mods, {name: imports(name, path, set(mods)) for name, path in mods.items()}


def test_every_module_sits_in_one_declared_layer():
  layers = declared_layers()
  assert [n for n, _ in layers][0] == "entry points" and len(layers) >= 4
  for name in modules():
    layer_of(name, layers)


def test_no_import_runs_up_a_layer():
  layers = declared_layers()
  mods, edges = graph()
  uphill = [f"{m} (layer '{layers[layer_of(m, layers)][0]}') imports {t} (layer '{layers[layer_of(t, layers)][0]}') "
            f"at {mods[m].relative_to(ROOT)}:{line}"
            for m, targets in edges.items() for t, line in sorted(targets)
            if layer_of(t, layers) < layer_of(m, layers)]
  assert not uphill, "\n".join(uphill)


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
  state, stack = {}, []

  def visit(node):
    state[node] = "open"
    stack.append(node)
    for nxt in sorted(edges.get(node, ())):
      if state.get(nxt) == "open":
        return stack[stack.index(nxt):] + [nxt]
      if nxt not in state:
        found = visit(nxt)
        if found:
          return found
    stack.pop()
    state[node] = "done"
    return None

  for node in sorted(edges):
    if node not in state:
      found = visit(node)
      if found:
        return found
  return None


def test_the_import_graph_has_no_cycle():
  _, edges = graph()
  cycle = find_cycle({m: {t for t, _ in targets} for m, targets in edges.items()})
  assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_checks_find_what_they_look_for():
  """The checker itself: a planted cycle is found, and a planted uphill import is named."""
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert find_cycle({"a": {"b"}, "b": set()}) is None
  layers = [("entry points", ["jaxtrain.main"]), ("foundations", ["jaxtrain"])]
  assert layer_of("jaxtrain.errors", layers) == 1 and layer_of("jaxtrain.main", layers) == 0
  mods = modules()
  assert ("jaxtrain.sharding", 23) in {(t, l) for t, l in imports("jaxtrain.parallel.context",
                                                                   mods["jaxtrain.parallel.context"], set(mods))}


NAMED = {"jaxtrain.train.trainer": "jaxtrain.sampling", "jaxtrain.generate": "jaxtrain.checkpoint",
         "jaxtrain.data.prepare.beam": "jaxtrain.data.prepare.algorithm",
         "jaxtrain.models": "jaxtrain.models.llama", "jaxtrain.models.llama": "jaxtrain.models.llama.hf",
         "jaxtrain.models.moe": "jaxtrain.models.moe.hf"}


@pytest.mark.parametrize("module", list(NAMED))
def test_named_dependencies_are_seen(module):
  """Imports the graph must see (a regression: they once ran uphill or in a cycle, or by a name string the graph
  cannot read): the trainer's sampler, generate's checkpoint helpers, the Beam runner's algorithm, and the built-in
  model families with their Hugging Face adapters, imported by the package (no importlib by name)."""
  mods, edges = graph()
  assert NAMED[module] in {t for t, _ in edges[module]}


def named_by_string(source: str, known: set[str]) -> list[int]:
  """Lines where ``source`` names a jaxtrain module in a string (outside docstrings): an import by name
  (``importlib.import_module``, a registry's list of modules to load) that the graph cannot see."""
  tree = ast.parse(source)
  docs = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef))
          and n.body and isinstance(n.body[0], ast.Expr)}
  return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
          and "." in n.value and n.value in known and id(n) not in docs]


def test_no_module_is_imported_by_name():
  """Every jaxtrain module is reached by an import statement the graph sees, none through a name string (only
  users' modules are: a config file's, a hook's import path)."""
  mods = modules()
  found = [f"{path.relative_to(ROOT)}:{line}" for path in mods.values()
           for line in named_by_string(path.read_text(), set(mods))]
  assert not found, found
  planted = 'FAMILIES = Registry("model.name", "model", builtin=("jaxtrain.models.llama",))\n'
  assert named_by_string(planted, set(mods)) == [1]
