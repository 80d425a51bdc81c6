#!/usr/bin/env bash
# Warm requests beside cold loads on one GPU (issue 27's last target: warm p99 under cold loads
# <= 1.1x without them), then single cold inferences with and without the copy window.
#
# Run on the device from the repository root, with the release binary gzipped at
# $CARRY/kairos.gz (and, optionally, the GPU test binary of crates/gputest/tests/cold.rs at
# $CARRY/cold-test.gz); results go to $OUT/r (JSON with every request, logs, tables); the tables
# are printed last. Knobs (environment): RATE (300), INSTANCES (32), HOT (4), SHARE (0.8),
# BUDGET (6 copies), EVICTION (lru; lru2; or both, "lru lru2": the resident reference runs once),
# POLICIES ("paella streams:8"), REQUESTS (2000), SERVING (1: the serving experiment below), NOWINDOW
# (1: also the window off: first policy, goodput), SINGLE (1: single cold inferences of SINGLE_MODELS,
# default bert_base,gpt2, at seq 128 and gpt2 at 1024 under paella, with and without the copy window,
# beside scripts/cold_peer.py), GOODPUT (1: DeepPlan's goodput experiment, GOODPUT_INSTANCES (64)
# bert_base instances, arrivals uniform over them at GOODPUT_RATES ("300,330,360") req/s, a budget
# of 4 copies, fifo, every strategy: where pipelining's p99 passes the 100 ms SLO), AZURE (1: the
# `deepplan-azure` preset, 8 bert_base, 8 roberta_base and 2 gpt2 instances under a third of their
# weights, the trace in data/traces or AZURE_TRACE=FILE, loads 0.25 and 0.5, paella and streams),
# LINKS_CHUNKS (MiB, e.g. "1 2 4 8": the copy engine's rate in copies of that size,
# scripts/links_peer.py on GPU 0, first), PEER (1: PyTorch's load-then-run server,
# scripts/cold_serve_peer.py, on the same arrivals as the goodput points and the first policy's
# serving points).
#
# The serving experiment: bert_base instances i0..i{INSTANCES-1}; the first HOT take SHARE of a
# Poisson stream of RATE req/s and stay resident, the others take the rest and are cold most of
# the time (the budget holds BUDGET copies). Per policy: the all-resident reference
# (--serve-baseline: same arrivals, no budget), then load-then-run, pipelined and deepplan with
# the default copy window; under the first policy also pipelined and deepplan with the window off
# (0: every load's copies at once, the behaviour before the window). The column "hot warm p50 /
# p99" is what the target compares: a strategy's against the resident row's.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to a results folder}"
CARRY=${CARRY:-.carry}
RATE=${RATE:-300}
INSTANCES=${INSTANCES:-32}
HOT=${HOT:-4}
SHARE=${SHARE:-0.8}
BUDGET=${BUDGET:-6}
POLICIES=${POLICIES:-"paella streams:8"}
REQUESTS=${REQUESTS:-2000}
SINGLE=${SINGLE:-1}
SERVING=${SERVING:-1}
AZURE=${AZURE:-0}
EVICTION=${EVICTION:-lru}
NOWINDOW=${NOWINDOW:-1}
SINGLE_MODELS=${SINGLE_MODELS:-bert_base,gpt2}
GOODPUT=${GOODPUT:-0}
LINKS_CHUNKS=${LINKS_CHUNKS:-}
PEER=${PEER:-1}
GOODPUT_INSTANCES=${GOODPUT_INSTANCES:-64}
GOODPUT_RATES=${GOODPUT_RATES:-300,330,360}
export KAIROS_CACHE_DIR=${KAIROS_CACHE_DIR:-/tmp/kairos-cubin} KAIROS_PROGRESS=lines
. scripts/cubin-carry.sh
B=/tmp/kb
mkdir -p $B
gunzip -c "$CARRY/kairos.gz" >$B/kairos && chmod +x $B/kairos
R=$OUT/r
mkdir -p $R
cp "$0" $R/
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $R/gpu.txt
step() { # name timeout command...
    local name=$1 t=$2
    shift 2
    local t0=$(date +%s)
    timeout "$t" "$@" >"$R/$name.log" 2>&1
    echo "$name: rc $? in $(($(date +%s) - t0)) s"
}
if [ -f "$CARRY/cold-test.gz" ]; then
    gunzip -c "$CARRY/cold-test.gz" >$B/cold-test && chmod +x $B/cold-test
    KAIROS_GPU_TESTS=1 step cold-test 150 $B/cold-test --include-ignored --test-threads=1 --nocapture
fi
for c in $LINKS_CHUNKS; do
    step links-$c 60 python3 scripts/links_peer.py --gpus 0 --chunk-mib "$c" --reps 20 --out $R/links-$c.json
done
SERVE=(bench cold --models bert_base --serve-instances "$INSTANCES" --serve-rate "$RATE" --serve-requests "$REQUESTS"
    --serve-budget-instances "$BUDGET" --serve-hot "$HOT" --serve-hot-share "$SHARE")
[ "$SERVING" = 1 ] || POLICIES=
first=1
baseline=(--serve-baseline)
for EV in $EVICTION; do
    for P in $POLICIES; do
        tag=${P//:/}-$EV
        step "serve-$tag" 300 $B/kairos "${SERVE[@]}" --eviction "$EV" "${baseline[@]}" --policy "$P" \
            --out $R/serve-$tag.json
        if [ $first = 1 ] && [ "$NOWINDOW" = 1 ]; then
            step "serve-$tag-nowindow" 200 $B/kairos "${SERVE[@]}" --eviction "$EV" --policy "$P" \
                --strategies pipelined,deepplan --copy-window-bytes 0 --out $R/serve-$tag-nowindow.json
        fi
        if [ $first = 1 ] && [ "$PEER" = 1 ]; then
            for r in ${RATE//,/ }; do
                step "serve-peer-$r" 300 python3 scripts/cold_serve_peer.py --replay $R/serve-$tag.json --rate "$r" \
                    --out $R/serve-peer-$r.json
            done
        fi
        first=0
    done
    baseline=()
done
if [ "$GOODPUT" = 1 ]; then
    step goodput 400 $B/kairos bench cold --models bert_base --serve-instances "$GOODPUT_INSTANCES" \
        --serve-rate "$GOODPUT_RATES" --serve-requests "$REQUESTS" --serve-budget-instances 4 --policy fifo \
        --out $R/goodput.json
    if [ "$NOWINDOW" = 1 ]; then
        step goodput-nowindow 400 $B/kairos bench cold --models bert_base --serve-instances "$GOODPUT_INSTANCES" \
            --serve-rate "$GOODPUT_RATES" --serve-requests "$REQUESTS" --serve-budget-instances 4 --policy fifo \
            --copy-window-bytes 0 --out $R/goodput-nowindow.json
    fi
    if [ "$PEER" = 1 ]; then
        for r in ${GOODPUT_RATES//,/ }; do
            step goodput-peer-$r 300 python3 scripts/cold_serve_peer.py --replay $R/goodput.json --rate "$r" \
                --out $R/goodput-peer-$r.json
        done
    fi
fi
if [ "$SINGLE" = 1 ]; then
    step single128 150 $B/kairos bench cold --models "$SINGLE_MODELS" --policy paella --reps 20 --out $R/single128.json
    step single128-nowindow 150 $B/kairos bench cold --models "$SINGLE_MODELS" --policy paella --reps 20 \
        --copy-window-bytes 0 --out $R/single128-nowindow.json
    step peer128 90 python3 scripts/cold_peer.py --models "$SINGLE_MODELS" --reps 30 --out $R/peer128.json
    if [[ ,$SINGLE_MODELS, == *,gpt2,* ]]; then
        step single1024 150 $B/kairos bench cold --models gpt2 --seq-len 1024 --policy paella --reps 20 \
            --out $R/single1024.json
        step peer1024 90 python3 scripts/cold_peer.py --models gpt2 --seq 1024 --reps 30 --out $R/peer1024.json
    fi
fi
if [ "$AZURE" = 1 ]; then
    step azure 400 $B/kairos bench run deepplan-azure --backend cuda --policies paella,streams --loads 0.25,0.5 \
        --instances 2 --requests "$REQUESTS" --arrival "azure:${AZURE_TRACE:-data/traces/azure-functions-sample.csv}" --out $R/azure
fi
grep -hE "^test |test result|panicked" $R/cold-test.log 2>/dev/null | tail -12
grep -lE "panicked|^Error" $R/*.log 2>/dev/null | sed 's/^/errors in: /'
for f in $R/serve-*.md $R/goodput*.md $R/single*.md $R/azure/results.md; do
    [ -f "$f" ] && echo "== $(basename "$f")" && cat "$f"
done
for f in $R/*peer-*.log; do
    [ -f "$f" ] && echo "== $(basename "$f")" && tail -2 "$f"
done
for f in $R/links-*.log $R/peer*.log; do
    [ -f "$f" ] && echo "== $(basename "$f")" && tail -8 "$f"
done
# Everything in one archive (the device tool brings back a few files per call).
tar -C "$OUT" -czf "$OUT/cold-warm.tgz" r && rm -rf "$R"
