"""Drives a running kairos server with NVIDIA's official `tritonclient` (HTTP and gRPC).

Run by tests/tritonclient.rs, which starts the server on the simulated GPU and writes the inputs
and the CPU reference's outputs as .npy files into DIR:
    python3 tritonclient_check.py HTTP_HOST:PORT GRPC_HOST:PORT DIR
Every check is an assert; the script prints one line per protocol and exits non-zero on failure.
"""

import json
import os
import sys
import urllib.request

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

HTTP_URL, GRPC_URL, DIR = sys.argv[1], sys.argv[2], sys.argv[3]
MODELS = ["mlp", "mlp_f16", "pair", "embed"]
checks = 0


def check(cond, what):
    global checks
    assert cond, what
    checks += 1


def load(name):
    return np.load(os.path.join(DIR, name))


def case(model):
    """The inputs (name -> array) and expected outputs (name -> array) the Rust side wrote."""
    with open(os.path.join(DIR, f"{model}.json")) as f:
        names = json.load(f)
    ins = {n: load(f"{model}.in.{i}.npy") for i, n in enumerate(names["inputs"])}
    outs = {n: load(f"{model}.out.{i}.npy") for i, n in enumerate(names["outputs"])}
    return ins, outs


def expect_error(fn, statuses, what):
    try:
        fn()
    except InferenceServerException as e:
        check(e.status() in statuses, f"{what}: status {e.status()} not in {statuses}: {e.message()}")
        return e
    raise AssertionError(f"{what}: no error")


def run(mod, client, kind):
    datatype = {np.dtype("float32"): "FP32", np.dtype("float16"): "FP16", np.dtype("int64"): "INT64"}
    check(client.is_server_live(), "live")
    check(client.is_server_ready(), "ready")
    meta = client.get_server_metadata()
    name = meta["name"] if kind == "http" else meta.name
    check(name == "kairos", f"server name {name}")
    for model in MODELS:
        ins, outs = case(model)
        check(client.is_model_ready(model), f"{model} ready")
        md = client.get_model_metadata(model)
        md_inputs = md["inputs"] if kind == "http" else [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in md.inputs]
        check([t["name"] for t in md_inputs] == list(ins), f"{model} input names {md_inputs}")
        for t in md_inputs:
            check(t["datatype"] == datatype[ins[t["name"]].dtype], f"{model} datatype {t}")
            check([int(d) for d in t["shape"]] == list(ins[t["name"]].shape), f"{model} shape {t}")
        cfg = client.get_model_config(model)
        if kind == "grpc":
            cfg = json.loads(__import__("google.protobuf.json_format", fromlist=["x"]).MessageToJson(cfg.config))
        check(cfg["name"] == model, f"config name {cfg}")
        for binary in ([True, False] if kind == "http" else [True]):
            inputs = []
            for n, a in ins.items():
                i = mod.InferInput(n, list(a.shape), datatype[a.dtype])
                if kind == "http":
                    i.set_data_from_numpy(a, binary_data=binary)
                else:
                    i.set_data_from_numpy(a)
                inputs.append(i)
            if kind == "http":
                requested = [mod.InferRequestedOutput(n, binary_data=binary) for n in outs]
            else:
                requested = [mod.InferRequestedOutput(n) for n in outs]
            for req in (requested, None):
                r = client.infer(model, inputs, outputs=req)
                for n, want in outs.items():
                    got = r.as_numpy(n)
                    check(got is not None, f"{model} output {n} missing")
                    check(got.dtype == want.dtype and got.shape == want.shape, f"{model} {n}: {got.dtype}{got.shape} vs {want.dtype}{want.shape}")
                    check(np.array_equal(got, want), f"{model} {n} binary={binary}: max diff {np.max(np.abs(got.astype(np.float64) - want))}")
        # Only one output, by name.
        if model == "pair":
            r = client.infer(model, inputs, outputs=[mod.InferRequestedOutput("relu")])
            check(r.as_numpy("y") is None and np.array_equal(r.as_numpy("relu"), outs["relu"]), "output selection")
    # priority and timeout: a 1 us timeout is a deadline no request meets; the server cancels a
    # request past its timeout (504 / DEADLINE_EXCEEDED) unless it was served first, late.
    ins, outs = case("mlp")
    x = mod.InferInput("x", [1, 64], "FP32")
    x.set_data_from_numpy(ins["x"])

    def missed_flag(r):
        resp = r.get_response()
        if kind == "http":
            return resp["parameters"]["kairos_deadline_missed"]
        return resp.parameters["kairos_deadline_missed"].bool_param

    try:
        r = client.infer("mlp", [x], priority=1, timeout=1)
        check(missed_flag(r) is True, f"deadline missed flag: {missed_flag(r)}")
        check(np.array_equal(r.as_numpy("y"), outs["y"]), "priority request result")
    except InferenceServerException as e:
        check(e.status() in {"504", "StatusCode.DEADLINE_EXCEEDED"}, f"1 us timeout: status {e.status()}: {e.message()}")
    # A timeout of 10 s: served, in time.
    r = client.infer("mlp", [x], priority=1, timeout=10_000_000)
    check(missed_flag(r) is False, f"deadline missed flag with a 10 s timeout: {missed_flag(r)}")
    check(np.array_equal(r.as_numpy("y"), outs["y"]), "priority request result")
    # Errors: unknown model, unknown version, wrong datatype, wrong shape.
    nf = {"404", "StatusCode.NOT_FOUND"}
    bad = {"400", "StatusCode.INVALID_ARGUMENT"}
    expect_error(lambda: client.infer("nope", [x]), nf, "unknown model")
    expect_error(lambda: client.infer("mlp", [x], model_version="9"), nf, "unknown version")
    wrong = mod.InferInput("x", [1, 64], "INT64")
    wrong.set_data_from_numpy(np.arange(64, dtype=np.int64).reshape(1, 64))
    e = expect_error(lambda: client.infer("mlp", [wrong]), bad, "wrong datatype")
    check("FP32" in e.message(), e.message())
    short = mod.InferInput("x", [1, 32], "FP32")
    short.set_data_from_numpy(np.zeros((1, 32), dtype=np.float32))
    expect_error(lambda: client.infer("mlp", [short]), bad, "wrong shape")
    check(not client.is_model_ready("nope"), "unknown model not ready")
    # Repository: index, unload, load.
    index = client.get_model_repository_index()
    rows = index if kind == "http" else [{"name": m.name, "state": m.state} for m in index.models]
    check(sorted(r["name"] for r in rows if r["state"] == "READY") == sorted(MODELS), f"index {rows}")
    client.unload_model("mlp_f16")
    check(not client.is_model_ready("mlp_f16"), "unloaded")
    expect_error(lambda: client.infer("mlp_f16", [x]), nf, "infer on an unloaded model")
    client.load_model("mlp_f16")
    check(client.is_model_ready("mlp_f16"), "loaded again")
    r = client.infer("mlp_f16", [x])
    check(np.array_equal(r.as_numpy("y"), case("mlp_f16")[1]["y"]), "reloaded result")
    # Statistics.
    stats = client.get_inference_statistics("mlp")
    if kind == "http":
        count = stats["model_stats"][0]["inference_count"]
    else:
        count = stats.model_stats[0].inference_count
    check(int(count) >= 4, f"statistics count {count}")


run(httpclient, httpclient.InferenceServerClient(url=HTTP_URL), "http")
print(f"tritonclient.http: {checks} checks passed")
n = checks
run(grpcclient, grpcclient.InferenceServerClient(url=GRPC_URL), "grpc")
print(f"tritonclient.grpc: {checks - n} checks passed")

# Malformed protobuf straight through grpcio: INVALID_ARGUMENT, and the server goes on.
import grpc  # noqa: E402

channel = grpc.insecure_channel(GRPC_URL)
call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
try:
    call(b"\x0a\xff\xff\xff\xff\x0f")
    raise AssertionError("malformed protobuf accepted")
except grpc.RpcError as e:
    check(e.code() == grpc.StatusCode.INVALID_ARGUMENT, f"malformed protobuf: {e.code()}")
check(grpcclient.InferenceServerClient(url=GRPC_URL).is_server_live(), "live after garbage")

metrics = urllib.request.urlopen(f"http://{HTTP_URL}/metrics").read().decode()
check('kairos_requests_total{model="mlp",class="real-time",protocol="grpc",outcome="ok"}' in metrics, "metrics")
# The Prometheus project's own OpenMetrics parser reads the whole exposition (it raises on a
# malformed line, a repeated family or a missing `# EOF`).
from prometheus_client.openmetrics.parser import text_string_to_metric_families  # noqa: E402

families = {f.name: f for f in text_string_to_metric_families(metrics)}
ok_grpc = [
    s.value
    for s in families["kairos_requests"].samples
    if s.labels == {"model": "mlp", "class": "real-time", "protocol": "grpc", "outcome": "ok"}
]
check(len(ok_grpc) == 1 and ok_grpc[0] >= 1, f"kairos_requests_total parsed: {ok_grpc}")
check(families["kairos_request_duration_seconds"].type == "histogram", "histogram family parsed")
check(families["kairos_models_ready"].samples[0].value >= 1, "models ready parsed")
print(f"all {checks} checks passed")
