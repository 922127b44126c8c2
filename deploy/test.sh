#!/usr/bin/env bash
# The project's one test command: set up what is missing, build the guests,
# run every test of the workspace (release profile: wasmtime and the model
# are too slow unoptimised).
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/setup.sh --no-build
# The console's tests drive a real headless Chromium over WebDriver.
if ! command -v chromedriver >/dev/null || ! command -v chromium >/dev/null; then
  echo "[test] installing chromium and chromium-driver (Debian) for the console tests" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq chromium chromium-driver >/dev/null
fi
deploy/scripts/build-guests.sh
HOME_DIR=${FACEGATE_HOME:-$PWD/.facegate}
export FACEGATE_HOME=$HOME_DIR
export ORT_DYLIB_PATH=${ORT_DYLIB_PATH:-$HOME_DIR/lib/libonnxruntime.so}
cargo test --release --workspace "$@"
