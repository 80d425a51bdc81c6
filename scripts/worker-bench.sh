#!/usr/bin/env bash
# GPU worker processes on a real GPU (nvidia-h100-x1; carry $CARRY/kairos.gz, default .carry, and .carry-cubin):
#
#   overhead  resnet50 f16 over REST (binary tensors), --gpu-workers off then on, the same GPU:
#             2000 closed-loop requests from 1 client, 4000 from 8 (scripts/worker_driver.py latency)
#   fault     resnet18 f16 with --gpu-workers on and --test-fault-at-launch N: the first worker's N-th
#             launch writes to an unmapped address (a sticky CUDA fault); 4 clients send requests
#             throughout; every outcome kept; the outage measured (worker_driver.py fault)
#   inproc    the same fault with --gpu-workers off: what happens without workers
#   hang      resnet18 f16 with --gpu-workers on and --test-hang-at-launch N: before the first worker's
#             N-th launch a kernel fills every SM for minutes (a hung launch); the watchdog (2 s) fails
#             the requests held, the worker exits (its exit ends the kernel) and a new one serves;
#             4 clients throughout (worker_driver.py fault)
#   soak      `kairos bench soak --backend cuda` for SOAK_S seconds (default 540) at SOAK_RATE requests/s
#             (default 100) over SOAK_MODELS, through the GPU worker (the default with CUDA)
#
# WORKER_STEPS (default overhead,fault,inproc) picks steps. Results are packed into $OUT/results.tar.xz;
# a short summary is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/worker-bench}
mkdir -p "$OUT"
BIN=/tmp/kairos-bin
mkdir -p "$BIN"
CARRY=${CARRY:-.carry}
gunzip -c "$CARRY/kairos.gz" >"$BIN/kairos" && chmod +x "$BIN/kairos" || { echo "missing $CARRY/kairos.gz"; exit 1; }
export KAIROS_CACHE_DIR=${KAIROS_CACHE_DIR:-/tmp/kairos-cubin}
. scripts/cubin-carry.sh
export PYTHONUNBUFFERED=1
steps=${WORKER_STEPS:-overhead,fault,inproc}
fault_at=${FAULT_AT_LAUNCH:-20000}
hang_at=${HANG_AT_LAUNCH:-20000}
has() { [[ ",$steps," == *",$1,"* ]]; }
step() { local name=$1 limit=$2; shift 2; local t=$(date +%s); echo "== $name"; timeout "$limit" "$@" > >(tee "$OUT/$name.log") 2>&1; echo "== $name: rc $? in $(( $(date +%s) - t )) s" | tee -a "$OUT/summary.txt"; }

nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv | tee "$OUT/device.txt"
REPO=/tmp/worker-repo
rm -rf "$REPO"; mkdir -p "$REPO/resnet50" "$REPO/resnet18"
printf 'model = "resnet50"\ndtype = "f16"\n' >"$REPO/resnet50/config.toml"
printf 'model = "resnet18"\ndtype = "f16"\n' >"$REPO/resnet18/config.toml"

PID=
serve() { # serve LOG ARGS...: starts kairos serve on 127.0.0.1:8000, waits until ready
    local log=$1; shift
    "$BIN/kairos" serve --backend cuda -r "$REPO" --http 127.0.0.1:8000 --grpc off --shm-socket off "$@" >"$OUT/$log" 2>&1 &
    PID=$!
    for _ in $(seq 1 1200); do
        curl -sf http://127.0.0.1:8000/v2/health/ready >/dev/null && return 0
        kill -0 $PID 2>/dev/null || { echo "the server exited: $(tail -5 "$OUT/$log")"; return 1; }
        sleep 0.1
    done
    echo "not ready after 120 s"; return 1
}
stop() { kill -TERM $PID 2>/dev/null; for _ in $(seq 1 100); do kill -0 $PID 2>/dev/null || break; sleep 0.1; done; kill -9 $PID 2>/dev/null; wait $PID 2>/dev/null; }

if has overhead; then
    for w in off on; do
        serve "serve-overhead-$w.log" --gpu-workers $w --load resnet50 || continue
        step "latency-$w-c1" 120 python3 scripts/worker_driver.py latency --model resnet50 --requests 2000 --concurrency 1 --label "workers $w" --out "$OUT/latency-$w-c1.json"
        step "latency-$w-c8" 120 python3 scripts/worker_driver.py latency --model resnet50 --requests 4000 --concurrency 8 --label "workers $w" --out "$OUT/latency-$w-c8.json"
        stop
    done
fi
if has fault; then
    if serve serve-fault.log --gpu-workers on --load resnet18 --test-fault-at-launch "$fault_at"; then
        step fault 90 python3 scripts/worker_driver.py fault --model resnet18 --concurrency 4 --duration-s 60 --label "workers on, fault at launch $fault_at" --out "$OUT/fault.json"
        curl -s http://127.0.0.1:8000/metrics | grep -E "^kairos_(gpu_recoveries|launches_lost)" | tee "$OUT/fault-metrics.txt"
        curl -s http://127.0.0.1:8000/v2/health/live -o /dev/null -w "live %{http_code}\n" | tee -a "$OUT/fault-metrics.txt"
        grep -v " INFO " "$OUT/serve-fault.log" | tail -12
        stop
    fi
fi
if has inproc; then
    if serve serve-inproc.log --gpu-workers off --load resnet18 --test-fault-at-launch "$fault_at"; then
        step inproc 60 python3 scripts/worker_driver.py fault --model resnet18 --concurrency 4 --duration-s 15 --label "workers off, fault at launch $fault_at" --out "$OUT/inproc.json"
        curl -s http://127.0.0.1:8000/v2/health/live -o /dev/null -w "live %{http_code}\n" | tee "$OUT/inproc-live.txt"
        kill -0 $PID 2>/dev/null && echo "server process alive" || { wait $PID; echo "server process gone: exit status $?"; }
        grep -v " INFO " "$OUT/serve-inproc.log" | tail -25
        stop
    fi
fi
if has hang; then
    if serve serve-hang.log --gpu-workers on --load resnet18 --test-hang-at-launch "$hang_at"; then
        step hang 90 python3 scripts/worker_driver.py fault --model resnet18 --concurrency 4 --duration-s 60 --label "workers on, hang before launch $hang_at" --out "$OUT/hang.json"
        curl -s http://127.0.0.1:8000/metrics | grep -E "^kairos_(gpu_recoveries|launches_lost)" | tee "$OUT/hang-metrics.txt"
        nvidia-smi --query-compute-apps=pid,used_memory --format=csv | tee -a "$OUT/hang-metrics.txt"
        grep -v " INFO " "$OUT/serve-hang.log" | tail -12
        stop
    fi
fi
if has soak; then
    step soak $(( ${SOAK_S:-540} + 60 )) "$BIN/kairos" bench soak --backend cuda --duration-s "${SOAK_S:-540}" \
        --models "${SOAK_MODELS:-mlp,pair,embed,resnet18,resnet50}" --rate "${SOAK_RATE:-100}" --out "$OUT/soak"
fi
tar -cJf "$OUT/results.tar.xz" -C "$OUT" --exclude results.tar.xz . ; find "$OUT" -mindepth 1 ! -name results.tar.xz ! -name summary.txt -delete
echo "== summary"
cat "$OUT/summary.txt"
python3 - "$OUT/results.tar.xz" <<'PY'
import json, sys, tarfile
t = tarfile.open(sys.argv[1])
for m in sorted(t.getnames()):
    if m.endswith(".json") and ("latency" in m or "fault" in m or "inproc" in m):
        s = json.load(t.extractfile(m))["summary"]
        extra = ""
        if s["mode"] == "fault":
            extra = f" failed {s.get('failed')} outage {s.get('outage_ms')} ms served_after {s.get('served_after_recovery')} wrong_after {s.get('wrong_after_recovery')}"
        if s["mode"] == "latency":
            extra = " server p50: engine {:.0f} gpu {:.0f} queue {:.0f} us".format(s.get("engine_p50_us", 0), s.get("gpu_p50_us", 0), s.get("queue_p50_us", 0))
        print(f"{m:28s} {s['label']:34s} c{s['concurrency']} n {s['requests']} served {s['served']} wrong {s['wrong']} lost {s['lost']} p50 {s['p50_us']:.0f} us p99 {s['p99_us']:.0f} us{extra}")
PY
