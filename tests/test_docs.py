"""The docs name only what exists.

README.md and docs/*.md are read as a newcomer would run them: every `make` target (and
the make variables set with it) is in the Makefile and read by that target, every gin file
and repository path is on disk, every runner exists, every runner flag is one the runner
accepts (read from its argparse / `cli.main` setup), every `--gin.NAME=VALUE` binding and
gin binding names a registered configurable and one of its parameters (scopes such as
`decode/precision.dtype` allowed), every `package.module:function` under attnprec imports,
and every relative markdown link (and its #anchor) resolves.

Names written in capitals (`gin/precision/X.gin`, `runners/NAME.py`, `--gin.NAME=VALUE`)
and `...` are placeholders and are not checked.
"""
import ast
import fnmatch
import functools
import glob
import importlib
import inspect
import json
import os
import re
import shlex

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))

# Files the docs name that runs write, not files in the repository.
RUN_OUTPUTS = {"operative_config.gin"}
# Extensions of the files a span like `model.json` names (not a gin binding).
FILE_EXTENSIONS = {"json", "jsonl", "md", "png", "py", "gin", "npz", "npy", "txt", "lock",
                   "gguf", "html", "bin", "cfg", "toml", "safetensors"}


def _read(path):
  with open(os.path.join(ROOT, path), encoding="utf-8") as f:
    return f.read()


def _is_placeholder(name):
  stem = os.path.splitext(os.path.basename(name.rstrip("/")))[0]
  return "..." in name or bool(re.fullmatch(r"[A-Z][A-Z0-9_]*", stem))


# --- reading the docs --------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _split(path):
  """(prose, code lines): fenced and indented code blocks apart from the prose (whose
  lines are kept in place, code blanked out)."""
  prose, code = [], []
  in_fence = in_indent = False
  prev_blank = True
  for line in _read(path).split("\n"):
    if line.lstrip().startswith("```"):
      in_fence = not in_fence
      prose.append("")
    elif in_fence:
      code.append(line)
      prose.append("")
    elif line.startswith("    ") and line.strip() and (prev_blank or in_indent):
      in_indent = True
      code.append(line)
      prose.append("")
    else:
      in_indent = in_indent and not line.strip()
      prose.append(line)
    prev_blank = not line.strip()
  return "\n".join(prose), code


@functools.lru_cache(maxsize=None)
def _spans(path):
  """Inline code spans of the prose (a span may wrap over lines)."""
  prose, _ = _split(path)
  return tuple(" ".join(s.split()) for s in re.findall(r"`([^`]+)`", prose))


@functools.lru_cache(maxsize=None)
def _commands(path):
  """Shell-like snippets: each logical line of a code block, and each inline span."""
  _, code = _split(path)
  lines, current = [], ""
  for line in code:
    if line.rstrip().endswith("\\"):
      current += line.rstrip()[:-1] + " "
    else:
      lines.append((current + line).strip())
      current = ""
  if current:
    lines.append(current.strip())
  return tuple(lines) + _spans(path)


def _words(text):
  text = re.split(r"\s(?:;|&&|\|\|?)\s|;\s", text)[0]
  try:
    return shlex.split(text, comments=True)
  except ValueError:   # an unbalanced quote in sample output
    return text.split()


def _all(fn):
  return [(path, item) for path in DOCS for item in fn(path)]


# --- the Makefile ------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _makefile():
  """(targets, {target: recipe text}, {variable: definition text})."""
  text = _read("Makefile")
  targets, recipes, variables = set(), {}, {}
  current = None
  for line in text.split("\n"):
    if line.startswith(".PHONY:"):
      targets.update(line.split(":", 1)[1].split())
      continue
    m = re.match(r"^([A-Za-z_][\w.-]*)\s*:(?!=)(.*)$", line)
    v = re.match(r"^(?:export\s+)?([A-Za-z_]\w*)\s*(?:\?|:|\+)?=(.*)$", line)
    if v and not m:
      variables[v.group(1)] = v.group(2)
      current = None
    elif m:
      current = m.group(1)
      targets.add(current)
      recipes[current] = m.group(2)
    elif line.startswith("\t") and current:
      recipes[current] += "\n" + line
    elif line.strip() and not line.startswith("#"):
      current = None
  return targets, recipes, variables


def _vars_read(target):
  """Make variables a target's recipe reads, through the variables it expands."""
  _, recipes, variables = _makefile()
  seen, todo = set(), [recipes.get(target, "")]
  # Prerequisites' recipes (setup -> $(VENV)/.installed) read theirs.
  while todo:
    text = todo.pop()
    for name in re.findall(r"\$[({]\s*(?:call\s+)?([A-Za-z_]\w*)", text):
      if name not in seen:
        seen.add(name)
        todo.append(variables.get(name, ""))
  return seen


def _runner_of(target):
  _, recipes, _ = _makefile()
  m = re.search(r"runners/(\w+)\.py", recipes.get(target, ""))
  return m.group(1) if m else None


# --- the runners ---------------------------------------------------------------------------

def _add_argument_flags(tree):
  flags, choices = set(), {}
  constants = {}
  for node in tree.body:
    if isinstance(node, ast.Assign) and len(node.targets) == 1 \
        and isinstance(node.targets[0], ast.Name):
      try:
        constants[node.targets[0].id] = ast.literal_eval(node.value)
      except ValueError:
        pass
  # `add = parser.add_argument` then `add("--flag", ...)` counts as add_argument too.
  aliases = {t.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
             and getattr(node.value, "attr", None) == "add_argument"
             for t in node.targets if isinstance(t, ast.Name)}
  for node in ast.walk(tree):
    if isinstance(node, ast.Call) and (getattr(node.func, "attr", None) == "add_argument"
                                       or getattr(node.func, "id", None) in aliases):
      names = [a.value for a in node.args
               if isinstance(a, ast.Constant) and str(a.value).startswith("-")]
      flags.update(names)
      for kw in node.keywords:
        if kw.arg == "choices":
          try:
            values = ast.literal_eval(kw.value)
          except ValueError:
            values = constants.get(getattr(kw.value, "id", None))
          if values is not None:
            for n in names:
              choices[n] = {str(x) for x in values}
  return flags, choices


@functools.lru_cache(maxsize=None)
def _gin_flags():
  """The flags `ginutils.split_flags` takes (`--gin_file`, `--gin_bindings`, `--gin.`)."""
  tree = ast.parse(_read("attnprec/ginutils/flags.py"))
  fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "split_flags")
  return {n.value.rstrip(".=") for n in ast.walk(fn)
          if isinstance(n, ast.Constant) and isinstance(n.value, str)
          and re.fullmatch(r"--gin[._]?\w*[.=]?", n.value)}


@functools.lru_cache(maxsize=None)
def _runners():
  """{runner name: (accepted flags, {flag: choices})}."""
  cli_flags, _ = _add_argument_flags(ast.parse(_read("attnprec/cli.py")))
  out = {}
  for path in glob.glob(os.path.join(ROOT, "runners", "*.py")):
    tree = ast.parse(_read(path))
    flags, choices = _add_argument_flags(tree)
    uses_cli_main = any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "main"
        and getattr(n.func.value, "id", None) == "cli" for n in ast.walk(tree))
    if uses_cli_main:
      flags |= cli_flags | _gin_flags()
    flags |= {"--help", "-h"}
    out[os.path.splitext(os.path.basename(path))[0]] = (flags, choices)
  return out


def _flag_name(token):
  if token.startswith("--gin."):
    return "--gin"
  return token.split("=", 1)[0]


# --- gin ---------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _registry():
  import gin
  from attnprec import ginutils
  ginutils._import_configurables()  # noqa: SLF001
  for runner in ("train", "decode", "audit", "study", "nextline", "sinks", "inspect_model"):
    _import_runner(runner)
  return gin.config._REGISTRY  # noqa: SLF001


def _import_runner(name):
  spec = importlib.util.spec_from_file_location(f"_docs_runner_{name}",
                                                os.path.join(ROOT, "runners", f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)


def _binding_problem(binding):
  """None if `[scope/]configurable.param` names a registered configurable and one of its
  parameters, else what is wrong."""
  name = binding.split("=", 1)[0].strip()
  name = name.rsplit("/", 1)[-1]          # scopes: decode/precision.dtype
  if _is_placeholder(name.split(".")[0]) or "." not in name:
    return None
  configurable, param = name.rsplit(".", 1)
  registry = _registry()
  if not registry.matching_selectors(configurable):
    return f"{binding!r}: no gin configurable named {configurable!r}"
  if param == "*":
    return None
  match = registry.get_match(configurable)
  try:
    params = inspect.signature(match.wrapped).parameters
  except (TypeError, ValueError):
    return None
  if param in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
    return None
  return f"{binding!r}: {configurable} has no parameter {param!r} (it has {', '.join(params)})"


# --- what the docs name ------------------------------------------------------------------

def _make_invocations(path):
  """(command text, target, {VAR: value}) for every `make TARGET VAR=VALUE ...`."""
  out = []
  for command in _commands(path):
    for m in re.finditer(r"(?:^|(?<=[\s;&|(]))make\s+(?=[A-Za-z\[])", command):
      words = _words(command[m.end():])
      targets, variables = [], {}
      for w in words:
        w = w.strip("[]")
        v = re.fullmatch(r"([A-Z_][A-Z0-9_]*)=(.*)", w, re.S)
        if v:
          variables[v.group(1)] = v.group(2)
        elif re.fullmatch(r"[a-z][\w-]*", w) and not variables:
          targets.append(w)
        else:
          break
      for target in targets:
        out.append((command, target, variables))
  return out


def _runner_invocations(path):
  """(command text, runner, [words after it]) for every `python runners/x.py ...`."""
  out = []
  for command in _commands(path):
    for m in re.finditer(r"runners/(\w+)\.py", command):
      if not _is_placeholder(m.group(1)):
        out.append((command, m.group(1), _words(command[m.end():])))
  return out


def _gin_paths(path):
  text = _read(path)
  return sorted(set(re.findall(r"(?<![\w-])gin/[\w./*-]*[\w/*]", text)))


def _bare_gin_names(path):
  names = set()
  for span in _commands(path):
    names.update(re.findall(r"(?<![\w/*.-])([\w*]+\.gin)\b", span))
  return sorted(names - RUN_OUTPUTS)


def _repo_paths(path):
  text = _read(path)
  found = re.findall(r"(?<![\w./-])((?:attnprec|tests|runners|docs)/[\w./*-]*)", text)
  return sorted({p.rstrip(".,") for p in found})


# --- tests -------------------------------------------------------------------------------

def _named_targets():
  return sorted({t for path in DOCS for _, t, _ in _make_invocations(path)})


def test_docs_exist_and_link_back():
  assert os.path.isfile(os.path.join(ROOT, "README.md"))
  readme = _read("README.md")
  assert "make decode" in readme and "make test" in readme
  for path in DOCS[1:]:
    first = _read(path).split("\n\n")[1]
    assert "README.md" in first, f"{path}: the first paragraph should link back to README"


def test_the_docs_name_make_targets():
  # The parser finds what the README's own quick start names.
  assert {"decode", "test"} <= set(_named_targets())


@pytest.mark.parametrize("target", _named_targets())
def test_make_target_exists(target):
  targets, _, _ = _makefile()
  where = sorted({p for p in DOCS for _, t, _ in _make_invocations(p) if t == target})
  assert target in targets, (f"`make {target}` is named in {', '.join(where)} but the Makefile "
                             f"has no such target (targets: {', '.join(sorted(targets))})")


def test_make_variables_are_read_by_their_target():
  targets, _, variables = _makefile()
  problems = []
  for path, (command, target, given) in _all(_make_invocations):
    if target not in targets:
      continue   # reported by test_make_target_exists
    reads = _vars_read(target)
    for var in given:
      if var not in reads:
        problems.append(f"{path}: `{command}`: make {target} does not read {var} "
                        f"(it reads {', '.join(sorted(r for r in reads if r.isupper()))})")
  assert not problems, "\n".join(problems)


def test_flags_given_to_make_targets_are_accepted_by_their_runner():
  runners = _runners()
  problems = []
  for path, (command, target, given) in _all(_make_invocations):
    runner = _runner_of(target)
    if runner is None or "ARGS" not in given or runner not in runners:
      continue
    flags, choices = runners[runner]
    for word in _words(given["ARGS"]):
      problems += _flag_problems(path, command, runner, word, flags, choices)
  assert not problems, "\n".join(problems)


def test_runners_exist_and_accept_their_flags():
  runners = _runners()
  problems = []
  for path, (command, runner, words) in _all(_runner_invocations):
    if runner not in runners:
      problems.append(f"{path}: `{command}`: no runners/{runner}.py")
      continue
    flags, choices = runners[runner]
    for word in words:
      if word.startswith("-"):
        problems += _flag_problems(path, command, runner, word, flags, choices)
  assert not problems, "\n".join(problems)


def _flag_problems(path, command, runner, word, flags, choices):
  if not word.startswith("-") or _is_placeholder(word.lstrip("-").split("=")[0]):
    return []
  name = _flag_name(word)
  if name not in flags:
    return [f"{path}: `{command}`: runners/{runner}.py does not accept {name} "
            f"(it accepts {', '.join(sorted(flags))})"]
  if "=" in word and name in choices:
    value = word.split("=", 1)[1]
    if value not in choices[name]:
      return [f"{path}: `{command}`: {name}={value} is not one of {sorted(choices[name])}"]
  if name == "--gin_file" and "=" in word:
    for f in word.split("=", 1)[1].split():
      if not _is_placeholder(f) and not os.path.isfile(os.path.join(ROOT, f)):
        return [f"{path}: `{command}`: no gin file {f}"]
  return []


def test_every_flag_named_is_accepted_by_some_runner():
  runners = _runners()
  known = set().union(*(flags for flags, _ in runners.values()))
  problems = []
  for path in DOCS:
    for command in _commands(path):
      for flag in re.findall(r"(?<![\w-])(--[a-z][\w]*)(?=[=\s.'\"`)\]]|$)", command):
        if flag.startswith("--xla_"):
          continue   # XLA's own flags (in XLA_FLAGS), not a runner's
        if flag not in known and not flag.startswith("--gin"):
          problems.append(f"{path}: `{command}`: no runner accepts {flag}")
  assert not problems, "\n".join(problems)


def test_gin_bindings_name_registered_configurables():
  problems, checked = [], 0
  for path in DOCS:
    for command in _commands(path):
      bindings = re.findall(r"--gin\.([^\s=]+=)", command)
      bindings += re.findall(r"--gin_bindings=['\"]([^'\"]+)['\"]", command)
      if re.fullmatch(r"(?:\w+/)?[A-Za-z_]\w*\.\w+\s*=\s*\S.*", command):
        bindings.append(command)              # a span like `decode/blockwise.q_block = 128`
      m = re.fullmatch(r"(?:\w+/)?([A-Za-z_]\w*)\.([a-z_]\w*|\*)", command)
      if m and m.group(2) not in FILE_EXTENSIONS and _registry().matching_selectors(m.group(1)):
        bindings.append(command)              # a span like `train.target_accuracy`
      for binding in bindings:
        checked += 1
        problem = _binding_problem(binding)
        if problem:
          problems.append(f"{path}: {problem}")
  assert checked > 20, checked
  assert not problems, "\n".join(problems)


def test_gin_files_exist():
  problems = []
  gin_files = [os.path.relpath(p, os.path.join(ROOT, "gin"))
               for p in glob.glob(os.path.join(ROOT, "gin", "**", "*.gin"), recursive=True)]
  for path in DOCS:
    for p in _gin_paths(path):
      if _is_placeholder(p):
        continue
      if not glob.glob(os.path.join(ROOT, p)):
        problems.append(f"{path}: no {p}")
    for name in _bare_gin_names(path):
      if not any(fnmatch.fnmatch(os.path.basename(f), name) for f in gin_files):
        problems.append(f"{path}: no gin file matching {name} under gin/")
  assert not problems, "\n".join(problems)


def test_repository_paths_exist():
  problems = []
  for path in DOCS:
    for p in _repo_paths(path):
      if not _is_placeholder(p) and not glob.glob(os.path.join(ROOT, p)):
        problems.append(f"{path}: no {p}")
  assert not problems, "\n".join(problems)


def test_python_functions_named_import():
  problems = []
  for path in DOCS:
    for command in _commands(path):
      for module, attr in re.findall(r"\b(attnprec(?:\.\w+)+):(\w+)", command):
        try:
          ok = hasattr(importlib.import_module(module), attr)
        except ImportError as e:
          ok, attr = False, f"{attr} ({e})"
        if not ok:
          problems.append(f"{path}: `{command}`: no {module}:{attr}")
      for module in re.findall(r"python -m ([\w.]+)", command):
        if module != "pip" and importlib.util.find_spec(module) is None:
          problems.append(f"{path}: `{command}`: no module {module}")
  assert not problems, "\n".join(problems)


def _slug(heading):
  text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
  return text.replace(" ", "-")


def _anchors(path):
  prose, _ = _split(path)
  return {_slug(m) for m in re.findall(r"^#{1,6}\s+(.*)$", prose, re.M)}


def test_relative_links_resolve():
  problems, checked = [], 0
  for path in DOCS:
    prose, _ = _split(path)
    prose = re.sub(r"`[^`]*`", "", prose)
    for target in re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", prose):
      if re.match(r"[a-z]+:", target):
        continue   # http(s), mailto
      checked += 1
      file, _, anchor = target.partition("#")
      resolved = os.path.normpath(os.path.join(ROOT, os.path.dirname(path), file)) \
          if file else os.path.join(ROOT, path)
      if not os.path.exists(resolved):
        problems.append(f"{path}: link {target!r}: no {os.path.relpath(resolved, ROOT)}")
      elif anchor and resolved.endswith(".md") and \
          anchor not in _anchors(os.path.relpath(resolved, ROOT)):
        problems.append(f"{path}: link {target!r}: no heading #{anchor} in "
                        f"{os.path.relpath(resolved, ROOT)}")
  assert checked > 10, checked
  assert not problems, "\n".join(problems)


# --- the README as a front door -------------------------------------------------------------

README_MAX_LINES = 150


def test_readme_is_a_front_door():
  """Short, with the pages to read next near the top, and every page under docs/ listed."""
  readme = _read("README.md")
  lines = readme.split("\n")
  if lines and lines[-1] == "":
    lines = lines[:-1]
  assert len(lines) <= README_MAX_LINES, (
      f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): evidence belongs in "
      f"docs/evals.md or docs/study.md")
  headings = [i for i, line in enumerate(lines) if re.match(r"#{2,6}\s", line)]
  first = next((i for i in headings if "where to go next" in lines[i].lower()), None)
  assert first is not None and first == headings[0], "README: 'Where to go next' comes first"
  missing = [p for p in DOCS[1:] if f"({p})" not in readme]
  assert not missing, f"README.md does not link {', '.join(missing)}"


def test_no_undefined_seed():
  """'seed' in the docs means a random seed only (a parameter such as `train.seed`); the
  README does not use the word at all."""
  assert not re.search(r"seed", _read("README.md"), re.I), "README.md says 'seed'"
  problems = [f"{path}: {m.group(0)!r}" for path in DOCS
              for m in re.finditer(r"\bthe seed\b|\bseed's\b", _read(path), re.I)]
  assert not problems, "\n".join(problems)


def _python_blocks(path):
  return re.findall(r"^```python\n(.*?)^```", _read(path), re.M | re.S)


def test_readme_python_example_names_what_exists():
  """The README's Python example parses, its imports resolve, and every function or class
  it calls from them exists and takes the keywords it is given (nothing is loaded)."""
  blocks = _python_blocks("README.md")
  assert blocks, "README.md has no ```python example"
  problems, checked = [], 0
  for block in blocks:
    tree = ast.parse(block)
    names = {}
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom):
        module = importlib.import_module(node.module)
        for alias in node.names:
          if not hasattr(module, alias.name):   # a submodule not imported yet
            try:
              importlib.import_module(f"{node.module}.{alias.name}")
            except ImportError:
              pass
          if not hasattr(module, alias.name):
            problems.append(f"no {node.module}.{alias.name}")
          else:
            names[alias.asname or alias.name] = getattr(module, alias.name)
    for node in ast.walk(tree):
      if not isinstance(node, ast.Call):
        continue
      fn = node.func
      if isinstance(fn, ast.Name) and fn.id in names:
        target, label = names[fn.id], fn.id
      elif isinstance(fn, ast.Attribute) and getattr(fn.value, "id", None) in names:
        owner = names[fn.value.id]
        label = f"{fn.value.id}.{fn.attr}"
        if not hasattr(owner, fn.attr):
          problems.append(f"no {label}")
          continue
        target = getattr(owner, fn.attr)
      else:
        continue
      checked += 1
      params = inspect.signature(target).parameters
      for kw in node.keywords:
        if kw.arg not in params:
          problems.append(f"{label} has no parameter {kw.arg!r}")
  assert checked >= 2, (checked, problems)
  assert not problems, "\n".join(problems)


def test_the_readme_headline_table_is_the_sizes_record():
  """Every row of the README's headline table is a row of the sizes run it quotes
  (results/sizes-qwen2.5-coder/sizes.json, written by `make sizes`), to the character:
  an edited figure, or a record made again without the README following, fails."""
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    readme = f.read()
  section = readme.split("## Headline result", 1)[1].split("\n## ", 1)[0]
  rows = [line for line in section.splitlines() if line.startswith("| ")
          and not line.startswith("| measure")]
  assert len(rows) >= 10, rows
  path = os.path.join(ROOT, "results", "sizes-qwen2.5-coder", "sizes.json")
  with open(path, encoding="utf-8") as f:
    recorded = set(json.load(f)["table"].splitlines())
  missing = [r for r in rows if r not in recorded]
  assert not missing, missing


def test_the_tpu_tables_are_the_device_check_records():
  """docs/performance.md's TPU tables (kernels, the flags' cost per phase, decode against
  its floor, the train step per remat and loss chunk) are what `device_tables` renders
  from results/tpu-device-check/, to the character: a figure edited by hand, or a run
  made again without the docs following, fails."""
  from attnprec.bench import device_tables
  with open(os.path.join(ROOT, "docs", "performance.md"), encoding="utf-8") as f:
    section = f.read().split("## On a TPU v5e", 1)[1]
  rendered = device_tables.tables(os.path.join(ROOT, "results", "tpu-device-check"))
  assert set(rendered) == {"kernels", "flags", "decode", "train"}, sorted(rendered)
  missing = [name for name, table in rendered.items() if table not in section]
  assert not missing, missing


HELDOUT_ROWS = {"bf16 (both flags off)": "bf16",
                "bf16 + `key_offset='bias'`": "bf16_offset_bias",
                "bf16 + `key_offset='prefill_mean'`": "bf16_offset_mean",
                "fp32_qk": "fp32_qk"}


def test_the_heldout_table_is_the_study_records():
  """docs/precision.md's held-out table: each cell is its study's figure at the longest
  context, as the study's report writes it (`report._fmt`; bold marks the best), read
  from results/study-offset-heldout-qwen2.5-coder-{0.5b,1.5b}/results.json, both runs on
  the one frozen held-out text (`inputs.HELDOUT_SHA256`)."""
  from attnprec.study import inputs
  from attnprec.study.report import _fmt
  with open(os.path.join(ROOT, "docs", "precision.md"), encoding="utf-8") as f:
    text = f.read()
  header = "| setting | 0.5B logits KL, held-out |"
  rows = text.split(header, 1)[1].split("\n\n", 1)[0].splitlines()[2:]
  assert len(rows) == len(HELDOUT_ROWS), rows
  figures = {}
  for size in ("0.5b", "1.5b"):
    path = os.path.join(ROOT, "results", f"study-offset-heldout-qwen2.5-coder-{size}",
                        "results.json")
    with open(path, encoding="utf-8") as f:
      res = json.load(f)
    assert inputs.HELDOUT_SHA256.startswith(res["text"]["sha256"]), (size, res["text"])
    figures[size] = {c["name"]: c["per_length"][-1] for c in res["configs"]}
  for row in rows:
    label, *cells = [c.strip() for c in row.strip("|").split("|")]
    name = HELDOUT_ROWS[label]
    want = [_fmt(figures[size][name][key]) for size in ("0.5b", "1.5b")
            for key in ("logits_kl", "decode_logits_kl")]
    assert [c.strip("*") for c in cells] == want, (label, cells, want)


def test_the_parity_table_states_the_tests_tolerances():
  """docs/checkpoints.md's parity table: each row's tolerance is the constant its named
  test asserts (`TOL` / `LOGITS_TOL`), and each named test exists; a row naming a test
  without such a constant, or another tolerance, fails."""
  import os
  import re
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with open(os.path.join(root, "docs", "checkpoints.md"), encoding="utf-8") as f:
    text = f.read()
  start = text.index("| model | test | tolerance |")
  rows = [line for line in text[start:].split("\n\n")[0].split("\n")[2:] if line.strip()]
  assert len(rows) == 11, rows
  for row in rows:
    _, model, test, tolerance, _ = [c.strip() for c in row.split("|")]
    with open(os.path.join(root, test), encoding="utf-8") as f:
      source = f.read()
    constants = {float(v) for v in re.findall(r"(?m)^(?:LOGITS_)?TOL = ([0-9.e-]+)", source)}
    assert constants == {float(tolerance)}, (model, test, constants)
