"""Speculative-decoding verify + commit for a GDN layer (kernels/gdn_verify.py, three variants) against
fla-core plus the glue a serving stack adds around it (bench_kernels.py `--only gdn_verify`).

Per (batch B, draft length k; T = k + 1 tokens a row), one layer at the Qwen3.5-4B shape: a verify of the
T tokens of every row, then a commit to accepted lengths drawn uniformly from 1 … T (seeded; the same for
every implementation):
- ours "states" (A): verify keeps every intermediate state, commit copies the accepted one;
- ours "replay" (B): verify keeps the step inputs, commit replays the accepted prefix from the checkpoint;
- ours "fused" (B, the commit folded into the next verify): in steady state a step is one verify that first
  commits the previous step (`pending`) in its own pass over the state; timed as that verify alone (two
  scratches alternating), checked over two steps in a row;
- fla + glue: what a serving stack does with upstream fla-core, which writes no per-token states (vLLM forks
  fused_recurrent to add `ssm_state_indices` [N, T] per-token state slots for that): gather the rows' conv
  states and recurrent states (index_select; the state in our [V, K] layout through fla's
  state_v_first), the causal conv over [conv state, T new columns] with SiLU (cuDNN depthwise conv1d),
  fla's rule over the T tokens from the gathered states (GVA, q/k L2 norm, the gates in the kernel), fla's
  fused gated RMSNorm; then the commit: the same rule again over the T tokens from the gathered states
  with the rejected tokens' gates masked (a = b = -1e4: g = 0, β = 0, so its final state is the state after
  the accepted prefix, without varlen packing or a host sync), written back (index_copy_), and the conv
  window's accepted columns gathered back into the conv states. Timed with fused_recurrent_gated_delta_rule
  and with chunk_gated_delta_rule; "fla" below is the faster of the two.
Every implementation is first checked against the float64 reference (reference.gdn_verify_ref: T sequential
gdn_decode_ref steps, each row committed at its accepted length) on fresh random inputs, "fused" over two
steps. Times are medians of CUDA-graph replays of [verify, commit] cycling over copies of the states (past
L2), as µs per layer and step; the "state roofline" is the bytes of recurrent state each variant must move
over the copy bandwidth. At k = 4 the V-blocks and warps of the state kernels (verify, commit) are swept
(`sweep_us`), the defaults timed beside them.

Without fla-core the baseline is left out (ours only). fla-core is not in the GPU machine's image: carry its
wheel (pure Python, needs einops, which is there; 0.5.2 and 0.6.0 have the API used here: GVA, state_v_first,
use_gate_in_kernel, use_beta_sigmoid_in_kernel, FusedRMSNormGated).

On the CPU, `python benchmarks/kernels_gdn_verify.py --smoke` (it sets TRITON_INTERPRET=1) runs the checks
alone at a small shape, a plain torch recurrence standing in for fla-core's kernels.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

KS = (2, 4, 8, 16)
BATCHES = (1, 8, 32, 64)
VERIFY_SWEEP = ((16, 1), (8, 1), (16, 2), (8, 2), (4, 4))  # (V-blocks, warps) of the state kernel, at k = 4
COMMIT_SWEEP = ((16, 1), (8, 1), (8, 2), (4, 4))
VARIANTS = ("states", "replay", "fused")


def shape_4b() -> dict:
    """The GDN shape of Qwen3.5-4B (model/configs.py's `qwen3.5-4b`)."""
    from ocriaquant.model.configs import SHAPES

    t = SHAPES["qwen3.5-4b"]().text_config
    return dict(H=t.linear_num_key_heads, HV=t.linear_num_value_heads, K=t.linear_key_head_dim,
                V=t.linear_value_head_dim, kw=t.linear_conv_kernel_dim, eps=t.rms_norm_eps)


# --- the baseline: fla-core (or transformers' torch recurrence) and the glue around it -------------------------

def fla_rule(kind: str):
    """fla-core's rule `kind` ("recurrent" or "chunk") as rule(q, k, v, a, b, A_log, dt_bias, h0, final) ->
    (o, final state or None), the state in our [.., V, K] layout; None where fla-core is not installed."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except ImportError:
        return None
    fn = fused_recurrent_gated_delta_rule if kind == "recurrent" else chunk_gated_delta_rule

    def rule(q, k, v, a, b, A_log, dt_bias, h0, final):
        return fn(q, k, v, g=a, beta=b, initial_state=h0, output_final_state=final, use_qk_l2norm_in_kernel=True,
                  use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True,
                  state_v_first=True)
    return rule


def torch_rule(q, k, v, a, b, A_log, dt_bias, h0, final):
    """The same contract in plain torch, fp32, one token after another (what transformers' torch recurrence
    computes): the CPU stand-in for fla-core's kernels."""
    rep = v.shape[2] // q.shape[2]
    q, k = ((x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)).repeat_interleave(rep, 2)
            for x in (q.float(), k.float()))
    q = q * q.shape[-1] ** -0.5
    g = (-A_log.float().exp() * F.softplus(a.float() + dt_bias)).exp()
    beta = b.float().sigmoid()
    S = h0.float().clone()  # [B, HV, V, K]
    o = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for t in range(v.shape[1]):
        S = S * g[:, t, :, None, None]
        delta = (v[:, t].float() - torch.einsum("bhvk,bhk->bhv", S, k[:, t])) * beta[:, t, :, None]
        S = S + delta[..., None] * k[:, t, :, None, :]
        o[:, t] = torch.einsum("bhvk,bhk->bhv", S, q[:, t])
    return o.to(v.dtype), (S if final else None)


def gated_norm(V: int, eps: float, weight: torch.Tensor):
    """fla-core's fused gated RMSNorm where installed (a serving stack's fused kernel), else the same in torch."""
    try:
        from fla.modules import FusedRMSNormGated

        norm = FusedRMSNormGated(V, eps=eps, activation="swish").to(device=weight.device, dtype=weight.dtype)
        norm.weight.data.copy_(weight)
        norm.requires_grad_(False)
        return norm
    except Exception:  # noqa: BLE001 - not installed, or an fla-core without it
        def norm(x, z):
            xf = x.float()
            y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight
            return (y.float() * F.silu(z.float())).to(x.dtype)
        return norm


class Glue:
    """Verify and commit through a delta rule that starts from given states and returns the final one (fla-core's),
    plus what a serving stack adds around it. No host syncs, so both capture in a CUDA graph."""

    def __init__(self, rule, H, K, V, kw, eps, norm_weight):
        self.rule, self.H, self.K, self.V, self.kw = rule, H, K, V, kw
        self.norm = gated_norm(V, eps, norm_weight)
        self.saved = None

    def verify(self, qkv, z, a, b, conv_state, conv_weight, A_log, dt_bias, state, slots):
        bsz, T, C = qkv.shape
        H, K, V = self.H, self.K, self.V
        rows = slots.long()
        win = torch.cat([conv_state.index_select(0, rows), qkv.transpose(1, 2)], 2)  # [B, C, kw-1+T], kept
        x = F.silu(F.conv1d(win, conv_weight[:, None, :], groups=C)).transpose(1, 2)  # [B, T, C]
        q, k, v = torch.split(x, [H * K, H * K, C - 2 * H * K], dim=-1)
        q, k, v = q.reshape(bsz, T, H, K), k.reshape(bsz, T, H, K), v.reshape(bsz, T, -1, V)
        h0 = state.index_select(0, rows)
        o, _ = self.rule(q, k, v, a, b, A_log, dt_bias, h0, False)
        self.saved = (q, k, v, a, b, h0, win)
        return self.norm(o.reshape(-1, V), z.reshape(-1, V)).reshape(bsz, T, -1)

    def commit(self, conv_state, state, slots, accepted, A_log, dt_bias):
        q, k, v, a, b, h0, win = self.saved
        bsz, T = a.shape[:2]
        rows = slots.long()
        pos = torch.arange(T, device=a.device)
        drop = (pos[None, :] >= accepted[:, None])[..., None]  # [B, T, 1]: the rejected tokens
        # -1e4, not -inf: softplus and sigmoid give exactly 0 in fp32 either way, and no -inf·0 can make a NaN
        a_m, b_m = a.masked_fill(drop, -1e4), b.masked_fill(drop, -1e4)
        _, ht = self.rule(q, k, v, a_m, b_m, A_log, dt_bias, h0, True)
        state.index_copy_(0, rows, ht)
        taps = torch.arange(self.kw - 1, device=a.device)
        cols = (accepted.long()[:, None] + taps[None, :])[:, None, :].expand(-1, win.shape[1], -1)
        conv_state.index_copy_(0, rows, win.gather(2, cols))


# --- inputs, checks ----------------------------------------------------------------------------------------------

def make_inputs(bsz, T, H, HV, K, V, kw, device, seed, copies=1):
    """(weights, tokens, [states per copy], slots, accepted, (tokens, accepted) of a second step): B rows at random
    distinct slots of B + 1."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    C = 2 * H * K + HV * V

    def r(*shape, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)

    def tokens():
        return dict(qkv=r(bsz, T, C), z=r(bsz, T, HV * V), a=r(bsz, T, HV), b=r(bsz, T, HV))

    def lengths():
        return torch.randint(1, T + 1, (bsz,), generator=g).to(torch.int32).to(device)

    w = dict(conv_weight=r(C, kw, scale=0.5), A_log=r(HV, scale=0.5, dtype=torch.float32),
             dt_bias=r(HV, dtype=torch.float32), norm_weight=r(V, scale=0.3) + 1)
    tok = tokens()
    first = dict(conv_state=r(bsz + 1, C, kw - 1), state=r(bsz + 1, HV, V, K, scale=0.2, dtype=torch.float32))
    states = [first] + [{n: t.clone() for n, t in first.items()} for _ in range(copies - 1)]
    slots = torch.randperm(bsz + 1, generator=g)[:bsz].to(torch.int32).to(device)
    accepted = lengths()
    return w, tok, states, slots, accepted, (tokens(), lengths())


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def ours(design, H, K, V, v_blocks=None, warps=None, commit_v_blocks=None, commit_warps=None):
    """(verify(w, tok, st, slots, scratch, out), commit(st, slots, accepted, scratch)) through our kernels."""
    from ocriaquant.runtime.kernels.gdn_verify import gdn_commit, gdn_verify

    def verify(w, tok, st, slots, scratch, out=None, pending=None):
        return gdn_verify(**tok, **w, **st, slots=slots, scratch=scratch, num_k_heads=H, head_k_dim=K, head_v_dim=V,
                          out=out, pending=pending, v_blocks=v_blocks, num_warps=warps)

    def commit(st, slots, accepted, scratch):
        gdn_commit(scratch, st["conv_state"], st["state"], slots, accepted, H, K, V, v_blocks=commit_v_blocks,
                   num_warps=commit_warps)
    return verify, commit


def check_all(w, tok, st, slots, accepted, second, H, HV, K, V, kw, eps, rules: dict, log) -> list[dict]:
    """Each implementation once on fresh copies of the states, against the float64 reference: rows of
    {impl, err_out, err_state, conv_exact}; "fused" over two steps (second = the next step's tokens and accepted
    lengths: its verify commits the first step, then its own commit). Ours must be within float32 rounding
    (1e-3, as gdn_decode's check) and exact on the conv state, or the run stops; a baseline rule whose bf16
    pipeline is off by more than 5e-2 is reported and dropped from `rules` (the run goes on without it)."""
    from ocriaquant.runtime.kernels.gdn_verify import DESIGNS, Pending, spec_scratch
    from ocriaquant.runtime.kernels.reference import gdn_verify_ref

    bsz, T = tok["a"].shape[:2]
    dev = tok["qkv"].device
    ref = dict(num_k_heads=H, head_k_dim=K, head_v_dim=V, eps=eps)
    want_out, want_cs, want_st = gdn_verify_ref(**tok, **w, **st, slots=slots, accepted=accepted, **ref)
    rows = []

    def row(impl, out, s, o_ref=want_out, cs_ref=want_cs, st_ref=want_st):
        rows.append(dict(impl=impl, err_out=rel(out, o_ref), err_state=rel(s["state"], st_ref),
                         conv_exact=torch.equal(s["conv_state"], cs_ref)))

    def scratch(design):
        return spec_scratch(design, bsz, T, H, K, HV, V, kw, device=dev, conv_dtype=st["conv_state"].dtype)

    for design in DESIGNS:
        verify, commit = ours(design, H, K, V)
        s, sc = {n: t.clone() for n, t in st.items()}, scratch(design)
        out = torch.full((bsz, T, HV * V), float("nan"), device=dev)
        verify(w, tok, s, slots, sc, out)
        commit(s, slots, accepted, sc)
        row(f"ours_{design}", out, s)
    tok2, acc2 = second
    out2_ref, cs2, st2 = gdn_verify_ref(**tok2, **w, conv_state=want_cs, state=want_st, slots=slots, accepted=acc2,
                                        **ref)
    verify, commit = ours("replay", H, K, V)
    s, first, nxt = {n: t.clone() for n, t in st.items()}, scratch("replay"), scratch("replay")
    verify(w, tok, s, slots, first)
    out = torch.full((bsz, T, HV * V), float("nan"), device=dev)
    verify(w, tok2, s, slots, nxt, out, Pending(first, torch.arange(bsz, dtype=torch.int32, device=dev), accepted))
    commit(s, slots, acc2, nxt)
    row("ours_fused", out, s, out2_ref, cs2, st2)
    for name, rule in rules.items():
        s = {n: t.clone() for n, t in st.items()}
        glue = Glue(rule, H, K, V, kw, eps, w["norm_weight"])
        out = glue.verify(tok["qkv"], tok["z"], tok["a"], tok["b"], s["conv_state"], w["conv_weight"], w["A_log"],
                          w["dt_bias"], s["state"], slots)
        glue.commit(s["conv_state"], s["state"], slots, accepted, w["A_log"], w["dt_bias"])
        row(name, out, s)
    for r in rows:
        ours_ = r["impl"].startswith("ours")
        tol = 1e-3 if ours_ else 5e-2
        if not (r["conv_exact"] and r["err_out"] <= tol and r["err_state"] <= tol):
            msg = (f"gdn_verify check B={bsz} T={T}: {r['impl']} wrong: out {r['err_out']:.2e}, state "
                   f"{r['err_state']:.2e}, conv exact {r['conv_exact']}")
            if ours_:
                raise SystemExit(msg)
            log(msg + ": left out of the timings")
            rules.pop(r["impl"])
    log("  checked: " + ", ".join(f"{r['impl']} out {r['err_out']:.1e} state {r['err_state']:.1e}" for r in rows))
    return rows


def smoke(device: str = "cpu", log=print) -> list[dict]:
    """The checks alone at a small shape (H 2, HV 4, K = V = 16, kernel 4, B = 3, k = 2), the glue through fla-core
    where it runs (CUDA), else transformers' torch recurrence. What the CPU can run of this benchmark."""
    H, HV, K, V, kw, eps = 2, 4, 16, 16, 4, 1e-6
    w, tok, (st,), slots, accepted, second = make_inputs(3, 3, H, HV, K, V, kw, device, seed=0)
    rule = fla_rule("recurrent") if device == "cuda" else None
    return check_all(w, tok, st, slots, accepted, second, H, HV, K, V, kw, eps, {"glue": rule or torch_rule}, log)


# --- timing ------------------------------------------------------------------------------------------------------

def _graph_us(calls: list, reps: int = 20) -> float:
    """Median µs per call of a CUDA graph that makes `calls` (kernels_harness.graph_time_us)."""
    from kernels_harness import graph_time_us

    return graph_time_us(calls, reps=reps)


def _eager_us(calls: list, reps: int = 20) -> float:
    for f in calls:
        f()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for f in calls:
            f()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / len(calls) * 1e6)
    return statistics.median(times)


def state_bytes(design: str, bsz: int, T: int, accepted: torch.Tensor, HV: int, V: int, K: int) -> int:
    """Recurrent-state bytes a variant must move per layer and step: "states" reads the state, writes T - 1
    intermediates and the last into the slot, then copies one intermediate over the slot (read + write) for each
    row with n < T; "replay" reads the state in verify, reads and writes it in commit; "fused" reads and writes
    it once. The fla glue: gather (read + write), the verify's read, the commit's read and write, the write-back
    (read + write)."""
    one = HV * V * K * 4
    if design == "states":
        return bsz * (1 + T) * one + int((accepted < T).sum()) * 2 * one
    return bsz * {"replay": 3, "fused": 2}.get(design, 7) * one


def bench_gdn_verify(bw: float, log, batches=BATCHES, ks=KS, sweep_k: int | None = 4, shape: dict | None = None,
                     device: str = "cuda", timer=None, copies: int | None = None, rules: dict | None = None) -> list:
    """Rows per (batch, k). shape (default the 4B's), device, timer(calls) -> µs per call (default CUDA-graph
    replays), copies of the states (default: enough to pass L2) and rules (default fla-core's where installed)
    are there for a dry run of this function on the CPU."""
    from kernels_harness import copies_for

    from ocriaquant.runtime.kernels.gdn_verify import Pending, spec_scratch

    sh = shape or shape_4b()
    H, HV, K, V, kw, eps = sh["H"], sh["HV"], sh["K"], sh["V"], sh["kw"], sh["eps"]
    timer = timer or _graph_us
    if rules is None:
        rules = {f"fla_{kind}": rule for kind in ("recurrent", "chunk") if (rule := fla_rule(kind)) is not None}
    if not rules:
        log("gdn_verify: fla-core is not installed: ours only (carry fla_core-0.5.2-py3-none-any.whl for the baseline)")
    log(f"gdn_verify: H {H}, HV {HV}, K {K}, V {V}, conv kernel {kw}; µs per layer and step (verify + commit)")
    rows = []
    for bsz in batches:
        for k in ks:
            T = k + 1
            nc = copies or copies_for((bsz + 1) * HV * V * K * 4)
            w, tok, states, slots, accepted, second = make_inputs(bsz, T, H, HV, K, V, kw, device,
                                                                  seed=1000 * bsz + k, copies=nc)
            with torch.inference_mode():
                errs = check_all(w, tok, states[0], slots, accepted, second, H, HV, K, V, kw, eps, rules, log)
            row = dict(batch=bsz, k=k, tokens=T, accepted_mean=round(float(accepted.float().mean()), 2),
                       checks=errs, state_copies=nc)
            out = torch.empty(bsz, T, HV * V, dtype=torch.bfloat16, device=device)
            rows_idx = torch.arange(bsz, dtype=torch.int32, device=device)
            for variant in VARIANTS:
                design = "states" if variant == "states" else "replay"
                scratches = [spec_scratch(design, bsz, T, H, K, HV, V, kw, device=device) for _ in range(2)]
                row[f"{variant}_scratch_mib"] = round(scratches[0].nbytes() / 2**20 * (2 if variant == "fused" else 1),
                                                      1)

                def timed(what, vcfg=(None, None), ccfg=(None, None)):
                    """µs per step: verify + commit ("both"), the verify or the commit alone, cycling the state
                    copies; "fused": the verify that commits the step before it (two scratches alternating)."""
                    verify, commit = ours(design, H, K, V, *vcfg, *ccfg)
                    sc = scratches[0]
                    if variant == "fused":
                        calls = [lambda st=st, i=i: verify(w, tok, st, slots, scratches[i % 2], out, Pending(
                            scratches[(i + 1) % 2], rows_idx, accepted)) for i, st in enumerate(states)]
                        return timer(calls)
                    calls = {"both": [f for st in states for f in (
                        lambda st=st: verify(w, tok, st, slots, sc, out),
                        lambda st=st: commit(st, slots, accepted, sc))],
                             "verify": [lambda st=st: verify(w, tok, st, slots, sc, out) for st in states],
                             "commit": [lambda st=st: commit(st, slots, accepted, sc) for st in states]}[what]
                    return timer(calls) * (2 if what == "both" else 1)

                if variant == "fused":
                    both = v_us = timed("verify")
                    c_us = 0.0
                else:
                    both, v_us, c_us = timed("both"), timed("verify"), timed("commit")
                roof = state_bytes(variant, bsz, T, accepted, HV, V, K) / bw * 1e6
                row[variant] = dict(us=round(both, 2), verify_us=round(v_us, 2), commit_us=round(c_us, 2),
                                    state_roofline_us=round(roof, 2), pct_roofline=round(100 * roof / both, 1))
                if k == sweep_k:
                    sw = {}
                    parts = (("verify", VERIFY_SWEEP),) + ((("commit", COMMIT_SWEEP),) if variant != "fused" else ())
                    for what, cfgs in parts:
                        for cfg in cfgs:
                            if V % cfg[0]:
                                continue
                            try:
                                sw[f"{what} {cfg[0]}x{cfg[1]}"] = round(
                                    timed(what, **{"vcfg" if what == "verify" else "ccfg": cfg}), 2)
                            except Exception as e:  # noqa: BLE001 - e.g. past the registers: reported, not fatal
                                log(f"  {variant} {what} {cfg} failed: {type(e).__name__}: {str(e)[:80]}")
                    row[variant]["sweep_us"] = sw
                    bv = min((v for n, v in sw.items() if n.startswith("verify")), default=v_us)
                    bc = min((v for n, v in sw.items() if n.startswith("commit")), default=c_us)
                    row[variant]["best_sweep_us"] = round(bv + bc, 2)
                    log(f"  {variant} sweep (V-blocks x warps): " + ", ".join(f"{n} {v}" for n, v in sw.items()))
                del scratches
            for name, rule in rules.items():
                glue = Glue(rule, H, K, V, kw, eps, w["norm_weight"])

                def step(st, glue=glue):
                    glue.verify(tok["qkv"], tok["z"], tok["a"], tok["b"], st["conv_state"], w["conv_weight"],
                                w["A_log"], w["dt_bias"], st["state"], slots)
                    glue.commit(st["conv_state"], st["state"], slots, accepted, w["A_log"], w["dt_bias"])

                calls = [lambda st=st: step(st) for st in states]
                with torch.inference_mode():
                    try:
                        us, how = timer(calls), "graph" if timer is _graph_us else "timer"
                    except Exception as e:  # noqa: BLE001 - the glue may not capture: timed eagerly then
                        log(f"  {name} + glue did not capture ({type(e).__name__}: {str(e)[:80]}); timing eagerly")
                        torch.cuda.synchronize()
                        us, how = _eager_us(calls), "eager"
                roof = state_bytes("fla", bsz, T, accepted, HV, V, K) / bw * 1e6
                row[name] = dict(us=round(us, 2), timing=how, state_roofline_us=round(roof, 2))
            msg = f"gdn_verify B={bsz} k={k}: " + ", ".join(
                f"{v} {row[v]['us']:.1f}us" + (f" (verify {row[v]['verify_us']:.1f} + commit {row[v]['commit_us']:.1f})"
                                                 if v != "fused" else "") for v in VARIANTS)
            if rules:
                fla_us = min(row[n]["us"] for n in rules)
                row["fla_us"] = fla_us
                for v in VARIANTS:
                    row[f"speedup_{v}"] = round(fla_us / row[v]["us"], 2)
                msg += "; " + ", ".join(f"{n}+glue {row[n]['us']:.1f}us" for n in rules) + " -> " + \
                    " / ".join(f"{row[f'speedup_{v}']:.2f}x" for v in VARIANTS)
            log(msg)
            row["ours_best_us"] = min(row[v]["us"] for v in VARIANTS)
            rows.append(row)
            del states
            if device == "cuda":
                torch.cuda.empty_cache()
    _table(rows, any("fla_us" in r for r in rows), log)
    return rows


def _table(rows, with_fla, log):
    log("\ngdn_verify, µs per layer and step (default tiles); x = fla-core + glue (the faster rule) / ours")
    head = f"{'B':>3} {'k':>3}" + "".join(f" {v:>8}" for v in VARIANTS)
    if with_fla:
        head += f" {'fla+glue':>9}" + "".join(f" {'x ' + v:>9}" for v in VARIANTS)
    log(head)
    for r in rows:
        line = f"{r['batch']:>3} {r['k']:>3}" + "".join(f" {r[v]['us']:>8.1f}" for v in VARIANTS)
        if with_fla and "fla_us" in r:
            line += f" {r['fla_us']:>9.1f}" + "".join(f" {r[f'speedup_{v}']:>9.2f}" for v in VARIANTS)
        log(line)
    target = [r for r in rows if r["batch"] == 32 and r["k"] == 4 and "fla_us" in r]
    if target:
        r = target[0]
        log("target (B = 32, k = 4): ours >= 3x fla-core + glue: " + ", ".join(
            f"{v} {r[f'speedup_{v}']:.2f}x {'met' if r[f'speedup_{v}'] >= 3 else 'NOT met'}" for v in VARIANTS))


def main() -> None:
    import argparse
    import json

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="the checks alone at a small shape (CPU: interpreter)")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--ks", default=",".join(map(str, KS)))
    ap.add_argument("--out", default=None, help="write the rows as json here")
    args = ap.parse_args()
    if args.smoke:
        rows = smoke("cuda" if torch.cuda.is_available() else "cpu")
        print("smoke ok:", ", ".join(r["impl"] for r in rows))
        return
    if not torch.cuda.is_available():
        sys.exit("kernels_gdn_verify.py times CUDA graphs: it needs a GPU (or --smoke)")
    from ocriaquant.bench import copy_bandwidth

    bw = copy_bandwidth(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}: device copy {bw / 1e12:.2f} TB/s", flush=True)
    rows = bench_gdn_verify(bw, lambda m: print(m, flush=True), [int(v) for v in args.batches.split(",")],
                            [int(v) for v in args.ks.split(",")])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    if "--smoke" in sys.argv and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
