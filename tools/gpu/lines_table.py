#!/usr/bin/env python3
"""The `lines` runs of tools/gpu/spec_prefill_h200.sh ($OUT/lines.txt) as one markdown table: each run's label, its
prefill rate and decode step, and, where the run printed a profile (--profile), the per-call times of the routed
experts' stages (the rows starting with " . ": gate/up, down, grouping, combine, x to bf16).
  tools/gpu/lines_table.py lines.txt [more logs...]"""
import re
import sys

STAGES = ('gate_up wgmma', 'down wgmma walk', 'down wgmma', 'group', 'combine', 'x to bf16')


def runs(text):
    """(label, prefill tok/s, step ms, {stage: us per call}) of every run, in order."""
    out = []
    for block in re.split(r'^== ', text, flags=re.M)[1:]:
        label = block.split('\n', 1)[0].split(': kiln bench-engine')[0].strip()
        m = re.search(r'prefill \d+ tokens in [\d.]+ ms: ([\d.]+) tok/s \| decode \d+ steps, step median ([\d.]+) ms',
                      block)
        stages = {}
        section = None  # the profile being read: bench-engine prints the decode step's, then the prefill pass's
        for line in block.split('\n'):
            if line.startswith('  per-op time of one '):
                section = 'prefill' if 'prefill pass' in line else 'other'
            s = re.match(r'\s+\. (.+?)\s{2,}(\d+)\s+([\d.]+)\s+([\d.]+)\s+[\d.]+%', line)
            if s and section != 'other' and s.group(1).strip() in STAGES:
                stages[s.group(1).strip()] = float(s.group(4))
        failed = re.search(r'^rc=(\d+)', block, flags=re.M)
        out.append((label, float(m.group(1)) if m else None, float(m.group(2)) if m else None, stages,
                    failed.group(1) if failed and failed.group(1) != '0' else None))
    return out


def main():
    rows = []
    for path in sys.argv[1:]:
        rows += runs(open(path, errors='replace').read())
    print('| run | prefill tok/s | decode step ms | ' + ' | '.join(f'{s} us' for s in STAGES) + ' |')
    print('|---|---:|---:|' + '---:|' * len(STAGES))
    for label, rate, step, stages, rc in rows:
        cells = [f'{rate:,.0f}' if rate else (f'failed (rc {rc})' if rc else '-'), f'{step:.3f}' if step else '-']
        cells += [f'{stages[s]:.1f}' if s in stages else '' for s in STAGES]
        print(f'| {label} | ' + ' | '.join(cells) + ' |')


if __name__ == '__main__':
    main()
