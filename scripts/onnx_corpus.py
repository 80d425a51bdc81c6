#!/usr/bin/env python3
"""The ONNX exporter corpus: models as people bring them, with onnxruntime's outputs to check against.

Builds every architecture below with random weights from a fixed seed (no downloads), exports it with
both PyTorch exporters (TorchScript: `dynamo=False`; dynamo: `dynamo=True`) at each asked opset with
dynamic axes (batch for vision models, batch and sequence for transformers), runs onnxruntime (CPU, f32)
on two input shapes per model, and writes

    OUT/<arch>.<exporter><opset>.onnx        the model (one file, weights inside)
    OUT/<arch>.case<k>.in<i>.npy             the inputs of case k (shared by every export of the arch)
    OUT/<arch>.<exporter><opset>.case<k>.out<j>.npy   onnxruntime's outputs
    OUT/manifest.json                        every entry: files, shapes, dynamic axes, export status

`kairos check-onnx OUT` then loads each model at each case's shapes, runs it (CPU reference or GPU)
and compares with onnxruntime. An export the exporter itself refuses is recorded as `export-failed`
with the exporter's message (it is not a kairos result).

Tiers: `tiny` (small widths and images; the whole tier runs on a CPU in minutes, CI runs it) and
`full` (the architectures' standard sizes at 224x224, for the GPU step). Transformers are small
configurations in both tiers.

    python3 scripts/onnx_corpus.py --out corpus --tier tiny
    python3 scripts/onnx_corpus.py --out corpus-full --tier full --opsets 17,18,newest --only 'resnet|bert'

Needs torch, torchvision, timm, transformers, onnx, onnxscript and onnxruntime (see .ci/run for the
pinned versions CI uses).
"""

import argparse
import json
import os
import re
import sys
import time
import traceback
import warnings
import zlib

import numpy as np

SEED = 20261128
# Token ids of random inputs elsewhere (`kairos bench latency`) go up to 1000.
VOCAB = 1024
POSITIONS = 64


def _torch():
    import torch

    return torch


def randomize(model, seed):
    """Fills every parameter and buffer with seeded values so outputs are far from zero and from uniform."""
    torch = _torch()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() <= 1:
                # Norm scales around 1, biases small: activations keep a sane range through deep nets.
                base = 1.0 if name.endswith("weight") else 0.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=g))
            else:
                fan_in = max(1, p[0].numel())
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 / fan_in) ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("running_mean"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
            elif name.endswith("running_var"):
                b.copy_(0.5 + torch.rand(b.shape, generator=g))
    return model.eval()


# ---------------------------------------------------------------- vision


def vision_models(tier):
    """(name, family, source, builder, image size) for every vision architecture."""
    import timm
    import torch.nn as nn
    import torchvision.models as M
    from torchvision.models import convnext, efficientnet, mnasnet, regnet, shufflenetv2, vgg

    tiny = tier == "tiny"

    def small_classifier(m, attr, features):
        setattr(m, attr, nn.Sequential(nn.Dropout(0.5), nn.Linear(features, 32), nn.ReLU(), nn.Linear(32, 10)))
        return m

    def alexnet():
        m = M.alexnet(num_classes=10)
        if tiny:
            m.features = nn.Sequential(
                nn.Conv2d(3, 16, 11, 4, 2), nn.ReLU(), nn.MaxPool2d(3, 2),
                nn.Conv2d(16, 24, 5, padding=2), nn.ReLU(), nn.MaxPool2d(3, 2),
                nn.Conv2d(24, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, 2),
            )
            m = small_classifier(m, "classifier", 32 * 36)
        return m

    def vgg11():
        if not tiny:
            return M.vgg11_bn(num_classes=10)
        m = vgg.VGG(vgg.make_layers([8, "M", 16, "M", 32, 32, "M", 32, "M"], batch_norm=True), num_classes=10)
        return small_classifier(m, "classifier", 32 * 49)

    def resnet18():
        return timm.models.resnet.ResNet(timm.models.resnet.BasicBlock, (1, 1, 1, 1), num_classes=10,
                                         channels=(8, 16, 24, 32), stem_width=8) if tiny else M.resnet18(num_classes=10)

    # torchvision's ResNet fixes its widths (64..2048); the tiny tier takes timm's, which has the
    # same bottleneck graph with the widths as arguments.
    def tiny_bottleneck(**kw):
        return timm.models.resnet.ResNet(timm.models.resnet.Bottleneck, (1, 1, 1, 1), num_classes=10,
                                         channels=(8, 16, 24, 32), stem_width=8, **kw)

    def resnet50():
        return tiny_bottleneck() if tiny else M.resnet50(num_classes=10)

    def resnext():
        return tiny_bottleneck(cardinality=4, base_width=8) if tiny else M.resnext50_32x4d(num_classes=10)

    def wide_resnet():
        return tiny_bottleneck(base_width=128) if tiny else M.wide_resnet50_2(num_classes=10)

    def squeezenet():
        return M.squeezenet1_1(num_classes=10)

    def densenet():
        if tiny:
            return M.DenseNet(growth_rate=4, block_config=(2, 2, 2), num_init_features=8, num_classes=10)
        return M.densenet121(num_classes=10)

    def narrowed(build, k=8):
        """The architecture with every channel count divided by k (same graph, 1/k^2 the weights):
        GoogLeNet and Inception fix their widths in code."""
        conv_init, bn_init, lin_init = nn.Conv2d.__init__, nn.BatchNorm2d.__init__, nn.Linear.__init__

        def conv(self, cin, cout, *a, **kw):
            conv_init(self, cin if cin == 3 else cin // k, cout // k, *a, **kw)

        def bn(self, c, *a, **kw):
            bn_init(self, c // k, *a, **kw)

        def lin(self, fin, fout, *a, **kw):
            lin_init(self, fin // k, fout, *a, **kw)

        nn.Conv2d.__init__, nn.BatchNorm2d.__init__, nn.Linear.__init__ = conv, bn, lin
        try:
            return build()
        finally:
            nn.Conv2d.__init__, nn.BatchNorm2d.__init__, nn.Linear.__init__ = conv_init, bn_init, lin_init

    def googlenet():
        build = lambda: M.googlenet(num_classes=10, aux_logits=False, init_weights=False)  # noqa: E731
        return narrowed(build) if tiny else build()

    def inception():
        build = lambda: M.inception_v3(num_classes=10, aux_logits=False, init_weights=False)  # noqa: E731
        return narrowed(build) if tiny else build()

    def mobilenet_v2():
        return M.mobilenet_v2(num_classes=10, width_mult=0.25 if tiny else 1.0)

    def mobilenet_v3():
        return M.mobilenet_v3_small(num_classes=10) if tiny else M.mobilenet_v3_large(num_classes=10)

    def mnasnet_():
        return mnasnet.MNASNet(0.25 if tiny else 1.0, num_classes=10)

    def shufflenet():
        if tiny:
            return shufflenetv2.ShuffleNetV2([1, 1, 1], [8, 16, 32, 64, 64], num_classes=10)
        return M.shufflenet_v2_x1_0(num_classes=10)

    def efficientnet_b0():
        if not tiny:
            return M.efficientnet_b0(num_classes=10)
        setting, last = efficientnet._efficientnet_conf("efficientnet_b0", width_mult=0.25, depth_mult=0.3)
        return efficientnet.EfficientNet(setting, 0.2, num_classes=10, last_channel=last)

    def efficientnet_v2():
        if not tiny:
            return M.efficientnet_v2_s(num_classes=10)
        F, M_ = efficientnet.FusedMBConvConfig, efficientnet.MBConvConfig
        setting = [F(1, 3, 1, 8, 8, 1), F(4, 3, 2, 8, 16, 1), M_(4, 3, 2, 16, 24, 1), M_(6, 3, 1, 24, 32, 1)]
        return efficientnet.EfficientNet(setting, 0.2, num_classes=10, last_channel=64)

    def regnet_x():
        if not tiny:
            return M.regnet_x_400mf(num_classes=10)
        p = regnet.BlockParams.from_init_params(depth=4, w_0=8, w_a=4.0, w_m=2.0, group_width=4)
        return regnet.RegNet(p, num_classes=10, stem_width=8)

    def regnet_y():
        if not tiny:
            return M.regnet_y_400mf(num_classes=10)
        p = regnet.BlockParams.from_init_params(depth=4, w_0=8, w_a=4.0, w_m=2.0, group_width=4, se_ratio=0.25)
        return regnet.RegNet(p, num_classes=10, stem_width=8)

    def convnext_():
        if not tiny:
            return M.convnext_tiny(num_classes=10)
        C = convnext.CNBlockConfig
        return convnext.ConvNeXt([C(8, 16, 1), C(16, 32, 1), C(32, None, 1)], num_classes=10)

    def vit():
        if not tiny:
            return M.vit_b_16(num_classes=10)
        return M.VisionTransformer(image_size=64, patch_size=16, num_layers=2, num_heads=2, hidden_dim=32,
                                   mlp_dim=64, num_classes=10)

    def swin():
        if not tiny:
            return M.swin_t(num_classes=10)
        return M.SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[2, 2], num_heads=[2, 2],
                                 window_size=[4, 4], num_classes=10)

    def timm_efficientnet():
        # TinyNet-E is timm's smallest EfficientNet (width 0.51, depth 0.6 of B0).
        return timm.create_model("tinynet_e" if tiny else "efficientnet_b0", pretrained=False, num_classes=10)

    def timm_convnext():
        return timm.create_model("convnext_atto" if tiny else "convnext_tiny", pretrained=False, num_classes=10)

    size = 64 if tiny else 224
    return [
        # AlexNet's and VGG's adaptive pooling to 6x6 / 7x7 exports only from a multiple of it (TorchScript).
        ("alexnet", "AlexNet", "torchvision", alexnet, 224),
        ("vgg11_bn", "VGG", "torchvision", vgg11, 112 if tiny else 224),
        ("resnet18", "ResNet", "timm" if tiny else "torchvision", resnet18, size),
        ("resnet50", "ResNet", "timm" if tiny else "torchvision", resnet50, size),
        ("resnext50", "ResNeXt", "timm" if tiny else "torchvision", resnext, size),
        ("wide_resnet50", "Wide ResNet", "timm" if tiny else "torchvision", wide_resnet, size),
        ("squeezenet1_1", "SqueezeNet", "torchvision", squeezenet, size),
        ("densenet", "DenseNet", "torchvision", densenet, size),
        ("googlenet", "GoogLeNet", "torchvision", googlenet, size),
        ("inception_v3", "Inception", "torchvision", inception, 96 if tiny else 299),
        ("mobilenet_v2", "MobileNet v2", "torchvision", mobilenet_v2, size),
        ("mobilenet_v3", "MobileNet v3", "torchvision", mobilenet_v3, size),
        ("mnasnet", "MNASNet", "torchvision", mnasnet_, size),
        ("shufflenet_v2", "ShuffleNet v2", "torchvision", shufflenet, size),
        ("efficientnet_b0", "EfficientNet", "torchvision", efficientnet_b0, size),
        ("efficientnet_v2", "EfficientNet v2", "torchvision", efficientnet_v2, size),
        ("regnet_x", "RegNet", "torchvision", regnet_x, size),
        ("regnet_y", "RegNet (SE)", "torchvision", regnet_y, size),
        ("convnext", "ConvNeXt", "torchvision", convnext_, size),
        ("vit", "ViT", "torchvision", vit, size),
        ("swin", "Swin", "torchvision", swin, size),
        ("timm_efficientnet", "EfficientNet", "timm", timm_efficientnet, size),
        ("timm_convnext", "ConvNeXt", "timm", timm_convnext, size),
    ]


# ---------------------------------------------------------------- transformers


def transformer_models():
    """(name, family, builder, inputs kind) for the transformer architectures, small configurations."""
    import transformers as T

    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                  max_position_embeddings=POSITIONS)

    def text(model_cls, config):
        return lambda: model_cls(config)

    vision_cfg = dict(image_size=32, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2,
                      num_attention_heads=2, intermediate_size=64)
    return [
        ("bert", "BERT", text(T.BertModel, T.BertConfig(**common)), "text+type"),
        ("distilbert", "DistilBERT",
         text(T.DistilBertModel, T.DistilBertConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2, hidden_dim=64,
                                                    max_position_embeddings=POSITIONS)), "text"),
        ("roberta", "RoBERTa", text(T.RobertaModel, T.RobertaConfig(**{**common, "max_position_embeddings": POSITIONS + 2})),
         "text"),
        ("albert", "ALBERT", text(T.AlbertModel, T.AlbertConfig(**common, embedding_size=16)), "text+type"),
        ("electra", "ELECTRA", text(T.ElectraModel, T.ElectraConfig(**common, embedding_size=16)), "text+type"),
        ("gpt2", "GPT-2", text(T.GPT2Model, T.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2,
                                                            n_positions=POSITIONS)), "text"),
        ("t5_encoder", "T5 encoder",
         text(T.T5EncoderModel, T.T5Config(vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2)),
         "text"),
        ("clip_text", "CLIP text",
         text(T.CLIPTextModel, T.CLIPTextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=2, num_attention_heads=2,
                                                max_position_embeddings=POSITIONS, projection_dim=16)), "text"),
        ("vit_hf", "ViT (HF)", text(T.ViTModel, T.ViTConfig(**vision_cfg)), "image"),
        ("deit", "DeiT", text(T.DeiTModel, T.DeiTConfig(**vision_cfg)), "image"),
        ("clip_vision", "CLIP vision", text(T.CLIPVisionModel, T.CLIPVisionConfig(**vision_cfg, projection_dim=16)),
         "image"),
    ]


# ---------------------------------------------------------------- export and reference


def wrap(model, names):
    """A module whose forward takes the inputs positionally and returns a tuple of tensors."""
    torch = _torch()

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, *args):
            out = self.inner(**dict(zip(names, args)), return_dict=False)
            return tuple(o for o in out if isinstance(o, torch.Tensor))

    return Wrapped().eval()


def cases_for(kind, image_size):
    """Two input sets per model (different batch, and sequence length for text), as numpy arrays."""
    rng = np.random.default_rng(SEED)
    out = []
    for batch, seq in ((1, 16), (2, 24)):
        if kind == "vision" or kind == "image":
            size = image_size if kind == "vision" else 32
            out.append(({"pixel_values" if kind == "image" else "input": rng.standard_normal((batch, 3, size, size)).astype(np.float32)},
                        batch, None))
            continue
        ids = rng.integers(1, VOCAB, size=(batch, seq), dtype=np.int64)
        mask = np.ones((batch, seq), dtype=np.int64)
        if batch > 1:
            mask[1, seq - 5:] = 0  # a padded row: the masked-softmax path exporters guard
        feeds = {"input_ids": ids, "attention_mask": mask}
        if kind == "text+type":
            types = np.zeros((batch, seq), dtype=np.int64)
            types[:, seq // 2:] = 1
            feeds["token_type_ids"] = types
        out.append((feeds, batch, seq))
    return out


def dynamic_axes_for(names, kind, outputs):
    axes = {}
    for n in names:
        axes[n] = {0: "batch"} if kind in ("vision", "image") else {0: "batch", 1: "sequence"}
    for o in outputs:
        axes[o] = {0: "batch"}
    return axes


def export(model, example, path, exporter, opset, names, outputs, kind):
    torch = _torch()
    args = tuple(torch.from_numpy(example[n]) for n in names)
    axes = dynamic_axes_for(names, kind, outputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "ts":
            torch.onnx.export(model, args, path, dynamo=False, opset_version=opset, input_names=names,
                              output_names=outputs, dynamic_axes=axes)
        else:
            # torch.export's own dynamic shapes (it cannot convert `dynamic_axes` for every model).
            dyn = torch.export.Dim.DYNAMIC
            shapes = tuple({d: dyn for d in axes[n]} for n in names)
            if kind != "vision":
                shapes = (shapes,)  # the wrapper takes its inputs as one `*args` tuple
            torch.onnx.export(model, args, path, dynamo=True, opset_version=opset, input_names=names,
                              output_names=outputs, dynamic_shapes=shapes, external_data=False, verbose=False)


def error_summary(e):
    """One line for the manifest: the exporter's own summary when it gives one."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if "## Exception summary" in text:
        after = text.split("## Exception summary", 1)[1].strip().splitlines()
        lines = [ln for ln in after if ln.strip()] or lines
    return f"{type(e).__name__}: {(lines[0] if lines else '')[:400]}"


def newest_opsets():
    from torch.onnx import _constants as c

    return {"ts": c.ONNX_TORCHSCRIPT_EXPORTER_MAX_OPSET, "dy": c.ONNX_MAX_OPSET}


def torch_latency(out, path, reps=50):
    """PyTorch's own batch-1 time for each model of the corpus (the module each TorchScript export
    came from, same seed), fp16 on the GPU: eager, and one captured CUDA graph replayed (medians)."""
    torch = _torch()
    # The zoo peer's timing (scripts/pytorch_peer.py, beside this script): the same method in every table.
    from pytorch_peer import eager_and_graph

    m = json.load(open(os.path.join(out, "manifest.json")))
    builders = {}
    for name, _, _, build, size in vision_models(m["tier"]):
        builders[name] = (build, "vision", size)
    for name, _, build, kind in transformer_models():
        builders[name] = (build, kind, None)
    rows = []
    dev = torch.device("cuda")
    for e in m["entries"]:
        if e["exporter"] != "torchscript" or e["status"] != "ok" or e["arch"] not in builders:
            continue
        build, kind, _ = builders[e["arch"]]
        row = {"model": os.path.join(out, e["file"]), "batch": 1}
        try:
            base = randomize(build(), SEED + zlib.crc32(e["arch"].encode()))
            names = e["inputs"]
            model = (base if kind == "vision" else wrap(base, names)).to(dev).half().eval()
            feeds = [np.load(os.path.join(out, f)) for f in e["cases"][0]["inputs"]]
            args = [torch.from_numpy(x).to(dev) for x in feeds]
            args = [x.half() if x.is_floating_point() else x for x in args]
            eager, _, graph, _ = eager_and_graph(model, args, reps)
            row["eager_ms"], row["graph_ms"] = eager, graph
        except Exception as ex:  # kept as data: the row says why it has no time
            row["error"] = error_summary(ex)
        rows.append(row)
        print(f"{e['arch']}: eager {row.get('eager_ms', float('nan')):.3f} ms, graph {row.get('graph_ms', float('nan')):.3f} ms",
              flush=True)
    with open(path, "w") as fh:
        json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name(0), "dtype": "f16", "rows": rows}, fh,
                  indent=1)


def merge(out, parts):
    """One manifest over several corpus folders (each a subfolder of `out`), file names made
    relative to `out`."""
    merged = None
    for part in parts:
        sub = os.path.relpath(part, out)
        if not os.path.exists(os.path.join(part, "manifest.json")):
            # A shard that no architecture fell to (fewer models than shards) writes nothing.
            print(f"merge: {part} has no manifest (no architecture in that shard), skipped")
            continue
        m = json.load(open(os.path.join(part, "manifest.json")))
        for e in m["entries"]:
            e["file"] = os.path.join(sub, e["file"])
            for c in e["cases"]:
                c["inputs"] = [os.path.join(sub, f) for f in c["inputs"]]
                c["outputs"] = [os.path.join(sub, f) for f in c["outputs"]]
        if merged is None:
            merged = m
        else:
            merged["entries"].extend(m["entries"])
    if merged is None:
        sys.exit(f"merge: none of the {len(parts)} folders has a manifest")
    with open(os.path.join(out, "manifest.json"), "w") as fh:
        json.dump(merged, fh, indent=1)
    print(f"merged {len(parts)} folders: {len(merged['entries'])} exports in {out}/manifest.json")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tier", choices=["tiny", "full"], default="tiny")
    ap.add_argument("--exporters", default="ts,dy", help="ts (TorchScript, dynamo=False) and/or dy (dynamo=True)")
    ap.add_argument("--opsets", default="17,18", help="comma list; 'newest' = the exporter's newest opset")
    ap.add_argument("--only", default=None, help="regular expression on architecture names")
    ap.add_argument("--skip-vision", action="store_true")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--shard", default=None, help="K/N: only every N-th architecture from the K-th (parallel runs)")
    ap.add_argument("--latency", default=None,
                    help="write PyTorch's batch-1 latency (fp16 on CUDA, eager and CUDA graph) of each TorchScript "
                         "export's module in --out's manifest to this JSON (the rows `kairos bench latency --peer` reads)")
    ap.add_argument("--merge", nargs="+", default=None,
                    help="merge these corpus folders (subfolders of --out) into one manifest in --out")
    a = ap.parse_args()

    if a.merge:
        merge(a.out, a.merge)
        return
    if a.latency:
        torch_latency(a.out, a.latency)
        return
    torch = _torch()
    import onnx
    import onnxruntime as ort

    torch.manual_seed(SEED)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    os.makedirs(a.out, exist_ok=True)
    newest = newest_opsets()
    exporters = [e for e in a.exporters.split(",") if e]
    for e in exporters:
        if e not in ("ts", "dy"):
            sys.exit(f"unknown exporter '{e}': use ts or dy")

    jobs = []
    if not a.skip_vision:
        for name, family, source, build, size in vision_models(a.tier):
            jobs.append((name, family, source, build, "vision", size))
    if not a.skip_transformers:
        for name, family, build, kind in transformer_models():
            jobs.append((name, family, "transformers", build, kind, None))
    if a.only:
        jobs = [j for j in jobs if re.search(a.only, j[0])]
    if a.shard:
        k, n = (int(x) for x in a.shard.split("/"))
        jobs = jobs[k::n]

    versions = {"torch": torch.__version__, "onnx": onnx.__version__, "onnxruntime": ort.__version__}
    for mod in ("torchvision", "timm", "transformers", "onnxscript"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:
            versions[mod] = None
    manifest_path = os.path.join(a.out, "manifest.json")
    entries = []
    started = time.time()
    for k, (name, family, source, build, kind, size) in enumerate(jobs):
        t0 = time.time()
        # Each architecture's weights from its own name: the same whatever --only or --shard picks.
        base = randomize(build(), SEED + zlib.crc32(name.encode()))
        cases = cases_for(kind, size)
        names = list(cases[0][0].keys())
        model = base if kind == "vision" else wrap(base, names)
        with torch.no_grad():
            n_out = len(model(*[torch.from_numpy(cases[0][0][n]) for n in names])) if kind != "vision" else 1
        outputs = [f"output{j}" for j in range(n_out)]
        case_files = []
        for c, (feeds, batch, seq) in enumerate(cases):
            files = []
            for i, n in enumerate(names):
                f = f"{name}.case{c}.in{i}.npy"
                np.save(os.path.join(a.out, f), feeds[n])
                files.append(f)
            case_files.append((files, batch, seq))
        for exporter in exporters:
            for o in a.opsets.split(","):
                opset = newest[exporter] if o == "newest" else int(o)
                stem = f"{name}.{exporter}{opset}"
                if any(e["file"] == stem + ".onnx" for e in entries):
                    continue
                entry = {"arch": name, "family": family, "source": source, "tier": a.tier, "exporter":
                         {"ts": "torchscript", "dy": "dynamo"}[exporter], "opset": opset, "file": stem + ".onnx",
                         "inputs": names, "outputs": outputs, "cases": []}
                path = os.path.join(a.out, stem + ".onnx")
                te = time.time()
                try:
                    # The second case (batch 2): torch.export would fix an axis of size 1 as a constant.
                    export(model, cases[1][0], path, exporter, opset, names, outputs, kind)
                    m = onnx.load(path)
                    entry["ops"] = sorted({n.op_type for n in m.graph.node})
                    entry["opset_written"] = max(o.version for o in m.opset_import if o.domain in ("", "ai.onnx"))
                    entry["bytes"] = os.path.getsize(path)
                    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
                    in_names = [i.name for i in sess.get_inputs()]
                    for c, (feeds, batch, seq) in enumerate(cases):
                        # The dynamo exporter drops inputs the graph does not use; feed what the file declares.
                        feed = {n: feeds[n] for n in in_names}
                        res = sess.run(None, feed)
                        outs = []
                        for j, r in enumerate(res):
                            f = f"{stem}.case{c}.out{j}.npy"
                            np.save(os.path.join(a.out, f), np.asarray(r, dtype=np.float32))
                            outs.append(f)
                        files, _, _ = case_files[c]
                        entry["cases"].append({"batch": batch, "seq_len": seq,
                                               "inputs": [files[names.index(n)] for n in in_names], "outputs": outs})
                    entry["status"] = "ok"
                except Exception as e:  # the exporter's (or onnxruntime's) own failure, kept as data
                    entry["status"] = "export-failed"
                    entry["error"] = error_summary(e)
                    if os.environ.get("CORPUS_TRACEBACK"):
                        traceback.print_exc()
                entry["export_s"] = round(time.time() - te, 2)
                entries.append(entry)
                print(f"[{len(entries)}] {stem}: {entry['status']} in {entry['export_s']:.1f} s"
                      + (f" ({entry['error']})" if entry["status"] != "ok" else f", {entry['bytes'] / 1e6:.2f} MB"),
                      flush=True)
                with open(manifest_path, "w") as fh:
                    json.dump({"seed": SEED, "tier": a.tier, "versions": versions, "entries": entries}, fh, indent=1)
        print(f"  {name}: {time.time() - t0:.1f} s ({time.time() - started:.0f} s in all)", flush=True)
    ok = sum(e["status"] == "ok" for e in entries)
    print(f"{ok} of {len(entries)} exports written to {a.out} in {time.time() - started:.0f} s; manifest {manifest_path}")


if __name__ == "__main__":
    main()
