"""The checkpoint proven outside our tools: run in a second environment that has torch,
transformers and the compressed-tensors vLLM pins (0.17.0), and neither ocriaquant nor
llmcompressor (which pins 0.19.0, the version export writes with).

    python tests/second_env/check.py DIR [DIR ...]

Each DIR is what `make_reference.py` wrote in the main environment: `checkpoint/` (our export)
and `reference.safetensors` (from our own reload: the decompressed weight of every quantized
Linear; for a few pages their processed inputs, prefill logits and greedy tokens). Here the
checkpoint is loaded with transformers and decompressed by this compressed-tensors, then
compared: every quantized weight and every page's prefill logits bit for bit, every page's
greedy tokens. One line per DIR, one line per mismatch; exit 1 on any mismatch. Imports
nothing of ocriaquant: this environment does not have it.
"""

from __future__ import annotations

import sys
from importlib.metadata import version
from pathlib import Path

import torch
from safetensors.torch import load_file


def load(ckpt: Path):
    from transformers import Qwen3_5ForConditionalGeneration

    return Qwen3_5ForConditionalGeneration.from_pretrained(ckpt, dtype=torch.bfloat16).eval()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> str:
    return f"{(a.float() - b.float()).abs().max().item():.3g}" if a.shape == b.shape else f"shape {tuple(a.shape)}"


@torch.no_grad()
def check(folder: Path) -> list[str]:
    ref = load_file(str(folder / "reference.safetensors"))
    ckpt = folder / "checkpoint"
    problems = []

    # Loaded as a transformers user loads it: compressed, decompressed by this compressed-tensors on
    # first use. Prefill logits and greedy tokens first, then the decompressed weights.
    net = load(ckpt)
    pages = sorted({k.split(":")[0] for k in ref if k.startswith("page")})
    same_logits = same_tokens = 0
    for p in pages:
        inputs = {k.split(":", 1)[1]: v for k, v in ref.items()
                  if k.startswith(p + ":") and not k.endswith((":tokens", ":logits"))}
        logits, tokens = ref[p + ":logits"], ref[p + ":tokens"]
        got = net(**inputs).logits[0]
        if same_bits(got, logits):
            same_logits += 1
        else:
            problems.append(f"{p}: prefill logits differ (max |diff| {max_diff(got, logits)})")
        out = net.generate(**inputs, max_new_tokens=tokens.numel(), do_sample=False,
                           pad_token_id=0)[0, inputs["input_ids"].shape[1]:]
        if torch.equal(out, tokens):
            same_tokens += 1
        else:
            first = next((i for i, (a, b) in enumerate(zip(out.tolist(), tokens.tolist())) if a != b),
                         min(len(out), len(tokens)))
            problems.append(f"{p}: greedy tokens differ from step {first} on")

    mods = {n: m for n, m in net.named_modules() if getattr(m, "quantization_scheme", None) is not None}
    want = {k.removeprefix("weight:"): v for k, v in ref.items() if k.startswith("weight:")}
    if set(mods) != set(want):
        problems.append(f"quantized modules differ: only here {sorted(set(mods) - set(want))[:3]}, "
                        f"only in our reload {sorted(set(want) - set(mods))[:3]}")
    weights = 0
    for name in sorted(set(mods) & set(want)):
        got = getattr(mods[name], "weight", None)
        if got is not None and same_bits(got.detach(), want[name]):
            weights += 1
        else:
            diff = "not decompressed" if got is None else f"max |diff| {max_diff(got.detach(), want[name])}"
            problems.append(f"{name}: decompressed weight differs ({diff})")
    print(f"{folder.name}: {weights}/{len(want)} quantized weights bit-identical with our reload; "
          f"{len(pages)} pages: {same_logits} with identical prefill logits, {same_tokens} token-identical "
          f"(compressed-tensors {version('compressed-tensors')}, transformers {version('transformers')}, "
          f"torch {version('torch')})")
    return problems


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    problems = []
    for d in argv:
        problems += [f"{Path(d).name}: {p}" for p in check(Path(d))]
    for p in problems:
        print("MISMATCH", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
