"""The gated delta net token mixer (Qwen3.5's linear attention), its state in per-slot buffers.

The torch path calls transformers' own torch functions for the chunked delta rule (prefill, and
verify's tokens) and runs its recurrence's arithmetic in place for decode (recurrent_step): the same
math transformers runs, fed from and written back to our slot buffers. The recurrent state is fp32
[slots, HV, V, K]; transformers keeps [.., K, V], so it is transposed on the way into its functions
and back. Conv state: [slots, C, kernel - 1]."""

from __future__ import annotations

import functools
import itertools

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.reference import conv_silu_ref, depthwise_causal_conv_silu
from .linear import FusedLinear, QuantLinear
from .norm import gated_rmsnorm
from .step import Chunk, Step, slot_rows


FLA_CHUNK = 64  # fla-core's chunk of the delta rule, which varlen_inputs' chunk indices count in


@functools.lru_cache(maxsize=32)
def varlen_inputs(layout: tuple[tuple[int, int], ...], device: torch.device):
    """A pass's chunks ((rows, slot) each) as fla-core's varlen inputs, made on the host and copied
    from pinned memory without a sync, once per layout (every GDN layer of a pass, and passes
    alike, share them): cu_seqlens on the device and the host, the (sequence, chunk) index of
    each FLA_CHUNK-row chunk (fla would build it on the host and copy it with a sync a layer), and
    the slots the final states go back to."""
    ns = [n for n, _ in layout]
    cu = torch.tensor([0] + list(itertools.accumulate(ns)), dtype=torch.long)
    indices = torch.tensor([(i, j) for i, n in enumerate(ns) for j in range(-(-n // FLA_CHUNK))], dtype=torch.long)
    slots = torch.tensor([s for _, s in layout], dtype=torch.long)

    def put(t):
        return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)

    return put(cu), cu, put(indices), put(slots)


def chunk_rule(gpu_kernels: bool):
    """The chunked gated delta rule for prefill: fla-core's Triton kernel when the triton
    backend runs on a GPU and fla-core is installed, else transformers' torch function — the
    same math, what the torch backend must match."""
    if gpu_kernels:
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule

            return chunk_gated_delta_rule
        except ImportError:
            pass
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    return torch_chunk_gated_delta_rule


def recurrent_step(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """One token of the gated delta rule for B rows: q, k [B, HV, K], v [B, HV, V], g and beta [B, HV];
    state [B, HV, V, K] fp32 (the cache's layout), advanced in place. The arithmetic of transformers'
    torch_recurrent_gated_delta_rule at one token (fp32, q and k l2-normalized, q / sqrt(K)), without its
    transposed state copies and fresh state buffers: on a CPU those were most of a decode step's GDN time.
    Returns the output [B, HV, V] in q's dtype."""
    dtype = q.dtype
    q, k, v = q.float(), k.float(), v.float()
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) / q.shape[-1] ** 0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    state.mul_(g.float().exp()[..., None, None])
    delta = (v - torch.einsum("bhvk,bhk->bhv", state, k)) * beta.float()[..., None]
    state.add_(delta[..., None] * k[..., None, :])
    return torch.einsum("bhvk,bhk->bhv", state, q).to(dtype)


class GatedDeltaNet(nn.Module):
    """A GDN token mixer whose conv and recurrent states are rows of per-slot buffers. With
    kernels (the triton backend) its four input projections run as one weight stream when they
    share a format (else qkv+z and a+b where those do), and a decode step's GDN is one
    gdn_decode launch."""

    INPUTS = ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b")

    def __init__(self, cfg, p: dict, linears: dict[str, QuantLinear]):
        super().__init__()
        self.H, self.HV = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.K, self.V = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.eps = cfg.rms_norm_eps
        self.out_proj = linears["out_proj"]
        self.kernels = self.out_proj.kernels
        self.register_buffer("conv_weight", p["conv1d.weight"].squeeze(1))  # [C, kernel]
        self.register_buffer("A_log", p["A_log"])
        self.register_buffer("dt_bias", p["dt_bias"])
        self.register_buffer("norm_weight", p["norm.weight"])
        self.conv_dim = 2 * self.H * self.K + self.HV * self.V
        self.kernel = self.conv_weight.shape[-1]
        self.fused: list[tuple[FusedLinear, list[str]]] = []

        def fuse(group):
            f = FusedLinear.of([linears[n] for n in group])
            if f is not None:
                self.add_module("fused_" + "_".join(n[len("in_proj_"):] for n in group), f)
                self.fused.append((f, list(group)))
            return f

        if self.kernels and fuse(self.INPUTS) is None:
            fuse(self.INPUTS[:2])
            fuse(self.INPUTS[2:])
        fused = {n for _, group in self.fused for n in group}
        for n in self.INPUTS:
            if n not in fused:
                self.add_module(n, linears[n])

    def input_linears(self) -> list[QuantLinear]:
        return [f.linear for f, _ in self.fused] + [getattr(self, n) for n in self.INPUTS if hasattr(self, n)]

    def tile_keys(self) -> list[tuple]:
        return [key for lin in self.input_linears() for key in lin.tile_keys()] + \
            self.out_proj.tile_keys(quantizes_input=True)

    def _proj(self, x: torch.Tensor, x_q: tuple | None = None) -> dict[str, torch.Tensor]:
        out = {}
        for f, group in self.fused:
            out.update(zip(group, f(x, x_q)))
        for n in self.INPUTS:
            if n not in out:
                out[n] = getattr(self, n)(x, x_q)
        return out

    def alloc_state(self, slots: int, device, dtype) -> dict:
        return {"conv": torch.zeros(slots, self.conv_dim, self.kernel - 1, dtype=dtype, device=device),
                "ssm": torch.zeros(slots, self.HV, self.V, self.K, dtype=torch.float32, device=device)}

    def _heads(self, mixed: torch.Tensor):
        """The conv's output [..., C] as q, k [..., H, K] and v [..., HV, V] (views)."""
        t = mixed.shape[:-1]
        q, k, v = torch.split(mixed, [self.H * self.K, self.H * self.K, self.HV * self.V], dim=-1)
        return q.reshape(*t, self.H, self.K), k.reshape(*t, self.H, self.K), v.reshape(*t, self.HV, self.V)

    def _qkv_gates(self, p, mixed):
        """q, k, v by head (q and k repeated to the value heads), the decay g and β from the conv's
        output and the projections: what transformers' torch functions take."""
        q, k, v = self._heads(mixed)
        beta = p["in_proj_b"].sigmoid()
        g = -self.A_log.float().exp() * F.softplus(p["in_proj_a"].float() + self.dt_bias)
        if self.HV // self.H > 1:
            q = q.repeat_interleave(self.HV // self.H, dim=-2)
            k = k.repeat_interleave(self.HV // self.H, dim=-2)
        return q, k, v, g, beta

    def _out(self, core: torch.Tensor, x: torch.Tensor, p: dict) -> torch.Tensor:
        if self.kernels is not None:  # prefill rows (decode and verify norm inside their kernels): z read in place
            from ..kernels.gated_rmsnorm import gated_rmsnorm as gated_rmsnorm_rows

            return self.out_proj(gated_rmsnorm_rows(core.reshape(x.shape[0], self.HV, self.V).contiguous(),
                                                    p["in_proj_z"], self.norm_weight, self.eps))
        z = p["in_proj_z"].reshape(-1, self.V)
        o = gated_rmsnorm(core.reshape(-1, self.V), z, self.norm_weight, self.eps)
        return self.out_proj(o.reshape(*x.shape[:-1], -1))

    def prefill(self, x: torch.Tensor, state: dict, chunks: list[Chunk], x_q: tuple | None = None) -> torch.Tensor:
        """x [sum n, D]: the rows of several requests' prefill chunks, one after another ->
        [sum n, D]. A chunk that starts at 0 begins from zero history; one that starts later
        continues from its slot's conv and recurrent state. Each writes its slot's state back.
        The projections run over all rows at once; the conv and the delta rule per chunk. x_q:
        FP8 projections' input codes, made by the norm before (QuantLinear.forward_w8a8)."""
        p = self._proj(x, x_q)
        rule = chunk_rule(self.kernels is not None and x.is_cuda)
        if rule.__module__.startswith("fla"):
            return self._prefill_fla(rule, p, x, state, chunks)
        cores, row = [], 0
        for c in chunks:
            rows = slice(row, row + c.n)
            row += c.n
            mixed = self._conv_rows(p["in_proj_qkv"][rows], state["conv"], c)  # [n, C]
            q, k, v, g, beta = self._qkv_gates({n: t[rows] for n, t in p.items()}, mixed)
            initial = state["ssm"][c.slot].transpose(-1, -2)[None].contiguous() if c.start else None
            core, final = rule(q[None], k[None], v[None], g=g[None], beta=beta[None], initial_state=initial,
                               output_final_state=True, use_qk_l2norm_in_kernel=True)
            state["ssm"][c.slot].copy_(final[0].transpose(-1, -2))  # [HV, K, V] -> our [HV, V, K]
            cores.append(core[0].to(x.dtype))
        return self._out(cores[0] if len(cores) == 1 else torch.cat(cores), x, p)

    def _prefill_fla(self, rule, p: dict, x: torch.Tensor, state: dict, chunks: list[Chunk]) -> torch.Tensor:
        """prefill through fla-core >= 0.6, every chunk of the pass in one call (varlen, its indices made
        on the host: varlen_inputs): q, k at their key heads (GVA), the decay made in its cumsum kernel
        from a, A_log and dt_bias, the state V-first as ours."""
        mixed = torch.empty(x.shape[0], self.conv_dim, dtype=x.dtype, device=x.device)
        row = 0
        for c in chunks:  # the conv per chunk (its own history), side by side in one buffer
            self._conv_rows(p["in_proj_qkv"][row:row + c.n], state["conv"], c, out=mixed[row:row + c.n])
            row += c.n
        q, k, v = self._heads(mixed)
        initial = None
        if any(c.start for c in chunks):  # then every chunk starts from a state: zero for a prompt's first
            zero = state["ssm"].new_zeros(state["ssm"].shape[1:])
            initial = torch.stack([state["ssm"][c.slot] if c.start else zero for c in chunks])
        varlen = {}
        if len(chunks) > 1:
            cu, cu_cpu, indices, slots = varlen_inputs(tuple((c.n, c.slot) for c in chunks), x.device)
            varlen = {"cu_seqlens": cu, "cu_seqlens_cpu": cu_cpu, "chunk_indices": indices}
        core, final = rule(q[None], k[None], v[None], g=p["in_proj_a"][None], beta=p["in_proj_b"].sigmoid()[None],
                           initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=True,
                           use_gate_in_kernel=True, A_log=self.A_log, dt_bias=self.dt_bias, state_v_first=True,
                           chunk_size=FLA_CHUNK, **varlen)
        if varlen:
            state["ssm"].index_copy_(0, slots, final)
        else:
            state["ssm"][chunks[0].slot].copy_(final[0])
        return self._out(core[0], x, p)

    def _conv_rows(self, x: torch.Tensor, conv: torch.Tensor, c: Chunk, out: torch.Tensor | None = None):
        """silu(depthwise causal conv) of a chunk's rows x [n, C], continuing from its slot's conv
        state (its last kernel - 1 inputs) unless the chunk starts the prompt; the state then holds
        the chunk's last inputs. With kernels one conv_silu launch on the rows as they lie (into
        `out` when given); else its torch reference."""
        w = self.kernel - 1
        history = conv[c.slot] if c.start else None
        if self.kernels is not None:
            from ..kernels.conv_silu import conv_silu

            y = conv_silu(x, history, self.conv_weight, out=out)
        else:
            y = conv_silu_ref(x, history, self.conv_weight)
            y = y if out is None else out.copy_(y)
        past = history if history is not None else x.new_zeros(x.shape[1], w)  # read above before it moves on
        conv[c.slot].copy_(torch.cat([past, x[-w:].T], dim=1)[:, -w:])
        return y

    def decode(self, x: torch.Tensor, state: dict, step: Step, x_q: tuple | None = None, partials: bool = False):
        """x [B, D], one token per slot -> [B, D]; the slots' states advance in place. partials:
        out_proj's output may come back unreduced (QuantLinear.forward; kernels only)."""
        p = self._proj(x, x_q)
        if self.kernels:
            from ..kernels.gdn_decode import gdn_decode

            # An FP8 out_proj's input comes from gdn_decode itself: above batch 1 quantized there (one
            # launch fewer), at batch 1 as its absmax in parts, out_proj's GEMV quantizing its own slices.
            quant = self.out_proj.producer_quant(x)
            o = gdn_decode(p["in_proj_qkv"], p["in_proj_z"], p["in_proj_a"], p["in_proj_b"], state["conv"],
                           self.conv_weight, self.A_log, self.dt_bias, self.norm_weight, state["ssm"], step.slots32,
                           self.H, self.K, self.V, self.eps, quant=quant, pdl=self.kernels.pdl)
            o, o_q = (o, None) if quant is None else o
            return self.out_proj(o, o_q, partials)
        conv, ssm = slot_rows(state["conv"], step), slot_rows(state["ssm"], step)
        window = torch.cat([conv, p["in_proj_qkv"][:, :, None]], dim=-1)  # [B, C, kernel]
        mixed = depthwise_causal_conv_silu(window, self.conv_weight)
        core = recurrent_step(*self._qkv_gates(p, mixed), ssm)
        conv.copy_(window[:, :, 1:])
        if not step.in_order:  # copies: back into their slots
            state["conv"].index_copy_(0, step.slots, conv)
            state["ssm"].index_copy_(0, step.slots, ssm)
        return self._out(core, x, p)

    # --- speculative decoding (#55): verify T tokens per row, then commit each row's accepted prefix ---------

    def alloc_scratch(self, rows: int, tokens: int, device, dtype):
        """What verify keeps for commit, for up to `rows` rows of `tokens` (= k + 1) positions, indexed by
        row (not slot): the conv window [rows, kernel-1+tokens, C] (the slot's conv state, then the new
        columns) and the states after tokens 1 … tokens-1 [rows, tokens-1, HV, V, K] fp32 (the state after
        the last token goes into the slot): a dict of the two. With kernels, kernels/gdn_verify's
        SpecScratch of its "replay" design instead: each token's k, v and gates, ~1/64 of a state a
        token at the 4B (where "states" would hold 2 MiB a token and row, 12 GiB at 64 rows and k = 4),
        the slot keeping its state until commit replays the accepted prefix — fewer bytes moved too."""
        if self.kernels:
            from ..kernels.gdn_verify import spec_scratch

            return spec_scratch("replay", rows, tokens, self.H, self.K, self.HV, self.V, self.kernel, device, dtype)
        return {"window": torch.zeros(rows, self.kernel - 1 + tokens, self.conv_dim, dtype=dtype, device=device),
                "states": torch.zeros(rows, tokens - 1, self.HV, self.V, self.K, dtype=torch.float32, device=device)}

    def verify(self, x: torch.Tensor, state: dict, step: Step, slots: torch.Tensor, scratch,
               x_q: tuple | None = None, pending: tuple | None = None) -> torch.Tensor:
        """x [B·T, D]: T tokens per row, row b's at rows b·T … b·T+T-1, continuing its slot's state
        (slots [B], one per row; `step` is the flattened rows' Step, its slots32 unused here) ->
        [B·T, D], each token's output exactly as T sequential decode steps give it. Leaves in `scratch`
        (alloc_scratch) what commit needs to roll back to any prefix, the slot's conv state untouched and
        its recurrent state after all T tokens (torch) or untouched (kernels' replay design): only commit's
        result is the contract. x_q: as decode's. pending (kernels only): (scratch, rows, accepted) of a
        verify not yet committed, committed first in the same pass (gdn_verify's Pending)."""
        bsz = slots.shape[0]
        T = x.shape[0] // bsz
        p = self._proj(x, x_q)
        if self.kernels:  # one launch for the T conv + delta-rule updates of every row (kernels/gdn_verify.py)
            from ..kernels.gdn_verify import Pending, gdn_verify

            o = gdn_verify(*(p[n].unflatten(0, (bsz, T)) for n in self.INPUTS), state["conv"], self.conv_weight,
                           self.A_log, self.dt_bias, self.norm_weight, state["ssm"], slots.to(torch.int32), scratch,
                           self.H, self.K, self.V, self.eps, pending=pending and Pending(*pending),
                           pdl=self.kernels.pdl)
            return self.out_proj(o.reshape(bsz * T, -1))
        if pending is not None:
            raise ValueError("a pending commit rides on the kernels' verify only; the torch path commits at once")
        from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

        qkv = p["in_proj_qkv"].unflatten(0, (bsz, T))                              # [B, T, C]
        window = torch.cat([state["conv"][slots], qkv.transpose(1, 2)], dim=-1)    # [B, C, kernel-1+T]
        scratch["window"][:bsz] = window.transpose(1, 2)
        mixed = depthwise_causal_conv_silu(window.unfold(2, self.kernel, 1), self.conv_weight[:, None])  # [B, C, T]
        q, k, v, g, beta = self._qkv_gates({n: t.unflatten(0, (bsz, T)) for n, t in p.items()}, mixed.transpose(1, 2))
        s = state["ssm"][slots]  # [B, HV, V, K]
        cores = []
        for t in range(T):  # token by token as decode runs them: the same function on the same inputs, laid
            tt = slice(t, t + 1)  # out alike (a [V, K] state seen as [K, V]: its sums' order depends on it)
            core, new = torch_recurrent_gated_delta_rule(q[:, tt], k[:, tt], v[:, tt], g=g[:, tt], beta=beta[:, tt],
                                                         initial_state=s.transpose(-1, -2), output_final_state=True,
                                                         use_qk_l2norm_in_kernel=True)
            s = new.transpose(-1, -2).contiguous()
            if t < T - 1:
                scratch["states"][:bsz, t] = s
            cores.append(core)
        state["ssm"].index_copy_(0, slots, s)
        return self._out(torch.cat(cores, 1).flatten(0, 1), x, p)

    def commit(self, state: dict, scratch, slots: torch.Tensor, accepted: torch.Tensor) -> None:
        """After verify with the same rows and scratch: each row's slot as if exactly accepted[b] ∈ [1, T]
        of its T tokens had been decoded (a copy from the scratch, never a recompute). accepted: [B] on
        the device."""
        if self.kernels:
            from ..kernels.gdn_verify import gdn_commit

            gdn_commit(scratch, state["conv"], state["ssm"], slots.to(torch.int32), accepted.to(torch.int32),
                       self.H, self.K, self.V)
            return
        bsz = slots.shape[0]
        rows = torch.arange(bsz, device=slots.device)
        T = scratch["window"].shape[1] - (self.kernel - 1)
        n = accepted.clamp(1, T)
        if T > 1:  # the slot holds the state after all T; rows that took fewer get theirs from the scratch
            kept = scratch["states"][rows, (n - 1).clamp(max=T - 2)]
            state["ssm"].index_copy_(0, slots, torch.where((n < T)[:, None, None, None], kept, state["ssm"][slots]))
        cols = n[:, None] + torch.arange(self.kernel - 1, device=slots.device)[None]   # window columns n … n+kernel-2
        state["conv"].index_copy_(0, slots, scratch["window"][rows[:, None], cols].transpose(1, 2).contiguous())
