#!/usr/bin/env bash
# The project's one test command: set up what is missing, build the guests,
# run every test of the workspace (release profile: wasmtime and the model
# are too slow unoptimised).
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/setup.sh --no-build
deploy/scripts/build-guests.sh
HOME_DIR=${FACEGATE_HOME:-$PWD/.facegate}
export FACEGATE_HOME=$HOME_DIR
export ORT_DYLIB_PATH=${ORT_DYLIB_PATH:-$HOME_DIR/lib/libonnxruntime.so}
cargo test --release --workspace "$@"
