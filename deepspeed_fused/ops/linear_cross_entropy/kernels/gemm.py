"""The Hopper fused GEMMs of the linear cross-entropy: one kernel family, the logits GEMM with
the row kernel's math in its epilogue (the logits never reach memory).

* ``_lce_gemm_stats_kernel`` (+ ``_merge_tile_stats_kernel``): the per-token forward's row
  statistics, :func:`..launch.gemm_stats`.
* ``_lce_gemm_grad_kernel``: the per-token backward's ``dL/dlogits`` of a vocabulary slice,
  :func:`..launch.gemm_grad`.

Both are persistent TMA kernels sharing their tile helpers (``_tile_ids``, ``_tile_acc``,
``_tile_logits``) and take the logits exactly as the row kernel (:mod:`.row`, whose
``_softcap`` they use) would read them from cuBLAS. They run on sm90 with fp16/bf16 operands,
or under the Triton interpreter (tests); :func:`..launch.gemm_stats_supported` / :func:`..launch.gemm_grad_supported`
say where, and a compile or launch failure turns them off for the process (one warning; the
caller then runs cuBLAS and the row kernel).
"""
from ..._common import HAS_TRITON, tl, triton

if HAS_TRITON:
    from .row import _rel_diff, _rel_exp, _softcap


if HAS_TRITON:

    @triton.jit
    def _tile_ids(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
        # tiles in groups of GROUP_M row-blocks, so the programs running together share weight tiles in L2
        group = GROUP_M * num_pid_n
        first_m = (tile_id // group) * GROUP_M
        size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
        return first_m + (tile_id % group) % size_m, (tile_id % group) // size_m

    @triton.jit
    def _tile_acc(h_desc, w_desc, pid_m, pid_n, k_tiles, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        # the fp32 accumulator of one (BM x BN) tile of h @ w.T, operands loaded by TMA
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(k_tiles):
            a = h_desc.load([pid_m * BM, ki * BK])
            b = w_desc.load([pid_n * BN, ki * BK])
            acc = tl.dot(a, b.T, acc)
        return acc

    @triton.jit
    def _tile_logits(acc, offs_m, offs_n, rmask, V, bias_ptr, temp_ptr, inv_temp, cap,
                     ROUND: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_TEMP: tl.constexpr, HAS_CAP: tl.constexpr):
        # the logits of one accumulator block as the row kernel reads them: (acc + bias) rounded to
        # the input dtype as cuBLAS writes them (ROUND 1: fp16, 2: bf16; 0: fp32 logits), then
        # temperature and cap; also the inverse temperature (per row with HAS_TEMP, else the scalar)
        z = acc
        if HAS_BIAS:
            z += tl.load(bias_ptr + offs_n, mask=offs_n < V, other=0.0).to(tl.float32)[None, :]
        if ROUND == 1:
            z = z.to(tl.float16).to(tl.float32)
        elif ROUND == 2:
            z = z.to(tl.bfloat16).to(tl.float32)
        if HAS_TEMP:
            inv_t = 1.0 / tl.load(temp_ptr + offs_m, mask=rmask, other=1.0).to(tl.float32)
            z = z * inv_t[:, None]
        else:
            inv_t = inv_temp
            z = z * inv_t
        if HAS_CAP:
            z = _softcap(z, cap)
        return z, inv_t

    @triton.jit
    def _tile_part_stats(acc, offs_m, n0, rmask, V, bias_ptr, temp_ptr, inv_temp, cap, lt,
                         ROUND: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_TEMP: tl.constexpr,
                         HAS_CAP: tl.constexpr, NEED_ENT: tl.constexpr, NEED_SUMZ: tl.constexpr,
                         NEED_TOP: tl.constexpr, NEED_SQ: tl.constexpr, W: tl.constexpr):
        # (max, sum exp, entropy term, sum z, target z) per row of one accumulator block (W columns
        # from n0; lt: each row's target column relative to n0, int32, -1 for none), from the
        # logits as the row kernel would read them: (acc + bias) rounded to the input dtype as
        # cuBLAS writes them (ROUND 1: fp16, 2: bf16; 0: fp32 logits), then temperature and cap
        cols = tl.arange(0, W)
        offs_n = n0 + cols
        cmask = (offs_n < V)[None, :]
        z, _ = _tile_logits(acc, offs_m, offs_n, rmask, V, bias_ptr, temp_ptr, inv_temp, cap,
                            ROUND, HAS_BIAS, HAS_TEMP, HAS_CAP)
        z = tl.where(cmask, z, float("-inf"))
        # floored: a block wholly past the vocabulary (a column half of the last tile) gives
        # m = -1e30 and d = a = 0, which the merge takes as empty
        m = tl.maximum(tl.max(z, axis=1), -1e30)
        e = _rel_exp(z, m[:, None])
        d = tl.sum(e, axis=1)
        if NEED_ENT:
            a = tl.sum(e * tl.where(cmask, z - m[:, None], 0.0), axis=1)
        else:
            a = tl.zeros_like(d)
        if NEED_SUMZ:
            sz = tl.sum(tl.where(cmask, z, 0.0), axis=1)
        else:
            sz = tl.zeros_like(d)
        # int32 compares against the block's own column numbers: no int64 tile, no second reduction
        # for whether the block holds the target (the caller checks lt's range)
        zt = tl.sum(tl.where(lt[:, None] == cols[None, :], z, 0.0), axis=1)
        if NEED_TOP:
            # torch.argmax's choice within the block: the first NaN, else the first largest value
            # (bv NaN marks a NaN). Two reductions: a NaN counts as +inf for the max, and among
            # the columns at the max a NaN's key (its column) comes before any other's (column + W).
            # Columns past the vocabulary are -inf and never chosen first.
            isnan = z != z
            zz = tl.where(isnan, float("inf"), z)
            bmax = tl.max(zz, axis=1)
            key = tl.min(tl.where((zz == bmax[:, None]) & cmask, cols[None, :] + tl.where(isnan, 0, W), 2 * W),
                         axis=1)
            has_nan = key < W
            bv = tl.where(has_nan, float("nan"), bmax)
            bi = tl.where(has_nan, key, key - W) + n0
        else:
            bv = tl.zeros_like(d)
            bi = tl.zeros_like(lt)
        if NEED_SQ:
            q = tl.sum(e * e, axis=1)
        else:
            q = tl.zeros_like(d)
        return m, d, a, sz, zt, bv, bi, q

    @triton.jit
    def _combine_top(v0, i0, v1, i1):
        # two blocks' (largest value or NaN, its first index) of the same rows, the second block
        # after the first: the first NaN, else the larger value, the first block's on ties
        take1 = (v0 == v0) & ((v1 != v1) | (v1 > v0))
        return tl.where(take1, v1, v0), tl.where(take1, i1, i0)

    @triton.jit
    def _combine_sq(m0, q0, m1, q1):
        # two blocks' sum exp(2(z - m)) of the same rows, to the larger max
        m = tl.maximum(m0, m1)
        s0 = _rel_exp(m0, m)
        s1 = _rel_exp(m1, m)
        return q0 * s0 * s0 + q1 * s1 * s1

    @triton.jit
    def _combine_stats(m0, d0, a0, m1, d1, a1):
        # two blocks' (max, sum exp, entropy term) of the same rows -> the blocks together
        m = tl.maximum(m0, m1)
        s0 = _rel_exp(m0, m)
        s1 = _rel_exp(m1, m)
        return m, d0 * s0 + d1 * s1, s0 * (a0 + _rel_diff(m0, m) * d0) + s1 * (a1 + _rel_diff(m1, m) * d1)

    @triton.jit
    def _lce_gemm_stats_kernel(
        h_desc, w_desc, bias_ptr, tgt_ptr, temp_ptr, m_ptr, d_ptr, a_ptr, sz_ptr, zt_ptr, bv_ptr, bi_ptr, q_ptr,
        M, V, K, ignore_index, vocab_start, inv_temp, cap,
        ROUND: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_TEMP: tl.constexpr, HAS_CAP: tl.constexpr,
        NEED_ENT: tl.constexpr, NEED_SUMZ: tl.constexpr, NEED_TOP: tl.constexpr, NEED_SQ: tl.constexpr,
        SUBTILE: tl.constexpr, BM: tl.constexpr,
        BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr,
    ):
        """The logits GEMM with the row statistics in its epilogue: persistent programs walk the
        (BM x BN) tiles of ``h @ w.T``; each tile's fp32 accumulator is turned, in registers, into
        the tile's partial statistics per row (the row kernel's, over the tile's BN vocabulary
        columns), written field by field to ``m_ptr``, ``d_ptr`` (and ``a_ptr``, ``sz_ptr`` when
        needed), each [V tiles, M]; the target logit goes to ``zt_ptr`` [M] from the one tile
        that holds it. NEED_TOP / NEED_SQ: per tile also the largest logit (NaN if any), its first
        column in the whole vocabulary (``bi_ptr``, int32) and ``sum exp(2(z-m))`` (``q_ptr``),
        each [V tiles, M]. The logits never reach memory. TMA descriptors load the operands
        (zero-filled past the edges). SUBTILE 2: the epilogue takes the tile in two column
        halves (fewer registers live at once)."""
        start = tl.program_id(0)
        num_pid_m = tl.cdiv(M, BM)
        num_pid_n = tl.cdiv(V, BN)
        k_tiles = tl.cdiv(K, BK)
        for tile_id in tl.range(start, num_pid_m * num_pid_n, NUM_SMS, flatten=True):
            pid_m, pid_n = _tile_ids(tile_id, num_pid_m, num_pid_n, GROUP_M)
            acc = _tile_acc(h_desc, w_desc, pid_m, pid_n, k_tiles, BM, BN, BK)
            offs_m = pid_m * BM + tl.arange(0, BM)
            rmask = offs_m < M
            t = tl.load(tgt_ptr + offs_m, mask=rmask, other=ignore_index)
            # the target's column relative to this tile, -1 where it is not in the tile; a target past
            # the vocabulary (possible without the target check) matches no column, as in the row
            # kernel: its logit counts as 0
            n0 = pid_n * BN
            c0 = vocab_start + n0  # the tile's first column in the whole vocabulary (a TP shard's offset)
            inside = (t != ignore_index) & (t >= c0) & (t < c0 + BN) & (t < vocab_start + V)
            lt = tl.where(inside, t - c0, -1).to(tl.int32)
            if SUBTILE == 2:
                halves = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))
                m, d, a_, sz, zt, bv, bi, q = _tile_part_stats(
                    halves[0], offs_m, n0, rmask, V, bias_ptr, temp_ptr, inv_temp, cap, lt,
                    ROUND, HAS_BIAS, HAS_TEMP, HAS_CAP, NEED_ENT, NEED_SUMZ, NEED_TOP, NEED_SQ, BN // 2)
                m1, d1, a1, sz1, zt1, bv1, bi1, q1 = _tile_part_stats(
                    halves[1], offs_m, n0 + BN // 2, rmask, V, bias_ptr, temp_ptr, inv_temp, cap, lt - BN // 2,
                    ROUND, HAS_BIAS, HAS_TEMP, HAS_CAP, NEED_ENT, NEED_SUMZ, NEED_TOP, NEED_SQ, BN // 2)
                if NEED_TOP:
                    bv, bi = _combine_top(bv, bi, bv1, bi1)
                if NEED_SQ:
                    q = _combine_sq(m, q, m1, q1)
                m, d, a_ = _combine_stats(m, d, a_, m1, d1, a1)
                sz += sz1
                zt += zt1
            else:
                m, d, a_, sz, zt, bv, bi, q = _tile_part_stats(
                    acc, offs_m, n0, rmask, V, bias_ptr, temp_ptr, inv_temp, cap, lt,
                    ROUND, HAS_BIAS, HAS_TEMP, HAS_CAP, NEED_ENT, NEED_SUMZ, NEED_TOP, NEED_SQ, BN)
            o = pid_n.to(tl.int64) * M + offs_m
            tl.store(m_ptr + o, m, mask=rmask)
            tl.store(d_ptr + o, d, mask=rmask)
            if NEED_ENT:
                tl.store(a_ptr + o, a_, mask=rmask)
            if NEED_SUMZ:
                tl.store(sz_ptr + o, sz, mask=rmask)
            if NEED_TOP:
                tl.store(bv_ptr + o, bv, mask=rmask)
                tl.store(bi_ptr + o, (bi + vocab_start).to(tl.int32), mask=rmask)
            if NEED_SQ:
                tl.store(q_ptr + o, q, mask=rmask)
            tl.store(zt_ptr + offs_m, zt, mask=rmask & inside)

    @triton.jit
    def _merge_tile_stats_kernel(m_ptr, d_ptr, a_ptr, sz_ptr, zt_ptr, out_ptr, n_tiles, M,
                                 bv_ptr, bi_ptr, q_ptr, xt_ptr, xi_ptr,
                                 NEED_ENT: tl.constexpr, NEED_SUMZ: tl.constexpr, NEED_TOP: tl.constexpr,
                                 NEED_SQ: tl.constexpr, BLOCK: tl.constexpr):
        """Merge the fused GEMM's per-tile statistics ([n_tiles, M] per field) into the row
        statistics [M, 5] that ``stats._finalize_stats`` reads, in tile order; with NEED_TOP /
        NEED_SQ also the extra statistics [M, 3] at ``xt_ptr`` (``xi_ptr``: the same memory as
        int32), as the row kernel writes them."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < M
        m = tl.full((BLOCK,), -1e30, tl.float32)
        d = tl.zeros((BLOCK,), tl.float32)
        a = tl.zeros((BLOCK,), tl.float32)
        sz = tl.zeros((BLOCK,), tl.float32)
        q = tl.zeros((BLOCK,), tl.float32)
        # tile 0 always holds vocabulary columns: it starts the (value, index) pair
        if NEED_TOP:
            bv = tl.load(bv_ptr + offs, mask=mask, other=0.0)
            bi = tl.load(bi_ptr + offs, mask=mask, other=0)
        else:
            bv = tl.zeros((BLOCK,), tl.float32)
            bi = tl.zeros((BLOCK,), tl.int32)
        for r in range(0, n_tiles):
            o = r * M + offs
            m_r = tl.load(m_ptr + o, mask=mask, other=0.0)
            d_r = tl.load(d_ptr + o, mask=mask, other=0.0)
            if NEED_ENT:
                a_r = tl.load(a_ptr + o, mask=mask, other=0.0)
            else:
                a_r = tl.zeros_like(d_r)
            if NEED_TOP:
                bv, bi = _combine_top(bv, bi, tl.load(bv_ptr + o, mask=mask, other=0.0),
                                      tl.load(bi_ptr + o, mask=mask, other=0))
            if NEED_SQ:
                q = _combine_sq(m, q, m_r, tl.load(q_ptr + o, mask=mask, other=0.0))
            m, d, a = _combine_stats(m, d, a, m_r, d_r, a_r)
            if NEED_SUMZ:
                sz += tl.load(sz_ptr + o, mask=mask, other=0.0)
        p = out_ptr + offs.to(tl.int64) * 5
        tl.store(p + 0, m, mask=mask)
        tl.store(p + 1, d, mask=mask)
        tl.store(p + 2, a if NEED_ENT else tl.zeros_like(a), mask=mask)
        tl.store(p + 3, sz, mask=mask)
        tl.store(p + 4, tl.load(zt_ptr + offs, mask=mask, other=0.0), mask=mask)
        x = offs.to(tl.int64) * 3
        if NEED_TOP:
            tl.store(xt_ptr + x, bv, mask=mask)
            tl.store(xi_ptr + x + 1, bi, mask=mask)
        if NEED_SQ:
            tl.store(xt_ptr + x + 2, q, mask=mask)


if HAS_TRITON:

    @triton.jit
    def _tile_grad_store(acc, offs_m, offs_n, rmask, V, bias_ptr, temp_ptr, inv_temp, cap, lt,
                         lse, s_pz, ge, coef, g_smooth, g_tgt, out_ptr, stride_out, out_desc, m0, n0,
                         ROUND: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_TEMP: tl.constexpr,
                         HAS_CAP: tl.constexpr, HAS_GE: tl.constexpr, TMA_OUT: tl.constexpr):
        # dL/dlogits of one accumulator block, as the row kernel's GRAD pass forms it from the
        # logits it would read (rounded as cuBLAS writes them unless ROUND 0), stored to out
        # (TMA_OUT: through the output's descriptor, which clips the block at M and V)
        cmask = (offs_n < V)[None, :]
        z, inv_t = _tile_logits(acc, offs_m, offs_n, rmask, V, bias_ptr, temp_ptr, inv_temp, cap,
                                ROUND, HAS_BIAS, HAS_TEMP, HAS_CAP)
        p = tl.exp(z - lse[:, None])
        if HAS_GE:
            g = p * (coef[:, None] - tl.where(ge[:, None] == 0.0, 0.0, ge[:, None] * (z - s_pz[:, None])))
        else:
            g = p * coef[:, None]
        g = g - g_smooth[:, None]
        # the target's column in this slice (ignored rows have g_tgt = 0; a target outside the
        # slice or past the vocabulary matches no column)
        hit = (lt[:, None] == offs_n[None, :]) & cmask
        g = tl.where(hit, g - g_tgt[:, None], g)
        if HAS_CAP:
            th = z / cap
            g = g * (1.0 - th * th)
        if HAS_TEMP:
            g = g * inv_t[:, None]
        else:
            g = g * inv_temp
        if TMA_OUT:
            out_desc.store([m0, n0], g.to(out_desc.dtype))
        else:
            ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_out + offs_n[None, :]
            tl.store(ptrs, g.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & cmask)

    @triton.jit
    def _lce_gemm_grad_kernel(
        h_desc, w_desc, bias_ptr, tgt_ptr, temp_ptr, lse_ptr, ent_ptr, gl_ptr, ge_ptr, gs_ptr, out_ptr, stride_out,
        out_desc, M, V, K, vocab_start, ignore_index, inv_temp, cap, z_loss, smooth, inv_vocab_total,
        ROUND: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_TEMP: tl.constexpr, HAS_CAP: tl.constexpr,
        HAS_GE: tl.constexpr, HAS_GS: tl.constexpr, TMA_OUT: tl.constexpr, SUBTILE: tl.constexpr, BM: tl.constexpr,
        BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr,
    ):
        """The per-token backward's logits GEMM with the row kernel's gradient in its epilogue:
        each (BM x BN) tile of ``h @ w.T`` (the vocabulary slice ``[vocab_start, vocab_start + V)``)
        becomes ``dL/dlogits`` from the forward's per-token lse (and entropy) and the upstream
        gradients, stored in the output's dtype; the logits themselves never reach memory."""
        start = tl.program_id(0)
        num_pid_m = tl.cdiv(M, BM)
        num_pid_n = tl.cdiv(V, BN)
        k_tiles = tl.cdiv(K, BK)
        for tile_id in tl.range(start, num_pid_m * num_pid_n, NUM_SMS, flatten=True):
            pid_m, pid_n = _tile_ids(tile_id, num_pid_m, num_pid_n, GROUP_M)
            acc = _tile_acc(h_desc, w_desc, pid_m, pid_n, k_tiles, BM, BN, BK)
            offs_m = pid_m * BM + tl.arange(0, BM)
            rmask = offs_m < M
            t = tl.load(tgt_ptr + offs_m, mask=rmask, other=ignore_index).to(tl.int64)
            lt = t - vocab_start
            lt = tl.where((t != ignore_index) & (lt >= 0) & (lt < V), lt, -1).to(tl.int32)
            lse = tl.load(lse_ptr + offs_m, mask=rmask, other=0.0)
            gl = tl.where(t != ignore_index, tl.load(gl_ptr + offs_m, mask=rmask, other=0.0), 0.0)
            coef = gl * (1.0 + 2.0 * z_loss * lse)
            if HAS_GS:
                coef += tl.load(gs_ptr + offs_m, mask=rmask, other=0.0)
            coef = tl.where((t != ignore_index) & (lse == float("inf")), float("nan"), coef)  # as the row kernel
            if HAS_GE:
                ge = tl.load(ge_ptr + offs_m, mask=rmask, other=0.0)
                s_pz = lse - tl.load(ent_ptr + offs_m, mask=rmask, other=0.0)
            else:
                ge = lse
                s_pz = lse
            g_smooth = gl * smooth * inv_vocab_total
            g_tgt = gl * (1.0 - smooth)
            if SUBTILE == 2:
                halves = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))
                offs_n = pid_n * BN + tl.arange(0, BN // 2)
                _tile_grad_store(halves[0], offs_m, offs_n, rmask, V, bias_ptr, temp_ptr, inv_temp, cap, lt,
                                 lse, s_pz, ge, coef, g_smooth, g_tgt, out_ptr, stride_out, out_desc,
                                 pid_m * BM, pid_n * BN, ROUND, HAS_BIAS, HAS_TEMP, HAS_CAP, HAS_GE, TMA_OUT)
                _tile_grad_store(halves[1], offs_m, offs_n + BN // 2, rmask, V, bias_ptr, temp_ptr, inv_temp, cap,
                                 lt, lse, s_pz, ge, coef, g_smooth, g_tgt, out_ptr, stride_out, out_desc,
                                 pid_m * BM, pid_n * BN + BN // 2, ROUND, HAS_BIAS, HAS_TEMP, HAS_CAP, HAS_GE,
                                 TMA_OUT)
            else:
                _tile_grad_store(acc, offs_m, pid_n * BN + tl.arange(0, BN), rmask, V, bias_ptr, temp_ptr,
                                 inv_temp, cap, lt, lse, s_pz, ge, coef, g_smooth, g_tgt, out_ptr, stride_out,
                                 out_desc, pid_m * BM, pid_n * BN, ROUND, HAS_BIAS, HAS_TEMP, HAS_CAP, HAS_GE,
                                 TMA_OUT)
