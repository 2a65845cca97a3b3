#!/usr/bin/env bash
# The GPU checks and figures in one go, on a machine with one CUDA GPU (run from the repo root).
#
#   bash bench/gpu.sh [tests] [engine] [sync] [train]     # default: all four, in this order
#
# tests   the `gpu`-marked tests: engine logprobs, Megatron logits and bf16 steps, CUDA-IPC sync
# engine  bench/engine_throughput.py on the ~0.5B `base` preset in bf16, with its roofline
# sync    bench/weight_sync.py: CUDA-IPC sync of the ~1.3B `large` preset against a device copy
# train   bench/train_step.py: Megatron bf16 training of `base`, tokens/s and MFU
#
# Each part runs under its own time limit (BENCH_TIMEOUT seconds, default 240), so one failure
# does not hide the rest; its output and log land in OUT_DIR (default runs/bench/gpu).
set -u
out=${OUT_DIR:-runs/bench/gpu}
mkdir -p "$out"
limit=${BENCH_TIMEOUT:-240}
py=${PYTHON:-python}

part() {
    local name=$1; shift
    echo "== $name: $*"
    local started=$SECONDS
    timeout -k 10 "$limit" "$@" >"$out/$name.out" 2>"$out/$name.log"
    echo "== $name: exit $? after $((SECONDS - started)) s"
    cat "$out/$name.out"
    tail -n 8 "$out/$name.log"
}

parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(tests engine sync train)
for name in "${parts[@]}"; do
    case $name in
        tests) part tests $py -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_cuda.py \
                   tests/train/test_weight_sync_cuda.py tests/train/test_cuda.py ;;
        engine) part engine $py bench/engine_throughput.py --device cuda --preset base --dtype bfloat16 ;;
        sync) part sync $py bench/weight_sync.py --device cuda --presets large ;;
        train) part train $py bench/train_step.py --device cuda ;;
        *) echo "unknown part: $name (tests, engine, sync, train)"; exit 2 ;;
    esac
done
