#!/usr/bin/env bash
# Static checks CI runs before the tests: formatting (rustfmt.toml) of both
# workspaces, clippy with warnings denied on every target, and that the GPU
# features (`cuda`, `tensorrt`) compile, though no GPU library is here.
set -euo pipefail
cd "$(dirname "$0")/.."
log() { printf '\033[1m[lint]\033[0m %s\n' "$*" >&2; }

if cargo fmt --version >/dev/null 2>&1; then
  log "rustfmt: host workspace and guests"
  cargo fmt --all --check
  (cd guests && cargo fmt --all --check)
else
  log "WARNING: rustfmt is not installed (rustup component add rustfmt); formatting not checked"
fi

if cargo clippy --version >/dev/null 2>&1; then
  log "clippy, warnings denied, with the cuda and tensorrt features"
  cargo clippy --release --workspace --all-targets --features facegate/cuda,facegate/tensorrt -- -D warnings
else
  log "WARNING: clippy is not installed (rustup component add clippy); falling back to cargo check"
  cargo check --release --workspace --all-targets --features facegate/cuda,facegate/tensorrt
fi
log "ok"
