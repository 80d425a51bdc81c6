#!/usr/bin/env bash
# REEF's DISB table on the GPU, every system in one device call (docs/benchmarks.md, "REEF's DISB
# workloads on an H200"): for each workload, `kairos bench run` under POLICIES, the RT-Only
# reference (`reef`, best-effort clients removed), then the PyTorch peer (one CUDA graph per model
# per worker, real-time workers on high-priority streams: scripts/peer_replay.py) on the very same
# arrival traces, and REEF's metrics in one table last (scripts/reef_table.py).
#
# Here (no GPU): scripts/carry-build.sh (the binary with the kernel library embedded into
# .carry/kairos.gz, the CUBIN cache into .carry-cubin/).
# On the device: OUT=... WORKLOADS="disb-a disb-b@220" bash scripts/reef-bench.sh
# Knobs: WORKLOADS (disb-X, or disb-X@R: the real-time clients at R req/s each, `--rt-rate R`;
# or reef-pairs@PAIRS: REEF's padding experiment on `--pairs PAIRS`, e.g. reef-pairs@vgg19+*, each
# point sized by the preset for >= 2000 real-time requests; default "disb-a disb-c disb-e"), POLICIES (reef,reef+runs,streams), REQUESTS (2250 a point:
# >= 2000 real-time requests after the 10% warm-up), PEER_MODES (graph-priority:4; "" skips the
# peer), PEERS_S (the peer's time budget, 200 s), RT_ONLY (1), EXTRA (more `bench run` arguments),
# TESTS (name filters of crates/gputest/tests/gpu.rs to run first when the call carries
# $CARRY/gpu-tests.gz, built with `cargo test --release -p kairos-gputest --test gpu --no-run`;
# default: stop words, preemption, light launches, recorded runs; "" skips them).
set -uo pipefail
cd "$(dirname "$0")/.."
export KAIROS_CACHE_DIR=${KAIROS_CACHE_DIR:-/tmp/kairos-cubin} CUDA_DEVICE_MAX_CONNECTIONS=32 PYTHONUNBUFFERED=1
. scripts/cubin-carry.sh
R=${OUT:-out/reef}
W=/tmp/reef-work
rm -rf $W
mkdir -p $R $W
BIN=/tmp/reef-bin
mkdir -p $BIN
gunzip -c ${CARRY:-.carry}/kairos.gz >$BIN/kairos && chmod +x $BIN/kairos
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $W/device.txt
cp "$0" $W/
N=${REQUESTS:-2250}
summary=""
dirs=""
TESTS=${TESTS-stop_words preempted_launches light_launches recorded_runs}
if [ -n "$TESTS" ] && [ -f ${CARRY:-.carry}/gpu-tests.gz ]; then
    t=$(date +%s)
    gunzip -c ${CARRY:-.carry}/gpu-tests.gz >$BIN/gpu-tests && chmod +x $BIN/gpu-tests
    timeout 300 $BIN/gpu-tests --test-threads 1 --include-ignored --nocapture $TESTS >$W/tests.log 2>&1
    summary="$summary
tests ($TESTS): rc $? ($(($(date +%s) - t)) s), $(grep -E '^test result' $W/tests.log | tail -1)"
    grep -E "^test |trial|panicked" $W/tests.log | tail -40
fi
set -f # reef-pairs@vgg19+*: no globbing
for spec in ${WORKLOADS:-disb-a disb-c disb-e}; do
    w=${spec%%@*}
    rate="--requests $N"
    name=$w
    if [ "$w" = reef-pairs ]; then
        pairs=${spec#*@}
        [ "$spec" = "$w" ] && pairs='*+*'
        rate="--pairs $pairs"
        name="$w-$(echo "$pairs" | tr -c 'a-z0-9_\n' '-' | sed 's/-*$//')"
    elif [ "$spec" != "$w" ]; then
        rate="--requests $N --rt-rate ${spec#*@}"
        name="$w-rt${spec#*@}"
    fi
    t=$(date +%s)
    timeout ${KAIROS_S:-240} $BIN/kairos bench run $w --backend cuda --engine threaded --loads 1 --traces \
        --policies ${POLICIES:-reef,reef+runs,streams} --saturation 0 $rate ${EXTRA:-} --out $W/$name >$W/$name.log 2>&1
    summary="$summary\n$name: rc $? ($(($(date +%s) - t)) s)"
    dirs="$dirs $W/$name"
    if [ "${RT_ONLY:-1}" = 1 ]; then
        t=$(date +%s)
        timeout ${KAIROS_RT_S:-120} $BIN/kairos bench run $w --backend cuda --engine threaded --loads 1 --traces --rt-only \
            --policies reef --saturation 0 $rate ${EXTRA:-} --out $W/$name-rt >$W/$name-rt.log 2>&1
        summary="$summary\n$name rt-only: rc $? ($(($(date +%s) - t)) s)"
        dirs="$dirs $W/$name-rt"
    fi
done
set +f
peers=""
if [ -n "${PEER_MODES-graph-priority:4}" ]; then
    t=$(date +%s)
    traces=""
    for d in $dirs; do traces="$traces $d/traces"; done
    budget=${PEERS_S:-200}
    timeout $((budget + 30)) python3 scripts/peer_replay.py --traces $traces --modes ${PEER_MODES:-graph-priority:4} \
        --budget-s $budget --out $W/peers.json >$W/peers.log 2>&1
    summary="$summary\npeers: rc $? ($(($(date +%s) - t)) s)"
    [ -f $W/peers.json ] && peers="--peers $W/peers.json"
fi
python3 scripts/reef_table.py $dirs $peers --matrix --json $W/reef_table.json >$W/reef_table.txt 2>&1
find $W -name "*.png" -delete
find $W -name "*.svg" -delete
tar cJf $R/reef.tar.xz -C $W .
for d in $dirs; do grep -hE "^  (disb|reef-pairs)|error|Error" $d.log | head -12; done
[ -f $W/peers.log ] && grep -E "done|wrote|skipped|budget" $W/peers.log | tail -8
cat $W/reef_table.txt
printf "$summary\n"
