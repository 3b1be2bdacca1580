"""Write the reference model, freshly initialized (seeded), to ocriaquant/assets/ocria-nano.

    python scripts/init_reference.py [--out DIR] [--seed 0]

scripts/train_reference.py (issue 3) trains it from here on synthetic pages.
"""

import argparse
from pathlib import Path

from ocriaquant.model.load import DEFAULT_MODEL
from ocriaquant.model.reference import init_reference

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = init_reference(args.out, args.seed)
    size = sum(f.stat().st_size for f in out.iterdir()) / 1e6
    print(f"wrote {out} ({size:.1f} MB)")
