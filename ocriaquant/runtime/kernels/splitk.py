"""Shared pieces of the weight-streaming GEMVs: launch geometry and the split-K epilogue.

Decode GEMVs have a tiny M and a 2560-wide N on Qwen3.5-4B: N / 16 rows = 160 tiles, barely
more than the H200's 132 SMs, so one tile per CTA leaves SMs idle for a second "wave". The K
loop is therefore split across CTAs. Partial sums go to an fp32 workspace and the last CTA to
finish a tile (an acq_rel ticket counter per tile) adds them up and writes the bf16 output:
one launch, no memset (the last CTA resets its counter, so the buffers can live in a CUDA
graph), no separate reduction kernel.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .partials import Partials
from .rounding import round_bf16

_WORKSPACES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def interpreted() -> bool:
    """Whether Triton runs the kernels in its CPU interpreter (TRITON_INTERPRET=1, what CI runs),
    where they take their integer-rounding and no-PTX paths."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter: exercise the split-K path at small shapes
    return torch.cuda.get_device_properties(device).multi_processor_count


def geometry(n: int, k: int, block_n: int, block_k: int, device: torch.device, split_k: int | None = None):
    """(tiles along N, splits along K). Enough CTAs for ~4 per SM, never a split smaller than
    4 K-blocks (the epilogue's extra traffic must stay small against the weight stream)."""
    tiles = triton.cdiv(n, block_n)
    if split_k is None:
        want = max(1, (4 * sm_count(device)) // tiles)
        split_k = max(1, min(want, k // (4 * block_k)))
    return tiles, split_k


def workspace(device: torch.device, shape: tuple, tickets: int, owner: str = "gemv"):
    """fp32 partials of `shape` and `tickets` int32 counters (zero, self-resetting), made once
    per (owner, device, shape, tickets) and reused, so they can live in a CUDA graph. Kernels
    that use them (the GEMVs here, gdn_decode) run one after another on a stream."""
    key = (owner, device, shape, tickets)  # tickets too: a smaller ticket array would be overrun
    if key not in _WORKSPACES:
        _WORKSPACES[key] = (torch.empty(shape, dtype=torch.float32, device=device),
                            torch.zeros(tickets, dtype=torch.int32, device=device))
    return _WORKSPACES[key]


def launch_plan(m: int, n: int, k: int, block_n: int, block_k: int, device: torch.device,
                split_k: int | None, out: torch.Tensor | None):
    """Everything a GEMV launch needs besides its operands: (BM, grid, K per split, out,
    workspace, tickets). M is padded to at least 16, the smallest tensor-core tile."""
    bm = max(16, triton.next_power_of_2(m))
    tiles, splits = geometry(n, k, block_n, block_k, device, split_k)
    k_per = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    splits = triton.cdiv(k, k_per)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=device) if out is None else out
    ws, tick = workspace(device, (splits, bm, n), tiles)
    return bm, (tiles, splits), k_per, out, ws, tick


def use_pdl(device: torch.device, pdl: bool | None = None) -> bool:
    """Whether a decode kernel launches with programmatic dependent launch (Hopper): its CTAs
    start while the previous kernel drains. A GEMV issues its first weight loads — which no
    earlier kernel writes — before waiting on it (`wait_for_inputs`), so the weight stream does
    not begin with a launch and a DRAM round trip; gdn_decode does the same with its state at
    batch 1; the small kernels wait first (`start_after_producer`) and gain the launch.
    pdl: None, on where the GPU has it (CUDA, compute capability 9 or more); True / False, the
    caller's choice (the runtime's configuration). Never on another device (the interpreter)."""
    if pdl is not None:
        return pdl and device.type == "cuda"
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


@triton.jit
def prefetch_l2(ptrs):
    """Each address's line into L2 (prefetch.global.L2); the int32 returned is a dummy."""
    return tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def prefetch_ahead(w_ptr, rn, N, stride_wn, start, end, AHEAD: tl.constexpr, STEP: tl.constexpr,
                   LINE: tl.constexpr):
    """Ask L2 for elements start … start + AHEAD·STEP - 1 (clamped below end) of rows rn (clamped
    below N) of w_ptr, one request per LINE elements (128 bytes). GPU only."""
    if AHEAD > 0:
        rl = tl.arange(0, (AHEAD * STEP + LINE - 1) // LINE)
        off = tl.minimum(start + rl * LINE, end - 1)
        prefetch_l2(w_ptr + tl.minimum(rn, N - 1)[:, None] * stride_wn + off[None, :])


def l2_ahead(interpret: bool, tiles_after_first: int, ahead: int) -> int:
    """prefetch_ahead's AHEAD for a launch asking `ahead` tiles: 0 under the interpreter (no PTX), never more than
    the split has tiles left, a power of two."""
    a = 0 if interpret else min(ahead, tiles_after_first)
    return 1 << (a.bit_length() - 1) if a > 0 else 0


@triton.jit
def split_tile(N, K, K_PER_SPLIT, BN: tl.constexpr):
    """This CTA's rows and K range in a (tiles along N, splits along K) grid: (pid_n, pid_k,
    rows, row mask, k_start, k_end)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    k_start = pid_k * K_PER_SPLIT
    return pid_n, pid_k, rn, rn < N, k_start, tl.minimum(k_start + K_PER_SPLIT, K)


@triton.jit
def whole_tile_mask(nmask, cols, t0, t_end):
    """The mask of a [rows, len(cols)] tile at K position t0 of a split whose K range is whole tiles
    (split_tile with K_PER_SPLIT and K multiples of the tile): rows nmask, every column the same,
    t0 < t_end. Built in the load's own shape: a mask reshaped into it loses its constancy along K
    under Triton 3.6 (the device's compiler), and the load goes 4 bytes at a time."""
    return nmask[:, None] & (cols * 0 + t0 < t_end)[None, :]


@triton.jit
def start_after_producer(PDL: tl.constexpr):
    """First statement of a small PDL-launched kernel (norms, activation quantization, attention):
    let the kernel after it launch now — a GEMV, which streams weights until it waits on this
    one —, then wait for the kernel before it, whose outputs this one reads. Launched this way
    these kernels also hide their own launch behind their producer's tail."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Under PDL: wait until the previous kernel has finished (its writes visible), then let the
    next one launch. Everything before this may read only constant data (weights, scales)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def after_wait(x):
    """x (a scalar), passed through a non-pure asm: called after wait_for_inputs, the value cannot be had
    before the wait, so a pure asm load that takes it as an operand (half2.load_pairs_v4's `after`) cannot
    be moved above the wait either. A mov, where a tl.load after the wait would do the same with a memory
    round trip before the first such load."""
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def store_row(y, y_ptr, ws_ptr, tick_ptr, pid_n, pid_k, N, BN: tl.constexpr, SPLIT_K: tl.constexpr,
              PARTIALS: tl.constexpr, INTERPRET: tl.constexpr):
    """The batch-1 GEMVs' epilogue for this CTA's fp32 outputs y [BN]: with PARTIALS only its
    split's partial, at row pid_k of the workspace (where store_or_reduce puts it; the consumer
    adds the splits, partials.py); else store_or_reduce's bf16 row."""
    if PARTIALS:
        rn = pid_n * BN + tl.arange(0, BN)
        tl.store(ws_ptr + pid_k * N + rn, y, mask=rn < N)
    else:
        if INTERPRET and SPLIT_K == 1:  # the interpreter's bf16 store truncates (rounding.py)
            y = round_bf16(y)
        store_or_reduce(y[None, :], y_ptr, ws_ptr, tick_ptr, pid_n, pid_k, 1, N, 0, 1, BN, SPLIT_K)


def partials_view(ws: torch.Tensor, splits: int, n: int) -> Partials:
    """The parts store_row wrote with PARTIALS, as Partials [splits, 1, N]."""
    return Partials(ws.view(-1)[:splits * n].view(splits, 1, n))


@triton.jit
def store_or_reduce(acc, y_ptr, ws_ptr, tick_ptr, pid_n, pid_k, M, N, stride_ym,
                    BM: tl.constexpr, BN: tl.constexpr, SPLIT_K: tl.constexpr):
    """Write tile `acc` [BM, BN] (fp32) to y (bf16), summing the SPLIT_K partials if split."""
    rm = tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    w_ptrs = ws_ptr + rm[:, None] * N + rn[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(w_ptrs + pid_k * BM * N, acc, mask=mask)
        # Every thread's partial is written (barrier) before the ticket releases it; the last
        # ticket acquires everyone else's, and the barrier after keeps all reads behind it.
        tl.debug_barrier()
        ticket = tl.atomic_add(tick_ptr + pid_n, 1, sem="acq_rel")
        tl.debug_barrier()
        if ticket == SPLIT_K - 1:
            total = tl.zeros((BM, BN), dtype=tl.float32)
            for s in range(SPLIT_K):
                total += tl.load(w_ptrs + s * BM * N, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(tick_ptr + pid_n, 0)
