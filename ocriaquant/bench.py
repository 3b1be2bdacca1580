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

import math
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from .errors import OcriaError
from .runtime.engine import PREFILL_BUDGET
from .runtime.measure import decode_speed, page_speed, page_stats, pages_at_slo  # benchmarks/ import them from here too

# Named plans for --shape: bf16; mixed (NVFP4 MLPs, FP8 GDN and attention); fp8 and nvfp4 (every
# decoder Linear in that format). The lm_head and the vision encoder stay BF16 in all of them.
# fp8 / nvfp4 time the kernels mixed does not run inside a step (FP8 MLPs, NVFP4 mixers).
PLANS = ("bf16", "mixed", "fp8", "nvfp4")
SLO_MAX_CONCURRENCY = 64  # the largest CUDA-graph bucket: the SLO search goes no higher
ACCEPTED_LENGTHS = (1.5, 2, 2.5, 3, 4, 5, 6)  # the spec report's speed-up sweep (#55)


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


def prefill_flops(config, enc: dict) -> dict[str, float]:
    """FLOPs of one request's prefill: the vision tower (patch embedding, its Linears, attention
    over each image's patches, the merger) and the text decoder (every Linear, causal attention,
    the gated delta rule's state updates); the head on the last position only."""
    v, t = config.vision_config, config.text_config
    flops = {"vision": 0.0, "text": 0.0}
    if "image_grid_thw" in enc:
        d, i = v.hidden_size, v.intermediate_size
        per_image = [int(n) for n in enc["image_grid_thw"].prod(-1)]
        n = sum(per_image)
        patch = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
        m = v.spatial_merge_size ** 2
        flops["vision"] = 2 * n * patch * d + v.depth * (2 * n * (4 * d * d + 2 * d * i) + sum(
            4 * k * k * d for k in per_image)) + 2 * (n // m) * (m * d * m * d + m * d * v.out_hidden_size)
    T, D = enc["input_ids"].shape[-1], t.hidden_size
    hk, hv = t.linear_num_key_heads * t.linear_key_head_dim, t.linear_num_value_heads * t.linear_value_head_dim
    gdn = D * (2 * hk + hv) + D * hv + 2 * D * t.linear_num_value_heads + hv * D
    hd = t.head_dim
    attn = D * t.num_attention_heads * hd * 2 + 2 * D * t.num_key_value_heads * hd + t.num_attention_heads * hd * D
    for kind in t.layer_types:
        if kind == "linear_attention":  # per token and value head: k·v outer product, S·k and q·S
            flops["text"] += 2 * T * gdn + 6 * T * t.linear_num_value_heads * t.linear_key_head_dim * \
                t.linear_value_head_dim
        else:  # causal: half of the T² scores, QK and PV
            flops["text"] += 2 * T * attn + 2 * T * T * hd * t.num_attention_heads
        flops["text"] += 2 * T * 3 * D * t.intermediate_size
    flops["text"] += 2 * D * t.vocab_size
    return flops


def dense_bf16_rate(device: torch.device) -> float:
    """FLOP/s of a BF16 8192³ matmul: the dense tensor-core rate the prefill roofline divides by."""
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(device)
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize(device)
    return 2 * 8192 ** 3 * 10 / (time.perf_counter() - t)


def prefill_speed(rt, enc: dict, rate: float, reps: int = 3) -> dict:
    """One page's prefill, vision tower and text timed apart (best of `reps`, slot 0), against
    its FLOP roofline: (vision + text FLOPs) ÷ the dense BF16 rate."""
    from .runtime.layers import Chunk

    def timed(fn):
        best = float("inf")
        for _ in range(reps):
            torch.cuda.synchronize(rt.device)
            t = time.perf_counter()
            out = fn()
            torch.cuda.synchronize(rt.device)
            best = min(best, time.perf_counter() - t)
        return best, out

    vision_s, prompts = timed(lambda: rt.encode([enc]))
    text_s, _ = timed(lambda: rt.prefill_chunks([(prompts[0], Chunk(0, 0, prompts[0].length))]))
    flops = prefill_flops(rt.hf_config, enc)
    total = flops["vision"] + flops["text"]
    return {"vision_s": round(vision_s, 4), "text_s": round(text_s, 4), "total_s": round(vision_s + text_s, 4),
            "vision_tflop": round(flops["vision"] / 1e12, 2), "text_tflop": round(flops["text"] / 1e12, 2),
            "dense_bf16_tflop_s": round(rate / 1e12, 1), "roofline_s": round(total / rate, 4),
            "over_roofline": round((vision_s + text_s) / (total / rate), 2)}


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
    tiles: Path | None = None           # GEMV tile table file (None: ocriaquant/recipes/tiles/h200.json)
    slo_p90: float | None = None        # also find the highest concurrency whose p90 holds this (seconds)
    prefill_budget: int | None = None   # prompt tokens the engine prefills per step (None: the engine's)
    spec: int = 0                       # speculative decoding (#55): drafts per step from the MTP (a shape's: random)
    acceptance: Path | None = None      # with spec: the acceptance (JSON, measure.accepted_lengths) tok/s expects
    draft: str = "bf16"                 # with spec: the drafter's weights (MTP Linears + head: bf16, fp8)
    draft_vocab: int = 0                # with spec: the draft vocabulary, lowest ids (0: all)


def run(checkpoint: Path | None, options: BenchOptions = BenchOptions(), log: Callable[[str], None] = print,
        save: Callable[[dict], None] | None = None, **fields) -> dict:
    """Everything `ocriaquant bench` measures, as one report dict. Named fields override options. `save`, if
    given, gets the report as it grows (marked "partial"), after each figure: a run cut short keeps them."""
    o = replace(options, **fields)
    shape, plan, device, backend, context, steps = o.shape, o.plan, o.device, o.backend, o.context, o.steps
    batches, concurrency, pages, out_tokens = list(o.batches), list(o.concurrency), o.pages, o.out_tokens
    baseline, baseline_tokens, cuda_graphs, tiles = o.baseline, o.baseline_tokens, o.cuda_graphs, o.tiles
    if o.slo_p90 is not None and o.slo_p90 <= 0:
        raise OcriaError(f"--slo-p90 is a latency in seconds, above 0; got {o.slo_p90}")
    from .runtime.config import RuntimeConfig
    from .runtime.engine import Engine
    from .runtime.model_runner import ModelRunner
    from .runtime.tiles import TileTable

    if checkpoint is not None and shape is not None:
        raise OcriaError("give a checkpoint or --shape, not both")
    if o.spec and shape is not None and o.acceptance is None:
        raise OcriaError("--spec on a named shape: random weights draft nothing the target accepts; give the "
                         "acceptance to expect with --acceptance FILE (JSON, see `ocriaquant bench --help`)")
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
    page_list, side = synthetic_pages(max(pages or 0, max(concurrency) if concurrency else 0, 4 if o.slo_p90 else 1),
                                      o.megapixels)
    if shape is not None:
        log(f"building {shape} with random weights ({plan}) on {device}")
        hf, store, kinds, config, processor = build_shape(shape, plan, device)
        source, label = (config, store, kinds), f"{shape} {plan} (random weights)"
        if o.spec:  # speculative decoding: a random MTP layer beside the random model (#55)
            add_random_mtp(store, config, device)
    else:
        from .model.load import load_model, resolve_model_dir
        from .model.processor import load_processor

        label = str(resolve_model_dir(checkpoint))
        processor, source = load_processor(resolve_model_dir(checkpoint)), None
        hf = load_model(checkpoint, "bf16", device)[0] if baseline else None
    from .model.processor import encode_page

    prompt_len = encode_page(processor, page_list[0])["input_ids"].shape[1]
    max_len = max(prompt_len + out_tokens, context + (steps + 5) * (o.spec + 1) + 8) + 8  # spec rows grow k+1 a step
    slots = max(batches + concurrency + ([SLO_MAX_CONCURRENCY] if o.slo_p90 else []))
    log(f"runtime: backend {backend}, {slots} slots, max_len {max_len} (page prompt {prompt_len} tokens)")
    rt = ModelRunner(checkpoint, RuntimeConfig(backend=backend, device=device, max_slots=slots, max_len=max_len,
                                               cuda_graphs=cuda_graphs, tiles=TileTable.load(tiles) if tiles else None,
                                               spec=o.spec, draft=o.draft, draft_vocab=o.draft_vocab),
                     source=source)
    vocab = rt.hf_config.text_config.vocab_size
    probs = given_acceptance(o)
    if probs and shape is not None:  # random weights accept nothing: steps accept as the file says, costs real
        rt.simulate_acceptance(probs)
    bw = copy_bandwidth(dev) if dev.type == "cuda" else float("nan")
    report = {"model": label, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
              "backend": backend, "cuda_graphs": rt.use_graphs, "tiles": rt.tiles.source if rt.tiles else None,
              "torch": torch.__version__,
              "copy_bandwidth_tb_s": round(bw / 1e12, 3), "context": context, "decode": [], "pages": [],
              "page_px": [side, side], "page_prompt_tokens": prompt_len, "out_tokens": out_tokens,
              "setup_s": round(time.perf_counter() - t0, 1)}

    def keep() -> None:
        if save is not None:
            save({**report, "partial": True, "total_s": round(time.perf_counter() - t0, 1)})

    for b in batches:
        sec = decode_speed(rt, b, context, steps, vocab)
        by = step_bytes(rt, b, context)
        row = {"batch": b, "ms_per_step": round(sec * 1e3, 3), "tok_per_s": round(b / sec, 1),
               "bytes_per_step_gb": round(by["total"] / 1e9, 3), "weights_gb": round(by["weights"] / 1e9, 3),
               "weights_bytes": by["weights"],
               "roofline_ms": round(by["total"] / bw * 1e3, 3), "roofline_frac": round(by["total"] / bw / sec, 3)}
        report["decode"].append(row)
        keep()
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
            keep()
            log(f"transformers batch {b}: {b / sec:.1f} tok/s -> ours {row['speedup_vs_transformers']}x")
    if o.spec:
        report["spec"] = spec_report(rt, o, probs, batches, context, steps, report["decode"], log)
        report["spec"]["simulated_acceptance"] = rt._simulated is not None
        keep()
    del hf  # the baseline's memory goes back before the pages run
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    engine = Engine(runner=rt, processor=processor, prefill_budget=o.prefill_budget or PREFILL_BUDGET)
    # with --spec, pages are served both ways on the same runner: plain decoding first, the comparison
    plain = Engine(runner=rt, processor=processor, prefill_budget=engine.prefill_budget, spec=0) if o.spec else None
    encs = [encode_page(processor, p, rt.model.dtype) for p in page_list]  # as Engine.encode: BF16 pixels
    report["prefill_budget"] = engine.prefill_budget
    if concurrency or o.slo_p90:
        # Untimed: pages through the engine compile the vision encoder's and prefill's kernels,
        # and every decode bucket the levels can reach is captured, so that no level's latencies
        # carry a one-off cost (before this, the first page at concurrency 1 took ~10 s of a
        # 2.2 s median on an H100, and p90 reported it).
        t = time.perf_counter()
        # the page's prompt in two passes, so a chunk that continues a slot's state (its own kernel
        # variants: fla-core's with an initial state, masked attention) compiles here too
        for e in filter(None, (plain, engine)):
            budget, e.prefill_budget = e.prefill_budget, encs[0]["input_ids"].shape[1] // 2 + 1
            list(e.generate([(encs[0], 2)], max_batch=1, stop_at_eos=False))
            e.prefill_budget = budget
        captured = rt.capture_buckets(max(concurrency + ([SLO_MAX_CONCURRENCY] if o.slo_p90 else [])))
        report["pages_warmup_s"] = round(time.perf_counter() - t, 1)
        log(f"pages warm-up: {report['pages_warmup_s']} s (one page in two passes, buckets captured: {captured or 'none'})")
        if dev.type == "cuda":
            report["prefill"] = pf = prefill_speed(rt, encs[0], dense_bf16_rate(dev))
            keep()
            log(f"one page's prefill: vision {pf['vision_s']} s + text {pf['text_s']} s = {pf['total_s']} s, "
                f"{pf['over_roofline']}x its roofline ({pf['vision_tflop']} + {pf['text_tflop']} TFLOP at "
                f"{pf['dense_bf16_tflop_s']} TFLOP/s)")
    for key, e in (("_plain", plain), ("", engine)):
        if e is None:
            continue
        what = " (plain decoding)" if key else " (speculative)" if o.spec else ""
        for c in concurrency:
            n = pages or max(4, c)
            row = page_speed(e, (encs * (n // len(encs) + 1))[:n], c, out_tokens)
            report.setdefault("pages" + key, []).append(row)
            keep()
            log(f"pages at concurrency {c}{what}: {row['pages_per_s']} pages/s, p50 {row['p50_s']} s, p90 "
                f"{row['p90_s']} s" + (f", {row['accepted_length']} tokens a verify" if "accepted_length" in row else ""))
        if o.slo_p90:
            def searching(levels, key=key):  # the levels so far, kept while the search runs
                report["slo" + key] = {"slo_p90_s": o.slo_p90, "searching": True, "levels": levels}
                keep()

            report["slo" + key] = pages_at_slo(e, encs, o.slo_p90, out_tokens, SLO_MAX_CONCURRENCY, pages,
                                               lambda m, what=what: log(m + what), searching)
            keep()
    if o.spec and o.slo_p90:
        sp, pl = report["slo"]["pages_per_s"], report["slo_plain"]["pages_per_s"]
        report["spec"]["slo_pages_per_s"] = {"plain": pl, "spec": sp, "ratio": round(sp / pl, 3) if pl else None}
        log(f"pages within p90 <= {o.slo_p90} s: speculative {sp} against plain {pl} pages/s")
    if o.spec and report["pages"] and o.acceptance is None:  # a checkpoint's MTP: acceptance measured on the pages
        report["spec"]["measured_accepted_length"] = {r["concurrency"]: r.get("accepted_length")
                                                      for r in report["pages"]}
    report["total_s"] = round(time.perf_counter() - t0, 1)
    return report


def add_random_mtp(store, config, device: str, seed: int = 0) -> None:
    """A random MTP layer (model/mtp.py's, bf16) into a named shape's MemoryStore, as `mtp.*`."""
    from .model.mtp import Qwen35MTP

    torch.manual_seed(seed)
    with torch.device(device):
        tensors = Qwen35MTP(config.text_config).checkpoint_tensors()
    store.tensors.update({k: v.to(device) for k, v in tensors.items()})
    store.where.update(dict.fromkeys(tensors))


def given_acceptance(o: BenchOptions) -> list[float] | None:
    """--acceptance FILE read as P(a step gives 1 … k+1 tokens) (runtime.measure.accepted_lengths)."""
    import json

    from .runtime.measure import accepted_lengths

    if not o.spec or o.acceptance is None:
        return None
    try:
        return accepted_lengths(json.loads(Path(o.acceptance).read_text()), o.spec)
    except (OSError, ValueError) as e:
        raise OcriaError(f"--acceptance {o.acceptance}: {e}") from None


def spec_report(rt, o: BenchOptions, probs: list[float] | None, batches: list[int], context: int, steps: int,
                decode: list[dict], log: Callable[[str], None]) -> dict:
    """Speculative decoding at each batch: the step's phases timed for real (verify of k+1 positions,
    commit, the MTP's drafting), the draft head's cost beside the full head's, the accepted length
    at which a step breaks even with plain decode, the speed-up at each accepted length, and, from
    the acceptance given (probs, --acceptance: not measured here), the expected tokens per step and
    tok/s."""
    from .runtime.measure import spec_step_speed

    k = o.spec
    if probs is not None:
        source = f"from {o.acceptance} (given, not measured: expected tok/s below assume it)"
    else:
        source = "measured on the pages (pages rows' accepted_length)"
    expected = sum((i + 1) * p for i, p in enumerate(probs)) if probs else None
    log(f"speculative decoding, k={k}: acceptance {source}"
        + (f"; expected {expected:.2f} tokens per step" if expected else ""))
    vocab = rt.hf_config.text_config.vocab_size
    dim = rt.hf_config.text_config.hidden_size
    rows = []
    for b in batches:
        t = spec_step_speed(rt, b, context, steps, vocab)
        plain = next(r for r in decode if r["batch"] == b)["ms_per_step"] / 1e3
        h = torch.randn(b, dim, dtype=rt.dtype, device=rt.device)
        head_s = _timed(lambda: rt.draft_head(h), rt.device)
        full_s = head_s if rt.draft_head is rt.model.lm_head else _timed(lambda: rt.model.lm_head(h), rt.device)
        row = {"batch": b, "step_ms": round(t["step_s"] * 1e3, 3), "eager_step_ms": round(t["eager_step_s"] * 1e3, 3),
               "verify_ms": round(t["verify_s"] * 1e3, 3),
               "commit_ms": round(t["commit_s"] * 1e3, 3), "draft_ms": round(t["draft_s"] * 1e3, 3),
               "draft_head_ms": round(head_s * 1e3, 3), "full_head_ms": round(full_s * 1e3, 3),
               "plain_step_ms": round(plain * 1e3, 3), "break_even_accepted_length": round(t["step_s"] / plain, 2)}
        # what each accepted length would give (tokens per step × plain step / spec step), up to k + 1
        row["speedup_at"] = {str(a): round(a * plain / t["step_s"], 2) for a in ACCEPTED_LENGTHS if a <= k + 1}
        if expected:
            row["expected_tok_per_s"] = round(b * expected / t["step_s"], 1)
            row["expected_speedup"] = round(expected * plain / t["step_s"], 2)
        rows.append(row)
        log(f"spec batch {b}: step {row['step_ms']} ms (eagerly {row['eager_step_ms']}: verify {row['verify_ms']}, "
            f"commit {row['commit_ms']}, draft "
            f"{row['draft_ms']}; draft head {row['draft_head_ms']} ms a call, full head {row['full_head_ms']}); plain "
            f"step {row['plain_step_ms']} ms: breaks even at {row['break_even_accepted_length']} tokens per step"
            + (f"; expected {row['expected_tok_per_s']} tok/s ({row['expected_speedup']}x)" if expected else ""))
    return {"k": k, "acceptance": source, "accepted_length_probs": probs, "expected_accepted_length": expected,
            "draft": o.draft, "draft_vocab": o.draft_vocab or vocab, "cuda_graphs": rt.use_graphs,
            "gdn_commit": "inside the next verify (deferred; commit ms ~0)" if rt.deferred else "after each verify",
            "steps": rows}


def _timed(fn, device, reps: int = 10) -> float:
    """Median seconds of fn() (synchronized on a GPU)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
    fn()
    out = []
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def table(report: dict):
    """The report as rich tables: decode, pages, and where measured the prefill roofline and the
    SLO search."""
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
    for col in ("decoding", "concurrency", "pages", "pages/s", "p50 s", "p90 s", "tok/s", "tokens a verify"):
        p.add_column(col, justify="right")
    for key, what in (("pages_plain", "plain"), ("pages", "speculative" if "spec" in report else "plain")):
        for r in report.get(key, []):
            p.add_row(what, str(r["concurrency"]), str(r["pages"]), f"{r['pages_per_s']:.3f}", f"{r['p50_s']:.2f}",
                      f"{r['p90_s']:.2f}", f"{r['tok_per_s']:.0f}", str(r.get("accepted_length", "—")))
    tables = [d, p]
    if "prefill" in report:
        pf = report["prefill"]
        f = Table(title=f"one page's prefill against its FLOP roofline ({pf['vision_tflop']} + {pf['text_tflop']} "
                        f"TFLOP at the {pf['dense_bf16_tflop_s']} TFLOP/s of a dense BF16 matmul)")
        for col in ("vision s", "text s", "total s", "roofline s", "× roofline"):
            f.add_column(col, justify="right")
        f.add_row(f"{pf['vision_s']:.3f}", f"{pf['text_s']:.3f}", f"{pf['total_s']:.3f}", f"{pf['roofline_s']:.3f}",
                  f"{pf['over_roofline']:.2f}")
        tables.append(f)
    for key, what in (("slo_plain", ", plain decoding"), ("slo", ", speculative" if "spec" in report else "")):
        if key not in report:
            continue
        slo = report[key]
        t = Table(title=f"pages within p90 ≤ {slo['slo_p90_s']} s{what}: {slo['pages_per_s']:.3f} pages/s at "
                        f"concurrency {slo['concurrency']}" if slo["concurrency"] else
                        f"pages within p90 ≤ {slo['slo_p90_s']} s{what}: not held even one page at a time")
        for col in ("concurrency", "pages", "pages/s", "p50 s", "p90 s", "first token p50 s", "held"):
            t.add_column(col, justify="right")
        for r in slo["levels"]:
            t.add_row(str(r["concurrency"]), str(r["pages"]), f"{r['pages_per_s']:.3f}", f"{r['p50_s']:.2f}",
                      f"{r['p90_s']:.2f}", f"{r['first_token_p50_s']:.2f}",
                      "yes" if r["p90_s"] <= slo["slo_p90_s"] else "no")
        tables.append(t)
    if "spec" in report:
        sp = report["spec"]
        t = Table(title=f"speculative decoding, {sp['k']} drafts a step (drafter {sp['draft']}, vocabulary "
                        f"{sp['draft_vocab']}); acceptance {sp['acceptance']}")
        for col in ("batch", "step ms", "eager step ms", "verify ms", "commit ms", "draft ms", "draft head ms",
                    "plain step ms", "break-even tokens/step", "expected tok/s", "expected ×"):
            t.add_column(col, justify="right")
        for r in sp["steps"]:
            t.add_row(str(r["batch"]), f"{r['step_ms']:.2f}", f"{r['eager_step_ms']:.2f}", f"{r['verify_ms']:.2f}",
                      f"{r['commit_ms']:.2f}", f"{r['draft_ms']:.2f}", f"{r['draft_head_ms']:.2f}",
                      f"{r['plain_step_ms']:.2f}", f"{r['break_even_accepted_length']:.2f}",
                      str(r.get("expected_tok_per_s", "—")),
                      f"{r['expected_speedup']}×" if "expected_speedup" in r else "—")
        tables.append(t)
        lengths = list(sp["steps"][0]["speedup_at"]) if sp["steps"] else []
        measured = {c: a for c, a in (sp.get("measured_accepted_length") or {}).items() if a}
        t = Table(title="speed-up over plain decode by mean accepted length (tokens per verify step)"
                        + (f"; the acceptance given: {sp['expected_accepted_length']:.2f}"
                           if sp.get("expected_accepted_length") else "")
                        + ("; measured on the pages: " + ", ".join(f"{a} at concurrency {c}" for c, a in measured.items())
                           if measured else ""))
        for col in ["batch"] + lengths:
            t.add_column(col, justify="right")
        for r in sp["steps"]:
            t.add_row(str(r["batch"]), *(f"{r['speedup_at'][a]}×" for a in lengths))
        tables.append(t)
    return tables


def _gpu_worker(device: str, feed, emit, job) -> None:
    """One engine of `bench --gpus`: built and warmed up, then "ready"; then the pool's pages (synthetic
    page ids), each generating out_tokens tokens, at `concurrency`; a "page" event per finished page."""
    checkpoint, o, concurrency = job
    from .model.processor import encode_page
    from .runtime.config import RuntimeConfig
    from .runtime.engine import Engine
    from .runtime.model_runner import ModelRunner
    from .runtime.tiles import TileTable

    page_list, _ = synthetic_pages(4, o.megapixels)
    if o.shape is not None:
        _, store, kinds, config, processor = build_shape(o.shape, o.plan, device)
        source = (config, store, kinds)
    else:
        from .model.load import resolve_model_dir
        from .model.processor import load_processor

        processor, source = load_processor(resolve_model_dir(checkpoint)), None
    encs = [encode_page(processor, p, torch.bfloat16) for p in page_list]  # the runtime's dtype, as Engine.encode
    rt = ModelRunner(checkpoint, RuntimeConfig(backend=o.backend, device=device, max_slots=concurrency,
                                               max_len=encs[0]["input_ids"].shape[1] + o.out_tokens + 16,
                                               cuda_graphs=o.cuda_graphs,
                                               tiles=TileTable.load(o.tiles) if o.tiles else None), source=source)
    engine = Engine(runner=rt, processor=processor)
    list(engine.generate([(encs[0], 2)], max_batch=1, stop_at_eos=False))  # untimed: compiles, as run() does
    rt.capture_buckets(concurrency)
    emit("ready")
    keys: dict[int, str] = {}

    def requests():
        for rid, (key, i) in enumerate(feed):
            keys[rid] = key
            yield encs[i % len(encs)], o.out_tokens

    for r in engine.generate(requests(), max_batch=concurrency, stop_at_eos=False):
        emit("page", key=keys.pop(r.rid), seconds=r.seconds, tokens=len(r.tokens))


def run_gpus(checkpoint: Path | None, gpus: str | int, options: BenchOptions = BenchOptions(),
             log: Callable[[str], None] = print, **fields) -> dict:
    """`bench --gpus N`: pages/s and p50 / p90 latency with one engine per GPU (scale/pool.py), at
    the largest --concurrency per GPU, on 1 GPU and on N in the same run, and the scaling
    efficiency: pages/s on N ÷ (N × pages/s on 1). Engines are built and warmed up before the
    clock starts; every page generates out_tokens tokens."""
    from .scale.devices import worker_devices
    from .scale.pool import run_pool, shards

    o = replace(options, **fields)
    if checkpoint is not None and o.shape is not None:
        raise OcriaError("give a checkpoint or --shape, not both")
    devices = worker_devices(gpus, o.device)
    concurrency = max(o.concurrency) if o.concurrency else 8
    per_gpu = o.pages or max(8, 2 * concurrency)  # a few waves per GPU: admissions staggered, not one burst
    label = f"{o.shape} {o.plan} (random weights)" if o.shape else str(checkpoint or "bundled model")
    report = {"model": label, "device": o.device, "backend": o.backend, "concurrency_per_gpu": concurrency,
              "out_tokens": o.out_tokens, "megapixels": o.megapixels, "runs": []}
    for n in sorted({1, len(devices)}):
        lat, tokens, last = [], [0], [0.0]

        def on_event(worker, kind, key, data):
            if kind == "page":
                lat.append(data["seconds"])
                tokens[0] += data["tokens"]
                last[0] = time.perf_counter()

        log(f"{n} engine(s) on {', '.join(d if v is None else f'GPU {v}' for d, v in devices[:n])}: "
            f"{per_gpu * n} pages at concurrency {concurrency} each")
        pool = run_pool(_gpu_worker, devices[:n], shards([(str(i), i) for i in range(per_gpu * n)], 1),
                        (checkpoint, o, concurrency), on_event, wait_ready=True)
        dead = [w for w in pool.workers if w.exit_code != 0]
        if dead:
            raise OcriaError(f"bench engine {dead[0].worker} ({dead[0].device}) failed (exit code {dead[0].exit_code})"
                             + (f":\n{dead[0].error}" if dead[0].error else ""))
        row = {"gpus": n, **page_stats(lat, tokens[0], last[0] - pool.started_at)}
        report["runs"].append(row)
        log(f"{n} engine(s): {row['pages_per_s']} pages/s, p50 {row['p50_s']} s, p90 {row['p90_s']} s")
    one, many = report["runs"][0], report["runs"][-1]
    report["scaling_efficiency"] = round(many["pages_per_s"] / (many["gpus"] * one["pages_per_s"]), 3)
    return report


def gpus_table(report: dict):
    from rich.table import Table

    t = Table(title=f"pages across GPUs — {report['model']}, concurrency {report['concurrency_per_gpu']} per GPU, "
                    f"{report['out_tokens']} out tokens each; scaling efficiency {report['scaling_efficiency']:.0%}")
    for col in ("GPUs", "pages", "pages/s", "p50 s", "p90 s", "tok/s"):
        t.add_column(col, justify="right")
    for r in report["runs"]:
        t.add_row(str(r["gpus"]), str(r["pages"]), f"{r['pages_per_s']:.3f}", f"{r['p50_s']:.2f}",
                  f"{r['p90_s']:.2f}", f"{r['tok_per_s']:.0f}")
    return t
