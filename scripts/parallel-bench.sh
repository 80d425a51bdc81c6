#!/usr/bin/env bash
# DeepPlan's parallel transmission on a machine with two (or more) NVLink-connected GPUs (run on
# nvidia-h100-x2 / nvidia-h200-x2 with .carry/kairos.gz and .carry-cubin carried):
#
#   links      the topology (`kairos inspect --gpus`, nvidia-smi topo -m) and the copy bandwidths
#              with PyTorch (scripts/links_peer.py: host->GPU alone and both at once, GPU->GPU,
#              parallel-pipeline by hand)
#   cold       `kairos bench cold` on GPU 0 with GPU 1 as its secondary: pipelined, deepplan,
#              parallel, parallel-deepplan (PARALLEL_MODELS), every sample kept
#   peer       scripts/cold_peer.py on GPU 0: PyTorch copy, load+eager, load+graph, warm (the peer)
#   both       DeepPlan's Table 4: GPU 0 (secondary 1) and GPU 1 (secondary 0) cold-starting
#              bert_base with parallel-deepplan at the same time, two processes
#   serve      DeepPlan's serving experiment on two GPUs (`bench cold --serve-gpus 2`)
#   secondary  the secondary's own warm requests (scripts/warm_loop.py, resnet50 CUDA graph on
#              GPU 1) alone, then while GPU 0 cold-starts through it (parallel, many reps)
#
#   gputest    the GPU test of cold starts (crates/gputest/tests/cold.rs), carried as .carry-gpu/kairos-cuda-cold-test.gz
#   compile    the kernel library compiled on the device's cores, returned as $OUT/cubin.tgz
#
# PARALLEL_STEPS (default links,cold,peer) picks steps; PARALLEL_PEERS (default 1) the secondaries of the cold step. Results are packed into $OUT/results.tar;
# a short summary is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/parallel-bench}
mkdir -p "$OUT"
BIN=/tmp/kairos-bin
mkdir -p "$BIN"
gunzip -c .carry/kairos.gz >"$BIN/kairos" && chmod +x "$BIN/kairos" || { echo "missing .carry/kairos.gz"; exit 1; }
export KAIROS_CACHE_DIR=${KAIROS_CACHE_DIR:-/tmp/kairos-cubin}
. scripts/cubin-carry.sh
export PYTHONUNBUFFERED=1
# Never NVLink multicast on these machines (KINDS.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
steps=${PARALLEL_STEPS:-links,cold,peer}
models=${PARALLEL_MODELS:-bert_base,roberta_base,bert_large,gpt2,resnet50}
reps=${PARALLEL_REPS:-20}
has() { [[ ",$steps," == *",$1,"* ]]; }
step() { local name=$1 limit=$2; shift 2; local t=$(date +%s); echo "== $name"; timeout "$limit" "$@" > >(tee "$OUT/$name.log") 2>&1; echo "== $name: rc $? in $(( $(date +%s) - t )) s" | tee -a "$OUT/summary.txt"; }

nvidia-smi --query-gpu=index,name,driver_version,memory.total,pci.bus_id --format=csv | tee "$OUT/device.txt"
if has compile; then
    # The whole kernel library on the device's cores, packed for later calls to carry as .carry-cubin.
    step compile 400 "$BIN/kairos" kernels compile --arch 90 --variants both --jobs "$(nproc)" --cache-dir "$KAIROS_CACHE_DIR"
    tar -czf "$OUT/cubin.tgz" -C "$KAIROS_CACHE_DIR" .
fi
if has links; then
    nvidia-smi topo -m | tee "$OUT/topo.txt"
    step inspect 60 "$BIN/kairos" inspect --gpus --json "$OUT/topology.json"
    step links 120 python3 scripts/links_peer.py --out "$OUT/links_peer.json" --reps 20
fi
if has gputest; then
    # crates/gputest/tests/cold.rs: answers of every cold strategy, the parallel ones through GPU 1
    # (the test binary built here: `cargo test --release -p kairos-gputest --test cold --no-run`, stripped and gzipped).
    gunzip -c .carry-gpu/kairos-cuda-cold-test.gz >"$BIN/cold-test" && chmod +x "$BIN/cold-test"
    step gputest 300 "$BIN/cold-test" --include-ignored --test-threads=1 --nocapture
fi
if has cold; then
    step cold 420 "$BIN/kairos" bench cold --backend cuda --device 0 --peer-gpus "${PARALLEL_PEERS:-1}" --models "$models" \
        --strategies pipelined,deepplan,parallel,parallel-deepplan --reps "$reps" --out "$OUT/cold.json"
fi
if has peer; then
    step peer 300 python3 scripts/cold_peer.py --models "${PEER_MODELS:-bert_base,roberta_base,resnet50}" --reps 20 --out "$OUT/cold_peer.json"
fi
if has both; then
    # Alone first (each GPU with the other as secondary), then both at once.
    for g in 0 1; do
        step "alone-$g" 200 "$BIN/kairos" bench cold --backend cuda --device $g --peer-gpus $((1 - g)) --models bert_base \
            --strategies parallel-deepplan --reps 60 --no-autotune --out "$OUT/alone-$g.json"
    done
    t=$(date +%s)
    for g in 0 1; do
        timeout 300 "$BIN/kairos" bench cold --backend cuda --device $g --peer-gpus $((1 - g)) --models bert_base \
            --strategies parallel-deepplan --reps 60 --no-autotune --out "$OUT/both-$g.json" >"$OUT/both-$g.log" 2>&1 &
    done
    wait
    echo "== both: in $(( $(date +%s) - t )) s" | tee -a "$OUT/summary.txt"
fi
if has secondary; then
    step warm-alone 60 python3 scripts/warm_loop.py --gpu 1 --model resnet50 --seconds 8 --out "$OUT/warm_alone.json"
    "$BIN/kairos" bench cold --backend cuda --device 0 --peer-gpus 1 --models bert_base --strategies parallel \
        --reps 400 --no-autotune --out "$OUT/cold_beside_warm.json" >"$OUT/cold_beside_warm.log" 2>&1 &
    cold_pid=$!
    # Start the warm loop once the cold starts run (the profile comes first).
    for _ in $(seq 120); do grep -q "bert_base: parallel" "$OUT/cold_beside_warm.log" 2>/dev/null && break; sleep 0.5; done
    step warm-beside 60 python3 scripts/warm_loop.py --gpu 1 --model resnet50 --seconds 8 --out "$OUT/warm_beside.json"
    kill $cold_pid 2>/dev/null; wait $cold_pid 2>/dev/null
fi
if has serve; then
    # DeepPlan's serving experiment on the GPUs: bert_base instances, k on GPU k mod 2, weight budget of 8 copies
    # per GPU; each GPU loading alone (deepplan) against loading through the other (parallel-deepplan).
    step serve 540 "$BIN/kairos" bench cold --backend cuda --models bert_base --serve-gpus 2 \
        --serve-instances "${SERVE_INSTANCES:-64}" --serve-rate "${SERVE_RATES:-300,600}" --serve-requests "${SERVE_REQUESTS:-2000}" \
        --serve-budget-instances 8 --serve-slo-ms "${SERVE_SLO_MS:-4}" --strategies "${SERVE_STRATEGIES:-deepplan,parallel-deepplan}" --out "$OUT/serve.json"
fi
tar -cf "$OUT/results.tar" -C "$OUT" --exclude results.tar --exclude cubin.tgz . 2>/dev/null
echo "==== summary"
cat "$OUT/summary.txt"
[ -f "$OUT/links.log" ] && tail -12 "$OUT/links.log"
[ -f "$OUT/cold.md" ] && cat "$OUT/cold.md"
[ -f "$OUT/peer.log" ] && tail -8 "$OUT/peer.log"
[ -f "$OUT/serve.md" ] && cat "$OUT/serve.md"
for f in alone-0 alone-1 both-0 both-1; do [ -f "$OUT/$f.md" ] && { echo "-- $f"; grep parallel "$OUT/$f.md"; }; done
grep -h "^warm" "$OUT/warm-alone.log" "$OUT/warm-beside.log" 2>/dev/null
# The device tool returns few files: keep the tar, the cubins and the summary at the top.
[ "${PARALLEL_KEEP_FILES:-0}" = 1 ] || find "$OUT" -mindepth 1 -maxdepth 1 ! -name results.tar ! -name cubin.tgz ! -name summary.txt -exec rm -rf {} + 2>/dev/null
true
