#!/usr/bin/env bash
# Installs the toolchains that build facegate handlers written in Python and
# JavaScript (world `script-handler` of wit/face-detect.wit), pinned:
#   - componentize-py  into the project's venv   $FACEGATE_HOME/venv  (pip)
#   - componentize-js, jco and rolldown into     $FACEGATE_HOME/node  (npm --prefix)
# rolldown bundles a JavaScript app with guest-sdk/js before componentize-js
# (which takes one module); jco gives `jco wit` / `jco print` to inspect a
# built component.
#
# Idempotent: a tool already at its pinned version is kept; nothing else is
# touched. FACEGATE_HOME defaults to .facegate/ in the repository.
# Needs python3 (with venv), node >= 20 and npm; both registries (PyPI, npm).
#
# Usage: deploy/scripts/install-script-toolchains.sh [python|js|all]   (default: all)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
HOME_DIR="${FACEGATE_HOME:-$ROOT/.facegate}"
VENV="$HOME_DIR/venv"
NODE_PREFIX="$HOME_DIR/node"

COMPONENTIZE_PY_VERSION=0.25.1
COMPONENTIZE_JS_VERSION=0.23.0
JCO_VERSION=1.35.0
# jco 1.35.0 depends on rolldown ^1.2.4: the same copy serves both.
ROLLDOWN_VERSION=1.3.3

log() { printf '\033[1m[script-toolchains]\033[0m %s\n' "$*" >&2; }

install_python() {
  if [ ! -x "$VENV/bin/python" ]; then
    log "creating the venv $VENV"
    python3 -m venv "$VENV"
  fi
  local have
  have="$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("componentize-py"))' 2>/dev/null || true)"
  if [ "$have" != "$COMPONENTIZE_PY_VERSION" ]; then
    log "installing componentize-py $COMPONENTIZE_PY_VERSION into $VENV"
    "$VENV/bin/pip" install -q --disable-pip-version-check "componentize-py==$COMPONENTIZE_PY_VERSION"
  fi
  "$VENV/bin/componentize-py" --version >/dev/null
}

# npm_version NAME: the version installed under the node prefix, or nothing.
npm_version() {
  local pkg="$NODE_PREFIX/node_modules/$1/package.json"
  [ -f "$pkg" ] && node -p "require(process.argv[1]).version" "$pkg" 2>/dev/null || true
}

install_js() {
  command -v node >/dev/null || { log "node is missing (need node >= 20 and npm)"; exit 1; }
  command -v npm >/dev/null || { log "npm is missing"; exit 1; }
  local major
  major="$(node -p 'process.versions.node.split(".")[0]')"
  if [ "$major" -lt 20 ]; then
    log "node $(node --version) is too old: componentize-js needs node >= 20"
    exit 1
  fi
  if [ "$(npm_version @bytecodealliance/componentize-js)" != "$COMPONENTIZE_JS_VERSION" ] ||
     [ "$(npm_version @bytecodealliance/jco)" != "$JCO_VERSION" ] ||
     [ "$(npm_version rolldown)" != "$ROLLDOWN_VERSION" ]; then
    log "installing componentize-js $COMPONENTIZE_JS_VERSION, jco $JCO_VERSION and rolldown $ROLLDOWN_VERSION into $NODE_PREFIX"
    mkdir -p "$NODE_PREFIX"
    # A package.json of our own keeps npm from walking up to another project.
    [ -f "$NODE_PREFIX/package.json" ] ||
      printf '{\n  "name": "facegate-script-toolchains",\n  "private": true\n}\n' >"$NODE_PREFIX/package.json"
    npm install --prefix "$NODE_PREFIX" --save-exact --no-audit --no-fund --loglevel=error \
      "@bytecodealliance/componentize-js@$COMPONENTIZE_JS_VERSION" \
      "@bytecodealliance/jco@$JCO_VERSION" \
      "rolldown@$ROLLDOWN_VERSION"
  fi
  local bin
  for bin in componentize-js jco rolldown; do
    [ -x "$NODE_PREFIX/node_modules/.bin/$bin" ] || { log "missing $NODE_PREFIX/node_modules/.bin/$bin"; exit 1; }
  done
}

case "${1:-all}" in
  python) install_python ;;
  js) install_js ;;
  all) install_python; install_js ;;
  *) echo "usage: $0 [python|js|all]" >&2; exit 2 ;;
esac
