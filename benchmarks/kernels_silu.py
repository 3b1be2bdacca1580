"""silu_mul_quant against the unfused torch sequence, and the batch-1 NVFP4 gate_up with SiLU in its
epilogue against the two launches it replaces (bench_kernels.py `--only silu`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels_harness import graph_time_us, rel
from ocriaquant.quant import nvfp4
from ocriaquant.runtime.kernels.gemv_nvfp4 import gemv_nvfp4, gemv_nvfp4_silu, nvfp4_x_pairs, pack_m1
from ocriaquant.runtime.kernels.reference import silu_mul_quant_ref
from ocriaquant.runtime.kernels.silu_mul_quant import silu_mul_quant


def unfused_silu_mul_fp8(gate, up):
    """The torch sequence the fused kernel replaces (capturable: no host scalars)."""
    h = F.silu(gate) * up
    scale = h.abs().amax(-1, keepdim=True) / 448.0
    return (h / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale.float()


def bench_silu(bw: float, log) -> list:
    rows = []
    i = 9216
    for m in (64, 256):
        gu = torch.randn(m, 2 * i, dtype=torch.bfloat16, device="cuda") * 2
        gate, up = gu[:, :i], gu[:, i:]
        q, s = silu_mul_quant(gate, up)
        q_ref, s_ref = silu_mul_quant_ref(gate, up)
        codes = float((q.view(torch.uint8) == q_ref.view(torch.uint8)).float().mean())
        err = rel(q.double() * s.double(), F.silu(gate.double()) * up.double())
        if codes < 0.999 or err > 4e-2:
            raise SystemExit(f"silu_mul_quant wrong at M={m}: codes equal {codes:.4f}, rel err {err:.2e}")
        ours = graph_time_us([lambda: silu_mul_quant(gate, up)] * 8)
        ref = graph_time_us([lambda: unfused_silu_mul_fp8(gate, up)] * 8)
        nbytes = m * i * 2 * 2 + m * i + m * 4
        rows.append({"m": m, "i": i, "ours_us": round(ours, 2), "torch_us": round(ref, 2),
                     "speedup": round(ref / ours, 2), "codes_equal": codes, "%bw": round(100 * nbytes / (ours * 1e-6) / bw, 1)})
        log(f"silu_mul_quant M={m}: ours {ours:.1f}us, unfused torch {ref:.1f}us -> {ref / ours:.2f}x "
            f"({rows[-1]['%bw']}% bw, codes equal {codes:.4%})")
    return rows


def bench_gate_up_silu(bw: float, log, tiles) -> dict:
    """Batch 1, NVFP4 MLP input side on the 4B shape (gate_up 18432 x 2560): gemv_nvfp4 then
    silu_mul_quant (bf16 + pairs), against gemv_nvfp4_silu (one launch), both with PDL in a
    graph; checked equal bit for bit."""
    i, k = 9216, 2560
    w = torch.randn(2 * i, k, dtype=torch.bfloat16, device="cuda") / k**0.5
    packed, scales, gs = nvfp4.quantize_weight(w)
    x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
    xp = nvfp4_x_pairs(x)
    plain, inter = pack_m1(packed, scales), pack_m1(packed, scales, interleave=True)
    tile = tiles.tile("nvfp4_silu", 2 * i, k)

    def two():
        gu = gemv_nvfp4(x, packed, scales, gs, x_pairs=xp, m1=plain, split_k=1, **tile)
        return silu_mul_quant(gu[:, :i], gu[:, i:], "bf16", pairs=True)[1]

    def one():
        return gemv_nvfp4_silu(xp, inter, gs, **tile)

    (aw, as_), (bw_, bs) = two(), one()
    if not (torch.equal(aw, bw_) and torch.equal(as_, bs)):
        raise SystemExit("gemv_nvfp4_silu differs from gemv_nvfp4 + silu_mul_quant")
    t2, t1 = graph_time_us([two] * 8), graph_time_us([one] * 8)
    nbytes = 2 * i * k // 2 + 2 * i * k // 16
    row = {"n": 2 * i, "k": k, "two_launch_us": round(t2, 2), "fused_us": round(t1, 2), "speedup": round(t2 / t1, 2),
           "fused %bw": round(100 * nbytes / (t1 * 1e-6) / bw, 1), "tile": tile}
    log(f"gate_up + silu (NVFP4, M=1): two launches {t2:.1f}us, fused {t1:.1f}us -> {t2 / t1:.2f}x "
        f"({row['fused %bw']}% bw)")
    return row
