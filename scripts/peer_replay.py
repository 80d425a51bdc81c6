#!/usr/bin/env python3
"""The PyTorch peer of `kairos bench`: replays the very arrival traces kairos was given.

`kairos bench run ... --traces` writes one trace per point (`OUT/traces/*.trace.json`, format
kairos-trace/1: streams with model, class rt/be and deadline; closed-loop sources; open-loop arrivals
as columns). This script serves the same requests with PyTorch (torchvision / transformers models of
the same architectures, random weights, fp16, eval, cudnn.benchmark on) in the serving modes
multi-stream servers use, and writes what happened to each request (format kairos-peer/1);
`kairos bench report --peers` puts the results in the same tables and plots, measured by the same code.

Modes (comma-separated `--modes`; a mode's name in the results is its kind followed by N, e.g. graph4):
  graph:N             N worker threads, each with its own CUDA stream, one shared FIFO queue (a free
                      worker takes the oldest waiting request); each request is one replay of a CUDA
                      graph captured for its model on that worker's stream: PyTorch as it is deployed
  graph-priority:N    N best-effort graph workers on normal-priority streams and N real-time graph
                      workers on high-priority streams (priority -1); real-time requests (class rt)
                      go to their own queue
  single              one worker thread, one CUDA stream, requests in arrival order (one model at a time)
  streams:N           as graph:N, but each request runs one eager forward pass
  priority:N          as graph-priority:N, eager: N best-effort workers on low-priority streams and N
                      real-time workers on high-priority streams (torch.cuda.Stream(priority=-1))

The CUDA-graph modes are the default peer (`--modes graph:1,graph:4,graph:8,graph-priority:4,streams:4`,
eager streams:4 kept as a second peer). Graph workers share the eager workers' threads and streams
(2 x the greatest N); before any replay each worker captures one graph per model on its own stream
and thread, after 3 eager warm-up passes there (static resident inputs, the graph's static outputs,
one shared memory pool per worker). A model that cannot be captured (or runs out of memory) is
logged, and its traces are skipped in the graph modes only.

Latency is completion (after the worker's stream synchronizes) minus the scheduled arrival, GPU time
the CUDA-event time of the forward pass or graph replay. Closed-loop clients send their next request
when the previous one completes (plus the trace's think time). Arrivals stop at the trace's duration;
requests not done `drain_ns` later are unfinished. Building, warming and capturing happen before the
measured window. Python threads share the GIL: this is PyTorch as a Python server runs it, not a C++
server.

    python3 scripts/peer_replay.py --traces out/bench/traces [more dirs or files] \
        [--modes graph:1,graph:4,graph:8,graph-priority:4,streams:4] [--presets disb-a,paella-mix] \
        [--budget-s 150] [--out out/bench/peers.json]
    python3 scripts/peer_replay.py --selftest     # checks the mode parser; needs neither GPU nor torch

Traces of the synthetic head-of-line job (paella-hol) have no PyTorch equivalent and are skipped;
coldstart instances share one module per architecture (PyTorch keeps them all resident).
"""
import argparse, heapq, inspect, json, os, queue, random, re, sys, threading, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# Imported by `_import_torch` once the arguments are parsed, so that `--selftest` runs without torch.
torch = None
build = None  # pytorch_peer.build: the same architectures as the kernel-count peer
TRANSFORMERS = ()  # pytorch_peer.TRANSFORMERS

PEER_FORMAT = "kairos-peer/1"
DEFAULT_MODES = "graph:1,graph:4,graph:8,graph-priority:4,streams:4"
GRAPH_KINDS = ("graph", "graph-priority")
# Kinds with a real-time queue served by workers on high-priority streams.
PRIORITY_KINDS = ("priority", "graph-priority")
# Eager warm-up passes on a worker's stream before a capture (as PyTorch's CUDA-graph docs do).
CAPTURE_WARMUP = 3


def _import_torch():
    global torch, build, TRANSFORMERS
    import torch as _torch
    import pytorch_peer
    torch, build, TRANSFORMERS = _torch, pytorch_peer.build, tuple(pytorch_peer.TRANSFORMERS)


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def trace_files(paths, presets):
    files = []
    for p in paths:
        if os.path.isdir(p):
            files += [os.path.join(p, f) for f in sorted(os.listdir(p)) if f.endswith(".trace.json")]
        else:
            files.append(p)
    # A trace given twice (the same arrivals in two runs' folders) is replayed once; two traces of
    # one name with other contents (runs with other arguments) are both replayed, and `kairos
    # bench report` merges into each folder the run whose arrivals are its trace's.
    out, seen = [], set()
    for f in files:
        t = json.load(open(f))
        if t.get("format") != "kairos-trace/1":
            log(f"skip {f}: not a kairos-trace/1 file")
            continue
        if presets and t["preset"] not in presets:
            continue
        key = json.dumps(t, sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
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


def _describe_error(e):
    """The exception and what it was raised during: a failed capture's own error (e.g. a synchronizing
    op or out of memory) is usually the context of capture_end's "operation not permitted"."""
    parts, seen = [], set()
    while e is not None and id(e) not in seen and len(parts) < 3:
        seen.add(id(e))
        text = str(e).strip().splitlines()
        parts.append(f"{type(e).__name__}: {text[0] if text else ''}")
        e = e.__cause__ or e.__context__
    return " <- ".join(parts)


def _is_oom(e):
    oom = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if (oom is not None and isinstance(e, oom)) or "out of memory" in str(e).lower():
            return True
        e = e.__cause__ or e.__context__
    return False


def key_text(key):
    arch, batch, seq = key
    return f"{arch} (batch {batch}, seq {seq})"


class Graphs:
    """One CUDA graph per (model, worker) for the graph modes, captured before any replay.

    Each capture runs as a task on the worker's own long-lived thread (see `Workers`: cuDNN's
    benchmark cache is thread-local) and stream, one capture at a time with every other worker idle
    (a capture must not overlap other CUDA work; torch.cuda.graph also synchronizes the device and
    empties the allocator's cache on entry). Per model: CAPTURE_WARMUP eager passes on the worker's
    stream (a side stream, not the default one, as PyTorch's docs ask; warming the very stream the
    capture uses also creates the per-stream lazy state such as cuBLAS workspaces outside the
    capture), then the capture on that stream, then one replay and a synchronize. The graph reads the
    model's resident input tensors (shared with the eager modes and with every worker: a forward
    pass only reads them) and writes its static outputs, which are kept alive with the graph. An rt
    worker's graphs run at its stream's high priority either way: recent PyTorch instantiates graphs
    with cudaGraphInstantiateFlagUseNodePriority (kernels keep the capture stream's priority), older
    ones take the launch stream's, and each worker replays on the stream it captured on.

    Memory: all graphs of one worker share one memory pool (torch.cuda.graph_pool_handle()) rather
    than one private pool each (11 models x 16 workers would each hold their own activations).
    That is safe because a worker replays its graphs strictly one at a time on its one stream (it
    synchronizes after each request; stream order alone would serialize them), and a graph reads
    only its inputs and weights (outside the pool) and what it wrote itself earlier in the same
    replay: two graphs of a worker may reuse each other's intermediate memory, never while the other
    runs. Static outputs stay referenced, so later captures never place anything over them (and
    they are never read). Different workers, which do replay concurrently, have different pools.

    A failed capture (out of memory, or a model that cannot be captured, e.g. one that synchronizes
    with the host) is logged and leaves that model without a graph on that worker; the traces using
    it are skipped in the graph modes only. A model that fails for any reason but memory is not
    tried on the other workers. After a failure the worker gets a fresh pool, and what some PyTorch
    versions leave behind is undone (see `_recover`). Models are captured in the order given
    (the caller puts transformers, the likely failures, last) and each on every worker before the
    next, so a failure that spoils later captures costs as little as possible.
    """

    def __init__(self, models, workers):
        self.models = models
        self.workers = workers
        n = len(workers.streams)
        self.by_worker = [dict() for _ in range(n)]  # worker -> model key -> (graph, static outputs)
        self.pools = [None] * n
        self.seconds = [0.0] * n
        self.failed = [0] * n
        try:  # thread_local: a stray CUDA call on another thread must not invalidate the capture
            self.capture_kw = (
                {"capture_error_mode": "thread_local"}
                if "capture_error_mode" in inspect.signature(torch.cuda.graph.__init__).parameters
                else {}
            )
        except (TypeError, ValueError):
            self.capture_kw = {}

    def capture(self, keys, worker_ids):
        for key in keys:
            for w in worker_ids:
                res = {}

                def task(stream, w=w, key=key, res=res):
                    res["r"] = self._capture_on(w, key, stream)

                t = time.time()
                self.workers.start(w, task).wait()
                self.seconds[w] += time.time() - t
                why, oom = res.get("r", ("the capture task raised (see above)", False))
                if why is None:
                    continue
                self.failed[w] += 1
                log(f"  graph {key_text(key)} on worker {w}: capture failed in {time.time() - t:.1f} s: {why}")
                if not oom:
                    log(f"  graph {key_text(key)}: not captured on any worker; its traces are skipped in the graph modes")
                    break

    def missing(self, keys, worker_ids):
        """The keys (of `keys`) without a graph on some worker of `worker_ids`."""
        return sorted({k for k in keys for w in worker_ids if k not in self.by_worker[w]})

    def _capture_on(self, w, key, stream):
        """Runs on worker w's thread: returns (None, False) when captured, else (why, out of memory)."""
        model, args = self.models.by_arch[key]
        if self.pools[w] is None:
            self.pools[w] = torch.cuda.graph_pool_handle()
        pool = self.pools[w]
        prev = torch.cuda.current_stream()
        graph, out, err = None, None, None
        try:
            torch.cuda.synchronize()  # the inputs were made on the default stream, by the main thread
            with torch.no_grad(), torch.cuda.stream(stream):
                for _ in range(CAPTURE_WARMUP):
                    model(*args)
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.no_grad(), torch.cuda.graph(graph, pool=pool, stream=stream, **self.capture_kw):
                out = model(*args)
            with torch.cuda.stream(stream):
                graph.replay()
            stream.synchronize()
        except Exception as e:  # one model must not lose the others
            err = (_describe_error(e), _is_oom(e))
        # Out of the except block: the traceback (and the failed forward's tensors) is released.
        if err is None:
            self.by_worker[w][key] = (graph, out)
            return None, False
        graph = out = None
        self._recover(prev, pool)
        self.pools[w] = None  # the next capture on this worker starts a fresh pool
        return err

    @staticmethod
    def _recover(prev, pool):
        """Undoes what a failed torch.cuda.graph may leave behind (PyTorch versions differ).

        capture_end raises before the context restores the thread's stream, so later work on this
        thread would go to the capture stream: restore it. Where capture_end raises before ending
        the allocator's routing into the pool, the allocator stays "recording" (the next capture into
        that pool fails, and emptying the cache asserts): end it (an error here means it had ended).
        A failed capture's error can also surface at the next kernel launch on this thread: spend it
        on a throwaway op.
        """
        end = getattr(torch._C, "_cuda_endAllocateToPool", None) or getattr(
            torch._C, "_cuda_endAllocateCurrentStreamToPool", None)
        if end is not None:
            try:
                end(torch.cuda.current_device(), pool)
            except Exception:
                pass
        try:
            torch.cuda.set_stream(prev)
        except Exception as e:
            log(f"  could not restore the worker's stream after a failed capture: {e!r}")
        for _ in range(3):
            try:
                torch.zeros(1, device="cuda").add_(1).item()
                break
            except Exception:
                continue


def parse_modes(text):
    """[(kind, n)] of `--modes`: single, streams:N, priority:N, graph:N, graph-priority:N (N >= 1)."""
    modes = []
    for m in text.split(","):
        m = m.strip()
        if m == "single":
            modes.append(("single", 1))
        elif ":" in m:
            kind, n = m.split(":", 1)
            if kind not in ("streams", "priority") + GRAPH_KINDS:
                raise SystemExit(f"unknown mode {m}: use single, streams:N, priority:N, graph:N, graph-priority:N")
            if not re.fullmatch(r"[0-9]+", n) or int(n) < 1:
                raise SystemExit(f"mode {m}: N must be a whole number of workers, at least 1")
            modes.append((kind, int(n)))
        else:
            raise SystemExit(f"unknown mode {m}: use single, streams:N, priority:N, graph:N, graph-priority:N")
    return modes


def mode_name(kind, n):
    return "single" if kind == "single" else f"{kind}{n}"


def mode_workers(kind, n, nmax):
    """The worker indices a mode uses: best-effort workers are 0..nmax-1 (normal-priority streams),
    real-time ones nmax..2*nmax-1 (high-priority streams), as `main` creates them."""
    be = list(range(n))
    return be + [nmax + i for i in range(n)] if kind in PRIORITY_KINDS else be


def graph_workers(modes, nmax):
    """The workers that need CUDA graphs: those some graph mode uses, in order (best-effort first)."""
    used = set()
    for kind, n in modes:
        if kind in GRAPH_KINDS:
            used.update(mode_workers(kind, n, nmax))
    return sorted(used)


class Replay:
    def __init__(self, trace, modules, kind, n, workers, rt_workers, be_workers, seed, keys=None, graphs=None):
        self.t = trace
        self.kind, self.n = kind, n
        self.streams = trace["streams"]
        self.modules = modules  # stream index -> (model, args)
        self.keys = keys  # stream index -> model key (arch, batch, seq)
        # Graph modes: worker index -> model key -> (CUDA graph, static outputs); None: eager.
        self.graphs = graphs
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
        if self.kind in PRIORITY_KINDS and self.streams[stream]["class"] == "rt":
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

    def worker(self, q, cuda_stream, graphs=None):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        # Graph modes: this worker's graph of each trace stream's model, captured on cuda_stream.
        replays = None if graphs is None else [graphs[k][0] for k in self.keys]
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
            if replays is None:
                model, args = self.modules[stream]
                with torch.no_grad(), torch.cuda.stream(cuda_stream):
                    e0.record(cuda_stream)
                    model(*args)
                    e1.record(cuda_stream)
            else:
                graph = replays[stream]
                with torch.cuda.stream(cuda_stream):
                    e0.record(cuda_stream)
                    graph.replay()  # launches on the current stream: this worker's
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

    def start_worker(self, i, q):
        if self.graphs is None:
            return self.workers.start(i, lambda s: self.worker(q, s))
        graphs = self.graphs[i]
        return self.workers.start(i, lambda s: self.worker(q, s, graphs))

    def run(self):
        running = []
        if self.kind in PRIORITY_KINDS:
            for i in self.rt_workers[: self.n]:
                running.append(self.start_worker(i, self.rt_q))
        for i in self.be_workers[: self.n]:
            running.append(self.start_worker(i, self.be_q))
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


def selftest():
    """Checks the mode parser and the workers the modes use; needs neither a GPU nor torch."""
    good = {
        "single": [("single", 1)],
        "streams:4": [("streams", 4)],
        "priority:4": [("priority", 4)],
        "graph:1": [("graph", 1)],
        "graph:8": [("graph", 8)],
        "graph-priority:4": [("graph-priority", 4)],
        " graph:2 , streams:16,single ": [("graph", 2), ("streams", 16), ("single", 1)],
        "single,streams:4,priority:4": [("single", 1), ("streams", 4), ("priority", 4)],
        DEFAULT_MODES: [("graph", 1), ("graph", 4), ("graph", 8), ("graph-priority", 4), ("streams", 4)],
    }
    for text, want in good.items():
        got = parse_modes(text)
        assert got == want, (text, got, want)
    names = [mode_name(k, n) for k, n in parse_modes(DEFAULT_MODES + ",single,priority:4")]
    assert names == ["graph1", "graph4", "graph8", "graph-priority4", "streams4", "single", "priority4"], names
    bad = ["", "graph", "graph:", "graph:0", "graph:-1", "graph:x", "graph:1.5", "graph:4:2", "graph: 4",
           "graph-priority", "graph-priority:0", "graphs:4", "graph_priority:4", "priority", "streams",
           "single:1", "bogus:2", "streams:4,", ",streams:4", "streams:4,,single", "Graph:4"]
    for text in bad:
        try:
            parse_modes(text)
        except SystemExit:
            continue
        raise AssertionError(f"mode {text!r} was accepted")
    assert mode_workers("graph", 3, 8) == [0, 1, 2]
    assert mode_workers("graph-priority", 2, 8) == [0, 1, 8, 9]
    assert mode_workers("priority", 1, 4) == [0, 4]
    assert mode_workers("single", 1, 4) == [0]
    modes = parse_modes(DEFAULT_MODES)
    assert graph_workers(modes, 8) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    assert graph_workers(parse_modes("single,streams:4,priority:4"), 4) == []
    assert graph_workers(parse_modes("graph-priority:2,graph:1"), 2) == [0, 1, 2, 3]
    assert "torch" not in sys.modules, "the self-test imported torch"
    print(f"selftest ok: {len(good)} accepted, {len(bad)} rejected mode lists")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", nargs="+", help="trace files or folders of *.trace.json (required)")
    ap.add_argument("--modes", default=DEFAULT_MODES)
    ap.add_argument("--presets", default="", help="only these presets (comma-separated)")
    ap.add_argument("--budget-s", type=float, default=0, help="skip replays that would end after this many seconds")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "out"), "peers.json"))
    ap.add_argument("--selftest", action="store_true", help="check the mode parser (no GPU, no torch) and exit")
    a = ap.parse_args()
    if a.selftest:
        selftest()
        return
    if not a.traces:
        ap.error("the following arguments are required: --traces")
    modes = parse_modes(a.modes)
    _import_torch()
    start = time.time()
    presets = set(p for p in a.presets.split(",") if p)
    traces = trace_files(a.traces, presets)
    torch.backends.cudnn.benchmark = True
    device = torch.cuda.get_device_name(0)
    log(f"# PyTorch {torch.__version__} on {device}: {len(traces)} traces x {len(modes)} modes")
    nmax = max(n for _, n in modes)
    be_streams = [torch.cuda.Stream(priority=0) for _ in range(nmax)]
    # Lower is more urgent; -1 is the highest priority every CUDA device offers. The real-time workers
    # of both priority:N and graph-priority:N use these priority -1 streams (not the greatest priority
    # torch.cuda.Stream.priority_range() reports): with only two classes of streams at work, only their
    # order matters, and eager and graph peers then run on the very same streams.
    rt_streams = [torch.cuda.Stream(priority=-1) for _ in range(nmax)]
    models = Models()
    plans = []
    for f, t in traces:
        archs = {m["name"]: m for m in t["models"]}
        if any(m["arch"] == "synthetic-chain" for m in archs.values()):
            log(f"skip {os.path.basename(f)}: the synthetic head-of-line job has no PyTorch equivalent")
            continue
        try:
            modules, keys = [], []
            for s in t["streams"]:
                m = archs[s["model"]]
                modules.append(models.get(m["arch"], m["batch"], m["seq_len"]))
                keys.append((m["arch"], m["batch"], m["seq_len"]))
        except Exception as e:  # a model PyTorch cannot build must not lose the others
            log(f"skip {os.path.basename(f)}: {e!r}")
            continue
        plans.append((f, t, modules, keys))
    # The graph modes use the same threads and streams as the eager ones (modes run one at a time):
    # best-effort workers on priority-0 streams, real-time ones on priority -1 (see above).
    workers = Workers(be_streams + rt_streams)
    be_workers, rt_workers = list(range(nmax)), list(range(nmax, 2 * nmax))
    graphs = None
    gworkers = graph_workers(modes, nmax)
    if gworkers:
        # Before the eager warm-up below: every capture empties the allocator's cache (torch.cuda.graph
        # does on entry), which would otherwise drop the blocks the eager modes warmed. Each capture
        # warms its model eagerly on the worker's thread and stream first.
        t = time.time()
        graphs = Graphs(models, workers)
        needed = {k for _, _, _, keys in plans for k in keys}
        graphs.capture(sorted(needed, key=lambda k: (k[0] in TRANSFORMERS, k)), gworkers)
        for i in gworkers:
            kind = "rt" if i >= nmax else "be"
            failed = f", {graphs.failed[i]} failed" if graphs.failed[i] else ""
            log(f"  worker {i} ({kind}): {len(graphs.by_worker[i])} CUDA graphs warmed and captured in {graphs.seconds[i]:.1f} s{failed}")
        log(f"  CUDA graphs of {len(needed)} models on {len(gworkers)} workers in {time.time() - t:.1f} s")
    # One thread at a time: autotuning under contention would pick worse convolution plans.
    # Eager warm-up only on the workers the eager modes use (a worker's first passes re-run cuDNN's
    # per-thread autotuning: ~16 s each on an H100 host).
    eager_used = set()
    for kind, n in modes:
        if kind not in GRAPH_KINDS:
            eager_used.update(mode_workers(kind, n, nmax))
    for i in sorted(eager_used):
        t = time.time()
        workers.start(i, models.warm).wait()
        log(f"  worker {i} warmed in {time.time() - t:.1f} s")
    log(f"  models built and warmed in {time.time() - start:.1f} s")
    runs = []
    for f, t, modules, keys in plans:
        for kind, n in modes:
            if kind in GRAPH_KINDS:
                missing = graphs.missing(keys, mode_workers(kind, n, nmax))
                if missing:
                    log(f"skip {os.path.basename(f)} {mode_name(kind, n)}: no CUDA graph of {', '.join(map(key_text, missing))}")
                    continue
            need = (t["duration_ns"] + t["drain_ns"]) / 1e9 + 1.0
            if a.budget_s and time.time() - start + need > a.budget_s:
                log(f"skip {os.path.basename(f)} {mode_name(kind, n)}: over the {a.budget_s:.0f} s budget")
                continue
            r = Replay(t, modules, kind, n, workers, rt_workers, be_workers, a.seed, keys,
                       graphs.by_worker if kind in GRAPH_KINDS else None)
            started_unix_ms = int(time.time() * 1000)
            wall = r.run()
            rec = r.records
            done = [x for x in rec if x[2] is not None]
            lat = sorted(x[2] - x[1] for x in done)
            p99 = lat[int(0.99 * (len(lat) - 1))] / 1e6 if lat else float("nan")
            log(f"  {t['preset']:<18} load {t['load']:<5} {mode_name(kind, n):<15} {len(done)}/{len(rec)} done, p99 {p99:.3f} ms ({wall:.1f} s)")
            runs.append({
                "trace": os.path.basename(f),
                "mode": mode_name(kind, n),
                "stream": [x[0] for x in rec],
                "arrival_ns": [x[1] for x in rec],
                "done_ns": [x[2] for x in rec],
                "gpu_ns": [x[3] for x in rec],
                "closed": [x[4] for x in rec],
                "wall_s": wall,
                "started_unix_ms": started_unix_ms,
            })
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump({"format": PEER_FORMAT, "system": "pytorch", "version": torch.__version__, "device": device, "runs": runs}, fh)
    log(f"wrote {a.out}: {len(runs)} runs in {time.time() - start:.1f} s")


if __name__ == "__main__":
    main()
