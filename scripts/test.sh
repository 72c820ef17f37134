#!/usr/bin/env bash
# The test command of the README: installs what the tests need on a fresh
# Debian machine (when run as root), then runs formatting, lints, every test
# target, the doc tests and the loom models. Fails loudly on any step.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v mpirun >/dev/null 2>&1 || need+=(openmpi-bin)
command -v mpicc >/dev/null 2>&1 || need+=(libopenmpi-dev)
command -v ucx_perftest >/dev/null 2>&1 || need+=(ucx-utils)
command -v nft >/dev/null 2>&1 || need+=(nftables)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
# The rdma transport builds against libfabric and its tests run over the
# tcp;ofi_rxm provider (fi_info, from libfabric-bin, tells them it is there).
[ -e /usr/include/rdma/fabric.h ] || need+=(libfabric-dev)
command -v fi_info >/dev/null 2>&1 || need+=(libfabric-bin)
if ((${#need[@]})); then
  if [ "$(id -u)" -ne 0 ]; then
    echo "test.sh: missing ${need[*]}; install them (apt-get install ${need[*]}) or run as root" >&2
    exit 1
  fi
  echo "test.sh: installing ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

before=$(ls /dev/shm 2>/dev/null | grep -c '^abtl\.' || true)

# The workspace: the library (this directory) and btl-tools/ (btl-run,
# btl-info, btl-perf). Everything is built and tested with the rdma
# transport and the CUDA driver layer in (FEATURES: the driver is loaded at
# run time, so no toolkit is needed, and without one smcuda reports why);
# the default build, which needs neither, is linted too.
FEATURES=async-btl/rdma,btl-tools/rdma,async-btl/cuda,btl-tools/cuda
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
cargo clippy --workspace --all-targets --features "$FEATURES" -- -D warnings
# Public docs build without broken links or other rustdoc warnings.
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --features "$FEATURES"
# The library stays lean: command-line, plotting and benchmark crates are
# the tools' alone.
lib_deps=$(cargo tree -p async-btl -e normal --prefix none)
if grep -E '^(clap|plotters|indicatif|console|hwlocality|serde_json|tracing-subscriber) ' <<<"$lib_deps"; then
  echo "test.sh: the library depends on a crate that only the tools need (above)" >&2
  exit 1
fi
# The example tests run the example binaries (target/debug/examples/NAME)
# and btl-run (target/debug/btl-run), which a test build alone does not
# leave there on a fresh checkout.
cargo build --workspace --examples --bins --features "$FEATURES"
# A watchdog, not a speed limit: a hung test fails the run in bounded time
# (the whole suite takes a few minutes).
timeout -k 30 1500 cargo test --workspace --all-targets --features "$FEATURES"
timeout -k 30 600 cargo test --workspace --doc --features "$FEATURES"
# The loom models are the library's (btl-tools has none).
RUSTFLAGS="--cfg btl_loom" CARGO_TARGET_DIR=target-loom cargo test -p async-btl --lib loom
# The fuzz targets follow the library's API, and each runs clean for a few
# seconds (built with the stable coverage flags: no cargo-fuzz to install;
# `scripts/fuzz.sh SECONDS` for a longer run).
cargo check --manifest-path fuzz/Cargo.toml --bins
FUZZ_BUILD=plain FUZZ_JOBS=2 scripts/fuzz.sh 3

after=$(ls /dev/shm 2>/dev/null | grep -c '^abtl\.' || true)
if [ "$after" -gt "$before" ]; then
  echo "test.sh: the tests left shared-memory files behind:" >&2
  ls -l /dev/shm | grep ' abtl\.' >&2
  exit 1
fi
echo "test.sh: all checks passed"
