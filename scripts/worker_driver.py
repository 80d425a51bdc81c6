#!/usr/bin/env python3
"""Drives `kairos serve` over REST (binary tensor data) for the GPU-worker measurements.

  latency  N requests from C threads, closed loop: per-request latency (the worker's cost when run
           with --gpu-workers on and off against the same GPU).
  fault    C threads send requests for D seconds while the server's first worker faults; a
           thread polls /v2/health/ready every 5 ms. Every request's outcome is kept: served (its
           outputs compared with the answer before the fault), an error status (with the body),
           or lost (no answer within the timeout). Reports the outage: first failure, first
           success after it, readiness false -> true.

Every request's record goes to --out (JSON), with the summary.
"""
import argparse, http.client, json, struct, sys, threading, time
import numpy as np

DT = {"FP32": np.float32, "FP16": np.float16, "INT64": np.int64}


def metadata(host, port, model):
    c = http.client.HTTPConnection(host, port, timeout=30)
    c.request("GET", f"/v2/models/{model}")
    r = c.getresponse()
    body = r.read()
    if r.status != 200:
        raise SystemExit(f"metadata of {model}: {r.status} {body[:200]!r}")
    return json.loads(body)


def make_request(meta, seed):
    rng = np.random.default_rng(seed)
    inputs, blobs = [], []
    for i in meta["inputs"]:
        shape = [int(d) for d in i["shape"]]
        dt = DT[i["datatype"]]
        a = (rng.standard_normal(shape).astype(dt) if dt != np.int64 else rng.integers(0, 100, shape).astype(dt))
        b = a.tobytes()
        inputs.append({"name": i["name"], "shape": shape, "datatype": i["datatype"], "parameters": {"binary_data_size": len(b)}})
        blobs.append(b)
    outputs = [{"name": o["name"], "parameters": {"binary_data": True}} for o in meta["outputs"]]
    head = json.dumps({"inputs": inputs, "outputs": outputs}).encode()
    return head + b"".join(blobs), len(head)


def infer(conn, model, body, head_len):
    conn.request("POST", f"/v2/models/{model}/infer", body=body,
                 headers={"Inference-Header-Content-Length": str(head_len), "Content-Type": "application/octet-stream"})
    r = conn.getresponse()
    data = r.read()
    if r.status != 200:
        return r.status, data[:400].decode(errors="replace"), None, {}
    hl = int(r.getheader("Inference-Header-Content-Length") or len(data))
    head = json.loads(data[:hl])
    outs, off = [], hl
    for o in head["outputs"]:
        n = o["parameters"]["binary_data_size"]
        outs.append(np.frombuffer(data[off:off + n], dtype=DT[o["datatype"]]).astype(np.float32))
        off += n
    return 200, "", outs, head.get("parameters", {})


def rel_err(a, b):
    return max(float(np.max(np.abs(x - y))) / max(float(np.max(np.abs(y))), 1e-6) for x, y in zip(a, b))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["latency", "fault"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", required=True)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--duration-s", type=float, default=20)
    p.add_argument("--after-recovery-s", type=float, default=5)
    p.add_argument("--timeout-s", type=float, default=30)
    p.add_argument("--tolerance", type=float, default=2e-3)
    p.add_argument("--label", default="")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    meta = metadata(a.host, a.port, a.model)
    body, head_len = make_request(meta, 7)
    warm = http.client.HTTPConnection(a.host, a.port, timeout=a.timeout_s)
    st, msg, reference, _ = infer(warm, a.model, body, head_len)
    if st != 200:
        raise SystemExit(f"the first request failed: {st} {msg}")
    for _ in range(50):
        infer(warm, a.model, body, head_len)
    records, lock = [], threading.Lock()
    t0 = time.perf_counter()
    stop = threading.Event()
    ready_log = []

    def worker(n):
        conn = http.client.HTTPConnection(a.host, a.port, timeout=a.timeout_s)
        i = 0
        while (a.mode == "latency" and i < n) or (a.mode == "fault" and not stop.is_set()):
            i += 1
            s = time.perf_counter()
            try:
                st, msg, outs, p = infer(conn, a.model, body, head_len)
            except Exception as e:  # no answer: lost (timeout) or a broken connection
                st, msg, outs, p = (-1 if isinstance(e, TimeoutError) else -2), repr(e), None, {}
                conn = http.client.HTTPConnection(a.host, a.port, timeout=a.timeout_s)
            e = time.perf_counter()
            rec = {"t_ms": (s - t0) * 1e3, "latency_us": (e - s) * 1e6, "status": st}
            if st == 200:
                # The server's own account: engine_ns (submission to answer, in the server),
                # gpu_ns (first kernel to last, device), queue_ns (arrival to first kernel).
                for k in ("kairos_engine_ns", "kairos_gpu_ns", "kairos_queue_ns"):
                    if k in p:
                        rec[k[7:]] = p[k]
            if outs is not None:
                rec["rel_err"] = rel_err(outs, reference)
            else:
                rec["error"] = msg
            with lock:
                records.append(rec)

    def poll_ready():
        conn = http.client.HTTPConnection(a.host, a.port, timeout=5)
        last = None
        while not stop.is_set():
            try:
                conn.request("GET", "/v2/health/ready")
                r = conn.getresponse()
                body = r.read()
                ok = r.status == 200
            except Exception as e:
                ok, body = False, repr(e).encode()
                conn = http.client.HTTPConnection(a.host, a.port, timeout=5)
            if ok != last:
                ready_log.append({"t_ms": (time.perf_counter() - t0) * 1e3, "ready": ok, "body": body[:300].decode(errors="replace")})
                last = ok
            time.sleep(0.005)

    threads = [threading.Thread(target=worker, args=(a.requests // a.concurrency,)) for _ in range(a.concurrency)]
    poller = threading.Thread(target=poll_ready) if a.mode == "fault" else None
    if poller:
        poller.start()
    for t in threads:
        t.start()
    if a.mode == "fault":
        # Until the outage is over (a success after a failure) plus a while, or the duration.
        while time.perf_counter() - t0 < a.duration_s:
            time.sleep(0.05)
            with lock:
                fails = [r for r in records if r["status"] != 200]
                if fails:
                    last_fail = max(r["t_ms"] + r["latency_us"] / 1e3 for r in fails)
                    after = [r for r in records if r["status"] == 200 and r["t_ms"] > last_fail]
                    if after and (time.perf_counter() - t0) * 1e3 > last_fail + a.after_recovery_s * 1e3:
                        break
        stop.set()
    for t in threads:
        t.join()
    stop.set()
    if poller:
        poller.join()
    ok = [r for r in records if r["status"] == 200]
    wrong = [r for r in ok if r["rel_err"] > a.tolerance]
    lat = np.array([r["latency_us"] for r in ok]) if ok else np.array([0.0])
    by_status = {}
    for r in records:
        by_status[str(r["status"])] = by_status.get(str(r["status"]), 0) + 1
    summary = {
        "label": a.label, "mode": a.mode, "model": a.model, "concurrency": a.concurrency, "requests": len(records),
        "served": len(ok), "wrong": len(wrong), "lost": by_status.get("-1", 0), "by_status": by_status,
        "p50_us": float(np.percentile(lat, 50)), "p99_us": float(np.percentile(lat, 99)), "mean_us": float(lat.mean()),
        "wall_s": time.perf_counter() - t0,
    }
    for k in ("engine_ns", "gpu_ns", "queue_ns"):
        v = [r[k] for r in ok if k in r]
        if v:
            summary[k.replace("_ns", "_p50_us")] = float(np.percentile(v, 50)) / 1e3
    if a.mode == "fault":
        fails = sorted((r for r in records if r["status"] != 200), key=lambda r: r["t_ms"])
        if fails:
            first_fail_done = min(r["t_ms"] + r["latency_us"] / 1e3 for r in fails)
            last_fail_sent = max(r["t_ms"] for r in fails)
            after = [r for r in ok if r["t_ms"] > last_fail_sent]
            first_ok_after = min((r["t_ms"] + r["latency_us"] / 1e3 for r in after), default=None)
            summary.update({
                "failed": len(fails), "first_failure_ms": first_fail_done, "last_failure_sent_ms": last_fail_sent,
                "first_success_after_ms": first_ok_after,
                "outage_ms": (first_ok_after - first_fail_done) if first_ok_after else None,
                "served_after_recovery": len(after),
                "wrong_after_recovery": len([r for r in after if r["rel_err"] > a.tolerance]),
                "errors_seen": sorted({r.get("error", "")[:160] for r in fails})[:5],
            })
        else:
            summary["failed"] = 0
            summary["note"] = "no request failed: the fault did not happen within the window"
        summary["ready_log"] = ready_log
    with open(a.out, "w") as f:
        json.dump({"summary": summary, "records": records}, f)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
