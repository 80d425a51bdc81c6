#!/usr/bin/env python3
"""How many SMs REEF's padding could give best-effort work beside a real-time model, from its profile.

    python3 scripts/padding_room.py [data/profiles/h200] [--models vgg19,resnet152,...] [--window-us 300]

REEF pads each real-time kernel with best-effort blocks on the compute units it leaves idle (OSDI'22,
section 5). How much room that leaves depends on how long a padding decision holds. For each model's
profile (`kairos profile`: per kernel `duration_ns` on the whole GPU and `duration_by_sms`, its time
on the first n SMs) this prints, time-weighted over the model's kernels, the SMs left to padding when
every real-time kernel keeps its speed within a tolerance (0%, 1%, 2%, 5%: its *right size* is the
fewest SMs within that), rounded up to groups of 8 SMs (the occupancy map's and green contexts' unit):

- per kernel: the reservation follows each real-time kernel (REEF's dynamic kernel padding, which fuses
  best-effort blocks into the real-time kernel's launch);
- per window: one reservation for the widest kernel starting within the next `--window-us` of the
  model's kernel time (what a padding launch that lives that long can count on);
- per job: the widest of all kernels left (kairos' `reef` reserves by the job's widest launch).

The hardware spreads a grid one CTA per SM first, so without a mask a real-time kernel touches nearly
every SM whatever its right size ("spread" below is the SMs its default grid covers, time-weighted).
"""
import argparse
import glob
import json
import math
import os

GROUP_SMS = 8
DISB = ["vgg19", "resnet152", "densenet201", "inception_v3", "distilbert"]


def right_size(kernel, tol, sm_count):
    """Fewest SMs at which the kernel runs within `tol` of its whole-GPU time."""
    full = kernel["duration_ns"]
    for sms, ns in sorted(kernel.get("duration_by_sms") or []):
        if ns <= full * (1 + tol):
            return min(sms, sm_count)
    return sm_count


def free_sms(reserved, sm_count):
    """SMs above a reservation rounded up to whole groups."""
    return max(0, sm_count - math.ceil(reserved / GROUP_SMS) * GROUP_SMS) if reserved < sm_count else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profiles", nargs="?", default="data/profiles/h200")
    ap.add_argument("--models", default=",".join(DISB))
    ap.add_argument("--window-us", type=float, default=300.0)
    ap.add_argument("--sm-count", type=int, default=132)
    a = ap.parse_args()
    n = a.sm_count
    print(f"SMs left to padding, time-weighted over each model's kernels, of {n} ({a.profiles}; window {a.window_us:.0f} us)")
    print(f"{'model':<14} {'kernels':>7} {'time us':>8} {'spread':>6} {'tolerance':>9} {'per kernel':>10} {'per window':>10} {'per job':>8}")
    for m in a.models.split(","):
        files = sorted(glob.glob(os.path.join(a.profiles, f"{m}-*b1.json")))
        if not files:
            print(f"{m:<14} no profile in {a.profiles}")
            continue
        ks = json.load(open(files[0]))["kernels"]
        total = sum(k["duration_ns"] for k in ks)
        weighted = lambda xs: sum(x * k["duration_ns"] for x, k in zip(xs, ks)) / total
        spread = weighted([min(n, k["ctas"], k["logical_blocks"]) for k in ks])
        for tol in (0.0, 0.01, 0.02, 0.05):
            r = [right_size(k, tol, n) for k in ks]
            window = []
            for i in range(len(ks)):
                t, widest, j = 0.0, 0, i
                while j < len(ks) and t < a.window_us * 1e3:
                    widest, t, j = max(widest, r[j]), t + ks[j]["duration_ns"], j + 1
                window.append(widest)
            rest = [max(r[i:]) for i in range(len(r))]
            print(f"{m:<14} {len(ks):>7} {total / 1e3:>8.0f} {spread:>6.0f} {tol:>8.0%} "
                  f"{weighted([free_sms(x, n) for x in r]):>10.1f} {weighted([free_sms(x, n) for x in window]):>10.1f} "
                  f"{weighted([free_sms(x, n) for x in rest]):>8.1f}")


if __name__ == "__main__":
    main()
