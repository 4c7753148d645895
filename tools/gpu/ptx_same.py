#!/usr/bin/env python3
"""Whether the kernels of two PTX files are the same code, names normalised (the anonymous namespace's hash, the
file name, template arguments added after the fact). For checking that a refactor or a new opt-in form leaves the
default kernels' code unchanged, without a GPU:
  nvcc <flags> -ptx -x cu OLD.cu -o old.ptx; nvcc <flags> -ptx -x cu NEW.cu -o new.ptx
  tools/gpu/ptx_same.py old.ptx new.ptx 'moe_wgmma_kernelILi128ELb0ELb0E=moe_wgmma_kernelILi128ELb0ELb0ELb0E' ...
Each argument OLD=NEW pairs a kernel of the first file (a substring of its mangled name) with one of the second."""
import re
import sys


def bodies(path):
    text = open(path).read()
    out = {}
    for m in re.finditer(r'\.entry (\S+)\(.*?\n\}\n', text, re.S):
        body = re.sub(r'_Z\w*kiln\w*', 'SYM', m.group(0))
        body = re.sub(r'\$L__\w+', 'L', body)
        out[m.group(1)] = body
    return out


def main():
    old, new = bodies(sys.argv[1]), bodies(sys.argv[2])
    bad = 0
    for pair in sys.argv[3:]:
        a, b = pair.split('=')
        ka = [k for k in old if a + 'E' in k or a + 'EE' in k]
        kb = [k for k in new if b + 'E' in k or b + 'EE' in k]
        if len(ka) != 1 or len(kb) != 1:
            print(f'{pair}: {len(ka)} / {len(kb)} kernels match')
            bad += 1
            continue
        same = old[ka[0]] == new[kb[0]]
        print(f'{pair}: {"same code" if same else "DIFFERENT"}')
        bad += not same
    sys.exit(1 if bad else 0)


if __name__ == '__main__':
    main()
