"""Main-environment half of the second-environment check (see check.py beside it).

    python tests/second_env/make_reference.py OUT

Exports a mixed BF16/FP8/NVFP4 plan of the bundled model for each target (every quantized
group kind, fused GDN / q,k,v / gate,up units in NVFP4 and in FP8, the tied lm_head) with
`ocriaquant export`, reloads each checkpoint as `export`'s own check does (transformers +
compressed-tensors 0.19), checks the reloaded weights against quant/'s dequantization of the
stored tensors, and writes OUT/<target>/{checkpoint/, reference.safetensors}: the decompressed
weight of every quantized Linear, and the processed inputs, prefill logits and greedy tokens of
a few held-out pages. Exit 1 when our own reload disagrees with quant/.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ocriaquant.artifacts import Plan, model_fingerprint, save_plan
from ocriaquant.data import BUNDLED_PAGES, load_pages, select_split
from ocriaquant.export import export
from ocriaquant.model import DEFAULT_MODEL, load_model
from ocriaquant.model.processor import chat_text
from ocriaquant.quant import fp8, nvfp4

# ocria-nano: GDN layers 0-2, 4-6, full attention 3 and 7.
PLAN = {"layers.0.gdn_in": "nvfp4", "layers.0.gdn_out": "fp8", "layers.0.mlp_up": "fp8", "layers.0.mlp_down": "nvfp4",
        "layers.1.gdn_in": "fp8", "layers.1.mlp_up": "nvfp4",
        "layers.3.attn_qkv": "nvfp4", "layers.3.attn_o": "fp8", "layers.3.mlp_up": "nvfp4",
        "layers.7.attn_qkv": "fp8", "layers.7.attn_o": "nvfp4", "layers.7.mlp_down": "fp8", "lm_head": "fp8"}
PAGES = 2
NEW_TOKENS = 16


def stored(ckpt: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            out.update({k: fh.get_tensor(k) for k in fh.keys()})
    return out


def ours(sd: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """quant/'s dequantization of a module's stored tensors."""
    if name + ".weight_packed" in sd:
        return nvfp4.dequantize(sd[name + ".weight_packed"], sd[name + ".weight_scale"],
                                sd[name + ".weight_global_scale"].float(), torch.bfloat16)
    return fp8.dequantize(sd[name + ".weight"], sd[name + ".weight_scale"], torch.bfloat16)


@torch.no_grad()
def make(out: Path, target: str, pages) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    plan_path = out / "plan.json"
    save_plan(plan_path, Plan(groups=PLAN, target=target, model_dir=DEFAULT_MODEL,
                              model_fingerprint=model_fingerprint(DEFAULT_MODEL)))
    ckpt = export(plan_path, out / "checkpoint", pages=BUNDLED_PAGES, max_pages=2, verify_pages=0, force=True)
    sd = stored(ckpt)
    ref: dict[str, torch.Tensor] = {}
    problems = []

    net, proc = load_model(ckpt)  # export's own reload check: compressed, decompressed on first use
    for i, page in enumerate(pages):
        enc = proc(images=[page.image], text=[chat_text(proc, page.prompt)], return_tensors="pt")
        enc["pixel_values"] = enc["pixel_values"].to(torch.bfloat16)
        ref.update({f"page{i}:{k}": v.contiguous() for k, v in enc.items()})
        ref[f"page{i}:logits"] = net(**enc).logits[0].contiguous()  # the prompt's prefill
        ref[f"page{i}:tokens"] = net.generate(**enc, max_new_tokens=NEW_TOKENS, do_sample=False,
                                              pad_token_id=proc.tokenizer.pad_token_id)[0, enc["input_ids"].shape[1]:]
    for name, mod in net.named_modules():  # decompressed by now
        if getattr(mod, "quantization_scheme", None) is None:
            continue
        w = mod.weight.detach().contiguous()
        if not torch.equal(w.view(torch.int16), ours(sd, name).view(torch.int16)):
            problems.append(f"{target} {name}: transformers' reload differs from quant/'s dequantization")
        ref[f"weight:{name}"] = w
    save_file(ref, str(out / "reference.safetensors"))
    print(f"{target}: {sum(k.startswith('weight:') for k in ref)} quantized weights, {len(pages)} pages -> {out}")
    return problems


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__)
        return 2
    out = Path(argv[0])
    pages = [p for p in select_split(load_pages(BUNDLED_PAGES).pages, "heldout") if p.has_reference][:PAGES]
    problems = []
    for target in ("h200", "b200"):
        problems += make(out / target, target, pages)
    for p in problems:
        print("MISMATCH", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
