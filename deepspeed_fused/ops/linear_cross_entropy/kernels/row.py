"""The Triton row kernel of the fused linear cross-entropy.

``_lce_rows_kernel`` runs one program per row of a logits chunk (written by cuBLAS, see
:mod:`..chunks`) and, in fp32, either writes the row's partial statistics (finalized and merged
by :mod:`..stats`) or overwrites the row with ``dL/dlogits``, or both in two passes over it.
:func:`..launch._launch_rows` is the only way the other modules start it. The kernels are defined when
this module is imported, so ``TRITON_INTERPRET`` must be set before (tests/conftest.py does).
The fused GEMMs' epilogues (:mod:`.gemm`) take their logits with this module's
``_softcap``, so both agree bit for bit.

Math per token with ``s`` the raw logits, ``T`` the temperature, ``c`` the soft cap:
``z = c*tanh(s/(T c))`` (or ``s/T``), ``lse = logsumexp(z)``, ``p = softmax(z)``,
``loss = lse - (1-eps) z_t - eps mean(z) + z_loss lse^2`` (0 for ignored targets),
``entropy = lse - sum p z``. With upstream gradients ``gL`` (loss), ``gE`` (entropy),
``gS`` (lse): ``dz_j = p_j (gL (1 + 2 z_loss lse) + gS - gE (z_j - sum p z))
- gL eps/V - gL (1-eps) [j == t]``, then ``ds = dz (1 - (z/c)^2) / T``.
"""
import torch

from ..._common import HAS_TRITON, tl, triton


# dtypes the kernel takes (float64 runs the torch reference)
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


if HAS_TRITON:

    @triton.jit
    def _softcap(z, cap):
        # cap * tanh(z / cap); tanh via exp so it runs compiled and interpreted
        return cap - 2.0 * cap / (tl.exp(2.0 * z / cap) + 1.0)

    @triton.jit
    def _rel_exp(x, m):
        # exp(x - m) against a running max m, 1 where x equals m: an infinite max then gives
        # torch.logsumexp's +inf (not inf - inf = NaN); a NaN still gives NaN
        return tl.where(x == m, 1.0, tl.exp(x - m))

    @triton.jit
    def _rel_diff(x, m):
        # x - m, 0 where x equals m (an infinite max)
        return tl.where(x == m, 0.0, x - m)

    @triton.jit
    def _load_z(x_row, cols, mask, inv_t, cap, HAS_CAP: tl.constexpr):
        # a block of the row's logits as the loss sees them: fp32, over the temperature, soft-capped
        z = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32) * inv_t
        if HAS_CAP:
            z = _softcap(z, cap)
        return z

    @triton.jit
    def _first_max_update(z, cols, V, best, best_i, first):
        # torch.argmax's choice over the columns seen so far, one more block ``z`` (columns
        # ``cols``, those >= V set to -inf) taken in: the first NaN if any, else the first of
        # the largest values (a later block replaces the running one only when strictly larger)
        isnan = z != z
        nan_i = tl.min(tl.where(isnan, cols, V), axis=0)
        zz = tl.where(isnan, float("-inf"), z)
        bmax = tl.max(zz, axis=0)
        bi = tl.min(tl.where((zz == bmax) & (cols < V), cols, V), axis=0)
        seen_nan = best != best
        take_nan = (nan_i < V) & ~seen_nan
        take = ~seen_nan & ((bmax > best) | first)
        best_i = tl.where(take_nan, nan_i, tl.where(take, bi, best_i))
        best = tl.where(take_nan, float("nan"), tl.where(take, bmax, best))
        return best, best_i

    @triton.jit
    def _lce_rows_kernel(
        x_ptr, stride_x, V, g_ptr, stride_g,
        tgt_ptr, ignore_index, vocab_start,
        temp_ptr, inv_temp, cap, z_loss, smooth, inv_vocab_total,
        stat_ptr, lse_ptr, ent_ptr, gl_ptr, ge_ptr, gs_ptr, n_shard, shard_stride, xt_ptr, xi_ptr,
        HAS_TEMP: tl.constexpr, HAS_CAP: tl.constexpr, STATS: tl.constexpr, GRAD: tl.constexpr,
        PER_TOKEN: tl.constexpr, HAS_GE: tl.constexpr, HAS_GS: tl.constexpr,
        NEED_ENT: tl.constexpr, NEED_SUMZ: tl.constexpr, MERGE: tl.constexpr, NEED_TOP: tl.constexpr,
        NEED_SQ: tl.constexpr, BLOCK: tl.constexpr,
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
        With STATS, the forward-only extras (see :mod:`..stats`) to ``xt_ptr`` [rows, 3] fp32
        (``xi_ptr``: the same memory as int32): NEED_TOP: the row's largest logit (NaN if it has
        a NaN) at column 0 and its first index in the whole vocabulary (the first NaN's if any:
        ``torch.argmax``'s choice) as int32 at column 1; NEED_SQ: ``sum exp(2(z-m))`` at column 2.
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
            q = 0.0
            best = float("-inf")  # the largest logit so far (NaN once a NaN is seen)
            best_i = 0  # its first column
            for start in range(0, V, BLOCK):
                cols = start + offs
                mask = cols < V
                z = _load_z(x_row, cols, mask, inv_t, cap, HAS_CAP)
                if NEED_SUMZ:
                    sz += tl.sum(tl.where(mask, z, 0.0), axis=0)
                z = tl.where(mask, z, float("-inf"))
                if NEED_TOP:
                    best, best_i = _first_max_update(z, cols, V, best, best_i, start == 0)
                m_new = tl.maximum(m, tl.max(z, axis=0))
                e = _rel_exp(z, m_new)
                alpha = _rel_exp(m, m_new)
                if NEED_ENT:
                    a = alpha * (a + _rel_diff(m, m_new) * d) + tl.sum(e * tl.where(mask, z - m_new, 0.0), axis=0)
                if NEED_SQ:
                    q = q * alpha * alpha + tl.sum(e * e, axis=0)
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
            if NEED_TOP:
                tl.store(xt_ptr + row * 3, best)
                tl.store(xi_ptr + row * 3 + 1, (best_i + vocab_start).to(tl.int32))
            if NEED_SQ:
                tl.store(xt_ptr + row * 3 + 2, q)
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
                    dd = dd * _rel_exp(mm, m_new) + d_r * _rel_exp(m_r, m_new)
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
            # a +inf logit (lse +inf): eager's cross_entropy has NaN in the whole labelled row (its
            # log_softmax takes inf - inf), whatever the upstream gradient
            coef = tl.where(valid & (lse == float("inf")), float("nan"), coef)
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
                    g = p * (coef - tl.where(ge == 0.0, 0.0, ge * (z - s_pz)))  # 0: the entropy unused
                else:
                    g = p * coef
                g = g - g_smooth
                g = tl.where(in_shard & (cols == lt), g - g_tgt, g)
                if HAS_CAP:
                    th = z / cap
                    g = g * (1.0 - th * th)
                g = g * inv_t
                tl.store(g_row + cols, g.to(g_ptr.dtype.element_ty), mask=mask)
