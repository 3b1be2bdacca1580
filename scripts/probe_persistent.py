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
- `no-barrier`: the persistent kernel with no barrier at all (wrong sums): the ceiling of the chain.
Each runs on the step's chain and on a `folded` one without the phases under 64 KB: a persistent
kernel would compute a norm in every CTA from the vector it reads anyway, rather than behind a
barrier of its own. Each is checked against a torch int64 reference of the chain (`no-barrier` excepted) and timed as
graph replays between CUDA events; % = bytes / time / copy bandwidth.

Measured so far (BENCHMARKS.md, session 34, an H100): the first form was compute-bound (≤ 27 % of its bytes even
without barriers; 64-bit addresses a word, a reduction every tile). In that setting a boundary cost ~1.6–2.0 µs as a
PDL launch and ~3.1–3.4 µs as a grid barrier spun on with atomics. The present form (32-bit offsets, elementwise
accumulation, spinning on loads) has not run on a GPU yet.
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


@triton.jit
def _phase_args(w_ptr, tab_ptr, p):
    """Phase p's weights and geometry from the table: (weights, N, K words, splits, words a unit)."""
    return (w_ptr + tl.load(tab_ptr + p * 8 + 0), tl.load(tab_ptr + p * 8 + 1).to(tl.int32),
            tl.load(tab_ptr + p * 8 + 2).to(tl.int32), tl.load(tab_ptr + p * 8 + 3).to(tl.int32),
            tl.load(tab_ptr + p * 8 + 4).to(tl.int32))


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
def _chain_kernel(w_ptr, buf_ptr, tab_ptr, bar_ptr, p_lo, p_hi, P,
                  BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr, BARRIER: tl.constexpr,
                  SPIN_LIMIT: tl.constexpr = 1 << 18):
    """Phases p_lo … p_hi - 1 of the chain (module docstring); table row p: w_off, N, K words, splits,
    words a unit, out_off, in_off, in_len (int64); P phases in all. BARRIER: a grid barrier between phases (all CTAs
    resident), bar_ptr[p] its arrive counter; bar_ptr[p_hi] counts CTAs done, and the last one resets them. A CTA that
    spins SPIN_LIMIT times at a barrier sets bar_ptr[P + 1] and goes on (wrong sums, checked by the host): a
    grid that does not fit on the GPU at once would otherwise hang the device (session 34, on an H100)."""
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
        out_off = tl.load(tab_ptr + p * 8 + 5)
        in_off = tl.load(tab_ptr + p * 8 + 6)
        in_len = tl.load(tab_ptr + p * 8 + 7).to(tl.int32)
        nxt = (p + 1) % P
        z_off = tl.load(tab_ptr + nxt * 8 + 5)
        z_len = tl.load(tab_ptr + nxt * 8 + 1).to(tl.int32)
        for z in range(pid * BN * BK, z_len, G * BN * BK):  # zero the next phase's output
            zr = z + tl.arange(0, BN * BK)
            tl.store(buf_ptr + z_off + zr, tl.zeros([BN * BK], tl.int32), mask=zr < z_len)
        tpu = uk // BK
        iters = tl.cdiv(tl.cdiv(n, BN) * splits - pid, G) * tpu
        acc = tl.zeros([BN, BK], tl.int32)  # elementwise in the loop, reduced once a unit, as the GEMVs do
        for i in range(0, iters):
            wt = w_next
            cur_ptrs, mask, rows, cols, cmask = _phase_tile(w, n, kw, splits, uk, i, pid, G, BN, BK)
            if i + 1 < iters:  # one tile ahead
                nptrs, nmask, nrows, ncols, ncmask = _phase_tile(w, n, kw, splits, uk, i + 1, pid, G, BN, BK)
                w_next = tl.load(nptrs, mask=nmask, other=0)
            # a masked word is 0 in both, so it adds 0 ^ 0
            x = tl.load(buf_ptr + in_off + cols % in_len, mask=cmask, other=0,
                        cache_modifier=".cg")
            acc += wt ^ x[None, :]
            if i % tpu == tpu - 1:
                tl.atomic_add(buf_ptr + out_off + rows, tl.sum(acc, axis=1), mask=rows < n, sem="relaxed")
                acc = tl.zeros([BN, BK], tl.int32)
        if p + 1 < p_hi:
            # The next phase's first tile, then the barrier: its weights stream while CTAs arrive.
            w2, n2, kw2, splits2, uk2 = _phase_args(w_ptr, tab_ptr, p + 1)
            nptrs, nmask, nrows, ncols, ncmask = _phase_tile(w2, n2, kw2, splits2, uk2, 0, pid, G, BN, BK)
            w_next = tl.load(nptrs, mask=nmask, other=0)
            if BARRIER:
                tl.debug_barrier()
                tl.atomic_add(bar_ptr + p, 1, sem="release")
                # Spin on plain volatile loads, then acquire once: hundreds of CTAs spinning with atomics
                # (read-modify-writes, serialized at L2) on the counter slow the arrivals they wait for.
                seen = tl.load(bar_ptr + p, volatile=True)
                spins = tl.load(bar_ptr + P + 1, volatile=True) * SPIN_LIMIT  # flagged already: do not spin
                while (seen < G) & (spins < SPIN_LIMIT):
                    seen = tl.load(bar_ptr + p, volatile=True)
                    spins += 1
                seen = tl.atomic_add(bar_ptr + p, 0, sem="acquire")
                if seen < G:  # not every CTA is resident: give up, flag it (bar_ptr[P + 1]) rather than hang
                    tl.atomic_xchg(bar_ptr + P + 1, 1)
                tl.debug_barrier()
    if BARRIER:
        tl.debug_barrier()
        done = tl.atomic_add(bar_ptr + p_hi, 1, sem="acq_rel")
        if done == G - 1:  # every CTA is past every barrier: reset them for the next launch
            for q in range(p_lo, p_hi + 1):
                tl.atomic_xchg(bar_ptr + q, 0)


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
        self.buf = torch.zeros(total_o, dtype=torch.int32, device=device)
        self.x0 = torch.randint(-2**31, 2**31 - 1, (rows[-1][0],), dtype=torch.int32, generator=g, device=device)
        tab = []
        for p, (n, kw) in enumerate(rows):
            # as splitk.launch_plan splits K, but aiming at this grid's CTAs rather than 4 a SM
            splits = max(1, min(triton.cdiv(kw, bk), triton.cdiv(ctas, triton.cdiv(n, bn))))
            uk = triton.cdiv(triton.cdiv(kw, splits), bk) * bk
            splits = triton.cdiv(kw, uk)
            q = (p - 1) % len(rows)
            tab.append([w_off[p], n, kw, splits, uk, out_off[p], out_off[q], rows[q][0]])
        self.table = torch.tensor(tab, dtype=torch.int64, device=device)
        self.tab_host = tab  # launch reads it while a graph captures, when the device's copy cannot be read
        self.bar = torch.zeros(len(rows) + 2, dtype=torch.int32, device=device)  # + done count, + stuck flag
        self.out_off, self.rows = out_off, rows

    def bytes(self) -> int:
        return sum(n * nbytes for _, n, nbytes in self.phases)

    def reset(self):
        """The state a pass starts from: the last phase's output holds x0, everything else zero."""
        self.buf.zero_()
        n = self.rows[-1][0]
        self.buf[self.out_off[-1]:self.out_off[-1] + n] = self.x0

    def output(self, p: int) -> torch.Tensor:
        return self.buf[self.out_off[p]:self.out_off[p] + self.rows[p][0]]

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


def launch(chain: Chain, variant: str, grid: int, warps: int, spin_limit: int | None = None):
    """One pass of the chain as `variant` launches it (module docstring)."""
    P = len(chain.rows)
    common = dict(BN=chain.bn, BK=chain.bk, num_warps=warps)
    if spin_limit is not None:
        common["SPIN_LIMIT"] = spin_limit
    if variant == "launches":
        pdl = chain.device.type == "cuda"
        for p in range(P):
            units = triton.cdiv(chain.rows[p][0], chain.bn) * chain.tab_host[p][3]
            _chain_kernel[(min(grid, units),)](chain.w, chain.buf, chain.table, chain.bar, p, p + 1, P,
                                               PDL=pdl, BARRIER=False, launch_pdl=pdl, **common)
    else:
        _chain_kernel[(grid,)](chain.w, chain.buf, chain.table, chain.bar, 0, P, P, PDL=False,
                               BARRIER=variant == "persistent", **common)


def check(chain: Chain, variant: str, grid: int, warps: int, spin_limit: int | None = None) -> int:
    """Largest mismatch count over the phases' outputs after one pass from reset (0: exact); -1 where a
    grid barrier gave up (its grid was not resident at once)."""
    chain.reset()
    chain.bar.zero_()
    launch(chain, variant, grid, warps, spin_limit)
    if int(chain.bar[-1]):
        chain.bar.zero_()
        return -1
    ref = chain.reference()
    bad = 0
    for p in range(1, len(ref)):  # phase 0's output was zeroed by the last phase
        got = chain.output(p).to(torch.int64)
        bad = max(bad, int((got != ref[p]).sum()))
    return bad


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
                # the launch's own specialization: Triton compiles an int argument of 1 as a constant, so a kernel
                # warmed up with other phase bounds can hold fewer registers than the one that runs
                P = len(chain.rows)
                compiled = _chain_kernel.warmup(chain.w, chain.buf, chain.table, chain.bar, 0, P, P, BN=bn, BK=bk,
                                                PDL=False, BARRIER=True, num_warps=warps, grid=(grid,))
                compiled._init_handles()  # n_regs is filled in when the kernel is loaded, not at warmup
                fits = ctas_per_sm(compiled.n_regs, warps, compiled.metadata.shared)
                if fits < cps:  # a grid barrier over CTAs that cannot all be resident never opens
                    print(f"tile {tile}, {cps}/SM: only {fits} CTAs fit a SM ({compiled.n_regs} registers); skipped")
                    break
                for name in ("launches", "persistent", "no-barrier"):
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
