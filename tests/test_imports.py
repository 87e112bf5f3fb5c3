"""The import graph of `attnprec`, read from the source with `ast` (nothing is imported):
no cycles between modules nor between packages, no library module imports the runner
layer, and every import follows the floor chart of docs/layout.md (a module imports only
from its own floor or below; the chart places every module).

An edge A -> B is an `import B` / `from B import x` anywhere in A (function bodies
included: a lazy import is still a dependency). `from P import m` where P/m.py exists
is an edge to P.m; an import of a package is an edge to its `__init__`.
"""
import ast
import pathlib
import re

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
  def runner(m):   # a runner-layer module, or one of its package's (attnprec.ginutils.x)
    return any(m == r or m.startswith(r + ".") for r in RUNNER_LAYER)
  assert runner("attnprec.ginutils.flags") and not runner("attnprec.ginutilsx")
  bad = {m: sorted(d for d in deps if runner(d))
         for m, deps in graph.items() if not runner(m)}
  bad = {m: d for m, d in bad.items() if d}
  assert not bad, f"library modules importing the runner layer: {bad}"


def package_graph(graph):
  """The module graph folded onto units: a top-level module (attnprec.audit) or a
  subpackage with all its modules (attnprec.evals); edges inside a unit are dropped."""
  def unit(m):
    return ".".join(m.split(".")[:2])
  out = {}
  for m, deps in graph.items():
    out.setdefault(unit(m), set()).update(unit(d) for d in deps if unit(d) != unit(m))
  return out


def test_no_package_import_cycles():
  # the fold: a cycle through two packages' different modules is a package cycle
  assert cycles(package_graph({"p.a.x": {"p.b.y"}, "p.b.z": {"p.a.w"}, "p.a.w": set(),
                               "p.b.y": set()})) == [["p.a", "p.b"]]
  graph = package_graph(import_graph())
  assert "attnprec.stats" in graph["attnprec.study"]
  assert "attnprec.contract" in graph["attnprec.kernels"]
  found = cycles(graph)
  assert not found, "package import cycles: " + "; ".join(" <-> ".join(c) for c in found)


LAYOUT = ROOT / "docs" / "layout.md"
_FLOOR_LINE = re.compile(r"^(\w+)? +((?:attnprec/\S+|runners/)(?:  +attnprec/\S+)*)")


def floor_chart(text=None):
  """[(floor, path)] in chart order, from the first code block of docs/layout.md: a line
  starting with a word opens that floor; the paths at the start of a line's second
  column (one or more, two spaces apart) are on the current floor. Descriptions and
  their continuation lines are not read."""
  text = LAYOUT.read_text() if text is None else text
  block = text.split("```\n", 2)[1]
  out, floor = [], None
  for line in block.splitlines():
    if line[:1] not in ("", " "):
      floor = line.split()[0]
    if len(line) > 9 and line[9] != " " and line[:9].strip() in ("", floor):
      m = _FLOOR_LINE.match(line)
      if m:
        out += [(floor, p) for p in m.group(2).split()]
  return out


def floors():
  """({module: floor index}, [floor names]) for every module of attnprec: the most
  specific chart entry covering it (a file, or a package directory)."""
  chart = floor_chart()
  names = list(dict.fromkeys(f for f, _ in chart))
  exact, covering = {}, {}   # an __init__.py places only the package module itself
  for floor, path in chart:
    if path.startswith(PACKAGE + "/"):
      if path.endswith("/__init__.py"):
        exact[path[:-len("/__init__.py")].replace("/", ".")] = names.index(floor)
      else:
        covering[path.rstrip("/").removesuffix(".py").replace("/", ".")] = \
            names.index(floor)
  out = {}
  for m in modules():
    parts = m.split(".")
    for i in range(len(parts), 0, -1):
      if ".".join(parts[:i]) in covering:
        out[m] = covering[".".join(parts[:i])]
        break
    if m in exact:
      out[m] = exact[m]
  return out, names


def test_floor_chart_is_read():
  chart = floor_chart()
  assert ("ground", "attnprec/errors.py") in chart
  assert ("tools", "attnprec/evals/") in chart
  assert ("runner", "attnprec/cli.py") in chart
  # a description naming a path is not an entry:
  assert floor_chart("```\nx        attnprec/a.py   see attnprec/b.py\n"
                     "                        and attnprec/c.py\n"
                     "y        attnprec/d.py  attnprec/e/   two\n```\n") == [
      ("x", "attnprec/a.py"), ("y", "attnprec/d.py"), ("y", "attnprec/e/")]
  assert [n for n in floors()[1]] == ["ground", "kernels", "numerics", "model", "use",
                                      "tools", "runner"]


def test_floor_chart_paths_exist():
  missing = [p for _, p in floor_chart() if not (ROOT / p).exists()]
  assert not missing, f"docs/layout.md's floor chart names paths that do not exist: {missing}"


def test_floor_chart_places_every_module():
  """Every top-level module and every package is an entry of the chart itself (a module
  inside a package is placed by its package)."""
  listed = {p.rstrip("/").removesuffix(".py").removesuffix("/__init__").replace("/", ".")
            for _, p in floor_chart() if p.startswith(PACKAGE + "/")}
  units = {".".join(m.split(".")[:2]) for m in modules() if m != PACKAGE} | {PACKAGE}
  missing = sorted(u for u in units if u not in listed)
  assert not missing, f"modules and packages docs/layout.md's floor chart omits: {missing}"


def test_imports_follow_the_floors():
  """A module imports only from its own floor or below (docs/layout.md)."""
  floor_of, names = floors()
  assert set(floor_of) == set(modules()), "modules the chart does not place: " + \
      ", ".join(sorted(set(modules()) - set(floor_of)))
  bad = [f"{m} ({names[floor_of[m]]}) imports {d} ({names[floor_of[d]]})"
         for m, deps in sorted(import_graph().items()) for d in sorted(deps)
         if floor_of[d] > floor_of[m]]
  assert not bad, "imports from a higher floor: " + "; ".join(bad)
