#!/usr/bin/env bash
# Validates the Kubernetes manifests in deploy/k8s (or the directory given)
# against the Kubernetes API schemas, offline, in strict mode (unknown fields
# are errors), with the schemas bundled in the PyPI package
# kubernetes-validate (pinned below), plus the cross checks and the GPU
# overlay checks of deploy/scripts/validate_k8s.py. Exits non-zero on any
# error.
#
# - Installs kubernetes-validate into the project venv
#   ${FACEGATE_HOME:-.facegate}/venv (created with `python3 -m venv` if
#   missing) unless that version is already there; that one install is the
#   only network access.
# - Renders every kustomization (deploy/k8s, deploy/k8s/base,
#   deploy/k8s/gpu, and the component deploy/k8s/egress). Where `kubectl` (or `kustomize`) is installed it renders,
#   and the script's built-in renderer must agree with it; without either,
#   the built-in renderer alone is used. FACEGATE_KUSTOMIZE=none forces that.
# - Kubernetes versions: K8S_VERSIONS (space-separated), default "1.31 1.37":
#   the oldest version these manifests target and the newest schema bundled.
#
# Usage: deploy/scripts/validate-k8s.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
HOME_DIR=${FACEGATE_HOME:-$ROOT/.facegate}
VALIDATOR_VERSION=1.37.0
K8S_VERSIONS=${K8S_VERSIONS:-"1.31 1.37"}
DIR=${1:-deploy/k8s}
log() { printf '\033[1m[validate-k8s]\033[0m %s\n' "$*" >&2; }

if [ ! -x "$HOME_DIR/venv/bin/python" ]; then
  log "creating the project venv $HOME_DIR/venv"
  python3 -m venv "$HOME_DIR/venv"
fi
PY="$HOME_DIR/venv/bin/python"
installed=$("$PY" -c 'from kubernetes_validate.version import __version__ as v; print(v)' 2>/dev/null || true)
if [ "$installed" != "$VALIDATOR_VERSION" ]; then
  log "installing kubernetes-validate==$VALIDATOR_VERSION into $HOME_DIR/venv"
  "$HOME_DIR/venv/bin/pip" install -q "kubernetes-validate==$VALIDATOR_VERSION"
fi

KUSTOMIZE=${FACEGATE_KUSTOMIZE:-auto}
if [ "$KUSTOMIZE" = auto ]; then
  if command -v kubectl >/dev/null 2>&1 && kubectl kustomize --help >/dev/null 2>&1; then
    KUSTOMIZE="kubectl kustomize"
  elif command -v kustomize >/dev/null 2>&1; then
    KUSTOMIZE="kustomize build"
  else
    KUSTOMIZE=none
  fi
fi
args=()
for v in $K8S_VERSIONS; do args+=(--k8s-version "$v"); done
if [ "$KUSTOMIZE" != none ]; then
  args+=(--kustomize "$KUSTOMIZE")
  log "rendering with \`$KUSTOMIZE\` (and the built-in renderer, which must agree)"
else
  log "no kubectl/kustomize: rendering with the built-in renderer only"
fi
[ -d "$DIR/gpu" ] && args+=(--gpu-overlay "$DIR/gpu")

log "validating $DIR against Kubernetes $K8S_VERSIONS (strict)"
exec "$PY" deploy/scripts/validate_k8s.py "${args[@]}" "$DIR"
