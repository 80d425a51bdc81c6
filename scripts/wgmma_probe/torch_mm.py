import torch
shapes = [(197, 2304, 768), (197, 3072, 768), (197, 768, 3072), (197, 768, 768), (1024, 3072, 768), (128, 3072, 768), (4096, 4096, 4096)]
for M, N, K in shapes:
    a = torch.randn(M, K, device='cuda', dtype=torch.half)
    b = torch.randn(N, K, device='cuda', dtype=torch.half)
    for _ in range(10): torch.mm(a, b.t())
    reps = 20 if M == 4096 else 200
    e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps): torch.mm(a, b.t())
    g.replay(); torch.cuda.synchronize()
    e0.record(); g.replay(); e1.record(); torch.cuda.synchronize()
    us = e0.elapsed_time(e1) * 1000 / reps
    print(f"torch {M} {N} {K}: {us:.1f} us {2*M*N*K/us/1e6:.0f} TFLOPS")
