#!/usr/bin/env bash
# REEF's preemption floor on the GPU, in one device call (docs/benchmarks.md "Preemption floor"):
#
#   tests   the GPU tests (crates/gputest/tests/gpu.rs) with the preempt flag in device memory, those of
#           the protocol with it in host memory, and the ring-overflow recovery test
#   bench   crates/gputest/examples/preempt_bench.rs: spin kernels and every kernel of real models
#           preempted at random instants, both flags, plans autotuned with and without a block budget
#   disb    DISB workloads (DISB, default "disb-a disb-c") under `reef` at REEF's rates: device flag
#           (reef, reef+wait, streams), host flag (reef), device flag with best-effort plans under a
#           block budget (reef), and the RT-Only reference; REEF's table last (scripts/reef_table.py)
#
# Here (no GPU), build what the call carries:
#   cargo build --release -p kairos-gputest --example preempt_bench
#   cargo test --release -p kairos-gputest --test gpu --no-run   (its path: cargo's "Executable" line)
#   cargo test --release -p kairos-gputest --test recovery --no-run
#   then strip + gzip them into $CARRY/preempt_bench.gz, $CARRY/gpu-tests.gz, $CARRY/recovery-test.gz, the binary into
#   $CARRY/kairos.gz (scripts/carry-build.sh), the CUBIN cache into .carry-cubin/.
# On the device: OUT=... STEPS="tests bench disb" bash scripts/preempt-bench.sh
# Knobs: TRIALS (spin trials per case, 1000), KERNEL_TRIALS (per model kernel, 8), MODELS (comma list),
# BUDGET_US (10), DISB, REQUESTS (2250 a point), CARRY (.carry).
set -uo pipefail
cd "$(dirname "$0")/.."
export KAIROS_CACHE_DIR=${KAIROS_CACHE_DIR:-/tmp/kairos-cubin} CUDA_DEVICE_MAX_CONNECTIONS=32 PYTHONUNBUFFERED=1
. scripts/cubin-carry.sh
CARRY=${CARRY:-.carry}
R=${OUT:-out/preempt}
W=/tmp/preempt-work
rm -rf $W
mkdir -p $R $W
BIN=/tmp/preempt-bin
mkdir -p $BIN
for b in preempt_bench gpu-tests recovery-test kairos; do
    [ -f $CARRY/$b.gz ] && gunzip -c $CARRY/$b.gz >$BIN/$b && chmod +x $BIN/$b
done
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $W/device.txt
cp "$0" $W/
STEPS=${STEPS:-tests bench disb}
BUDGET_US=${BUDGET_US:-10}
summary=""

for step in $STEPS; do
    t=$(date +%s)
    case $step in
    tests)
        # Every GPU test with the device flag (the default); the protocol's own with the host flag.
        KAIROS_ZOO_MODELS=${KAIROS_ZOO_MODELS:-resnet18,densenet121,bert_base} KAIROS_PREEMPT_FLAG=device timeout 300 $BIN/gpu-tests --test-threads 1 --include-ignored >$W/tests-device.log 2>&1
        summary="$summary\ntests (all, device flag): rc $?, $(grep -E '^test result' $W/tests-device.log | tail -1)"
        KAIROS_PREEMPT_FLAG=host timeout 240 $BIN/gpu-tests --test-threads 1 --include-ignored preempt light_launches \
            notifications launches_stay >$W/tests-host.log 2>&1
        summary="$summary\ntests (protocol, host flag): rc $?, $(grep -E '^test result' $W/tests-host.log | tail -1)"
        # The ring's limit refresh: a ring overflow while a model is served (its own process).
        if [ -x $BIN/recovery-test ]; then
            timeout 240 $BIN/recovery-test --include-ignored --exact the_engine_recovers_from_a_ring_overflow --nocapture \
                >$W/tests-ring.log 2>&1
            summary="$summary\ntests (ring overflow recovery): rc $?, $(grep -E '^test result' $W/tests-ring.log | tail -1)"
        fi
        ;;
    bench)
        timeout 400 $BIN/preempt_bench --out $W --trials ${TRIALS:-1000} --kernel-trials ${KERNEL_TRIALS:-8} \
            --block-budget-us $BUDGET_US ${MODELS:+--models $MODELS} >$W/bench.log 2>&1
        summary="$summary\npreempt_bench: rc $?"
        ;;
    disb)
        N=${REQUESTS:-2250}
        dirs=""
        for w in ${DISB:-disb-a disb-c}; do
            run() { # name, extra env, extra args
                local name=$1 envs=$2
                shift 2
                env $envs timeout 200 $BIN/kairos bench run $w --backend cuda --engine threaded --loads 1 --requests $N \
                    --saturation 0 --out $W/$w-$name "$@" >$W/$w-$name.log 2>&1
                summary="$summary\n$w $name: rc $?"
            }
            run device KAIROS_PREEMPT_FLAG=device --policies reef,reef+wait,streams
            run host KAIROS_PREEMPT_FLAG=host --policies reef
            run budget KAIROS_PREEMPT_FLAG=device --policies reef --be-block-budget-us $BUDGET_US
            run rt KAIROS_PREEMPT_FLAG=device --policies reef --rt-only
            dirs="$dirs $W/$w-device $W/$w-host=host-flag $W/$w-budget=be-blocks<=${BUDGET_US}us $W/$w-rt"
        done
        python3 scripts/reef_table.py $dirs --json $W/reef_table.json >$W/reef_table.txt 2>&1
        ;;
    esac
    summary="$summary ($(($(date +%s) - t)) s)"
done
find $W -name "*.png" -delete
find $W -name "*.svg" -delete
tar cJf $R/preempt.tar.xz -C $W .
echo "== logs"
for f in $W/tests-*.log; do [ -f $f ] && grep -E "^test |panicked" $f | head -20; done
[ -f $W/bench.log ] && sed -n '/^preempt flag ->/,$p' $W/bench.log && grep -E "failed|error" $W/bench.log
[ -f $W/reef_table.txt ] && cat $W/reef_table.txt
printf "$summary\n"
