#!/usr/bin/env bash
# kairos' benchmark call on a GPU machine: PyTorch peers (kernels per forward pass, eager and
# CUDA-graph latency), ONNX fixtures from both PyTorch exporters, kairos on the GPU end to end, and
# Paella's experiments (head-of-line, short/long, vision mix) with every policy in the same run.
#
#   scripts/device-bench.sh build     here (no GPU): strip and gzip the kairos binary into .carry/
#   scripts/device-bench.sh run       on the device, with .carry carried
#
# Everything lands in $OUT (out/device-bench otherwise); a short table is printed last.
# BENCH_REQUESTS, BENCH_POLICIES, BENCH_LOADS and BENCH_STEPS (default
# "peers,fixtures,run,hol,short-long,mix,fairness"; "suite" adds scripts/gpu-suite.sh full) trim the run.
# BENCH_STEPS=presets runs the workload presets of `kairos bench run` (paella-mix and DISB A-E) with
# kairos' policies, then scripts/peer_replay.py replays the same traces with PyTorch (one stream,
# 4 streams, 4+4 priority streams), then `kairos bench report` merges both into one set of tables and
# plots under $OUT/presets (about 4 minutes on an H200; PRESETS_* below trim it).
# BENCH_STEPS=latency: isolated latency of every zoo model at batch 1 and 8, kairos (`kairos bench
# latency`, every kernel issued by the dispatcher) beside PyTorch eager and CUDA-graph replay
# (scripts/pytorch_peer.py) in the same call; its table is printed last (LATENCY_* below trim it).
# BENCH_STEPS=serve: `kairos bench serve` (serving overhead per transport, incl. the zero-copy
# shared-memory path; SERVE_MODELS, SERVE_REQUESTS).
# Logs, JSON and plots are packed into $OUT/results.tar (the device tool returns few files).
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-run}
[ "$mode" = build ] && exec scripts/carry-build.sh

OUT=${OUT:-out/device-bench}
mkdir -p "$OUT"
BIN=/tmp/kairos-bin
mkdir -p "$BIN"
gunzip -c .carry/kairos.gz >"$BIN/kairos" && chmod +x "$BIN/kairos" || { echo "missing .carry/kairos.gz: run scripts/device-bench.sh build first"; exit 1; }
export KAIROS_CACHE_DIR=${KAIROS_CACHE_DIR:-/tmp/kairos-cubin}
# The CUBIN cache compiled ahead of time here, when carried (scripts/cubin-carry.sh).
. scripts/cubin-carry.sh
export PYTHONUNBUFFERED=1
steps=${BENCH_STEPS:-peers,fixtures,run,hol,short-long,mix,fairness}
requests=${BENCH_REQUESTS:-400}
policies=${BENCH_POLICIES:-streams,streams-kernel,paella}
profiles=data/profiles/h200
has() { [[ ",$steps," == *",$1,"* ]]; }
step() { local name=$1 limit=$2; shift 2; local t=$(date +%s); echo "== $name"; timeout "$limit" "$@" > >(tee "$OUT/$name.log") 2>&1; echo "== $name: rc $? in $(( $(date +%s) - t )) s" | tee -a "$OUT/summary.txt"; }

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/device.txt"
has peers && step peers 240 python3 scripts/pytorch_peer.py --out "$OUT/pytorch_peer.json" --reps 20
has fixtures && step fixtures 150 python3 scripts/export_fixtures.py --out "$OUT"
if has run; then
    for m in resnet50 bert_base; do step "run-$m" 60 "$BIN/kairos" run "$m" --backend cuda --dtype f16 --check; done
fi
has hol && step hol 120 "$BIN/kairos" bench paella hol --backend cuda --requests "$requests" --policies streams,paella --out "$OUT/bench"
has short-long && step short-long 150 "$BIN/kairos" bench paella short-long --backend cuda --profiles "$profiles" --requests "$requests" --policies "$policies" --loads 0.5,1,2,3,4,6 --out "$OUT/bench-sl"
has mix && step mix 250 "$BIN/kairos" bench paella mix --backend cuda --profiles "$profiles" --requests "$requests" --policies "$policies" --loads "${BENCH_LOADS:-0.5,1,1.5,2,3,4}" --out "$OUT/bench-mix"
has fairness && step fairness 90 "$BIN/kairos" bench paella fairness --backend cuda --profiles "$profiles" --requests "$requests" --loads 3 --out "$OUT/bench-fair"
if has presets; then
    # Workload presets, kairos and the PyTorch peers on the very same arrival traces.
    pout="$OUT/presets"
    if [ -n "${PRESETS_REUSE:-}" ]; then
        # Peers only: reuse kairos' results and traces of an earlier call (carried folder).
        mkdir -p "$pout" && cp -r "$PRESETS_REUSE"/. "$pout"/ && echo "== presets-kairos: reused $PRESETS_REUSE" | tee -a "$OUT/summary.txt"
    else
    step presets-kairos "${PRESETS_KAIROS_S:-210}" "$BIN/kairos" bench run \
        "${PRESETS:-paella-mix:1:2:4,disb-a:0.25:1,disb-b,disb-c:0.25:1,disb-d:0.5:1,disb-e:0.5:1}" \
        --backend "${PRESETS_BACKEND:-cuda}" --profiles "$profiles" --sigma 1.5 --policies "${PRESETS_POLICIES:-fifo,streams,paella}" \
        --duration-ms "${PRESETS_DURATION_MS:-1500}" --traces --out "$pout"
    fi
    step presets-peers "${PRESETS_PEERS_S:-360}" python3 scripts/peer_replay.py --traces "$pout/traces" \
        --modes "${PRESETS_MODES:-single,streams:4,priority:4}" --budget-s "${PRESETS_PEERS_BUDGET_S:-330}" --out "$pout/peers.json"
    peers_arg=()
    [ -f "$pout/peers.json" ] && peers_arg=(--peers "$pout/peers.json")
    step presets-report 60 "$BIN/kairos" bench report --results "$pout/results.json" ${peers_arg[@]+"${peers_arg[@]}"}
fi
if has serve; then
    # Serving overhead (client latency minus GPU time) over REST, gRPC and the shared-memory
    # channel (zero-copy, polling, copied, socket) on a kairos server in the same process tree.
    step serve "${SERVE_S:-240}" "$BIN/kairos" bench serve --backend cuda --models "${SERVE_MODELS:-mlp,gap224,mlp_w1024_d8,resnet18}" \
        --requests "${SERVE_REQUESTS:-1000}" --warmup 100 --out "$OUT/bench-serve"
fi
if has suite; then
    # The GPU test suite and the protocol measurements (needs .carry/ from scripts/gpu-suite.sh build).
    step suite 230 env OUT="$OUT/suite" bash scripts/gpu-suite.sh full
fi
cd "$OUT" && tar cf results.tar --exclude=results.tar --exclude='*.tar' . 2>/dev/null; cd - >/dev/null

echo
echo "== summary"
cat "$OUT/summary.txt"
python3 - "$OUT" <<'PY'
import json, sys, os
out = sys.argv[1]
p = os.path.join(out, "pytorch_peer.json")
if os.path.exists(p):
    d = json.load(open(p))
    print(f"PyTorch {d['torch']} on {d['device']} ({d['dtype']}, batch 1): model kernels/fwd eager_ms graph_ms")
    for r in d["rows"]:
        print(" ", r["model"], r.get("kernels_per_forward"), round(r.get("eager_ms", -1), 3), round(r.get("graph_ms", -1), 3), r.get("error", ""))
PY
for f in hol short-long mix fairness; do [ -f "$OUT/$f.log" ] && grep -E "load at p99|resnet18 p99|^\| paella" "$OUT/$f.log" | head -16; done
[ -f "$OUT/suite.log" ] && sed -n '/^== tests/,$p' "$OUT/suite.log" | tail -40
if [ -f "$OUT/presets/results.json" ]; then
    # Last: one line per point of the presets, kairos and the peers side by side.
    python3 - "$OUT/presets/results.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"\n== presets on {r['device']} (peers: {'; '.join(r['peers']) or 'none'})")
print(f"{'preset':<11} {'system':<8} {'policy':<10} {'load':>5} {'served/s':>9} {'p99 ms':>9} {'headline p99 ms':>16}")
for p in r["presets"]:
    h = p["headline"]
    for pt in sorted(p["points"], key=lambda x: (x["system"] != "kairos", x["policy"], x["load"])):
        m = pt["metrics"]
        hs = m["overall"]
        if h.get("kind") == "group":
            hs = next((g for g in m["groups"] if g["name"] == h["name"]), hs)
        elif h.get("kind") == "model":
            hs = next((g for g in m["models"] if g["name"].split("/")[0] == h["name"]), hs)
        pol = pt["policy"].removeprefix(pt["system"] + "-")
        sat = " sat" if pt["saturated"] else ""
        print(f"{p['preset']:<11} {pt['system']:<8} {pol:<10} {pt['load']:>5} {m['overall']['throughput_per_s']:>9.1f} "
              f"{m['overall']['latency']['p99_ns'] / 1e6:>9.2f} {hs['latency']['p99_ns'] / 1e6:>16.2f}{sat}")
PY
fi

# ---- latency step (kairos bench latency; owner: the latency benchmark) ----------------------------
# PyTorch eager / CUDA graph at each batch size, then kairos on the same models with the peer's
# JSON side by side; writes $OUT/latency/{pytorch_peer.json,latency.json,latency.md}, appends them
# to results.tar and prints the tables last. LATENCY_MODELS (default: the zoo), LATENCY_BATCH
# (1,8), LATENCY_REQUESTS (50), LATENCY_BUDGET_S (per model and batch, 4), LATENCY_PEER_REPS (20),
# LATENCY_POLICY (fifo), LATENCY_PEER_S / LATENCY_KAIROS_S (step limits), LATENCY_PEER=FILE (reuse
# a peer JSON instead of measuring it), LATENCY_AB_OVERLAP=1 (also run kairos with overlapped
# launches, KAIROS_OVERLAP_LAUNCHES=1, into $OUT/latency-overlap), LATENCY_AB_SPLIT_K=1 (also run
# kairos with plans lowered with split-K, KAIROS_SPLIT_K=1, into $OUT/latency-splitk),
# LATENCY_AB_BASE=1 (also run an earlier build, .carry/kairos-base.gz, into $OUT/latency-base),
# LATENCY_AB_REPEATS=N (then N interleaved batch-1 repeats of both builds, LATENCY_REPEAT_MODELS).
if has latency; then
    lout="$OUT/latency"
    mkdir -p "$lout"
    lmodels=()
    [ -n "${LATENCY_MODELS:-}" ] && lmodels=(--models "$LATENCY_MODELS")
    if [ -n "${LATENCY_PEER:-}" ]; then
        cp "$LATENCY_PEER" "$lout/pytorch_peer.json" && echo "== latency-peers: reused $LATENCY_PEER" | tee -a "$OUT/summary.txt"
    else
        step latency-peers "${LATENCY_PEER_S:-270}" python3 scripts/pytorch_peer.py --batch "${LATENCY_BATCH:-1,8}" \
            --reps "${LATENCY_PEER_REPS:-20}" --out "$lout/pytorch_peer.json" ${lmodels[@]+"${lmodels[@]}"}
    fi
    lpeer=()
    [ -f "$lout/pytorch_peer.json" ] && lpeer=(--peer "$lout/pytorch_peer.json")
    # The tables go to latency.md and are printed once, below; the log keeps the progress lines.
    step latency-kairos "${LATENCY_KAIROS_S:-300}" bash -c 'exec "$@" >/dev/null' _ "$BIN/kairos" bench latency --backend cuda --batch "${LATENCY_BATCH:-1,8}" \
        --requests "${LATENCY_REQUESTS:-50}" --budget-s "${LATENCY_BUDGET_S:-4}" --policy "${LATENCY_POLICY:-fifo}" \
        --out "$lout" ${lmodels[@]+"${lmodels[@]}"} ${lpeer[@]+"${lpeer[@]}"}
    # A/B variants: the same run with one setting changed, into $OUT/latency-<variant>.
    latency_variant() {
        local variant=$1
        shift
        mkdir -p "$OUT/latency-$variant"
        step "latency-kairos-$variant" "${LATENCY_KAIROS_S:-300}" env "$@" bash -c 'exec "$@" >/dev/null' _ "${LBIN:-$BIN/kairos}" bench latency --backend cuda --batch "${LATENCY_BATCH:-1,8}" \
            --requests "${LATENCY_REQUESTS:-50}" --budget-s "${LATENCY_BUDGET_S:-4}" --policy "${LATENCY_POLICY:-fifo}" \
            --out "$OUT/latency-$variant" ${lmodels[@]+"${lmodels[@]}"} ${lpeer[@]+"${lpeer[@]}"}
        (cd "$OUT" && tar rf results.tar "latency-$variant" 2>/dev/null)
    }
    # Overlapped launches (programmatic dependent launch), opt-in.
    [ "${LATENCY_AB_OVERLAP:-0}" = 1 ] && latency_variant overlap KAIROS_OVERLAP_LAUNCHES=1
    # Plans with split-K (opt-in).
    [ "${LATENCY_AB_SPLIT_K:-0}" = 1 ] && latency_variant splitk KAIROS_SPLIT_K=1
    # The same run with an earlier build (.carry/kairos-base.gz: e.g. the commit before a kernel
    # change, its CUBIN images in the carried cache too), into $OUT/latency-base.
    if [ "${LATENCY_AB_BASE:-0}" = 1 ]; then
        if gunzip -c .carry/kairos-base.gz >"$BIN/kairos-base" 2>/dev/null && chmod +x "$BIN/kairos-base"; then
            LBIN="$BIN/kairos-base" latency_variant base
        else
            echo "LATENCY_AB_BASE=1 but no .carry/kairos-base.gz" | tee -a "$OUT/summary.txt"
        fi
    fi
    # Interleaved repeats of a few models at batch 1, base build and this one, with the same tiles
    # (the base's autotune table copied over this build's), for effects smaller than the
    # run-to-run spread: LATENCY_AB_REPEATS=N (with LATENCY_AB_BASE=1), LATENCY_REPEAT_MODELS.
    if [ "${LATENCY_AB_REPEATS:-0}" -gt 0 ] && [ -x "$BIN/kairos-base" ]; then
        tables=$(ls -t "$KAIROS_CACHE_DIR"/autotune-*.json 2>/dev/null)
        tbase=$(echo "$tables" | head -1)
        tnew=$(echo "$tables" | sed -n 2p)
        [ -n "$tnew" ] && cp "$tbase" "$tnew" && echo "repeats: tiles of $(basename "$tbase") for both builds"
        for i in $(seq "$LATENCY_AB_REPEATS"); do
            for b in base new; do
                bin="$BIN/kairos"
                [ "$b" = base ] && bin="$BIN/kairos-base"
                step "latency-repeat-$b-$i" 120 bash -c 'exec "$@" >/dev/null' _ "$bin" bench latency --backend cuda --batch 1 \
                    --requests "${LATENCY_REQUESTS:-50}" --budget-s "${LATENCY_BUDGET_S:-4}" --policy "${LATENCY_POLICY:-fifo}" \
                    --models "${LATENCY_REPEAT_MODELS:-bert_base,distilbert,gpt2,resnet50,densenet121}" \
                    --out "$OUT/latency-repeat-$b-$i"
            done
        done
        (cd "$OUT" && tar rf results.tar latency-repeat-* 2>/dev/null)
        python3 - "$OUT" "$LATENCY_AB_REPEATS" <<'PY'
import json, os, sys
out, n = sys.argv[1], int(sys.argv[2])
rows = {}
for i in range(1, n + 1):
    for b in ("base", "new"):
        p = os.path.join(out, f"latency-repeat-{b}-{i}", "latency.json")
        if not os.path.exists(p):
            continue
        for r in json.load(open(p))["tables"][0]["rows"]:
            rows.setdefault(r["model"], {}).setdefault(b, []).append(r.get("p50_ms"))
print("== latency repeats, batch 1, p50 ms (base build | this build, interleaved, same tiles)")
for m, v in rows.items():
    f = lambda l: " ".join(f"{x:.3f}" if x else "-" for x in l)
    print(f"  {m:14s} {f(v.get('base', []))} | {f(v.get('new', []))}")
PY
    fi
    (cd "$OUT" && tar rf results.tar latency 2>/dev/null)
    echo
    for variant in overlap splitk base; do
        if [ -f "$OUT/latency-$variant/latency.md" ]; then
            echo "== latency, variant $variant ($OUT/latency-$variant/latency.md)"
            cat "$OUT/latency-$variant/latency.md"
        fi
    done
    echo "== latency (kairos bench latency; $lout/latency.md)"
    cat "$lout/latency.md" 2>/dev/null || echo "no latency table: see $OUT/latency-kairos.log"
fi
# ---- end of the latency step --------------------------------------------------------------------
