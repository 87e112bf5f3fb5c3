#!/usr/bin/env bash
# Installs attnprec's dependencies for running it on a TPU machine, into a folder that is
# appended to PYTHONPATH (the machine's own JAX, jaxlib and libtpu stay first):
#
#   source scripts/tpu_install.sh [DIR]        # DIR defaults to /tmp/attnprec-site
#
# Three sources, tried in this order (docs/tpu.md):
#   .whl-tpu/          wheels fetched beforehand on a machine with a registry
#                      (`make tpu-wheels`): the packages a TPU image's own index lacks
#                      (chex, dm-haiku, jmp, tabulate, gin-config, gguf), offline;
#   /opt/pypi/simple   a TPU image's own package index, if it has one (optax, orbax,
#                      ml-collections, tokenizers, safetensors, matplotlib, tqdm, ...);
#   PyPI               where the machine reaches it (a TPU VM with internet): the rest.
# JAX itself is never installed here: use the one that came with libtpu.
# Sourced, it exports PYTHONPATH; run as a script, it prints the line to export.
DIR="${1:-/tmp/attnprec-site}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$DIR/wheels" "$DIR/index"
PIP="env PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-compile --no-cache-dir --disable-pip-version-check"
# What the project needs beyond jax (setup.cfg's install_requires, less the weights packages).
NEEDS="optax orbax-checkpoint ml-collections tqdm jinja2 matplotlib tokenizers safetensors pyyaml toolz absl-py typing_extensions"
ok=1
if ls "$ROOT"/.whl-tpu/*.whl >/dev/null 2>&1; then
  $PIP --no-index --no-deps --upgrade --target "$DIR/wheels" "$ROOT"/.whl-tpu/*.whl || ok=0
fi
if [ -f "$DIR/index/.attnprec-installed" ]; then
  :   # installed by an earlier run into this folder: the index part is not repeated
elif [ -d /opt/pypi/simple ]; then
  $PIP --only-binary=:all: --index-url file:///opt/pypi/simple --target "$DIR/index" $NEEDS || ok=0
elif ! python3 -c "import optax, orbax.checkpoint, ml_collections" 2>/dev/null; then
  $PIP --target "$DIR/index" $NEEDS chex dm-haiku gin-config gguf || ok=0
fi
[ "$ok" = 1 ] && touch "$DIR/index/.attnprec-installed"
case ":${PYTHONPATH:-}:" in
  *":$DIR/wheels:"*) ;;
  *) export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$ROOT:$DIR/wheels:$DIR/index" ;;
esac
if [ "$ok" = 1 ] && python3 -c "import jax, haiku, chex, gin, optax, attnprec" 2>/dev/null; then
  echo "attnprec for TPU: installed under $DIR (jax $(python3 -c 'import jax; print(jax.__version__)'))"
else
  echo "attnprec for TPU: the install under $DIR is incomplete; see the pip messages above" >&2
  echo "(no registry here? run 'make tpu-wheels' on a machine with one and bring .whl-tpu/)" >&2
  (return 0 2>/dev/null) && return 1 || exit 1
fi
(return 0 2>/dev/null) || echo "export PYTHONPATH=$PYTHONPATH"
