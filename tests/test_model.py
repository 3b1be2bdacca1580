import json

import pytest
import torch
from torch import nn

from ocriaquant.data.synth import make_page
from ocriaquant.errors import OcriaError
from ocriaquant.model import (FORMATS, chat_text, discover_groups, load_config, load_model, meta_model,
                              qwen35_4b_config, tiny_config)
from ocriaquant.model.groups import decode_bytes, decoder_linear_params, unassigned_linears


def test_groups_cover_every_linear_exactly_once():
    from transformers import Qwen3_5ForConditionalGeneration

    model = Qwen3_5ForConditionalGeneration(tiny_config(layers=8))
    groups = discover_groups(model)
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    members = [m for g in groups for m in g.members]
    assert len(members) == len(set(members)) and set(members) == linears
    assert unassigned_linears(model, groups) == []
    kinds = [g.kind for g in groups]
    assert kinds[0] == "vision" and kinds[-1] == "lm_head"
    # 3:1 GDN:attention -> 6 GDN and 2 attention layers.
    assert kinds.count("gdn_in") == 6 and kinds.count("attn_qkv") == 2 and kinds.count("mlp_up") == 8
    by = {g.name: g for g in groups}
    assert [m.rsplit(".", 1)[1] for m in by["layers.0.gdn_in"].members] == ["in_proj_qkv", "in_proj_z"]
    assert [m.rsplit(".", 1)[1] for m in by["layers.3.attn_qkv"].members] == ["q_proj", "k_proj", "v_proj"]
    assert by["layers.0.gdn_ab"].always_bf16 and by["vision"].always_bf16
    assert by["layers.0.mlp_up"].fused and not by["layers.0.mlp_down"].fused
    # Non-Linear parameters (conv1d, norms, A_log, dt_bias, embeddings) are in no group.
    assert not any("conv1d" in m or "norm" in m or "embed" in m for m in members)
    # Shapes and params come from the modules themselves.
    mod = model.get_submodule(by["layers.0.mlp_down"].members[0])
    assert by["layers.0.mlp_down"].params == mod.weight.numel()


def test_bytes_per_format():
    model = meta_model(tiny_config())
    groups = discover_groups(model)
    g = next(g for g in groups if g.kind == "mlp_up")
    assert g.bytes("bf16") == 2 * g.params and g.bytes("fp8") == g.params and g.bytes("nvfp4") == 4.5 / 8 * g.params
    ab = next(g for g in groups if g.kind == "gdn_ab")
    assert ab.bytes("nvfp4") == ab.bytes("bf16")
    with pytest.raises(ValueError, match="unknown format"):
        g.bytes("int4")
    # A plan dict overrides per group; vision is never counted per step.
    all_bf16 = decode_bytes(groups, "bf16")
    assert decode_bytes(groups, {g.name: "fp8"}) == all_bf16 - g.params


def test_qwen35_4b_shape_on_meta():
    model = meta_model(qwen35_4b_config())
    types = model.config.text_config.layer_types
    assert types.count("linear_attention") == 24 and types.count("full_attention") == 8
    params = decoder_linear_params(discover_groups(model))
    assert abs(params - 3.57e9) / 3.57e9 < 0.01
    assert next(model.parameters()).device.type == "meta"
    # Reference figure (DESIGN.md): 8.41 GB of BF16 weights per decode step.
    assert abs(decode_bytes(discover_groups(model), "bf16") - 8.41e9) / 8.41e9 < 0.005


def test_load_tiny_model_and_run_a_page(tiny_model_dir):
    model, proc = load_model(tiny_model_dir, dtype="fp32")
    page = make_page(2)
    inputs = proc(images=[page.image], text=[chat_text(proc, page.prompt if hasattr(page, "prompt") else "x")],
                  return_tensors="pt")
    ids = inputs["input_ids"][0]
    n_img = int((ids == model.config.image_token_id).sum())
    grid = inputs["image_grid_thw"][0]
    assert n_img == int(grid.prod()) // 4 > 0
    # mm_token_type_ids marks exactly the image tokens (transformers needs it for image positions).
    assert torch.equal(inputs["mm_token_type_ids"][0].bool(), ids == model.config.image_token_id)
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape == (1, ids.numel(), model.config.text_config.vocab_size)
    assert torch.isfinite(logits).all()


def test_not_qwen35_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(OcriaError, match="llama.*not supported.*Qwen3.5"):
        load_config(tmp_path)
    with pytest.raises(OcriaError, match="not a directory"):
        load_model(tmp_path / "missing")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(OcriaError, match="not valid JSON"):
        load_config(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(OcriaError, match="config.json"):
        load_config(empty)


def test_bundled_model_loads_and_has_reference_shape():
    model, proc = load_model()
    groups = discover_groups(model)
    assert sum(g.kind == "gdn_in" for g in groups) == 6 and sum(g.kind == "attn_qkv" for g in groups) == 2
    assert model.dtype == torch.bfloat16
    assert proc.tokenizer.decode(proc.tokenizer("| a | 1.5 |\n- x")["input_ids"]) == "| a | 1.5 |\n- x"
    assert set(FORMATS) == {"bf16", "fp8", "nvfp4"}


def test_bundled_model_reads_a_heldout_page():
    """The trained reference model decodes a held-out page it never saw, on the CPU, in BF16."""
    from ocriaquant.data import BUNDLED_PAGES, load_pages, split_pages
    from ocriaquant.eval import ned
    from ocriaquant.model.generate import greedy_decode

    model, proc = load_model()
    _, held = split_pages(load_pages(BUNDLED_PAGES).pages)
    page = held[1]
    text = greedy_decode(model, proc, [page], max_new_tokens=48)[0]
    prefix = page.reference[: len(text)]
    assert text.startswith("# ")
    # An untrained model scores ~1.0 here; the trained one (held-out NED 0.0015) reads it.
    assert ned(text, prefix) < 0.05, (text, prefix)


def test_route_by_device_keeps_cpu_inputs_on_transformers_torch_functions():
    """With fla-core installed transformers binds Qwen3.5's GDN functions to its Triton kernels for
    every device, and CPU tensors then fail inside Triton. Routed, a CUDA input still reaches the
    bound kernel and a CPU input transformers' own torch function, with only the keywords it takes.
    CI has no fla-core, so the routing of transformers' module is forced here."""
    import inspect

    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    from ocriaquant.model.route_kernels import _NAMES, route_by_device, routed

    def bound(x, *args, **kwargs):
        raise RuntimeError("the GPU kernel ran")

    def reference(x, y, scale=1.0):
        return x * scale + y

    f = routed(bound, reference)
    x = torch.ones(3)
    assert torch.equal(f(x, x, scale=2.0, cu_seqlens=None), torch.full((3,), 3.0))

    class OnCuda:
        is_cuda = True

    with pytest.raises(RuntimeError, match="GPU kernel ran"):
        f(OnCuda(), x)
    before = {n: getattr(m, n) for n in _NAMES}
    try:
        for n, fn in before.items():  # as transformers bound them (load_model may have routed them already)
            setattr(m, n, getattr(fn, "bound", fn))
        assert sorted(route_by_device(force=True)) == sorted(_NAMES)
        assert route_by_device(force=True) == []  # idempotent
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 5, 2, 8, generator=g) for _ in range(3))
        gate, beta = -torch.rand(1, 5, 2, generator=g), torch.rand(1, 5, 2, generator=g)
        kw = dict(g=gate, beta=beta, initial_state=None, output_final_state=True, use_qk_l2norm_in_kernel=True,
                  cu_seqlens=None)
        got = m.torch_chunk_gated_delta_rule(q, k, v, **kw)
        want = inspect.unwrap(m.torch_chunk_gated_delta_rule.bound)(q, k, v, **kw)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    finally:
        for n, fn in before.items():
            setattr(m, n, fn)


def test_a_model_directory_needs_its_weights_and_says_which_are_missing(tiny_model_dir, tmp_path):
    """Every way a model folder lacks its weights is named, with the folder, by the check every
    weight-reading verb runs first; `load_config` (info) reads the config alone."""
    import shutil

    from ocriaquant.model.load import PagesNotModel, resolve_model_dir, weights_problem

    assert weights_problem(tiny_model_dir) is None and resolve_model_dir(tiny_model_dir) == tiny_model_dir
    d = tmp_path / "model"
    d.mkdir()
    shutil.copy(tiny_model_dir / "config.json", d)
    assert load_config(d).model_type == "qwen3_5"
    with pytest.raises(OcriaError, match=r"model: no weights \(config.json, but no \*.safetensors files\)"):
        load_model(d)
    (d / "pytorch_model.bin").write_bytes(b"\0" * 16)
    assert "only PyTorch pytorch_model.bin" in weights_problem(d)
    (d / "model-00001-of-00002.safetensors").write_text(
        "version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 123\n")
    assert "model-00001-of-00002.safetensors is a Git LFS pointer" in weights_problem(d)
    assert "git lfs pull" in weights_problem(d)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    assert weights_problem(d).startswith("1 of the 2 weight files model.safetensors.index.json lists are missing "
                                         "(model-00002-of-00002.safetensors)")
    with pytest.raises(OcriaError, match="only `ocriaquant info` works from config.json alone"):
        resolve_model_dir(d)
    assert resolve_model_dir(d, weights=False) == d

    pages = tmp_path / "pages"
    pages.mkdir()
    make_page(1).image.save(pages / "scan.png")
    with pytest.raises(PagesNotModel, match="pages: a folder of 1 page, not a model directory") as e:
        load_model(pages)
    assert e.value.path == pages and e.value.pages == 1
