#!/usr/bin/env bash
# The GPU check of smcuda's GPU layer, for a machine with an NVIDIA GPU
# and no Rust toolchain: it runs prebuilt binaries, compiles nothing.
#
# Here (with Rust), build the binaries into an ignored folder:
#   scripts/gpu-check.sh --build            # -> target/gpu-bin/
# There, from a copy of the tree that carries target/gpu-bin/:
#   scripts/gpu-check.sh [BTL-GPU-CHECK ARGS...]
# It prints the driver's view (nvidia-smi), what btl-info finds for
# smcuda, then runs btl-gpu-check (two processes: IPC handles, copies
# with checksums from 8 B to 256 MiB, ordering behind a peer's event,
# free and allocate again, bandwidth beside a local device-to-device
# copy), then the smcuda transport's own scenarios through the fabric
# (tests/smcuda.rs on the driver: put/get and lent sends with VMM descriptors, legacy
# handles and BTL_SMCUDA_IPC=off through the host, registered memory,
# dropped futures, an Interrupt-mode ping-pong, a peer killed), and the
# gpu_ring example. The figures go to $OUT/gpu-check.json (or
# ./gpu-check.json).
# BTL_GPU_BIN names another folder of binaries; BTL_SMCUDA_GPU=test-double
# runs the same check on the test double (no GPU needed). Exit status:
# that of btl-gpu-check (0: passed; 3: no GPU found).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bin=${BTL_GPU_BIN:-$root/target/gpu-bin}

if [ "${1:-}" = "--build" ]; then
  cd "$root"
  cargo build --release -p btl-tools --features cuda --bin btl-gpu-check --bin btl-info
  mkdir -p "$bin"
  for b in btl-gpu-check btl-info; do
    cp "target/release/$b" "$bin/$b"
    strip "$bin/$b"
  done
  cargo build --release -p async-btl --features cuda --example gpu_ring
  cp target/release/examples/gpu_ring "$bin/gpu_ring"
  strip "$bin/gpu_ring"
  # The transport's test binary (it runs its ranks by starting itself).
  tests=$(cargo test --release -p async-btl --features cuda --test smcuda --no-run 2>&1 |
    sed -n 's/.*Executable tests\/smcuda.rs (\(.*\))$/\1/p')
  [ -x "$tests" ] || { echo "gpu-check.sh: the smcuda test binary was not built" >&2; exit 2; }
  cp "$tests" "$bin/smcuda-tests"
  strip "$bin/smcuda-tests"
  ls -l "$bin"
  exit 0
fi

for b in btl-gpu-check btl-info; do
  if [ ! -x "$bin/$b" ]; then
    echo "gpu-check.sh: $bin/$b is missing: build it with scripts/gpu-check.sh --build" >&2
    exit 2
  fi
done
out=${OUT:-.}
mkdir -p "$out"
echo "== driver"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi -L || true
  nvidia-smi --query-gpu=name,driver_version,memory.total,mig.mode.current --format=csv || true
else
  echo "nvidia-smi: not found"
fi
echo "== btl-info (smcuda)"
"$bin/btl-info" | grep -i -A1 smcuda || true
echo "== btl-gpu-check"
require=()
[ "${BTL_SMCUDA_GPU:-cuda}" = "cuda" ] && require=(--require-gpu)
set +e
timeout -k 10 150 "$bin/btl-gpu-check" "${require[@]}" --json "$out/gpu-check.json" "$@"
rc=$?
set -e
echo "gpu-check.sh: btl-gpu-check exited with $rc; figures in $out/gpu-check.json"
# The transport's scenarios need the driver (the double has its own tests).
if [ $rc -eq 0 ] && [ "${BTL_SMCUDA_GPU:-cuda}" = "cuda" ]; then
  echo "== smcuda transport through the fabric"
  if [ ! -x "$bin/smcuda-tests" ]; then
    echo "gpu-check.sh: $bin/smcuda-tests is missing: build it with scripts/gpu-check.sh --build" >&2
    exit 2
  fi
  set +e
  BTL_SMCUDA_TEST_GPU=cuda timeout -k 10 150 "$bin/smcuda-tests" \
    on_a_real_gpu_device_memory_goes_by_each_ipc_kind_and_through_the_host \
    --exact --nocapture --test-threads=1
  rc=$?
  set -e
  echo "gpu-check.sh: the smcuda transport scenarios exited with $rc"
  if [ $rc -eq 0 ] && [ -x "$bin/gpu_ring" ]; then
    echo "== gpu_ring example (3 ranks, lent device memory around a ring)"
    set +e
    timeout -k 10 60 "$bin/gpu_ring"
    rc=$?
    set -e
  fi
fi
exit $rc
