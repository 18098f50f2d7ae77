"""Factorization Memory scan: references in PyTorch and fast kernels in Triton.

For each sequence, m memory rows of width D, per token t and row i:

    h_t[i] = (1 - theta_t[i]) * h_{t-1}[i] + theta_t[i] * xbar_t
    y_t    = sum_i phi_t[i] * h_t[i] / rms(h_t[i]),      rms(v) = sqrt(mean(v^2) + eps)

theta and phi are zero outside a token's top-k rows, so one code path serves dense and sparse.

| function       | what it is                                                               |
| -------------- | ------------------------------------------------------------------------ |
| fm_scan_naive  | loop over t; the ground truth                                            |
| fm_scan_torch  | chunked parallel algorithm in plain PyTorch (autograd); the CPU path     |
| fm_scan        | the same algorithm in Triton, forward and backward                       |
| fm_step_naive  | one decode step touching only the selected rows                          |
| fm_step        | the same step in Triton                                                  |

Shapes: xbar (B,T,D); theta, phi (B,T,M); h0, hT (B,M,D) float32; y (B,T,D) in xbar's dtype.
Step: h (B,M,D) float32 updated in place, xbar (B,D), idx (B,K) int64, theta, phi (B,K), y (B,D).

The chunked algorithm (chunk of C tokens, chunk-start state H, b = within-chunk cumulative
log(1 - theta)). Row i inside a chunk is a gated linear recurrence:

    h_t[i] = e^{b_t[i]} H[i] + sum_{s<=t} L_i[t,s] xbar_s,     L_i[t,s] = e^{b_t[i]-b_s[i]} theta_s[i]

The only nonlinearity is one scalar per (t, i), the row norm, and it never needs h_t itself:

    ||h_t[i]||^2 = e^{2b_t} ||H[i]||^2 + 2 e^{b_t} (L_i (H X^T)[i])_t + (L_i G L_i^T)_tt,   G = X X^T

With q_t[i] = phi_t[i] / rms(h_t[i]) known, the output is gated linear attention:

    y = P X + (q * e^b) H,      P[t,s] = sum_i q_t[i] L_i[t,s]

and chunk-end states follow from H_next = e^{b_C} H + sum_s e^{b_C - b_s} theta_s xbar_s.
"""

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # the PyTorch references work without Triton
    triton = None

LOG_DECAY_FLOOR = -80.0  # log(1 - theta) at theta = 1 and at document starts: e^-80 = 1.8e-35 leaks nothing
# measurable, but every document start in a chunk adds -80 to its cumulative log-decay, which costs float32
# precision in the relative decays (about 3e-5 relative error with 40 boundaries in one chunk, 1e-6 with 1)
CHUNK = 64  # tokens per chunk in the Triton scan


# ----------------------------------------------------------------------------- references


def fm_scan_naive(xbar, theta, phi, h0=None, eps=1e-6):
    """Loop over t: the ground truth. Computes in float64 for float64 inputs, else float32."""
    B, T, D = xbar.shape
    M = theta.shape[-1]
    dtype = torch.promote_types(xbar.dtype, torch.float32)
    h = xbar.new_zeros(B, M, D, dtype=dtype) if h0 is None else h0.to(dtype)
    ys = []
    for t in range(T):
        write = theta[:, t, :, None].to(dtype)  # (B, M, 1)
        h = (1 - write) * h + write * xbar[:, t, None, :].to(dtype)  # (B, M, D)
        rms = torch.sqrt(h.pow(2).mean(-1) + eps)  # (B, M)
        ys.append(((phi[:, t].to(dtype) / rms)[..., None] * h).sum(1))  # (B, D)
    return torch.stack(ys, 1).to(xbar.dtype), h


def fm_step_naive(h, xbar, idx, theta, phi, eps=1e-6):
    """One decode step: reads and updates only rows idx of h (in place); returns y (B, D)."""
    D = h.shape[-1]
    rows_idx = idx[..., None].expand(-1, -1, D)  # (B, K, D)
    write = theta[..., None].to(h.dtype)  # (B, K, 1)
    rows = (1 - write) * h.gather(1, rows_idx) + write * xbar[:, None, :].to(h.dtype)  # (B, K, D)
    h.scatter_(1, rows_idx, rows)
    rms = torch.sqrt(rows.pow(2).mean(-1) + eps)  # (B, K)
    return ((phi.to(h.dtype) / rms)[..., None] * rows).sum(1).to(xbar.dtype)


def _pad_time(x, multiple):
    pad = (-x.shape[1]) % multiple
    return F.pad(x, (0, 0, 0, pad)) if pad else x


def _log_decay(theta):
    """log(1 - theta), LOG_DECAY_FLOOR at theta = 1 (whose gradient then omits the decay term)."""
    below_one = theta < 1
    return torch.where(below_one, torch.log1p(-torch.where(below_one, theta, 0)), LOG_DECAY_FLOOR)


def _chunk_cumsum(log_decay, chunk):
    """Within-chunk inclusive cumsum of the log-decays (B, Tp, M): b (B, NC, C, M)."""
    B, Tp, M = log_decay.shape
    return log_decay.view(B, Tp // chunk, chunk, M).cumsum(2)


def fm_scan_torch(xbar, theta, phi, h0=None, eps=1e-6, chunk_size=64):
    """Chunked parallel FM scan in plain PyTorch (see the module docstring); differentiable."""
    B, T, D = xbar.shape
    M = theta.shape[-1]
    C = chunk_size
    dtype = torch.promote_types(xbar.dtype, torch.float32)
    x = _pad_time(xbar.to(dtype), C)  # padded steps have theta = phi = 0: no write, no read
    NC = x.shape[1] // C
    x = x.view(B, NC, C, D)
    th = _pad_time(theta.to(dtype), C)
    ph = _pad_time(phi.to(dtype), C).view(B, NC, C, M)
    b = _chunk_cumsum(_log_decay(th), C).transpose(-1, -2)  # (B, NC, M, C)
    th = th.view(B, NC, C, M).transpose(-1, -2)  # (B, NC, M, C)

    causal = torch.ones(C, C, dtype=torch.bool, device=x.device).tril()
    rel = (b[..., :, None] - b[..., None, :]).masked_fill(~causal, float("-inf"))  # (B, NC, M, C, C)
    L = rel.exp() * th[..., None, :]  # (B, NC, M, C, C): L[i, t, s]

    chunk_write = torch.einsum("bnis,bnsd->bnid", L[..., -1, :], x)  # (B, NC, M, D)
    chunk_decay = b[..., -1].exp()[..., None]  # (B, NC, M, 1)
    H = x.new_zeros(B, M, D) if h0 is None else h0.to(dtype)
    starts = []
    for n in range(NC):
        starts.append(H)
        H = chunk_decay[:, n] * H + chunk_write[:, n]
    Hs = torch.stack(starts, 1)  # (B, NC, M, D) chunk-start states

    gram = x @ x.transpose(-1, -2)  # (B, NC, C, C)
    HX = Hs @ x.transpose(-1, -2)  # (B, NC, M, C)
    eb = b.exp()  # (B, NC, M, C)
    quad = ((L @ gram[:, :, None]) * L).sum(-1)  # (B, NC, M, C)
    cross = (L * HX[..., None, :]).sum(-1)  # (B, NC, M, C)
    sq_norm = eb**2 * Hs.pow(2).sum(-1, keepdim=True) + 2 * eb * cross + quad
    rms = torch.sqrt(sq_norm.clamp(min=0) / D + eps)  # (B, NC, M, C)
    q = ph.transpose(-1, -2) / rms  # (B, NC, M, C)

    P = torch.einsum("bnit,bnits->bnts", q, L)  # (B, NC, C, C)
    y = P @ x + (q * eb).transpose(-1, -2) @ Hs  # (B, NC, C, D)
    return y.reshape(B, NC * C, D)[:, :T].to(xbar.dtype), H


# ----------------------------------------------------------------------------- Triton kernels
#
# Forward:  _chunk_write_kernel   per (chunk, batch, D block): a chunk's own write to its end state
#           _chunk_scan_kernel    per (batch, state block): sequential over chunks, chunk-start states
#           _chunk_out_kernel     per (chunk, batch): row norms through the Gram expansion, then y
# Backward: _chunk_dstate_kernel  per (chunk, batch): dq, c, and the chunk's gradient to its start state
#           _chunk_scan_kernel    reversed: gradient at every chunk end
#           _chunk_dinput_kernel  per (chunk, batch): dxbar and dk (gradient wrt theta as a key)
# The gradient wrt the log-decays follows from an identity (see _FMScan.backward), in PyTorch.
#
# All tensors the kernels read besides xbar/dy are float32 and padded in time to a multiple of CHUNK:
# theta, phi, b (within-chunk cumulative log-decay), r (row rms), all (B, Tp, M); states (B, NC, M, D).

if triton is not None:

    @triton.jit
    def _mm(a, b, precision: tl.constexpr):
        """Matrix product with float32 accumulation ('tf32x3' keeps float32 inputs near float32 accuracy)."""
        return tl.dot(a, b, input_precision=precision)

    @triton.jit
    def _load_cols(row_ptrs, rows_ok, offs_d, D):
        """Columns offs_d of the rows at row_ptrs (R,) as a float32 (R, BD) tile, zeros where masked."""
        mask = rows_ok[:, None] & (offs_d < D)[None, :]
        return tl.load(row_ptrs[:, None] + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _decay_matrix(b_t, causal):
        """E[t, s] = exp(b_t - b_s) for s <= t, else 0.  (C, C)"""
        diff = tl.minimum(b_t[:, None] - b_t[None, :], 0.0)
        return tl.where(causal, tl.exp(diff), 0.0)

    @triton.jit
    def _chunk_write_kernel(x_ptr, theta_ptr, b_ptr, s_ptr, T, Tp, D, M, NC,
                            C: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, PRECISION: tl.constexpr):
        n, bi, pd = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_t = tl.arange(0, C)
        offs_m = tl.arange(0, BM)
        offs_d = pd * BD + tl.arange(0, BD)
        t_abs = n * C + offs_t
        m_ok = offs_m < M
        tm_ptr = bi * Tp * M + t_abs[:, None] * M + offs_m[None, :]
        theta = tl.load(theta_ptr + tm_ptr, mask=m_ok[None, :], other=0.0)  # (C, BM)
        b = tl.load(b_ptr + tm_ptr, mask=m_ok[None, :], other=0.0)
        b_end = tl.load(b_ptr + bi * Tp * M + (n * C + C - 1) * M + offs_m, mask=m_ok, other=0.0)  # (BM,)
        k_end = theta * tl.exp(b_end[None, :] - b)  # (C, BM): e^{b_C - b_s} theta_s
        x_mask = (t_abs < T)[:, None] & (offs_d < D)[None, :]
        x = tl.load(x_ptr + bi * T * D + t_abs[:, None] * D + offs_d[None, :], mask=x_mask, other=0.0)
        write = _mm(tl.trans(k_end), x.to(tl.float32), PRECISION)  # (BM, BD)
        s_mask = m_ok[:, None] & (offs_d < D)[None, :]
        tl.store(s_ptr + ((bi * NC + n) * M + offs_m[:, None]) * D + offs_d[None, :], write, mask=s_mask)

    @triton.jit
    def _chunk_scan_kernel(s_ptr, b_ptr, init_ptr, final_ptr, Tp, D, M, NC,
                           C: tl.constexpr, BLOCK: tl.constexpr, HAS_INIT: tl.constexpr,
                           REVERSE: tl.constexpr):
        """states[n] <- carry; carry <- e^{b_end[n]} * carry + states[n], over n (in place)."""
        bi, pe = tl.program_id(0), tl.program_id(1)
        offs = pe * BLOCK + tl.arange(0, BLOCK)
        ok = offs < M * D
        row = offs // D
        if HAS_INIT:
            carry = tl.load(init_ptr + bi * M * D + offs, mask=ok, other=0.0)
        else:
            carry = tl.zeros([BLOCK], dtype=tl.float32)
        n = NC - 1 if REVERSE else 0
        own = tl.load(s_ptr + (bi * NC + n) * M * D + offs, mask=ok, other=0.0)
        log_decay = tl.load(b_ptr + bi * Tp * M + (n * C + C - 1) * M + row, mask=ok, other=0.0)
        for step in range(NC):
            n = NC - 1 - step if REVERSE else step
            last = (step + 1) // NC  # 1 on the last step, which re-reads its own chunk instead
            n_next = n - 1 + last if REVERSE else n + 1 - last  # prefetch the next chunk
            own_next = tl.load(s_ptr + (bi * NC + n_next) * M * D + offs, mask=ok, other=0.0)
            log_decay_next = tl.load(b_ptr + bi * Tp * M + (n_next * C + C - 1) * M + row, mask=ok, other=0.0)
            tl.store(s_ptr + (bi * NC + n) * M * D + offs, carry, mask=ok)
            carry = tl.exp(log_decay) * carry + own
            own, log_decay = own_next, log_decay_next
        tl.store(final_ptr + bi * M * D + offs, carry, mask=ok)

    @triton.jit
    def _chunk_out_kernel(x_ptr, theta_ptr, phi_ptr, b_ptr, hs_ptr, hx_ptr, hsq_ptr, r_ptr, y_ptr, eps,
                          T, Tp, D, M, NC,
                          C: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, PRECISION: tl.constexpr):
        n, bi = tl.program_id(0), tl.program_id(1)
        offs_t = tl.arange(0, C)
        offs_m = tl.arange(0, BM)
        t_abs = n * C + offs_t
        t_ok = t_abs < T
        m_ok = offs_m < M
        x_rows = x_ptr + bi * T * D + t_abs * D  # (C,) row pointers
        h_rows = hs_ptr + (bi * NC + n) * M * D + offs_m * D  # (BM,)

        gram = tl.zeros([C, C], dtype=tl.float32)  # X X^T
        hx = tl.zeros([BM, C], dtype=tl.float32)  # H X^T
        h_sq = tl.zeros([BM], dtype=tl.float32)  # ||H_i||^2
        for d0 in range(0, D, BD):
            offs_d = d0 + tl.arange(0, BD)
            x = _load_cols(x_rows, t_ok, offs_d, D)
            h = _load_cols(h_rows, m_ok, offs_d, D)
            gram += _mm(x, tl.trans(x), PRECISION)
            hx += _mm(h, tl.trans(x), PRECISION)
            h_sq += tl.sum(h * h, axis=1)
        chunk = bi * NC + n  # rows of hx / h_sq are read back one at a time below
        tl.store(hx_ptr + chunk * BM * C + offs_m[:, None] * C + offs_t[None, :], hx)
        tl.store(hsq_ptr + chunk * BM + offs_m, h_sq)
        tl.debug_barrier()

        causal = offs_t[:, None] >= offs_t[None, :]
        P = tl.zeros([C, C], dtype=tl.float32)
        tm_row = bi * Tp * M + t_abs * M  # (C,) offsets of (t, row 0)
        for i in range(M):
            b_i = tl.load(b_ptr + tm_row + i)  # (C,)
            L = _decay_matrix(b_i, causal) * tl.load(theta_ptr + tm_row + i)[None, :]  # (C, C)
            quad = tl.sum(_mm(L, gram, PRECISION) * L, axis=1)
            cross = tl.sum(L * tl.load(hx_ptr + (chunk * BM + i) * C + offs_t)[None, :], axis=1)
            eb = tl.exp(b_i)
            sq_norm = eb * eb * tl.load(hsq_ptr + chunk * BM + i) + 2.0 * eb * cross + quad
            rms = tl.sqrt(tl.maximum(sq_norm, 0.0) / D + eps)
            tl.store(r_ptr + tm_row + i, rms)
            P += (tl.load(phi_ptr + tm_row + i) / rms)[:, None] * L
        tl.debug_barrier()

        tm_ptr = tm_row[:, None] + offs_m[None, :]
        rms = tl.load(r_ptr + tm_ptr, mask=m_ok[None, :], other=1.0)  # (C, BM)
        phi = tl.load(phi_ptr + tm_ptr, mask=m_ok[None, :], other=0.0)
        b = tl.load(b_ptr + tm_ptr, mask=m_ok[None, :], other=0.0)
        q_state = phi / rms * tl.exp(b)  # (C, BM): reads of the chunk-start state
        for d0 in range(0, D, BD):
            offs_d = d0 + tl.arange(0, BD)
            x = _load_cols(x_rows, t_ok, offs_d, D)
            h = _load_cols(h_rows, m_ok, offs_d, D)
            y = _mm(P, x, PRECISION) + _mm(q_state, h, PRECISION)  # (C, BD)
            tl.store(y_ptr + bi * T * D + t_abs[:, None] * D + offs_d[None, :], y.to(y_ptr.dtype.element_ty),
                     mask=t_ok[:, None] & (offs_d < D)[None, :])

    @triton.jit
    def _chunk_dstate_kernel(x_ptr, dy_ptr, theta_ptr, phi_ptr, b_ptr, hs_ptr, r_ptr, dq_ptr, c_ptr, dyh_ptr,
                             j_ptr, ds_ptr, T, Tp, D, M, NC,
                             C: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, PRECISION: tl.constexpr):
        """dq = dy.h, c = dL/d||h||^2 * 2, and dS = sum_u e^{b_u} g_u with g_u = q_u dy_u + c_u h_u."""
        n, bi = tl.program_id(0), tl.program_id(1)
        offs_t = tl.arange(0, C)
        offs_m = tl.arange(0, BM)
        t_abs = n * C + offs_t
        t_ok = t_abs < T
        m_ok = offs_m < M
        x_rows = x_ptr + bi * T * D + t_abs * D  # (C,) row pointers
        dy_rows = dy_ptr + bi * T * D + t_abs * D
        h_rows = hs_ptr + (bi * NC + n) * M * D + offs_m * D  # (BM,)

        dyx = tl.zeros([C, C], dtype=tl.float32)  # dY X^T
        dyh = tl.zeros([C, BM], dtype=tl.float32)  # dY H^T
        for d0 in range(0, D, BD):
            offs_d = d0 + tl.arange(0, BD)
            x = _load_cols(x_rows, t_ok, offs_d, D)
            dy = _load_cols(dy_rows, t_ok, offs_d, D)
            h = _load_cols(h_rows, m_ok, offs_d, D)
            dyx += _mm(dy, tl.trans(x), PRECISION)
            dyh += _mm(dy, tl.trans(h), PRECISION)
        chunk = bi * NC + n  # columns of dyh are read back one at a time below
        tl.store(dyh_ptr + chunk * C * BM + offs_t[:, None] * BM + offs_m[None, :], dyh)
        tl.debug_barrier()

        causal = offs_t[:, None] >= offs_t[None, :]
        tm_row = bi * Tp * M + t_abs * M
        j_row = j_ptr + chunk * M * C
        for i in range(M):
            b_i = tl.load(b_ptr + tm_row + i)
            L = _decay_matrix(b_i, causal) * tl.load(theta_ptr + tm_row + i)[None, :]
            eb = tl.exp(b_i)
            dq = tl.sum(L * dyx, axis=1) + eb * tl.load(dyh_ptr + chunk * C * BM + offs_t * BM + i)
            rms = tl.load(r_ptr + tm_row + i)
            q = tl.load(phi_ptr + tm_row + i) / rms
            c = -dq * q / (D * rms * rms)
            tl.store(dq_ptr + tm_row + i, dq)
            tl.store(c_ptr + tm_row + i, c)
            tl.store(j_row + i * C + offs_t, tl.sum((eb * c)[:, None] * L, axis=0))  # J[i, s]
        tl.debug_barrier()

        tm_ptr = tm_row[:, None] + offs_m[None, :]
        rms = tl.load(r_ptr + tm_ptr, mask=m_ok[None, :], other=1.0)  # (C, BM)
        eb = tl.exp(tl.load(b_ptr + tm_ptr, mask=m_ok[None, :], other=0.0))
        c = tl.load(c_ptr + tm_ptr, mask=m_ok[None, :], other=0.0)
        q_state = tl.load(phi_ptr + tm_ptr, mask=m_ok[None, :], other=0.0) / rms * eb  # (C, BM)
        kappa = tl.sum(eb * eb * c, axis=0)  # (BM,)
        J = tl.load(j_row + offs_m[:, None] * C + offs_t[None, :], mask=m_ok[:, None], other=0.0)  # (BM, C)
        for d0 in range(0, D, BD):
            offs_d = d0 + tl.arange(0, BD)
            x = _load_cols(x_rows, t_ok, offs_d, D)
            dy = _load_cols(dy_rows, t_ok, offs_d, D)
            h = _load_cols(h_rows, m_ok, offs_d, D)
            ds = _mm(tl.trans(q_state), dy, PRECISION) + _mm(J, x, PRECISION) + kappa[:, None] * h
            tl.store(ds_ptr + (bi * NC + n) * M * D + offs_m[:, None] * D + offs_d[None, :], ds,
                     mask=m_ok[:, None] & (offs_d < D)[None, :])

    @triton.jit
    def _chunk_dinput_kernel(x_ptr, dy_ptr, theta_ptr, phi_ptr, b_ptr, hs_ptr, dh_ptr, r_ptr, c_ptr, hx_ptr,
                             dhx_ptr, dk_ptr, v_ptr, dx_ptr, T, Tp, D, M, NC,
                             C: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, PRECISION: tl.constexpr):
        """dh_t = sum_{u>=t} e^{b_u-b_t} g_u + e^{b_C-b_t} dH_end; dk = dh.x, dx = sum_i theta_i dh_i."""
        n, bi = tl.program_id(0), tl.program_id(1)
        offs_t = tl.arange(0, C)
        offs_m = tl.arange(0, BM)
        t_abs = n * C + offs_t
        t_ok = t_abs < T
        m_ok = offs_m < M
        x_rows = x_ptr + bi * T * D + t_abs * D  # (C,) row pointers
        dy_rows = dy_ptr + bi * T * D + t_abs * D
        h_rows = hs_ptr + (bi * NC + n) * M * D + offs_m * D  # (BM,)
        dh_rows = dh_ptr + (bi * NC + n) * M * D + offs_m * D

        gram = tl.zeros([C, C], dtype=tl.float32)  # X X^T
        xdy = tl.zeros([C, C], dtype=tl.float32)  # X dY^T
        hx = tl.zeros([BM, C], dtype=tl.float32)  # H X^T
        dhx = tl.zeros([BM, C], dtype=tl.float32)  # dH_end X^T
        for d0 in range(0, D, BD):
            offs_d = d0 + tl.arange(0, BD)
            x = _load_cols(x_rows, t_ok, offs_d, D)
            dy = _load_cols(dy_rows, t_ok, offs_d, D)
            h = _load_cols(h_rows, m_ok, offs_d, D)
            dh = _load_cols(dh_rows, m_ok, offs_d, D)
            gram += _mm(x, tl.trans(x), PRECISION)
            xdy += _mm(x, tl.trans(dy), PRECISION)
            hx += _mm(h, tl.trans(x), PRECISION)
            dhx += _mm(dh, tl.trans(x), PRECISION)
        chunk = bi * NC + n  # rows of hx / dhx are read back one at a time below
        tl.store(hx_ptr + chunk * BM * C + offs_m[:, None] * C + offs_t[None, :], hx)
        tl.store(dhx_ptr + chunk * BM * C + offs_m[:, None] * C + offs_t[None, :], dhx)
        tl.debug_barrier()

        causal = offs_t[:, None] >= offs_t[None, :]
        anti = offs_t[:, None] <= offs_t[None, :]
        tm_row = bi * Tp * M + t_abs * M
        b_end = tl.load(b_ptr + bi * Tp * M + (n * C + C - 1) * M + offs_m, mask=m_ok, other=0.0)
        W = tl.zeros([C, C], dtype=tl.float32)  # dx += W X
        PT = tl.zeros([C, C], dtype=tl.float32)  # dx += P^T dY
        for i in range(M):
            b_i = tl.load(b_ptr + tm_row + i)
            theta = tl.load(theta_ptr + tm_row + i)
            q = tl.load(phi_ptr + tm_row + i) / tl.load(r_ptr + tm_row + i)
            c = tl.load(c_ptr + tm_row + i)
            eb = tl.exp(b_i)
            L = _decay_matrix(b_i, causal) * theta[None, :]  # (C, C) [t, s]
            R = tl.where(anti, tl.exp(tl.minimum(b_i[None, :] - b_i[:, None], 0.0)), 0.0)  # [t, u]: e^{b_u-b_t}
            Rc = R * c[None, :]
            Z = _mm(Rc, L, PRECISION)  # (C, C): sum_u R[t,u] c_u L[u,s]
            Rq = R * q[None, :]
            W += theta[:, None] * Z
            PT += theta[:, None] * Rq
            v = tl.sum(Rc * eb[None, :], axis=1)  # (C,): weight of H_i in dh_t
            b_end_i = tl.load(b_ptr + bi * Tp * M + (n * C + C - 1) * M + i)
            row = (chunk * BM + i) * C + offs_t
            dk = (tl.sum(Rq * xdy, axis=1) + tl.sum(Z * gram, axis=1) + tl.load(hx_ptr + row) * v
                  + tl.exp(b_end_i - b_i) * tl.load(dhx_ptr + row))
            tl.store(dk_ptr + tm_row + i, dk)
            tl.store(v_ptr + tm_row + i, v)
        tl.debug_barrier()

        tm_ptr = tm_row[:, None] + offs_m[None, :]
        theta = tl.load(theta_ptr + tm_ptr, mask=m_ok[None, :], other=0.0)  # (C, BM)
        b = tl.load(b_ptr + tm_ptr, mask=m_ok[None, :], other=0.0)
        v_state = theta * tl.load(v_ptr + tm_ptr, mask=m_ok[None, :], other=0.0)
        v_end = theta * tl.exp(b_end[None, :] - b)
        for d0 in range(0, D, BD):
            offs_d = d0 + tl.arange(0, BD)
            x = _load_cols(x_rows, t_ok, offs_d, D)
            dy = _load_cols(dy_rows, t_ok, offs_d, D)
            h = _load_cols(h_rows, m_ok, offs_d, D)
            dh = _load_cols(dh_rows, m_ok, offs_d, D)
            dx = (_mm(PT, dy, PRECISION) + _mm(W, x, PRECISION)
                  + _mm(v_state, h, PRECISION) + _mm(v_end, dh, PRECISION))
            tl.store(dx_ptr + bi * T * D + t_abs[:, None] * D + offs_d[None, :], dx.to(dx_ptr.dtype.element_ty),
                     mask=t_ok[:, None] & (offs_d < D)[None, :])

    @triton.jit
    def _step_kernel(h_ptr, x_ptr, idx_ptr, theta_ptr, phi_ptr, y_ptr, eps, D, M, K,
                     BK: tl.constexpr, BD: tl.constexpr):
        bi = tl.program_id(0)
        offs_k = tl.arange(0, BK)
        k_ok = offs_k < K
        rows = tl.load(idx_ptr + bi * K + offs_k, mask=k_ok, other=0)
        write = tl.load(theta_ptr + bi * K + offs_k, mask=k_ok, other=0.0).to(tl.float32)[:, None]  # (BK, 1)
        row_base = h_ptr + bi * M * D + rows[:, None] * D
        sq_norm = tl.zeros([BK], dtype=tl.float32)
        for d0 in range(0, D, BD):
            offs_d = d0 + tl.arange(0, BD)
            mask = k_ok[:, None] & (offs_d < D)[None, :]
            x = tl.load(x_ptr + bi * D + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
            h = tl.load(row_base + offs_d[None, :], mask=mask, other=0.0)
            h = (1.0 - write) * h + write * x[None, :]  # (BK, BD)
            tl.store(row_base + offs_d[None, :], h, mask=mask)
            sq_norm += tl.sum(h * h, axis=1)
        tl.debug_barrier()
        phi = tl.load(phi_ptr + bi * K + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        read = phi / tl.sqrt(sq_norm / D + eps)  # (BK,)
        for d0 in range(0, D, BD):
            offs_d = d0 + tl.arange(0, BD)
            mask = k_ok[:, None] & (offs_d < D)[None, :]
            h = tl.load(row_base + offs_d[None, :], mask=mask, other=0.0)
            y = tl.sum(read[:, None] * h, axis=0)
            tl.store(y_ptr + bi * D + offs_d, y.to(y_ptr.dtype.element_ty), mask=offs_d < D)


# ----------------------------------------------------------------------------- Triton wrappers


def _precision(x):
    """tf32 matmuls for 16-bit inputs; three-pass tf32 (about float32 accuracy) for float32 inputs."""
    return "tf32x3" if x.dtype == torch.float32 else "tf32"


def _block_m(M):
    """Row tile: at least 32, since Triton 3.6 faults (illegal address) on tf32x3 products 16 wide."""
    return max(32, triton.next_power_of_2(M))


def _chunk_states(x, theta, b, h0):
    """Chunk-start states (B, NC, M, D) float32 and the final state (B, M, D)."""
    B, Tp, M = theta.shape
    D = x.shape[-1]
    NC = Tp // CHUNK
    states = x.new_empty(B, NC, M, D, dtype=torch.float32)
    BD = 64
    _chunk_write_kernel[(NC, B, triton.cdiv(D, BD))](x, theta, b, states, x.shape[1], Tp, D, M, NC, C=CHUNK,
                                                     BM=_block_m(M), BD=BD, PRECISION=_precision(x))
    final = x.new_empty(B, M, D, dtype=torch.float32)
    _scan_states(states, b, h0, final, reverse=False)
    return states, final


def _scan_states(states, b, init, final, reverse):
    """In place: states[n] (a chunk's own contribution) becomes the carry entering chunk n."""
    B, NC, M, D = states.shape
    BLOCK = 512
    _chunk_scan_kernel[(B, triton.cdiv(M * D, BLOCK))](
        states, b, init if init is not None else final, final, b.shape[1], D, M, NC,
        C=CHUNK, BLOCK=BLOCK, HAS_INIT=init is not None, REVERSE=reverse)


def _meta(x, M, num_warps, num_stages):
    """Launch settings of the per-chunk kernels (warps chosen per kernel on an H200: bench.py stages)."""
    return dict(C=CHUNK, BM=_block_m(M), BD=64, PRECISION=_precision(x), num_warps=num_warps, num_stages=num_stages)


def _chunk_out(x, theta, phi, b, states, eps):
    """Forward output y (B, T, D) and the row rms (B, Tp, M)."""
    B, T, D = x.shape
    NC, M = states.shape[1], theta.shape[-1]
    hx = theta.new_empty(B, NC, _block_m(M), CHUNK)
    h_sq = theta.new_empty(B, NC, _block_m(M))
    rms, y = torch.empty_like(theta), torch.empty_like(x)
    _chunk_out_kernel[(NC, B)](x, theta, phi, b, states, hx, h_sq, rms, y, eps, T, theta.shape[1], D, M, NC,
                               **_meta(x, M, num_warps=4, num_stages=2))
    return y, rms


def _chunk_dstate(x, dy, theta, phi, b, states, rms):
    """dq = dy . h and c = dL/d||h||^2 * 2 (B, Tp, M); each chunk's gradient to its start state."""
    B, T, D = x.shape
    NC, M = states.shape[1], theta.shape[-1]
    dq, c = torch.empty_like(theta), torch.empty_like(theta)
    dyh = theta.new_empty(B, NC, CHUNK, _block_m(M))
    J = theta.new_empty(B, NC, M, CHUNK)
    dstates = torch.empty_like(states)
    _chunk_dstate_kernel[(NC, B)](x, dy, theta, phi, b, states, rms, dq, c, dyh, J, dstates,
                                  T, theta.shape[1], D, M, NC, **_meta(x, M, num_warps=4, num_stages=1))
    return dq, c, dstates


def _chunk_dinput(x, dy, theta, phi, b, states, dstates, rms, c):
    """dxbar (B, T, D) and dk = dL/dtheta as a key (B, Tp, M)."""
    B, T, D = x.shape
    NC, M = states.shape[1], theta.shape[-1]
    hx = theta.new_empty(B, NC, _block_m(M), CHUNK)
    dhx = torch.empty_like(hx)
    dk, v, dx = torch.empty_like(theta), torch.empty_like(theta), torch.empty_like(x)
    _chunk_dinput_kernel[(NC, B)](x, dy, theta, phi, b, states, dstates, rms, c, hx, dhx, dk, v, dx,
                                  T, theta.shape[1], D, M, NC, **_meta(x, M, num_warps=8, num_stages=1))
    return dx, dk


def _prepare(theta, phi, cu_seqlens):
    """Padded float32 theta, phi and the within-chunk cumulative log-decay b, all (B, Tp, M)."""
    theta_p = _pad_time(theta.float(), CHUNK).contiguous()
    phi_p = _pad_time(phi.float(), CHUNK).contiguous()
    log_decay = _log_decay(theta_p)
    if cu_seqlens is not None:  # a document start forgets the memory
        log_decay[:, cu_seqlens[1:-1].long()] = LOG_DECAY_FLOOR
    b = _chunk_cumsum(log_decay, CHUNK).view(theta_p.shape)
    return theta_p, phi_p, log_decay, b


def _reverse_cumsum_time(v):
    """sum_{u >= t} v[:, u] for v (B, T, M), scanning along a contiguous last dim."""
    return v.transpose(1, 2).contiguous().flip(-1).cumsum(-1).flip(-1).transpose(1, 2)


class _FMScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, xbar, theta, phi, h0, eps, cu_seqlens):
        x = xbar.contiguous()
        theta_p, phi_p, log_decay, b = _prepare(theta, phi, cu_seqlens)
        states, hT = _chunk_states(x, theta_p, b, None if h0 is None else h0.float().contiguous())
        y, rms = _chunk_out(x, theta_p, phi_p, b, states, eps)
        ctx.save_for_backward(x, theta_p, phi_p, log_decay, b, states, rms, hT)
        ctx.has_h0, ctx.in_dtypes, ctx.eps = h0 is not None, (theta.dtype, phi.dtype), eps
        return y, hT

    @staticmethod
    def backward(ctx, dy, dhT):
        x, theta, phi, log_decay, b, states, rms, hT = ctx.saved_tensors
        T, D = x.shape[1:]
        dy = x.new_zeros(x.shape) if dy is None else dy.contiguous()
        dhT = hT.new_zeros(hT.shape) if dhT is None else dhT.float().contiguous()
        dq, c, dstates = _chunk_dstate(x, dy, theta, phi, b, states, rms)  # (B, Tp, M) x 2, (B, NC, M, D)
        dh0 = torch.empty_like(hT)  # (B, M, D)
        _scan_states(dstates, b, dhT, dh0, reverse=True)  # dstates now holds dL/d(chunk-end state)
        dx, dk = _chunk_dinput(x, dy, theta, phi, b, states, dstates, rms, c)  # (B, T, D), (B, Tp, M)
        # d loss / d b_t = g_t . h_t - theta_t dk_t, with g_t . h_t = q dq + c ||h||^2 (+ dhT . hT at the end);
        # b is the cumulative log-decay, so d loss / d log(1 - theta_t) = sum_{u >= t} d loss / d b_u.
        q = phi / rms
        sq_norm = D * (rms * rms - ctx.eps)
        d_b = q * dq + c * sq_norm - theta * dk  # (B, Tp, M)
        d_b[:, T - 1] += (dhT * hT).sum(-1)
        d_log_decay = _reverse_cumsum_time(d_b)
        dtheta = dk - torch.where(log_decay > LOG_DECAY_FLOOR, d_log_decay / (1 - theta), 0)
        dphi = dq / rms
        theta_dtype, phi_dtype = ctx.in_dtypes
        return (dx, dtheta[:, :T].to(theta_dtype), dphi[:, :T].to(phi_dtype),
                dh0 if ctx.has_h0 else None, None, None)


def _check_scan_args(xbar, theta, phi, h0, cu_seqlens):
    B, T, D = xbar.shape
    if theta.shape != phi.shape or theta.shape[:2] != (B, T):
        raise ValueError(f"theta {tuple(theta.shape)} and phi {tuple(phi.shape)} must both be (B, T, M) "
                         f"with (B, T) = {(B, T)} from xbar")
    if h0 is not None and h0.shape != (B, theta.shape[-1], D):
        raise ValueError(f"h0 must be (B, M, D) = {(B, theta.shape[-1], D)}, got {tuple(h0.shape)}")
    if cu_seqlens is not None and (B != 1 or h0 is not None):
        raise ValueError("cu_seqlens packs documents into one row: use batch size 1 and h0=None")
    n_chunks = -(-T // CHUNK)
    if B * n_chunks * CHUNK * max(D, theta.shape[-1]) >= 2**31 or B * n_chunks * theta.shape[-1] * D >= 2**31:
        raise ValueError(f"fm_scan indexes with 32-bit offsets: B*T*D = {B * T * D:,} and the chunk states are too "
                         f"large for one call; split the batch into calls of fewer tokens")


@torch.compiler.disable  # torch.compile runs the kernels as they are, with a graph break around them
def fm_scan(xbar, theta, phi, h0=None, eps=1e-6, cu_seqlens=None):
    """Triton FM scan (forward and backward). cu_seqlens (N+1,) int: document boundaries in a
    packed batch of one row; the memory restarts at each (see LOG_DECAY_FLOOR), and hT is the state
    after the last token."""
    _check_scan_args(xbar, theta, phi, h0, cu_seqlens)
    return _FMScan.apply(xbar, theta, phi, h0, eps, cu_seqlens)


@torch.compiler.disable
def fm_step(h, xbar, idx, theta, phi, eps=1e-6):
    """Triton decode step: loads, updates and stores only rows idx of h; returns y (B, D)."""
    B, M, D = h.shape
    K = idx.shape[1]
    if h.dtype != torch.float32 or not h.is_contiguous():
        raise ValueError("the decode state h must be a contiguous float32 tensor (B, M, D)")
    y = torch.empty_like(xbar)
    BD = min(triton.next_power_of_2(D), max(64, 8192 // triton.next_power_of_2(K)))
    _step_kernel[(B,)](h, xbar.contiguous(), idx.contiguous(), theta.contiguous(), phi.contiguous(), y, eps,
                       D, M, K, BK=max(2, triton.next_power_of_2(K)), BD=BD)
    return y
