"""Tokenizers built offline from a GGUF file's metadata (or an HF `tokenizer.json`).

    tok = checkpoint.tokenizer
    ids = tok.encode("Hello")              # adds BOS when the model expects it (Gemma)
    text = tok.decode(ids)                 # special tokens skipped by default
    ids = tok.encode_chat([{"role": "user", "content": "Hi"}])   # ChatML models

Only the `tokenizers` library is used at run time (no transformers, no hub). A GGUF stores
the vocabulary (`tokenizer.ggml.tokens`), token types (1 normal, 3 control, 4 user-defined,
6 byte), merges, and special ids under llama.cpp's key names; we rebuild the tokenizer the
model was trained with, as transformers' `integrations/gguf` does:

* `tokenizer.ggml.model == "gpt2"` (SmolLM2): byte-level BPE. The text is split as
  `tokenizer.ggml.pre` says: `smollm` splits digits one by one, then applies GPT-2's regex
  (as SmolLM2's own `tokenizer.json`); `qwen2` and `llama-bpe` use those models' regexes;
  `default` is GPT-2's. Tokens outside the byte alphabet are re-spelled in it.
* `tokenizer.ggml.model == "llama"` for gemma/gemma2/gemma3: SentencePiece-style BPE with
  byte fallback: spaces become "▁", no prefix space. The file lists no merges, so they are
  rebuilt from the vocabulary, ordered by the tokens' position in the file (Gemma's scores
  do not follow its merge order). Tokens made only of spaces are stored with real spaces
  and are re-spelled with "▁" so the merges find them.

Control tokens become special added tokens (never split; skipped when decoding);
user-defined tokens (Gemma's newline and tab runs) become plain added tokens, matched whole.
BOS is added by `encode` itself (`add_bos`, default from `tokenizer.ggml.add_bos_token`),
never by a post-processor, so it is explicit.
"""
import functools
import json
import pathlib
from typing import Dict, List, Optional, Sequence

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers

from attnprec.errors import UserError

CONTROL, USER_DEFINED = 3, 4
# A chat template renders in jinja2's sandbox (no attribute access to Python internals)
# and is stopped once its output passes RENDER_LIMIT_CHARS + 4 x the messages' length, or
# its range() loops pass RANGE_LIMIT items in all: a template that loops to produce
# gigabytes fails in well under a second.
RENDER_LIMIT_CHARS = 1 << 20
RANGE_LIMIT = 1_000_000


class _TemplateTooLarge(Exception):
  pass
SPACE = "\u2581"    # SentencePiece's visible space "▁"
_GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")
_FORMAT = "attnprec-tokenizer-1"


class Tokenizer:
  """A `tokenizers.Tokenizer` plus the model's special ids and chat template."""

  def __init__(self, backend: tokenizers.Tokenizer, *, bos_id: Optional[int],
               eos_id: Optional[int], pad_id: Optional[int] = None, add_bos: bool = False,
               chat_template: Optional[str] = None):
    self.backend = backend
    self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
    self.add_bos = add_bos                  # the model's default for `encode`
    self.chat_template = chat_template      # the Jinja source, as shipped (for reference)

  @property
  def vocab_size(self) -> int:
    return self.backend.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str, *, add_bos: Optional[bool] = None) -> List[int]:
    """Token ids of `text`; BOS first if `add_bos` (None: the model's default)."""
    ids = self.backend.encode(text, add_special_tokens=False).ids
    if (self.add_bos if add_bos is None else add_bos):
      if self.bos_id is None:
        raise UserError("This tokenizer has no BOS token; call encode(..., add_bos=False).")
      ids = [self.bos_id] + ids
    return ids

  def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
    return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special)

  def token(self, i: int) -> Optional[str]:
    return self.backend.id_to_token(int(i))

  # -- chat -----------------------------------------------------------------------------
  def apply_chat_template(self, messages: Sequence[Dict[str, str]], *,
                          add_generation_prompt: bool = True) -> str:
    """The prompt text for `messages` ([{"role", "content"}]): the model's own Jinja chat
    template rendered as transformers renders it (a sandboxed jinja2 environment with
    `trim_blocks`/`lstrip_blocks`, `tojson`, `raise_exception`; `tools` unset), so the
    template's default system message (SmolLM2's, Qwen's) comes out exactly as shipped.
    """
    if not self.chat_template:
      raise UserError("This model has no chat template (a base model); format the prompt "
                      "yourself and call encode().")
    for k, m in enumerate(messages):
      if set(m) - {"role", "content"} or not {"role", "content"} <= set(m):
        raise UserError(f"Chat message {k} must have exactly 'role' and 'content', got "
                        f"{sorted(m)}.")
    special = lambda i: None if i is None else self.token(i)   # noqa: E731
    given = sum(len(str(m["content"])) for m in messages)
    limit = RENDER_LIMIT_CHARS + 4 * given
    budget = [RANGE_LIMIT]

    def bounded_range(*args):
      r = range(*args)
      budget[0] -= len(r)
      if budget[0] < 0:
        raise _TemplateTooLarge(f"its loops run over more than {RANGE_LIMIT} range() items")
      return r

    try:
      parts, size = [], 0
      for part in _compiled_template(self.chat_template).generate(
          messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
          tools=None, bos_token=special(self.bos_id) or "",
          eos_token=special(self.eos_id) or "", range=bounded_range):
        size += len(part)
        if size > limit:
          raise _TemplateTooLarge(f"its output passed {limit} characters")
        parts.append(part)
      return "".join(parts)
    except _TemplateTooLarge as e:
      raise UserError(f"The model's chat template was stopped: {e} for messages of {given} "
                      f"characters (a shipped template renders a few hundred characters "
                      f"around them). The template is broken or hostile; pass the prompt "
                      f"without the chat template (chat=False) or fix the template.") \
          from None
    except jinja2.TemplateError as e:
      raise UserError(f"The model's chat template cannot render these messages ({e}).") \
          from None
    except RecursionError:
      raise UserError("The model's chat template cannot render these messages: it recurses "
                      "without end (a macro calling itself).") from None

  def encode_chat(self, messages, *, add_generation_prompt: bool = True) -> List[int]:
    """Token ids of the chat prompt (no extra BOS: the template writes what it needs)."""
    return self.encode(self.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt), add_bos=False)

  # -- serialization (the checkpoint cache) ---------------------------------------------
  def save(self, directory) -> None:
    """Writes `tokenizer.json` (the backend) and `tokenizer_meta.json` into `directory`."""
    directory = pathlib.Path(directory)
    self.backend.save(str(directory / "tokenizer.json"))
    meta = dict(format=_FORMAT, bos_id=self.bos_id, eos_id=self.eos_id, pad_id=self.pad_id,
                add_bos=self.add_bos, chat_template=self.chat_template)
    (directory / "tokenizer_meta.json").write_text(json.dumps(meta), encoding="utf-8")

  @classmethod
  def load(cls, directory) -> "Tokenizer":
    """Reads what `save` wrote."""
    directory = pathlib.Path(directory)
    meta = json.loads((directory / "tokenizer_meta.json").read_text(encoding="utf-8"))
    if meta.pop("format", None) != _FORMAT:
      raise ValueError(f"{directory} holds no {_FORMAT} tokenizer")
    return cls(tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json")), **meta)

  # -- builders -------------------------------------------------------------------------
  @classmethod
  def from_gguf_metadata(cls, meta: dict, *, origin: str = "GGUF file") -> "Tokenizer":
    """Builds the tokenizer a GGUF's `tokenizer.ggml.*` metadata describes."""
    kind = meta.get("tokenizer.ggml.model")
    arch = meta.get("general.architecture")
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is None:
      raise UserError(f"{origin} has no tokenizer.ggml.tokens; it carries no tokenizer.")
    tokens = list(tokens)
    types = [int(t) for t in meta.get("tokenizer.ggml.token_type", [1] * len(tokens))]
    if kind == "gpt2":
      backend = _byte_level_bpe(tokens, types, meta.get("tokenizer.ggml.merges"),
                                meta.get("tokenizer.ggml.pre", "default"), origin)
    elif kind == "llama" and arch in _GEMMA_ARCHS:
      unk = meta.get("tokenizer.ggml.unknown_token_id")
      backend = _gemma_bpe(tokens, types, None if unk is None else tokens[unk])
    else:
      raise UserError(f"{origin}: unsupported tokenizer {kind!r} for architecture {arch!r}; "
                      f"supported: 'gpt2' (byte-level BPE, e.g. SmolLM2) and 'llama' for "
                      f"{', '.join(_GEMMA_ARCHS)} (SentencePiece-style BPE).")

    def special(key):
      v = meta.get(f"tokenizer.ggml.{key}")
      return None if v is None else int(v)

    return cls(backend, bos_id=special("bos_token_id"), eos_id=special("eos_token_id"),
               pad_id=special("padding_token_id"),
               add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")),
               chat_template=meta.get("tokenizer.chat_template"))

  @classmethod
  def from_hf_dir(cls, directory) -> Optional["Tokenizer"]:
    """From `tokenizer.json` (+ `tokenizer_config.json`, `chat_template.jinja`), or None
    if the directory has no tokenizer.json."""
    directory = pathlib.Path(directory)
    path = directory / "tokenizer.json"
    if not path.is_file():
      return None
    try:
      backend = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON
      raise UserError(f"Cannot read tokenizer file {path}: {e}.") from None
    cfg = {}
    if (directory / "tokenizer_config.json").is_file():
      cfg = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))

    def token_id(key):
      tok = cfg.get(key)
      tok = tok.get("content") if isinstance(tok, dict) else tok
      return backend.token_to_id(tok) if tok else None

    template = cfg.get("chat_template")
    if (directory / "chat_template.jinja").is_file():   # where transformers 5 saves it
      template = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    bos_id = token_id("bos_token")
    # Does the shipped post-processor add BOS? Then the model expects it.
    probe = backend.encode("a", add_special_tokens=True).ids
    add_bos = cfg.get("add_bos_token", bool(probe) and probe[0] == bos_id)
    return cls(backend, bos_id=bos_id, eos_id=token_id("eos_token"),
               pad_id=token_id("pad_token"), add_bos=bool(add_bos and bos_id is not None),
               chat_template=template)


class _BoundedSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
  """The sandbox, with `*` and `**` refused where they would build a value past the
  render limit ('x' * 10**9 allocates a gigabyte before any output is produced)."""
  intercepted_binops = frozenset(["*", "**"])

  def call_binop(self, context, operator, left, right):
    if operator == "*":
      for seq, n in ((left, right), (right, left)):
        if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and \
            len(seq) * n > RENDER_LIMIT_CHARS:
          raise _TemplateTooLarge(f"it multiplies a value of length {len(seq)} by {n}")
    if operator == "**" and isinstance(right, (int, float)) and abs(right) > 1024:
      raise _TemplateTooLarge(f"it raises a number to the power {right}")
    return super().call_binop(context, operator, left, right)


@functools.lru_cache(maxsize=8)
def _compiled_template(source: str) -> jinja2.Template:
  """A chat template compiled as transformers compiles it."""
  def raise_exception(message):
    raise jinja2.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True,
                        extensions=[jinja2.ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  try:
    return env.from_string(source)
  except jinja2.TemplateError as e:
    raise UserError(f"The model's chat template is not valid Jinja ({e}).") from None


def bytes_to_unicode() -> Dict[int, str]:
  """GPT-2's reversible byte -> printable character table."""
  bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1)))
  cs = bs[:]
  n = 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return dict(zip(bs, map(chr, cs)))


# How text is split before byte-level BPE, by `tokenizer.ggml.pre` (llama.cpp's names):
# GPT-2's regex, digits one by one then GPT-2's regex (SmolLM2), or a model's own regex.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_BYTE_LEVEL_SPLITS = {"default": None, "gpt-2": None, "smollm": "digits",
                      "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT,
                      "qwen2": _QWEN2_SPLIT}


def _byte_level_bpe(tokens, types, merges, pre, origin) -> tokenizers.Tokenizer:
  if merges is None:
    raise UserError(f"{origin}: a gpt2 (byte-level BPE) tokenizer needs tokenizer.ggml.merges.")
  spelling = bytes_to_unicode()
  alphabet = set(spelling.values())
  vocab = {(t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
           for i, t in enumerate(tokens)}
  bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges], dropout=None,
                   continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
  tok = tokenizers.Tokenizer(bpe)
  if pre not in _BYTE_LEVEL_SPLITS:
    raise UserError(f"{origin}: unsupported byte-level pre-tokenizer tokenizer.ggml.pre="
                    f"{pre!r}; supported: {', '.join(map(repr, _BYTE_LEVEL_SPLITS))}.")
  split = _BYTE_LEVEL_SPLITS[pre]
  if split is None:      # GPT-2's own regex
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  elif split == "digits":
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
  else:
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = decoders.ByteLevel()
  # A control token spelled outside the byte alphabet is a converter mislabel: skip it.
  _add_tokens(tok, tokens, types, keep=lambda t: set(t) <= alphabet)
  return tok


def _gemma_bpe(tokens, types, unk) -> tokenizers.Tokenizer:
  respelled = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
  vocab = {t: i for i, t in enumerate(respelled)}
  merges = _merges_by_position(respelled, vocab)
  tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None,
                                        unk_token=unk, fuse_unk=True, byte_fallback=True))
  tok.normalizer = normalizers.Replace(" ", SPACE)
  tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(),
                                   decoders.Fuse()])
  _add_tokens(tok, tokens, types, keep=lambda t: True, vocab=vocab)
  return tok


def _merges_by_position(tokens: List[str], vocab: Dict[str, int]) -> list:
  """BPE merges implied by a vocabulary: every split of a token into two tokens, best
  (earliest in the file) first; ties by longer left, then longer right piece."""
  score = {t: -i for i, t in enumerate(tokens)}   # a repeated token keeps its last index
  found = []
  for token, s in score.items():
    pairs = [(token[:k], token[k:]) for k in range(1, len(token))
             if token[:k] in vocab and token[k:] in vocab]
    pairs.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
    found.extend((s, len(a), len(b), a, b) for a, b in pairs)
  # Stable sort, descending on (score, len(a), len(b)); equal keys keep their order.
  order = sorted(range(len(found)), key=lambda k: found[k][:3], reverse=True)
  return [(found[k][3], found[k][4]) for k in order]


def _add_tokens(tok, tokens, types, *, keep, vocab=None) -> None:
  control = [AddedToken(t, normalized=False, special=True)
             for t, ty in zip(tokens, types) if ty == CONTROL and keep(t)]
  if control:
    tok.add_special_tokens(control)
  vocab = tok.get_vocab() if vocab is None else vocab
  user = [AddedToken(t, normalized=False, special=False)
          for t, ty in zip(tokens, types) if ty == USER_DEFINED and t in vocab]
  if user:
    tok.add_tokens(user)
