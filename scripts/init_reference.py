"""Write a reference model, freshly initialized (seeded).

    python scripts/init_reference.py [--out DIR] [--seed 0]            # ocria-nano (the grid reader)
    python scripts/init_reference.py --reader --out DIR [--seed 0]     # the document reader (issue #57)

`--reader` writes the document reader of ocriaquant.model.reader (with its MTP layer), its
byte-level BPE tokenizer learned from --tokenizer-pages pages of the document generator.
scripts/train_reference.py trains the reader from scratch itself (it learns the same tokenizer
from its first pages); this gives an untrained one, e.g. to look at its shapes with `ocriaquant info`.
"""

import argparse
from pathlib import Path

from ocriaquant.model.load import DEFAULT_MODEL
from ocriaquant.model.reference import init_reference

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help=f"default {DEFAULT_MODEL} (ocria-nano only)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reader", action="store_true", help="the document reader instead of ocria-nano")
    ap.add_argument("--vocab", type=int, default=8192, help="--reader: BPE vocabulary")
    ap.add_argument("--tokenizer-pages", type=int, default=1000, help="--reader: pages whose markdown trains it")
    args = ap.parse_args()
    if args.reader:
        if args.out is None:
            raise SystemExit("--reader needs --out (the bundled ocria-nano stays as it is)")
        from ocriaquant.data.docgen import make_doc_page
        from ocriaquant.model.reader import ReaderShape, count_parameters, init_reader, reader_config, \
            train_reader_tokenizer

        texts = [make_doc_page(10**6 + i).markdown for i in range(args.tokenizer_pages)]
        tok = train_reader_tokenizer(texts, args.vocab)
        shape = ReaderShape(vocab=args.vocab)
        out = init_reader(args.out, tok, shape, args.seed)
        n = count_parameters(reader_config(tok, shape))
        print(f"parameters: {', '.join(f'{k} {v / 1e6:.2f} M' for k, v in n.items())}")
    else:
        out = init_reference(args.out or DEFAULT_MODEL, args.seed)
    size = sum(f.stat().st_size for f in out.iterdir()) / 1e6
    print(f"wrote {out} ({size:.1f} MB)")
