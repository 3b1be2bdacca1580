"""Our runtime against transformers: state layout, greedy tokens, `parse`."""

import json
import os
import shutil

import pytest
import torch

from ocriaquant.data import BUNDLED_PAGES, load_pages, split_pages
from ocriaquant.model import load_config

# the triton backend's kernels run on a GPU, or on the CPU under Triton's interpreter (the README's test command)
needs_triton = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                  reason="the triton backend needs a GPU or TRITON_INTERPRET=1")


def test_prefill_then_decode_equals_longer_prefill(tiny_model_dir):
    """Prefill N tokens then decode 1 ≡ prefill N+1: catches a transposed GDN state ([V, K]
    written, [K, V] read), a wrong conv-state shift or a KV cache written at the wrong place."""
    from ocriaquant.runtime.config import RuntimeConfig
    from ocriaquant.runtime.model_runner import ModelRunner

    rt = ModelRunner(tiny_model_dir, RuntimeConfig(max_slots=3, max_len=64, dtype=torch.float32))
    torch.manual_seed(0)
    ids = torch.randint(0, 250, (1, 12))
    full, _ = rt.prefill({"input_ids": ids}, slot=2)
    for s in (0, 1):  # two slots at different lengths, decoded together
        rt.prefill({"input_ids": ids[:, : 11 - s]}, slot=s)
    logits = rt.decode(ids[0, [11, 10]], torch.tensor([0, 1]), torch.tensor([11, 10]), torch.tensor([0, 0]))
    shorter, _ = rt.prefill({"input_ids": ids[:, :11]}, slot=2)
    assert torch.allclose(logits[0], full, atol=1e-4, rtol=1e-4)
    assert torch.allclose(logits[1], shorter, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("device,backend", [("cpu", "torch"), pytest.param(
    "cpu", "triton", marks=pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                              reason="the triton backend on the CPU needs TRITON_INTERPRET=1")),
    pytest.param("cuda", "triton", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                            reason="CUDA graphs need a GPU"))])
def test_greedy_step_chained_on_the_device_equals_steps_fed_from_the_host(tiny_model_dir, device, backend):
    """greedy_step(None, ...) feeds each row the token the last step produced and advances its
    length on the device: the same tokens and state as steps whose inputs come from the host
    (decode_step, argmax). The engine launches steps that way, one ahead of reading them. On a
    GPU both run the same CUDA graph, which does the feeding itself; the triton backend feeds
    through step_inputs and greedy_advance (on the CPU under the interpreter, without graphs)."""
    from ocriaquant.errors import OcriaError
    from ocriaquant.runtime.config import RuntimeConfig
    from ocriaquant.runtime.model_runner import ModelRunner

    rt = ModelRunner(tiny_model_dir, RuntimeConfig(max_slots=3, max_len=40, device=device, backend=backend,
                                                   dtype=torch.float32 if backend == "torch" else torch.bfloat16))
    torch.manual_seed(3)
    prompts = [torch.randint(0, 250, (1, n)) for n in (9, 6)]
    slots, deltas = [2, 0], [0, 0]
    with pytest.raises(OcriaError, match="chains from a last step"):
        rt.greedy_step(None, slots, [9, 6], deltas)
    runs = []
    for chained in (False, True):
        for s, p in zip(slots, prompts):  # a prefill rewrites the slot's whole state
            rt.prefill({"input_ids": p}, slot=s)
        tokens, lengths, got = [int(p[0, -1]) for p in prompts], [9, 6], []
        pending = rt.greedy_step(tokens, slots, lengths, deltas) if chained else None
        for _ in range(4):
            if chained:
                lengths = [n + 1 for n in lengths]
                ahead = rt.greedy_step(None, slots, lengths, deltas)  # launched before the last is read
                got.append(pending.get())
                pending = ahead
            else:
                tokens = rt.decode_step(tokens, slots, lengths, deltas).argmax(-1).tolist()
                lengths = [n + 1 for n in lengths]
                got.append(tokens)
        if chained:
            got.append(pending.get())
        else:
            got.append(rt.decode_step(tokens, slots, lengths, deltas).argmax(-1).tolist())
        runs.append((got, rt.state[0]["ssm"][[0, 2]].clone(), rt.state[3]["k"][[0, 2], :, :16].clone()))
    (t0, s0, k0), (t1, s1, k1) = runs
    assert t0 == t1 and torch.equal(s0, s1) and torch.equal(k0, k1)
    with pytest.raises(OcriaError, match="max_len"):
        rt.greedy_step(None, slots, [40, 11], deltas)
    # bench's warm-up: the buckets up to 3 rows not captured yet (2 was), on the sentinel slot, so
    # no sequence's state moves; nothing without graphs
    assert rt.capture_buckets(3) == ([1, 4] if rt.use_graphs else [])
    assert rt.capture_buckets(3) == []
    assert torch.equal(rt.state[0]["ssm"][[0, 2]], s1) and torch.equal(rt.state[3]["k"][[0, 2], :, :16], k1)


def test_prefill_logits_equal_transformers(tiny_model_dir, synth_pages):
    from ocriaquant.model import load_model
    from ocriaquant.model.processor import chat_text
    from ocriaquant.runtime.config import RuntimeConfig
    from ocriaquant.runtime.model_runner import ModelRunner

    model, proc = load_model(tiny_model_dir, dtype="fp32")
    page = load_pages(synth_pages).pages[0]
    enc = dict(proc(images=[page.image], text=[chat_text(proc, page.prompt)], return_tensors="pt"))
    with torch.no_grad():
        want = model(**enc).logits[0, -1]
    rt = ModelRunner(tiny_model_dir, RuntimeConfig(max_slots=1, max_len=512, dtype=torch.float32))
    got, delta = rt.prefill(enc, slot=0)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    assert delta < 0  # 64 image tokens on a 8x8 grid take fewer than 64 positions


def test_pages_of_two_sizes_encode_together_as_each_alone(tiny_model_dir, synth_pages):
    """One vision call for several pages keeps each page's attention to itself: the bounds the
    runtime hands transformers from the host's grid (no sync a layer) are the ones it would make."""
    from transformers.vision_utils import get_vision_cu_seqlens

    from ocriaquant.model import load_model
    from ocriaquant.model.processor import chat_text
    from ocriaquant.runtime.config import RuntimeConfig
    from ocriaquant.runtime.model_runner import ModelRunner
    from ocriaquant.runtime.models.qwen3_5 import vision_cu_seqlens

    _, proc = load_model(tiny_model_dir, dtype="fp32")
    a, b = load_pages(synth_pages).pages[:2]
    encs = [dict(proc(images=[img], text=[chat_text(proc, page.prompt)], return_tensors="pt"))
            for page, img in ((a, a.image), (b, b.image.resize((192, 224))))]
    grid = torch.cat([e["image_grid_thw"] for e in encs])
    assert grid[0].tolist() != grid[1].tolist()
    assert torch.equal(vision_cu_seqlens(grid), get_vision_cu_seqlens(grid))
    rt = ModelRunner(tiny_model_dir, RuntimeConfig(max_slots=2, max_len=512, dtype=torch.float32))
    together = rt.encode(encs)
    for enc, got in zip(encs, together):
        alone, = rt.encode([enc])
        assert torch.allclose(got.embeds, alone.embeds, atol=1e-5, rtol=1e-5)
        assert torch.equal(got.positions, alone.positions) and got.delta == alone.delta


@needs_triton
def test_triton_vision_tower_gives_the_torch_backends_page_embeddings(tiny_model_dir, synth_pages):
    """Two pages in one vision call on the triton backend: every block's attention is the kernel
    module (its numerics: the next test) and encode gives the torch backend's embeddings, within
    roundings, and positions. The tiny tower's attention is near uniform, so this checks the wiring."""
    from ocriaquant.model import load_model
    from ocriaquant.model.processor import chat_text
    from ocriaquant.runtime.config import RuntimeConfig
    from ocriaquant.runtime.layers.vision import VisionAttention
    from ocriaquant.runtime.model_runner import ModelRunner

    _, proc = load_model(tiny_model_dir, dtype="fp32")
    encs = [dict(proc(images=[p.image], text=[chat_text(proc, p.prompt)], return_tensors="pt"))
            for p in load_pages(synth_pages).pages[:2]]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    got = {}
    for backend in ("torch", "triton"):
        rt = ModelRunner(tiny_model_dir, RuntimeConfig(backend=backend, device=dev, max_slots=2, max_len=512,
                                                      dtype=torch.bfloat16))
        kernel = [isinstance(b.attn, VisionAttention) for b in rt.model.visual.blocks]
        assert all(kernel) if backend == "triton" else not any(kernel)
        got[backend] = rt.encode(encs)
    for a, b in zip(got["torch"], got["triton"]):
        assert float((b.embeds.float() - a.embeds.float()).norm() / a.embeds.float().norm()) < 1e-2
        assert torch.equal(a.positions, b.positions)


@needs_triton
def test_vision_attention_with_its_kernel_equals_transformers_module():
    """The triton backend's vision attention (vision_rope, then SDPA per image) against transformers'
    Qwen3_5VisionAttention on the same weights, two images in one call, weights large enough that
    attention is far from uniform: the same output but for roundings; the images' bounds matter."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionAttention

    from ocriaquant.model import tiny_config
    from ocriaquant.runtime.layers.vision import VisionAttention

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = tiny_config().vision_config
    cfg.hidden_size, cfg.num_heads, cfg._attn_implementation = 64, 2, "sdpa"
    torch.manual_seed(4)
    hf = Qwen3_5VisionAttention(cfg)
    with torch.no_grad():
        hf.qkv.weight.normal_(0, 0.4)
    hf = hf.to(dev, torch.bfloat16)
    ours = VisionAttention(hf)
    x = torch.randn(64, 64, device=dev).to(torch.bfloat16)
    theta = torch.rand(64, 16, device=dev) * 20
    rope = (torch.cat([theta.cos()] * 2, -1), torch.cat([theta.sin()] * 2, -1))
    bounds = torch.tensor([0, 40, 64], dtype=torch.int32)
    with torch.no_grad():
        want = hf(x, cu_seqlens=bounds, position_embeddings=rope).float()
        got = ours(x, cu_seqlens=bounds, position_embeddings=rope).float()
        one = ours(x, cu_seqlens=torch.tensor([0, 64], dtype=torch.int32), position_embeddings=rope).float()
    err = lambda a: float((a - want).norm() / want.norm())  # noqa: E731
    assert err(got) < 0.01 < err(one)


@pytest.mark.parametrize("which", ["bf16", "mixed"])
def test_runtime_greedy_tokens_equal_transformers(which, request):
    """Four held-out pages with different token limits, two slots: pages join as others
    finish (mid-flight admission) and run in batches of mixed lengths."""
    from ocriaquant.model import load_model
    from ocriaquant.model.generate import greedy_decode
    from ocriaquant.runtime.config import RuntimeConfig
    from ocriaquant.runtime.engine import Engine

    ckpt = None if which == "bf16" else request.getfixturevalue("mixed_checkpoint")
    _, held = split_pages(load_pages(BUNDLED_PAGES).pages)
    pages = held[:4]
    limits = [24, 64, 40, 16]
    engine = Engine(ckpt, RuntimeConfig(max_slots=2))
    steps = []
    results = list(engine.generate(((engine.encode(p), n) for p, n in zip(pages, limits)), on_step=steps.append))
    # Page 2 takes page 0's slot while page 1 runs on; page 3 ends alone: batches of 2 and of 1.
    assert results[0].rid == 0 and results[-1].rid == 3 and 1 in steps and 2 in steps
    ours = {r.rid: r.tokens for r in results}
    model, proc = load_model(ckpt)
    tok = proc.tokenizer
    for i, (page, n) in enumerate(zip(pages, limits)):
        ref = greedy_decode(model, proc, [page], max_new_tokens=n)[0]
        assert len(ours[i]) == n
        assert tok.decode(ours[i], skip_special_tokens=True).strip() == ref, (which, i)


def test_parse_writes_every_readable_page_and_reports_a_corrupt_one(tmp_path):
    from ocriaquant.parse import parse

    pages = tmp_path / "pages"
    pages.mkdir()
    for p in [p for p in sorted(BUNDLED_PAGES.glob("page-*")) if p.suffix != ".md"][:2]:
        shutil.copy(p, pages / p.name)
    (pages / "broken.png").write_bytes(b"\x89PNG not really")
    with pytest.warns(UserWarning, match="broken.png"):
        s = parse(None, pages, tmp_path / "out", max_new_tokens=24, max_batch=2)
    assert s["parsed"] == 2 and [f["path"].endswith("broken.png") for f in s["failed"]] == [True]
    written = sorted(f.name for f in (tmp_path / "out").glob("*.md"))
    assert written == sorted(p.stem + ".md" for p in pages.glob("page-*"))
    assert all((tmp_path / "out" / w).read_text().startswith("#") for w in written)
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["tokens"] > 0
    s2 = parse(None, pages, tmp_path / "out", max_new_tokens=24, max_batch=2)  # rerun: nothing left to do
    assert s2["parsed"] == 0 and s2["already_done"] == 2


def test_runtime_errors_name_the_problem(tiny_model_dir, tmp_path):
    from ocriaquant.errors import OcriaError
    from ocriaquant.runtime.config import RuntimeConfig
    from ocriaquant.runtime.load import quant_schemes
    from ocriaquant.runtime.model_runner import ModelRunner

    other = tmp_path / "llama"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(OcriaError, match="model_type 'llama'.*not supported"):
        ModelRunner(other)
    with pytest.raises(OcriaError, match="unknown runtime backend 'cuda'; one of torch, triton"):
        RuntimeConfig(backend="cuda")
    with pytest.raises(OcriaError, match="group 'group_0'.*not a format ocriaquant serves"):
        quant_schemes({"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {"group_0": {
            "targets": ["x"], "weights": {"type": "int", "num_bits": 4, "strategy": "group"}}}}})
    with pytest.raises(OcriaError, match="method 'gptq'"):
        quant_schemes({"quantization_config": {"quant_method": "gptq"}})
    # A checkpoint that lost a tensor: the error names it.
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    f = next(broken.glob("*.safetensors"))
    sd = load_file(str(f))
    del sd["model.language_model.layers.0.mlp.down_proj.weight"]
    save_file(sd, str(f), metadata={"format": "pt"})
    with pytest.raises(OcriaError, match="missing tensors model.language_model.layers.0.mlp.down_proj.weight"):
        ModelRunner(broken)


@needs_triton
def test_w4a4_candidate_decodes_through_cuda_graphs_as_the_torch_backend(tiny_model_dir):
    """A b200 (W4A4) candidate as search builds it in memory: its activation rounding runs inside the
    decode step, so it must capture into a CUDA graph (no host copy) and give the torch backend's
    greedy tokens. On a GPU through the graphs; on the CPU the kernels under the interpreter."""
    from ocriaquant.runtime.config import RuntimeConfig
    from ocriaquant.runtime.load import MemoryStore, TensorStore, quantize_in_memory
    from ocriaquant.runtime.model_runner import ModelRunner

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    base = TensorStore(tiny_model_dir)
    tensors = {k: base.get(k).to(dev) for k in base.where}
    names = ["model.language_model.layers.0.mlp.gate_proj", "model.language_model.layers.0.mlp.up_proj",
             "model.language_model.layers.2.mlp.down_proj"]
    absmax = {n: torch.tensor(4.0) for n in names}
    units = [(names[:2], "nvfp4_w4a4"), (names[2:], "nvfp4_w4a4")]
    torch.manual_seed(5)
    prompts = [torch.randint(0, 250, (1, n)) for n in (9, 6)]
    got = {}
    for backend in ("torch", "triton"):
        qt, kinds = quantize_in_memory(tensors, units, absmax)
        assert set(kinds.values()) == {"nvfp4_w4a4"}
        rt = ModelRunner(None, RuntimeConfig(device=dev, max_slots=3, max_len=32, backend=backend),
                         source=(load_config(tiny_model_dir), MemoryStore(qt, "w4a4 (in memory)"), kinds))
        assert rt.capture_buckets(3) == ([1, 2, 4] if rt.use_graphs else [])
        for s, p in zip((2, 0), prompts):
            rt.prefill({"input_ids": p}, slot=s)
        tokens, lengths, out = [int(p[0, -1]) for p in prompts], [9, 6], []
        for _ in range(4):
            tokens = rt.greedy_step(tokens, [2, 0], lengths, [0, 0]).get()
            lengths = [n + 1 for n in lengths]
            out.append(tokens)
        got[backend] = out
    assert got["triton"] == got["torch"]


def _mixed_checkpoint(tiny_model_dir, synth_pages, tmp_path):
    """The tiny model exported with every format mix a layer can have: FP8 and NVFP4 mixers and MLPs,
    fused and apart, BF16 between."""
    from ocriaquant.artifacts import model_fingerprint
    from ocriaquant.export import export

    plan = {"layers.0.gdn_in": "nvfp4", "layers.0.gdn_out": "fp8", "layers.0.mlp_up": "nvfp4", "layers.0.mlp_down": "fp8",
            "layers.1.gdn_in": "fp8", "layers.1.gdn_out": "nvfp4", "layers.3.attn_qkv": "fp8", "layers.3.attn_o": "fp8",
            "layers.3.mlp_down": "nvfp4", "layers.2.mlp_up": "nvfp4", "layers.2.mlp_down": "nvfp4"}
    (tmp_path / "plan.json").write_text(json.dumps({"target": "h200", "groups": plan, "model_dir": str(tiny_model_dir),
                                                    "calibration": {"fingerprint": model_fingerprint(tiny_model_dir)}}))
    return export(tmp_path / "plan.json", tmp_path / "ckpt", pages=synth_pages, max_pages=1, verify_pages=0)


@needs_triton
def test_triton_prefill_above_the_gemv_rows_matches_torch_backend(tiny_model_dir, synth_pages, tmp_path, monkeypatch):
    """A prefill of more rows than the GEMVs take, two chunks in one pass (one continuing its slot): the
    triton backend's norms fused with the residual adds, writing the FP8 projections' codes (add_rmsnorm),
    and silu·mul with down_proj's input (silu_mul_quant) give the torch backend's logits and GDN states."""
    from ocriaquant.runtime.config import RuntimeConfig
    from ocriaquant.runtime.kernels import add_rmsnorm as norm_module
    from ocriaquant.runtime.layers import Chunk
    from ocriaquant.runtime.model_runner import ModelRunner

    ckpt = _mixed_checkpoint(tiny_model_dir, synth_pages, tmp_path)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(2)
    ids = [torch.randint(0, 250, (1, n)) for n in (90, 120)]
    quant_calls = []
    real = norm_module.add_rmsnorm
    monkeypatch.setattr(norm_module, "add_rmsnorm", lambda *a, **k: quant_calls.append(a[4] if len(a) > 4 else None)
                        or real(*a, **k))
    runs = {}
    for backend in ("torch", "triton"):
        rt = ModelRunner(ckpt, RuntimeConfig(device=dev, max_slots=2, max_len=160, backend=backend))
        a, b = rt.encode([{"input_ids": i} for i in ids])
        rt.prefill_chunks([(b, Chunk(1, 0, 40))])  # slot 1 continues from 40 below
        logits = rt.prefill_chunks([(a, Chunk(0, 0, 90)), (b, Chunk(1, 40, 80))])
        runs[backend] = (logits.float().cpu(), torch.stack([rt.state[0]["ssm"][:2], rt.state[1]["ssm"][:2]]).cpu(),
                         rt.state[0]["conv"][:2].float().cpu())
    (lt, st, ct), (lk, sk, ck) = runs["torch"], runs["triton"]
    assert "fp8" in quant_calls  # the FP8 projections' codes came from the norm
    assert torch.equal(lk.argmax(-1), lt.argmax(-1)) and float((lk - lt).norm() / lt.norm()) <= 2e-2
    assert float((sk - st).norm() / st.norm()) <= 2e-2 and float((ck - ct).norm() / ct.norm()) <= 2e-2


@needs_triton
def test_triton_backend_decode_matches_torch_backend(tiny_model_dir, synth_pages, tmp_path):
    """Decode steps through gdn_decode, the GEMVs and silu_mul_quant give the torch backend's
    logits and GDN state on a mixed FP8 / NVFP4 checkpoint: on the GPU when there is one, else on
    the CPU under Triton's interpreter."""
    from ocriaquant.runtime.config import RuntimeConfig
    from ocriaquant.runtime.model_runner import ModelRunner

    ckpt = _mixed_checkpoint(tiny_model_dir, synth_pages, tmp_path)
    torch.manual_seed(1)
    prompts = [torch.randint(0, 250, (1, n)) for n in (9, 6)]
    runs = {}
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for backend in ("torch", "triton"):
        rt = ModelRunner(ckpt, RuntimeConfig(device=dev, max_slots=3, max_len=32, backend=backend))
        lengths = torch.tensor([9, 6], device=dev)
        tokens = torch.stack([p[0, -1] for p in prompts]).to(dev)
        for s, p in zip((2, 0), prompts):
            rt.prefill({"input_ids": p}, slot=s)
        out = []
        for _ in range(3):
            logits = rt.decode(tokens, torch.tensor([2, 0], device=dev), lengths, torch.tensor([0, 0], device=dev))
            out.append(logits.float())
            tokens, lengths = logits.argmax(-1), lengths + 1
        untouched = torch.equal(rt.state[0]["ssm"][1], torch.zeros_like(rt.state[0]["ssm"][1]))  # no row on slot 1
        # batch 1: the weight-streaming GEMVs of every format (above it BF16 and NVFP4 use cuBLAS)
        rt.prefill({"input_ids": prompts[0]}, slot=1)
        one = rt.decode(*(torch.tensor(v, device=dev) for v in ([int(prompts[0][0, -1])], [1], [9], [0])))
        runs[backend] = (torch.stack(out).cpu(), rt.state[0]["ssm"][[0, 2]].cpu(), one.float().cpu())
        assert untouched
        # layer 2's NVFP4 gate_up ran at batch 1 with silu·mul in its epilogue (gemv_nvfp4_silu)
        mlps = [layer.mlp for layer in rt.model.layers]
        assert (backend == "triton") == bool(mlps[2].gate_up and mlps[2].gate_up.linear.m1_interleaved)
        # layer 1's BF16 gate_up ran at batch 1 with silu·mul in its epilogue (gemv_bf16 silu)
        assert (backend == "triton") == mlps[1].fused_silu_bf16()
    (lt, st, ot), (lk, sk, ok) = runs["torch"], runs["triton"]
    assert float((ok - ot).norm() / ot.norm()) <= 2e-2
    assert not torch.equal(lk, lt) and not torch.equal(sk, st)  # the kernels ran (fp32 GDN, other sum order)
    assert float((lk - lt).norm() / lt.norm()) <= 2e-2
    assert float((sk - st).norm() / st.norm()) <= 1e-2


# Tiles of today's 4B decode step (the rule they were swept into, evaluated before tiles became
# data): every speed in BENCHMARKS.md ran at these, so the default table must keep them.
PINNED_4B_TILES = {
    ("fp8", 2560, 9216, 1): {"block_n": 64, "block_k": 512, "split_k": 8, "num_warps": 8},
    ("nvfp4", 2560, 9216, 1): {"block_n": 8, "block_k": 1024, "split_k": 3, "num_warps": 2},
    ("fp8_qx", 2560, 4096, 1): {"block_n": 128, "block_k": 256, "split_k": 8, "num_warps": 8},
    ("fp8", 2560, 4096, 1): {"block_n": 8, "block_k": 4096, "split_k": 1, "num_warps": 4},
    ("nvfp4", 2560, 4096, 1): {"block_n": 4, "block_k": 4096, "split_k": 1, "num_warps": 4},
    ("fp8", 12352, 2560, 1): {"block_n": 64, "block_k": 512, "num_warps": 8},
    ("fp8", 10240, 2560, 1): {"block_n": 64, "block_k": 512, "num_warps": 8},
    ("nvfp4", 12288, 2560, 1): {"block_n": 64, "block_k": 512, "num_warps": 8},
    ("nvfp4", 8192, 2560, 1): {"block_n": 64, "block_k": 512, "num_warps": 8},
    ("nvfp4_silu", 18432, 2560, 1): {"block_n": 32, "block_k": 512},
    ("nvfp4", 18432, 2560, 1): {"block_n": 32, "block_k": 512},
    ("fp8", 18432, 2560, 1): {"block_n": 32, "block_k": 512},
    ("bf16", 18432, 2560, 1): {"block_n": 4, "block_k": 512},
    ("bf16", 248320, 2560, 1): {"block_n": 16, "block_k": 512},
    ("bf16", 2560, 9216, 1): {"block_n": 4, "block_k": 1024, "num_warps": 8},
    ("bf16", 2560, 4096, 1): {"block_n": 4, "block_k": 1024, "num_warps": 8},
    ("bf16", 12352, 2560, 1): {"block_n": 8, "block_k": 512},
    ("fp8", 12352, 2560, 8): {"block_n": 64, "block_k": 256, "num_warps": 4, "num_stages": 3, "split_k": 1},
    ("fp8", 12352, 2560, 64): {"block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 4, "split_k": 1},
    ("fp8", 18432, 2560, 33): {"block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 4, "split_k": 1},
    ("fp8", 2560, 9216, 32): {"block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 8, "split_k": 3},
    ("fp8", 2560, 4096, 2): {"block_n": 64, "block_k": 256, "num_warps": 4, "num_stages": 6, "split_k": 1},
}


def test_default_tile_table_keeps_the_4b_tiles():
    from ocriaquant.runtime.tiles import TileTable

    table = TileTable.default()
    assert table.gpu == "H200"
    for key, tile in PINNED_4B_TILES.items():
        assert table.find(*key) == tile, key


def _meta_store(shape: str, plan: str):
    """(config, MemoryStore, kinds) of a named shape on the meta device, quantized as bench's
    build path quantizes it (one NVFP4 global scale per unit: plan_units) or, for "export-<fmt>",
    as `ocriaquant export` groups it (gdn_in, attn_qkv, mlp_up one unit each; gdn_ab BF16)."""
    from transformers import Qwen3_5ForConditionalGeneration

    from ocriaquant.bench import plan_units
    from ocriaquant.model import discover_groups
    from ocriaquant.model.configs import SHAPES
    from ocriaquant.runtime.load import MemoryStore

    config = SHAPES[shape]()
    with torch.device("meta"):
        hf = Qwen3_5ForConditionalGeneration(config)
    tensors = dict(hf.state_dict())
    if plan.startswith("export-"):
        units = [(g.members, plan[len("export-"):]) for g in discover_groups(hf)
                 if not g.always_bf16 and g.kind != "lm_head"]
    else:
        units = plan_units(config, plan) if plan != "bf16" else []
    kinds = {}
    for u, (names, fmt) in enumerate(units):
        gs = torch.tensor([float(u + 1)])  # kept off the meta device: fusion compares global scales
        for name in names:
            n, k = tensors.pop(name + ".weight").shape
            kinds[name] = fmt
            if fmt == "fp8":
                tensors[name + ".weight"] = torch.empty(n, k, dtype=torch.float8_e4m3fn, device="meta")
                tensors[name + ".weight_scale"] = torch.empty(n, 1, device="meta")
            else:
                tensors[name + ".weight_packed"] = torch.empty(n, k // 2, dtype=torch.uint8, device="meta")
                tensors[name + ".weight_scale"] = torch.empty(n, k // 16, dtype=torch.float8_e4m3fn, device="meta")
                tensors[name + ".weight_global_scale"] = gs
    return config, MemoryStore(tensors, f"{shape} {plan} (meta)"), kinds


@pytest.mark.parametrize("plan", ["bf16", "mixed", "fp8", "nvfp4", "export-fp8", "export-nvfp4"])
def test_every_4b_gemv_finds_its_tile_in_the_default_table(plan):
    """Built as the triton backend builds it (fused where formats and scales allow), every Linear
    of the 4B looks up tiles the default table holds, at batch 1 and, for FP8, at every batch up
    to 64: no shape of the 4B falls to the generic tile."""
    from ocriaquant.runtime.config import Kernels
    from ocriaquant.runtime.models.qwen3_5 import Qwen3_5
    from ocriaquant.runtime.tiles import TileTable

    config, store, kinds = _meta_store("qwen3.5-4b", plan)
    table = TileTable.default()
    with torch.device("meta"):
        model = Qwen3_5(config, store, kinds, kernels=Kernels(pdl=False, tiles=table))
    keys = model.tile_keys()
    missing = sorted(key for key in keys if table.find(*key) is None)
    assert not missing, missing[:10]
    # the fusions this plan gets, each a shape of its own
    shapes = {(kind, n, k) for kind, n, k, m in keys if m == 1}
    want = {"bf16": {("bf16", 12352, 2560), ("bf16", 10240, 2560), ("bf16", 18432, 2560)},
            "mixed": {("fp8", 12352, 2560), ("fp8_qx", 2560, 4096), ("nvfp4_silu", 18432, 2560)},
            "nvfp4": {("nvfp4", 8192, 2560), ("nvfp4", 32, 2560), ("nvfp4", 1024, 2560), ("nvfp4_silu", 18432, 2560)},
            "export-nvfp4": {("nvfp4", 12288, 2560), ("bf16", 64, 2560), ("nvfp4", 10240, 2560)},
            "export-fp8": {("fp8", 12288, 2560), ("bf16", 64, 2560), ("fp8", 18432, 2560)}}.get(plan, set())
    assert want <= shapes
    assert ("bf16", 248320, 2560) in shapes  # the tied lm_head


def test_tile_table_files_are_checked_entry_by_entry(tmp_path):
    from ocriaquant.errors import OcriaError
    from ocriaquant.runtime.tiles import GENERIC_DOT, GENERIC_M1, TileTable

    def table(*entries):
        path = tmp_path / "t.json"
        path.write_text(json.dumps({"gpu": "test", "tiles": list(entries)}))
        return TileTable.load(path)

    good = {"kind": "fp8", "n": 64, "k": 256, "block_n": 32, "block_k": 256, "num_warps": 4}
    t = table(good, {**good, "m": [2, 8], "split_k": 2}, {**good, "m": [9, 64], "num_stages": 3})
    assert len(t) == 3 and t.find("fp8", 64, 256, 5)["split_k"] == 2 and t.find("fp8", 64, 256, 64)["num_stages"] == 3
    assert t.find("fp8", 64, 512) is None and t.tile("fp8", 64, 512) == GENERIC_M1
    assert t.tile("fp8", 64, 512, 4) == GENERIC_DOT and t.tile("nvfp4_silu", 64, 512)["block_n"] % 32 == 0
    for bad, problem in [({**good, "kind": "int4"}, "kind 'int4' is not one of"),
                         ({**good, "block_n": 48}, "block_n must be a power of two"),
                         ({**good, "block_k": 0}, "block_k must be a positive integer"),
                         ({**good, "maxnreg": 128}, "unknown field"),
                         ({**good, "kind": "bf16", "m": [2, 4]}, "only fp8 and nvfp4 have tiles above batch 1"),
                         ({**good, "m": [8, 65]}, "batch range"),
                         ({**good, "kind": "nvfp4_silu", "split_k": 2}, "nvfp4_silu takes whole 32-row tiles"),
                         ({k: v for k, v in good.items() if k != "block_k"}, "block_k is missing")]:
        with pytest.raises(OcriaError, match=r"t\.json: tile entry 1 .*" + problem):
            table(good, bad)
    with pytest.raises(OcriaError, match=r"t\.json: tile entry 2 .*batches 4-9 overlap .*fp8 64x256 \(batches 2-8\)"):
        table(good, {**good, "m": [2, 8]}, {**good, "m": [4, 9]})
    (tmp_path / "t.json").write_text("{not json")
    with pytest.raises(OcriaError, match=r"t\.json: not a readable JSON tile table"):
        TileTable.load(tmp_path / "t.json")
    with pytest.raises(OcriaError, match="no such tile table"):
        TileTable.load(tmp_path / "none.json")


def test_runtime_config_is_checked_and_pdl_has_one_switch(monkeypatch):
    from ocriaquant.errors import OcriaError
    from ocriaquant.runtime.config import RuntimeConfig

    assert RuntimeConfig().kernel_settings() is None  # the torch backend launches nothing
    monkeypatch.setenv("OCRIAQUANT_PDL", "0")
    assert RuntimeConfig().pdl is False
    monkeypatch.delenv("OCRIAQUANT_PDL")
    cfg = RuntimeConfig(backend="triton")
    assert cfg.pdl is True and cfg.kernel_settings().pdl is False  # never on the CPU
    with pytest.raises(OcriaError, match="at least 1 slot"):
        RuntimeConfig(max_slots=0)


@needs_triton
def test_linears_launch_with_the_tiles_and_pdl_of_their_config(monkeypatch):
    """A Linear built for the triton backend launches its GEMV with its table's tile for that
    batch, and the config's PDL setting."""
    import ocriaquant.runtime.kernels.gemv_fp8 as gemv_fp8_module
    from ocriaquant.quant import fp8
    from ocriaquant.runtime.config import Kernels
    from ocriaquant.runtime.layers import QuantLinear
    from ocriaquant.runtime.tiles import TileTable

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    table = TileTable([{"kind": "fp8", "n": 64, "k": 256, "block_n": 32, "block_k": 128, "num_warps": 4},
                       {"kind": "fp8", "n": 64, "k": 256, "m": [2, 64], "block_n": 64, "block_k": 64,
                        "num_warps": 4, "num_stages": 2, "split_k": 2}])
    seen = []
    real = gemv_fp8_module.gemv_fp8
    monkeypatch.setattr(gemv_fp8_module, "gemv_fp8", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    w_q, w_s = fp8.quantize_weight(torch.randn(64, 256, dtype=torch.bfloat16) / 16)
    lin = QuantLinear("fp8", w_q, w_s, kernels=Kernels(pdl=False, tiles=table)).to(dev)
    for m in (1, 4):
        x = torch.randn(m, 256, dtype=torch.bfloat16, device=dev)
        torch.testing.assert_close(lin(x).float(), QuantLinear("fp8", w_q, w_s).to(dev)(x).float(), atol=2e-2,
                                   rtol=2e-2)
    assert [(kw["block_n"], kw["block_k"], kw["pdl"]) for kw in seen] == [(32, 128, False), (64, 64, False)]
    assert seen[1]["split_k"] == 2 and seen[1]["num_stages"] == 2


@needs_triton
def test_nvfp4_above_batch_1_runs_the_tensor_core_gemv_where_the_table_has_a_tile(monkeypatch):
    """An NVFP4 Linear above batch 1 reads its packed weight through gemv_nvfp4's tensor-core form
    at the batches its table has a tile for, and runs cuBLAS on the dequantized weight at the others:
    both within bf16 rounding of the float64 product of the checkpoint's values."""
    import ocriaquant.runtime.kernels.gemv_nvfp4 as gemv_nvfp4_module
    from ocriaquant.quant import nvfp4
    from ocriaquant.runtime.config import Kernels
    from ocriaquant.runtime.layers import QuantLinear
    from ocriaquant.runtime.tiles import TileTable

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    table = TileTable([{"kind": "nvfp4", "n": 64, "k": 256, "m": [2, 8], "block_n": 32, "block_k": 128,
                        "num_warps": 4, "num_stages": 2, "split_k": 2}])
    seen = []
    real = gemv_nvfp4_module.gemv_nvfp4
    monkeypatch.setattr(gemv_nvfp4_module, "gemv_nvfp4", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    torch.manual_seed(0)
    w = torch.randn(64, 256, dtype=torch.bfloat16) / 16
    packed, scale, gs = nvfp4.quantize_weight(w)
    lin = QuantLinear("nvfp4", packed, scale, gs, kernels=Kernels(pdl=False, tiles=table)).to(dev)
    w64 = nvfp4.dequantize(packed, scale, gs, torch.float64).to(dev)
    for m in (4, 9):
        x = torch.randn(m, 256, dtype=torch.bfloat16, device=dev)
        torch.testing.assert_close(lin(x).double(), x.double() @ w64.T, atol=2e-2, rtol=2e-2)
    assert [(kw["path"], kw["block_n"], kw["split_k"]) for kw in seen] == [("dot", 32, 2)]  # m = 9: cuBLAS


def test_torch_backend_runs_without_triton(tiny_model_dir):
    """Triton is optional: the torch backend imports no kernel module (only kernels/reference.py
    and kernels/partials.py, which are plain torch)."""
    import subprocess
    import sys

    code = f"""
import sys
sys.modules["triton"] = None  # import triton now fails
import torch
from ocriaquant.runtime.config import RuntimeConfig
from ocriaquant.runtime.model_runner import ModelRunner
rt = ModelRunner({str(tiny_model_dir)!r}, RuntimeConfig(max_slots=2, max_len=16))
rt.prefill({{"input_ids": torch.tensor([[5, 6, 7]])}}, slot=0)
print(rt.greedy_step([8], [0], [3], [0]).get(), rt.greedy_step(None, [0], [4], [0]).get())
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]


@needs_triton
def test_fp8_prefill_rows_are_the_w8a8_product_of_the_checkpoint():
    """Above the GEMVs' 64 rows, an FP8 Linear of the triton backend multiplies E4M3 activations
    (quantized per token, as the checkpoint's dynamic scheme does) by the E4M3 weight with both
    scales on the fp32 sums: within bf16 rounding of that product in float64, and of the torch
    backend's fake-quantized BF16 product."""
    from ocriaquant.quant import fp8
    from ocriaquant.runtime.config import RuntimeConfig
    from ocriaquant.runtime.layers import QuantLinear

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    x = torch.randn(80, 256, dtype=torch.bfloat16, device=dev) * 3
    w_q, w_s = fp8.quantize_weight(torch.randn(96, 256, dtype=torch.bfloat16, device=dev) / 16)
    kernels = RuntimeConfig(backend="triton", device=dev).kernel_settings()
    got = QuantLinear("fp8", w_q, w_s, kernels=kernels)(x)
    x_q, x_s = fp8.quantize_activation(x)
    exact = (x_q.double() * x_s.double()) @ (w_q.double() * w_s.double()).T
    err = (got.double() - exact).abs()
    assert got.dtype == torch.bfloat16 and bool((err <= exact.abs() * 2**-8 + 1e-6).all())
    torch_path = QuantLinear("fp8", w_q, w_s)(x).double()
    assert float((torch_path - exact).norm() / exact.norm()) < 1e-2
    assert not torch.equal(got, QuantLinear("bf16", fp8.dequantize(w_q, w_s, torch.bfloat16))(x))  # not BF16


def test_recurrent_step_is_transformers_recurrence_token_by_token():
    """The torch path's GDN decode step (layers/gdn.recurrent_step: in place, in the cache's [V, K] state layout)
    against transformers' torch_recurrent_gated_delta_rule ([K, V]) over three tokens: states equal to fp32
    rounding, outputs to bf16's."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    from ocriaquant.runtime.layers.gdn import recurrent_step

    g0 = torch.Generator().manual_seed(3)
    B, HV, K, V = 3, 4, 16, 8
    state = torch.randn(B, HV, V, K, generator=g0) * 0.1
    state_tf = state.transpose(-1, -2).contiguous()
    for _ in range(3):
        q, k = (torch.randn(B, HV, K, generator=g0).to(torch.bfloat16) for _ in range(2))
        v = torch.randn(B, HV, V, generator=g0).to(torch.bfloat16)
        g, beta = -torch.rand(B, HV, generator=g0), torch.rand(B, HV, generator=g0)
        out = recurrent_step(q, k, v, g, beta, state)
        want, state_tf = torch_recurrent_gated_delta_rule(q[:, None], k[:, None], v[:, None], g=g[:, None],
                                                          beta=beta[:, None], initial_state=state_tf,
                                                          output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(state, state_tf.transpose(-1, -2), rtol=1e-6, atol=1e-6)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), want[:, 0].float(), rtol=2 ** -7, atol=1e-6)
