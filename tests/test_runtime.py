"""Our runtime against transformers: state layout, greedy tokens, `parse`."""

import json
import os
import shutil

import pytest
import torch

from ocriaquant.data import BUNDLED_PAGES, load_pages, split_pages


def test_prefill_then_decode_equals_longer_prefill(tiny_model_dir):
    """Prefill N tokens then decode 1 ≡ prefill N+1: catches a transposed GDN state ([V, K]
    written, [K, V] read), a wrong conv-state shift or a KV cache written at the wrong place."""
    from ocriaquant.runtime.model_runner import RuntimeModel

    rt = RuntimeModel(tiny_model_dir, max_slots=3, max_len=64, dtype=torch.float32)
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
    from ocriaquant.runtime.model_runner import RuntimeModel

    rt = RuntimeModel(tiny_model_dir, max_slots=3, max_len=40, device=device, backend=backend,
                      dtype=torch.float32 if backend == "torch" else torch.bfloat16)
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
    from ocriaquant.runtime.model_runner import RuntimeModel

    model, proc = load_model(tiny_model_dir, dtype="fp32")
    page = load_pages(synth_pages).pages[0]
    enc = dict(proc(images=[page.image], text=[chat_text(proc, page.prompt)], return_tensors="pt"))
    with torch.no_grad():
        want = model(**enc).logits[0, -1]
    rt = RuntimeModel(tiny_model_dir, max_slots=1, max_len=512, dtype=torch.float32)
    got, delta = rt.prefill(enc, slot=0)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    assert delta < 0  # 64 image tokens on a 8x8 grid take fewer than 64 positions


@pytest.fixture(scope="module")
def mixed_checkpoint(tmp_path_factory):
    """The bundled model exported with a mixed FP8 / NVFP4 plan (h200: weight-only NVFP4)."""
    from ocriaquant.calibrate import model_fingerprint
    from ocriaquant.export import export
    from ocriaquant.model import DEFAULT_MODEL, discover_groups, load_config, meta_model

    tmp = tmp_path_factory.mktemp("mixed")
    groups = discover_groups(meta_model(load_config(DEFAULT_MODEL)))
    fmt = {"mlp_up": "nvfp4", "mlp_down": "nvfp4", "gdn_in": "fp8", "gdn_out": "fp8", "attn_qkv": "fp8",
           "attn_o": "fp8"}
    plan = {g.name: fmt.get(g.kind, "bf16") for g in groups if not g.always_bf16}
    (tmp / "plan.json").write_text(json.dumps({"target": "h200", "groups": plan, "model_dir": str(DEFAULT_MODEL),
                                               "calibration": {"fingerprint": model_fingerprint(DEFAULT_MODEL)}}))
    return export(tmp / "plan.json", tmp / "ckpt", max_pages=2, verify_pages=0)


@pytest.mark.parametrize("which", ["bf16", "mixed"])
def test_runtime_greedy_tokens_equal_transformers(which, request):
    """Four held-out pages with different token limits, two slots: pages join as others
    finish (mid-flight admission) and run in batches of mixed lengths."""
    from ocriaquant.model import load_model
    from ocriaquant.model.generate import greedy_decode
    from ocriaquant.runtime.engine import Engine

    ckpt = None if which == "bf16" else request.getfixturevalue("mixed_checkpoint")
    _, held = split_pages(load_pages(BUNDLED_PAGES).pages)
    pages = held[:4]
    limits = [24, 64, 40, 16]
    engine = Engine(ckpt, max_slots=2)
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
    for p in [p for p in sorted(BUNDLED_PAGES.glob("*.png"))[:2]]:
        shutil.copy(p, pages / p.name)
    (pages / "broken.png").write_bytes(b"\x89PNG not really")
    with pytest.warns(UserWarning, match="broken.png"):
        s = parse(None, pages, tmp_path / "out", max_new_tokens=24, max_batch=2)
    assert s["parsed"] == 2 and [f["path"].endswith("broken.png") for f in s["failed"]] == [True]
    written = sorted(f.name for f in (tmp_path / "out").glob("*.md"))
    assert written == sorted(p.stem + ".md" for p in pages.glob("page-*.png"))
    assert all((tmp_path / "out" / w).read_text().startswith("#") for w in written)
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["tokens"] > 0
    s2 = parse(None, pages, tmp_path / "out", max_new_tokens=24, max_batch=2)  # rerun: nothing left to do
    assert s2["parsed"] == 0 and s2["already_done"] == 2


def test_runtime_errors_name_the_problem(tiny_model_dir, tmp_path):
    from ocriaquant.errors import OcriaError
    from ocriaquant.runtime.load import quant_schemes
    from ocriaquant.runtime.model_runner import RuntimeModel

    other = tmp_path / "llama"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(OcriaError, match="model_type 'llama'.*not supported"):
        RuntimeModel(other)
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
        RuntimeModel(broken)


@pytest.mark.skipif(not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1",
                    reason="the triton backend needs a GPU or TRITON_INTERPRET=1")
def test_triton_backend_decode_matches_torch_backend(tiny_model_dir, synth_pages, tmp_path):
    """Decode steps through gdn_decode, the GEMVs and silu_mul_quant give the torch backend's
    logits and GDN state on a mixed FP8 / NVFP4 checkpoint: on the GPU when there is one, else on
    the CPU under Triton's interpreter."""
    from ocriaquant.calibrate import model_fingerprint
    from ocriaquant.export import export
    from ocriaquant.runtime.model_runner import RuntimeModel

    plan = {"layers.0.gdn_in": "nvfp4", "layers.0.gdn_out": "fp8", "layers.0.mlp_up": "nvfp4", "layers.0.mlp_down": "fp8",
            "layers.1.gdn_in": "fp8", "layers.1.gdn_out": "nvfp4", "layers.3.attn_qkv": "fp8", "layers.3.attn_o": "fp8",
            "layers.3.mlp_down": "nvfp4", "layers.2.mlp_up": "nvfp4", "layers.2.mlp_down": "nvfp4"}
    (tmp_path / "plan.json").write_text(json.dumps({"target": "h200", "groups": plan, "model_dir": str(tiny_model_dir),
                                                    "calibration": {"fingerprint": model_fingerprint(tiny_model_dir)}}))
    ckpt = export(tmp_path / "plan.json", tmp_path / "ckpt", pages=synth_pages, max_pages=1, verify_pages=0)
    torch.manual_seed(1)
    prompts = [torch.randint(0, 250, (1, n)) for n in (9, 6)]
    runs = {}
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for backend in ("torch", "triton"):
        rt = RuntimeModel(ckpt, device=dev, max_slots=3, max_len=32, backend=backend)
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
        assert (backend == "triton") == bool(rt.layers[2].mlp.gate_up and rt.layers[2].mlp.gate_up.linear.m1_interleaved)
        # layer 1's BF16 gate_up ran at batch 1 with silu·mul in its epilogue (gemv_bf16 silu)
        assert (backend == "triton") == rt.layers[1].mlp.fused_silu_bf16()
    (lt, st, ot), (lk, sk, ok) = runs["torch"], runs["triton"]
    assert float((ok - ot).norm() / ot.norm()) <= 2e-2
    assert not torch.equal(lk, lt) and not torch.equal(sk, st)  # the kernels ran (fp32 GDN, other sum order)
    assert float((lk - lt).norm() / lt.norm()) <= 2e-2
    assert float((sk - st).norm() / st.norm()) <= 1e-2
