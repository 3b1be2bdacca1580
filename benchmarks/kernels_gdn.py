"""gdn_decode against fla-core's fused_recurrent_gated_delta_rule plus the transformers glue around it
(bench_kernels.py `--only gdn`), its V-blocks and warps swept.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from kernels_harness import graph_time_us, rel
from ocriaquant.runtime.kernels.gdn_decode import gdn_decode
from ocriaquant.runtime.kernels.reference import gdn_decode_ref


def transformers_glue_step(qkv, z, a, b, conv_state, conv_w, A_log, dt_bias, norm, state_kv, H, K, V):
    """transformers' Qwen3.5 GDN decode path between the projections, with fla-core's kernel."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_update

    bsz = qkv.shape[0]
    hv = A_log.shape[0]
    x = causal_conv1d_update(qkv[:, :, None], conv_state, conv_w, None, "silu")[:, :, 0]
    q, k, v = torch.split(x, [H * K, H * K, hv * V], dim=-1)
    q, k, v = q.reshape(bsz, 1, H, K), k.reshape(bsz, 1, H, K), v.reshape(bsz, 1, hv, V)
    beta = b.sigmoid()[:, None]
    g = (-A_log.float().exp() * F.softplus(a.float() + dt_bias))[:, None]
    q, k = q.repeat_interleave(hv // H, dim=2), k.repeat_interleave(hv // H, dim=2)
    o, new_state = fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=state_kv,
                                                    output_final_state=True, use_qk_l2norm_in_kernel=True)
    state_kv.copy_(new_state)
    return norm(o.reshape(-1, V), z.reshape(-1, V)).reshape(bsz, -1)


def bench_gdn(bw: float, log) -> list:
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

    H, HV, K, V = 16, 32, 128, 128
    C = 2 * H * K + HV * V
    rows = []
    for bsz in (1, 32, 64):
        slots_n = bsz + 1
        g = torch.Generator(device="cuda").manual_seed(bsz)

        def r(*shape, scale=1.0, dtype=torch.bfloat16):
            return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)

        inp = dict(qkv=r(bsz, C), z=r(bsz, HV * V), a=r(bsz, HV), b=r(bsz, HV), conv_state=r(slots_n, C, 3),
                   conv_weight=r(C, 4, scale=0.5), A_log=r(HV, scale=0.5, dtype=torch.float32),
                   dt_bias=r(HV, dtype=torch.float32), norm_weight=r(V, scale=0.3) + 1,
                   state=r(slots_n, HV, V, K, scale=0.2, dtype=torch.float32))
        slots = torch.randperm(slots_n, device="cuda")[:bsz].int()
        out_ref, cs_ref, st_ref = gdn_decode_ref(**inp, slots=slots, num_k_heads=H, head_k_dim=K, head_v_dim=V)
        for nvb in (None, 1, 2, 4, 8):  # the default, then every V-split the sweep below times
            fresh = dict(inp, state=inp["state"].clone(), conv_state=inp["conv_state"].clone())
            out = torch.full((bsz, HV * V), float("nan"), dtype=torch.float32, device="cuda")
            gdn_decode(**fresh, slots=slots, num_k_heads=H, head_k_dim=K, head_v_dim=V, out=out, v_blocks=nvb)
            e_out, e_state = rel(out, out_ref), rel(fresh["state"], st_ref)
            if not (e_out <= 1e-3 and e_state <= 1e-3 and torch.equal(fresh["conv_state"], cs_ref)):
                raise SystemExit(f"gdn_decode wrong at B={bsz}, V-blocks {nvb}: out {e_out:.2e}, state {e_state:.2e}")
        out_bf = torch.empty(bsz, HV * V, dtype=torch.bfloat16, device="cuda")
        res = {}
        for nvb in (1, 2, 4, 8):
            for nw in (4, 8, 16):
                res[nvb, nw] = graph_time_us([lambda nw=nw, nvb=nvb: gdn_decode(
                    **inp, slots=slots, num_k_heads=H, head_k_dim=K, head_v_dim=V, out=out_bf, num_warps=nw,
                    v_blocks=nvb)] * 8)
        default = graph_time_us([lambda: gdn_decode(**inp, slots=slots, num_k_heads=H, head_k_dim=K, head_v_dim=V,
                                                    out=out_bf)] * 8)
        (nvb, nw) = min(res, key=res.get)
        ours = res[nvb, nw]
        log("  " + ", ".join(f"{b}x{w}: {t:.1f}" for (b, w), t in sorted(res.items())) + f"; default {default:.1f}")
        norm = Qwen3_5RMSNormGated(V).cuda().to(torch.bfloat16)
        norm.weight.data.copy_(inp["norm_weight"])
        state_kv = inp["state"][:bsz].transpose(-1, -2).contiguous()  # fla/transformers keep [.., K, V]
        conv_tf = inp["conv_state"][:bsz].clone()
        args = (inp["qkv"], inp["z"], inp["a"], inp["b"], conv_tf, inp["conv_weight"], inp["A_log"], inp["dt_bias"],
                norm, state_kv, H, K, V)
        try:
            base = graph_time_us([lambda: transformers_glue_step(*args)] * 8)
            base_kind = "graph"
        except Exception as e:  # noqa: BLE001 - the glue may not capture; time it eagerly then
            log(f"  baseline did not capture ({type(e).__name__}); timing eagerly")
            for _ in range(3):
                transformers_glue_step(*args)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(50):
                transformers_glue_step(*args)
            torch.cuda.synchronize()
            base, base_kind = (time.perf_counter() - t0) / 50 * 1e6, "eager"
        fla_only = None
        try:
            from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
            q = torch.randn(bsz, 1, HV, K, device="cuda", dtype=torch.bfloat16)
            fla_only = graph_time_us([lambda: fused_recurrent_gated_delta_rule(
                q, q, q, g=torch.zeros(bsz, 1, HV, device="cuda"), beta=torch.ones(bsz, 1, HV, device="cuda",
                                                                                   dtype=torch.bfloat16),
                initial_state=state_kv, output_final_state=True, use_qk_l2norm_in_kernel=True)] * 8)
        except Exception as e:  # noqa: BLE001
            log(f"  fla kernel alone not timed: {e}")
        state_bytes = 2 * bsz * HV * V * K * 4
        roof_us = state_bytes / bw * 1e6
        rows.append({"batch": bsz, "ours_us": round(ours, 2), "num_warps": nw, "v_blocks": nvb,
                     "default_us": round(default, 2), "sweep_us": {f"{b}x{w}": round(t, 2) for (b, w), t in res.items()}, "fla_glue_us": round(base, 2),
                     "fla_glue_timing": base_kind, "fla_kernel_only_us": None if fla_only is None else round(fla_only, 2),
                     "speedup": round(base / ours, 2), "state_roofline_us": round(roof_us, 2),
                     "%roofline": round(100 * roof_us / ours, 1), "err_out": e_out, "err_state": e_state})
        log(f"gdn_decode B={bsz}: ours {ours:.1f}us (V-blocks {nvb}, warps {nw}), fla+glue {base:.1f}us ({base_kind}), fla kernel "
            f"{fla_only if fla_only is None else round(fla_only, 1)}us -> {base / ours:.2f}x; state roofline "
            f"{roof_us:.1f}us = {rows[-1]['%roofline']}%")
    return rows
