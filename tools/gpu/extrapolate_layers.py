#!/usr/bin/env python3
"""Layer truncations of a model, and the full-depth projection of their measured costs (tools/gpu/spec_layers.sh).

  extrapolate_layers.py --truncate CONFIG_JSON N   rewrite a config.json (or its text_config) to its first N layers
  extrapolate_layers.py --config DIR LOG...        fit the costs in bench-engine logs named layers_<N>[_plain].txt

Each cost c(N) measured at two or more depths N is fitted as a + b * N (least squares): b is the per-layer cost,
a what does not grow with depth (embedding, lm_head, the MTP head, launch and host overheads). The full depth is the
config's num_hidden_layers. The plain decode step comes from the runs without --spec-sweep (layers_<N>_plain.txt:
no MTP head loaded, the step that `--speculative-algorithm none` runs); the speculative costs from the runs with it.
Everything printed for the full depth is a PROJECTION from the truncated runs, not a measurement.
"""
import json
import re
import sys

PUBLISHED_ACCEPT = {1: 1.93, 2: 2.73, 3: 3.39, 4: 3.97}  # the model card's accept lengths at K = 1..4

PLAIN = re.compile(r"^batch (\d+):.*decode \d+ steps, step median ([0-9.]+) ms")
DRAFT = re.compile(r"^\s*spec K=(\d+) batch (\d+): draft ([0-9.]+) ms")
CHECKPOINT = re.compile(r"^\s*spec K=(\d+) batch (\d+), position checkpoints: verify ([0-9.]+) ms, settle "
                        r"\(keep_verified\) (-?[0-9.]+) ms")


def text_config(c):
    return c.get("text_config", c)


def truncate(path, n):
    c = json.load(open(path))
    t = text_config(c)
    full = t["num_hidden_layers"]
    if not 1 <= n <= full:
        sys.exit(f"--truncate: {n} layers outside 1..{full}")
    t["num_hidden_layers"] = n
    if "layer_types" in t:
        t["layer_types"] = t["layer_types"][:n]
    json.dump(c, open(path, "w"), indent=1)


def fit(points):
    """Least-squares a + b * n over [(n, cost)]."""
    n = len(points)
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    sxx = sum((p[0] - mx) ** 2 for p in points)
    b = sum((p[0] - mx) * (p[1] - my) for p in points) / sxx
    return my - b * mx, b


def main(argv):
    if len(argv) == 3 and argv[0] == "--truncate":
        truncate(argv[1], int(argv[2]))
        return
    if len(argv) < 3 or argv[0] != "--config":
        sys.exit(__doc__)
    full = text_config(json.load(open(argv[1] + "/config.json")))["num_hidden_layers"]
    costs = {}  # (name, batch, k) -> [(layers, ms)]
    for path in argv[2:]:
        m = re.search(r"layers_(\d+)(_plain)?\.txt$", path)
        if not m:
            continue
        layers, plain_run = int(m.group(1)), bool(m.group(2))
        for line in open(path, errors="replace"):
            if (p := PLAIN.match(line)):
                key = ("plain" if plain_run else "plain+head", int(p.group(1)), 0)
                costs.setdefault(key, []).append((layers, float(p.group(2))))
            elif (d := DRAFT.match(line)) and not plain_run:
                costs.setdefault(("draft", int(d.group(2)), int(d.group(1))), []).append((layers, float(d.group(3))))
            elif (v := CHECKPOINT.match(line)) and not plain_run:
                k, b = int(v.group(1)), int(v.group(2))
                costs.setdefault(("verify", b, k), []).append((layers, float(v.group(3))))
                costs.setdefault(("settle", b, k), []).append((layers, float(v.group(4))))
    print(f"Fits c(N) = a + b N over the truncations; PROJECTION at the full depth N = {full}:")
    at_full = {}
    for key in sorted(costs):
        pts = costs[key]
        if len({p[0] for p in pts}) < 2:
            print(f"  {key}: one depth only ({pts}); no fit")
            continue
        a, b = fit(pts)
        at_full[key] = a + b * full
        name, batch, k = key
        what = f"{name}" + (f" K={k}" if k else "")
        meas = ", ".join(f"{n} layers {c:.3f} ms" for n, c in sorted(pts))
        print(f"  batch {batch} {what:16s} measured {meas} | per layer {b * 1e3:7.1f} us, fixed {a:.3f} ms | "
              f"PROJECTED at {full} layers: {at_full[key]:.3f} ms")
    for (name, batch, k), verify in sorted(at_full.items()):
        if name != "verify":
            continue
        plain = at_full.get(("plain", batch, 0))
        draft = at_full.get(("draft", batch, k))
        settle = max(0.0, at_full.get(("settle", batch, k), 0.0))  # sub-0.1 ms, timed as a difference: noisy
        if plain is None or draft is None:
            continue
        acc = PUBLISHED_ACCEPT.get(k)
        if acc is None:
            continue
        cycle = draft + verify + settle
        speedup = acc * plain / cycle
        print(f"PROJECTION batch {batch} K={k}: plain step {plain:.3f} ms (no head), draft chain {draft:.3f} + verify "
              f"{verify:.3f} + settle {settle:.3f} = {cycle:.3f} ms per cycle; at the published accept length {acc}: "
              f"{speedup:.2f}x the plain step ({1e3 * batch * acc / cycle:.1f} tok/s for the rank's share of the step, "
              f"all-reduces not included)")


if __name__ == "__main__":
    main(sys.argv[1:])
