"""The docs' TPU tables, rendered from the device check's files (`runners/device_check.py`
writes them; results/tpu-device-check/ holds the committed ones).

`tables(directory)` -> {name: markdown table}: docs/performance.md quotes each to the
character and a test holds it there (tests/test_docs.py), so a figure edited by hand, or
a run made again without the docs following, fails. `python runners/device_check.py
--tables=DIR` prints them for a new run's files.

Files read, each a device_check.json: device_check.json (kernels), device_check-flags.json,
device_check-decode.json, device_check-train.json; a table whose file is absent is left
out (a run of some parts only).
"""
import json
import math
import os
import re
from typing import Dict, Optional

from attnprec.errors import UserError

FILES = {"kernels": "device_check.json", "flags": "device_check-flags.json",
         "decode": "device_check-decode.json", "train": "device_check-train.json"}
KERNEL_ROWS = (("dot_product bf16", "dot_product, flags off (bf16)"),
               ("dot_product both flags", "dot_product, both flags"),
               ("blockwise both flags", "blockwise, both flags"),
               ("pallas both flags", "pallas, both flags"),
               ("flash both flags", "flash, both flags"),
               ("jax splash (flags-on semantics)",
                "jax splash attention (flags-on semantics)"))
PHASES = (("prefill", "prefill, 8 x 1024", "blockwise ('auto')"),
          ("decode", "decode step, batch 8", "dot_product ('auto' on a TPU)"),
          ("train", "train step, 1 x 1024", "dot_product (the default)"))


def _part(directory: str, name: str, key: str) -> Optional[dict]:
  path = os.path.join(directory, FILES[name])
  if not os.path.exists(path):
    return None
  try:
    with open(path, encoding="utf-8") as f:
      parts = json.load(f)["parts"]
    if not isinstance(parts, dict):
      raise TypeError(f"'parts' is a {type(parts).__name__}")
  except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
    raise UserError(f"{path} is not a device check's results file (device_check.json "
                    f"with a 'parts' object): {type(e).__name__}: {e}.") from None
  found = [v for k, v in parts.items() if k.startswith(key)]
  if found:
    _require_finite(found[0], f"{path}: part {key!r}")
  return found[0] if found else None


def _require_finite(x, where: str) -> None:
  """A UserError naming the field if any number in `x` is NaN or Inf: a table made from a
  broken run's figures would read like any other."""
  if isinstance(x, dict):
    for k, v in x.items():
      _require_finite(v, f"{where}, {k}")
  elif isinstance(x, (list, tuple)):
    for i, v in enumerate(x):
      _require_finite(v, f"{where}[{i}]")
  elif isinstance(x, float) and not math.isfinite(x):
    raise UserError(f"{where} is {x}: a table is rendered only from finite figures; run "
                    f"that part again.")


def _sig(x: float, digits: int = 2) -> str:
  """x to `digits` significant digits, as the docs write an error (2.3e-3, 0.018)."""
  if x >= 1e-2:
    return f"{x:.{digits}g}"
  mantissa, exponent = f"{x:.{digits - 1}e}".split("e")
  return f"{mantissa}e{int(exponent)}"


def kernels_table(part: dict) -> str:
  rows = part["rows"]
  lines = ["| kernel | median (ms) | / splash | relative L2 error | max abs error |",
           "|---|---:|---:|---:|---:|"]
  for key, label in KERNEL_ROWS:
    if key not in rows and key.startswith("flash"):   # a run made before the kernel
      continue
    r = rows[key]
    lines.append(f"| {label} | {r['median_ms']:.2f} | {r['time_vs_base']:.2f}x | "
                 f"{_sig(r['rel_l2'])} | {_sig(r['max_abs_error'])} |")
  return "\n".join(lines)


def flags_table(part: dict) -> str:
  med, ratio = part["median_s"], part["flags_over_no_flags"]
  lines = ["| phase | kernel run | bf16 | bf16 + both flags | flags / none |",
           "|---|---|---:|---:|---:|"]
  for phase, label, kernel in PHASES:
    off, on = med[f"{phase}/bf16"], med[f"{phase}/bf16_flags"]
    unit, f = ("ms", 1e3)
    lines.append(f"| {label} | {kernel} | {off * f:.{1 if off > 0.01 else 2}f} {unit} | "
                 f"{on * f:.{1 if on > 0.01 else 2}f} {unit} | {ratio[phase]:.2f}x |")
  return "\n".join(lines)


def decode_table(part: dict) -> str:
  lines = ["| batch x cache | step | HBM floor | step / floor |", "|---|---:|---:|---:|"]
  for case, r in part["cases"].items():
    B, P = case.split("x")
    lines.append(f"| {B} x {int(P) // 1024}k | {r['step_ms']:.2f} ms | {r['floor_ms']:.2f} ms "
                 f"| {r['over_floor']:.2f}x |")
  return "\n".join(lines)


def train_table(part: dict) -> str:
  lines = ["| tokens | kernel | remat | loss_chunk | temporaries | step | MFU |",
           "|---|---|---|---:|---:|---:|---:|"]
  for case, r in part["cases"].items():
    tokens, kernel, remat, chunk = case.split(" ")
    B, T = tokens.split("x")
    cells = [f"{B} x {T}", kernel, remat.split("=")[1], chunk.split("=")[1]]
    if "error" in r:
      cells += [_unfit(r["error"]), "", ""]
    else:
      cells += [f"{r['temp_gb']:.1f} GB (+ {r['args_gb']:.1f} GB state)",
                f"{r['step_ms']:.0f} ms", f"{100 * r['mfu']:.0f}%"]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def _unfit(error: str) -> str:
  """What XLA:TPU's out-of-memory error says a step needed: 'needs 53.27 GB' (its HLO
  temporaries) or '8.10 MB over' (the chip's capacity); 'failed' for another error."""
  m = re.search(r"required for HLO temporaries \(([\d.]+)([GM])\)", error)
  if m:
    return f"{m.group(1)} {m.group(2)}B: does not fit"
  m = re.search(r"Exceeded hbm capacity by ([\d.]+)([GMK])", error)
  if m:
    return f"{m.group(1)} {m.group(2)}B over"
  return "failed"


def tables(directory: str) -> Dict[str, str]:
  """{name: markdown table} for each of the device check's files in `directory`."""
  out = {}
  for name, key, render in (("kernels", "kernels", kernels_table),
                            ("flags", "flag cost", flags_table),
                            ("decode", "decode step", decode_table),
                            ("train", "train step", train_table)):
    part = _part(directory, name, key)
    if part is not None and "error" not in part:
      try:
        out[name] = render(part)
      except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        path = os.path.join(directory, FILES[name])
        raise UserError(f"{path}: part {key!r} is not what the device check writes "
                        f"({type(e).__name__}: {str(e)[:160]}; a figure that is not a "
                        f"number, or a field missing): edited or written by other code. "
                        f"Run the device check again for that part.") from None
  return out
