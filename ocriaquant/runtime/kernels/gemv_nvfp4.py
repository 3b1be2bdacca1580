"""NVFP4 W4A16 weight-streaming GEMV for decode on Hopper (no FP4 tensor cores): the packed
E2M1 weights and their E4M3 block scales are read once and dequantized in registers to
exactly the BF16 values the simulation and compressed-tensors' decompression give, then
multiplied with the BF16 activations on the tensor cores (M padded to 16). At M = 1 the
weights are decoded two at a time into fp16 pairs and multiplied on the CUDA cores with
fma.rn.f16x2 (half2.py), where the tensor-core path would waste 15 of its 16 rows.

Layouts as export writes them (compressed-tensors `nvfp4-pack-quantized`): weight_packed
uint8 [N, K/2] (even k in the low nibble), weight_scale E4M3 [N, K/16], weight_global_scale
fp32 [1]; dequantized w = e2m1 · (scale / global). The M = 1 kernel reads the same codes with
their bits reordered once at load (pack_m1, half2.M1_LAYOUT): 11 integer ops decode a word of
eight weights where the checkpoint's order took 15, and the kernel is bound by instructions.
gemv_nvfp4_silu is that kernel on a fused gate_up whose epilogue applies silu(gate) · up.

Nibbles decode to E2M1 × 2⁻¹⁴ in fp16 with a few integer ops (half2.e2m1_times_2m14); the
2¹⁴ goes into the block scale (a power of two, so rounding is unchanged).

Triton's interpreter (CI) computes tl.dot wrongly on BF16 values converted inside the kernel
(a 16×16 product came out ~1e10), and its fp32 -> bf16 conversion truncates. Under
TRITON_INTERPRET=1 the weights are therefore rounded with rounding.round_bf16 and multiplied
in fp32 — the same values as the GPU's bf16 path, which bench_kernels.py checks at real shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .half2 import (M1_LAYOUT, e2m1_times_2m14, load_after, load_pairs, load_pairs_v4, nvfp4_block_dot,
                    store_nvfp4_pairs)
from .partials import Partials
from .rounding import e4m3_value, round_bf16
from .silu_mul_quant import silu_mul_values
from .splitk import (after_wait, interpreted, launch_plan, partials_view, split_tile, store_or_reduce, store_row,
                     use_pdl, wait_for_inputs, whole_tile_mask)


def pure_loads(block_k: int, silu: bool) -> bool:
    """Whether a batch-1 launch reads its activations and block scales laid out as its tile uses them
    (PURE: pure asm loads, half2.load_pairs_v4 with `after`, and block-scale offsets of contiguity 2)
    rather than in Triton's default layout, which it converts every K-tile through shuffles or shared
    memory and barriers. Faster on K-tiles of at most 512; slower on the wide K-tiles and in
    gemv_nvfp4_silu, so not there."""
    return block_k <= 512 and not silu


@triton.jit
def _gemv_nvfp4_kernel(x_ptr, w_ptr, sc_ptr, sc8_ptr, gs_ptr, y_ptr, ws_ptr, tick_ptr, M, N, K, stride_xm, stride_wn,
                       stride_sn, stride_ym, K_PER_SPLIT, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       SPLIT_K: tl.constexpr, INTERPRET: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rkh = tl.arange(0, BK // 2)      # packed bytes of a K-tile
    rks = tl.arange(0, BK // 16)     # block scales of a K-tile
    rk = tl.arange(0, BK)
    inv_gs = 16384.0 / tl.load(gs_ptr)  # 2**14 / global: see the module docstring
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    k_start = pid_k * K_PER_SPLIT
    nmask = rn < N
    for k0 in range(k_start, k_start + K_PER_SPLIT, BK):
        kh = k0 // 2 + rkh
        p = tl.load(w_ptr + rn[:, None] * stride_wn + kh[None, :], mask=nmask[:, None] & (kh[None, :] < K // 2),
                    other=0, eviction_policy="evict_first").to(tl.int16)
        ksb = k0 // 16 + rks
        s_off = rn[:, None] * stride_sn + ksb[None, :]
        s_mask = nmask[:, None] & (ksb[None, :] < K // 16)
        if INTERPRET:  # integer decode: the interpreter's E4M3 conversion is unreliable (rounding.py)
            s = e4m3_value(tl.load(sc_ptr + s_off, mask=s_mask, other=0).to(tl.int32))
        else:
            s = tl.load(sc8_ptr + s_off, mask=s_mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        lo = e2m1_times_2m14(p & 15)
        hi = e2m1_times_2m14((p >> 4) & 15)
        w = tl.reshape(tl.join(lo, hi), (BN, BK // 16, 16)).to(tl.float32)
        w = tl.reshape(w * (s * inv_gs)[:, :, None], (BN, BK))
        ks = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * stride_xm + ks[None, :], mask=(rm[:, None] < M) & (ks[None, :] < K),
                    other=0.0)
        if INTERPRET:  # the interpreter mis-multiplies bf16 made in-kernel (see module docstring)
            acc = tl.dot(x.to(tl.float32), tl.trans(round_bf16(w)), acc)
        else:
            acc = tl.dot(x, tl.trans(w.to(tl.bfloat16)), acc)
    store_or_reduce(acc, y_ptr, ws_ptr, tick_ptr, pid_n, pid_k, M, N, stride_ym, BM, BN, SPLIT_K)


@triton.jit
def _load_tile(w_ptr, sc_ptr, sc8_ptr, rn, nmask, stride_wn, stride_sn, b0, b_end, BN: tl.constexpr,
               NB: tl.constexpr, INTERPRET: tl.constexpr, WHOLE: tl.constexpr, PURE: tl.constexpr):
    """Blocks b0 … b0+NB-1 (masked at b_end) of rows rn: each block's two words, as one
    [BN, 2·NB] load split in registers, and the block scales (E4M3 codes under the interpreter,
    whose E4M3 conversion is unreliable: rounding.py). WHOLE: the split's K range is whole tiles,
    so a tile is in or out as one; a mask constant along K (and a 16-block-aligned start) lets
    each thread load 16 bytes where a per-block mask allowed 8: half the weight loads, the same
    SASS loop length otherwise."""
    kb = b0 + tl.arange(0, NB)
    rw = tl.arange(0, 2 * NB)
    if WHOLE:  # a block, not a scalar compare (the interpreter rejects scalar masks), in each load's shape
        wmask = whole_tile_mask(nmask, kb, b0, b_end)
        vmask = whole_tile_mask(nmask, rw, b0, b_end)
    else:
        wmask = nmask[:, None] & (kb < b_end)[None, :]
        vmask = tl.reshape(tl.broadcast_to(wmask[:, :, None], (BN, NB, 2)), (BN, 2 * NB))
    v = tl.load(w_ptr + rn[:, None] * stride_wn + 2 * b0 + rw[None, :], mask=vmask, other=0,
                eviction_policy="evict_first")
    v0, v1 = tl.split(tl.reshape(v, (BN, NB, 2)))
    if PURE:  # the same offsets, of contiguity 2: 2-byte loads, in the layout of the blocks' words (v0, v1)
        rs = tl.arange(0, NB)
        s_off = rn[:, None] * stride_sn + (b0 + (rs // 2) * 2 + rs % 2)[None, :]
    else:  # 8 or 16 contiguous bytes a thread, whose layout Triton converts the block sums into every tile
        s_off = rn[:, None] * stride_sn + kb[None, :]
    if INTERPRET:
        s = tl.load(sc_ptr + s_off, mask=wmask, other=0).to(tl.int32)
    else:
        s = tl.load(sc8_ptr + s_off, mask=wmask, other=0.0, eviction_policy="evict_first")
    return v0, v1, s


@triton.jit
def _gemv_nvfp4_m1_kernel(xw_ptr, xs_ptr, w_ptr, sc_ptr, sc8_ptr, gs_ptr, y_ptr, ws_ptr, tick_ptr, hw_ptr, hs_ptr, N,
                          K, stride_wn, stride_sn, K_PER_SPLIT, BN: tl.constexpr, NB: tl.constexpr,
                          SPLIT_K: tl.constexpr, INTERPRET: tl.constexpr, PTX: tl.constexpr, PDL: tl.constexpr,
                          SILU: tl.constexpr, PARTIALS: tl.constexpr, WHOLE: tl.constexpr, V4: tl.constexpr,
                          PURE: tl.constexpr):
    """M = 1 without tensor cores: padding one row to the 16 an MMA needs wastes 15/16 of it
    and forces the decoded weights through a shared-memory layout change. Here a tile is BN
    rows × NB blocks of 16 weights; each block's two 32-bit words are decoded two nibbles at a
    time into fp16 pairs and multiplied with the activations by fma.rn.f16x2 (half2.py), the
    block scales (the weight's and the activations' 2^e) multiply the block's sum in fp32, the
    global scale the row's total. The activations arrive as fp16 pairs (half2.nvfp4_pairs:
    xw int32 [K/2], xs fp32 [K/16]); the weights as pack_m1 wrote them (M1_LAYOUT words).

    SILU: the weight is a gate_up pair interleaved by pack_m1 (16 gate rows, then the same 16
    up rows), so a tile's rows give silu(gate) · up for whole 16-value blocks: the epilogue
    writes that product as down_proj's activation pairs (hw, hs) instead of y, and the
    separate silu_mul_quant launch between the two GEMVs goes away.

    Latency, not arithmetic, bounds the 4B's layer shapes (a CTA streams a few tiles only), so
    the next tile's loads are issued before this one is computed, and the first tile's before
    waiting on the kernel that wrote the activations."""
    pid_n, pid_k, rn, nmask, k_start, k_end = split_tile(N, K, K_PER_SPLIT, BN)
    b_first = k_start // 16
    if WHOLE:  # splits start on a whole K-tile: 16-byte weight loads (see _load_tile)
        b_first = tl.multiple_of(b_first, 16)
    b_end = k_end // 16
    v0, v1, s = _load_tile(w_ptr, sc_ptr, sc8_ptr, rn, nmask, stride_wn, stride_sn, b_first, b_end, BN, NB,
                           INTERPRET, WHOLE, PURE)
    gs = tl.load(gs_ptr)  # here, before the wait, not after the loop: its round trip hides under the first tile's
    wait_for_inputs(PDL)
    after = after_wait(b_first) if V4 and PURE else 0  # orders the pure activation loads behind the wait
    rb = tl.arange(0, NB)
    acc = tl.zeros((BN, NB), dtype=tl.float32)
    for b0 in range(b_first, b_end, NB):
        n0, n1, ns = _load_tile(w_ptr, sc_ptr, sc8_ptr, rn, nmask, stride_wn, stride_sn, b0 + NB, b_end, BN, NB,
                                INTERPRET, WHOLE, PURE)  # the next tile (masked off after the last)
        kb = b0 + rb                                        # block index along K
        bmask = kb < b_end
        if V4 and PURE:  # whole tiles, 16-byte aligned pairs, GPU: laid out as the tile uses them (pure_loads)
            xs = load_after(xs_ptr + kb, after).to(tl.float32, bitcast=True)
            p0, p1, p2, p3, p4, p5, p6, p7 = load_pairs_v4(xw_ptr + kb * 8, after)
        else:
            if WHOLE:  # the tile is in range as a whole: unmasked, the block scales load 16 bytes at a time
                xs = tl.load(xs_ptr + kb)
            else:
                xs = tl.load(xs_ptr + kb, mask=bmask, other=0.0)
            if V4:  # each block's eight words in two 16-byte loads
                p0, p1, p2, p3, p4, p5, p6, p7 = load_pairs_v4(xw_ptr + kb * 8)
            else:
                p0, p1, p2, p3, p4, p5, p6, p7 = load_pairs(xw_ptr + kb * 8, bmask)
        part = nvfp4_block_dot(v0, v1, p0, p1, p2, p3, p4, p5, p6, p7, PTX)
        if INTERPRET:
            acc += part * (e4m3_value(s) * xs[None, :])
        else:
            acc += part * (s.to(tl.float32) * xs[None, :])
        v0, v1, s = n0, n1, ns
    # w = E2M1 · s / global; the sums hold E2M1 · 2^-14 · x · 2^(14 - e), times 2^e above.
    y = tl.sum(acc, 1) / gs
    if SILU:  # SPLIT_K == 1, BN a multiple of 32 (gemv_nvfp4_silu): rows [16 gate, 16 up] per block
        gu = tl.permute(tl.reshape(round_bf16(y), (BN // 32, 2, 16)), (0, 2, 1))  # gate, up as bf16 stores them
        g, u = tl.split(gu)
        h = tl.reshape(silu_mul_values(g, u), (BN // 2,))
        store_nvfp4_pairs(h, hw_ptr, hs_ptr, pid_n * (BN // 2), N // 2)
    else:
        store_row(y, y_ptr, ws_ptr, tick_ptr, pid_n, pid_k, N, BN, SPLIT_K, PARTIALS, INTERPRET)


@triton.jit
def _nvfp4_pairs_kernel(x_ptr, xw_ptr, xs_ptr, K, stride_xm, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    r = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_xm + r, mask=r < K, other=0.0).to(tl.float32)
    store_nvfp4_pairs(x, xw_ptr + row * (K // 2), xs_ptr + row * (K // 16), tl.program_id(1) * BLOCK, K)


def nvfp4_x_pairs(x: torch.Tensor, block: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 [M, K] (K a multiple of 16) -> (int32 [M, K/2], fp32 [M, K/16]): the activations as
    gemv_nvfp4's batch-1 kernel reads them (half2.nvfp4_pairs). The runtime's producers
    (add_rmsnorm, silu_mul_quant) write these themselves; this is for everything else."""
    m, k = x.shape
    if k % 16 or x.stride(-1) != 1:
        raise ValueError(f"nvfp4_x_pairs: K must be a multiple of 16 with contiguous rows, got {tuple(x.shape)}")
    xw = torch.empty(m, k // 2, dtype=torch.int32, device=x.device)
    xs = torch.empty(m, k // 16, dtype=torch.float32, device=x.device)
    block = min(block, triton.next_power_of_2(k))
    _nvfp4_pairs_kernel[(m, triton.cdiv(k, block))](x, xw, xs, k, x.stride(0), BLOCK=block, num_warps=4)
    return xw, xs


def pack_m1(w_packed: torch.Tensor, w_scale: torch.Tensor, interleave: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The checkpoint's NVFP4 weight (uint8 [N, K/2], even k in the low nibble; E4M3 scales
    [N, K/16]) -> (int32 words [N, K/8] in half2.M1_LAYOUT, the scales) for the batch-1 kernel:
    the same 4-bit codes, their bits placed so that each activation pair decodes in ~3 integer
    ops (done once, at load). interleave: N = 2·I rows of a fused gate_up, reordered to 16 gate
    rows then the same 16 up rows (gemv_nvfp4_silu's epilogue); the scales follow the rows."""
    n, kh = w_packed.shape
    k = 2 * kh
    if k % 16 or w_scale.shape != (n, k // 16):
        raise ValueError(f"pack_m1: weight {tuple(w_packed.shape)} and scales {tuple(w_scale.shape)} "
                         "are not an NVFP4 pair with K a multiple of 16")
    if interleave:
        if n % 32:
            raise ValueError(f"pack_m1: interleaving gate_up needs 2·I rows with I a multiple of 16, got {n}")
        i = n // 2
        g = torch.arange(i, device=w_packed.device).reshape(-1, 16)
        perm = torch.stack([g, g + i], 1).reshape(-1)   # [16 gate, 16 up] per block of outputs
        w_packed, w_scale = w_packed[perm], w_scale[perm]
    b = w_packed.to(torch.int64)
    nib = torch.stack([b & 15, b >> 4], -1).reshape(n, k // 16, 2, 2, 4)  # [row, block, word, half, pair]
    mag, sign = nib & 7, nib >> 3
    words = torch.zeros(n, k // 16, 2, dtype=torch.int64, device=b.device)
    for j, (m_sh, s_sh) in enumerate(M1_LAYOUT):  # bit t of the decoded pair comes from bit t - shift
        for h in (0, 16):  # the pair's low and high fp16 half (python ints: no tensor made during a graph capture)
            # the three magnitude bits move together (9-11 after the shift), the sign to 15
            words |= (mag[..., h // 16, j] << (9 - m_sh + h)) | (sign[..., h // 16, j] << (15 - s_sh + h))
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words)
    return words.to(torch.int32).reshape(n, k // 8).contiguous(), w_scale.contiguous()


def _m1_launch(xw, xs, m1, w_global_scale, n, k, block_n, block_k, split_k, num_warps, num_stages, ptx, pdl,
               device, out=None, silu_out=None, partials=False):
    words, scales = m1
    if words.shape != (n, k // 8) or scales.shape != (n, k // 16):
        raise ValueError(f"gemv_nvfp4: batch-1 weight words {tuple(words.shape)} / scales {tuple(scales.shape)} "
                         f"do not match N={n}, K={k} (pack_m1 makes them)")
    interp = interpreted()
    _, grid, k_per, out, ws, tick = launch_plan(1, n, k, block_n, block_k, device, split_k,
                                                out if silu_out is None else xw.new_empty(0, dtype=torch.bfloat16))
    pdl = use_pdl(device, pdl)
    partials = partials and silu_out is None and grid[1] > 1
    whole = k % block_k == 0  # every split is whole K-tiles: no K mask needed
    hw, hs = silu_out if silu_out is not None else (out, out)
    _gemv_nvfp4_m1_kernel[grid](xw, xs, words, scales.view(torch.uint8), scales,
                                w_global_scale.reshape(1).float(), out, ws, tick, hw, hs, n, k, words.stride(0),
                                scales.stride(0), k_per, BN=block_n, NB=block_k // 16, SPLIT_K=grid[1],
                                num_warps=num_warps, num_stages=num_stages, INTERPRET=interp,
                                PTX=ptx and not interp, SILU=silu_out is not None, PARTIALS=partials, WHOLE=whole,
                                V4=whole and xw.data_ptr() % 16 == 0 and not interp,
                                PURE=pure_loads(block_k, silu_out is not None), PDL=pdl, launch_pdl=pdl)
    return partials_view(ws, grid[1], n) if partials else out


def gemv_nvfp4(x: torch.Tensor | None, w_packed: torch.Tensor, w_scale: torch.Tensor, w_global_scale: torch.Tensor,
               out: torch.Tensor | None = None, block_n: int = 16, block_k: int = 256,
               split_k: int | None = None, num_warps: int = 4, num_stages: int = 4,
               path: str = "auto", ptx: bool = True, pdl: bool | None = None,
               x_pairs: tuple[torch.Tensor, torch.Tensor] | None = None,
               m1: tuple[torch.Tensor, torch.Tensor] | None = None, partials: bool = False) -> torch.Tensor | Partials:
    """x bf16 [M, K], w_packed uint8 [N, K/2], w_scale E4M3 [N, K/16], w_global_scale fp32 [1]
    -> bf16 [M, N]. path: "fma" (M = 1 only), "dot" (tensor cores), "auto" (fma at M = 1).
    ptx: the M = 1 path decodes words with the PTX sequence (GPU only; False: Triton's ops).
    x_pairs: x as nvfp4_x_pairs gives it, already written by the producer (M = 1 path only;
    None: made here, one more launch; x may then be None). m1: the weight as pack_m1 gives it,
    made once at load (M = 1 path; None: packed here, for tests and one-off calls). partials: on
    the M = 1 path, when K is split, the splits' fp32 sums unreduced (partials.Partials)."""
    n = w_packed.shape[0]
    m, k = (1, w_packed.shape[1] * 2) if x is None else x.shape
    if w_packed.shape[1] * 2 != k or w_scale.shape != (n, k // 16):
        raise ValueError(f"gemv_nvfp4: x has K={k} but the weight is packed {tuple(w_packed.shape)} "
                         f"with scales {tuple(w_scale.shape)}")
    if m > 64:
        raise ValueError(f"gemv_nvfp4 is for decode (M <= 64), got M={m}; dequantize and use a GEMM above that")
    device = w_packed.device
    if path == "fma" or (path == "auto" and m == 1):
        if m != 1:
            raise ValueError(f"gemv_nvfp4: the fma path is for M = 1, got M={m}")
        xw, xs = x_pairs if x_pairs is not None else nvfp4_x_pairs(x.contiguous())
        m1 = pack_m1(w_packed, w_scale) if m1 is None else m1
        return _m1_launch(xw, xs, m1, w_global_scale, n, k, block_n, block_k, split_k, num_warps, num_stages, ptx,
                          pdl, device, out=out, partials=partials)
    bm, grid, k_per, out, ws, tick = launch_plan(m, n, k, block_n, block_k, device, split_k, out)
    _gemv_nvfp4_kernel[grid](x, w_packed, w_scale.view(torch.uint8), w_scale, w_global_scale.reshape(1).float(),
                             out, ws, tick, m, n, k, x.stride(0), w_packed.stride(0), w_scale.stride(0), out.stride(0),
                             k_per, BM=bm, BN=block_n, BK=block_k, SPLIT_K=grid[1], num_warps=num_warps,
                             num_stages=num_stages, INTERPRET=interpreted())
    return out


def gemv_nvfp4_silu(x_pairs: tuple[torch.Tensor, torch.Tensor], m1: tuple[torch.Tensor, torch.Tensor],
                    w_global_scale: torch.Tensor, block_n: int = 32, block_k: int = 512, num_warps: int = 4,
                    num_stages: int = 4, ptx: bool = True, pdl: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch 1, a fused NVFP4 gate_up packed with pack_m1(..., interleave=True), its input as
    activation pairs -> silu(gate) · up as down_proj's NVFP4 activation pairs (int32 [1, I/2],
    fp32 [1, I/16]), in one launch: the GEMV, silu_mul_quant's bf16 rounding and
    half2.nvfp4_pairs. block_n: a multiple of 32 (whole 16-value blocks per tile); no split-K."""
    words, _ = m1
    n, k = words.shape[0], words.shape[1] * 8
    if block_n % 32:
        raise ValueError(f"gemv_nvfp4_silu: block_n must be a multiple of 32, got {block_n}")
    i = n // 2
    hw = torch.empty(1, i // 2, dtype=torch.int32, device=words.device)
    hs = torch.empty(1, i // 16, dtype=torch.float32, device=words.device)
    xw, xs = x_pairs
    _m1_launch(xw, xs, m1, w_global_scale, n, k, block_n, block_k, 1, num_warps, num_stages, ptx, pdl,
               words.device, silu_out=(hw, hs))
    return hw, hs

