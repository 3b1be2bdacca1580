"""A decode step's inputs in one launch: each row's token embedding, its M-RoPE cos / sin, and
the int32 slots and lengths the kernels take.

In torch these are ~15 kernels at the head of every step (the embedding gather, the rotary
module's matmul, concatenations, cos, sin, scaling and casts, two int32 casts), each a launch
and none of them PDL-launched, so the first norm of the step cannot start early either. At
decode the three M-RoPE sections of a text token share one position (length + delta), so cos
and sin are rows of a table the runtime computes once with the same rotary module
(RuntimeModel at load): a gather here gives the same bits as computing them per step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .splitk import use_pdl


@triton.jit
def _step_inputs_kernel(tok_ptr, slot_ptr, len_ptr, delta_ptr, emb_ptr, cos_tab, sin_tab, x_ptr, cos_ptr, sin_ptr,
                        slot32_ptr, len32_ptr, D, ROT, ROWS, stride_emb, stride_tab, BD: tl.constexpr,
                        BR: tl.constexpr, PDL: tl.constexpr):
    """Program b: row b. The first kernel of a step reads only what the host (or the last step's
    greedy_advance, a whole graph earlier) wrote, so it waits on nothing; it lets the step's
    first norm launch at once."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    tok = tl.load(tok_ptr + b)
    length = tl.load(len_ptr + b)
    pos = length + tl.load(delta_ptr + b)
    pos = tl.minimum(tl.maximum(pos, 0), ROWS - 1)  # in range by the runtime's checks; never read outside the table
    for d0 in range(0, D, BD):
        rd = d0 + tl.arange(0, BD)
        m = rd < D
        tl.store(x_ptr + b * D + rd, tl.load(emb_ptr + tok * stride_emb + rd, mask=m), mask=m)
    rr = tl.arange(0, BR)
    rm = rr < ROT
    tl.store(cos_ptr + b * ROT + rr, tl.load(cos_tab + pos * stride_tab + rr, mask=rm), mask=rm)
    tl.store(sin_ptr + b * ROT + rr, tl.load(sin_tab + pos * stride_tab + rr, mask=rm), mask=rm)
    tl.store(slot32_ptr + b, tl.load(slot_ptr + b).to(tl.int32))
    tl.store(len32_ptr + b, length.to(tl.int32))


def step_inputs(tokens: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor, deltas: torch.Tensor,
                embed: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
                pdl: bool | None = None) -> tuple[torch.Tensor, ...]:
    """tokens, slots, lengths, deltas int64 [B] (rows of the step's meta, any stride); embed
    [vocab, D]; cos/sin tables [positions, rot], row p the rotary module at position p. Returns x [B, D], cos, sin [B, rot],
    slots and lengths as int32 [B]. Positions (length + delta) must lie inside the tables: the
    runtime checks lengths against max_len and M-RoPE deltas at prefill. pdl: as splitk.use_pdl."""
    bsz, d, (rows, rot) = tokens.shape[0], embed.shape[1], cos_table.shape
    if (embed.stride(1) != 1 or cos_table.stride() != sin_table.stride() or cos_table.stride(1) != 1
            or sin_table.shape != cos_table.shape or any(t.shape != (bsz,) for t in (slots, lengths, deltas))):
        raise ValueError(f"step_inputs: tokens [{bsz}], embed {tuple(embed.shape)}, tables {tuple(cos_table.shape)}"
                         f" / {tuple(sin_table.shape)} do not fit")
    dev = tokens.device
    x = torch.empty(bsz, d, dtype=embed.dtype, device=dev)
    cos = torch.empty(bsz, rot, dtype=cos_table.dtype, device=dev)
    sin = torch.empty_like(cos)
    slots32 = torch.empty(bsz, dtype=torch.int32, device=dev)
    lengths32 = torch.empty_like(slots32)
    pdl = use_pdl(dev, pdl)
    _step_inputs_kernel[(bsz,)](tokens, slots, lengths, deltas, embed, cos_table, sin_table, x, cos, sin, slots32,
                                lengths32, d, rot, rows, embed.stride(0), cos_table.stride(0),
                                BD=min(4096, triton.next_power_of_2(d)), BR=triton.next_power_of_2(rot),
                                num_warps=4, PDL=pdl)
    return x, cos, sin, slots32, lengths32

