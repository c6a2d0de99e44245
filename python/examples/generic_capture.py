"""The generic capture end to end without torch: the numpy toy MoE
(``numpy_toy.py``) traced twice through ``moeconf.torch``, once as it is and
once with layer 1 summing its routed terms in float16 (another backend), then
``moeconf diff`` of the two. Exit 0 when the diff says what it must (the
trace against itself equivalent; the candidate parting at layer 1's
``moe.combine`` with identical tokens), 1 otherwise, 2 on an error.

    python3 python/examples/generic_capture.py [--out DIR] [--moeconf BIN]
"""

import argparse
import os
import subprocess
import sys

import numpy as np

from moeconf import binary
from numpy_toy import Toy, run


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=".", help="directory for ref.bin and cand.bin (default: here)")
    p.add_argument("--moeconf", default=None, help="the binary (default: $MOECONF_BIN, the wheel's, PATH)")
    a = p.parse_args(argv)
    try:
        exe = binary.check(a.moeconf).path
    except binary.BinaryError as e:
        print(f"generic_capture: {e}", file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    ref, cand = os.path.join(a.out, "ref.bin"), os.path.join(a.out, "cand.bin")
    ref_tokens = run(Toy(), ref, capture="all").generated
    model = Toy()
    model.layers[1].experts.sum_dtype = np.float16
    cand_tokens = run(model, cand, capture="all").generated
    print(f"generated ids: reference {ref_tokens}, candidate {cand_tokens}")

    same = subprocess.run([exe, "diff", ref, ref], capture_output=True, text=True)
    diff = subprocess.run([exe, "diff", ref, cand], capture_output=True, text=True)
    last = diff.stdout.strip().splitlines()[-1] if diff.stdout.strip() else ""
    print(f"moeconf diff ref.bin ref.bin: exit {same.returncode}")
    print(f"moeconf diff ref.bin cand.bin: exit {diff.returncode}: {last}")
    problems = []
    if same.returncode != 0:
        problems.append(f"a trace against itself exited {same.returncode}: {same.stderr.strip()}")
    if diff.returncode != 1:
        problems.append(f"the candidate's diff exited {diff.returncode}: {diff.stderr.strip()}")
    elif not (last.startswith("first divergence:") and "layer 1 " in last and "moe.combine" in last):
        problems.append(f"the first divergence is not layer 1's moe.combine: {last!r}")
    for msg in problems:
        print(f"generic_capture: {msg}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
