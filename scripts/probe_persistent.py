"""Probe: what would a persistent decode kernel — one launch running many layers, its CTAs meeting at a
grid barrier where the runtime ends one kernel and launches the next — gain at batch 1? Measured on a
synthetic chain with the byte profile of the real step, before anyone writes the real kernel.

    python scripts/probe_persistent.py --shape qwen3.5-4b --context 512 --out persistent.json

Why. The mixed plan's batch-1 step on an H200 launches ~245 kernels and runs at 58 % of its roofline;
each launch costs ~2.8 µs beyond its bytes (BENCHMARKS.md, sessions 21 and 32), and #9 asks 70 %.
Under PDL the next kernel already streams its weights before it waits, so whether a grid barrier
inside one kernel is cheaper than a kernel boundary is an open, measurable question.

The chain. One phase per kernel of the step, in the step's order, each streaming that kernel's bytes:
the GDN and attention input projections (FP8), gdn_decode (its fp32 state, read and written, as
reads), attention's KV at --context, out_proj / o_proj (FP8), gate_up and down (NVFP4 packed + FP8
block scales), and the small kernels (norms, qk_norm_rope, attention's merge) as phases of a few KB.
Phase p is an integer "GEMV" over its weight words W_p [N_p, K_p] (int32): y_p[n] = Σ_k W_p[n, k] ^
y_{p-1}[k mod N_{p-1}], summed with wrapping int32 atomics (exact in any order, so split-K needs no
tail) — a true dependency on the phase before at the cost of a XOR and an add a word, so the probe
stays memory-bound as the real GEMVs are. Phase p also zeroes phase p+1's output.

The variants (one kernel source, so only the phase boundary differs):
- `launches`: a kernel per phase, captured in one CUDA graph, under PDL as the runtime launches
  its GEMVs: each CTA loads its first weight tile, waits on the kernel before, then lets the next
  launch (splitk.wait_for_inputs, PDL 1).
- `persistent`: one launch of `--ctas-per-sm` CTAs a SM (all resident), phases separated by a grid
  barrier (an arrive counter per phase: a release add, volatile loads spun on, one acquire); each CTA
  loads its next phase's first weight tile before it arrives, as the PDL kernel does before its wait.
- `flags`: a grid barrier whose CTAs arrive in a tree of 32 counters, the last to arrive opening it by
  writing each CTA a flag on a line of its own, so neither arriving nor waiting meets on one line.
- `dataflow`: no barrier. Each split-K unit, once its sums are in, adds one to its row block's counter
  (a release); a unit waits only on the counters of the previous phase's row blocks it depends on: those
  it reads, and the share of the previous output its share of K stands for (a norm, one word a row, waits
  on all of it, as a real RMS does). This is how a "megakernel" orders its work: by dependency, not phase.
  The host zeroes the outputs before the launch, since no CTA can know when a phase ahead has started.
- `dataflow-all`: the same counters, each unit waiting on every block of the phase before: a barrier
  whose waiting is spread over the blocks' lines.
- `no-barrier`: the persistent kernel with no barrier at all (wrong sums): the ceiling of the chain.
Each runs on the step's chain and on a `folded` one without the phases under 64 KB: a persistent
kernel would compute a norm in every CTA from the vector it reads anyway, rather than behind a
barrier of its own. Each is checked against a torch int64 reference of the chain (`no-barrier` excepted) and timed as
graph replays between CUDA events; % = bytes / time / copy bandwidth.

Measured (BENCHMARKS.md, sessions 34–35, H100s): the first form was compute-bound (≤ 27 % of its bytes even without
barriers; 64-bit addresses a word, a reduction every tile). The present form, on the step's chain, costs a phase
boundary (time above `no-barrier`, over 240 boundaries) ~0.9–1.3 µs as a PDL launch, 3.6–5.4 µs as either grid
barrier, 3.7–10.6 µs as `dataflow-all` and 7–17 µs as `dataflow` (a wait and a release every unit, where PDL and the
barriers pay once a phase). No one-launch form beat the launches in any tile or grid.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).parent.parent))
sys.path.insert(0, str(Path(__file__).parent))
from profile_step import replay_ms  # noqa: E402

from ocriaquant.runtime.kernels.splitk import ctas_per_sm  # noqa: E402

SMALL = 64 * 1024  # bytes under which a phase is a "small kernel" (norms, qk_norm_rope, merge)


def step_phases(shape: str, context: int, lm_head: bool) -> list[tuple[str, int, int]]:
    """(name, rows, bytes a row) of each kernel of the mixed plan's batch-1 step, in order."""
    from ocriaquant.model.configs import SHAPES

    t = SHAPES[shape]().text_config
    h, inter = t.hidden_size, t.intermediate_size
    kd, vd = t.linear_num_key_heads * t.linear_key_head_dim, t.linear_num_value_heads * t.linear_value_head_dim
    qd, kvd = t.num_attention_heads * t.head_dim, t.num_key_value_heads * t.head_dim
    fp8 = h + 4                      # FP8 row + its fp32 scale
    nvfp4 = lambda k: k // 2 + k // 16  # noqa: E731  packed E2M1 + an FP8 scale a 16-block
    norm = ("norm", h, 4)            # a bf16 row in, a bf16 (or quantized) row out: a few KB
    phases = []
    for kind in t.layer_types:
        phases.append(norm)
        if kind == "linear_attention":
            phases.append(("gdn_in_fp8", 2 * kd + 2 * vd + 2 * t.linear_num_value_heads, fp8))
            state = t.linear_num_value_heads * t.linear_value_head_dim * t.linear_key_head_dim * 4
            phases.append(("gdn_decode", t.linear_num_value_heads * t.linear_value_head_dim,
                           2 * state // (t.linear_num_value_heads * t.linear_value_head_dim)))
            phases.append(("gdn_out_fp8", h, vd + 4))
        else:
            phases.append(("qkv_fp8", 2 * qd + 2 * kvd, fp8))
            phases.append(("qk_norm_rope", t.num_attention_heads + t.num_key_value_heads, 2 * t.head_dim * 2))
            phases.append(("attn_chunk", 2 * t.num_key_value_heads * (context + 1), t.head_dim * 2))
            phases.append(("attn_merge", t.num_attention_heads, t.head_dim * 4))
            phases.append(("o_fp8", h, qd + 4))
        phases.append(norm)
        phases.append(("gate_up_nvfp4", 2 * inter, nvfp4(h)))
        phases.append(("down_nvfp4", h, nvfp4(inter)))
    phases.append(norm)
    if lm_head:
        phases.append(("lm_head_bf16", t.vocab_size, 2 * h))
    return phases


def tiny_phases() -> list[tuple[str, int, int]]:
    """A small chain for the CPU test: phases of a few rows, one of them smaller than a tile."""
    return [("a", 40, 1024), ("b", 8, 64), ("c", 72, 516), ("d", 24, 2048)]


TW = tl.constexpr(12)  # int64 words a table row


@triton.jit
def _phase_args(w_ptr, tab_ptr, p):
    """Phase p's weights and geometry from the table: (weights, N, K words, splits, words a unit)."""
    return (w_ptr + tl.load(tab_ptr + p * TW + 0), tl.load(tab_ptr + p * TW + 1).to(tl.int32),
            tl.load(tab_ptr + p * TW + 2).to(tl.int32), tl.load(tab_ptr + p * TW + 3).to(tl.int32),
            tl.load(tab_ptr + p * TW + 4).to(tl.int32))


@triton.jit
def _phase_tile(w, n, kw, splits, uk, i, pid, G, BN: tl.constexpr, BK: tl.constexpr):
    """This CTA's i-th [BN, BK] weight tile of a phase: (pointers, mask, rows, columns, column mask). Offsets in
    int32 from the phase's base (a phase is under 2^31 words), as the runtime's GEMVs address."""
    tpu = uk // BK
    u = pid + (i // tpu) * G
    k_unit = (u % splits) * uk
    k0 = k_unit + (i % tpu) * BK
    rows = (u // splits) * BN + tl.arange(0, BN)
    cols = k0 + tl.arange(0, BK)
    cmask = cols < tl.minimum(k_unit + uk, kw)
    return w + rows[:, None] * kw + cols[None, :], (rows < n)[:, None] & cmask[None, :], rows, cols, cmask


@triton.jit
def _spin_until(addr, target, bar_ptr, P, SPIN_LIMIT: tl.constexpr):
    """Wait until the int32 at addr reaches target: spin on plain volatile loads, then acquire once. Hundreds of CTAs
    spinning with atomics (read-modify-writes, serialized at L2) would slow the writes they wait for. A CTA that spins
    SPIN_LIMIT times (or finds bar_ptr[P + 1] set) gives up and sets bar_ptr[P + 1] rather than hang."""
    seen = tl.load(addr, volatile=True)
    spins = tl.load(bar_ptr + P + 1, volatile=True) * SPIN_LIMIT  # flagged already: do not spin
    while (seen < target) & (spins < SPIN_LIMIT):
        seen = tl.load(addr, volatile=True)
        spins += 1
    seen = tl.atomic_add(addr, 0, sem="acquire")
    if seen < target:  # not every CTA is resident: give up, flag it rather than hang
        tl.atomic_xchg(bar_ptr + P + 1, 1)


@triton.jit
def _wait_inputs(cnt_ptr, bar_ptr, tab_ptr, p, u, kw, splits, uk, P, BN: tl.constexpr, DATAFLOW: tl.constexpr,
                 SPIN_LIMIT: tl.constexpr, FENCE: tl.constexpr):
    """Dataflow: before unit u of phase p reads its inputs, wait until every row block of phase p - 1 it depends on
    holds all its split-K sums (its counter = that phase's splits). DATAFLOW 1: the blocks it reads and the share of
    the previous output its share of K stands for (a unit of a norm, K = 1 word, stands for all of it: the RMS needs
    every row); 2: all blocks, a barrier with its counters spread over the blocks. Spins on volatile loads (relaxed,
    system scope, in PTX's model), then one fence.acq_rel: a relaxed read of a release followed by a fence is an
    acquire of every counter read. The first form acquired each counter with an atomic and read them 64 at a time,
    one L2 round trip after another: 5.5 ms a pass, 3× the PDL chain (session 35). FENCE 0 (the interpreter, which
    runs no PTX) acquires with atomics instead."""
    nq = tl.load(tab_ptr + p * TW + 7).to(tl.int32)
    cq = tl.load(tab_ptr + p * TW + 9)
    need = tl.load(tab_ptr + p * TW + 10).to(tl.int32)
    lo = nq * 0
    hi = tl.cdiv(nq, BN) - 1
    if DATAFLOW == 1:
        k_unit = (u % splits) * uk
        kend = tl.minimum(k_unit + uk, kw)
        plo = k_unit * nq // kw
        phi = tl.cdiv(kend * nq, kw) - 1
        if kw <= nq:  # it reads rows k_unit … kend - 1 (cols % nq is cols)
            plo = tl.minimum(plo, k_unit)
            phi = tl.maximum(phi, kend - 1)
            lo = plo // BN
            hi = phi // BN
    CB: tl.constexpr = 1024  # the step's widest phase (gate_up, 1152 blocks of 16 rows) in two round trips
    for b0 in range(lo, hi + 1, CB):
        offs = b0 + tl.arange(0, CB)
        m = offs <= hi
        c = tl.load(cnt_ptr + cq + offs, mask=m, other=need, volatile=True)
        spins = tl.load(bar_ptr + P + 1, volatile=True) * SPIN_LIMIT
        while (tl.min(c, axis=0) < need) & (spins < SPIN_LIMIT):
            c = tl.load(cnt_ptr + cq + offs, mask=m, other=need, volatile=True)
            spins += 1
        if FENCE:
            c = tl.inline_asm_elementwise("fence.acq_rel.gpu;\n\tmov.b32 $0, $1;", "=r,r", [c], dtype=tl.int32,
                                          is_pure=False, pack=1)
        else:
            c = tl.where(m, tl.atomic_add(cnt_ptr + cq + offs, 0, mask=m, sem="acquire"), need)
        if tl.min(c, axis=0) < need:  # a producer is not resident: flag it rather than hang
            tl.atomic_xchg(bar_ptr + P + 1, 1)


@triton.jit
def _chain_kernel(w_ptr, buf_ptr, tab_ptr, bar_ptr, flag_ptr, cnt_ptr, p_lo, p_hi, P,
                  BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr, BARRIER: tl.constexpr,
                  DATAFLOW: tl.constexpr = 0, FENCE: tl.constexpr = 1, SPIN_LIMIT: tl.constexpr = 1 << 18,
                  SUBS: tl.constexpr = 32):
    """Phases p_lo … p_hi - 1 of the chain (module docstring); table row p (TW int64 words): w_off, N, K words,
    splits, words a unit, out_off, in_off, in_len, its counters' offset, the previous phase's counters' offset, the
    previous phase's splits. All CTAs resident unless BARRIER and DATAFLOW are 0.
    BARRIER 1: a grid barrier between phases, bar_ptr[p] its arrive counter, every CTA spinning on it. BARRIER 2: CTAs
    arrive in a tree of SUBS counters (flag_ptr[(G + s) * 32], the top at G + SUBS), and the last to arrive opens the
    barrier by writing each CTA its own flag (flag_ptr[pid * 32], a line each), so neither the arrivals nor the
    spinning meet on one line. Session 35's first `flags` arrived on one counter: 4.6 µs a phase, against 5.4 for
    BARRIER 1.
    DATAFLOW (BARRIER 0): no barrier; a unit's split-K sums counted per row block (cnt_ptr), and a unit waits on the
    counters of the row blocks it depends on (_wait_inputs). Outputs are zeroed by the host before the launch.
    bar_ptr[p_hi] counts CTAs done, and the last one resets the barrier. A CTA that spins SPIN_LIMIT times sets
    bar_ptr[P + 1] and goes on (wrong sums, checked by the host): a grid that does not fit on the GPU at once would
    otherwise hang the device (session 34, on an H100)."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    # The first phase's first weight tile before waiting on anything: weights are constant.
    w, n, kw, splits, uk = _phase_args(w_ptr, tab_ptr, p_lo)
    w_ptrs, w_mask, r0, c0, m0 = _phase_tile(w, n, kw, splits, uk, 0, pid, G, BN, BK)
    w_next = tl.load(w_ptrs, mask=w_mask, other=0)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    for p in range(p_lo, p_hi):
        w, n, kw, splits, uk = _phase_args(w_ptr, tab_ptr, p)
        out_off = tl.load(tab_ptr + p * TW + 5)
        in_off = tl.load(tab_ptr + p * TW + 6)
        in_len = tl.load(tab_ptr + p * TW + 7).to(tl.int32)
        if DATAFLOW == 0:
            nxt = (p + 1) % P
            z_off = tl.load(tab_ptr + nxt * TW + 5)
            z_len = tl.load(tab_ptr + nxt * TW + 1).to(tl.int32)
            for z in range(pid * BN * BK, z_len, G * BN * BK):  # zero the next phase's output
                zr = z + tl.arange(0, BN * BK)
                tl.store(buf_ptr + z_off + zr, tl.zeros([BN * BK], tl.int32), mask=zr < z_len)
        tpu = uk // BK
        iters = tl.cdiv(tl.cdiv(n, BN) * splits - pid, G) * tpu
        acc = tl.zeros([BN, BK], tl.int32)  # elementwise in the loop, reduced once a unit, as the GEMVs do
        for i in range(0, iters):
            wt = w_next
            u = pid + (i // tpu) * G  # this tile's split-K unit
            cur_ptrs, mask, rows, cols, cmask = _phase_tile(w, n, kw, splits, uk, i, pid, G, BN, BK)
            if i + 1 < iters:  # one tile ahead
                nptrs, nmask, nrows, ncols, ncmask = _phase_tile(w, n, kw, splits, uk, i + 1, pid, G, BN, BK)
                w_next = tl.load(nptrs, mask=nmask, other=0)
            if DATAFLOW != 0:
                # phase 0 reads the pass before's output, ready at launch; waiting on all blocks, once a phase will do
                if (p > 0) & (i % tpu == 0) & ((DATAFLOW == 1) | (i == 0)):
                    _wait_inputs(cnt_ptr, bar_ptr, tab_ptr, p, u, kw, splits, uk, P, BN, DATAFLOW, SPIN_LIMIT, FENCE)
            # a masked word is 0 in both, so it adds 0 ^ 0
            x = tl.load(buf_ptr + in_off + cols % in_len, mask=cmask, other=0,
                        cache_modifier=".cg")
            acc += wt ^ x[None, :]
            if i % tpu == tpu - 1:
                tl.atomic_add(buf_ptr + out_off + rows, tl.sum(acc, axis=1), mask=rows < n, sem="relaxed")
                acc = tl.zeros([BN, BK], tl.int32)
                if DATAFLOW != 0:  # every thread's sums, then one release: the unit's row block has one more
                    tl.debug_barrier()
                    tl.atomic_add(cnt_ptr + tl.load(tab_ptr + p * TW + 8) + u // splits, 1, sem="release")
        if p + 1 < p_hi:
            # The next phase's first tile, then the barrier: its weights stream while CTAs arrive.
            w2, n2, kw2, splits2, uk2 = _phase_args(w_ptr, tab_ptr, p + 1)
            nptrs, nmask, nrows, ncols, ncmask = _phase_tile(w2, n2, kw2, splits2, uk2, 0, pid, G, BN, BK)
            w_next = tl.load(nptrs, mask=nmask, other=0)
            if BARRIER == 1:
                tl.debug_barrier()
                tl.atomic_add(bar_ptr + p, 1, sem="release")
                _spin_until(bar_ptr + p, G, bar_ptr, P, SPIN_LIMIT)
                tl.debug_barrier()
            if BARRIER == 2:
                # Arrive in a tree: CTA pid on sub-counter pid % NS, the last of each sub on the top counter, the
                # last there opens the barrier. Same-address atomics serialize at their L2 slice, so 528 arrivals
                # on one counter queue for microseconds. The counters only grow (reset once, at the end): phase j's
                # last arrival at a sub of c CTAs reads (j + 1) * c - 1.
                NS = tl.minimum(G, SUBS)
                sub = pid % NS
                c_sub = (G - sub + NS - 1) // NS
                j = p - p_lo
                tl.debug_barrier()
                arrived = tl.atomic_add(flag_ptr + (G + sub) * 32, 1, sem="acq_rel")
                if arrived == (j + 1) * c_sub - 1:
                    subs_in = tl.atomic_add(flag_ptr + (G + SUBS) * 32, 1, sem="acq_rel")
                    if subs_in == (j + 1) * NS - 1:  # the last: every CTA's flag, each a release
                        for f0 in range(0, G, 128):
                            fo = f0 + tl.arange(0, 128)
                            tl.atomic_xchg(flag_ptr + fo * 32, tl.zeros([128], tl.int32) + p + 1, mask=fo < G,
                                           sem="release")
                _spin_until(flag_ptr + pid * 32, p + 1, bar_ptr, P, SPIN_LIMIT)
                tl.debug_barrier()
    if BARRIER != 0:
        tl.debug_barrier()
        done = tl.atomic_add(bar_ptr + p_hi, 1, sem="acq_rel")
        if done == G - 1:  # every CTA is past every barrier: reset them for the next launch
            for q in range(p_lo, p_hi + 1):
                tl.atomic_xchg(bar_ptr + q, 0)
            if BARRIER == 2:  # the CTAs' flags, then the tree's counters
                for f0 in range(0, G + SUBS + 1, 128):
                    fo = f0 + tl.arange(0, 128)
                    tl.store(flag_ptr + fo * 32, tl.zeros([128], tl.int32), mask=fo < G + SUBS + 1)


class Chain:
    """The chain's buffers: weights (random int32 words), one output buffer per phase, the table."""

    def __init__(self, phases, device, ctas: int, bn: int, bk: int, seed: int = 0):
        self.phases, self.device, self.bn, self.bk = phases, device, bn, bk
        g = torch.Generator(device).manual_seed(seed)
        rows, w_off, out_off, total_w, total_o = [], [], [], 0, 0
        for _, n, nbytes in phases:
            kw = max(1, nbytes // 4)
            w_off.append(total_w)
            out_off.append(total_o)
            total_w += n * kw
            total_o += n
            rows.append((n, kw))
        self.w = torch.randint(-2**31, 2**31 - 1, (total_w,), dtype=torch.int32, generator=g, device=device)
        self.x0 = torch.randint(-2**31, 2**31 - 1, (rows[-1][0],), dtype=torch.int32, generator=g, device=device)
        tab, cnt_off, blocks = [], [], 0
        for n, _ in rows:
            cnt_off.append(blocks)
            blocks += triton.cdiv(n, bn)
        for p, (n, kw) in enumerate(rows):
            # as splitk.launch_plan splits K, but aiming at this grid's CTAs rather than 4 a SM
            splits = max(1, min(triton.cdiv(kw, bk), triton.cdiv(ctas, triton.cdiv(n, bn))))
            uk = triton.cdiv(triton.cdiv(kw, splits), bk) * bk
            splits = triton.cdiv(kw, uk)
            tab.append([w_off[p], n, kw, splits, uk, out_off[p], 0, 0, cnt_off[p], 0, 0, 0])
        for p in range(len(rows)):
            q = (p - 1) % len(rows)
            tab[p][6:8] = [out_off[q], rows[q][0]]
            tab[p][9:11] = [cnt_off[q], tab[q][3]]
        self.table = torch.tensor(tab, dtype=torch.int64, device=device)
        self.tab_host = tab  # launch reads it while a graph captures, when the device's copy cannot be read
        # Dataflow runs zero the outputs before the launch rather than a phase ahead, so the last phase writes a slot
        # of its own: the pass's first phase reads the slot before it (x0 in check), which must outlive the zeroing.
        self.last_slot = total_o
        tab_df = [list(r) for r in tab]
        tab_df[-1][5] = self.last_slot
        self.table_df = torch.tensor(tab_df, dtype=torch.int64, device=device)
        self.buf = torch.zeros(total_o + rows[-1][0], dtype=torch.int32, device=device)
        self.bar = torch.zeros(len(rows) + 2, dtype=torch.int32, device=device)  # + done count, + stuck flag
        self.flags = torch.zeros((ctas + 33) * 32, dtype=torch.int32, device=device)  # a line a CTA, + the tree
        self.cnt = torch.zeros(max(1, blocks), dtype=torch.int32, device=device)
        self.out_off, self.rows = out_off, rows

    def bytes(self) -> int:
        return sum(n * nbytes for _, n, nbytes in self.phases)

    def reset(self):
        """The state a pass starts from: the last phase's output holds x0, everything else zero."""
        self.buf.zero_()
        n = self.rows[-1][0]
        self.buf[self.out_off[-1]:self.out_off[-1] + n] = self.x0

    def output(self, p: int, dataflow: bool = False) -> torch.Tensor:
        off = self.last_slot if dataflow and p == len(self.rows) - 1 else self.out_off[p]
        return self.buf[off:off + self.rows[p][0]]

    def reference(self) -> list[torch.Tensor]:
        """Each phase's output after one pass, summed in int64 (torch, on the chain's device) and wrapped to int32."""
        outs, x = [], self.x0.to(torch.int64)
        for p, (n, kw) in enumerate(self.rows):
            off = self.tab_host[p][0]
            w = self.w[off:off + n * kw].to(torch.int64).view(n, kw)
            xs = x[torch.arange(kw, device=x.device) % x.numel()]
            y = (w ^ xs[None, :]).sum(1)
            y = ((y + 2**31) % 2**32) - 2**31
            outs.append(y)
            x = y
        return outs


VARIANTS = {"persistent": dict(BARRIER=1), "flags": dict(BARRIER=2), "dataflow": dict(DATAFLOW=1),
            "dataflow-all": dict(DATAFLOW=2), "no-barrier": {}}


def launch(chain: Chain, variant: str, grid: int, warps: int, spin_limit: int | None = None):
    """One pass of the chain as `variant` launches it (module docstring)."""
    P = len(chain.rows)
    common = dict(BN=chain.bn, BK=chain.bk, FENCE=int(chain.device.type == "cuda"), num_warps=warps)
    if spin_limit is not None:
        common["SPIN_LIMIT"] = spin_limit
    args = (chain.w, chain.buf, chain.table, chain.bar, chain.flags, chain.cnt)
    if variant == "launches":
        pdl = chain.device.type == "cuda"
        for p in range(P):
            units = triton.cdiv(chain.rows[p][0], chain.bn) * chain.tab_host[p][3]
            _chain_kernel[(min(grid, units),)](*args, p, p + 1, P, PDL=pdl, BARRIER=0, launch_pdl=pdl, **common)
        return
    mode = dict(BARRIER=0, DATAFLOW=0) | VARIANTS[variant]
    if mode["DATAFLOW"]:
        # the outputs and counters zeroed here, the slot the first phase reads (out_off[-1]) kept
        chain.buf[:chain.out_off[-1]].zero_()
        chain.buf[chain.last_slot:].zero_()
        chain.cnt.zero_()
        args = (chain.w, chain.buf, chain.table_df, chain.bar, chain.flags, chain.cnt)
    _chain_kernel[(grid,)](*args, 0, P, P, PDL=False, **mode, **common)


def check(chain: Chain, variant: str, grid: int, warps: int, spin_limit: int | None = None) -> int:
    """Largest mismatch count over the phases' outputs after one pass from reset (0: exact); -1 where a
    grid barrier or a dataflow wait gave up (its grid was not resident at once)."""
    chain.reset()
    chain.bar.zero_()
    launch(chain, variant, grid, warps, spin_limit)
    if int(chain.bar[-1]):
        chain.bar.zero_()
        chain.flags.zero_()
        return -1
    ref = chain.reference()
    bad = 0
    dataflow = bool(VARIANTS.get(variant, {}).get("DATAFLOW"))
    for p in range(1, len(ref)):  # phase 0's output was zeroed by the last phase
        got = chain.output(p, dataflow).to(torch.int64)
        bad = max(bad, int((got != ref[p]).sum()))
    return bad


def resident_ctas(chain: Chain, grid: int, warps: int) -> int:
    """CTAs a SM that fit of the one-launch variants' kernels, the fewest: the launch's own specializations, since
    Triton compiles an int argument of 1 as a constant, so a kernel warmed up with other phase bounds can hold fewer
    registers than the one that runs."""
    P = len(chain.rows)
    fits = []
    for mode in VARIANTS.values():
        k = _chain_kernel.warmup(chain.w, chain.buf, chain.table, chain.bar, chain.flags, chain.cnt, 0, P, P,
                                 BN=chain.bn, BK=chain.bk, PDL=False, num_warps=warps, grid=(grid,),
                                 **(dict(BARRIER=0, DATAFLOW=0) | mode))
        k._init_handles()  # n_regs is filled in when the kernel is loaded, not at warmup
        fits.append(ctas_per_sm(k.n_regs, warps, k.metadata.shared))
    return min(fits)


def time_graph(fn, replays: int) -> float:
    """ms per pass: a graph holding one pass, timed by profile_step.replay_ms."""
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    return replay_ms(graph, replays)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3.5-4b")
    ap.add_argument("--context", type=int, default=512, help="tokens in each attention layer's KV cache")
    ap.add_argument("--lm-head", action="store_true", help="end the chain with the BF16 lm_head (1.27 GB at the 4B)")
    ap.add_argument("--layers", type=int, default=0, help="only the first N layers' phases (0: all)")
    ap.add_argument("--ctas-per-sm", default="2,4", help="persistent grids to try, CTAs a SM (comma-separated)")
    ap.add_argument("--tiles", default="16x128x4,16x256x8,32x128x8",
                    help="rows x words x warps of a weight tile (comma-separated)")
    ap.add_argument("--variants", default="launches,persistent,flags,dataflow,dataflow-all,no-barrier",
                    help="which to time (module docstring), comma-separated")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("probe_persistent.py: needs a CUDA device (it times CUDA graphs and spins on a grid barrier)")
    dev = torch.device("cuda")
    from ocriaquant.bench import copy_bandwidth

    bw = copy_bandwidth(dev)
    phases = step_phases(args.shape, args.context, args.lm_head)
    if args.layers:
        per = [i for i, ph in enumerate(phases) if ph[0] == "down_nvfp4"]
        phases = phases[:per[args.layers - 1] + 1]
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    folded = [ph for ph in phases if ph[1] * ph[2] >= SMALL]
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "copy_tb_s": round(bw / 1e12, 3), "phases": len(phases), "phases_folded": len(folded),
              "context": args.context, "lm_head": args.lm_head, "rows": []}
    print(f"copy {bw / 1e12:.3f} TB/s; {len(phases)} phases, {len(folded)} over {SMALL // 1024} KB", flush=True)
    for tile in args.tiles.split(","):
        bn, bk, warps = (int(v) for v in tile.split("x"))
        for cps in (int(c) for c in args.ctas_per_sm.split(",")):
            grid = sms * cps
            for chain_name, chain_phases in (("step", phases), ("folded", folded)):
                chain = Chain(chain_phases, dev, grid, bn, bk)
                roof = chain.bytes() / bw * 1e3
                fits = resident_ctas(chain, grid, warps)
                if fits < cps:  # a grid barrier or a dataflow wait over CTAs not all resident never opens
                    print(f"tile {tile}, {cps}/SM: only {fits} CTAs fit a SM; skipped")
                    break
                for name in args.variants.split(","):
                    bad = None if name == "no-barrier" else check(chain, name, grid, warps)
                    if bad == -1:
                        print(f"tile {tile}, {cps}/SM {chain_name} {name}: a grid barrier gave up (not every CTA "
                              "was resident); not timed", flush=True)
                        continue
                    ms = time_graph(lambda c=chain, v=name: launch(c, v, grid, warps), args.replays)
                    row = {"tile": tile, "ctas_per_sm": cps, "chain": chain_name, "variant": name,
                           "ms": round(ms, 4), "roofline_ms": round(roof, 4), "pct": round(100 * roof / ms, 1),
                           "mismatches": bad}
                    report["rows"].append(row)
                    print(f"tile {tile:>10} {cps}/SM {chain_name:>6} {name:>10}: {ms:.4f} ms, {row['pct']:5.1f} % "
                          f"of {roof:.4f} ms{'' if bad is None else f', mismatches {bad}'}", flush=True)
                del chain
                torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
