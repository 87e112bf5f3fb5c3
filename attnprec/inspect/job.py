"""`make inspect FN=package.module:function [INPUTS=... | SHAPES=...] [GIN=...]`.

Loads the user's function, builds its example inputs, reports every attention in its
lowered program and writes inspect.json / inspect.md into the run directory.

Inputs, one of:
  inspect.inputs = 'package.module:make_inputs'  a function of no arguments returning
      (args, kwargs): arrays, pytrees of arrays or jax.ShapeDtypeStructs;
  inspect.shapes = 'bf16[2,8,4,16] bf16[2,8,4,16] i32[]'  positional arguments as
      shapes (nothing is computed: the program is only lowered);
  neither: the function takes no arguments.

The Precision to check against (`inspect.expect`): 'auto' (default) uses the
`precision.*` bindings if there are any (a gin/precision/ file) and only reports
otherwise; 'train' / 'decode' the Precision of that phase's scope; 'none' only reports.

The platform (`platform`, the runner's --platform: 'cpu', 'tpu', 'cuda'): the function is
lowered for it on this machine and, with a Precision stated, its dots are also read under
that platform's precision semantics (`attnprec.platforms`); a precision the platform does
not accept is refused first. A function that cannot be lowered for it here (cuDNN's fused
attention needs cuDNN on the machine) is a UserError saying so.
"""
import importlib
import os
import re
import sys
import types
from typing import Optional

import gin
import jax
import jax.numpy as jnp

from attnprec import platforms, runs
from attnprec.errors import UserError, choice_error
from attnprec.inspect import check_expect_readable, inspect_lowered
from attnprec.inspect.report import Report, local_platform
from attnprec.precision import phase_precision, target_backend

EXPECT = ("auto", "none", "train", "decode")
SHAPE_DTYPES = {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32,
                "f64": jnp.float64, "i8": jnp.int8, "i32": jnp.int32, "i64": jnp.int64,
                "u8": jnp.uint8, "u32": jnp.uint32, "bool": jnp.bool_}
_SHAPE = re.compile(r"^(?P<dtype>\w+)\[(?P<dims>[0-9, ]*)\]$")


def load_callable(spec: str, what: str):
  """'package.module:name' (name may be dotted) -> the object, or a UserError."""
  if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
    raise UserError(f"{what}={spec!r} is not of the form 'package.module:function', "
                    f"e.g. 'attnprec.inspect.examples:maxtext_attention'.")
  module_name, attr = spec.split(":")
  if os.getcwd() not in sys.path:
    sys.path.append(os.getcwd())     # the user's own modules, from where make runs
  try:
    module = importlib.import_module(module_name)
  except Exception as e:  # noqa: BLE001 -- any failure to import is the user's input
    raise UserError(f"Cannot import module {module_name!r} named by {what}={spec!r}: "
                    f"{type(e).__name__}: {e}. The module must be importable from the "
                    f"working directory or PYTHONPATH.") from None
  obj = module
  for part in attr.split("."):
    if not hasattr(obj, part):
      names = sorted(n for n in dir(module) if not n.startswith("_")
                     and isinstance(getattr(module, n), types.FunctionType))
      raise UserError(f"Module {module_name!r} has no attribute {attr!r} ({what}="
                      f"{spec!r}); its public callables are: "
                      f"{', '.join(names[:30]) or '(none)'}.")
    obj = getattr(obj, part)
  if not callable(obj):
    raise UserError(f"{what}={spec!r} names a {type(obj).__name__}, not a function.")
  return obj


def parse_shapes(text: str) -> tuple:
  """'bf16[2,8] i32[]' -> (ShapeDtypeStruct((2, 8), bf16), ShapeDtypeStruct((), i32))."""
  out = []
  for item in text.split():
    m = _SHAPE.match(item)
    if not m or m.group("dtype") not in SHAPE_DTYPES:
      raise UserError(f"Invalid shape {item!r} in inspect.shapes={text!r}; write "
                      f"DTYPE[D0,D1,...] separated by spaces, e.g. 'bf16[2,8,4,16] i32[]', "
                      f"with DTYPE one of: {', '.join(SHAPE_DTYPES)}.")
    dims = tuple(int(d) for d in m.group("dims").replace(" ", "").split(",") if d)
    if m.group("dtype") in ("f64", "i64") and not jax.config.jax_enable_x64:
      raise UserError(f"inspect.shapes={text!r} asks for {m.group('dtype')}, but 64-bit "
                      f"types are off in this process (jax_enable_x64 is False), so jax "
                      f"would lower {m.group('dtype')[0]}32 instead and the report would "
                      f"describe another program. Set JAX_ENABLE_X64=1 in the environment, "
                      f"or use f32 / i32.")
    out.append(jax.ShapeDtypeStruct(dims, SHAPE_DTYPES[m.group("dtype")]))
  return tuple(out)


def build_inputs(inputs: Optional[str], shapes: Optional[str]):
  """(args, kwargs) from the inputs hook or the shapes (see the module docstring)."""
  if inputs is not None and shapes is not None:
    raise UserError(f"Set one of inspect.inputs ({inputs!r}) and inspect.shapes "
                    f"({shapes!r}), not both.")
  if shapes is not None:
    return parse_shapes(shapes), {}
  if inputs is None:
    return (), {}
  hook = load_callable(inputs, "inspect.inputs")
  try:
    built = hook()
  except Exception as e:  # noqa: BLE001
    raise UserError(f"inspect.inputs={inputs!r} raised {type(e).__name__}: {e}") from None
  if not (isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], (tuple, list))
          and isinstance(built[1], dict)):
    raise UserError(f"inspect.inputs={inputs!r} must return (args, kwargs): a tuple of "
                    f"positional arguments and a dict of keyword arguments; it returned "
                    f"a {type(built).__name__}.")
  return tuple(built[0]), built[1]


def _precision_bound() -> bool:
  """Whether any `precision.*` binding was parsed (a gin/precision/ file, a flag)."""
  for line in gin.config_str().splitlines():
    name = line.split("=")[0].strip()
    if name.split("/")[-1].startswith("precision."):
      return True
  return False


def expected_precision(expect: str):
  if expect not in EXPECT:
    raise choice_error("inspect.expect", expect, EXPECT)
  bound = _precision_bound()
  if expect == "none":
    if bound:
      raise UserError("precision.* is set but inspect.expect is 'none', so it would not "
                      "be used; drop the precision bindings or set inspect.expect to "
                      "'auto', 'decode' or 'train'.")
    return None
  if expect == "auto":
    if not bound:
      return None
    expect = "decode"
  with gin.config_scope(expect):
    return phase_precision()


def lower_for(function, platform: str, args, kwargs):
  """`jax.jit(function)` lowered for `platform`: as before on the platform this process
  runs on, else with `lowering_platforms` (nothing is compiled)."""
  jitted = jax.jit(function)
  if platform == local_platform():
    return jitted.lower(*args, **kwargs)
  # traced for the target's backend: 'auto' settings resolve for it, not this machine
  with target_backend(platforms.TABLE[platform].backend):
    traced = jitted.trace(*args, **kwargs)
  return traced.lower(lowering_platforms=(platform,))


def lowering_error(fn: str, platform: str, e: Exception, inputs: str) -> UserError:
  """The paragraph for a function that could not be lowered (for `platform`)."""
  first = str(e).strip().splitlines()[0] if str(e).strip() else ""
  if "cudnn" in str(e).lower():
    return UserError(f"Lowering {fn} for platform {platform!r} failed: it calls cuDNN "
                     f"(e.g. jax.nn.dot_product_attention(implementation='cudnn')), and "
                     f"jax builds a cuDNN call only where it finds cuDNN, which this "
                     f"machine has not ({type(e).__name__}: {first}). Lower it with "
                     f"implementation='xla' here, or run it on a GPU machine (make "
                     f"device-check).")
  if "unsupported tpu device kind" in str(e).lower():
    return UserError(f"Lowering {fn} for platform {platform!r} failed here: its Mosaic "
                     f"lowering asks which TPU generation it runs on ({type(e).__name__}: "
                     f"{first}), and this machine has no TPU. Run `make inspect ... "
                     f"ARGS=--platform=tpu` on a TPU machine (docs/tpu.md), where the same "
                     f"command reads its kernel body.")
  where = "" if platform == "cpu" else f" for platform {platform!r}"
  return UserError(f"Lowering {fn}{where} on the given inputs failed: {type(e).__name__}: "
                   f"{first} (inputs: {inputs}).")


@gin.configurable("inspect", denylist=["run_dir", "platform"])
def inspect_job(*, run_dir: str, fn: Optional[str] = None, inputs: Optional[str] = None,
                shapes: Optional[str] = None, expect: str = "auto",
                platform: str = platforms.DEFAULT_PLATFORM) -> Report:
  """Writes inspect.json and inspect.md into run_dir; returns the Report."""
  platforms.check(platform)
  if fn is None:
    raise UserError("No function to inspect: set inspect.fn, e.g. make inspect "
                    "FN=attnprec.inspect.examples:maxtext_attention "
                    "INPUTS=attnprec.inspect.examples:maxtext_inputs.")
  runs.check_writable(run_dir)
  function = load_callable(fn, "inspect.fn")
  precision = expected_precision(expect)
  if precision is not None:
    platforms.check_precision(platform, precision)
    check_expect_readable(precision, f"The expected precision ({expect} phase)")
  args, kwargs = build_inputs(inputs, shapes)
  try:
    lowered = lower_for(function, platform, args, kwargs)
  except Exception as e:  # noqa: BLE001 -- the user's function on the user's inputs
    raise lowering_error(fn, platform, e, inputs or shapes or "none") from None
  report = inspect_lowered(lowered, expect=precision, function=fn, platform=platform)
  paths = report.write(run_dir)
  print(f"function: {fn}" + ("" if platform == "cpu" else f" (lowered for {platform})"))
  backend = platforms.TABLE[platform].backend     # 'auto' forms as the program ran them
  print(f"expected: {precision.describe(backend) if precision else '(no Precision stated)'}")
  print(report.attention_table())
  print()
  print(report.dense_table())
  print()
  if report.kernels:
    print(report.kernel_table())
    print()
  print(report.verdict())
  print(f"wrote {paths[0]} and {os.path.basename(paths[1])}")
  return report
