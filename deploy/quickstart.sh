#!/usr/bin/env bash
# One command from a fresh clone to a running gateway: set up, build, serve
# the example handlers (tenant "demo") with the real CenterFace model.
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/setup.sh
HOME_DIR=${FACEGATE_HOME:-$PWD/.facegate}
export FACEGATE_HANDLERS=${FACEGATE_HANDLERS:-$HOME_DIR/handlers}
export FACEGATE_MODEL=${FACEGATE_MODEL:-$HOME_DIR/models/centerface.onnx}
export ORT_DYLIB_PATH=${ORT_DYLIB_PATH:-$HOME_DIR/lib/libonnxruntime.so}
echo "try: curl -s --data-binary @runtime/tests/fixtures/images/grace_hopper.jpg http://${FACEGATE_LISTEN:-127.0.0.1:8080}/v1/demo/detect"
exec target/release/facegate serve "$@"
