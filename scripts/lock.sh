#!/usr/bin/env bash
# Regenerate constraints.txt, the lock file: the exact version of every package that the test suite runs with,
# as a pip constraints file (`pip install -c constraints.txt ...`; `make install` and the Dockerfiles use it).
#   bash scripts/lock.sh                 # resolve afresh in a clean venv (today's newest versions in range)
#   bash scripts/lock.sh --from .venv    # freeze an existing venv instead (the one the tests just passed in)
# Then run `make test` against it (rm -rf .venv; make test) and commit constraints.txt.
# torch and what its wheel pins (torchvision, triton, nvidia-*, cuda-*) are left out: the Makefile's TORCH_SPEC
# (CPU machines), the Dockerfiles' TORCH_SPEC or the GPU machine's own torch decide them, so `make TORCH_SPEC=`
# keeps a system torch. pyproject.toml keeps ranges: `pip install mmserve` is not bound by this file.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-$(sed -n 's/^TORCH_SPEC ?= *//p' Makefile)}
OUT=${OUT:-constraints.txt}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

if [ "${1:-}" = "--from" ]; then
  venv=${2:?usage: lock.sh --from VENV}
  how="frozen from an existing venv (scripts/lock.sh --from)"
else
  venv=$tmp/venv
  how="resolved in a clean venv (scripts/lock.sh)"
  "$PYTHON" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  # shellcheck disable=SC2086
  [ -z "$TORCH_SPEC" ] || "$venv/bin/python" -m pip install -q $TORCH_SPEC
  "$venv/bin/python" -m pip install -q ".[test,bench]"
fi

pyver=$("$venv/bin/python" -c 'import platform; print(platform.python_version())')
{
  echo "# The lock: pip constraints (pip freeze format, == pins) of the versions the test suite ran with."
  echo "# Regenerate: bash scripts/lock.sh (see its header and docs/deploy.md, \"The lock\"). Do not edit by hand."
  echo "# Used as: pip install -c constraints.txt -e \".[test]\"   (make install; the Dockerfiles: '.')"
  echo "# $how; Python $pyver, $(uname -m), torch from TORCH_SPEC (not pinned here): $TORCH_SPEC"
  "$venv/bin/python" -m pip freeze --all --exclude-editable \
    | grep -v -i -E '^(mmserve|torch|torchvision|torchaudio|triton|nvidia-[a-z0-9-]+|cuda-[a-z0-9-]+)( @ |==)' \
    | grep -v -E '^(#|-e )'
} > "$tmp/out"
mv "$tmp/out" "$OUT"
echo "wrote $OUT: $(grep -vc "^#" "$OUT") pins" >&2
