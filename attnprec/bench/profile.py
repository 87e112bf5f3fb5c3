"""Where a prefill's (or a decode step's) time goes (`make bench ARGS=--suite=profile`):
XLA:CPU's own trace of the compiled program, per thunk, attributed to the model's stages
by the HLO's op names.

Method
  * The prefill is the program `make bench` times (`attnprec.bench.model._AttnprecCase`:
    `decoding.prefill` under the serving precision, compiled once); `phases=('decode',)`
    profiles its decode step after the prompt instead.
  * `jax.profiler.trace(..., create_perfetto_trace=True)` records `rounds` calls; XLA:CPU's
    thunk executor writes one event per executed thunk (a fusion, a dot, a copy, ...) with
    its HLO instruction's name (`args.hlo_op`). Containers (while, conditional, call) are
    left out where their bodies' thunks have their own events; a loop whose body XLA:CPU
    runs without them (the blockwise kernel's) is one stage, 'attention loop (blockwise)'.
  * Each instruction is attributed to a stage (`STAGES`) from the compiled HLO
    (`Compiled.as_text()`): a fusion or thunk with a dot is the dot's stage, told by its op
    name's module path (`attn/q|k|v|o`, `mlp/gate|up|down`, the logits head) or the
    kernel's named scopes (`contract.QK_SCOPE`, `contract.WV_SCOPE`); one without is told
    by the op names of what it computes (norms, RoPE, the kernel's softmax and mask, the
    MLP's activation, the key offset, the cache write, the embedding), and one that only
    moves or converts data (convert, copy, transpose, broadcast, slice, ...) is
    'copies / converts'.
  * Per stage: the summed thunk time per call (ms) and its share of the summed time of
    all thunks; beside it the call's wall time. XLA:CPU may run independent thunks on
    several threads, so the sum can exceed the wall time.
Shapes: B batch, P prompt length.
"""
import collections
import glob
import gzip
import json
import os
import re
import statistics
import tempfile
import time
from typing import Dict, List, NamedTuple, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from attnprec import contract, cpu_features

# What can be profiled: the prefill `make bench` times, or one decode step after it (on a
# copy of the prefill's state, which the step donates, made outside the timed call).
PHASES = ("prefill", "decode")
STAGES = ("projections q, k, v, o", "MLP projections", "logits head", "attention QK dot",
          "attention PV dot", "attention softmax and mask", "attention loop (blockwise)", "RoPE and biases", "key offset",
          "norms", "MLP activation", "embedding", "cache write", "copies / converts",
          "other dots", "other")
DATA_MOVEMENT = frozenset((
    "parameter", "constant", "convert", "copy", "transpose", "bitcast", "reshape",
    "broadcast", "slice", "dynamic-slice", "concatenate", "pad", "tuple",
    "get-tuple-element", "bitcast-convert", "iota", "reverse", "copy-start", "copy-done"))
CONTAINERS = frozenset(("while", "conditional", "call"))
DOTS = frozenset(("dot", "convolution"))
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"([a-z][a-z0-9\-]*)\(")
_COMP = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")


class Instr(collections.namedtuple("Instr", "name opcode op_name calls operands")):
  """One HLO instruction: its name, opcode, metadata op_name, called computations and
  operands (instruction names)."""


def parse_hlo(text: str) -> Tuple[Dict[str, Instr], Dict[str, List[str]]]:
  """({instruction name: Instr}, {computation name: [instruction names]}) of a compiled
  module's text (names are unique in a module)."""
  instrs, comps, current = {}, {}, None
  for line in text.splitlines():
    if current is None or line.strip() == "}":
      m = _COMP.match(line)
      current = m.group(1) if m else None
      if current is not None:
        comps[current] = []
      continue
    m = _INSTR.match(line)
    if not m:
      continue
    name, rest = m.groups()
    # the opcode is the first word before a "(": "f32[2,3]{1,0} fusion(%a, %b), ..." (a
    # shape holds none: "(f32[2]{0}, s32[]) tuple(...)")
    op = _OPCODE.search(rest)
    opcode = op.group(1) if op else ""
    operands = ()
    if op:
      depth, end = 1, op.end()
      while end < len(rest) and depth:
        depth += {"(": 1, ")": -1}.get(rest[end], 0)
        end += 1
      operands = tuple(re.findall(r"%([\w.\-]+)", rest[op.end():end]))
    op_name = re.search(r'op_name="([^"]*)"', rest)
    calls = re.findall(r"(?:calls|body|condition|to_apply|branch_computations)=\{?"
                       r"%?([\w.\-]+(?:,\s*%?[\w.\-]+)*)\}?", rest)
    called = [c.strip().lstrip("%") for group in calls for c in group.split(",")]
    instrs[name] = Instr(name, opcode, op_name.group(1) if op_name else "", tuple(called),
                         operands)
    comps[current].append(name)
  return instrs, comps


def _inner(name: str, instrs, comps, seen=None) -> List[Instr]:
  """The instruction and everything in the computations it calls (fusions nest)."""
  seen = set() if seen is None else seen
  out = [instrs[name]]
  for comp in instrs[name].calls:
    if comp in seen:
      continue
    seen.add(comp)
    for inner in comps.get(comp, ()):
      out.extend(_inner(inner, instrs, comps, seen))
  return out


def _dot_stage(op_name: str) -> str:
  if f"/{contract.QK_SCOPE}" in op_name:
    return "attention QK dot"
  if f"/{contract.WV_SCOPE}" in op_name:
    return "attention PV dot"
  if re.search(r"/attn/[qkvo]/", op_name):
    return "projections q, k, v, o"
  if re.search(r"/mlp/(gate|up|down)/", op_name):
    return "MLP projections"
  if "/decoder/" in op_name and "/layer_" not in op_name and "/layers/" not in op_name:
    return "logits head"       # the one dot outside the blocks: the unembedding
  return "other dots"


def _elementwise_stage(ops: List[Instr]) -> str:
  # XLA shares one constant among every use of its value (a 1.0 of the kernel's and of the
  # MLP's silu), so a constant's op name says nothing about the fusion it lands in
  names = [i.op_name for i in ops if i.op_name and i.opcode != "constant"]
  # a fusion is what it computes: one of only converts / copies (a weight cast to bf16 at
  # its use, named after the projection) is data movement, not that stage's arithmetic
  codes = {i.opcode for i in ops} - {"fusion"}
  has = lambda part: any(part in n for n in names)   # noqa: E731
  if codes <= DATA_MOVEMENT:
    return "copies / converts"
  if codes & {"scatter", "dynamic-update-slice"}:
    return "cache write"
  if has(contract.KEY_OFFSET_SCOPE):
    return "key offset"
  if has("/kernel/"):
    return "attention softmax and mask"
  if has("norm/"):
    return "norms"
  if has("/mlp/"):
    return "MLP activation"
  if has("/attn/"):
    return "RoPE and biases"
  if codes & {"gather"} or has("_take"):
    return "embedding"
  return "other"


def _named_near(name: str, instrs, comps, users, forward: bool, depth: int = 4) -> List[str]:
  """Op names of the instructions that feed `name` (or use it: `forward`), looking through
  unnamed ones (a dot whose fusion XLA:CPU rewrote without metadata) up to `depth` steps."""
  found, frontier = [], [name]
  for _ in range(depth):
    nxt = []
    for n in frontier:
      for m in (users.get(n, ()) if forward else instrs[n].operands):
        if m not in instrs:
          continue
        named = [i.op_name for i in _inner(m, instrs, comps) if i.op_name]
        found.extend(named)
        if not named:
          nxt.append(m)
    if found:
      return found
    frontier = nxt
  return found


def _exp_upstream(name: str, instrs, comps, depth: int = 4) -> bool:
  """Whether an exp (the softmax's) computes one of `name`'s operands, looking back
  through up to `depth` instructions (converts, copies, fusions)."""
  frontier = list(instrs[name].operands)
  for _ in range(depth):
    nxt = []
    for n in frontier:
      if n not in instrs:
        continue
      inner = _inner(n, instrs, comps)
      if any(i.opcode in ("exponential", "exp") for i in inner):
        return True
      if instrs[n].opcode not in DOTS:
        nxt.extend(instrs[n].operands)
    frontier = nxt
  return False


def stage_of(name: str, instrs, comps, users=None) -> str:
  """The stage (`STAGES`) an executed instruction's time belongs to. A dot without an op
  name (XLA:CPU drops the metadata of some rewritten attention dots) is the kernel's PV
  dot when what feeds it was computed in the kernel (the probabilities), its QK dot when
  what uses it is."""
  ops = _inner(name, instrs, comps)
  dots = [i for i in ops if i.opcode in DOTS]
  if dots:
    named = [d.op_name for d in dots if d.op_name]
    if named:
      return _dot_stage(named[0])
    if users is not None:
      kernel = lambda names: any("/kernel/" in n for n in names)   # noqa: E731
      back = _named_near(name, instrs, comps, users, forward=False)
      if kernel(back) or kernel(_named_near(name, instrs, comps, users, forward=True)):
        # the PV dot's operand is the probabilities: an exp upstream, in the kernel
        return "attention PV dot" if _exp_upstream(name, instrs, comps) else \
            "attention QK dot"
    return "other dots"
  return _elementwise_stage(ops)


def users_of(instrs) -> Dict[str, List[str]]:
  """{instruction: the instructions that take it as an operand}."""
  users = collections.defaultdict(list)
  for i in instrs.values():
    for o in i.operands:
      users[o].append(i.name)
  return users


def thunk_times(trace_dir: str) -> Dict[Tuple[str, str], float]:
  """{(hlo module, hlo op): summed duration in microseconds} from the newest perfetto
  trace under `trace_dir`."""
  paths = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"),
                           recursive=True), key=os.path.getmtime)
  if not paths:
    raise RuntimeError(f"jax.profiler wrote no perfetto trace under {trace_dir}")
  with gzip.open(paths[-1], "rt") as f:
    data = json.load(f)
  events = data["traceEvents"] if isinstance(data, dict) else data
  out = collections.defaultdict(float)
  for e in events:
    args = e.get("args") or {}
    if e.get("ph") == "X" and "hlo_op" in args:
      out[(args.get("hlo_module", ""), args["hlo_op"])] += float(e.get("dur", 0.0))
  return dict(out)


class Trace(NamedTuple):
  """`rounds` traced calls of one compiled program: its parsed HLO and its thunks' times."""
  instrs: Dict[str, Instr]          # parse_hlo's instructions of the program's module
  comps: Dict[str, List[str]]       # ... and its computations
  op_us: Dict[str, float]           # {hlo op of the module: summed microseconds, all rounds}
  walls: List[float]                # each traced call's wall time, seconds
  rounds: int


def trace_program(compiled, call, rounds: int = 3, fresh=None) -> Trace:
  """Traces `rounds` calls of `call()` (which runs `compiled`, a `jax.stages.Compiled`)
  after one untimed call, with XLA:CPU's per-thunk trace events. fresh: made before each
  call, outside its wall time, and passed to it (`call(fresh())`): the inputs a call
  donates (a decode step's state)."""
  text = compiled.as_text()
  instrs, comps = parse_hlo(text)
  module = re.search(r"^HloModule\s+([\w.\-]+)", text, re.M).group(1)
  run = call if fresh is None else (lambda: call(jax.block_until_ready(fresh())))
  jax.block_until_ready(run())                       # warm
  walls = []
  with tempfile.TemporaryDirectory(prefix="attnprec-profile-") as tmp:
    with jax.profiler.trace(tmp, create_perfetto_trace=True):
      for _ in range(rounds):
        args = None if fresh is None else jax.block_until_ready(fresh())
        t0 = time.perf_counter()
        jax.block_until_ready(call() if fresh is None else call(args))
        walls.append(time.perf_counter() - t0)
    times = thunk_times(tmp)
  return Trace(instrs, comps, {op: us for (mod, op), us in times.items() if mod == module},
               walls, rounds)


def profile_program(compiled, call, rounds: int = 3, fresh=None) -> dict:
  """Per-stage time of `call()` (which runs `compiled`, a `jax.stages.Compiled`), from
  `rounds` traced calls (`trace_program`): {"stages": {stage: ms per call}, "wall_ms":
  median, "thunks_ms": summed thunk time per call, "unattributed": [hlo ops not in the
  module]}. fresh: as for `trace_program`."""
  trace = trace_program(compiled, call, rounds, fresh)
  instrs, comps = trace.instrs, trace.comps
  users = users_of(instrs)
  stages = collections.defaultdict(float)
  missing = []
  seen = set(trace.op_us)
  for op, us in trace.op_us.items():
    if op not in instrs:
      missing.append(op)
      continue
    if instrs[op].opcode in CONTAINERS:
      inner = {i.name for i in _inner(op, instrs, comps)} - {op}
      if inner & seen:
        continue          # its body's thunks have their own events
      # XLA:CPU runs some loop bodies without an event per thunk: the loop is one stage
      names = [i.op_name for i in _inner(op, instrs, comps)]
      stage = ("attention loop (blockwise)" if any("/kernel/" in n for n in names)
               else stage_of(op, instrs, comps, users))
    else:
      stage = stage_of(op, instrs, comps, users)
    stages[stage] += us / 1e3 / rounds
  return {"stages": {s: stages.get(s, 0.0) for s in STAGES},
          "wall_ms": statistics.median(trace.walls) * 1e3,
          "thunks_ms": sum(stages.values()), "unattributed": sorted(set(missing))}


def run_profile(*, models: Sequence[str] = ("smollm2-135m",),
                cases: Sequence[Tuple[int, int]] = ((1, 1000), (1, 4000)),
                presets: Sequence[str] = ("bf16_flags",), rounds: int = 3,
                phases: Sequence[str] = ("prefill",), progress: bool = True, on_row=None,
                load=None) -> dict:
  """Each phase (PHASES: the prefill of the case's prompt, or one decode step after it)
  of each model x case x preset (`bench.model.PRESETS`), profiled; plain data. on_row:
  called with the result so far after each row; load: model name -> a checkpoint
  (`.config`, `.params`), `checkpoints.load` by default."""
  from attnprec import checkpoints
  from attnprec.bench import model as model_bench
  from attnprec.errors import UserError
  for name in presets:
    if name not in model_bench.PRESETS:
      raise UserError(f"Unknown bench preset {name!r}; valid: {list(model_bench.PRESETS)}.")
  for name in list(phases) or [None]:
    if name not in PHASES:
      raise UserError(f"Unknown profile phase {name!r} (phases={list(phases)}); valid: a "
                      f"non-empty list of {list(PHASES)}.")
  log = print if progress else (lambda *a, **k: None)
  result = dict(config=dict(models=list(models), cases=[list(c) for c in cases],
                            presets=list(presets), phases=list(phases), rounds=rounds,
                            jax=jax.__version__,
                            cpu_count=os.cpu_count(), cpu=cpu_features.describe(),
                            xla_flags=os.environ.get("XLA_FLAGS", "")), rows=[])
  rng = np.random.default_rng(0)
  for model in models:
    ckpt = (load or checkpoints.load)(model)
    carried = {}
    for B, P in cases:
      prompt = rng.integers(0, ckpt.config.vocab_size, (B, P)).astype(np.int32)
      for preset in presets:
        log(f"profile: {model} {B}x{P} {preset}", flush=True)
        case = model_bench._AttnprecCase(ckpt.config, ckpt.params,
                                         model_bench.PRESETS[preset], prompt, 1,
                                         carried=carried, carried_prefill=preset in
                                         model_bench.CARRIED_PREFILL,
                                         label=f"profile {model} {B}x{P} {preset}")
        for phase in phases:
          if phase == "prefill":    # its logits checked when the case was built
            row = profile_program(case._prefill, case.run_prefill, rounds)
          else:   # one decode step on a fresh copy of the prefill's state (it is donated)
            case.check_decode()
            row = profile_program(
                case._decode, lambda state: case._decode(case.params, state, case.first),
                rounds, fresh=lambda: jax.tree_util.tree_map(jnp.copy, case.state0))
          row.update(model=model, batch=B, prompt=P, preset=preset, phase=phase,
                     flops=model_bench.projection_flops(
                         ckpt.params, ckpt.config, B, P if phase == "prefill" else 1))
          result["rows"].append(row)
          if on_row is not None:
            on_row(result)
        del case
  result["complete"] = True
  return result


def _label(row) -> str:
  """'model BxP preset', and ', decode step' for a decode row."""
  step = ", decode step" if row.get("phase", "prefill") == "decode" else ""
  return f"{row['model']} {row['batch']}x{row['prompt']} {row['preset']}{step}"


def to_markdown(result: dict) -> str:
  """One table per row: stage, ms per call, share of the thunks' summed time."""
  cfg = result["config"]
  out = [f"CPU: {cfg['cpu']}, {cfg['cpu_count']} cores; jax {cfg['jax']}; "
         f"XLA_FLAGS={cfg['xla_flags'] or '(none)'}; {cfg['rounds']} traced calls per row."
         + ("" if result.get("complete") else " PARTIAL: the run stopped before its last "
            "row; the rows below are those it finished."), ""]
  rows = result["rows"]
  if not rows:
    return "\n".join(out + ["(no rows)"])
  head = " | ".join(_label(r) for r in rows)
  out += [f"| stage | {head} |", "|---|" + "---:|" * len(rows)]
  for stage in STAGES:
    cells = []
    for r in rows:
      ms, total = r["stages"][stage], r["thunks_ms"] or 1.0
      cells.append(f"{ms:.1f} ms ({100 * ms / total:.0f}%)" if ms else "-")
    out.append(f"| {stage} | " + " | ".join(cells) + " |")
  out.append("| **all thunks** | " + " | ".join(f"{r['thunks_ms']:.1f} ms" for r in rows)
             + " |")
  out.append("| wall time per call | " + " | ".join(f"{r['wall_ms']:.1f} ms" for r in rows)
             + " |")
  dense = ("projections q, k, v, o", "MLP projections", "logits head")
  out.append("| dense dots' share | " + " | ".join(
      f"{100 * sum(r['stages'][s] for s in dense) / (r['thunks_ms'] or 1):.0f}%"
      for r in rows) + " |")
  return "\n".join(out)


def plot(result: dict, path: str) -> str:
  """One horizontal bar per row, split into each stage's share of the thunk time; the
  row's thunk and wall time per call at its end. Returns the path."""
  from attnprec import plotting
  plt = plotting.pyplot()
  rows = result["rows"]
  labels = [_label(r) for r in rows]
  fig, ax = plt.subplots(figsize=(10, 0.55 * len(rows) + 2.6))
  left = np.zeros(len(rows))
  cmap = plt.get_cmap("tab20")
  total = np.array([r["thunks_ms"] or 1.0 for r in rows])
  for k, stage in enumerate(STAGES):
    share = 100 * np.array([r["stages"][stage] for r in rows]) / total
    if not share.any():
      continue
    ax.barh(labels, share, left=left, color=cmap(k % 20), label=stage)
    left += share
  for y, r in enumerate(rows):
    ax.text(101, y, f"{r['thunks_ms'] / 1e3:.1f} s thunks, {r['wall_ms'] / 1e3:.1f} s wall",
            va="center", fontsize=7)
  ax.set_xlim(0, 130)
  ax.set_xlabel("share of the prefill's thunk time, %")
  ax.set_title("Where the prefill's time goes (XLA:CPU per-thunk trace)")
  ax.invert_yaxis()
  ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.16))
  fig.tight_layout()
  return plotting.save_figure(fig, path)
