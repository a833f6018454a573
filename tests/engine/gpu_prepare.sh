#!/usr/bin/env bash
# Prepares, on a machine with pip and the project's .venv (`make venv`), what gpu_check.sh needs on a lent GPU machine
# (the device tool; Python 3.12 there, with torch, triton, transformers and peft but not the packages below): wheels
# in .whl/ (kvgate itself, built from this tree, and the dependencies the GPU image lacks, for CPython 3.12 on
# manylinux x86_64), and the trained copier model in .gpucache/ (~1.5 min on 2 CPU cores here, so the GPU run does
# not spend its minutes training it). Both folders are ignored by git (.git/info/exclude) and travel with `carry`:
#
#   bash tests/engine/gpu_prepare.sh
#   device run, carry [".whl", ".gpucache"]:
#     O=$OUT; mkdir -p $O/r; KVGATE_CACHE_DIR=$PWD/.gpucache OUT=$O/r STAGES=qkernels,spec,kvfp8,spectests \
#       timeout 550 bash tests/engine/gpu_check.sh; tar czf $O/gpu.tgz -C $O r; rm -rf $O/r
#
# (the device returns at most 8 files: the logs and JSON go back as one archive).
set -eu
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
for path in /.whl/ /.gpucache/; do
  grep -qxF "$path" .git/info/exclude 2>/dev/null || echo "$path" >> .git/info/exclude
done
mkdir -p .whl
rm -f .whl/kvgate-*.whl
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl .
# Versions as this project's venv has them; the GPU image's own packages are not replaced (KINDS.md lists them).
platforms=()
for n in 17 24 26 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
for name in llguidance jsonschema jsonschema-specifications referencing rpds-py pyzmq msgspec httptools uvloop; do
  version=$("$PY" -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" --platform manylinux2014_x86_64 -d .whl "$name==$version"
done
KVGATE_CACHE_DIR=$PWD/.gpucache "$PY" -c "from kvgate.engine.copier import ensure_copier_model; print(ensure_copier_model())"
ls -la .whl .gpucache/models
