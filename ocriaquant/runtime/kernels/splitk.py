"""Shared pieces of the weight-streaming GEMVs: launch geometry and the split-K epilogue.

Decode GEMVs have a tiny M and a 2560-wide N on Qwen3.5-4B: N / 16 rows = 160 tiles, barely
more than the H200's 132 SMs, so one tile per CTA leaves SMs idle for a second "wave". The K
loop is therefore split across CTAs. Partial sums go to an fp32 workspace and the last CTA to
finish a tile (an acq_rel ticket counter per tile) adds them up and writes the bf16 output:
one launch, no memset (the last CTA resets its counter, so the buffers can live in a CUDA
graph), no separate reduction kernel.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from ..partials import Partials
from .rounding import round_bf16

_WORKSPACES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

# store_or_reduce's EARLY_TICKET form: each CTA takes its ticket right after its PDL wait (take_ticket), its round trip
# hidden behind the K loop; at the end only the last arrival's CTA keeps its partial in registers and reads the
# others', which store theirs and exit with no fence and no atomic; a partial not yet visible reads as UNSET, and
# the reader reads again. The old form's last CTA waited for its own partial's store (the ticket's release), then
# the ticket, then the partials: two more round trips at the kernel's tail. Both sum the splits in the same order
# (bit-identical outputs, tests/test_kernels.py). On an H100 (session 40, scripts/probe_splitk_tail.py) it took NVFP4
# down_proj's batch-1 rule from 8.42 to 7.85 µs and every split NVFP4 tile 0.4-1.4 µs lower; but the FP8 tensor-core
# form never finished a split launch there, because take_ticket's vector then had copies (its docstring). Mended, that
# form ran on an H100 (session 41: bit-identical; FP8 2560x4096 at batch 32, no split beat the unsplit rule's
# 6.33 µs), but down_proj's 2-warp tile hung in back-to-back launches: one warp reset partials another had not read
# yet (the barrier in store_or_reduce), mended and not yet run on a GPU: off by default until it has.
# OCRIAQUANT_SPLITK_EARLY=1 turns it on (read at import; the module value at every launch, for A/Bs: ab_step's
# kernels.splitk.SPLITK_EARLY=1).
SPLITK_EARLY = int(os.environ.get("OCRIAQUANT_SPLITK_EARLY", "0"))
# The bits of a workspace value not written yet: a NaN (sign set, all payload bits) that no arithmetic makes
# (NVIDIA GPUs write every NaN they compute as 0x7FFFFFFF), so a partial never reads as UNSET.
UNSET = tl.constexpr(-1)


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


def workspace(device: torch.device, shape: tuple, tickets: int, owner: str = "gemv", unset: bool = False):
    """fp32 partials of `shape` and `tickets` int32 counters (zero, self-resetting), made once
    per (owner, device, shape, tickets) and reused, so they can live in a CUDA graph. Kernels
    that use them (the GEMVs here, gdn_decode) run one after another on a stream. unset: the
    partials start as UNSET's bits (store_or_reduce's EARLY_TICKET form, which leaves them so)."""
    key = (owner, device, shape, tickets)  # tickets too: a smaller ticket array would be overrun
    if key not in _WORKSPACES:
        ws = (torch.full(shape, UNSET.value, dtype=torch.int32, device=device).view(torch.float32) if unset
              else torch.empty(shape, dtype=torch.float32, device=device))
        _WORKSPACES[key] = (ws, torch.zeros(tickets, dtype=torch.int32, device=device))
    return _WORKSPACES[key]


def launch_plan(m: int, n: int, k: int, block_n: int, block_k: int, device: torch.device,
                split_k: int | None, out: torch.Tensor | None, early: bool = False):
    """Everything a GEMV launch needs besides its operands: (BM, grid, K per split, out,
    workspace, tickets). M is padded to at least 16, the smallest tensor-core tile. early: the
    launch reduces its splits by store_or_reduce's EARLY_TICKET form, whose workspace (its own, never a
    Partials') holds UNSET wherever no split has written."""
    bm = max(16, triton.next_power_of_2(m))
    tiles, splits = geometry(n, k, block_n, block_k, device, split_k)
    k_per = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    splits = triton.cdiv(k, k_per)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=device) if out is None else out
    ws, tick = workspace(device, (splits, bm, n), tiles, owner="gemv_early" if early else "gemv", unset=early)
    return bm, (tiles, splits), k_per, out, ws, tick


def early_ticket(partials: bool = False) -> bool:
    """Whether a split launch reduces by store_or_reduce's EARLY_TICKET form (SPLITK_EARLY, read at every launch);
    never one that leaves its partials to the consumer (Partials)."""
    return bool(SPLITK_EARLY) and not partials


def use_pdl(device: torch.device, pdl: bool | None) -> bool:
    """Whether a decode kernel launches with programmatic dependent launch (Hopper): its CTAs
    start while the previous kernel drains. A GEMV issues its first weight loads — which no
    earlier kernel writes — before waiting on it (`wait_for_inputs`), so the weight stream does
    not begin with a launch and a DRAM round trip; gdn_decode does the same with its state at
    batch 1; the small kernels wait first (`start_after_producer`) and gain the launch. On an
    H200 the GEMVs took the mixed plan's batch-1 step from 2.75 to 2.57 ms (BENCHMARKS.md,
    session 5); with everything of session 6, 2.59 ms without PDL against 2.26 ms with it.
    OCRIAQUANT_PDL=0 turns it off; never under the interpreter."""
    if pdl is not None:
        return pdl and device.type == "cuda"
    return device.type == "cuda" and os.environ.get("OCRIAQUANT_PDL", "1") != "0" and \
        torch.cuda.get_device_capability(device)[0] >= 9


# When the kernels that wait with wait_for_inputs (the GEMVs, gdn_decode) let the next kernel launch
# before their own wait rather than after it (pdl_launch). Either order is correct: a kernel's wait
# returns only once the kernel before it has finished, which waited on the one before that, and
# nothing before a wait reads what an unfinished kernel writes. Before: the next kernel's CTAs
# (and their pre-wait weight loads) can start while this one still waits, so more than one
# kernel's weights are in flight — but those CTAs also take SM room, which a kernel whose grid
# does not fit on the GPU at once needs for its later CTAs. 0: never before; 1: before, in a
# batch-1 launch whose whole grid is resident at once (one wave, from its compiled registers, warps
# and shared memory: one_wave); 2: always before. TRIGGER_FIRST_SKIP: kernels (names, comma-separated)
# that always wait first. Read at every launch (ab_step can switch them); OCRIAQUANT_PDL_TRIGGER_FIRST
# and OCRIAQUANT_PDL_TRIGGER_FIRST_SKIP set them at import.
# Default 0: the one-wave order won only in graphs captured third or later in a process; a process's first capture
# of it (what bench and a serving engine replay) was slower than waiting first (BENCHMARKS.md, session 29).
TRIGGER_FIRST = int(os.environ.get("OCRIAQUANT_PDL_TRIGGER_FIRST", "0"))
# The NVFP4 batch-1 GEMVs wait first: triggering first cost the nvfp4 plan's batch-1 step 2.080 -> 2.100 ms, and
# the mixed plan nothing either way (H200, BENCHMARKS.md, session 28).
TRIGGER_FIRST_SKIP = os.environ.get("OCRIAQUANT_PDL_TRIGGER_FIRST_SKIP", "_gemv_nvfp4_m1_kernel")
_ONE_WAVE: dict[tuple, bool] = {}


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


def ctas_per_sm(n_regs: int, warps: int, shared: int, regs: int = 65536, threads: int = 2048,
                smem: int = 233472) -> int:
    """How many CTAs of a kernel (registers a thread, warps a CTA, shared bytes a CTA) one SM holds
    at once, as CUDA's occupancy calculator counts for Hopper: registers given out per warp in
    units of 256 (8 a thread), 1 KB of shared memory reserved per CTA, at most 32 CTAs."""
    per_sm = min(regs // (-(-max(1, n_regs) // 8) * 8 * 32) // warps, threads // (32 * warps), 32)
    return min(per_sm, smem // (shared + 1024)) if shared else per_sm


def one_wave(compiled, ctas: int, device: torch.device) -> bool:
    """Whether `ctas` CTAs of a compiled Triton kernel are all resident at once on the device."""
    props = torch.cuda.get_device_properties(device)
    per_sm = ctas_per_sm(compiled.n_regs, compiled.metadata.num_warps, compiled.metadata.shared,
                         getattr(props, "regs_per_multiprocessor", 65536),
                         getattr(props, "max_threads_per_multi_processor", 2048),
                         getattr(props, "shared_memory_per_multiprocessor", 233472))
    return ctas <= per_sm * props.multi_processor_count


def pdl_launch(kernel, grid: tuple, pdl: bool, rows: int, *args, **kwargs):
    """kernel[grid](*args, **kwargs) for a kernel that waits with wait_for_inputs (its PDL constexpr:
    0 no PDL, 1 wait then let the next kernel launch, 2 let it launch, then wait), launched with
    PDL when pdl is true, in the order TRIGGER_FIRST asks (rows: the launch's batch). Under 1 the
    first launch of each (kernel, grid, constexprs) waits first and notes from the compiled kernel
    whether the grid is one wave; the launches after it (the CUDA graphs, captured after a warm-up)
    use that. Mixed plan's batch-1 step on an H200 (scripts/ab_step.py, BENCHMARKS.md, session 28):
    1.603 ms waiting first everywhere, 1.577 ms under 1; the nvfp4 plan 2.080 against 2.100 ms
    with its NVFP4 GEMVs first (hence TRIGGER_FIRST_SKIP) and 2.081 without; mixed batch 64 5.675
    against 5.708 ms with its one-wave kernels first (hence batch 1 only). Those were graphs
    re-captured in one process; in a process's first capture, the one a server replays, 1 took
    1.640-1.645 ms against 0's 1.623 (session 29, scripts/bench_captures.py), hence 0 by default."""
    waves = TRIGGER_FIRST == 1 and rows == 1 and kernel.__name__ not in TRIGGER_FIRST_SKIP.split(",")
    key = (kernel, grid, tuple(sorted(kwargs.items()))) if waves else None  # built only where it is read
    first = TRIGGER_FIRST == 2 or (waves and _ONE_WAVE.get(key, False))
    compiled = kernel[grid](*args, PDL=0 if not pdl else (2 if first else 1), launch_pdl=pdl, **kwargs)
    if pdl and waves and key not in _ONE_WAVE:
        _ONE_WAVE[key] = one_wave(compiled, math.prod(grid), torch.device("cuda", torch.cuda.current_device()))
    return compiled


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
    """Under PDL: wait until the previous kernel has finished (its writes visible) and let the
    next one launch — after the wait (PDL 1) or before it (PDL 2, pdl_launch). Everything before
    this may read only constant data (weights, scales)."""
    if PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    elif PDL:
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
              PARTIALS: tl.constexpr, INTERPRET: tl.constexpr, ticket=0, EARLY_TICKET: tl.constexpr = False):
    """The batch-1 GEMVs' epilogue for this CTA's fp32 outputs y [BN]: with PARTIALS only its
    split's partial, at row pid_k of the workspace (where store_or_reduce puts it; the consumer
    adds the splits, runtime/partials.py); else store_or_reduce's bf16 row (ticket, EARLY_TICKET: its)."""
    if PARTIALS:
        rn = pid_n * BN + tl.arange(0, BN)
        tl.store(ws_ptr + pid_k * N + rn, y, mask=rn < N)
    else:
        if INTERPRET and SPLIT_K == 1:  # the interpreter's bf16 store truncates (rounding.py)
            y = round_bf16(y)
        store_or_reduce(y[None, :], y_ptr, ws_ptr, tick_ptr, pid_n, pid_k, 1, N, 0, 1, BN, SPLIT_K, ticket,
                        EARLY_TICKET)


def partials_view(ws: torch.Tensor, splits: int, n: int) -> Partials:
    """The parts store_row wrote with PARTIALS, as Partials [splits, 1, N]."""
    return Partials(ws.view(-1)[:splits * n].view(splits, 1, n))


_TICKET_PTX = tl.constexpr("""{
.reg .pred p;
.reg .b32 t;
mov.u32 t, %tid.x;
setp.eq.u32 p, t, 0;
setp.ne.and.b32 p, $2, 0, p;
mov.u32 $0, 0;
@p atom.relaxed.gpu.global.add.u32 $0, [$1], 1;
}""")


@triton.jit
def take_ticket(tick_ptr, pid_n, SPLIT_K: tl.constexpr, EARLY_TICKET: tl.constexpr, INTERPRET: tl.constexpr):
    """store_or_reduce's EARLY_TICKET ticket, asked where it is called (after the PDL wait: the launch before
    resets the counter): the CTA's arrival number at its output tile, 0 … SPLIT_K - 1, at element 0 of a vector
    (store_or_reduce reads it there). One thread asks: a scalar atomic would make every thread wait for its
    answer there (Triton broadcasts it through shared memory), and the K loop would start a round trip late.
    The vector has one element per thread of the CTA, so that no thread holds a copy of another's: Triton
    takes copies to be equal and reduces over one of them, and with a [16] vector (session 39) the threads of
    warps 1… and lanes 16… read 0 where thread 0 read the ticket, disagreed on which CTA reduces, and the
    FP8 tensor-core form hung at its tail (H100, session 40). A placeholder where there is nothing to ask."""
    r = tl.arange(0, 16 if INTERPRET else tl.extra.cuda.num_threads())
    if not EARLY_TICKET or SPLIT_K == 1:
        return r * 0
    if INTERPRET:  # no PTX; one element adds 1, the others 0
        return tl.atomic_add(tick_ptr + pid_n + r * 0, (r == 0).to(tl.int32), sem="relaxed")
    return tl.inline_asm_elementwise(_TICKET_PTX, "=r,l,r", [tick_ptr + pid_n + r * 0, (r == 0).to(tl.int32)],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _gather_splits(acc, w_ptrs, mask, pid_k, BM: tl.constexpr, N, SPLIT_K: tl.constexpr):
    """The sum over splits in order 0 … SPLIT_K - 1 (the old form's and partials.py's order), this CTA's own
    from acc, and how many values read were still UNSET."""
    total = tl.zeros(acc.shape, dtype=tl.float32)
    unset = tl.zeros(acc.shape, dtype=tl.int32)
    for s in tl.static_range(SPLIT_K):
        others = mask & (tl.full(mask.shape, s, tl.int32) != pid_k)  # in the mask's shape (the interpreter)
        p = tl.load(w_ptrs + s * BM * N, mask=others, other=0.0, volatile=True)
        unset += (p.to(tl.int32, bitcast=True) == UNSET).to(tl.int32)
        total += tl.where(pid_k == s, acc, p)
    return total, tl.sum(unset)  # one reduction after every load: one between them kept each load waiting for
    # the one before it (sm_90 SASS)


@triton.jit
def store_or_reduce(acc, y_ptr, ws_ptr, tick_ptr, pid_n, pid_k, M, N, stride_ym,
                    BM: tl.constexpr, BN: tl.constexpr, SPLIT_K: tl.constexpr, ticket=0,
                    EARLY_TICKET: tl.constexpr = False):
    """Write tile `acc` [BM, BN] (fp32) to y (bf16), summing the SPLIT_K partials if split.
    EARLY_TICKET (SPLITK_EARLY): by take_ticket's `ticket`, in a workspace of UNSET (launch_plan's early)."""
    rm = tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    w_ptrs = ws_ptr + rm[:, None] * N + rn[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    elif EARLY_TICKET:
        if tl.max(tl.where(tl.arange(0, ticket.shape[0]) == 0, ticket, -1), 0) == SPLIT_K - 1:  # every other
            total, missing = _gather_splits(acc, w_ptrs, mask, pid_k, BM, N, SPLIT_K)  # split has its ticket:
            while missing > 0:  # their stores are on their way
                total, missing = _gather_splits(acc, w_ptrs, mask, pid_k, BM, N, SPLIT_K)
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=mask)
            # Every warp has read every partial before any is reset: where the tile has fewer values than the CTA
            # has threads, each warp holds a copy, counts `missing` over its own copy and leaves the loop on its
            # own; a warp that reset a slot another was still waiting on hung it (NVFP4 down_proj, 2 warps, H100,
            # session 41).
            tl.debug_barrier()
            unset = tl.full((BM, BN), UNSET, tl.int32).to(tl.float32, bitcast=True)
            for s in tl.static_range(SPLIT_K):  # as found, for the next launch (after it, by stream order)
                tl.store(w_ptrs + s * BM * N, unset, mask=mask & (tl.full(mask.shape, s, tl.int32) != pid_k))
            tl.store(tick_ptr + pid_n, 0)
        else:
            tl.store(w_ptrs + pid_k * BM * N, acc, mask=mask)
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
