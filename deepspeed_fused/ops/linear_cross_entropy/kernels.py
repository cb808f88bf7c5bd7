"""The Triton row kernel of the fused linear cross-entropy and its launch helper.

``_lce_rows_kernel`` runs one program per row of a logits chunk (written by cuBLAS, see
:mod:`.single`) and, in fp32, either writes the row's partial statistics (finalized and merged
by :mod:`.stats`) or overwrites the row with ``dL/dlogits``, or both in two passes over it.
:func:`_launch_rows` is the only way the other modules start it. The kernels are defined when
this module is imported, so ``TRITON_INTERPRET`` must be set before (tests/conftest.py does).

Math per token with ``s`` the raw logits, ``T`` the temperature, ``c`` the soft cap:
``z = c*tanh(s/(T c))`` (or ``s/T``), ``lse = logsumexp(z)``, ``p = softmax(z)``,
``loss = lse - (1-eps) z_t - eps mean(z) + z_loss lse^2`` (0 for ignored targets),
``entropy = lse - sum p z``. With upstream gradients ``gL`` (loss), ``gE`` (entropy),
``gS`` (lse): ``dz_j = p_j (gL (1 + 2 z_loss lse) + gS - gE (z_j - sum p z))
- gL eps/V - gL (1-eps) [j == t]``, then ``ds = dz (1 - (z/c)^2) / T``.
"""
import contextlib

import torch

from .._common import HAS_TRITON, interpreter_active, sm_count, tl, triton


# dtypes the kernel takes (float64 runs the torch reference)
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


if HAS_TRITON:

    @triton.jit
    def _softcap(z, cap):
        # cap * tanh(z / cap); tanh via exp so it runs compiled and interpreted
        return cap - 2.0 * cap / (tl.exp(2.0 * z / cap) + 1.0)

    @triton.jit
    def _load_z(x_row, cols, mask, inv_t, cap, HAS_CAP: tl.constexpr):
        # a block of the row's logits as the loss sees them: fp32, over the temperature, soft-capped
        z = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32) * inv_t
        if HAS_CAP:
            z = _softcap(z, cap)
        return z

    @triton.jit
    def _lce_rows_kernel(
        x_ptr, stride_x, V, g_ptr, stride_g,
        tgt_ptr, ignore_index, vocab_start,
        temp_ptr, inv_temp, cap, z_loss, smooth, inv_vocab_total,
        stat_ptr, lse_ptr, ent_ptr, gl_ptr, ge_ptr, gs_ptr, n_shard, shard_stride,
        HAS_TEMP: tl.constexpr, HAS_CAP: tl.constexpr, STATS: tl.constexpr, GRAD: tl.constexpr,
        PER_TOKEN: tl.constexpr, HAS_GE: tl.constexpr, HAS_GS: tl.constexpr,
        NEED_ENT: tl.constexpr, NEED_SUMZ: tl.constexpr, MERGE: tl.constexpr, BLOCK: tl.constexpr,
    ):
        """One program per row of the logits chunk ``x`` [rows, V].

        STATS: write the row's partial statistics to ``stat_ptr`` [rows, 5].
        GRAD: write the row's dlogits to ``g_ptr`` (its dtype; ``x`` itself, in place, or a
        separate buffer when the logits are fp32 and the GEMMs after want the input dtype;
        every element of x is read before the program writes g there). Without STATS, lse (and the
        entropy, for gE) are read from ``lse_ptr``/``ent_ptr``, or, with MERGE, lse is merged
        from the partial statistics of ``n_shard`` vocabulary shards at ``stat_ptr``
        ([n_shard, rows, 5], ``shard_stride`` elements apart). PER_TOKEN: loss upstream
        gradient per row from ``gl_ptr``; else ``gl_ptr[0]`` for every valid row.
        """
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * stride_x
        g_row = g_ptr + row * stride_g
        t = tl.load(tgt_ptr + row).to(tl.int64)
        valid = t != ignore_index
        lt = t - vocab_start
        in_shard = valid & (lt >= 0) & (lt < V)
        lt = tl.where(in_shard, lt, 0)
        if HAS_TEMP:
            inv_t = 1.0 / tl.load(temp_ptr + row).to(tl.float32)
        else:
            inv_t = inv_temp
        offs = tl.arange(0, BLOCK)
        if STATS:
            m = -1e30
            d = 0.0
            a = 0.0
            sz = 0.0
            for start in range(0, V, BLOCK):
                cols = start + offs
                mask = cols < V
                z = _load_z(x_row, cols, mask, inv_t, cap, HAS_CAP)
                if NEED_SUMZ:
                    sz += tl.sum(tl.where(mask, z, 0.0), axis=0)
                z = tl.where(mask, z, float("-inf"))
                m_new = tl.maximum(m, tl.max(z, axis=0))
                e = tl.exp(z - m_new)
                alpha = tl.exp(m - m_new)
                if NEED_ENT:
                    a = alpha * (a + (m - m_new) * d) + tl.sum(e * tl.where(mask, z - m_new, 0.0), axis=0)
                d = d * alpha + tl.sum(e, axis=0)
                m = m_new
            zt = tl.load(x_row + lt).to(tl.float32) * inv_t
            if HAS_CAP:
                zt = _softcap(zt, cap)
            zt = tl.where(in_shard, zt, 0.0)
            sp = stat_ptr + row * 5
            tl.store(sp + 0, m)
            tl.store(sp + 1, d)
            tl.store(sp + 2, a)
            tl.store(sp + 3, sz)
            tl.store(sp + 4, zt)
            lse = m + tl.log(d)
            s_pz = m + a / d
        if GRAD:
            if MERGE:
                # lse of the whole vocabulary from the shards' (max, sum of exp), in shard order
                mm = -1e30
                dd = 0.0
                for r in range(0, n_shard):
                    gp = stat_ptr + r * shard_stride + row * 5
                    m_r = tl.load(gp)
                    d_r = tl.load(gp + 1)
                    m_new = tl.maximum(mm, m_r)
                    dd = dd * tl.exp(mm - m_new) + d_r * tl.exp(m_r - m_new)
                    mm = m_new
                lse = mm + tl.log(dd)
            elif not STATS:
                lse = tl.load(lse_ptr + row)
                if HAS_GE:
                    s_pz = lse - tl.load(ent_ptr + row)
            if PER_TOKEN:
                gl = tl.load(gl_ptr + row)
            else:
                gl = tl.load(gl_ptr)
            gl = tl.where(valid, gl, 0.0)
            coef = gl * (1.0 + 2.0 * z_loss * lse)
            if HAS_GS:
                coef += tl.load(gs_ptr + row)
            if HAS_GE:
                ge = tl.load(ge_ptr + row)
            g_smooth = gl * smooth * inv_vocab_total
            g_tgt = gl * (1.0 - smooth)
            for start in range(0, V, BLOCK):
                cols = start + offs
                mask = cols < V
                z = _load_z(x_row, cols, mask, inv_t, cap, HAS_CAP)
                p = tl.exp(z - lse)
                if HAS_GE:
                    g = p * (coef - ge * (z - s_pz))
                else:
                    g = p * coef
                g = g - g_smooth
                g = tl.where(in_shard & (cols == lt), g - g_tgt, g)
                if HAS_CAP:
                    th = z / cap
                    g = g * (1.0 - th * th)
                g = g * inv_t
                tl.store(g_row + cols, g.to(g_ptr.dtype.element_ty), mask=mask)


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
                         W: tl.constexpr):
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
        e = tl.exp(z - m[:, None])
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
        return m, d, a, sz, zt

    @triton.jit
    def _combine_stats(m0, d0, a0, m1, d1, a1):
        # two blocks' (max, sum exp, entropy term) of the same rows -> the blocks together
        m = tl.maximum(m0, m1)
        s0 = tl.exp(m0 - m)
        s1 = tl.exp(m1 - m)
        return m, d0 * s0 + d1 * s1, s0 * (a0 + (m0 - m) * d0) + s1 * (a1 + (m1 - m) * d1)

    @triton.jit
    def _lce_gemm_stats_kernel(
        h_desc, w_desc, bias_ptr, tgt_ptr, temp_ptr, m_ptr, d_ptr, a_ptr, sz_ptr, zt_ptr, M, V, K,
        ignore_index, vocab_start, inv_temp, cap,
        ROUND: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_TEMP: tl.constexpr, HAS_CAP: tl.constexpr,
        NEED_ENT: tl.constexpr, NEED_SUMZ: tl.constexpr, SUBTILE: tl.constexpr, BM: tl.constexpr,
        BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr,
    ):
        """The logits GEMM with the row statistics in its epilogue: persistent programs walk the
        (BM x BN) tiles of ``h @ w.T``; each tile's fp32 accumulator is turned, in registers, into
        the tile's partial statistics per row (the row kernel's, over the tile's BN vocabulary
        columns), written field by field to ``m_ptr``, ``d_ptr`` (and ``a_ptr``, ``sz_ptr`` when
        needed), each [V tiles, M]; the target logit goes to ``zt_ptr`` [M] from the one tile
        that holds it. The logits never reach memory. TMA descriptors load the operands
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
                m, d, a_, sz, zt = _tile_part_stats(
                    halves[0], offs_m, n0, rmask, V, bias_ptr, temp_ptr, inv_temp, cap, lt,
                    ROUND, HAS_BIAS, HAS_TEMP, HAS_CAP, NEED_ENT, NEED_SUMZ, BN // 2)
                m1, d1, a1, sz1, zt1 = _tile_part_stats(
                    halves[1], offs_m, n0 + BN // 2, rmask, V, bias_ptr, temp_ptr, inv_temp, cap, lt - BN // 2,
                    ROUND, HAS_BIAS, HAS_TEMP, HAS_CAP, NEED_ENT, NEED_SUMZ, BN // 2)
                m, d, a_ = _combine_stats(m, d, a_, m1, d1, a1)
                sz += sz1
                zt += zt1
            else:
                m, d, a_, sz, zt = _tile_part_stats(
                    acc, offs_m, n0, rmask, V, bias_ptr, temp_ptr, inv_temp, cap, lt,
                    ROUND, HAS_BIAS, HAS_TEMP, HAS_CAP, NEED_ENT, NEED_SUMZ, BN)
            o = pid_n.to(tl.int64) * M + offs_m
            tl.store(m_ptr + o, m, mask=rmask)
            tl.store(d_ptr + o, d, mask=rmask)
            if NEED_ENT:
                tl.store(a_ptr + o, a_, mask=rmask)
            if NEED_SUMZ:
                tl.store(sz_ptr + o, sz, mask=rmask)
            tl.store(zt_ptr + offs_m, zt, mask=rmask & inside)

    @triton.jit
    def _merge_tile_stats_kernel(m_ptr, d_ptr, a_ptr, sz_ptr, zt_ptr, out_ptr, n_tiles, M,
                                 NEED_ENT: tl.constexpr, NEED_SUMZ: tl.constexpr, BLOCK: tl.constexpr):
        """Merge the fused GEMM's per-tile statistics ([n_tiles, M] per field) into the row
        statistics [M, 5] that ``stats._finalize_stats`` reads, in tile order."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < M
        m = tl.full((BLOCK,), -1e30, tl.float32)
        d = tl.zeros((BLOCK,), tl.float32)
        a = tl.zeros((BLOCK,), tl.float32)
        sz = tl.zeros((BLOCK,), tl.float32)
        for r in range(0, n_tiles):
            o = r * M + offs
            m_r = tl.load(m_ptr + o, mask=mask, other=0.0)
            d_r = tl.load(d_ptr + o, mask=mask, other=0.0)
            if NEED_ENT:
                a_r = tl.load(a_ptr + o, mask=mask, other=0.0)
            else:
                a_r = tl.zeros_like(d_r)
            m, d, a = _combine_stats(m, d, a, m_r, d_r, a_r)
            if NEED_SUMZ:
                sz += tl.load(sz_ptr + o, mask=mask, other=0.0)
        p = out_ptr + offs.to(tl.int64) * 5
        tl.store(p + 0, m, mask=mask)
        tl.store(p + 1, d, mask=mask)
        tl.store(p + 2, a if NEED_ENT else tl.zeros_like(a), mask=mask)
        tl.store(p + 3, sz, mask=mask)
        tl.store(p + 4, tl.load(zt_ptr + offs, mask=mask, other=0.0), mask=mask)


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
            g = p * (coef[:, None] - ge[:, None] * (z - s_pz[:, None]))
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


# (BM, BN, BK, GROUP_M, num_stages, num_warps, SUBTILE) of the fused statistics GEMM, swept on the
# H200 at the suite's four shapes: the GEMM alone (a scratch prototype, 2026-11-30; BK 128, BN 128,
# BM 256, GROUP_M 1/4/8/32, warp specialization all slower), then in the op (2026-12-01,
# docs/benchmarks/linear_cross_entropy_fused_ab.json): per-token forward 1.005-1.04 T with the
# epilogue in two column halves and 4 stages (the whole tile at once: 0.99-1.04; 3 stages
# 1.01-1.05), against 1.05-1.13 T for cuBLAS + row kernel
_GEMM_STATS_CFG = (128, 256, 64, 16, 4, 8, 2)
_GEMM_STATS_CFG_INTERP = (16, 64, 16, 2, 1, 1, 2)
# bound on the fused GEMM's per-tile partial statistics (fp32, [V / BN, tokens] per field)
_GEMM_STATS_PART_BYTES = 256 * 1024 * 1024
# False once the fused GEMM has failed to compile or launch in this process (one warning): later
# calls form the logits with cuBLAS and run the row kernel
_GEMM_STATS_OK = [True]
# the same for the backward's fused GEMM (dlogits in its epilogue), and its switch for A/B runs
_GEMM_GRAD_OK = [True]
_GEMM_GRAD_ON = [True]
# the gradient GEMM's configuration (as _GEMM_STATS_CFG; the interpreter uses _GEMM_STATS_CFG_INTERP
# for both): the tile stored by TMA from shared memory, whole (fewest registers, 175), 3 stages to
# leave the store its shared memory. Per-token + entropy fwd+bwd (the same A/B):
# 4.04 / 4.20 / 4.02 / 4.06 T, against 4.01-4.31 T for the column halves with TMA or pointer stores
# and 4.08-4.29 T for cuBLAS + row kernel
_GEMM_GRAD_CFG = (128, 256, 64, 16, 3, 8, 1)
# the gradient GEMM stores its tiles through a TMA descriptor of the output (A/B switch)
_GEMM_GRAD_TMA_OUT = [True]


def _gemm_fusable(hidden, weight) -> bool:
    """Whether the fused GEMMs can run: a Hopper GPU (TMA, sm90) with fp16/bf16 operands whose
    rows are 16-byte aligned, or the Triton interpreter on CPU (fp32/fp16, for the tests)."""
    if not (HAS_TRITON and _TensorDescriptor is not None):
        return False
    if hidden.shape[1] % 8 or hidden.stride(1) != 1 or weight.stride(1) != 1:
        return False
    if interpreter_active():
        return hidden.device.type == "cpu" and hidden.dtype in (torch.float32, torch.float16)
    # Hopper only: the tile configuration (and its shared memory) is the one swept on the H200
    return (hidden.is_cuda and hidden.dtype in (torch.float16, torch.bfloat16)
            and torch.cuda.get_device_capability(hidden.device)[0] == 9
            and hidden.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0
            and hidden.stride(0) % 8 == 0 and weight.stride(0) % 8 == 0)


def gemm_stats_supported(hidden, weight) -> bool:
    """Whether :func:`gemm_stats` runs: see :func:`_gemm_fusable`, and it has not failed."""
    return _GEMM_STATS_OK[0] and _gemm_fusable(hidden, weight)


def gemm_grad_supported(hidden, weight) -> bool:
    """Whether :func:`gemm_grad` runs: see :func:`_gemm_fusable`, and it has not failed."""
    return _GEMM_GRAD_OK[0] and _GEMM_GRAD_ON[0] and _gemm_fusable(hidden, weight)


try:
    from triton.tools.tensor_descriptor import TensorDescriptor as _TensorDescriptor
except Exception:  # pragma: no cover - older Triton
    _TensorDescriptor = None

# the last launched fused GEMMs ("stats", "grad"): their registers, spills and shared memory are
# what a tuning run reads (n_regs, n_spills, metadata.shared)
_COMPILED = {}


def _fused_launch(hidden, fp32_logits, interp):
    """What both fused GEMMs launch with: the persistent grid's size (the device's SM count, cached
    per device; 4 programs under the interpreter), the epilogue's rounding of the logits (0: none,
    fp32 logits; 1: fp16; 2: bf16, as cuBLAS writes them) and the device context (Triton launches
    on the current device: make it the tensors')."""
    rnd = 0 if (fp32_logits or hidden.dtype == torch.float32) else (1 if hidden.dtype == torch.float16 else 2)
    if interp:
        return 4, rnd, contextlib.nullcontext()
    idx = hidden.device.index if hidden.device.index is not None else torch.cuda.current_device()
    return sm_count(idx), rnd, torch.cuda.device(hidden.device)


def _fused_failed(flag, which, path, e):
    """A fused GEMM failed to compile or launch: never try it again in this process (``flag``), and
    say so once."""
    import warnings

    flag[0] = False
    warnings.warn(f"deepspeed_fused.linear_cross_entropy: the fused logits GEMM{which} failed "
                  f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); the per-token "
                  f"{path} now runs cuBLAS and the row kernel", RuntimeWarning, stacklevel=3)


def gemm_stats(hidden, weight, bias, target, *, temp=None, inv_temp=1.0, softcap=0.0, ignore_index=-100,
               need_ent=False, need_sumz=False, fp32_logits=False, vocab_start=0):
    """Row statistics [M, 5] (fp32, as ``stats._finalize_stats`` reads them) of the logits
    ``hidden @ weight.T (+ bias)`` from the fused GEMM (``_lce_gemm_stats_kernel``) and a merge over
    its vocabulary tiles. The logits are taken as cuBLAS would write them: rounded to the input
    dtype, unless ``fp32_logits`` (see ``single.fp32_logits``), so the statistics agree with a
    backward that recomputes them. ``weight`` may be a vocabulary shard starting at column
    ``vocab_start``: the target logit is then this shard's (0 for targets outside it), as the row
    kernel's partial statistics of a shard. None when the kernel failed (one warning; the caller
    runs cuBLAS and the row kernel instead)."""
    M, K = hidden.shape
    V = weight.shape[0]
    interp = interpreter_active()
    BM, BN, BK, group_m, stages, warps, subtile = _GEMM_STATS_CFG_INTERP if interp else _GEMM_STATS_CFG
    n_n = triton.cdiv(V, BN)
    # token chunks so the per-tile partials stay within _GEMM_STATS_PART_BYTES (one chunk up to
    # M x V = 2^33 (bf16 sizes: 8192 x 1M vocabulary) with two fields)
    nf = 2 + int(need_ent) + int(need_sumz)
    rows = max(BM, _GEMM_STATS_PART_BYTES // (n_n * 4 * nf) // BM * BM)
    rows = min(rows, M)
    f32 = dict(dtype=torch.float32, device=hidden.device)
    bufs = [torch.empty(n_n * rows, **f32) for _ in range(nf)]
    zt = torch.zeros(M, **f32)
    stats = torch.empty((M, 5), **f32)
    sms, rnd, device = _fused_launch(hidden, fp32_logits, interp)
    block = 64 if interp else 128
    if bias is not None:
        bias = bias.contiguous()  # the epilogue reads it as one contiguous row
    try:
        with device:
            w_desc = _TensorDescriptor.from_tensor(weight, [BN, BK])
            for s in range(0, M, rows):
                e = min(M, s + rows)
                n = e - s
                m, d = bufs[0][:n_n * n].view(n_n, n), bufs[1][:n_n * n].view(n_n, n)
                a = bufs[2][:n_n * n].view(n_n, n) if need_ent else m
                sz = bufs[-1][:n_n * n].view(n_n, n) if need_sumz else m
                h_desc = _TensorDescriptor.from_tensor(hidden[s:e], [BM, BK])
                _COMPILED["stats"] = _lce_gemm_stats_kernel[(min(sms, triton.cdiv(n, BM) * n_n),)](
                    h_desc, w_desc, bias if bias is not None else m, target[s:e], temp[s:e] if temp is not None else m,
                    m, d, a, sz, zt[s:e], n, V, K, ignore_index, vocab_start, float(inv_temp), float(softcap or 1.0),
                    ROUND=rnd, HAS_BIAS=bias is not None, HAS_TEMP=temp is not None, HAS_CAP=bool(softcap),
                    NEED_ENT=need_ent, NEED_SUMZ=need_sumz, SUBTILE=subtile, BM=BM, BN=BN, BK=BK, GROUP_M=group_m,
                    NUM_SMS=sms, num_stages=stages, num_warps=warps)
                _merge_tile_stats_kernel[(triton.cdiv(n, block),)](
                    m, d, a, sz, zt[s:e], stats[s:e], n_n, n, NEED_ENT=need_ent, NEED_SUMZ=need_sumz, BLOCK=block,
                    num_warps=1 if interp else 4)
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # a compile or launch failure on this GPU/Triton: fall back, once
        _fused_failed(_GEMM_STATS_OK, "", "forward", e)
        return None
    return stats


def gemm_grad(hidden, weight, bias, target, out, *, lse, g_loss, ent=None, g_ent=None, g_lse=None, temp=None,
              inv_temp=1.0, softcap=0.0, z_loss=0.0, smoothing=0.0, ignore_index=-100, vocab_start=0,
              vocab_total=None, fp32_logits=False) -> bool:
    """``out`` [M, V] (input dtype) = dL/dlogits of the vocabulary slice ``weight`` (rows from
    ``vocab_start`` of ``vocab_total``) from the fused GEMM (``_lce_gemm_grad_kernel``): what the
    cuBLAS logits GEMM and the row kernel's per-token gradient pass would write, without the
    logits in memory. ``lse``/``ent``/``g_*``: fp32 per token, as for ``_launch_rows``. False when
    the kernel failed (one warning, ``out`` not written; the caller runs cuBLAS and the row kernel)."""
    M, K = hidden.shape
    V = weight.shape[0]
    interp = interpreter_active()
    BM, BN, BK, group_m, stages, warps, subtile = _GEMM_STATS_CFG_INTERP if interp else _GEMM_GRAD_CFG
    assert g_ent is None or ent is not None, "the entropy gradient needs the forward's entropy"
    sms, rnd, device = _fused_launch(hidden, fp32_logits, interp)
    if bias is not None:
        bias = bias.contiguous()
    assert out.shape == (M, V) and out.stride(1) == 1
    try:
        with device:
            h_desc = _TensorDescriptor.from_tensor(hidden, [BM, BK])
            w_desc = _TensorDescriptor.from_tensor(weight, [BN, BK])
            # the gradient tiles stored by TMA where the output's rows allow it (16-byte aligned)
            tma_out = (_GEMM_GRAD_TMA_OUT[0] and out.data_ptr() % 16 == 0
                       and (out.stride(0) * out.element_size()) % 16 == 0)
            if not tma_out:
                subtile = 2  # a pointer store of the whole tile spills registers
            out_desc = (_TensorDescriptor(out, list(out.shape), list(out.stride()), [BM, BN // subtile])
                        if tma_out else h_desc)
            _COMPILED["grad"] = _lce_gemm_grad_kernel[(min(sms, triton.cdiv(M, BM) * triton.cdiv(V, BN)),)](
                h_desc, w_desc, bias if bias is not None else lse, target, temp if temp is not None else lse,
                lse, ent if ent is not None else lse, g_loss, g_ent if g_ent is not None else lse,
                g_lse if g_lse is not None else lse, out, out.stride(0), out_desc, M, V, K, vocab_start,
                ignore_index, float(inv_temp), float(softcap or 1.0), float(z_loss), float(smoothing),
                1.0 / float(vocab_total or V),
                ROUND=rnd, HAS_BIAS=bias is not None, HAS_TEMP=temp is not None, HAS_CAP=bool(softcap),
                HAS_GE=g_ent is not None, HAS_GS=g_lse is not None, TMA_OUT=tma_out, SUBTILE=subtile, BM=BM,
                BN=BN, BK=BK, GROUP_M=group_m, NUM_SMS=sms, num_stages=stages, num_warps=warps)
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # a compile or launch failure on this GPU/Triton: fall back, once
        _fused_failed(_GEMM_GRAD_OK, " (gradient)", "backward", e)
        return False
    return True


if HAS_TRITON:

    @triton.jit
    def _scale_unless_one_kernel(x_ptr, n, g_ptr, gate_ptr, tgt_ptr, ignore_index,
                                 GATE: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        # x *= g in place, the product in fp32 with g as given (fp32) and one rounding, unless
        # g == 1: then no program reads or writes x. g is read on the device, so the host never
        # waits for it. ROWS: program (r, j) takes block j of row r (n elements a row), left as
        # it is where the row's target is ignore_index. GATE: nothing is scaled where the flag at
        # gate_ptr is 0.
        g = tl.load(g_ptr).to(tl.float32)
        go = g != 1.0
        if GATE:
            go = go & (tl.load(gate_ptr) != 0)
        base = 0
        if ROWS:
            row = tl.program_id(0).to(tl.int64)
            go = go & (tl.load(tgt_ptr + row) != ignore_index)
            base = row * n
            blk = tl.program_id(1).to(tl.int64)
        else:
            blk = tl.program_id(0).to(tl.int64)
        if go:
            offs = blk * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            x = tl.load(x_ptr + base + offs, mask=mask, other=0.0)
            tl.store(x_ptr + base + offs, (x.to(tl.float32) * g).to(x_ptr.dtype.element_ty), mask=mask)


def _scale_masked_torch_(x, g, target=None, ignore_index=-100, gate=None):
    """:func:`_scale_unless_one_` in torch ops (an autograd op on ``g``: differentiable under
    ``create_graph``, traceable by torch.compile): the rows or tensors left alone are multiplied
    by exactly 1 (``mul_``; a 0-d ``g`` may be rounded to ``x``'s dtype first on CUDA)."""
    s = g.reshape(())
    if gate is not None:
        s = torch.where(gate, s, torch.ones_like(s))
    if target is not None:
        s = torch.where(target.reshape(-1, *([1] * (x.dim() - 1))) != ignore_index, s, torch.ones_like(s))
    return x.mul_(s)


def _scale_unless_one_(x, g, *, target=None, ignore_index=-100, gate=None):
    """``x = (x.float() * g.float()).to(x.dtype)`` in place, for the forward-formed gradients and the
    scalar upstream gradient ``g`` (almost always 1, as ``loss.backward()`` makes it): no memory
    traffic when ``g == 1``, and no host sync to find out.

    ``target`` ([x.shape[0]], the tokens of x's rows, e.g. dhidden's): rows whose target is
    ``ignore_index`` are left as formed (their exact zeros stay zeros whatever g is: no 0 * inf).
    ``gate`` (a 0-d bool tensor on x's device, e.g. "some token is labelled"): x is left as formed
    where it is False (the zeros of dweight summed over no labelled token). Where the kernel
    cannot run, :func:`_scale_masked_torch_`."""
    if (x.numel() == 0 or g.numel() != 1 or not x.is_contiguous() or x.dtype not in _KERNEL_DTYPES
            or g.device != x.device or (gate is not None and gate.device != x.device)
            or (target is not None and (target.device != x.device or target.numel() != x.shape[0]))
            or not (x.is_cuda or (interpreter_active() and x.device.type == "cpu" and x.dtype != torch.bfloat16))):
        return _scale_masked_torch_(x, g, target, ignore_index, gate)
    g1 = g.reshape(1)
    if target is not None:
        n = x[0].numel()
        block = min(4096, triton.next_power_of_2(n))
        grid = (x.shape[0], triton.cdiv(n, block))
    else:
        n = x.numel()
        block = 4096
        grid = (triton.cdiv(n, block),)
    _scale_unless_one_kernel[grid](x, n, g1, g1 if gate is None else gate.reshape(1),
                                   g1 if target is None else target.contiguous(), int(ignore_index),
                                   GATE=gate is not None, ROWS=target is not None, BLOCK=block,
                                   num_warps=(8 if block >= 2048 else 4) if x.is_cuda else 1)
    return x


def _row_config(V):
    """(BLOCK, num_warps) of the row kernel for rows of V logits."""
    if interpreter_active():
        return min(64, triton.next_power_of_2(V)), 1
    # swept on the H200 (scratch rows A/B, 2026-11-30): software-pipelined loops (num_stages 2-3)
    # and BLOCK 1024-8192 with 4-16 warps are no faster over the suite's chunk shapes
    block = min(4096, triton.next_power_of_2(V))
    return block, 8 if block >= 2048 else 4


def _launch_rows(x, target, *, temp=None, inv_temp=1.0, softcap=0.0, z_loss=0.0, smoothing=0.0,
                 ignore_index=-100, vocab_start=0, vocab_total=None, stats=None, lse=None, ent=None,
                 g_loss=None, g_ent=None, g_lse=None, per_token=False, need_ent=False, merged=None, out=None):
    """Run the row kernel over the chunk ``x`` [rows, V] (contiguous rows).

    ``stats`` given: write partial statistics there. ``g_loss`` given: write dlogits to ``out``
    (default ``x`` itself; else a ``[rows, V]`` buffer with contiguous rows, in its own dtype)
    (``per_token``: g_loss is [rows]; else a 1-element weight for valid rows), from
    ``lse`` or, with ``merged`` (the partial statistics of every vocabulary shard for these
    rows, [shards, rows, 5] fp32, rows contiguous), from the lse the kernel merges from them.
    """
    n, V = x.shape
    if n == 0:
        return
    assert x.stride(1) == 1
    out = x if out is None else out
    assert out.shape == x.shape and out.stride(1) == 1 and out.device == x.device
    dummy = torch.empty(1, dtype=torch.float32, device=x.device)
    block, warps = _row_config(V)
    grad = g_loss is not None
    merge = merged is not None
    if merge:
        assert grad and stats is None and g_ent is None and merged.dtype == torch.float32
        assert merged.shape[1:] == (n, 5) and merged.stride(1) == 5 and merged.stride(2) == 1
    _lce_rows_kernel[(n,)](
        x, x.stride(0), V, out, out.stride(0),
        target, ignore_index, vocab_start,
        temp if temp is not None else dummy, float(inv_temp), float(softcap or 1.0), float(z_loss),
        float(smoothing), 1.0 / float(vocab_total or V),
        merged if merge else (stats if stats is not None else dummy), lse if lse is not None else dummy,
        ent if ent is not None else dummy, g_loss if grad else dummy,
        g_ent if g_ent is not None else dummy, g_lse if g_lse is not None else dummy,
        merged.shape[0] if merge else 0, merged.stride(0) if merge else 0,
        HAS_TEMP=temp is not None, HAS_CAP=bool(softcap), STATS=stats is not None, GRAD=grad,
        PER_TOKEN=per_token, HAS_GE=g_ent is not None, HAS_GS=g_lse is not None,
        NEED_ENT=need_ent, NEED_SUMZ=smoothing != 0.0, MERGE=merge, BLOCK=block, num_warps=warps,
    )
