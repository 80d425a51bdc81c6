#!/usr/bin/env python3
"""Time from process start to the first correct response of `kairos serve` (issue: first run on a
fresh GPU machine).

Starts `BIN serve -r REPO` (REST only) with the given cache folder, polls liveness, server
readiness and each model's readiness, and sends each model one inference request as soon as it is
ready (the KServe v2 JSON protocol, deterministic inputs from the model's metadata). Records, per
model, the seconds from the process start to the model's first successful response; afterwards
checks every response against the CPU reference kernels (`BIN run MODEL --backend cpu`, same input)
with a relative L2 tolerance. Also records when the server first answered /v2/health/live, how
long /v2/health/ready said 503 (and its reasons), and the server's stderr. Writes one JSON record.

    python3 scripts/first_run.py --bin BIN --models resnet50 --dtype f16 --cache-dir DIR \
        --label "serve 1 model, empty cache" --out result.json
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import numpy as np

NP_OF = {"FP32": np.float32, "FP16": np.float16, "INT64": np.int64, "INT32": np.int32}
# Relative L2 error between the GPU's and the CPU reference's outputs that still counts as correct
# (fp16 end to end through a whole network; the GPU suite's per-kernel tolerances are tighter).
REL_L2_MAX = {"f16": 5e-2, "f32": 1e-3}


def http(method, url, body=None, timeout=30.0):
    req = urllib.request.Request(url, data=body, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, ConnectionError, OSError):
        return None, b""


def make_input(meta_input, seed):
    rng = np.random.default_rng(seed)
    shape = [int(d) for d in meta_input["shape"]]
    dt = meta_input["datatype"]
    name = meta_input["name"].lower()
    if dt in ("INT64", "INT32"):
        a = np.ones(shape) if "mask" in name else (np.zeros(shape) if "type" in name else rng.integers(1, 1000, shape))
        return a.astype(NP_OF[dt])
    return rng.standard_normal(shape).astype(NP_OF[dt])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--models", required=True, help="comma-separated zoo names")
    ap.add_argument("--dtype", default="f16")
    ap.add_argument("--cache-dir", required=True)
    ap.add_argument("--label", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--port", type=int, default=18000)
    ap.add_argument("--timeout-s", type=float, default=420.0)
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument(
        "--settle-s",
        type=float,
        default=0.0,
        help="after the first responses, wait up to this long for the background compilations to end (the quick "
        "kernel builds replaced by optimized ones), then ask every model once more and check those answers too",
    )
    a = ap.parse_args()
    models = [m for m in a.models.split(",") if m]
    work = tempfile.mkdtemp(prefix="first-run-")
    repo = os.path.join(work, "models")
    for m in models:
        os.makedirs(os.path.join(repo, m))
        with open(os.path.join(repo, m, "config.toml"), "w") as f:
            f.write(f'model = "{m}"\ndtype = "{a.dtype}"\n')
    os.makedirs(a.cache_dir, exist_ok=True)
    env = dict(os.environ, KAIROS_CACHE_DIR=a.cache_dir, KAIROS_PROGRESS="lines")
    base = f"http://127.0.0.1:{a.port}"
    log_path = os.path.join(work, "serve.log")
    log = open(log_path, "w")
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [a.bin, "serve", "-r", repo, "--http", f"127.0.0.1:{a.port}", "--grpc", "off", "--shm-socket", "off"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    rec = {"label": a.label, "models": models, "dtype": a.dtype, "cache_dir_files_at_start": len(os.listdir(a.cache_dir))}
    live_s = None
    not_ready_reasons = []
    first = {}
    inputs = {}
    responses = {}
    errors = {}
    server_ready_s = None
    try:
        while time.monotonic() - t0 < a.timeout_s and len(first) < len(models):
            if proc.poll() is not None:
                errors["server"] = f"exited with {proc.returncode}"
                break
            if live_s is None:
                st, _ = http("GET", f"{base}/v2/health/live", timeout=2)
                if st == 200:
                    live_s = time.monotonic() - t0
                else:
                    time.sleep(0.02)
                    continue
            if server_ready_s is None:
                st, body = http("GET", f"{base}/v2/health/ready", timeout=2)
                if st == 200:
                    server_ready_s = time.monotonic() - t0
                elif body:
                    reason = body.decode(errors="replace")[:300]
                    if not not_ready_reasons or not_ready_reasons[-1][1] != reason:
                        not_ready_reasons.append((round(time.monotonic() - t0, 2), reason))
            for m in models:
                if m in first:
                    continue
                st, _ = http("GET", f"{base}/v2/models/{m}/ready", timeout=2)
                if st != 200:
                    continue
                if m not in inputs:
                    st, body = http("GET", f"{base}/v2/models/{m}", timeout=5)
                    if st != 200:
                        continue
                    meta = json.loads(body)
                    inputs[m] = [(i["name"], i["datatype"], make_input(i, 7 + k)) for k, i in enumerate(meta["inputs"])]
                req = {
                    "inputs": [
                        {"name": n, "shape": list(x.shape), "datatype": dt, "data": x.astype(np.float64 if dt.startswith("FP") else np.int64).ravel().tolist()}
                        for n, dt, x in inputs[m]
                    ]
                }
                st, body = http("POST", f"{base}/v2/models/{m}/infer", json.dumps(req).encode(), timeout=60)
                if st == 200:
                    first[m] = time.monotonic() - t0
                    responses[m] = json.loads(body)
                else:
                    errors[m] = f"HTTP {st}: {body[:200]!r}"
            time.sleep(0.05)
        if a.settle_s > 0 and len(first) == len(models):
            settle(a, t0, base, log_path, inputs, rec)
        if server_ready_s is None and len(first) == len(models):
            for _ in range(200):
                st, _ = http("GET", f"{base}/v2/health/ready", timeout=2)
                if st == 200:
                    server_ready_s = time.monotonic() - t0
                    break
                time.sleep(0.05)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    rec.update(
        live_s=live_s,
        server_ready_s=server_ready_s,
        first_response_s=first,
        first_response_max_s=max(first.values()) if len(first) == len(models) else None,
        not_ready_reasons=not_ready_reasons[:40],
        errors={k: v for k, v in errors.items() if k not in first},
        cache_dir_files_at_end=len(os.listdir(a.cache_dir)),
    )
    # Correctness: each first response against the CPU reference on the same inputs.
    checks = {}
    if not a.no_check:
        for m in first:
            checks[m] = check_answer(a, env, work, m, inputs[m], responses[m])[1]
            for later in rec.get("later_responses", {}).get(m, []):
                checks[f"{m} (after the swap)"] = check_answer(a, env, work, m, inputs[m], later)[1]
    rec["checks"] = checks
    rec["all_correct"] = bool(checks) and all(c["ok"] for c in checks.values()) and len(first) == len(models)
    with open(log_path) as f:
        lines = f.read().splitlines()
    rec["serve_log_tail"] = lines[-60:]
    rec["serve_log_compile_lines"] = [l for l in lines if "kernel unit" in l or "autotun" in l][:120]
    rec.pop("later_responses", None)
    with open(a.out, "w") as f:
        json.dump(rec, f, indent=1)
    fr = rec["first_response_max_s"]
    print(
        f"{a.label}: live {live_s if live_s is None else round(live_s, 2)} s, first response "
        f"{'none' if fr is None else round(fr, 2)} s (slowest of {len(models)}), server ready "
        f"{server_ready_s if server_ready_s is None else round(server_ready_s, 2)} s, correct {rec['all_correct']}"
        + (f", optimized builds swapped in {len(rec['swaps'])}x, last at {rec['swaps'][-1][0]} s" if rec.get("swaps") else ""),
        flush=True,
    )
    if rec["errors"]:
        print("  errors:", rec["errors"], flush=True)


def settle(a, t0, base, log_path, inputs, rec):
    """Waits until no compilation is running (as many 'compiling' lines as 'ready in' lines in the log)
    for 5 s, or --settle-s; records when each quick build was replaced, then asks every model again."""
    swaps, seen, quiet_since = [], 0, time.monotonic()
    deadline = time.monotonic() + a.settle_s
    while time.monotonic() < deadline:
        with open(log_path) as f:
            lines = f.read().splitlines()
        sw = [l for l in lines if "now runs its optimized build" in l]
        for l in sw[seen:]:
            swaps.append((round(time.monotonic() - t0, 2), l))
        started = sum(1 for l in lines if l.startswith("kairos: compiling "))
        ended = sum(1 for l in lines if " ready in " in l and l.startswith("kairos: ") and "kernel unit(s) for" in l)
        if len(sw) != seen or started != ended:
            quiet_since = time.monotonic()
        seen = len(sw)
        if time.monotonic() - quiet_since > 5.0:
            break
        time.sleep(0.25)
    rec["swaps"] = swaps
    rec["settled_s"] = round(time.monotonic() - t0, 2)
    later = {}
    for m, ins in inputs.items():
        req = {
            "inputs": [
                {"name": n, "shape": list(x.shape), "datatype": dt, "data": x.astype(np.float64 if dt.startswith("FP") else np.int64).ravel().tolist()}
                for n, dt, x in ins
            ]
        }
        st, body = http("POST", f"{base}/v2/models/{m}/infer", json.dumps(req).encode(), timeout=60)
        if st == 200:
            later.setdefault(m, []).append(json.loads(body))
    rec["later_responses"] = later


def check_answer(a, env, work, m, ins, response):
    """A response against the CPU reference kernels on the same inputs: (ok, record)."""
    ref = os.path.join(work, f"{m}_ref.npy")
    if not os.path.exists(ref):
        paths = []
        for k, (n, dt, x) in enumerate(ins):
            p = os.path.join(work, f"{m}_in{k}.npy")
            np.save(p, x)
            paths += ["-i", p]
        r = subprocess.run([a.bin, "run", m, "--dtype", a.dtype, "--backend", "cpu", *paths, "-o", ref], capture_output=True, text=True, env=env)
        if r.returncode != 0:
            return False, {"ok": False, "error": r.stderr[-400:]}
    got = np.asarray(response["outputs"][0]["data"], dtype=np.float64)
    want = np.load(ref).astype(np.float64).ravel()
    err = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)) if got.size == want.size else float("inf")
    ok = bool(err <= REL_L2_MAX[a.dtype])
    return ok, {"ok": ok, "rel_l2": err}


if __name__ == "__main__":
    sys.exit(main())
