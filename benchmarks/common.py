"""What the tools that time one decode step of a named shape share (ab_step.py, profile_step.py):
their options, and the runtime they build from them.

Not a tool of its own: the tools import it (benchmarks/ is on sys.path when a tool there runs).
"""

from __future__ import annotations

from pathlib import Path

from ocriaquant.bench import PLANS, build_shape
from ocriaquant.errors import OcriaError


def add_step_args(ap, steps: int) -> None:
    """The options of the tools that time one decode step of a named shape: --shape, --plan,
    --batch, --context, --max-len, --steps (`steps` is the default of the last), --tiles."""
    ap.add_argument("--shape", default="qwen3.5-4b", help="a named shape (ocriaquant/model/configs.py)")
    ap.add_argument("--plan", default="mixed", choices=PLANS)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=512, help="tokens already cached per row")
    ap.add_argument("--max-len", type=int, default=None,
                    help="cache length per slot (default: context + steps + 16). `ocriaquant bench` sizes it for "
                         "its synthetic pages (5092 at the 4B), and attention's chunk grid follows it")
    ap.add_argument("--steps", type=int, default=steps, help="decode steps timed")
    ap.add_argument("--tiles", type=Path, default=None,
                    help="the GEMV tile table the runtime launches with (default: ocriaquant/recipes/tiles/h200.json)")


def step_runtime(args, device: str, backend: str = "triton"):
    """(runner, vocab): a ModelRunner of args.shape in args.plan with random weights (bench.build_shape,
    its transformers model dropped), args.batch slots of args.max_len, at the tiles of args.tiles:
    what add_step_args' tools time."""
    from ocriaquant.runtime.config import RuntimeConfig
    from ocriaquant.runtime.model_runner import ModelRunner
    from ocriaquant.runtime.tiles import TileTable

    max_len = args.max_len or args.context + args.steps + 16
    if max_len < args.context + args.steps + 2:
        raise OcriaError(f"--max-len {max_len} cannot hold --context {args.context} plus --steps {args.steps}")
    tiles = TileTable.load(args.tiles) if args.tiles else None
    _, store, kinds, config, _ = build_shape(args.shape, args.plan, device)
    runner = ModelRunner(None, RuntimeConfig(backend=backend, device=device, max_slots=args.batch, max_len=max_len,
                                             tiles=tiles), source=(config, store, kinds))
    return runner, config.text_config.vocab_size
