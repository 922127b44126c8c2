#!/usr/bin/env bash
# Builds a facegate handler written in JavaScript into a component of world
# `script-handler` (wit/face-detect.wit): it exports wasi:http/incoming-handler
# and imports facegate:face-detect/pipeline, which the gateway links in at
# deploy time.
#
# Usage: deploy/scripts/build-js.sh APP OUT.wasm
#   APP is an ES module, or a directory holding app.js. Its export
#   `incomingHandler` = { handle(request, responseOut) } is the handler; it
#   may import the SDK as "facegate" (guest-sdk/js/facegate.js), the WIT
#   interfaces of the world by their names ("wasi:http/types@0.2.12",
#   "facegate:face-detect/pipeline@0.1.0", ...) and its own files by
#   relative paths.
#
# Two steps: rolldown bundles the app and the SDK into one module (WIT
# imports stay imports), then componentize-js turns it into a component.
#
# Note: every componentize-js component also imports
# wasi:http/outgoing-handler@0.2.10 (StarlingMonkey's `fetch`), whether the
# app calls fetch or not; its `http` feature cannot be disabled for a
# handler (it also carries the incoming-handler export). The fetch-event
# style (addEventListener("fetch", ...)) does not build against world
# script-handler: the engine's own export is incoming-handler@0.2.10, the
# world wants @0.2.12. Export `incomingHandler` (see guest-sdk/js).
# Tools, pinned, from $FACEGATE_HOME/node (installed by
# deploy/scripts/install-script-toolchains.sh when missing).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
HOME_DIR="${FACEGATE_HOME:-$ROOT/.facegate}"
NODE_PREFIX="$HOME_DIR/node"
# Keep in step with install-script-toolchains.sh.
COMPONENTIZE_JS_VERSION=0.23.0
ROLLDOWN_VERSION=1.3.3
# A component (not a core module) starts with: \0asm, version 0x0d, layer 1.
COMPONENT_HEADER="0061736d0d000100"

if [ $# -ne 2 ]; then
  echo "usage: $0 APP(.js or dir with app.js) OUT.wasm" >&2
  exit 2
fi
if [ -d "$1" ]; then
  ENTRY="$(cd "$1" && pwd)/app.js"
else
  ENTRY="$(realpath "$1")"
fi
OUT="$(realpath -m "$2")"
[ -f "$ENTRY" ] || { echo "build-js: $ENTRY not found" >&2; exit 1; }

npm_version() {
  local pkg="$NODE_PREFIX/node_modules/$1/package.json"
  [ -f "$pkg" ] && node -p "require(process.argv[1]).version" "$pkg" 2>/dev/null || true
}
if [ "$(npm_version @bytecodealliance/componentize-js)" != "$COMPONENTIZE_JS_VERSION" ] ||
   [ "$(npm_version rolldown)" != "$ROLLDOWN_VERSION" ]; then
  "$ROOT/deploy/scripts/install-script-toolchains.sh" js
fi

mkdir -p "$(dirname "$OUT")"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
start=$(date +%s%N)

node --input-type=module - "$NODE_PREFIX/node_modules/rolldown/dist/index.mjs" \
  "$ENTRY" "$ROOT/guest-sdk/js/facegate.js" "$WORK/app.js" <<'JS'
import { pathToFileURL } from "node:url";
const [rolldownPath, entry, sdk, out] = process.argv.slice(2);
const { rolldown } = await import(pathToFileURL(rolldownPath).href);
const bundle = await rolldown({
  input: entry,
  platform: "neutral",
  // WIT interfaces ("wasi:http/types@0.2.12", "facegate:face-detect/pipeline@0.1.0"):
  // componentize-js provides them.
  external: [/^[a-z][a-z0-9-]*:[a-z][a-z0-9-]*\//],
  resolve: { alias: { facegate: sdk } },
  logLevel: "warn",
});
await bundle.write({ file: out, format: "esm" });
await bundle.close();
JS

# From the work directory: the component sees only the bundle (componentize-js
# maps the current directory to / while it pre-initialises the module).
(cd "$WORK" && "$NODE_PREFIX/node_modules/.bin/componentize-js" \
  --wit "$ROOT/wit" --world-name script-handler -o "$OUT" app.js >"$WORK/componentize.log" 2>&1) || {
  cat "$WORK/componentize.log" >&2
  exit 1
}
end=$(date +%s%N)

header="$(head -c 8 "$OUT" | od -An -tx1 | tr -d ' \n')"
[ "$header" = "$COMPONENT_HEADER" ] || { echo "build-js: $OUT is not a component" >&2; exit 1; }
ms=$(((end - start) / 1000000))
printf 'build-js: %s  %d bytes  (%d.%01d s)\n' "$OUT" "$(stat -c %s "$OUT")" $((ms / 1000)) $((ms % 1000 / 100))
