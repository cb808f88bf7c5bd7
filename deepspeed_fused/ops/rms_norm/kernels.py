"""The RMSNorm's Triton kernels: one kernel family, kept in one file because its parts belong
together. The Llama form's forward (``_rms_fwd_kernel``), its persistent backward
(``_rms_bwd_kernel``, rows in one block) and looping backward (``_rms_bwd_loop_kernel``, wide rows),
the in-launch weight-gradient sums (``_dw_finish``, ``_dw_finish_cols``) and the separate one
(``_dw_reduce_kernel``); then the same kernels for the other forms (``_rms_fwd_form_kernel``,
``_rms_bwd_form_kernel``, ``_rms_bwd_loop_form_kernel``), which share the row addressing, the
statistics and the weight-gradient sums and add the form's rounding points as constexprs.
What the kernels compute, and why, is in ``deepspeed_fused/ops/rms_norm/__init__.py`` and
docs/rms_norm.md; the launch plans that choose among them are in ``plans.py``.
"""
from __future__ import annotations

from .._common import HAS_TRITON, tl, triton

if HAS_TRITON:
    from .._common import exp_cuda

    @triton.jit
    def _row_offsets(rows, D1, D2, S0, S1, S2):
        # Row r of the collapsed leading shape [D0, D1, D2] lives at
        # (r // (D1*D2)) * S0 + ((r // D2) % D1) * S1 + (r % D2) * S2 (element units).
        outer = rows // (D1 * D2)
        mid = (rows // D2) % D1
        inner = rows % D2
        return tl.cast(outer, tl.int64) * S0 + tl.cast(mid, tl.int64) * S1 + tl.cast(inner, tl.int64) * S2

    @triton.jit
    def _rstd(sum_sq, N, eps):
        # 1 / sqrt(mean + eps) with one rounding to FP32: computed in FP64 from the row's sum of
        # squares (per row, so it costs nothing); Triton's plain FP32 '/' is an approximate
        # division and rsqrt an approximate instruction, each worth an ULP or two.
        var = sum_sq.to(tl.float64) / N
        return (1.0 / tl.sqrt(var + eps)).to(tl.float32)

    @triton.jit
    def _rms_fwd_kernel(X, W, Y, RSTD, n_rows, N, D1, D2, S0, S1, S2, eps,
                        BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE: tl.constexpr,
                        STATS64: tl.constexpr, WRITE_RSTD: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < n_rows
        xrow = _row_offsets(rows, D1, D2, S0, S1, S2)[:, None]
        yrow = rows.to(tl.int64)[:, None] * N
        cols = tl.arange(0, BLOCK_N)
        in_ty = X.dtype.element_ty
        out_ty = Y.dtype.element_ty
        if SINGLE:
            cmask = cols < N
            m = rmask[:, None] & cmask[None, :]
            x = tl.load(X + xrow + cols[None, :], mask=m, other=0.0).to(tl.float32)
            if STATS64:
                x64 = x.to(tl.float64)
                ss = tl.sum(x64 * x64, axis=1)
            else:
                ss = tl.sum(x * x, axis=1)
            rstd = _rstd(ss, N, eps)
            w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
            xn = (x * rstd[:, None]).to(in_ty).to(tl.float32)
            tl.store(Y + yrow + cols[None, :], (w[None, :] * xn).to(out_ty), mask=m)
        else:
            acc = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float64 if STATS64 else tl.float32)
            for c0 in range(0, N, BLOCK_N):
                c = c0 + cols
                m = rmask[:, None] & (c < N)[None, :]
                x = tl.load(X + xrow + c[None, :], mask=m, other=0.0).to(acc.dtype)
                acc += x * x
            rstd = _rstd(tl.sum(acc, axis=1), N, eps)
            for c0 in range(0, N, BLOCK_N):
                c = c0 + cols
                cm = c < N
                m = rmask[:, None] & cm[None, :]
                x = tl.load(X + xrow + c[None, :], mask=m, other=0.0).to(tl.float32)
                w = tl.load(W + c, mask=cm, other=0.0).to(tl.float32)
                xn = (x * rstd[:, None]).to(in_ty).to(tl.float32)
                tl.store(Y + yrow + c[None, :], (w[None, :] * xn).to(out_ty), mask=m)
        if WRITE_RSTD:
            tl.store(RSTD + rows, rstd, mask=rmask)

    @triton.jit
    def _sum_rows(SRC, n, N, DST, RB_P: tl.constexpr, RB_N: tl.constexpr):
        # DST[c] = sum over i < n of SRC[i, c] in FP32, in a fixed order, rounded to DST's dtype.
        # Loads bypass L1: the rows were written by other programs of this launch.
        pr = tl.arange(0, RB_P)
        for c0 in range(0, N, RB_N):
            c = c0 + tl.arange(0, RB_N)
            cm = c < N
            acc = tl.zeros([RB_P, RB_N], dtype=tl.float32)
            for p0 in range(0, n, RB_P):
                p = p0 + pr
                m = (p < n)[:, None] & cm[None, :]
                acc += tl.load(SRC + p.to(tl.int64)[:, None] * N + c[None, :], mask=m, other=0.0,
                               cache_modifier=".cg")
            tl.store(DST + c, tl.sum(acc, axis=0).to(DST.dtype.element_ty), mask=cm)

    @triton.jit
    def _dw_finish(PART, CNT, DW, pid, nprog, N, GROUP: tl.constexpr, RB_P: tl.constexpr, RB_N: tl.constexpr,
                   WPR: tl.constexpr):
        # Called by every program after it stored its weight-gradient partial PART[pid, :N].
        # Two-level fixed-order sum in the same launch: the last program of each group of GROUP
        # consecutive programs sums the group's rows into PART[nprog + group]; the last group to
        # finish sums those into DW. Which program arrives last does not change any sum, so the
        # result is bitwise repeatable. Each counter is reset to zero by its last user.
        # WPR > 1: WPR consecutive programs each stored N // WPR columns of one partial row (program
        # pid the columns (pid % WPR) * (N // WPR) on of row pid // WPR); nprog and GROUP are
        # multiples of WPR, so a group's programs wrote GROUP // WPR whole rows, and its sum goes to
        # row nprog // WPR + group.
        g = pid // GROUP
        n_groups = tl.cdiv(nprog, GROUP)
        first = g * GROUP
        size = tl.minimum(nprog - first, GROUP)
        tl.debug_barrier()  # every thread's partial stored before the release below
        arrived = tl.atomic_add(CNT + g, 1, sem="acq_rel", scope="gpu")
        if arrived == size - 1:
            _sum_rows(PART + (first // WPR).to(tl.int64) * N, size // WPR, N,
                      PART + (nprog // WPR + g).to(tl.int64) * N, RB_P, RB_N)
            tl.store(CNT + g, 0)
            tl.debug_barrier()
            groups_done = tl.atomic_add(CNT + n_groups, 1, sem="acq_rel", scope="gpu")
            if groups_done == n_groups - 1:
                _sum_rows(PART + (nprog // WPR).to(tl.int64) * N, n_groups, N, DW, RB_P, RB_N)
                tl.store(CNT + n_groups, 0)

    @triton.jit
    def _dw_finish_cols(PART, CNT, DW, pid, nprog, N, SW: tl.constexpr, RB_P: tl.constexpr, WPR: tl.constexpr):
        # Called by every program after it stored its weight-gradient partial PART[pid, :N]. The
        # last n_fin = cdiv(N, SW) programs to arrive each wait until all have arrived, then each
        # sums one strip of SW columns over all nprog partial rows (fixed order: bitwise
        # repeatable whoever arrives last). Waiting cannot deadlock: a program that arrives
        # earlier exits, so the at most n_fin - 1 programs still to arrive find free slots as
        # long as n_fin programs fit on the device at once. The last finisher to leave resets
        # both counters. Under the interpreter (programs run one after another) n_fin is 1.
        # WPR > 1: WPR programs stored one partial row between them (see _dw_finish): nprog arrive,
        # nprog // WPR rows are summed.
        n_fin = tl.cdiv(N, SW)
        n_part = nprog // WPR
        tl.debug_barrier()  # every thread's partial stored before the release below
        arrived = tl.atomic_add(CNT, 1, sem="acq_rel", scope="gpu")
        j = arrived - (nprog - n_fin)
        if j >= 0:
            done = arrived + 1
            while done < nprog:
                done = tl.atomic_add(CNT, 0, sem="acquire", scope="gpu")
            c = j * SW + tl.arange(0, SW)
            cm = c < N
            pr = tl.arange(0, RB_P)
            acc = tl.zeros([RB_P, SW], dtype=tl.float32)
            for p0 in range(0, n_part, RB_P):
                p = p0 + pr
                m = (p < n_part)[:, None] & cm[None, :]
                acc += tl.load(PART + p.to(tl.int64)[:, None] * N + c[None, :], mask=m, other=0.0,
                               cache_modifier=".cg")
            tl.store(DW + c, tl.sum(acc, axis=0).to(DW.dtype.element_ty), mask=cm)
            tl.debug_barrier()
            left = tl.atomic_add(CNT + 1, 1, sem="acq_rel", scope="gpu")
            if left == n_fin - 1:
                tl.store(CNT, 0)
                tl.store(CNT + 1, 0)

    @triton.jit
    def _bwd_load_tile(DY, X, RSTD, tile, n_rows, cols, cmask,
                       XD1, XD2, XS0, XS1, XS2, GD1, GD2, GS0, GS1, GS2, BLOCK_R: tl.constexpr):
        rows = tile * BLOCK_R + tl.arange(0, BLOCK_R)
        return _bwd_load_rows(DY, X, RSTD, rows, n_rows, cols, cmask, XD1, XD2, XS0, XS1, XS2, GD1, GD2, GS0, GS1, GS2)

    @triton.jit
    def _bwd_load_rows(DY, X, RSTD, rows, n_rows, cols, cmask,
                       XD1, XD2, XS0, XS1, XS2, GD1, GD2, GS0, GS1, GS2):
        rmask = rows < n_rows  # all false past the last tile: no memory traffic
        m = rmask[:, None] & cmask[None, :]
        xoff = _row_offsets(rows, XD1, XD2, XS0, XS1, XS2)[:, None] + cols[None, :]
        goff = _row_offsets(rows, GD1, GD2, GS0, GS1, GS2)[:, None] + cols[None, :]
        x = tl.load(X + xoff, mask=m, other=0.0)
        dy = tl.load(DY + goff, mask=m, other=0.0)
        rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
        return x, dy, rstd

    @triton.jit
    def _rms_bwd_kernel(DY, X, W, RSTD, DX, PART, CNT, DW, n_rows, N, n_tiles,
                        XD1, XD2, XS0, XS1, XS2, GD1, GD2, GS0, GS1, GS2,
                        BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr,
                        GROUP: tl.constexpr, RB_P: tl.constexpr, RB_N: tl.constexpr, FINISH: tl.constexpr):
        # One persistent program: walks row tiles pid, pid + P, ...; writes dx for them and one
        # FP32 weight-gradient partial row PART[pid, :N] (the row fits one block). With PREFETCH
        # the next tile's x and dy are loaded before the current one is processed.
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        in_ty = X.dtype.element_ty
        out_ty = DY.dtype.element_ty
        cols = tl.arange(0, BLOCK_N)
        cmask = cols < N
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
        if PREFETCH:
            x_nx, dy_nx, rstd_nx = _bwd_load_tile(DY, X, RSTD, pid, n_rows, cols, cmask,
                                                  XD1, XD2, XS0, XS1, XS2, GD1, GD2, GS0, GS1, GS2, BLOCK_R)
        for tile in range(pid, n_tiles, nprog):
            if PREFETCH:
                x = x_nx.to(tl.float32)
                dy = dy_nx.to(tl.float32)
                rstd = rstd_nx
                x_nx, dy_nx, rstd_nx = _bwd_load_tile(DY, X, RSTD, tile + nprog, n_rows, cols, cmask,
                                                      XD1, XD2, XS0, XS1, XS2, GD1, GD2, GS0, GS1, GS2, BLOCK_R)
            else:
                x, dy, rstd = _bwd_load_tile(DY, X, RSTD, tile, n_rows, cols, cmask,
                                             XD1, XD2, XS0, XS1, XS2, GD1, GD2, GS0, GS1, GS2, BLOCK_R)
                x = x.to(tl.float32)
                dy = dy.to(tl.float32)
            rows = tile * BLOCK_R + tl.arange(0, BLOCK_R)
            m = (rows < n_rows)[:, None] & cmask[None, :]
            # eager: grad of the rounded normalized value = dy * w in the output dtype, then the
            # input dtype; the rest is FP32.
            g = (dy * w[None, :]).to(out_ty).to(in_ty).to(tl.float32)
            dot = tl.sum(g * x, axis=1)
            dvar = (-0.5 * dot) * (rstd * rstd * rstd)
            dx = g * rstd[:, None] + (dvar / N)[:, None] * (2.0 * x)
            tl.store(DX + rows.to(tl.int64)[:, None] * N + cols[None, :], dx.to(in_ty), mask=m)
            xn = (x * rstd[:, None]).to(in_ty).to(tl.float32)
            acc += (dy * xn).to(out_ty).to(tl.float32)
        tl.store(PART + pid.to(tl.int64) * N + cols, tl.sum(acc, axis=0), mask=cmask)
        if FINISH == 1:
            _dw_finish(PART, CNT, DW, pid, nprog, N, GROUP, RB_P, RB_N, 1)
        if FINISH == 2:
            _dw_finish_cols(PART, CNT, DW, pid, nprog, N, RB_N, RB_P, 1)

    @triton.jit
    def _rms_bwd_loop_kernel(DY, X, W, RSTD, DX, PART, CNT, DW, n_rows, N,
                             XD1, XD2, XS0, XS1, XS2, GD1, GD2, GS0, GS1, GS2,
                             BLOCK_N: tl.constexpr, GROUP: tl.constexpr, RB_P: tl.constexpr,
                             RB_N: tl.constexpr, FINISH: tl.constexpr):
        # Wide rows: one row at a time, two passes over column blocks (the row sum, then dx);
        # the weight-gradient partial accumulates in this program's own row PART[pid, :] (its
        # first row stores, later rows add; only this program touches the row, so no atomics).
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        in_ty = X.dtype.element_ty
        out_ty = DY.dtype.element_ty
        cols = tl.arange(0, BLOCK_N)
        prow = PART + pid.to(tl.int64) * N
        for row in range(pid, n_rows, nprog):
            xb = X + _row_offsets(row, XD1, XD2, XS0, XS1, XS2)
            gb = DY + _row_offsets(row, GD1, GD2, GS0, GS1, GS2)
            rstd = tl.load(RSTD + row)
            dacc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for c0 in range(0, N, BLOCK_N):
                c = c0 + cols
                cm = c < N
                x = tl.load(xb + c, mask=cm, other=0.0).to(tl.float32)
                dy = tl.load(gb + c, mask=cm, other=0.0).to(tl.float32)
                w = tl.load(W + c, mask=cm, other=0.0).to(tl.float32)
                g = (dy * w).to(out_ty).to(in_ty).to(tl.float32)
                dacc += g * x
            dvar = (-0.5 * tl.sum(dacc, axis=0)) * (rstd * rstd * rstd)
            for c0 in range(0, N, BLOCK_N):
                c = c0 + cols
                cm = c < N
                x = tl.load(xb + c, mask=cm, other=0.0).to(tl.float32)
                dy = tl.load(gb + c, mask=cm, other=0.0).to(tl.float32)
                w = tl.load(W + c, mask=cm, other=0.0).to(tl.float32)
                g = (dy * w).to(out_ty).to(in_ty).to(tl.float32)
                dx = g * rstd + (dvar / N) * (2.0 * x)
                tl.store(DX + tl.cast(row, tl.int64) * N + c, dx.to(in_ty), mask=cm)
                xn = (x * rstd).to(in_ty).to(tl.float32)
                p = tl.where(row > pid, tl.load(prow + c, mask=cm, other=0.0), 0.0)
                tl.store(prow + c, p + (dy * xn).to(out_ty).to(tl.float32), mask=cm)
        if FINISH == 1:
            _dw_finish(PART, CNT, DW, pid, nprog, N, GROUP, RB_P, RB_N, 1)
        if FINISH == 2:
            _dw_finish_cols(PART, CNT, DW, pid, nprog, N, RB_N, RB_P, 1)

    @triton.jit
    def _dw_reduce_kernel(PART, DW, P, N, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, WPR: tl.constexpr):
        # The weight-gradient sum as its own launch (wide sums, where one program's tail would
        # be latency-bound): dW[c] = sum over programs p of PART[p, c], in a fixed order, rounded
        # to the weight dtype, column strips in parallel. WPR > 1: the P programs stored one
        # partial row per WPR of them (see _dw_finish): P // WPR rows.
        P = P // WPR
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
        for p0 in range(0, P, BLOCK_P):
            p = p0 + tl.arange(0, BLOCK_P)
            m = (p < P)[:, None] & cmask[None, :]
            acc += tl.load(PART + p.to(tl.int64)[:, None] * N + cols[None, :], mask=m, other=0.0)
        tl.store(DW + cols, tl.sum(acc, axis=0).to(DW.dtype.element_ty), mask=cmask)

    # ---- the other forms (see RMSForm): one kernel family, the form's rounding points as constexprs.
    # Codes of a rounding (NRND: the normalized value; PRND: the weight product; QRND: the value the
    # output is cast from): 0 stays FP32, 1 the input's dtype, 2 the weight's dtype. WMODE: 0 no
    # weight, 1 the weight, 2 1 + w in FP32, 3 1 + w rounded to the weight's dtype. GATE: 0 none, 1
    # times act(gate) after the weight, 2 times act(gate) before the statistics. ACT: 0 SiLU, 1 sigmoid.
    # RSTD_RND: rstd rounded to the input dtype and multiplied in it (no weight, DeepSeek-V4's
    # unweighted norm).
    @triton.jit
    def _rnd(v, CODE: tl.constexpr, X, W):
        if CODE == 1:
            v = v.to(X.dtype.element_ty).to(tl.float32)
        elif CODE == 2:
            v = v.to(W.dtype.element_ty).to(tl.float32)
        return v

    @triton.jit
    def _act_of(g, e, ACT: tl.constexpr):
        # eager's FP32 activation from e = 1 + exp(-g): silu(g) = g / e, sigmoid(g) = 1 / e
        if ACT == 0:
            s = tl.div_rn(g, e)
        else:
            s = tl.div_rn(tl.zeros_like(g) + 1.0, e)
        return s

    @triton.jit
    def _act(g, ACT: tl.constexpr):
        return _act_of(g, 1.0 + tl.exp(-g), ACT)

    @triton.jit
    def _act_out(g, ACT: tl.constexpr):
        # the activation the forward multiplies its output by (gate after the weight) just before
        # that output is rounded: the division need not be correctly rounded there (a 2-ULP FP32
        # quotient moves the half-precision output no more than eager CUDA's own exp does, and the
        # correctly rounded one cost 12-19% of the narrow-row forward's device time on the H200); the statistics' and the
        # backward's activation stay correctly rounded (_act)
        e = 1.0 + tl.exp(-g)
        if ACT == 0:
            s = g / e
        else:
            s = 1.0 / e
        return s

    @triton.jit
    def _act_acc(g, ACT: tl.constexpr):
        # _act with CUDA's expf: the backward's activation (its half-precision roundings of
        # dy * act(gate) then land where eager's do)
        return _act_of(g, 1.0 + exp_cuda(-g), ACT)

    @triton.jit
    def _act_bwd(ds, g, ACT: tl.constexpr):
        # eager's activation backward: silu: ds * sig * (1 + g * (1 - sig)); sigmoid: ds * (1 - sig) * sig
        sig = tl.div_rn(tl.zeros_like(g) + 1.0, 1.0 + exp_cuda(-g))
        if ACT == 0:
            d = ds * sig * (1.0 + g * (1.0 - sig))
        else:
            d = ds * (1.0 - sig) * sig
        return d

    @triton.jit
    def _wfac(w, WMODE: tl.constexpr, X, W):
        # the factor the normalized value is multiplied by (w already FP32)
        if WMODE == 2:
            w = 1.0 + w
        elif WMODE == 3:
            w = _rnd(1.0 + w, 2, X, W)
        return w

    @triton.jit
    def _form_out(h, g, rstd, a, X, W, NRND: tl.constexpr, WMODE: tl.constexpr, PRND: tl.constexpr,
                  GATE: tl.constexpr, ACT: tl.constexpr, RSTD_RND: tl.constexpr):
        # the forward's value before its final cast to the output dtype (h: the FP32 input, gated
        # for GATE 2; rstd, a: broadcast to h's shape or scalars)
        if RSTD_RND:
            n = h * rstd.to(X.dtype.element_ty).to(tl.float32)
        else:
            n = _rnd(h * rstd, NRND, X, W)
        if WMODE != 0:
            n = _rnd(a * n, PRND, X, W)
        if GATE == 1:
            n = n * _act_out(g, ACT)
        return n

    @triton.jit
    def _form_grads(x, g, dy, rstd, a, X, W, NRND: tl.constexpr, WMODE: tl.constexpr, PRND: tl.constexpr,
                    QRND: tl.constexpr, GATE: tl.constexpr, ACT: tl.constexpr):
        # eager autograd's chain down to the normalized value: (h, gradient of the FP32 normalized
        # value, the weight-gradient term, the gate's gradient (GATE 1) or act(gate) (GATE 2))
        if GATE == 2:
            s = _act(g, ACT)
            h = x * s
        else:
            s = x
            h = x
        nr = _rnd(h * rstd, NRND, X, W)
        dp = _rnd(dy, QRND, X, W)
        if GATE == 1:
            if WMODE != 0:
                p = _rnd(a * nr, PRND, X, W)
            else:
                p = nr
            s = _act_bwd(dp * p, g, ACT)
            dp = _rnd(dp * _act_acc(g, ACT), PRND, X, W)
        if WMODE != 0:
            gn = _rnd(_rnd(dp * a, PRND, X, W), NRND, X, W)
            term = _rnd(dp * nr, PRND, X, W)
        else:
            gn = dp
            term = dp
        return h, gn, term, s

    @triton.jit
    def _form_dx(x, g, h, gn, s, rstd, dvar, N, GATE: tl.constexpr, ACT: tl.constexpr):
        # (dx in FP32, the gate's gradient for GATE 2) from the gradient of the normalized value
        dh = gn * rstd + (dvar / N) * (2.0 * h)
        if GATE == 2:
            dg = _act_bwd(dh * x, g, ACT)
            dh = dh * s
        else:
            dg = dh
        return dh, dg

    @triton.jit
    def _rms_fwd_form_kernel(X, W, Y, RSTD, G, n_rows, N, D1, D2, S0, S1, S2, eps,
                             BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE: tl.constexpr,
                             STATS64: tl.constexpr, WRITE_RSTD: tl.constexpr, NRND: tl.constexpr,
                             WMODE: tl.constexpr, PRND: tl.constexpr, GATE: tl.constexpr, ACT: tl.constexpr,
                             RSTD_RND: tl.constexpr, WG: tl.constexpr):
        # _rms_fwd_kernel for the other forms; the gate (if any) is contiguous like Y. WG > 1:
        # grouped statistics, each row one group of a wider row whose weight spans WG groups (row r
        # takes weight row r % WG, of N elements)
        pid = tl.program_id(0)
        rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < n_rows
        xrow = _row_offsets(rows, D1, D2, S0, S1, S2)[:, None]
        yrow = rows.to(tl.int64)[:, None] * N
        cols = tl.arange(0, BLOCK_N)
        out_ty = Y.dtype.element_ty
        if SINGLE:
            cmask = cols < N
            m = rmask[:, None] & cmask[None, :]
            h = tl.load(X + xrow + cols[None, :], mask=m, other=0.0).to(tl.float32)
            g = h
            if GATE != 0:
                g = tl.load(G + yrow + cols[None, :], mask=m, other=0.0).to(tl.float32)
            if GATE == 2:
                h = h * _act(g, ACT)
            if STATS64:
                h64 = h.to(tl.float64)
                ss = tl.sum(h64 * h64, axis=1)
            else:
                ss = tl.sum(h * h, axis=1)
            rstd = _rstd(ss, N, eps)
            a = rstd
            if WMODE != 0:
                if WG > 1:
                    wrow = (rows % WG).to(tl.int64)[:, None] * N
                    a = _wfac(tl.load(W + wrow + cols[None, :], mask=m, other=0.0).to(tl.float32), WMODE, X, W)
                else:
                    a = _wfac(tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32), WMODE, X, W)[None, :]
            y = _form_out(h, g, rstd[:, None], a, X, W, NRND, WMODE, PRND, GATE, ACT, RSTD_RND)
            tl.store(Y + yrow + cols[None, :], y.to(out_ty), mask=m)
        else:
            acc = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float64 if STATS64 else tl.float32)
            for c0 in range(0, N, BLOCK_N):
                c = c0 + cols
                m = rmask[:, None] & (c < N)[None, :]
                h = tl.load(X + xrow + c[None, :], mask=m, other=0.0).to(tl.float32)
                if GATE == 2:
                    h = h * _act(tl.load(G + yrow + c[None, :], mask=m, other=0.0).to(tl.float32), ACT)
                h = h.to(acc.dtype)
                acc += h * h
            rstd = _rstd(tl.sum(acc, axis=1), N, eps)
            for c0 in range(0, N, BLOCK_N):
                c = c0 + cols
                cm = c < N
                m = rmask[:, None] & cm[None, :]
                h = tl.load(X + xrow + c[None, :], mask=m, other=0.0).to(tl.float32)
                g = h
                if GATE != 0:
                    g = tl.load(G + yrow + c[None, :], mask=m, other=0.0).to(tl.float32)
                if GATE == 2:
                    h = h * _act(g, ACT)
                a = rstd
                if WMODE != 0:
                    if WG > 1:
                        wrow = (rows % WG).to(tl.int64)[:, None] * N
                        a = _wfac(tl.load(W + wrow + c[None, :], mask=m, other=0.0).to(tl.float32), WMODE, X, W)
                    else:
                        a = _wfac(tl.load(W + c, mask=cm, other=0.0).to(tl.float32), WMODE, X, W)[None, :]
                y = _form_out(h, g, rstd[:, None], a, X, W, NRND, WMODE, PRND, GATE, ACT, RSTD_RND)
                tl.store(Y + yrow + c[None, :], y.to(out_ty), mask=m)
        if WRITE_RSTD:
            tl.store(RSTD + rows, rstd, mask=rmask)

    @triton.jit
    def _bwd_tile_rows(tile, q, BLOCK_R: tl.constexpr, WG: tl.constexpr, WROW: tl.constexpr):
        # the rows of a persistent backward tile: BLOCK_R consecutive rows; with WROW (grouped
        # statistics, one weight row q per program) the rows t * WG + q of BLOCK_R consecutive t
        rows = tile * BLOCK_R + tl.arange(0, BLOCK_R)
        if WG > 1 and WROW:
            rows = rows * WG + q
        return rows

    @triton.jit
    def _bwd_form_load_tile(DY, X, G, RSTD, tile, q, n_rows, N, cols, cmask,
                            XD1, XD2, XS0, XS1, XS2, GD1, GD2, GS0, GS1, GS2,
                            BLOCK_R: tl.constexpr, GATE: tl.constexpr, WG: tl.constexpr, WROW: tl.constexpr):
        rows = _bwd_tile_rows(tile, q, BLOCK_R, WG, WROW)
        rmask = rows < n_rows
        m = rmask[:, None] & cmask[None, :]
        x, dy, rstd = _bwd_load_rows(DY, X, RSTD, rows, n_rows, cols, cmask,
                                     XD1, XD2, XS0, XS1, XS2, GD1, GD2, GS0, GS1, GS2)
        g = x
        if GATE != 0:
            g = tl.load(G + rows.to(tl.int64)[:, None] * N + cols[None, :], mask=m, other=0.0)
        return x, dy, g, rstd

    @triton.jit
    def _rms_bwd_form_kernel(DY, X, W, RSTD, DX, PART, CNT, DW, G, DG, n_rows, N, n_tiles,
                             XD1, XD2, XS0, XS1, XS2, GD1, GD2, GS0, GS1, GS2,
                             BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr,
                             GROUP: tl.constexpr, RB_P: tl.constexpr, RB_N: tl.constexpr, FINISH: tl.constexpr,
                             NRND: tl.constexpr, WMODE: tl.constexpr, PRND: tl.constexpr, QRND: tl.constexpr,
                             GATE: tl.constexpr, ACT: tl.constexpr, RSTD_RND: tl.constexpr, WG: tl.constexpr,
                             WROW: tl.constexpr):
        # _rms_bwd_kernel for the other forms (persistent; rows fit one block); DG like DX. WG > 1:
        # grouped statistics (see _rms_fwd_form_kernel). With WROW each program takes one weight
        # row q = pid % WG (nprog a multiple of WG) and walks the rows t * WG + q only, t in tiles
        # of BLOCK_R consecutive t's (n_tiles: the tiles of one weight row), tiles pid // WG,
        # pid // WG + nprog // WG, ...: the weight factor is one row, whatever BLOCK_R (so the tile
        # and the warps can be those of an ungrouped call of width N), and the partial PART[pid]
        # has N columns: program j * WG + q stores columns q * N on of row j of the [nprog // WG,
        # WG * N] partials the sums read (WPR = WG). Without WROW BLOCK_R is a multiple of WG, so
        # row i of every tile takes weight row i % WG, and the partial PART[pid] has WG * N columns
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        in_ty = X.dtype.element_ty
        cols = tl.arange(0, BLOCK_N)
        cmask = cols < N
        q = pid % WG
        first = pid
        step = nprog
        if WG > 1 and WROW:
            first = pid // WG
            step = nprog // WG
        a = cols.to(tl.float32)[None, :]
        if WMODE != 0:
            if WG > 1 and WROW:  # this program's weight row
                a = _wfac(tl.load(W + q.to(tl.int64) * N + cols, mask=cmask, other=0.0).to(tl.float32), WMODE, X,
                          W)[None, :]
            elif WG > 1:  # the weight rows of a tile's rows (the same for every tile)
                wrow = (tl.arange(0, BLOCK_R) % WG).to(tl.int64)[:, None] * N
                a = _wfac(tl.load(W + wrow + cols[None, :], mask=cmask[None, :], other=0.0).to(tl.float32),
                          WMODE, X, W)
            else:
                a = _wfac(tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32), WMODE, X, W)[None, :]
        acc = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
        if PREFETCH:
            x_nx, dy_nx, g_nx, rstd_nx = _bwd_form_load_tile(DY, X, G, RSTD, first, q, n_rows, N, cols, cmask, XD1,
                                                              XD2, XS0, XS1, XS2, GD1, GD2, GS0, GS1, GS2, BLOCK_R,
                                                              GATE, WG, WROW)
        for tile in range(first, n_tiles, step):
            if PREFETCH:
                x = x_nx.to(tl.float32)
                dy = dy_nx.to(tl.float32)
                g = g_nx.to(tl.float32)
                rstd = rstd_nx
                x_nx, dy_nx, g_nx, rstd_nx = _bwd_form_load_tile(DY, X, G, RSTD, tile + step, q, n_rows, N, cols,
                                                                  cmask, XD1, XD2, XS0, XS1, XS2, GD1, GD2, GS0, GS1,
                                                                  GS2, BLOCK_R, GATE, WG, WROW)
            else:
                x, dy, g, rstd = _bwd_form_load_tile(DY, X, G, RSTD, tile, q, n_rows, N, cols, cmask, XD1, XD2,
                                                     XS0, XS1, XS2, GD1, GD2, GS0, GS1, GS2, BLOCK_R, GATE, WG, WROW)
                x = x.to(tl.float32)
                dy = dy.to(tl.float32)
                g = g.to(tl.float32)
            rows = _bwd_tile_rows(tile, q, BLOCK_R, WG, WROW)
            m = (rows < n_rows)[:, None] & cmask[None, :]
            orow = rows.to(tl.int64)[:, None] * N + cols[None, :]
            r2 = rstd[:, None]
            if RSTD_RND:
                # y = x * rstd.to(in): both products in the input dtype, the row sum too
                rr = rstd.to(in_ty).to(tl.float32)
                drr = tl.sum(_rnd(dy * x, 1, X, W), axis=1).to(in_ty).to(tl.float32)
                dvar = (-0.5 * drr) * (rstd * rstd * rstd)
                dx = _rnd(dy * rr[:, None], 1, X, W) + _rnd((dvar / N)[:, None] * (2.0 * x), 1, X, W)
            else:
                h, gn, term, s = _form_grads(x, g, dy, r2, a, X, W, NRND, WMODE, PRND, QRND, GATE, ACT)
                dot = tl.sum(gn * h, axis=1)
                dvar = (-0.5 * dot) * (rstd * rstd * rstd)
                dx, dg = _form_dx(x, g, h, gn, s, r2, dvar[:, None], N, GATE, ACT)
                if GATE == 1:
                    dg = s
                if GATE != 0:
                    tl.store(DG + orow, dg.to(DG.dtype.element_ty), mask=m)
                if WMODE != 0:
                    acc += term
            tl.store(DX + orow, dx.to(in_ty), mask=m)
        if WMODE != 0:
            if WG > 1 and not WROW:  # tile row i * WG + q holds weight row q's terms
                qs = tl.arange(0, WG)
                part = tl.sum(tl.reshape(acc, [BLOCK_R // WG, WG, BLOCK_N]), axis=0)
                tl.store(PART + pid.to(tl.int64) * (WG * N) + qs.to(tl.int64)[:, None] * N + cols[None, :], part,
                         mask=cmask[None, :])
            else:  # WROW: columns q * N on of partial row pid // WG, the weight-gradient sums' WG * N wide rows
                tl.store(PART + pid.to(tl.int64) * N + cols, tl.sum(acc, axis=0), mask=cmask)
            if FINISH == 1:
                _dw_finish(PART, CNT, DW, pid, nprog, WG * N, GROUP, RB_P, RB_N, WG if WROW else 1)
            if FINISH == 2:
                _dw_finish_cols(PART, CNT, DW, pid, nprog, WG * N, RB_N, RB_P, WG if WROW else 1)

    @triton.jit
    def _rms_bwd_loop_form_kernel(DY, X, W, RSTD, DX, PART, CNT, DW, G, DG, n_rows, N,
                                  XD1, XD2, XS0, XS1, XS2, GD1, GD2, GS0, GS1, GS2,
                                  BLOCK_N: tl.constexpr, GROUP: tl.constexpr, RB_P: tl.constexpr,
                                  RB_N: tl.constexpr, FINISH: tl.constexpr, NRND: tl.constexpr,
                                  WMODE: tl.constexpr, PRND: tl.constexpr, QRND: tl.constexpr,
                                  GATE: tl.constexpr, ACT: tl.constexpr, RSTD_RND: tl.constexpr, WG: tl.constexpr):
        # _rms_bwd_loop_kernel for the other forms: one row at a time, two passes over column blocks.
        # WG > 1: grouped statistics (row r takes weight row r % WG, see _rms_fwd_form_kernel); the
        # partial PART[pid] has WG * N columns, zeroed first (a program's rows need not reach every
        # weight row), and row r adds into its weight row's N columns
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        in_ty = X.dtype.element_ty
        cols = tl.arange(0, BLOCK_N)
        prow0 = PART + pid.to(tl.int64) * (WG * N)
        if WMODE != 0 and WG > 1:
            for c0 in range(0, WG * N, BLOCK_N):
                c = c0 + cols
                tl.store(prow0 + c, tl.zeros([BLOCK_N], dtype=tl.float32), mask=c < WG * N)
            tl.debug_barrier()  # the zeros stored before other threads add to them
        for row in range(pid, n_rows, nprog):
            wb = W
            prow = prow0
            if WG > 1:
                wb = W + tl.cast(row % WG, tl.int64) * N
                prow = prow0 + tl.cast(row % WG, tl.int64) * N
            xb = X + _row_offsets(row, XD1, XD2, XS0, XS1, XS2)
            gb = DY + _row_offsets(row, GD1, GD2, GS0, GS1, GS2)
            ob = tl.cast(row, tl.int64) * N
            rstd = tl.load(RSTD + row)
            dacc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for c0 in range(0, N, BLOCK_N):
                c = c0 + cols
                cm = c < N
                x = tl.load(xb + c, mask=cm, other=0.0).to(tl.float32)
                dy = tl.load(gb + c, mask=cm, other=0.0).to(tl.float32)
                if RSTD_RND:
                    dacc += _rnd(dy * x, 1, X, W)
                else:
                    g = x
                    if GATE != 0:
                        g = tl.load(G + ob + c, mask=cm, other=0.0).to(tl.float32)
                    a = x
                    if WMODE != 0:
                        a = _wfac(tl.load(wb + c, mask=cm, other=0.0).to(tl.float32), WMODE, X, W)
                    h, gn, term, s = _form_grads(x, g, dy, rstd, a, X, W, NRND, WMODE, PRND, QRND, GATE, ACT)
                    dacc += gn * h
            if RSTD_RND:
                dvar = (-0.5 * tl.sum(dacc, axis=0).to(in_ty).to(tl.float32)) * (rstd * rstd * rstd)
            else:
                dvar = (-0.5 * tl.sum(dacc, axis=0)) * (rstd * rstd * rstd)
            for c0 in range(0, N, BLOCK_N):
                c = c0 + cols
                cm = c < N
                x = tl.load(xb + c, mask=cm, other=0.0).to(tl.float32)
                dy = tl.load(gb + c, mask=cm, other=0.0).to(tl.float32)
                if RSTD_RND:
                    rr = rstd.to(in_ty).to(tl.float32)
                    dx = _rnd(dy * rr, 1, X, W) + _rnd((dvar / N) * (2.0 * x), 1, X, W)
                else:
                    g = x
                    if GATE != 0:
                        g = tl.load(G + ob + c, mask=cm, other=0.0).to(tl.float32)
                    a = x
                    if WMODE != 0:
                        a = _wfac(tl.load(wb + c, mask=cm, other=0.0).to(tl.float32), WMODE, X, W)
                    h, gn, term, s = _form_grads(x, g, dy, rstd, a, X, W, NRND, WMODE, PRND, QRND, GATE, ACT)
                    dx, dg = _form_dx(x, g, h, gn, s, rstd, dvar, N, GATE, ACT)
                    if GATE == 1:
                        dg = s
                    if GATE != 0:
                        tl.store(DG + ob + c, dg.to(DG.dtype.element_ty), mask=cm)
                    if WMODE != 0:
                        if WG > 1:
                            p = tl.load(prow + c, mask=cm, other=0.0)
                        else:
                            p = tl.where(row > pid, tl.load(prow + c, mask=cm, other=0.0), 0.0)
                        tl.store(prow + c, p + term, mask=cm)
                tl.store(DX + ob + c, dx.to(in_ty), mask=cm)
        if WMODE != 0:
            if FINISH == 1:
                _dw_finish(PART, CNT, DW, pid, nprog, WG * N, GROUP, RB_P, RB_N, 1)
            if FINISH == 2:
                _dw_finish_cols(PART, CNT, DW, pid, nprog, WG * N, RB_N, RB_P, 1)

else:  # pragma: no cover - without Triton every call runs the torch reference
    _rms_fwd_kernel = _rms_bwd_kernel = _rms_bwd_loop_kernel = _dw_reduce_kernel = None
    _rms_fwd_form_kernel = _rms_bwd_form_kernel = _rms_bwd_loop_form_kernel = None
