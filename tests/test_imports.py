"""The import graph of `attnprec`, read from the source with `ast` (nothing is imported):
no cycles, and no library module imports the runner layer.

An edge A -> B is an `import B` / `from B import x` anywhere in A (function bodies
included: a lazy import is still a dependency). `from P import m` where P/m.py exists
is an edge to P.m; an import of a package is an edge to its `__init__`.
"""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = "attnprec"
# The runner layer: what runners/*.py call to turn flags into gin bindings. Library code
# (everything else in the package) must not import it.
RUNNER_LAYER = ("attnprec.cli", "attnprec.ginutils", "attnprec.configurables")


def modules():
  """{'attnprec.kernels.blockwise': path, 'attnprec.kernels': .../__init__.py, ...}."""
  out = {}
  for path in sorted((ROOT / PACKAGE).rglob("*.py")):
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
      parts = parts[:-1]
    out[".".join(parts)] = path
  return out


def import_graph():
  mods = modules()
  graph = {}
  for name, path in mods.items():
    is_pkg = path.name == "__init__.py"
    deps = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom):
        if node.level:
          base = name.split(".") if is_pkg else name.split(".")[:-1]
          base = base[:len(base) - node.level + 1]
          mod = ".".join(base + ([node.module] if node.module else []))
        else:
          mod = node.module or ""
        targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod
                   for a in node.names]
      else:
        continue
      for t in targets:
        while t and t not in mods:          # 'attnprec.x.y' (an attribute) -> 'attnprec.x'
          t = t.rpartition(".")[0]
        if t and t != name:
          deps.add(t)
    graph[name] = deps
  return graph


def cycles(graph):
  """Every strongly connected component with more than one module (Tarjan)."""
  index, low, stack, on_stack, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        out.append(sorted(comp))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def test_graph_is_read():
  """The reader sees the edges it must (so an empty graph cannot pass the checks)."""
  graph = import_graph()
  assert "attnprec.contract" in graph["attnprec.kernels.blockwise"]
  assert "attnprec.kernels.blockwise" in graph["attnprec.kernels"]
  assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
  found = cycles(import_graph())
  assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_contract_imports_no_kernel():
  graph = import_graph()
  assert not {d for d in graph["attnprec.contract"] if d.startswith("attnprec.kernels")}


@pytest.mark.parametrize("module", sorted(
    m for m in modules() if m.startswith("attnprec.kernels.")))
def test_kernel_modules_import_only_the_ground_floor(module):
  """A kernel imports the contract (and errors), never another kernel or the model."""
  assert import_graph()[module] <= {"attnprec.contract", "attnprec.errors"}


def test_library_does_not_import_the_runner_layer():
  graph = import_graph()
  bad = {m: sorted(d for d in deps if d in RUNNER_LAYER)
         for m, deps in graph.items() if m not in RUNNER_LAYER}
  bad = {m: d for m, d in bad.items() if d}
  assert not bad, f"library modules importing the runner layer: {bad}"
