"""The Triton row kernel of the fused linear cross-entropy and its launch helper.

``_lce_rows_kernel`` runs one program per row of a logits chunk (written by cuBLAS, see
:mod:`.chunks`) and, in fp32, either writes the row's partial statistics (finalized and merged
by :mod:`.stats`) or overwrites the row with ``dL/dlogits``, or both in two passes over it.
:func:`_launch_rows` is the only way the other modules start it. The kernels are defined when
this module is imported, so ``TRITON_INTERPRET`` must be set before (tests/conftest.py does).
The fused GEMMs' epilogues (:mod:`.gemm_kernels`) take their logits with this module's
``_softcap``, so both agree bit for bit.

Math per token with ``s`` the raw logits, ``T`` the temperature, ``c`` the soft cap:
``z = c*tanh(s/(T c))`` (or ``s/T``), ``lse = logsumexp(z)``, ``p = softmax(z)``,
``loss = lse - (1-eps) z_t - eps mean(z) + z_loss lse^2`` (0 for ignored targets),
``entropy = lse - sum p z``. With upstream gradients ``gL`` (loss), ``gE`` (entropy),
``gS`` (lse): ``dz_j = p_j (gL (1 + 2 z_loss lse) + gS - gE (z_j - sum p z))
- gL eps/V - gL (1-eps) [j == t]``, then ``ds = dz (1 - (z/c)^2) / T``.
"""
import torch

from .._common import HAS_TRITON, next_power_of_2, interpreter_active, tl, triton


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


def _row_config(V):
    """(BLOCK, num_warps) of the row kernel for rows of V logits."""
    if interpreter_active():
        return min(64, next_power_of_2(V)), 1
    # swept on the H200 (scratch rows A/B, 2026-11-30): software-pipelined loops (num_stages 2-3)
    # and BLOCK 1024-8192 with 4-16 warps are no faster over the suite's chunk shapes
    block = min(4096, next_power_of_2(V))
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
