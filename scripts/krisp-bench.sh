#!/usr/bin/env bash
# KRISP's experiment on the GPU, every system in one device call (docs/benchmarks.md, "KRISP on
# an H200"): GPU tests first (TESTS), what a hardware partition costs a stream of launches
# (crates/gputest/examples/partition_switch.rs, when the call carries it), then per model
# (MODELS: ARCH@bN:DURATION_MS) `kairos profile` (each kernel's right size at that batch), 1, 2
# and 4 closed-loop workers (`custom --arrival closed:1 --loads 1,2,4`) under POLICIES, PyTorch
# (one CUDA graph per model on each of 4 streams: scripts/peer_replay.py) on the very same traces,
# GPU power sampled every 100 ms beside it all, and KRISP's table last (scripts/krisp_table.py). With PAIRS,
# also pairs of different models at 2 workers (KRISP's Fig. 14): one closed-loop worker per model, each
# model's throughput over its own isolated worker (from its MODELS sweep), the PyTorch peer beside them.
#
# Here (no GPU): the binary into .carry/kairos.gz (scripts/carry-build.sh, or a Rust-only build
# with KAIROS_PREBUILT_KERNELS=.carry-cubin, stripped and gzipped), optionally the GPU tests
# (`cargo test --release -p kairos-gputest --test gpu --no-run`, stripped and gzipped into
# .carry/gpu-tests.gz) and the example (`cargo build --release -p kairos-gputest --example
# partition_switch` into .carry/partition_switch.gz).
# On the device: OUT=... MODELS="squeezenet1_1@b1:3000" bash scripts/krisp-bench.sh
# Knobs: MODELS (default "squeezenet1_1@b1:3000 densenet121@b1:7000"), POLICIES (streams, paella,
# krisp and krisp:inf with software masks and as green contexts, static:4 both ways), PEER_MODES
# (graph:4; "" skips the peer), PEERS_S (90 s per model), PROFILE_S (150 s), KAIROS_S (400 s per
# model and per pair), TESTS (name filters of the GPU tests; "" skips them), CHECK (1: `kairos run --check`
# of every model under CHECK_POLICIES, default "krisp+green static+green", 8 concurrent copies against tract),
# PAIRS (default "": none; "A@bN+B@bM:DURATION_MS ...", e.g. "squeezenet1_1@b1+densenet121@b1:4000": each pair
# as `custom --models A,B --arrival closed-each:1 --loads 1` (one closed-loop worker per model, same class)
# under POLICIES into pair-A+B/, its models profiled first where MODELS did not; give each model a MODELS sweep
# too, or its throughput is not normalised).
set -uo pipefail
cd "$(dirname "$0")/.."
export KAIROS_CACHE_DIR=${KAIROS_CACHE_DIR:-/tmp/kairos-cubin} KAIROS_NO_AUTOTUNE=true CUDA_DEVICE_MAX_CONNECTIONS=32 \
    PYTHONUNBUFFERED=1
. scripts/cubin-carry.sh
R=${OUT:-out/krisp}
W=/tmp/krisp-work
rm -rf $W
mkdir -p $R $W/profiles
BIN=/tmp/krisp-bin
mkdir -p $BIN
C=${CARRY:-.carry}
gunzip -c $C/kairos.gz >$BIN/kairos && chmod +x $BIN/kairos
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $W/device.txt
cp "$0" $W/
summary=""
TESTS=${TESTS-launches_stay_inside_partitions gpc_probe}
if [ -n "$TESTS" ] && [ -f $C/gpu-tests.gz ]; then
    t=$(date +%s)
    gunzip -c $C/gpu-tests.gz >$BIN/gpu-tests && chmod +x $BIN/gpu-tests
    timeout 200 $BIN/gpu-tests --test-threads 1 --include-ignored --nocapture $TESTS >$W/tests.log 2>&1
    summary="$summary
tests ($TESTS): rc $? ($(($(date +%s) - t)) s), $(grep -E '^test result' $W/tests.log | tail -1)"
    grep -E "^test |GPC set|groups 0x|panicked" $W/tests.log | tail -40
fi
if [ -f $C/partition_switch.gz ]; then
    gunzip -c $C/partition_switch.gz >$BIN/partition_switch && chmod +x $BIN/partition_switch
    timeout 120 $BIN/partition_switch --out $W/partition_switch.json >$W/partition_switch.txt 2>&1
    summary="$summary
partition_switch: rc $?"
fi
(nvidia-smi --query-gpu=power.draw --format=csv,noheader,nounits -lms 100 | while read -r l; do echo "$(date +%s%3N),$l"; done >$W/power.csv) &
policies=${POLICIES:-streams,paella,krisp,krisp+green,krisp:inf,krisp:inf+green,static,static+green}
profiled=" "
profile() { # ARCH@bN: each kernel's right size at that batch, into $W/profiles
    local m=$1 arch=${1%@b*} b=${1#*@b} t
    profiled="$profiled$m "
    t=$(date +%s)
    timeout ${PROFILE_S:-150} $BIN/kairos profile $arch --batch $b --dtype f16 --repeats 3 -o $W/profiles/$arch-f16-b$b.json \
        >$W/profile-$m.log 2>&1
    summary="$summary
profile $m: rc $? ($(($(date +%s) - t)) s) $(tail -1 $W/profile-$m.log)"
}
results=""
for entry in ${MODELS:-squeezenet1_1@b1:3000 densenet121@b1:7000}; do
    m=${entry%%:*}
    dur=${entry##*:}
    profile $m
    t=$(date +%s)
    timeout ${KAIROS_S:-400} $BIN/kairos bench run custom --models $m --arrival closed:1 --loads 1,2,4 --duration-ms $dur \
        --traces --policies $policies \
        --saturation 0 --profiles $W/profiles --backend cuda --engine threaded --out $W/$m >$W/$m.log 2>&1
    summary="$summary
$m: rc $? ($(($(date +%s) - t)) s)"
    results="$results $W/$m/results.json"
done
pair_results=""
for entry in ${PAIRS:-}; do
    pair=${entry%%:*}
    dur=${entry##*:}
    [ "$dur" != "$entry" ] || dur=4000
    a=${pair%%+*}
    b=${pair#*+}
    if [ "$a" = "$pair" ] || [ -z "$a" ] || [ -z "$b" ] || [ "$a" = "$b" ]; then
        summary="$summary
pair $entry: not A@bN+B@bM:DURATION_MS of two different models; skipped"
        continue
    fi
    for m in $a $b; do
        case "$profiled" in *" $m "*) ;; *) profile $m ;; esac
    done
    workload="custom --models $a,$b --arrival closed-each:1"
    t=$(date +%s)
    timeout ${KAIROS_S:-400} $BIN/kairos bench run $workload --loads 1 --duration-ms $dur --traces --policies $policies \
        --saturation 0 --profiles $W/profiles --backend cuda --engine threaded --out $W/pair-$pair >$W/pair-$pair.log 2>&1
    summary="$summary
pair $pair ($workload): rc $? ($(($(date +%s) - t)) s)"
    # A pair that wrote nothing stays out of the table (krisp_table.py stops at a missing file).
    [ -f $W/pair-$pair/results.json ] && pair_results="$pair_results $W/pair-$pair/results.json"
done
for r in $results $pair_results; do
    d=$(dirname $r)
    [ -n "${PEER_MODES-graph:4}" ] || break
    t=$(date +%s)
    timeout $((${PEERS_S:-90} + 20)) python3 scripts/peer_replay.py --traces $d/traces --modes ${PEER_MODES:-graph:4} \
        --budget-s ${PEERS_S:-90} --out $d/peers.json >$d/peers.log 2>&1
    summary="$summary
peers $(basename $d): rc $? ($(($(date +%s) - t)) s)"
    $BIN/kairos bench report --results $r --peers $d/peers.json >$d/report.log 2>&1 || tail -3 $d/report.log
done
pkill -f "power.draw" || true
if [ "${CHECK:-1}" = 1 ]; then
    for entry in ${MODELS:-squeezenet1_1@b1:3000 densenet121@b1:7000}; do
        m=${entry%%:*}
        for p in ${CHECK_POLICIES:-krisp+green static+green}; do
            timeout 120 $BIN/kairos run ${m%@b*} --backend cuda --dtype f16 --batch ${m#*@b} --check --policy $p --requests 8 \
                >$W/check-$m-$p.log 2>&1
            summary="$summary
check $m $p: rc $? $(grep -E 'copies|L2|rror' $W/check-$m-$p.log | tr '\n' ' ' | cut -c1-200)"
        done
    done
fi
find $W -name "*.png" -delete
find $W -name "*.svg" -delete
python3 scripts/krisp_table.py $results $pair_results --power $W/power.csv --json $W/krisp_table.json >$W/krisp_table.txt 2>&1
tar cJf $R/krisp.tar.xz -C $W .
[ -f $W/partition_switch.txt ] && cat $W/partition_switch.txt
echo -e "$summary"
cat $W/krisp_table.txt
