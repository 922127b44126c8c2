#!/usr/bin/env bash
# Builds a facegate handler written in Python into a component of world
# `script-handler` (wit/face-detect.wit): it exports wasi:http/incoming-handler
# and imports facegate:face-detect/pipeline, which the gateway links in at
# deploy time.
#
# Usage: deploy/scripts/build-python.sh APP_DIR OUT.wasm
#   APP_DIR holds app.py, whose class IncomingHandler is the export; the
#   app may import other modules of APP_DIR, the SDK (`import facegate`,
#   guest-sdk/python), the standard library and the generated bindings
#   (`wit_world`). componentize-py keeps only the modules imported at build
#   time (at module level): an import inside a function fails at run time
#   unless the module was already imported.
#   An app that calls more of WASI than that world imports (the hostile
#   test program calls wasi:sockets) brings a `world.wit` of its own: a
#   package with a world `handler` that includes `script-handler` and
#   more, using the packages of wit/; the app is built for that world.
#
# Tool: componentize-py, pinned, from $FACEGATE_HOME/venv (installed by
# deploy/scripts/install-script-toolchains.sh when missing).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
HOME_DIR="${FACEGATE_HOME:-$ROOT/.facegate}"
COMPONENTIZE_PY="$HOME_DIR/venv/bin/componentize-py"
COMPONENTIZE_PY_VERSION=0.25.1 # keep in step with install-script-toolchains.sh
# A component (not a core module) starts with: \0asm, version 0x0d, layer 1.
COMPONENT_HEADER="0061736d0d000100"

if [ $# -ne 2 ]; then
  echo "usage: $0 APP_DIR OUT.wasm" >&2
  exit 2
fi
APP_DIR="$(cd "$1" && pwd)"
OUT="$(realpath -m "$2")"
[ -f "$APP_DIR/app.py" ] || { echo "build-python: $APP_DIR has no app.py" >&2; exit 1; }
WIT=(-d "$ROOT/wit" -w script-handler)
if [ -f "$APP_DIR/world.wit" ]; then
  package="$(sed -n 's/^package \([^@;]*\).*;.*/\1/p' "$APP_DIR/world.wit" | head -n 1)"
  [ -n "$package" ] || { echo "build-python: $APP_DIR/world.wit names no package" >&2; exit 1; }
  WIT=(-d "$ROOT/wit" -d "$APP_DIR/world.wit" -w "$package/handler")
fi

if [ "$("$COMPONENTIZE_PY" --version 2>/dev/null)" != "componentize-py $COMPONENTIZE_PY_VERSION" ]; then
  "$ROOT/deploy/scripts/install-script-toolchains.sh" python
fi

mkdir -p "$(dirname "$OUT")"
start=$(date +%s%N)
# Copies of the app and the SDK (componentize-py writes __pycache__ into the
# directories it is given). -p: only those two. An empty VIRTUAL_ENV keeps
# componentize-py from adding a site-packages directory of this machine.
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/venv/lib/python3/site-packages" "$WORK/sdk"
cp -r "$APP_DIR" "$WORK/app"
cp -r "$ROOT/guest-sdk/python/facegate" "$WORK/sdk/facegate"
find "$WORK/app" "$WORK/sdk" -name __pycache__ -prune -exec rm -rf {} +
(cd "$WORK" && VIRTUAL_ENV="$WORK/venv" "$COMPONENTIZE_PY" -q "${WIT[@]}" \
  componentize -p "$WORK/app" -p "$WORK/sdk" app -o "$OUT")
end=$(date +%s%N)

header="$(head -c 8 "$OUT" | od -An -tx1 | tr -d ' \n')"
[ "$header" = "$COMPONENT_HEADER" ] || { echo "build-python: $OUT is not a component" >&2; exit 1; }
ms=$(((end - start) / 1000000))
printf 'build-python: %s  %d bytes  (%d.%01d s)\n' "$OUT" "$(stat -c %s "$OUT")" $((ms / 1000)) $((ms % 1000 / 100))
