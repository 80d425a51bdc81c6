#!/usr/bin/env python3
"""Small ONNX test models from PyTorch's two exporters (TorchScript and dynamo), for kairos' front-door tests.

Each model is exported with random weights (scaled so outputs are not near zero) by
torch.onnx.export(dynamo=False) at opsets 13 and 17 and by torch.onnx.export(dynamo=True) at opset 18,
together with a seeded input (.npy). Writes everything into one tar: $OUT/onnx_fixtures.tar.

    python3 scripts/export_fixtures.py [--out DIR]
"""
import argparse, io, os, tarfile

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class TinyCnn(nn.Module):
    """Conv/BN/ReLU, depthwise + HardSwish, ReLU6, two branches concatenated, pools, flatten, linear."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.dw = nn.Sequential(nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=8, bias=False), nn.BatchNorm2d(8), nn.Hardswish())
        self.b1 = nn.Sequential(nn.Conv2d(8, 6, 1), nn.ReLU6())
        self.b2 = nn.Sequential(nn.Conv2d(8, 4, 3, padding=2, dilation=2), nn.Sigmoid())
        self.pool = nn.AvgPool2d(3, stride=1, padding=1)
        self.fc = nn.Linear(10 * 4 * 4, 7)

    def forward(self, x):
        x = self.stem(x)
        x = F.max_pool2d(x, 2)
        x = self.dw(x)
        x = torch.cat([self.b1(x), self.b2(x)], dim=1)
        x = self.pool(x)
        x = F.adaptive_avg_pool2d(x, 4)
        return self.fc(torch.flatten(x, 1))


class TinyTransformer(nn.Module):
    """Embeddings, pre-LN attention with a causal mask, GELU MLP, tanh, mean pooling over the sequence."""

    def __init__(self, vocab=64, d=32, heads=4, seq=8):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.heads = heads
        self.register_buffer("mask", torch.tril(torch.ones(seq, seq, dtype=torch.bool)))

    def forward(self, ids):
        b, s = ids.shape
        pos = torch.arange(s, device=ids.device).unsqueeze(0).expand(b, s)
        x = self.tok(ids) + self.pos(pos)
        h = self.ln1(x)
        q, k, v = self.qkv(h).split(x.shape[-1], dim=-1)
        hd = x.shape[-1] // self.heads
        q, k, v = (t.view(b, s, self.heads, hd).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / (hd ** 0.5)
        att = att.masked_fill(~self.mask[:s, :s], float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, s, -1)
        x = x + self.proj(y)
        x = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return torch.tanh(x).mean(dim=1)


def randomize(m, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() > 1:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=g) * (2.0 / fan_in) ** 0.5)
            else:
                p.copy_(torch.rand(p.shape, generator=g) * 0.4 + (0.8 if "weight" in name else -0.2))
        for name, b in m.named_buffers():
            if "running_var" in name:
                b.copy_(torch.rand(b.shape, generator=g) + 0.5)
            elif "running_mean" in name:
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return m.eval()


def export(model, args, opset, dynamo):
    f = io.BytesIO()
    torch.onnx.export(model, args, f, dynamo=dynamo, opset_version=opset, input_names=["input"], output_names=["output"])
    return f.getvalue()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    a = ap.parse_args()
    torch.manual_seed(0)
    cases = [
        ("tiny_cnn", randomize(TinyCnn(), 1), (torch.randn(1, 3, 32, 32),)),
        ("tiny_transformer", randomize(TinyTransformer(), 2), (torch.randint(0, 64, (2, 8)),)),
    ]
    path = os.path.join(a.out, "onnx_fixtures.tar")
    with tarfile.open(path, "w") as tar:
        def add(name, data):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for name, model, args in cases:
            buf = io.BytesIO()
            np.save(buf, args[0].numpy())
            add(f"{name}.input.npy", buf.getvalue())
            with torch.no_grad():
                ref = model(*args).numpy()
            buf = io.BytesIO()
            np.save(buf, ref)
            add(f"{name}.torch_output.npy", buf.getvalue())
            for opset, dynamo in [(13, False), (17, False), (18, True)]:
                tag = f"{name}_{'dynamo' if dynamo else 'torchscript'}_opset{opset}.onnx"
                try:
                    data = export(model, args, opset, dynamo)
                    add(tag, data)
                    print(f"{tag}: {len(data)} bytes", flush=True)
                except Exception as e:
                    print(f"{tag}: export failed: {e!r}", flush=True)
    print("wrote", path)


if __name__ == "__main__":
    main()
