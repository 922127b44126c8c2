#!/usr/bin/env bash
# One command from a fresh clone to a running gateway: set up, build, and
# serve the example handlers with the real CenterFace model. On first run the
# store (.facegate/data) is seeded with tenant "demo" (handlers detect, blur,
# crop); its API key is saved in .facegate/data/demo.key (mode 0600; only the path is printed). The
# admin API uses FACEGATE_ADMIN_TOKEN, or a token generated into
# .facegate/data/admin.token (mode 0600).
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/setup.sh
HOME_DIR=${FACEGATE_HOME:-$PWD/.facegate}
export FACEGATE_DATA=${FACEGATE_DATA:-$HOME_DIR/data}
export FACEGATE_SEED=${FACEGATE_SEED:-$HOME_DIR/handlers}
export FACEGATE_MODEL=${FACEGATE_MODEL:-$HOME_DIR/models/centerface.onnx}
export ORT_DYLIB_PATH=${ORT_DYLIB_PATH:-$HOME_DIR/lib/libonnxruntime.so}
export FACEGATE_PIPELINE_COMPONENT=${FACEGATE_PIPELINE_COMPONENT:-$HOME_DIR/lib/pipeline.wasm}
if [ -z "${FACEGATE_ADMIN_TOKEN:-}" ]; then
  token_file="$FACEGATE_DATA/admin.token"
  if [ ! -s "$token_file" ]; then
    mkdir -p "$FACEGATE_DATA" && chmod 700 "$FACEGATE_DATA"
    (umask 077 && od -An -tx1 -N32 /dev/urandom | tr -d ' \n' > "$token_file")
  fi
  FACEGATE_ADMIN_TOKEN=$(cat "$token_file")
  export FACEGATE_ADMIN_TOKEN
  echo "admin API token in $token_file; for the CLI: export FACEGATE_ADMIN_TOKEN=\$(cat $token_file)"
fi
# The console's address follows --listen (or FACEGATE_LISTEN), and https with --tls-cert.
listen=${FACEGATE_LISTEN:-127.0.0.1:8080}
scheme=http
[ -n "${FACEGATE_TLS_CERT:-}" ] && scheme=https
prev=
for arg in "$@"; do
  case "$prev" in --listen) listen=$arg ;; --tls-cert) scheme=https ;; esac
  case "$arg" in --listen=*) listen=${arg#--listen=} ;; --tls-cert=*) scheme=https ;; esac
  prev=$arg
done
case "$listen" in 0.0.0.0:*) listen="127.0.0.1:${listen##*:}" ;; "[::]:"*) listen="[::1]:${listen##*:}" ;; esac
echo "console: $scheme://$listen/ (Try it with the demo key in $FACEGATE_DATA/demo.key; Operate with the admin token)"
exec target/release/facegate serve "$@"
