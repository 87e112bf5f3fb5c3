"""Where a call's time goes on an accelerator, read from the chip: the device planes'
events of one call under `jax.profiler`, summed by op name (`jax.profiler.ProfileData`).
XLA:CPU records no device plane, so there the answer is empty."""
import os
import tempfile

import jax


def device_ops(fn, top=30):
  """{op name: (total µs, count)} of the device planes' events during one call of `fn`,
  the `top` longest; {} where the profiler records no device plane (XLA:CPU)."""
  with tempfile.TemporaryDirectory() as d:
    jax.profiler.start_trace(d)
    try:
      fn()
    finally:
      jax.profiler.stop_trace()
    totals = {}
    for root, _, files in os.walk(d):
      for name in files:
        if not name.endswith(".xplane.pb"):
          continue
        with open(os.path.join(root, name), "rb") as f:
          data = jax.profiler.ProfileData.from_serialized_xspace(f.read())
        for plane in data.planes:
          if not plane.name.startswith("/device:"):
            continue
          for line in plane.lines:
            if line.name not in ("XLA Ops", "Ops"):
              totals.setdefault(f"(line {plane.name} {line.name})", (0.0, 0))
              continue
            for e in line.events:
              t, n = totals.get(e.name, (0.0, 0))
              totals[e.name] = (t + e.duration_ns / 1e3, n + 1)
  return dict(sorted(totals.items(), key=lambda kv: -kv[1][0])[:top])
