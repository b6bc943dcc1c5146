#!/usr/bin/env bash
# No container runtime runs here, so this performs Dockerfile.cpu's install steps in a clean venv: the same pip
# commands and the same lock (constraints.txt), on a copy of only what .dockerignore lets into the image. Then it
# checks that every installed package is at its locked version, starts the installed server as the image's
# ENTRYPOINT does (embedded demo model, from a directory outside the checkout, so the installed package runs, not
# the working tree), waits until the image's HEALTHCHECK command passes, sends SIGTERM and wants exit status 0.
#   bash scripts/check_container_install.sh          (about 3.5 minutes here, most of it installing torch)
# One difference from the image: the torch step. The image takes torch==2.14.1+cpu from PyTorch's CPU index,
# which this machine cannot reach; by default this script takes the Makefile's TORCH_SPEC (torch==2.14.1
# torchvision==0.29.1) from the configured index. Override with TORCH_SPEC=... TORCH_INDEX=... (as the
# Dockerfile's build args). Needs PyPI (or a mirror) for the rest, like the image build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-$(sed -n 's/^TORCH_SPEC ?= *//p' Makefile)}
TORCH_INDEX=${TORCH_INDEX:-}
tmp=$(mktemp -d)
server=
cleanup() { [ -z "$server" ] || kill -9 "$server" 2>/dev/null || true; rm -rf "$tmp"; }
trap cleanup EXIT

# The pip commands below must be the Dockerfiles' own: fail if either Dockerfile no longer has them.
for f in Dockerfile Dockerfile.cpu; do
  for cmd in 'pip install -c constraints.txt --upgrade pip' 'pip install -c constraints.txt .' \
             'pip install -c constraints.txt ${TORCH_SPEC}' 'pip install -c constraints.txt ${TORCH_INDEX:+'; do
    [ "$f:$cmd" = 'Dockerfile:pip install -c constraints.txt ${TORCH_INDEX:+' ] && continue
    [ "$f:$cmd" = 'Dockerfile.cpu:pip install -c constraints.txt ${TORCH_SPEC}' ] && continue
    grep -qF -- "$cmd" "$f" || { echo "FAIL: $f has no '$cmd' (update this script with the Dockerfile)"; exit 1; }
  done
done

# The build context: what .dockerignore admits.
mkdir -p "$tmp/src" "$tmp/home"
tar --exclude=__pycache__ --exclude='*.pyc' -cf - constraints.txt pyproject.toml README.md mmserve \
  | tar -xf - -C "$tmp/src"
healthcheck=$(sed -n 's/^  CMD //p' Dockerfile.cpu)
[ -n "$healthcheck" ] || { echo "FAIL: no HEALTHCHECK CMD line in Dockerfile.cpu"; exit 1; }

# Dockerfile.cpu's steps, in a clean venv.
t0=$(date +%s)
"$PYTHON" -m venv "$tmp/venv"
export VIRTUAL_ENV=$tmp/venv PATH=$tmp/venv/bin:$PATH
cd "$tmp/src"
pip install -q -c constraints.txt --upgrade pip
# shellcheck disable=SC2086
pip install -q -c constraints.txt ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} ${TORCH_SPEC}
pip install -q -c constraints.txt .
echo "installed in $(($(date +%s) - t0)) s"

# Every installed package that the lock names is at the locked version; nothing else but torch's own.
python - "$tmp/src/constraints.txt" <<'PY'
import importlib.metadata as md
import re
import sys

norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()  # noqa: E731
pins = {}
for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    if "==" in line:
        name, ver = line.split("==", 1)
        pins[norm(name)] = ver
bad, unpinned = [], []
for d in md.distributions():
    name = norm(d.metadata["Name"])
    if name in pins and d.version != pins[name]:
        bad.append(f"{name} {d.version} (lock: {pins[name]})")
    elif name not in pins and not re.match(r"(mmserve|torch|torchvision|triton|nvidia-.*|cuda-.*)$", name):
        unpinned.append(f"{name} {d.version}")
if bad or unpinned:
    sys.exit(f"FAIL: not at the locked version: {bad}; not in the lock: {unpinned}")
print(f"lock held: {len(pins)} pins, every installed package matches")
PY

# The image's ENTRYPOINT (with free ports) and HEALTHCHECK, run from outside the checkout.
cd "$tmp/home"
python -c "import mmserve, sys; sys.exit(0 if '$tmp/venv' in mmserve.__file__ else 'FAIL: mmserve not from the venv')"
read -r http grpc < <(python -c "
import socket
s = [socket.socket() for _ in range(2)]
[x.bind(('127.0.0.1', 0)) for x in s]
print(*[x.getsockname()[1] for x in s])")
mmserve serve --host 127.0.0.1 --http-port "$http" --grpc-port "$grpc" --device cpu > "$tmp/server.log" 2>&1 &
server=$!
ready=
for _ in $(seq 180); do
  if sh -c "${healthcheck//8000/$http}" 2>/dev/null; then ready=1; break; fi
  kill -0 "$server" 2>/dev/null || break
  sleep 1
done
if [ -z "$ready" ]; then echo "FAIL: the HEALTHCHECK never passed"; tail -20 "$tmp/server.log"; exit 1; fi
echo "HEALTHCHECK passed (/v2/health/ready on :$http)"
kill -TERM "$server"
rc=0; wait "$server" || rc=$?
server=
[ "$rc" = 0 ] || { echo "FAIL: exit status $rc after SIGTERM"; tail -20 "$tmp/server.log"; exit 1; }
echo "SIGTERM: drained and exited 0"
echo "container install check passed in $(($(date +%s) - t0)) s"
