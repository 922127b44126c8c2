#!/usr/bin/env bash
# Build every example handler in guests/ as a wasm32-wasip2 component
# (release profile) into guests/target/wasm32-wasip2/release/NAME.wasm.
#
# Toolchain: rustup's wasm32-wasip2 target when it is installed; otherwise
# Debian's packaged Rust, which builds std for the target itself:
#   apt-get install -y rustc-web cargo-web rust-web-src lld-19 wasi-libc
# This script installs nothing.
#
# Environment: CARGO_TARGET_DIR is ignored (outputs always go to
# guests/target); extra cargo arguments may follow on the command line.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
GUESTS="$ROOT/guests"
TARGET=wasm32-wasip2
OUT="$GUESTS/target/$TARGET/release"
# A component (not a core module) starts with: \0asm, version 0x0d, layer 1.
COMPONENT_HEADER="0061736d0d000100"
# The components: each guest's [lib] name,
# which name their .wasm files.
COMPONENTS=(detect detect_cached blur crop bench hostile pipeline faces spin_router hello)

# Keep in step with guests/.cargo/config.toml (RUSTFLAGS replaces it).
SIMD="-C target-feature=+simd128"

unset CARGO_TARGET_DIR
LOCKED=()
[[ -f "$GUESTS/Cargo.lock" ]] && LOCKED=(--locked)

have_rustup_target() {
    command -v rustup >/dev/null 2>&1 &&
        rustup target list --installed 2>/dev/null | grep -qx "$TARGET"
}

build_with_rustup() {
    echo "build-guests: using rustup's $TARGET target"
    (cd "$GUESTS" && cargo build --release --target "$TARGET" "${LOCKED[@]}" "$@")
}

# Debian's rustc-web has no prebuilt std for wasm32-wasip2: build it with
# -Zbuild-std from rust-web-src (RUSTC_BOOTSTRAP unlocks the nightly flag),
# link with LLVM 19's wasm-ld against Debian's wasi-libc; rustc's bundled
# wasm-component-ld turns the core module into a component.
build_with_debian() {
    local missing=()
    [[ -x /usr/bin/rustc ]] || missing+=(rustc-web)
    [[ -x /usr/bin/cargo ]] || missing+=(cargo-web)
    [[ -d /usr/lib/rustlib/src/rust/library ]] || missing+=(rust-web-src)
    [[ -x /usr/lib/llvm-19/bin/wasm-ld ]] || missing+=(lld-19)
    [[ -f /usr/lib/wasm32-wasi/libc.a ]] || missing+=(wasi-libc)
    if ((${#missing[@]})); then
        cat >&2 <<EOF
build-guests: no way to build for $TARGET here.
  Either: rustup target add $TARGET
  Or (Debian): apt-get install -y ${missing[*]}
EOF
        exit 1
    fi
    echo "build-guests: using Debian's rustc ($(/usr/bin/rustc --version)) with -Zbuild-std"
    (cd "$GUESTS" &&
        PATH="/usr/lib/llvm-19/bin:$PATH" \
        RUSTFLAGS="-L /usr/lib/wasm32-wasi $SIMD" \
        RUSTC=/usr/bin/rustc RUSTC_BOOTSTRAP=1 \
        /usr/bin/cargo build --release --target "$TARGET" \
            -Zbuild-std=std,panic_abort "${LOCKED[@]}" "$@")
}

check_component() {
    local wasm="$1" header
    [[ -f "$wasm" ]] || { echo "build-guests: missing $wasm" >&2; return 1; }
    header="$(head -c 8 "$wasm" | od -An -tx1 | tr -d ' \n')"
    if [[ "$header" != "$COMPONENT_HEADER" ]]; then
        echo "build-guests: $wasm is not a component (header $header)" >&2
        return 1
    fi
    printf '  %-60s %8d bytes\n' "$wasm" "$(stat -c %s "$wasm")"
}

if have_rustup_target; then
    build_with_rustup "$@"
else
    build_with_debian "$@"
fi

echo "build-guests: components:"
for name in "${COMPONENTS[@]}"; do
    check_component "$OUT/$name.wasm"
done
