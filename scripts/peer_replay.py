#!/usr/bin/env python3
"""The PyTorch peer of `kairos bench`: replays the very arrival traces kairos was given.

`kairos bench run ... --traces` writes one trace per point (`OUT/traces/*.trace.json`, format
kairos-trace/1: streams with model, class rt/be and deadline; closed-loop sources; open-loop arrivals
as columns). This script serves the same requests with PyTorch (torchvision / transformers models of
the same architectures, random weights, fp16, eval, cudnn.benchmark on) in the serving modes
multi-stream servers use, and writes what happened to each request (format kairos-peer/1);
`kairos bench report --peers` puts the results in the same tables and plots, measured by the same code.

Modes (comma-separated `--modes`):
  single       one worker thread, one CUDA stream, requests in arrival order (one model at a time)
  streams:N    N worker threads, each with its own CUDA stream, one shared FIFO queue
  priority:N   N best-effort workers on low-priority streams and N real-time workers on high-priority
               streams (torch.cuda.Stream(priority=-1)); real-time requests go to their own queue

Each request runs one eager forward pass on its worker's stream; latency is completion (after the
stream synchronizes) minus the scheduled arrival, GPU time the CUDA-event time of the forward pass.
Closed-loop clients send their next request when the previous one completes (plus the trace's think
time). Arrivals stop at the trace's duration; requests not done `drain_ns` later are unfinished.
Python threads share the GIL: this is PyTorch as a Python server runs it, not a C++ server.

    python3 scripts/peer_replay.py --traces out/bench/traces [more dirs or files] \
        [--modes single,streams:4,priority:4] [--presets disb-a,paella-mix] [--budget-s 150] \
        [--out out/bench/peers.json]

Traces of the synthetic head-of-line job (paella-hol) have no PyTorch equivalent and are skipped;
coldstart instances share one module per architecture (PyTorch keeps them all resident).
"""
import argparse, heapq, json, os, queue, random, sys, threading, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from pytorch_peer import build  # noqa: E402  (same architectures as the kernel-count peer)

PEER_FORMAT = "kairos-peer/1"


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def trace_files(paths, presets):
    files = []
    for p in paths:
        if os.path.isdir(p):
            files += [os.path.join(p, f) for f in sorted(os.listdir(p)) if f.endswith(".trace.json")]
        else:
            files.append(p)
    out = []
    for f in files:
        t = json.load(open(f))
        if t.get("format") != "kairos-trace/1":
            log(f"skip {f}: not a kairos-trace/1 file")
            continue
        if presets and t["preset"] not in presets:
            continue
        out.append((f, t))
    return out


class Models:
    """One module (and input) per architecture, built once, warmed on every stream."""

    def __init__(self):
        self.by_arch = {}

    def get(self, arch, batch, seq):
        key = (arch, batch, seq)
        if key not in self.by_arch:
            t = time.time()
            model, args = build(arch, batch, seq)
            self.by_arch[key] = (model, args)
            log(f"  built {arch} (batch {batch}, seq {seq}) in {time.time() - t:.1f} s")
        return self.by_arch[key]

    def warm(self, stream, reps=2):
        """Runs every model on `stream` from the calling thread (see `Workers`)."""
        with torch.no_grad(), torch.cuda.stream(stream):
            for model, args in self.by_arch.values():
                for _ in range(reps):
                    model(*args)
        stream.synchronize()


class Workers:
    """One long-lived thread per CUDA stream, reused by every replay.

    PyTorch keeps some per-thread state: cuDNN's v8 benchmark cache (the autotuned convolution
    plans) is thread-local, and cuBLAS handles are per thread and stream. A fresh thread per replay
    would autotune every convolution again inside the measured run (hundreds of milliseconds to
    seconds on the first requests), so the threads live as long as the script and each is warmed
    once, on its own stream, before any replay.
    """

    def __init__(self, streams):
        self.streams = streams
        self.inbox = [queue.Queue() for _ in streams]
        for i, q in enumerate(self.inbox):
            threading.Thread(target=self._loop, args=(q,), daemon=True, name=f"peer-worker-{i}").start()

    @staticmethod
    def _loop(q):
        while True:
            fn, done = q.get()
            try:
                fn()
            except Exception as e:  # a failed task must not kill the worker
                log(f"  worker task failed: {e!r}")
            finally:
                done.set()

    def start(self, i, fn):
        """Runs fn(stream_i) on worker i; returns an Event set when it returns."""
        done = threading.Event()
        self.inbox[i].put((lambda: fn(self.streams[i]), done))
        return done


def parse_modes(text):
    modes = []
    for m in text.split(","):
        m = m.strip()
        if m == "single":
            modes.append(("single", 1))
        elif ":" in m:
            kind, n = m.split(":", 1)
            if kind not in ("streams", "priority"):
                raise SystemExit(f"unknown mode {m}")
            modes.append((kind, int(n)))
        else:
            raise SystemExit(f"unknown mode {m}: use single, streams:N, priority:N")
    return modes


def mode_name(kind, n):
    return "single" if kind == "single" else f"{kind}{n}"


class Replay:
    def __init__(self, trace, modules, kind, n, workers, rt_workers, be_workers, seed):
        self.t = trace
        self.kind, self.n = kind, n
        self.streams = trace["streams"]
        self.modules = modules  # stream index -> (model, args)
        self.duration = trace["duration_ns"]
        self.drain_end = trace["duration_ns"] + trace["drain_ns"]
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.outstanding = 0
        self.records = []  # (stream, arrival_ns, done_ns or None, gpu_ns, closed)
        self.stop = threading.Event()
        self.rt_q, self.be_q = queue.Queue(), queue.Queue()
        self.timers = []  # heap of (time_ns, seq, req) for delayed closed-loop sends
        self.seq = 0
        self.rng = [random.Random(seed ^ (i + 1) * 0x9E3779B9) for i in range(len(trace["sources"]))]
        self.workers, self.rt_workers, self.be_workers = workers, rt_workers, be_workers
        self.t0 = 0

    def now(self):
        return time.perf_counter_ns() - self.t0

    def queue_for(self, stream):
        if self.kind == "priority" and self.streams[stream]["class"] == "rt":
            return self.rt_q
        return self.be_q

    def submit(self, stream, arrival, closed, source):
        with self.lock:
            self.outstanding += 1
        self.queue_for(stream).put((stream, arrival, closed, source))

    def pick(self, source):
        streams = self.t["sources"][source]["streams"]
        if len(streams) == 1:
            return streams[0][0]
        return self.rng[source].choices([s for s, _ in streams], weights=[w for _, w in streams])[0]

    def finished(self, req, done):
        stream, arrival, closed, source = req
        if closed and done is not None:
            arr = self.t["sources"][source]["arrival"]
            nxt = done + arr.get("think_ns", 0)
            if nxt < self.duration:
                if arr.get("think_ns", 0) == 0:
                    self.submit(self.pick(source), nxt, True, source)
                else:
                    with self.lock:
                        self.seq += 1
                        heapq.heappush(self.timers, (nxt, self.seq, source))
        with self.lock:
            self.outstanding -= 1
            self.cond.notify_all()

    def worker(self, q, cuda_stream):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        while True:
            try:
                req = q.get(timeout=0.02)
            except queue.Empty:
                if self.stop.is_set():
                    return
                continue
            stream, arrival, closed, source = req
            if self.stop.is_set():
                self.records.append((stream, arrival, None, 0, closed))
                self.finished(req, None)
                continue
            model, args = self.modules[stream]
            with torch.no_grad(), torch.cuda.stream(cuda_stream):
                e0.record(cuda_stream)
                model(*args)
                e1.record(cuda_stream)
            cuda_stream.synchronize()
            done = self.now()
            gpu = int(e0.elapsed_time(e1) * 1e6)
            if done > self.drain_end:
                self.records.append((stream, arrival, None, gpu, closed))
                self.finished(req, None)
            else:
                self.records.append((stream, arrival, done, gpu, closed))
                self.finished(req, done)

    def run(self):
        running = []
        if self.kind == "priority":
            for i in self.rt_workers[: self.n]:
                running.append(self.workers.start(i, lambda s: self.worker(self.rt_q, s)))
        for i in self.be_workers[: self.n]:
            running.append(self.workers.start(i, lambda s: self.worker(self.be_q, s)))
        opens = list(zip(self.t["arrivals"]["t_ns"], self.t["arrivals"]["stream"]))
        self.t0 = time.perf_counter_ns() + 20_000_000
        wall = time.time()
        time.sleep(max(0, -self.now()) / 1e9)
        # Closed-loop clients start at time 0.
        for i, src in enumerate(self.t["sources"]):
            if src["arrival"]["kind"] == "closed_loop":
                for _ in range(src["arrival"]["clients"]):
                    self.submit(self.pick(i), 0, True, i)
        k = 0
        while True:
            now = self.now()
            while k < len(opens) and opens[k][0] <= now:
                self.submit(opens[k][1], opens[k][0], False, None)
                k += 1
            with self.lock:
                due = []
                while self.timers and self.timers[0][0] <= now:
                    due.append(heapq.heappop(self.timers))
            for t, _, source in due:
                self.submit(self.pick(source), t, True, source)
            with self.lock:
                idle = k == len(opens) and not self.timers and self.outstanding == 0
            if idle and now >= self.duration or now >= self.drain_end:
                break
            if idle and k == len(opens):
                # Only closed loops left and nothing outstanding: they stopped.
                break
            nxt = opens[k][0] if k < len(opens) else self.drain_end
            with self.lock:
                if self.timers:
                    nxt = min(nxt, self.timers[0][0])
                wait = max(0, nxt - self.now()) / 1e9
                if wait > 0:
                    self.cond.wait(timeout=min(wait, 0.01))
        self.stop.set()
        for done in running:
            done.wait(timeout=30)
        # Open arrivals never submitted (stopped early) and requests still queued are unfinished.
        while k < len(opens):
            self.records.append((opens[k][1], opens[k][0], None, 0, False))
            k += 1
        for q in (self.rt_q, self.be_q):
            while not q.empty():
                stream, arrival, closed, _ = q.get_nowait()
                self.records.append((stream, arrival, None, 0, closed))
        torch.cuda.synchronize()
        return time.time() - wall


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", nargs="+", required=True, help="trace files or folders of *.trace.json")
    ap.add_argument("--modes", default="single,streams:4,priority:4")
    ap.add_argument("--presets", default="", help="only these presets (comma-separated)")
    ap.add_argument("--budget-s", type=float, default=0, help="skip replays that would end after this many seconds")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "out"), "peers.json"))
    a = ap.parse_args()
    start = time.time()
    presets = set(p for p in a.presets.split(",") if p)
    traces = trace_files(a.traces, presets)
    modes = parse_modes(a.modes)
    torch.backends.cudnn.benchmark = True
    device = torch.cuda.get_device_name(0)
    log(f"# PyTorch {torch.__version__} on {device}: {len(traces)} traces x {len(modes)} modes")
    nmax = max(n for _, n in modes)
    be_streams = [torch.cuda.Stream(priority=0) for _ in range(nmax)]
    # Lower is more urgent; -1 is the highest priority every CUDA device offers.
    rt_streams = [torch.cuda.Stream(priority=-1) for _ in range(nmax)]
    models = Models()
    plans = []
    for f, t in traces:
        archs = {m["name"]: m for m in t["models"]}
        if any(m["arch"] == "synthetic-chain" for m in archs.values()):
            log(f"skip {os.path.basename(f)}: the synthetic head-of-line job has no PyTorch equivalent")
            continue
        try:
            modules = []
            for s in t["streams"]:
                m = archs[s["model"]]
                modules.append(models.get(m["arch"], m["batch"], m["seq_len"]))
        except Exception as e:  # a model PyTorch cannot build must not lose the others
            log(f"skip {os.path.basename(f)}: {e!r}")
            continue
        plans.append((f, t, modules))
    workers = Workers(be_streams + rt_streams)
    be_workers, rt_workers = list(range(nmax)), list(range(nmax, 2 * nmax))
    # One thread at a time: autotuning under contention would pick worse convolution plans.
    for i in range(2 * nmax):
        t = time.time()
        workers.start(i, models.warm).wait()
        log(f"  worker {i} warmed in {time.time() - t:.1f} s")
    log(f"  models built and warmed in {time.time() - start:.1f} s")
    runs = []
    for f, t, modules in plans:
        for kind, n in modes:
            need = (t["duration_ns"] + t["drain_ns"]) / 1e9 + 1.0
            if a.budget_s and time.time() - start + need > a.budget_s:
                log(f"skip {os.path.basename(f)} {mode_name(kind, n)}: over the {a.budget_s:.0f} s budget")
                continue
            r = Replay(t, modules, kind, n, workers, rt_workers, be_workers, a.seed)
            wall = r.run()
            rec = r.records
            done = [x for x in rec if x[2] is not None]
            lat = sorted(x[2] - x[1] for x in done)
            p99 = lat[int(0.99 * (len(lat) - 1))] / 1e6 if lat else float("nan")
            log(f"  {t['preset']:<18} load {t['load']:<5} {mode_name(kind, n):<10} {len(done)}/{len(rec)} done, p99 {p99:.3f} ms ({wall:.1f} s)")
            runs.append({
                "trace": os.path.basename(f),
                "mode": mode_name(kind, n),
                "stream": [x[0] for x in rec],
                "arrival_ns": [x[1] for x in rec],
                "done_ns": [x[2] for x in rec],
                "gpu_ns": [x[3] for x in rec],
                "closed": [x[4] for x in rec],
                "wall_s": wall,
            })
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump({"format": PEER_FORMAT, "system": "pytorch", "version": torch.__version__, "device": device, "runs": runs}, fh)
    log(f"wrote {a.out}: {len(runs)} runs in {time.time() - start:.1f} s")


if __name__ == "__main__":
    main()
