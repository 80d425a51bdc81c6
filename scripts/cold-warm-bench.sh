#!/usr/bin/env bash
# Warm requests beside cold loads on one GPU (issue 27's last target: warm p99 under cold loads
# <= 1.1x without them), then single cold inferences with and without the copy window.
#
# Run on the device from the repository root, with the release binary gzipped at
# $CARRY/kairos.gz (and, optionally, the GPU test binary of crates/gputest/tests/cold.rs at
# $CARRY/cold-test.gz); results go to $OUT/r (JSON with every request, logs, tables); the tables
# are printed last. Knobs (environment): RATE (300), INSTANCES (32), HOT (4), SHARE (0.8),
# BUDGET (6 copies), EVICTION (lru; lru2), POLICIES ("paella streams:8"), REQUESTS (2000), SERVING (1: the serving
# experiment below), SINGLE (1: single cold inferences of bert_base and gpt2 at seq 128 and gpt2 at
# 1024 under paella, with and without the copy window, beside scripts/cold_peer.py), AZURE (1: the
# `deepplan-azure` preset, 8 bert_base, 8 roberta_base and 2 gpt2 instances under a third of their
# weights, the trace in data/traces or AZURE_TRACE=FILE, loads 0.25 and 0.5, paella and streams).
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
SERVE=(bench cold --models bert_base --serve-instances "$INSTANCES" --serve-rate "$RATE" --serve-requests "$REQUESTS"
    --serve-budget-instances "$BUDGET" --serve-hot "$HOT" --serve-hot-share "$SHARE" --eviction "$EVICTION")
first=1
[ "$SERVING" = 1 ] || POLICIES=
for P in $POLICIES; do
    tag=${P//:/}
    step "serve-$tag" 300 $B/kairos "${SERVE[@]}" --serve-baseline --policy "$P" --out $R/serve-$tag.json
    if [ $first = 1 ]; then
        step "serve-$tag-nowindow" 200 $B/kairos "${SERVE[@]}" --policy "$P" --strategies pipelined,deepplan \
            --copy-window-bytes 0 --out $R/serve-$tag-nowindow.json
        first=0
    fi
done
if [ "$SINGLE" = 1 ]; then
    step single128 150 $B/kairos bench cold --models bert_base,gpt2 --policy paella --reps 20 --out $R/single128.json
    step single128-nowindow 150 $B/kairos bench cold --models bert_base,gpt2 --policy paella --reps 20 \
        --copy-window-bytes 0 --out $R/single128-nowindow.json
    step single1024 150 $B/kairos bench cold --models gpt2 --seq-len 1024 --policy paella --reps 20 --out $R/single1024.json
    step peer128 90 python3 scripts/cold_peer.py --models bert_base,gpt2 --reps 30 --out $R/peer128.json
    step peer1024 90 python3 scripts/cold_peer.py --models gpt2 --seq 1024 --reps 30 --out $R/peer1024.json
fi
if [ "$AZURE" = 1 ]; then
    step azure 400 $B/kairos bench run deepplan-azure --backend cuda --policies paella,streams --loads 0.25,0.5 \
        --instances 2 --arrival "azure:${AZURE_TRACE:-data/traces/azure-functions-sample.csv}" --out $R/azure
fi
grep -hE "^test |test result|panicked" $R/cold-test.log 2>/dev/null | tail -12
grep -lE "panicked|^Error" $R/*.log 2>/dev/null | sed 's/^/errors in: /'
for f in $R/serve-*.md $R/single*.md $R/azure/results.md; do
    [ -f "$f" ] && echo "== $(basename "$f")" && cat "$f"
done
for f in $R/peer*.log; do
    [ -f "$f" ] && echo "== $(basename "$f")" && tail -8 "$f"
done
# Everything in one archive (the device tool brings back a few files per call).
tar -C "$OUT" -czf "$OUT/cold-warm.tgz" r && rm -rf "$R"
