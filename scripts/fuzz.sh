#!/usr/bin/env bash
# Run every fuzz target in fuzz/ for SECONDS each (one process, one core),
# print the runs per target, and fail if any target finds a crash (its
# input is left in fuzz/artifacts/TARGET/).
#   scripts/fuzz.sh SECONDS [TARGET...]
# By default through cargo-fuzz (installed if missing) on the stable
# toolchain, RUSTC_BOOTSTRAP=1 letting it pass its nightly flags: the
# address sanitiser and debug assertions are on. FUZZ_BUILD=plain instead
# builds the targets with the stable coverage flags of fuzz/Cargo.toml
# (no sanitiser, assertions and overflow checks on) and runs the binaries
# directly: no cargo-fuzz to install, what CI does. FUZZ_JOBS sets cargo's
# build jobs (default 1).
set -euo pipefail
cd "$(dirname "$0")/../fuzz"

secs=${1:?usage: scripts/fuzz.sh SECONDS [TARGET...]}
shift
targets=("$@")
if ((${#targets[@]} == 0)); then
  mapfile -t targets < <(sed -n '/^\[\[bin\]\]/,/^path/s/^name = "\(.*\)"/\1/p' Cargo.toml)
fi
export CARGO_BUILD_JOBS=${FUZZ_JOBS:-1}
mode=${FUZZ_BUILD:-cargo-fuzz}
case "$mode" in
  plain)
    triple=$(rustc -vV | sed -n 's/^host: //p')
    export CARGO_TARGET_DIR=target/plain
    RUSTFLAGS="--cfg fuzzing -Cdebug-assertions -Coverflow-checks -Cpasses=sancov-module \
-Cllvm-args=-sanitizer-coverage-level=4 -Cllvm-args=-sanitizer-coverage-inline-8bit-counters \
-Cllvm-args=-sanitizer-coverage-pc-table -Cllvm-args=-sanitizer-coverage-trace-compares" \
      cargo build --release --bins --target "$triple"
    bin=$CARGO_TARGET_DIR/$triple/release
    ;;
  cargo-fuzz)
    if ! cargo fuzz --version >/dev/null 2>&1; then
      echo "fuzz.sh: installing cargo-fuzz"
      cargo install cargo-fuzz --locked
    fi
    export RUSTC_BOOTSTRAP=1
    cargo fuzz build
    ;;
  *)
    echo "fuzz.sh: FUZZ_BUILD is plain or cargo-fuzz, not $mode" >&2
    exit 2
    ;;
esac

failed=()
for t in "${targets[@]}"; do
  mkdir -p "corpus/$t" "artifacts/$t"
  log=$(mktemp)
  # No -jobs or -workers: one process on one core.
  args=(-max_total_time="$secs" -print_final_stats=1 -artifact_prefix="artifacts/$t/")
  if [ "$mode" = plain ]; then
    run=("$bin/$t" "${args[@]}" "corpus/$t")
  else
    run=(cargo fuzz run "$t" "corpus/$t" -- "${args[@]}")
  fi
  if "${run[@]}" >"$log" 2>&1; then
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  else
    runs=CRASH
    failed+=("$t")
    tail -40 "$log" >&2
  fi
  rm -f "$log"
  printf 'fuzz.sh: %-20s %12s runs in %s s\n' "$t" "$runs" "$secs"
done
if ((${#failed[@]})); then
  echo "fuzz.sh: crashes in ${failed[*]} (inputs in fuzz/artifacts/)" >&2
  exit 1
fi
echo "fuzz.sh: ${#targets[@]} targets ran clean"
