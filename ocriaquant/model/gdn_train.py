"""The chunked gated delta rule for training: which implementation runs forward and backward.

transformers' Qwen3.5 GDN layer calls the module-level `torch_chunk_gated_delta_rule` of
`modeling_qwen3_5` for a whole sequence (prefill, training); `install(name)` points it at one of:

- `torch`: transformers' own function (fp32, a Python loop over 64-token chunks), autograd through it.
- `fla`: fla-core's `chunk_gated_delta_rule`, Triton kernels forward and backward. On Hopper with
  Triton >= 3.4 and < 3.7.1 fla refuses the backward: Triton miscompiles its gated
  `chunk_bwd_dqkwg` there and the gradients come out wrong (fla issue #640).
- `fla-bk32`: the same, with `chunk_bwd_dqkwg` launched on K tiles of 32 instead of 64 (the tile
  reported miscompiled) and fla's guard skipped. Only ever chosen by the check below.
- `fla-fwd`: fla's forward kernels; the backward recomputes the chunk with transformers' torch
  function and differentiates that (correct wherever fla's forward is; saves the torch forward only).

`select(...)` runs every candidate's forward and backward on random inputs of the model's GDN
shape, compares outputs and gradients with the torch function in fp32, times the ones that agree,
and returns the fastest of those with all the figures (the training log keeps them). On a CPU only
`torch` runs. Nothing here is used by inference: the runtime keeps its own prefill path.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import time

import torch

CANDIDATES = ("fla", "fla-bk32", "fla-fwd", "torch")


def torch_reference():
    """transformers' torch chunk function itself (under the kernel-hub wrapper and our routing)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    return inspect.unwrap(m.torch_chunk_gated_delta_rule)


def _fla_chunk():
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule


_FLA_DQKWG = []  # fla's own chunk_bwd_dqkwg, kept while ours is in its place


def _patch_bk32(on: bool = True) -> None:
    """Point fla's GDN backward at a chunk_bwd_dqkwg launcher with K tiles of at most 32 (and no
    Hopper/Triton guard), or (on=False) back at fla's own. The kernel is fla's; only its launch
    differs (MIT, fla-org)."""
    import triton
    from fla.ops.common import chunk_o
    from fla.ops.gated_delta_rule import chunk as gdn_chunk

    patched = getattr(gdn_chunk.chunk_bwd_dqkwg, "ocriaquant_bk32", False)
    if not on:
        if patched:
            gdn_chunk.chunk_bwd_dqkwg = _FLA_DQKWG[0]
        return
    if patched:
        return

    def chunk_bwd_dqkwg_bk32(q, k, v, do, h, dh, w=None, g=None, g_gamma=None, dv=None, scale=None,
                             state_v_first=False, cu_seqlens=None, chunk_size=64, chunk_indices=None):
        B, T, H, K, V, HV = *k.shape, v.shape[-1], v.shape[2]
        BT = chunk_size
        if chunk_indices is None and cu_seqlens is not None:
            chunk_indices = chunk_o.prepare_chunk_indices(cu_seqlens, BT)
        NT = triton.cdiv(T, BT) if cu_seqlens is None else len(chunk_indices)
        BK = min(max(triton.next_power_of_2(K), 16), 32)
        BV = min(max(triton.next_power_of_2(V), 16), 32)
        NK = triton.cdiv(K, BK)
        dq = q.new_empty(B, T, HV, K)
        dk = k.new_empty(B, T, HV, K)
        dg = torch.empty(NK, *g.shape, dtype=torch.float32, device=g.device) if g is not None else None
        dw = torch.empty_like(w) if w is not None else None
        chunk_o.chunk_bwd_kernel_dqkwg[(NK * NT, B * HV)](
            q=q, k=k, v=v, g=g, g_gamma=g_gamma, h=h, do=do, dh=dh, dq=dq, dk=dk, dw=dw, dv=dv, dg=dg,
            cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, scale=scale, B=B, T=T, H=H, HV=HV, K=K, V=V,
            BT=BT, BK=BK, BV=BV, STATE_V_FIRST=state_v_first)
        if H != HV:
            dq = dq.view(B, T, H, HV // H, K).sum(3)
            dk = dk.view(B, T, H, HV // H, K).sum(3)
        if dg is not None:
            dg = dg.sum(0)
        return dq, dk, dw, dg

    chunk_bwd_dqkwg_bk32.ocriaquant_bk32 = True
    _FLA_DQKWG[:] = [gdn_chunk.chunk_bwd_dqkwg]
    gdn_chunk.chunk_bwd_dqkwg = chunk_bwd_dqkwg_bk32


class _FlaForwardTorchBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta):
        ctx.save_for_backward(q, k, v, g, beta)
        o, _ = _fla_chunk()(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False,
                            use_qk_l2norm_in_kernel=True)
        return o

    @staticmethod
    def backward(ctx, do):
        inputs = [t.detach().requires_grad_(True) for t in ctx.saved_tensors]
        with torch.enable_grad():
            o, _ = torch_reference()(*inputs, use_qk_l2norm_in_kernel=True)
        return torch.autograd.grad(o, inputs, do)


def implementation(name: str):
    """A function with transformers' `torch_chunk_gated_delta_rule` signature running `name`."""
    if name == "torch":
        return torch_reference()
    if name in ("fla", "fla-bk32", "fla-fwd"):
        _patch_bk32(name == "fla-bk32")  # process-wide: the last implementation made is the one in force
    if name in ("fla", "fla-bk32"):
        fla = _fla_chunk()

        def run(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, **kwargs):
            return fla(query, key, value, g=g, beta=beta, initial_state=initial_state,
                       output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        return run
    if name == "fla-fwd":
        def run(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, **kwargs):
            if not torch.is_grad_enabled() or initial_state is not None or output_final_state \
                    or not use_qk_l2norm_in_kernel:  # inference (generate): fla's forward alone
                return _fla_chunk()(query, key, value, g=g, beta=beta, initial_state=initial_state,
                                    output_final_state=output_final_state,
                                    use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
            return _FlaForwardTorchBackward.apply(query, key, value, g, beta), None
        return run
    raise ValueError(f"unknown GDN implementation {name!r}; known: {', '.join(CANDIDATES)}")


def install(name: str) -> None:
    """Make transformers' Qwen3.5 GDN layers run `name` for whole sequences (this process only)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    m.torch_chunk_gated_delta_rule = implementation(name)


@contextlib.contextmanager
def differentiable(device):
    """While open, transformers' Qwen3.5 GDN layers have a backward that runs here (calibration's
    gradients): on CUDA with fla-core, `fla-fwd` (fla's forward, the torch function's backward: fla
    refuses its own on Hopper with Triton < 3.7.1), CPU tensors still on the torch function;
    elsewhere as loaded. Yields the implementation's name."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    from .route_kernels import routed

    if torch.device(device).type != "cuda" or importlib.util.find_spec("fla") is None:
        yield "as loaded"
        return
    saved = m.torch_chunk_gated_delta_rule
    m.torch_chunk_gated_delta_rule = routed(implementation("fla-fwd"), torch_reference())
    try:
        yield "fla-fwd"
    finally:
        m.torch_chunk_gated_delta_rule = saved


def _inputs(b: int, t: int, heads: int, dim: int, device, seed: int = 0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(b, t, heads, dim, generator=gen)
    k = torch.randn(b, t, heads, dim, generator=gen)
    v = torch.randn(b, t, heads, dim, generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(b, t, heads, generator=gen)) * 0.5  # log decay <= 0
    beta = torch.rand(b, t, heads, generator=gen)
    do = torch.randn(b, t, heads, dim, generator=gen)
    return [x.to(device) for x in (q, k, v, g, beta, do)]


def _run(fn, q, k, v, g, beta, do):
    xs = [x.detach().clone().requires_grad_(True) for x in (q, k, v, g, beta)]
    o, _ = fn(*xs, use_qk_l2norm_in_kernel=True)
    o.backward(do.to(o.dtype))
    return [o.detach().float()] + [x.grad.detach().float() for x in xs]


def _rel_err(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-12)) for a, b in zip(got, want))


def select(heads: int, dim: int, device, candidates=CANDIDATES, check_shape=(2, 320), time_shape=(32, 1024),
           tol: float = 0.05) -> tuple[str, dict]:
    """The fastest implementation whose forward and backward agree with the torch function in fp32.

    Inputs as training feeds them (q, k, v, beta bf16 on a GPU; the decay g fp32). A candidate
    that raises (fla absent, fla's guard) or disagrees (error above max(tol, 3x the torch
    function's own bf16 error)) is reported and skipped. Returns (name, report)."""
    device = torch.device(device)
    report: dict[str, dict] = {}
    if device.type != "cuda":
        return "torch", {"torch": {"ok": True, "note": "CPU: the torch function only"}}
    low = torch.bfloat16
    q, k, v, g, beta, do = _inputs(*check_shape, heads, dim, device)
    want = _run(torch_reference(), q, k, v, g, beta, do)  # fp32 reference
    cast = [x.to(low) for x in (q, k, v)] + [g, beta.to(low), do.to(low)]
    base_err = _rel_err(_run(torch_reference(), *cast), want)
    limit = max(tol, 3 * base_err)
    report["torch"] = {"ok": True, "err_bf16": round(base_err, 5)}
    for name in candidates:
        if name == "torch":
            continue
        try:
            err = _rel_err(_run(implementation(name), *cast), want)
            report[name] = {"ok": err <= limit, "err_bf16": round(err, 5), "limit": round(limit, 5)}
        except Exception as e:  # not installed, refused by a guard, failed to compile
            report[name] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:200]}"}
    tq, tk, tv, tg, tb, tdo = _inputs(*time_shape, heads, dim, device, seed=1)
    tcast = [x.to(low) for x in (tq, tk, tv)] + [tg, tb.to(low), tdo.to(low)]
    best, best_ms = "torch", float("inf")
    for name in candidates:
        if not report.get(name, {}).get("ok"):
            continue
        fn = implementation(name)
        for _ in range(2):
            _run(fn, *tcast)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            _run(fn, *tcast)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) / 5 * 1e3
        report[name]["fwd_bwd_ms"] = round(ms, 3)
        if ms < best_ms:
            best, best_ms = name, ms
    report["shape"] = {"check": list(check_shape), "time": list(time_shape), "heads": heads, "dim": dim}
    return best, report
