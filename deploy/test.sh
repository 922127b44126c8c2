#!/usr/bin/env bash
# The project's one test command: set up what is missing (Chromium for the
# console, PostgreSQL for the cluster store, an OCI registry), check the Kubernetes manifests,
# build the guests, run every test of the workspace (release profile:
# wasmtime and the model are too slow unoptimised).
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
# The control-plane tests run against a real PostgreSQL too: each test run
# starts throw-away servers (initdb in a temporary directory, a free port).
if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  echo "[test] installing postgresql-15 (Debian) for the PostgreSQL store tests" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq postgresql-15 >/dev/null
fi
# The registry tests push to and pull from a real OCI registry (the CNCF
# distribution registry, started on 127.0.0.1 by each test).
if ! command -v docker-registry >/dev/null; then
  echo "[test] installing docker-registry (Debian) for the OCI registry tests" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq docker-registry >/dev/null
fi
# The Kubernetes manifests, against the Kubernetes schemas.
deploy/scripts/validate-k8s.sh
deploy/scripts/build-guests.sh
# The JavaScript SDK's SHA-256 against the standard's vectors (node is there when JavaScript handlers build).
if command -v node >/dev/null; then node guest-sdk/js/sha256.test.mjs; fi
HOME_DIR=${FACEGATE_HOME:-$PWD/.facegate}
export FACEGATE_HOME=$HOME_DIR
export ORT_DYLIB_PATH=${ORT_DYLIB_PATH:-$HOME_DIR/lib/libonnxruntime.so}
cargo test --release --workspace "$@"
