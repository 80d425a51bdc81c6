#!/usr/bin/env python3
"""A model's profile from another model's measured one, where every launch of the first is a kernel the
second's profile measured: the same kernel with the same parameters, dtype and launch shape (what the
simulator's timing table keys a kernel on). For a model whose own profile is stale and no GPU is at hand, e.g.
distilbert, whose 58 launches are all among bert_base's 112 (same encoder layer, six of them).

    kairos inspect distilbert --dtype f16 --json /tmp/target.json
    kairos inspect bert_base --dtype f16 --json /tmp/source.json
    scripts/profile_from_identical_kernels.py /tmp/target.json /tmp/source.json \
        data/profiles/h200/bert_base-f16-b1.json -o data/profiles/h200/distilbert-f16-b1.json

Each launch takes the first identical launch's measurements (duration, duration by SM count, right size,
resources); the plan latency is the kernels' sum plus the source's per-launch overhead (its latency less its
kernels' sum, per launch) times the target's launch count. Refuses when a launch has no identical kernel, or
when the source profile does not match the source plan (launch names and block counts).
"""
import argparse
import json
import sys


def key(launch):
    return json.dumps([launch["kernel"], launch["dtype"], launch["shape"]], sort_keys=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("target_plan", help="`kairos inspect TARGET --json` output")
    ap.add_argument("source_plan", help="`kairos inspect SOURCE --json` output (the plan SOURCE_PROFILE measured)")
    ap.add_argument("source_profile", help="a `kairos profile` JSON of SOURCE")
    ap.add_argument("-o", "--output", required=True)
    a = ap.parse_args()
    target, source = json.load(open(a.target_plan)), json.load(open(a.source_plan))
    prof = json.load(open(a.source_profile))
    ks, ls = prof["kernels"], source["launches"]
    if len(ks) != len(ls) or any(
        k["name"] != l["name"] or k["logical_blocks"] != l["shape"]["logical_blocks"] for k, l in zip(ks, ls)
    ):
        sys.exit(f"{a.source_profile} was not measured on {a.source_plan}'s launches")
    first = {}
    for i, l in enumerate(ls):
        first.setdefault(key(l), i)
    kernels, missing = [], []
    for i, l in enumerate(target["launches"]):
        j = first.get(key(l))
        if j is None:
            missing.append(l["name"])
            continue
        k = dict(ks[j], launch=i, name=l["name"])
        kernels.append(k)
    if missing:
        sys.exit(f"{len(missing)} launches have no identical kernel in {a.source_plan}: {missing[:5]}")
    overhead = (prof["latency_ns"] - sum(k["duration_ns"] for k in ks)) / len(ks)
    batch = target["inputs"][0]["shape"][0] if target["inputs"] else 1
    out = {
        "model": target["model"],
        "dtype": target["dtype"],
        "batch": batch,
        "device": prof["device"],
        "sm_count": prof["sm_count"],
        "latency_ns": int(sum(k["duration_ns"] for k in kernels) + overhead * len(kernels)),
        "kernels": kernels,
    }
    json.dump(out, open(a.output, "w"), indent=2)
    print(f"{a.output}: {len(kernels)} launches from {prof['model']}'s profile, latency {out['latency_ns'] / 1e6:.3f} ms")


if __name__ == "__main__":
    main()
