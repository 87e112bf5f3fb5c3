"""Every module that registers gin configurables, imported in one place, at the top.

gin can bind a configurable only once the module that registers it has been imported.
The runner layer (`attnprec.ginutils.parse`, called by `attnprec.cli` and the runners)
imports this module before it parses any gin file; library code never imports it, nor
the runner layer (`tests/test_imports.py` checks both), so the library stays plain
functions and dataclasses and the import graph has no cycles.

The names gin files bind (`model.*`, `precision.*`, `train.*`, `recall_eval.*`, ...) are
registered where each is defined; this list says which modules those are.
"""
# pylint: disable=unused-import
import attnprec.audit  # noqa: F401          audit.*
import attnprec.config  # noqa: F401         model.*
import attnprec.decoding  # noqa: F401       Greedy, Temperature, TopK, TopP samplers
import attnprec.evals.jobs  # noqa: F401     eval.*, humaneval.*
import attnprec.evals.sizes  # noqa: F401    sizes.*
import attnprec.faults  # noqa: F401         fault_injection.*
import attnprec.inspect.job  # noqa: F401    inspect.*
import attnprec.jobs  # noqa: F401           decode.*, train_job.*, recall_eval.*, ...
import attnprec.kernels  # noqa: F401        blockwise.* (block sizes)
import attnprec.lrsweep.job  # noqa: F401   lr_sweep.*
import attnprec.precision  # noqa: F401      precision.* (per phase)
import attnprec.sharding  # noqa: F401       mesh.*, distributed.*
import attnprec.study.nextline  # noqa: F401 nextline.*
import attnprec.study.sinks  # noqa: F401    sinks.*
import attnprec.study.sweep  # noqa: F401    study.*
import attnprec.tasks.recall  # noqa: F401   recall.*
import attnprec.tasks.text  # noqa: F401     text.*
import attnprec.train  # noqa: F401          train.*, optimizer.*
