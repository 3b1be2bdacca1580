"""`ocriaquant bench`: our runtime's decode speed and page throughput, beside transformers'
`generate` on the same weights and beside the roofline, all measured in one run.

- decode tok/s at each batch: every row at `context` tokens of (synthetic) cache, greedy, the
  host loop included as the engine runs it (each step launched before the last one's tokens
  are read back) — what the engine pays per step;
- roofline: bytes one step moves (the Linears' weights in the format the kernels read, the
  rows' GDN state read and written, their KV cache read) ÷ the device copy bandwidth measured
  in the same run;
- pages/s and p50 / p90 latency (admission to last token) at each concurrency, on synthetic
  pages of `megapixels` with `out_tokens` tokens each: vision encoder and prefill included;
- transformers `generate` at the smallest and largest batch, on the same weights (for a
  quantized plan: the dequantized weights in BF16, the numbers our kernels multiply by).

A named shape (`--shape qwen3.5-4b`) builds the model with random weights, in memory, in one
of the plans: `bf16`, `mixed` (NVFP4 W4A16 MLPs, FP8 GDN and attention projections, BF16
head) — DESIGN.md's Qwen3.5-4B reference —, or `fp8` / `nvfp4` (every decoder Linear).
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from .errors import OcriaError

# Named plans for --shape: bf16; mixed (NVFP4 MLPs, FP8 GDN and attention); fp8 and nvfp4 (every
# decoder Linear in that format). The lm_head and the vision encoder stay BF16 in all of them.
# fp8 / nvfp4 time the kernels mixed does not run inside a step (FP8 MLPs, NVFP4 mixers).
PLANS = ("bf16", "mixed", "fp8", "nvfp4")


def copy_bandwidth(device: torch.device) -> float:
    """Bytes read + written per second by an elementwise kernel over 2 GiB. A same-dtype
    `copy_` goes to cudaMemcpy, which the copy engines serve at a lower rate (2.77 TB/s seen on
    an H200 against ~4.2 for a kernel); the roofline is about the SMs' own traffic.
    benchmarks/ uses this one too."""
    x = torch.randn(2**29, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    for _ in range(2):
        torch.mul(x, 1.0, out=y)
    torch.cuda.synchronize(device)
    t = time.perf_counter()
    for _ in range(10):
        torch.mul(x, 1.0, out=y)
    torch.cuda.synchronize(device)
    return 2 * x.numel() * 4 * 10 / (time.perf_counter() - t)


def plan_units(config, plan: str) -> list[tuple[list[str], str]]:
    """A quantized named plan's units (quantized together: one NVFP4 global scale per unit), each
    with its format: `mixed` NVFP4 MLPs and FP8 mixers, `fp8` / `nvfp4` every decoder Linear."""
    mlp_fmt, mixer_fmt = {"mixed": ("nvfp4", "fp8"), "fp8": ("fp8", "fp8"), "nvfp4": ("nvfp4", "nvfp4")}[plan]
    units = []
    for i, kind in enumerate(config.text_config.layer_types):
        pre = f"model.language_model.layers.{i}."
        units += [([pre + "mlp.gate_proj", pre + "mlp.up_proj"], mlp_fmt), ([pre + "mlp.down_proj"], mlp_fmt)]
        names = ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj") if kind == "linear_attention" \
            else ("q_proj", "k_proj", "v_proj", "o_proj")
        mixer = "linear_attn." if kind == "linear_attention" else "self_attn."
        units += [([pre + mixer + n], mixer_fmt) for n in names]
    return units


def build_shape(shape: str, plan: str, device: str, seed: int = 0):
    """(transformers model, MemoryStore, kinds, config, processor) for a named shape with random
    weights. The transformers model holds exactly the weights our runtime computes with."""
    from transformers import Qwen3_5ForConditionalGeneration

    from .model.configs import SHAPES, use_tokenizer_ids
    from .model.processor import PageProcessor, build_byte_tokenizer, build_image_processor
    from .quant import fp8, nvfp4
    from .runtime.load import MemoryStore

    if shape not in SHAPES:
        raise OcriaError(f"unknown shape {shape!r}; one of {', '.join(sorted(SHAPES))}")
    if plan not in PLANS:
        raise OcriaError(f"unknown plan {plan!r} for a named shape; one of {', '.join(PLANS)}")
    tok = build_byte_tokenizer()
    config = use_tokenizer_ids(SHAPES[shape](), tok)
    torch.manual_seed(seed)
    with torch.device(device):
        hf = Qwen3_5ForConditionalGeneration(config).to(torch.bfloat16).eval()
    params = dict(hf.named_parameters(remove_duplicate=False))
    tensors = {k: v.detach() for k, v in hf.state_dict().items()}
    kinds: dict[str, str] = {}
    if plan != "bf16":
        with torch.no_grad():
            for names, fmt in plan_units(config, plan):
                ws = [tensors.pop(n + ".weight") for n in names]
                gs = nvfp4.global_scale(*ws) if fmt == "nvfp4" else None
                for n, w in zip(names, ws):
                    kinds[n] = fmt
                    if fmt == "fp8":
                        q, s = fp8.quantize_weight(w, n)
                        tensors.update({n + ".weight": q, n + ".weight_scale": s})
                        params[n + ".weight"].copy_(fp8.dequantize(q, s, torch.bfloat16))
                    else:
                        packed, s, g = nvfp4.quantize_weight(w, gs, n)
                        tensors.update({n + ".weight_packed": packed, n + ".weight_scale": s,
                                        n + ".weight_global_scale": g})
                        params[n + ".weight"].copy_(nvfp4.dequantize(packed, s, g, torch.bfloat16))
    processor = PageProcessor(image_processor=build_image_processor(max_pixels=2048 * 2048 + 1), tokenizer=tok,
                              video_processor=None, chat_template=tok.chat_template)
    return hf, MemoryStore(tensors, f"{shape} (random weights, {plan})"), kinds, config, processor


def step_bytes(rt, batch: int, context: int) -> dict[str, float]:
    """Bytes one decode step moves: weights as the triton path reads them, plus per row the GDN
    state (read + write) and the visible KV cache (read)."""
    from .runtime.layers import Attention, QuantLinear

    weights = 0
    decoder = [rt.model.layers, rt.model.lm_head]
    for part in decoder:
        for m in part.modules():
            if not isinstance(m, QuantLinear):
                continue
            if m.kind == "bf16":
                weights += m.weight.numel() * m.weight.element_size()
            elif m.kind == "fp8":
                weights += m.w_q.numel() + m.w_scale.numel() * m.w_scale.element_size()
            else:
                weights += m.w_packed.numel() + m.w_scale.numel() + 4
    state = kv = 0
    for layer, st in zip(rt.model.layers, rt.state):
        if isinstance(layer.mixer, Attention):
            k = st["k"]
            kv += 2 * k.shape[1] * (context + 1) * k.shape[3] * k.element_size()
        else:
            state += 2 * sum(t[0].numel() * t.element_size() for t in st.values())
    return {"weights": weights, "state": batch * state, "kv": batch * kv, "total": weights + batch * (state + kv)}


def decode_speed(rt, batch: int, context: int, steps: int, vocab: int) -> float:
    """Seconds per decode step at `batch` rows, host loop included, run as the engine runs it:
    each step launched chained to the last (greedy_step) before the last one's tokens are read.

    The first call captures the step's CUDA graph, and its warm-up compiles the step's kernels:
    the objects compiling leaves behind can make Python's collector pause the host loop inside
    the few tens of timed steps (~1.6 ms each at batch 1), which the GPU then waits out. So, as
    `timeit` does, the garbage is collected before timing and the collector stays off while it
    runs: what is timed is the steady step a serving loop sees, not a one-off pause."""
    g = torch.Generator().manual_seed(batch)
    tokens = torch.randint(0, vocab, (batch,), generator=g).tolist()
    slots, lengths, deltas = list(range(batch)), [context] * batch, [0] * batch
    pending = rt.greedy_step(tokens, slots, lengths, deltas)
    collecting = gc.isenabled()
    try:
        for i in range(3 + steps):
            if i == 3:
                pending.get()
                if rt.device.type == "cuda":
                    torch.cuda.synchronize(rt.device)
                gc.collect()
                gc.disable()
                t = time.perf_counter()
            lengths = [n + 1 for n in lengths]
            ahead = rt.greedy_step(None, slots, lengths, deltas)
            pending.get()  # the last step's tokens back on the host, as the engine reads them
            pending = ahead
        pending.get()
        return (time.perf_counter() - t) / steps
    finally:
        if collecting:
            gc.enable()


class _StepClock:
    """A stopping criterion that never stops: generate calls it once per new token, right after
    that token is chosen, so the gaps between its stamps are decode steps, prefill excluded."""

    def __init__(self, dev: torch.device):
        self.dev, self.stamps = dev, []

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)
        self.stamps.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def __deepcopy__(self, memo):  # generate may copy its criteria; the stamps must land here
        return self


def transformers_speed(hf, batch: int, context: int, new_tokens: int, vocab: int) -> float:
    """Seconds per decode step of transformers `generate` (greedy): the median gap between
    consecutive tokens over three runs of new_tokens+1 tokens.

    Each step is timed on its own, not as the difference of two whole `generate` timings: on a
    loaded CPU with a tiny model that difference can come out zero or negative (CI saw it)."""
    from transformers import StoppingCriteriaList

    dev = next(hf.parameters()).device
    ids = torch.randint(0, vocab, (batch, context), device=dev)
    mask = torch.ones_like(ids)

    def gaps(n):
        clock = _StepClock(dev)
        hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                    pad_token_id=0, stopping_criteria=StoppingCriteriaList([clock]))
        if len(clock.stamps) != n:  # a generate that skips its criteria would time nothing
            raise RuntimeError(f"generate stamped {len(clock.stamps)} of {n} tokens")
        return [b - a for a, b in zip(clock.stamps, clock.stamps[1:])]

    gaps(2)  # warm-up
    return statistics.median(g for _ in range(3) for g in gaps(1 + new_tokens))


def synthetic_pages(n: int, megapixels: float) -> tuple[list, int]:
    """n square pages of `megapixels`, rendered in memory (4 distinct layouts, repeated)."""
    from .data.page import Page
    from .data.synth import SynthStyle, make_page

    side = int(math.sqrt(megapixels * 1e6) // 32 * 32)
    style = SynthStyle(width=side, height=side, font_size=40, heading_size=56, subheading_size=48, margin=64)
    imgs = [make_page(7_000 + i, style).image for i in range(min(n, 4))]
    return [Page(image=imgs[i % len(imgs)], source=Path(f"synthetic-{i:03d}.png")) for i in range(n)], side


def page_speed(engine, encs: list[dict], concurrency: int, out_tokens: int) -> dict:
    t = time.perf_counter()
    res = list(engine.generate([(e, out_tokens) for e in encs], max_batch=concurrency, stop_at_eos=False))
    wall = time.perf_counter() - t
    lat = sorted(r.seconds for r in res)
    q = statistics.quantiles(lat, n=10, method="inclusive") if len(lat) > 1 else lat * 9
    return {"concurrency": concurrency, "pages": len(res), "seconds": round(wall, 2),
            "pages_per_s": round(len(res) / wall, 3), "p50_s": round(statistics.median(lat), 2),
            "p90_s": round(q[8], 2), "tok_per_s": round(sum(len(r.tokens) for r in res) / wall, 1)}


@dataclass(frozen=True)
class BenchOptions:
    """What `ocriaquant bench` measures and how (the CLI's flags)."""
    shape: str | None = None            # a named shape with random weights instead of a checkpoint
    plan: str = "mixed"                 # with shape: one of PLANS
    device: str = "cuda"
    backend: str = "triton"
    batches: tuple[int, ...] = (1, 8, 32, 64)  # decode batch sizes
    context: int = 512                  # tokens cached per row when decode is timed
    steps: int = 32                     # decode steps timed per batch
    concurrency: tuple[int, ...] = (1, 8, 32, 64)  # page concurrency levels (empty: no pages)
    pages: int | None = None            # pages per level (None: max(4, level))
    megapixels: float = 4.1             # synthetic page size
    out_tokens: int = 1000              # tokens generated per page, EOS ignored
    baseline: bool = True               # transformers generate on the same weights
    baseline_tokens: int = 16           # decode steps timed for transformers
    cuda_graphs: bool = True
    tiles: Path | None = None           # GEMV tile table file (None: recipes/tiles/h200.json)


def run(checkpoint: Path | None, options: BenchOptions = BenchOptions(), log: Callable[[str], None] = print,
        **fields) -> dict:
    """Everything `ocriaquant bench` measures, as one report dict. Named fields override options."""
    o = replace(options, **fields)
    shape, plan, device, backend, context, steps = o.shape, o.plan, o.device, o.backend, o.context, o.steps
    batches, concurrency, pages, out_tokens = list(o.batches), list(o.concurrency), o.pages, o.out_tokens
    baseline, baseline_tokens, cuda_graphs, tiles = o.baseline, o.baseline_tokens, o.cuda_graphs, o.tiles
    from .runtime.config import RuntimeConfig
    from .runtime.engine import Engine
    from .runtime.model_runner import ModelRunner
    from .runtime.tiles import TileTable

    if checkpoint is not None and shape is not None:
        raise OcriaError("give a checkpoint or --shape, not both")
    if steps < 1 or (baseline and baseline_tokens < 1):
        raise OcriaError(f"--steps and --baseline-tokens time at least 1 decode step each; got {steps}, "
                         f"{baseline_tokens}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise OcriaError("no CUDA device here; run on a GPU, or use --device cpu --backend torch for a (slow) CPU run")
    if backend == "triton" and not device.startswith("cuda"):
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            raise OcriaError("the triton backend needs a GPU (or TRITON_INTERPRET=1 on the CPU, very slowly)")
    if max(batches + concurrency) > 64 and cuda_graphs:
        log("note: batches above 64 run eagerly (the GEMVs and the graph buckets stop at 64)")
    dev = torch.device(device)
    t0 = time.perf_counter()
    page_list, side = synthetic_pages(max(pages or 0, max(concurrency) if concurrency else 0, 1), o.megapixels)
    if shape is not None:
        log(f"building {shape} with random weights ({plan}) on {device}")
        hf, store, kinds, config, processor = build_shape(shape, plan, device)
        source, label = (config, store, kinds), f"{shape} {plan} (random weights)"
    else:
        from .model.load import load_model, resolve_model_dir
        from .model.processor import load_processor

        label = str(resolve_model_dir(checkpoint))
        processor, source = load_processor(resolve_model_dir(checkpoint)), None
        hf = load_model(checkpoint, "bf16", device)[0] if baseline else None
    from .model.processor import chat_text

    def encode(page):
        return dict(processor(images=[page.image], text=[chat_text(processor, page.prompt)], return_tensors="pt"))

    prompt_len = encode(page_list[0])["input_ids"].shape[1]
    max_len = max(prompt_len + out_tokens, context + steps + 8) + 8
    slots = max(batches + concurrency)
    log(f"runtime: backend {backend}, {slots} slots, max_len {max_len} (page prompt {prompt_len} tokens)")
    rt = ModelRunner(checkpoint, RuntimeConfig(backend=backend, device=device, max_slots=slots, max_len=max_len,
                                               cuda_graphs=cuda_graphs, tiles=TileTable.load(tiles) if tiles else None),
                     source=source)
    vocab = rt.hf_config.text_config.vocab_size
    bw = copy_bandwidth(dev) if dev.type == "cuda" else float("nan")
    report = {"model": label, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
              "backend": backend, "cuda_graphs": rt.use_graphs, "tiles": rt.tiles.source if rt.tiles else None,
              "torch": torch.__version__,
              "copy_bandwidth_tb_s": round(bw / 1e12, 3), "context": context, "decode": [], "pages": [],
              "page_px": [side, side], "page_prompt_tokens": prompt_len, "out_tokens": out_tokens,
              "setup_s": round(time.perf_counter() - t0, 1)}
    for b in batches:
        sec = decode_speed(rt, b, context, steps, vocab)
        by = step_bytes(rt, b, context)
        row = {"batch": b, "ms_per_step": round(sec * 1e3, 3), "tok_per_s": round(b / sec, 1),
               "bytes_per_step_gb": round(by["total"] / 1e9, 3), "weights_gb": round(by["weights"] / 1e9, 3),
               "weights_bytes": by["weights"],
               "roofline_ms": round(by["total"] / bw * 1e3, 3), "roofline_frac": round(by["total"] / bw / sec, 3)}
        report["decode"].append(row)
        log(f"decode batch {b}: {row['ms_per_step']} ms/step, {row['tok_per_s']} tok/s, "
            f"{row['roofline_frac']:.0%} of roofline")
    if baseline and hf is not None:
        for b in sorted({min(batches), max(batches)}):
            try:
                sec = transformers_speed(hf, b, context, baseline_tokens, vocab)
            except Exception as e:  # noqa: BLE001 - a failing baseline is reported, not fatal
                log(f"transformers generate failed at batch {b}: {type(e).__name__}: {e}")
                continue
            row = next(r for r in report["decode"] if r["batch"] == b)
            row["transformers_tok_per_s"] = round(b / sec, 1)
            row["speedup_vs_transformers"] = round(row["tok_per_s"] / (b / sec), 1)
            log(f"transformers batch {b}: {b / sec:.1f} tok/s -> ours {row['speedup_vs_transformers']}x")
    del hf  # the baseline's memory goes back before the pages run
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    engine = Engine(runner=rt, processor=processor)
    encs = [encode(p) for p in page_list]
    if concurrency:
        # Untimed: one page through the engine compiles the vision encoder's and prefill's kernels,
        # and every decode bucket the levels can reach is captured, so that no level's latencies
        # carry a one-off cost (before this, the first page at concurrency 1 took ~10 s of a
        # 2.2 s median on an H100, and p90 reported it).
        t = time.perf_counter()
        list(engine.generate([(encs[0], 2)], max_batch=1, stop_at_eos=False))
        captured = rt.capture_buckets(max(concurrency))
        report["pages_warmup_s"] = round(time.perf_counter() - t, 1)
        log(f"pages warm-up: {report['pages_warmup_s']} s (one page, buckets captured: {captured or 'none'})")
    for c in concurrency:
        n = pages or max(4, c)
        row = page_speed(engine, (encs * (n // len(encs) + 1))[:n], c, out_tokens)
        report["pages"].append(row)
        log(f"pages at concurrency {c}: {row['pages_per_s']} pages/s, p50 {row['p50_s']} s, p90 {row['p90_s']} s")
    report["total_s"] = round(time.perf_counter() - t0, 1)
    return report


def table(report: dict):
    """The report as rich tables (decode, pages)."""
    from rich.table import Table

    d = Table(title=f"decode — {report['model']} on {report['device']}, context {report['context']}, "
                    f"copy {report['copy_bandwidth_tb_s']} TB/s")
    for col in ("batch", "ms/step", "tok/s", "GB/step", "roofline ms", "% roofline", "transformers tok/s",
                "speed-up"):
        d.add_column(col, justify="right")
    for r in report["decode"]:
        d.add_row(str(r["batch"]), f"{r['ms_per_step']:.2f}", f"{r['tok_per_s']:.0f}", f"{r['bytes_per_step_gb']:.2f}",
                  f"{r['roofline_ms']:.2f}", f"{r['roofline_frac']:.0%}", str(r.get("transformers_tok_per_s", "—")),
                  f"{r['speedup_vs_transformers']}×" if "speedup_vs_transformers" in r else "—")
    p = Table(title=f"pages — {report['page_px'][0]}×{report['page_px'][1]} px, {report['page_prompt_tokens']} "
                    f"prompt tokens, {report['out_tokens']} out tokens each")
    for col in ("concurrency", "pages", "pages/s", "p50 s", "p90 s", "tok/s"):
        p.add_column(col, justify="right")
    for r in report["pages"]:
        p.add_row(str(r["concurrency"]), str(r["pages"]), f"{r['pages_per_s']:.3f}", f"{r['p50_s']:.2f}",
                  f"{r['p90_s']:.2f}", f"{r['tok_per_s']:.0f}")
    return d, p
