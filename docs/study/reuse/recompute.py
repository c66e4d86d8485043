#!/usr/bin/env python3
"""Recompute the reuse study's summary numbers from its committed artefacts (issue 54).

Run from the repository root (Python 3 standard library only, no build):

    python3 docs/study/reuse/recompute.py

It reads only committed files: the 90 finished runs in
docs/study/reuse/results/finished/<arm>-w<W>-s<S>.json.gz, the study's
pre-run Gate 0 measurements in results/finished/before-runs/gate0-w<W>.json.gz
and results/results.md. It prints:

  1. final fresh-sample entropy f - b (BAPO paper mode minus PPO [0.8, 1.2]),
     paired over the 9 (warm start, seed) pairs: mean, sd, t, p and the
     95% t interval (df 8); the same for final entropy b - a and test
     accuracy f - b (with its one-sided non-inferiority test, margin 0.01);
  2. the cluster-level test: the mean difference per warm start (3
     clusters of 3 seeds), then mean, sd, t, p and 95% t interval on n = 3
     (df 2);
  3. per BAPO arm (f, g, h), over all updates: the share whose mini-batch
     had no gradient (grad_norm 0 and pos_fraction 1: every advantage 0),
     met the target at the start bounds with a gradient, met it after the
     bounds moved, and ran to the search's limit without meeting it; for
     arm g, whose search runs per micro-batch of 8 sequences (two per
     update) and whose row holds token-weighted means over the two, what
     those means allow to infer about the mixture;
  4. the study's own Gate 0 re-measure (before-runs/) against the band
     [0.33, 0.42], and the Gate 0 line results.md printed.

The final entropy is the last probe's entropy (batch 200), as
src/local/controlled/analysis.rs reads it.
"""

import gzip
import json
import math
import os
import re

ROOT = os.path.dirname(os.path.abspath(__file__))
FIN = os.path.join(ROOT, "results", "finished")
WARMS, SEEDS = (0, 1, 2), (0, 1, 2)
BAND = (0.33, 0.42)


def load(arm, w, s):
    with gzip.open(os.path.join(FIN, f"{arm}-w{w}-s{s}.json.gz")) as f:
        return json.load(f)["run"]


# ---- Student's t without scipy -------------------------------------------

def _betacf(a, b, x):
    """Continued fraction of the incomplete beta (Numerical Recipes)."""
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > 1e-300 else 1e-300)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > 1e-300 else 1e-300)
        c = 1.0 + aa / c
        c = c if abs(c) > 1e-300 else 1e-300
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > 1e-300 else 1e-300)
        c = 1.0 + aa / c
        c = c if abs(c) > 1e-300 else 1e-300
        de = d * c
        h *= de
        if abs(de - 1.0) < 1e-15:
            break
    return h


def _ibeta(a, b, x):
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    lbt = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log(1 - x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(lbt) * _betacf(a, b, x) / a
    return 1.0 - math.exp(lbt) * _betacf(b, a, 1.0 - x) / b


def t_two_sided_p(t, df):
    return _ibeta(df / 2.0, 0.5, df / (df + t * t))


def t_quantile(q, df):
    """The q-quantile (q > 0.5) of Student's t, by bisection."""
    lo, hi = 0.0, 1000.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if 1.0 - t_two_sided_p(mid, df) / 2.0 < q:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def one_sample(xs):
    n = len(xs)
    m = sum(xs) / n
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    se = sd / math.sqrt(n)
    t = m / se if se > 0 else float("inf")
    q = t_quantile(0.975, n - 1)
    return dict(n=n, mean=m, sd=sd, t=t, p=t_two_sided_p(t, n - 1), lo=m - q * se, hi=m + q * se, q=q)


def show(label, r, digits=4):
    f = f"{{:+.{digits}f}}"
    print(
        f"  {label}: mean {f.format(r['mean'])}, sd {r['sd']:.{digits}f}, n {r['n']}, "
        f"t = {r['t']:.2f}, p = {r['p']:.4f}, 95% CI [{f.format(r['lo'])}, {f.format(r['hi'])}] "
        f"(t_0.975,{r['n'] - 1} = {r['q']:.3f})"
    )


# ---- 1 and 2: paired and cluster-level tests ------------------------------

def final_entropy(run):
    return run["probes"][-1]["entropy"]


def test_accuracy(run):
    return run["test_accuracy"]


def contrast(x, y, endpoint):
    """{(w, s): endpoint(x) - endpoint(y)} over the 9 pairs."""
    return {(w, s): endpoint(load(x, w, s)) - endpoint(load(y, w, s)) for w in WARMS for s in SEEDS}


def non_inferior(r, margin):
    """One-sided p of H0: mean <= -margin (the lower test of a TOST)."""
    t = (r["mean"] + margin) / (r["sd"] / math.sqrt(r["n"]))
    p = t_two_sided_p(t, r["n"] - 1) / 2 if t > 0 else 1 - t_two_sided_p(t, r["n"] - 1) / 2
    print(f"    non-inferiority at margin {margin}: t = {t:.2f}, one-sided p = {p:.4f}")


def tests(title, d, digits=4, margin=None):
    print(title)
    for w in WARMS:
        print(f"    warm start {w}: " + ", ".join(f"seed {s} {d[(w, s)]:+.{digits}f}" for s in SEEDS))
    r = one_sample([d[k] for k in sorted(d)])
    show("paired, n = 9 (warm start x seed)", r, digits)
    if margin:
        non_inferior(r, margin)
    means = [sum(d[(w, s)] for s in SEEDS) / len(SEEDS) for w in WARMS]
    print("    means per warm start: " + ", ".join(f"w{w} {m:+.{digits}f}" for w, m in zip(WARMS, means)))
    r = one_sample(means)
    show("cluster-level, n = 3 (means per warm start)", r, digits)
    if margin:
        non_inferior(r, margin)


# ---- 3: what BAPO's search did, update by update --------------------------

def regimes(arm):
    rows = [st for w in WARMS for s in SEEDS for st in load(arm, w, s)["steps"]]
    n = len(rows)
    empty = [st for st in rows if st["grad_norm"] == 0.0]
    pf1 = [st for st in rows if st["pos_fraction"] == 1.0]
    rest = [st for st in rows if st["grad_norm"] != 0.0]
    start = [st for st in rest if st["search_steps"] == 0 and st["target_met"] == 1.0]
    moved = [st for st in rest if st["search_steps"] > 0 and st["target_met"] == 1.0]
    exhausted = [st for st in rest if st["target_met"] == 0.0]
    mixed = [st for st in rest if 0.0 < st["target_met"] < 1.0]
    pct = lambda k: f"{len(k):5d} ({100 * len(k) / n:5.1f}%)"
    print(f"arm {arm}: {n} updates")
    print(f"  no gradient (grad_norm 0; pos_fraction 1 on {len(pf1)}, same rows: "
          f"{set(map(id, pf1)) == set(map(id, empty))}), counted 'start, target met' by the report: {pct(empty)}")
    print(f"  with a gradient, target met at the start bounds (search not needed): {pct(start)}")
    print(f"  with a gradient, bounds moved and target met inside the range:        {pct(moved)}")
    print(f"  with a gradient, ran to the limit without meeting the target:         {pct(exhausted)}")
    if mixed:
        print(f"  target_met strictly between 0 and 1 (a token-weighted mean of micro-batches): {pct(mixed)}")
    searched = [st for st in rows if st["search_steps"] > 0]
    print(f"  report's regimes: start {100 * (n - len(searched)) / n:.1f}% (search_steps 0, empty included), "
          f"moved {100 * sum(1 for st in rows if st['search_steps'] > 0 and st['target_met'] > 0) / n:.1f}%, "
          f"exhausted {100 * sum(1 for st in rows if st['target_met'] == 0) / n:.1f}%; "
          f"Gate 1's 'start window missed' (search_steps > 0) {100 * len(searched) / n:.1f}%")
    with_grad = n - len(empty)
    if not mixed:
        print(f"  of the {with_grad} updates with a gradient: searched {100 * len(searched) / with_grad:.1f}%, "
              f"ran to the limit {100 * len(exhausted) / with_grad:.1f}%, "
              f"met inside the range {100 * len(moved) / with_grad:.1f}%")
    else:
        print("  (rows are token-weighted means over micro-batches: 'met at the start', 'moved and met' and "
              "'ran to the limit' above hold for every micro-batch of the update; see the mixtures below)")
    return rows, (empty, start, moved, exhausted, mixed)


def g_mixtures(parts, limit_steps=51):
    """Arm g: each update's mini-batch is 16 sequences, cut in order into two
    micro-batches of 8 (one group each); a fractional target_met means one
    micro-batch met the target and one did not (paper mode: an unmet search
    ran all 51 steps to (0.9, 3.0)). With the met one's token weight
    w = target_met, its own step count is (search_steps - (1 - w) * 51) / w."""
    empty, start, moved_rows, exhausted, mixed = parts
    k_met = [(st["search_steps"] - (1 - st["target_met"]) * limit_steps) / st["target_met"] for st in mixed]
    at_start = sum(1 for k in k_met if abs(k) < 1e-6)
    moved = sum(1 for k in k_met if k > 1e-6)
    odd = len(k_met) - at_start - moved
    print(f"  arm g, the {len(mixed)} mixed updates read as two micro-batches: one ran to the limit and "
          f"the other stayed at its start bounds (empty, or met there) on {at_start}, "
          f"the other moved and met on {moved}, inconsistent with that reading on {odd}")
    n_micro = 2 * (len(empty) + len(start) + len(moved_rows) + len(exhausted) + len(mixed))
    limit = 2 * len(exhausted) + len(mixed)
    inside_lo, inside_hi = moved + len(moved_rows), moved + 2 * len(moved_rows)
    print(f"  arm g by micro-batch ({n_micro}): ran to the limit {limit} ({100 * limit / n_micro:.1f}%), "
          f"moved and met inside the range {inside_lo}-{inside_hi} "
          f"({100 * inside_lo / n_micro:.1f}-{100 * inside_hi / n_micro:.1f}%), "
          f"at the start bounds (empty or met there) the rest "
          f"({100 * (n_micro - limit - inside_hi) / n_micro:.1f}-{100 * (n_micro - limit - inside_lo) / n_micro:.1f}%); "
          f"empty micro-batches are not separable from the means in mixed updates")
    print(f"  the report's 'moved' share for g, {100 * (len(moved_rows) + len(mixed)) / (n_micro // 2):.1f}%, is "
          f"{len(moved_rows) + len(mixed)} updates, of which {100 * at_start / (len(moved_rows) + len(mixed)):.1f}% are ones where one micro-batch ran to the limit "
          f"and the other never left its start bounds")


# ---- 4: Gate 0 as the study re-measured it ---------------------------------

def gate0():
    print(f"Gate 0 re-measure before the runs (results/finished/before-runs/), band {list(BAND)}:")
    for w in WARMS:
        with gzip.open(os.path.join(FIN, "before-runs", f"gate0-w{w}.json.gz")) as f:
            g = json.load(f)["run"]
        share = g["positive_share"]
        inside = BAND[0] <= share <= BAND[1]
        print(f"  warm start {w}: share {share:.4f} over {g['groups']} groups "
              f"({g['informative_groups']} informative): {'in' if inside else 'OUTSIDE'} the band; "
              f"mini-batches under rho0 {100 * g['minibatch_below_rho0']:.1f}%")
    with open(os.path.join(ROOT, "results", "results.md")) as f:
        line = next(l for l in f if l.startswith("- Gate 0"))
    print("  results.md prints: " + line.strip())


def main():
    print("== 1-2. Final fresh-sample entropy (nats), f (BAPO paper mode) - b (PPO [0.8, 1.2]) ==")
    tests("final entropy f - b:", contrast("f", "b", final_entropy))
    print()
    tests("final entropy b - a (the positive control):", contrast("b", "a", final_entropy))
    print()
    tests("test accuracy f - b (non-inferiority margin 0.01):", contrast("f", "b", test_accuracy), margin=0.01)
    print()
    print("== 3. BAPO's bound search, update by update ==")
    for arm in ("f", "h"):
        regimes(arm)
        print()
    _, parts = regimes("g")
    g_mixtures(parts)
    print()
    print("== 4. Gate 0 ==")
    gate0()


if __name__ == "__main__":
    main()
