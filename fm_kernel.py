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

import math

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # the PyTorch references work without Triton
    triton = None

LOG_DECAY_FLOOR = -80.0  # log(1 - theta) is clamped here: e^-80 is 0 to float32, and theta = 1 stays finite
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


def _chunk_log_decay(theta, chunk):
    """Within-chunk inclusive cumsum of log(1 - theta): (B, NC, C, M)."""
    B, Tp, M = theta.shape
    log_decay = torch.log1p(-theta).clamp(min=LOG_DECAY_FLOOR)
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
    b = _chunk_log_decay(th, C).transpose(-1, -2)  # (B, NC, M, C)
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
