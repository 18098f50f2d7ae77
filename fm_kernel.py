"""Factorization Memory scan: references in PyTorch and fast kernels in Triton.

For each sequence, m memory rows of width D, per token t and row i:

    h_t[i] = (1 - theta_t[i]) * h_{t-1}[i] + theta_t[i] * xbar_t
    y_t    = sum_i phi_t[i] * h_t[i] / rms(h_t[i]),
    rms(v) = sqrt(mean(v^2) + eps)

theta and phi are zero outside a token's top-k rows, so one code path
serves dense and sparse; the sparse scans take the k rows' weights alone
(idx, theta, phi (B,T,K)) and never touch the others.

The chunked algorithm (chunk of C tokens, chunk-start state H,
b = within-chunk cumulative log(1 - theta)). Row i inside a chunk is a
gated linear recurrence:

    h_t[i] = e^{b_t[i]} H[i] + sum_{s<=t} L_i[t,s] xbar_s,
    L_i[t,s] = e^{b_t[i]-b_s[i]} theta_s[i]

The only nonlinearity is one scalar per (t, i), the row norm, and it
never needs h_t itself:

    ||h_t[i]||^2 = e^{2b_t} ||H[i]||^2
                   + 2 e^{b_t} (L_i (H X^T)[i])_t
                   + (L_i G L_i^T)_tt,
    G = X X^T

With q_t[i] = phi_t[i] / rms(h_t[i]) known, the output is gated linear
attention:

    y = P X + (q * e^b) H,      P[t,s] = sum_i q_t[i] L_i[t,s]

and chunk-end states follow from
H_next = e^{b_C} H + sum_s e^{b_C - b_s} theta_s xbar_s.

| function             | what it is                                  |
| -------------------- | ------------------------------------------- |
| fm_scan_naive        | loop over t; the ground truth               |
| fm_scan_torch        | chunked parallel algorithm in plain         |
|                      | PyTorch (autograd); the CPU path            |
| fm_scan              | the same algorithm in Triton, forward and   |
|                      | backward                                    |
| fm_sparse_scan_torch | sparse FM (k rows a token) by dispatch:     |
|                      | each row a one-row scan of the tokens that  |
|                      | chose it (sparse_dispatch sorts them); the  |
|                      | CPU path                                    |
| fm_sparse_scan       | the sparse scan in Triton, forward and      |
|                      | backward: work in B*T*k*D, any m            |
| fm_step_naive        | one decode step touching only the selected  |
|                      | rows                                        |
| route_naive          | the router's rows and weights from its      |
|                      | scores (softmax, top-k, rates)              |
| conv_step_naive      | a causal depthwise convolution + SiLU for   |
|                      | one token (FM's block)                      |
| causal_conv          | the convolution of FM's block (and          |
|                      | Mamba-2's) over a sequence, in PyTorch      |
| fm_route_step_naive  | route_naive, then fm_step_naive; with FM's  |
|                      | block, conv_step_naive on xbar before and   |
|                      | the output gate y * silu(z) after           |
| fm_step              | fm_step_naive's step in Triton              |
| fm_route_step        | fm_route_step_naive in one Triton kernel    |
|                      | (the model's decoding step)                 |
| route_step_takes_over | whether fm_route_step computes what an FM  |
|                      | layer's route does                          |
| decode_product_naive | F.linear of one row: the reference          |
| decode_product       | the same in Triton (fm::decode_product)     |
| decode_linear        | decode_product for one half-precision row   |
|                      | on CUDA, else F.linear                      |
| router_linear        | the router's F.linear, one reduction in a   |
|                      | compiled decoding step                      |

Shapes: xbar (B,T,D); theta, phi (B,T,M); h0, hT (B,M,D) float32;
y (B,T,D) in xbar's dtype.
Step: h (B,M,D) float32 updated in place, xbar (B,D), idx (B,K) int64,
theta, phi (B,K), y (B,D); with the router, scores (B,M+2) float32:
W_alpha x, then the logits of eta and mu. FM's block (not in the paper):
the gate's z (B,D), the convolution's window (B,D,W-1) updated in place,
its weight (D,W) and bias (D,).

The calls, in order (grid of each kernel; NC chunks of CHUNK tokens,
columns of D split among programs). The file follows this list: each
part's references, its kernels in this order, their device helpers,
then the launch functions in this order, its custom ops and public
functions.

fm_scan_naive, fm_scan_torch
    (_ChunkDecays: the decays in a chunk and their gradient)
fm_scan, forward (fm::scan_forward)
    _prepare
        _decay_kernel           (chunk, batch)
            decays a = 1 - theta, b, each chunk's keys K
    _chunk_states
        _chunk_states_kernel    (batch, group, columns)
            chunk-start states H and hT (with several groups of
            chunks: each group's own end state,
        _chunk_scan_kernel      (batch, elements)
            a scan over the groups, then
        _chunk_states_kernel
            the states from the group starts)
    _chunk_out
        _chunk_products_kernel  (chunk, batch)
            X X^T, H X^T, ||H_i||^2
        _chunk_norms_kernel     (chunk, batch)
            row rms, q = phi / rms, P, h_t . x_t
        _chunk_y_kernel         (chunk, batch, split)
            y = P X + (q e^b) H
fm_scan, backward (fm::scan_backward)
    _chunk_grads
        _chunk_products_kernel  (chunk, batch)
            X X^T, dY X^T, H dY^T
        _chunk_grads_kernel     (chunk, batch)
            dq, c, omega, kappa, dk (less its chunk-end term), P_w
    _chunk_dstate
        _chunk_dstate_kernel    (chunk, batch, split)
            each chunk's gradient to its start state
    _scan_states
        _chunk_scan_kernel      (batch, elements)
            reversed: the gradients at the chunk ends, dh0
    _chunk_dx
        _chunk_dx_kernel        (chunk, batch, split)
            dxbar, and dH_end X^T for dk's chunk-end term
    _rate_grads
        _decay_grads_kernel     (chunk, batch)
            dk's chunk-end term, d loss / d b summed back
        _rate_grads_kernel      (chunk, batch)
            dtheta and dphi
    _forget_grads
        _forget_grads_kernel    (chunk, batch)
            dtheta's decay term where theta = 1
fm_sparse_scan_torch
    (sparse_dispatch; fm_scan_torch over each row's writers)
fm_sparse_scan, forward
    (fm::sparse_scan_forward; chunks of SPARSE_CHUNK sorted pairs)
    _sparse_layout              (PyTorch)
        the pairs sorted by (sequence, row), their flags, the
        segments that run past a chunk
    _sparse_carry_kernel        (chunk, columns)
        the states those carry into later chunks
    _sparse_out_kernel          (chunk)
        h_t, its rms, phi_t h_t / rms, hT's rows
fm_sparse_scan, backward (fm::sparse_scan_backward)
    _sparse_grads_kernel        (chunk)
        dphi, the norm's factor c, each chunk's gradient into its
        carried state
    _sparse_carry_grads_kernel  (chunk, columns)
        those added back along each segment
    _sparse_dx_kernel           (chunk)
        dxbar, dtheta, dh0
fm_step_naive
fm_route_step_naive (conv_step_naive, route_naive, fm_step_naive)
fm_step (fm::step), fm_route_step (fm::route_step)
    _step
        _step_kernel            (batch)
            the top-k of the scores (route_step), the convolution
            of xbar, the K rows' update, their norms, y and its gate
decode_product_naive
decode_product (fm::decode_product), decode_linear
    _decode_product
        _decode_product_kernel  (N / BN)
            BN outputs a program: the weight's (BN, K) slab times x
router_linear (PyTorch)
"""

from copy import deepcopy
from typing import Optional

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # the PyTorch references work without Triton
    triton = None

# log(1 - theta) at theta = 1, in the cumulative log-decays b (the
# Triton walks take the decay itself there as 0): e^-80 = 1.8e-35 leaks
# nothing measurable
LOG_DECAY_FLOOR = -80.0
# tokens per chunk in the Triton scan: a power of 2
# (tl.arange's ranges), at least 16 (tl.dot's)
CHUNK = 64
MAX_ROWS = 128  # rows fm_scan (dense) takes: at m = 256 some tiles overflow shared memory
# elements of h a one-pass decode step holds: K = 8 rows of D = 2048, 64
# a thread at 8 warps
STEP_TILE = 16384


# ----------------------------------------------------------------------------- scan: references


def fm_scan_naive(xbar, theta, phi, h0=None, eps=1e-6):
    """Loop over t: the ground truth. Computes in float64 for float64
    inputs, else float32."""
    B, T, D = xbar.shape
    M = theta.shape[-1]
    dtype = torch.promote_types(xbar.dtype, torch.float32)
    h = xbar.new_zeros(B, M, D, dtype=dtype)
    if h0 is not None:
        h = h0.to(dtype)
    ys = []
    for t in range(T):
        write = theta[:, t, :, None].to(dtype)  # (B, M, 1)
        h = (1 - write) * h + write * xbar[:, t, None, :].to(dtype)  # (B, M, D)
        rms = torch.sqrt(h.pow(2).mean(-1) + eps)  # (B, M)
        ys.append(((phi[:, t].to(dtype) / rms)[..., None] * h).sum(1))  # (B, D)
    return torch.stack(ys, 1).to(xbar.dtype), h


def _pad_time(x, multiple):
    pad = (-x.shape[1]) % multiple
    return F.pad(x, (0, 0, 0, pad)) if pad else x


def _log_decay(theta):
    """log(1 - theta), LOG_DECAY_FLOOR at theta = 1 (forward only:
    _ChunkDecays differentiates the decays)."""
    below_one = theta < 1
    return torch.where(below_one, torch.log1p(-torch.where(below_one, theta, 0)),
                       LOG_DECAY_FLOOR)


def _chunk_cumsum(log_decay, chunk):
    """Within-chunk inclusive cumsum of the log-decays (B, Tp, M): b
    (B, NC, C, M)."""
    B, Tp, M = log_decay.shape
    return log_decay.view(B, Tp // chunk, chunk, M).cumsum(2)


class _ChunkDecays(torch.autograd.Function):
    """The decays inside each chunk from theta (B, Tp, M), padded to
    whole chunks: e^{b_t} (B, NC, M, C), from the chunk start to token
    t, and e^{b_t - b_s} (B, NC, M, C, C), from token s to token t
    (0 for s > t), with b the within-chunk cumulative log(1 - theta).
    The backward differentiates the decays a = 1 - theta themselves, not
    their logs: a factor e^{b_t - b_s} with s < v <= t is e^{b_t - b_v}
    a_v e^{b_{v-1} - b_s}, so

        d loss / d a_v = sum_{t >= v} sum_{s < v} e^{b_t - b_v} G[t, s] e^{b_{v-1} - b_s},

    G the gradient of e^{b_t - b_s} (s = -1 standing for the chunk
    start, e^{b_{-1}} = 1). Nothing divides by a_v, so the gradient is
    exact where theta = 1 (a_v = 0, the row forgets), whose log-decay is
    floored."""

    @staticmethod
    def forward(ctx, theta, chunk):
        b = _chunk_cumsum(_log_decay(theta), chunk).transpose(-1, -2)  # (B, NC, M, C)
        causal = torch.ones(chunk, chunk, dtype=torch.bool, device=theta.device).tril()
        from_start = b.exp()  # (B, NC, M, C)
        # (B, NC, M, C, C)
        between = (b[..., :, None] - b[..., None, :]).masked_fill(~causal, float("-inf")).exp()
        ctx.save_for_backward(from_start, between)
        return from_start, between

    @staticmethod
    def backward(ctx, d_from_start, d_between):
        from_start, between = ctx.saved_tensors
        later = between.transpose(-1, -2)  # [v, t] = e^{b_t - b_v}
        # [v, s] = e^{b_{v-1} - b_s}, zeros at v = 0
        earlier = F.pad(between, (0, 0, 1, 0))[..., :-1, :]
        # [v] = e^{b_{v-1}}
        earlier_start = F.pad(from_start, (1, 0), value=1.0)[..., :-1]
        from_start_term = (later @ d_from_start[..., None])[..., 0] * earlier_start
        d_decay = ((later @ d_between) * earlier).sum(-1) + from_start_term
        B, NC, M, C = d_decay.shape
        return -d_decay.transpose(-1, -2).reshape(B, NC * C, M), None  # a = 1 - theta


def fm_scan_torch(xbar, theta, phi, h0=None, eps=1e-6, chunk_size=64):
    """Chunked parallel FM scan in plain PyTorch
    (see the module docstring); differentiable."""
    B, T, D = xbar.shape
    M = theta.shape[-1]
    C = chunk_size
    dtype = torch.promote_types(xbar.dtype, torch.float32)
    # padded steps have theta = phi = 0: no write, no read
    x = _pad_time(xbar.to(dtype), C)
    NC = x.shape[1] // C
    x = x.view(B, NC, C, D)
    th = _pad_time(theta.to(dtype), C)
    ph = _pad_time(phi.to(dtype), C).view(B, NC, C, M)
    # e^b (B, NC, M, C), e^{b_t - b_s} (B, NC, M, C, C)
    eb, decays = _ChunkDecays.apply(th, C)
    th = th.view(B, NC, C, M).transpose(-1, -2)  # (B, NC, M, C)
    L = decays * th[..., None, :]  # (B, NC, M, C, C): L[i, t, s]

    chunk_write = torch.einsum("bnis,bnsd->bnid", L[..., -1, :], x)  # (B, NC, M, D)
    chunk_decay = eb[..., -1:]  # (B, NC, M, 1)
    H = x.new_zeros(B, M, D)
    if h0 is not None:
        H = h0.to(dtype)
    start_states = []
    for n in range(NC):
        start_states.append(H)
        H = chunk_decay[:, n] * H + chunk_write[:, n]
    Hs = torch.stack(start_states, 1)  # (B, NC, M, D) chunk-start states

    gram = x @ x.transpose(-1, -2)  # (B, NC, C, C)
    HX = Hs @ x.transpose(-1, -2)  # (B, NC, M, C)
    quad = ((L @ gram[:, :, None]) * L).sum(-1)  # (B, NC, M, C)
    cross = (L * HX[..., None, :]).sum(-1)  # (B, NC, M, C)
    sq_norm = eb**2 * Hs.pow(2).sum(-1, keepdim=True) + 2 * eb * cross + quad
    rms = torch.sqrt(sq_norm.clamp(min=0) / D + eps)  # (B, NC, M, C)
    q = ph.transpose(-1, -2) / rms  # (B, NC, M, C)

    P = torch.einsum("bnit,bnits->bnts", q, L)  # (B, NC, C, C)
    y = P @ x + (q * eb).transpose(-1, -2) @ Hs  # (B, NC, C, D)
    return y.reshape(B, NC * C, D)[:, :T].to(xbar.dtype), H


# ---------------------------------------------------------------------------- scan: Triton kernels
#
# The per-token work of a chunk (the row norms, P, and their gradients)
# walks (rows, tokens) tiles through the chunk's C tokens, one token a
# step, with the per-row decays a_s = 1 - theta_s <= 1 (0 at theta = 1;
# stored, not formed from the log-decays step by step) as plain factors:
# no exponent of a difference of log-decays, so nothing overflows
# however fast a row decays. Two kinds of walk:
#   _walk_dots:    D[i, t] = h_s[i] . v_t for all t, from H_i . v_t, as s goes:
#                  D <- a_s D + theta_s (x_s . v_t); kept where s = t, it gives h_t[i] . x_t
#                  (for the norms) and h_t[i] . dy_t (for dq)
#   _store_reads:  W[i, s] = e^{b_t - b_s} theta_s as t goes (W <- a_t W, column t set to
#                  theta_t), and row t of a read matrix sum_i query_t[i] W[i, :]: P with
#                  q = phi / rms, P_w with omega
# plus one scan over the tokens for the squared norms (forward) and one
# for Gamma (backward).
#
# With g_u = q_u dy_u + c_u h_u the gradient reaching h_u directly, the
# norm's part of the backward reduces to Gamma_s = sum_{u>=s} c_u
# e^{2(b_u - b_s)}: sum_u L_i[u,s] c_u h_u[i] = omega_s[i] h_s[i] +
# sum_{s'>s} P_w[s', s] x_s' with omega = theta Gamma, so dxbar = P^T dY
# + (P_w + P_w^T - diag P_w) X + (omega e^b) H + K_end^T dH_end. The
# gradient wrt the log-decays follows from an identity
# (see _rate_grads); divided by a = 1 - theta it gives dtheta's decay
# term d loss / d a, except where a = 0 (theta = 1), which
# _forget_grads_kernel computes directly.
#
# All tensors the kernels read besides xbar/dy and the states are
# float32 and padded in time to a multiple of CHUNK: theta, phi, a = 1 -
# theta (the decays), b (within-chunk cumulative log-decay), r
# (row rms), q, all (B, Tp, M). The chunk-start states and their
# gradients (B, NC, M, D) are stored in bfloat16 for bfloat16 inputs
# (_start_dtype), else float32; the carries between chunks, hT and dh0
# stay float32. Products with X, dY and the states run on bfloat16
# tensor cores for bfloat16 inputs, a float32 factor split into hi + lo
# bfloat16 halves (_split: 16 bits kept, more than tf32's 11; X, dY and
# bfloat16 states are exact), except the products of y and dxbar, which
# are rounded to bfloat16 anyway and take single bfloat16 operands; for
# float32 inputs they are exact float32, for float16 tf32. The walks run
# in float32 on CUDA cores.


# -------------------------------------------------------------------- scan forward kernels: decays


if triton is not None:

    @triton.jit
    def _decay_kernel(theta_ptr, decay_ptr, b_ptr, keys_ptr, Tp, M, C: tl.constexpr,
                      BM: tl.constexpr,
                      FLOOR: tl.constexpr):
        """The decays a = e^{log(1 - theta)} (0 at theta = 1), the
        within-chunk cumulative sum b of the log-decays (FLOOR there),
        and the chunk's keys to its end state, K[i, s] = e^{b_C - b_s}
        theta_s, (BM, C) a chunk (0 on padded rows)."""
        n, bi = tl.program_id(0), tl.program_id(1)
        offs_t, offs_m, offs_tile, rows_ok = _chunk_tile(bi, n, Tp, M, C, BM)
        theta = tl.load(theta_ptr + offs_tile, mask=rows_ok, other=0.0)
        kept = tl.maximum(1.0 - theta, 1e-30)  # theta >= 1 forgets below
        # log1p(-theta) = log(kept) * -theta / (kept - 1), exact to
        # rounding where kept != 1 (Goldberg)
        denominator = tl.where(kept == 1.0, -1.0, kept - 1.0)
        log_decay = tl.where(kept == 1.0, -theta, tl.log(kept) * (-theta / denominator))
        forget = theta >= 1.0
        tl.store(decay_ptr + offs_tile, tl.where(forget, 0.0, tl.exp(log_decay)),
                 mask=rows_ok)
        log_decay = tl.where(forget, FLOOR, log_decay)
        b = tl.cumsum(log_decay, axis=0)  # (C, BM)
        tl.store(b_ptr + offs_tile, b, mask=rows_ok)
        offs_c = tl.arange(0, C)
        b_end = tl.sum(tl.where((offs_c == C - 1)[:, None], b, 0.0), axis=0)  # (BM,)
        keys = theta * tl.exp(b_end[None, :] - b)  # (C, BM), stored rows first
        tl.store(keys_ptr + (bi * (Tp // C) + n) * BM * C + offs_m[None, :] * C + offs_c[:, None],
                 keys)


# -------------------------------------------------------- scan forward kernels: chunk-start states


if triton is not None:

    @triton.jit
    def _chunk_states_kernel(x_ptr, keys_ptr, b_ptr, init_ptr, states_ptr, end_ptr, T, Tp, D, M, NC,
                             GROUP,
                             C: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr,
                             FINAL: tl.constexpr,
                             HAS_INIT: tl.constexpr, PRECISION: tl.constexpr, OP: tl.constexpr):
        """The state over chunks GROUP * g .. min(GROUP * (g + 1), NC) -
        1 of sequence bi, on BD columns: carry <- e^{b_C} carry + K X.
        The final pass starts from init (group g's start state, or h0
        for one group), stores the carry entering each chunk in states
        and, from the last group, hT; the first (several groups) starts
        from zero and stores only the group's end carry, its own
        contribution to the next group's start."""
        bi, g, column_block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_m, offs_d = tl.arange(0, BM), column_block * BD + tl.arange(0, BD)
        # (BM, BD) offsets in one (M, D) state
        offs_state = offs_m[:, None] * D + offs_d[None, :]
        state_ok = (offs_m < M)[:, None] & (offs_d < D)[None, :]
        # (BM, C) offsets in one chunk's keys
        offs_keys = offs_m[:, None] * C + tl.arange(0, C)[None, :]
        if HAS_INIT:
            carry = tl.load(init_ptr + (bi * tl.num_programs(1) + g) * M * D + offs_state,
                            mask=state_ok, other=0.0)
        else:
            carry = tl.zeros([BM, BD], dtype=tl.float32)
        # loads pipelined num_stages deep
        for n in range(g * GROUP, tl.minimum(g * GROUP + GROUP, NC)):
            k_hi, k_lo = _split(tl.load(keys_ptr + (bi * NC + n) * BM * C + offs_keys), OP)
            # (BM,)
            b_end = _boundary(b_ptr, bi * Tp * M + n * C * M, offs_m, offs_m < M, C - 1, M)
            # (C, BD)
            x = _load_cols(_token_rows(x_ptr, bi, n, T, D, C), n * C + tl.arange(0, C) < T, offs_d,
                           D)
            if FINAL:
                tl.store(states_ptr + (bi * NC + n) * M * D + offs_state,
                         carry.to(states_ptr.dtype.element_ty),
                         mask=state_ok)
            carry = tl.exp(b_end)[:, None] * carry + _mm_split(k_hi, k_lo, x.to(OP), PRECISION)
        if not FINAL:
            tl.store(end_ptr + (bi * tl.num_programs(1) + g) * M * D + offs_state, carry,
                     mask=state_ok)
        elif g == tl.num_programs(1) - 1:
            tl.store(end_ptr + bi * M * D + offs_state, carry, mask=state_ok)

    @triton.jit
    def _chunk_scan_kernel(added_ptr, out_ptr, b_ptr, init_ptr, final_ptr, Tp, D, M, NC,
                           C: tl.constexpr, BLOCK: tl.constexpr, HAS_INIT: tl.constexpr,
                           REVERSE: tl.constexpr):
        """out[n] <- carry; carry <- e^{b_end[n]} * carry + added[n],
        over n. Loads run two chunks ahead, so that a program walking
        many chunks (batch 1) does not wait on memory at each
        (docs/kernel_log.md)."""
        bi, block = tl.program_id(0), tl.program_id(1)
        offs = block * BLOCK + tl.arange(0, BLOCK)
        ok = offs < M * D
        # chunk 0
        added_ptrs, out_ptrs = (added_ptr + bi * NC * M * D + offs,
                                out_ptr + bi * NC * M * D + offs)
        # b at chunk 0's last token, on each element's row
        end_ptrs = b_ptr + bi * Tp * M + (C - 1) * M + offs // D
        if HAS_INIT:
            carry = tl.load(init_ptr + bi * M * D + offs, mask=ok, other=0.0)
        else:
            carry = tl.zeros([BLOCK], dtype=tl.float32)
        n0, n1 = _chunk_at(0, NC, REVERSE), _chunk_at(1, NC, REVERSE)
        added0, log_decay0 = tl.load(added_ptrs + n0 * M * D,
                                     mask=ok), tl.load(end_ptrs + n0 * C * M, mask=ok)
        added1, log_decay1 = tl.load(added_ptrs + n1 * M * D,
                                     mask=ok), tl.load(end_ptrs + n1 * C * M, mask=ok)
        for step in range(NC):
            n2 = _chunk_at(step + 2, NC, REVERSE)
            added2, log_decay2 = tl.load(added_ptrs + n2 * M * D,
                                         mask=ok), tl.load(end_ptrs + n2 * C * M, mask=ok)
            tl.store(out_ptrs + _chunk_at(step, NC, REVERSE) * M * D,
                     carry.to(out_ptr.dtype.element_ty), mask=ok)
            carry = tl.exp(log_decay0) * carry + added0
            added0, log_decay0, added1, log_decay1 = added1, log_decay1, added2, log_decay2
        tl.store(final_ptr + bi * M * D + offs, carry, mask=ok)


# -------------------------------------------------------------------- scan forward kernels: output


if triton is not None:

    @triton.jit
    def _chunk_products_kernel(x_ptr, dy_ptr, states_ptr, gram_ptr, h_dots_ptr, h_sq_ptr, dyx_ptr,
                               T, D, M, NC,
                               C: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr,
                               PRECISION: tl.constexpr,
                               OP: tl.constexpr, BACKWARD: tl.constexpr):
        """A chunk's inner products over D, H its start state: X X^T, H
        X^T and ||H_i||^2, or for the backward X X^T, H dY^T and dY
        X^T."""
        n, bi = tl.program_id(0), tl.program_id(1)
        offs_c = tl.arange(0, C)
        offs_m = tl.arange(0, BM)
        t_ok = n * C + offs_c < T
        m_ok = offs_m < M
        # (C,)
        x_rows, dy_rows = (_token_rows(x_ptr, bi, n, T, D, C),
                           _token_rows(dy_ptr, bi, n, T, D, C))
        h_rows = _state_rows(states_ptr, bi * NC + n, M, D, BM)  # (BM,)
        gram = tl.zeros([C, C], dtype=tl.float32)
        h_dots = tl.zeros([BM, C], dtype=tl.float32)  # H X^T, or H dY^T
        h_sq = tl.zeros([BM], dtype=tl.float32)
        dyx = tl.zeros([C, C], dtype=tl.float32)
        for d0 in range(0, D, BD):
            offs_d = d0 + tl.arange(0, BD)
            x = _load_cols(x_rows, t_ok, offs_d, D).to(OP)
            # the states' own dtype (_start_dtype)
            h = _load_cols(h_rows, m_ok, offs_d, D).to(OP)
            gram += _mm(x, tl.trans(x), PRECISION)
            if BACKWARD:
                dy = _load_cols(dy_rows, t_ok, offs_d, D).to(OP)
                dyx += _mm(dy, tl.trans(x), PRECISION)
                h_dots += _mm(h, tl.trans(dy), PRECISION)
            else:
                h_dots += _mm(h, tl.trans(x), PRECISION)
                h_sq += tl.sum(h.to(tl.float32) * h.to(tl.float32), axis=1)
        chunk = bi * NC + n
        offs_square = offs_c[:, None] * C + offs_c[None, :]
        offs_tokens_first = offs_c[None, :] * BM + offs_m[:, None]
        tl.store(gram_ptr + chunk * C * C + offs_square, gram)
        tl.store(h_dots_ptr + chunk * BM * C + offs_tokens_first, h_dots)
        if BACKWARD:
            tl.store(dyx_ptr + chunk * C * C + offs_square, dyx)
        else:
            tl.store(h_sq_ptr + chunk * BM + offs_m, h_sq)

    @triton.jit
    def _chunk_norms_kernel(theta_ptr, phi_ptr, decay_ptr, gram_ptr, h_dot_x_ptr, h_sq_ptr, q_ptr,
                            p_ptr, rms_ptr, eps,
                            Tp, D, M, NC, C: tl.constexpr, S: tl.constexpr, BM: tl.constexpr):
        """Row rms of every token of a chunk, q = phi / rms and P[t, s]
        = sum_i q_t[i] L_i[t, s]. The squared norms follow ||h_t||^2 =
        a_t^2 ||h_{t-1}||^2 + 2 theta_t h_t . x_t - theta_t^2 x_t . x_t
        (a scan over the chunk from ||H_i||^2), with h_t . x_t from the
        walk of H . x_t through the chunk's writes (_walk_dots); h_t .
        x_t replaces H . x_t in place, for the backward
        (_chunk_grads_kernel)."""
        n, bi = tl.program_id(0), tl.program_id(1)
        offs_c, offs_m = tl.arange(0, C), tl.arange(0, BM)
        m_ok = offs_m < M
        chunk = bi * NC + n
        gram_chunk = gram_ptr + chunk * C * C
        # offset of the chunk's first token in (B, Tp, M) arrays
        chunk_base = bi * Tp * M + n * C * M
        # (BM, C) H_i . x_t
        start_dot_x = _rows_first(h_dot_x_ptr + chunk * C * BM, offs_m, offs_c, BM)
        h_dot_x = _walk_dots(start_dot_x, decay_ptr, theta_ptr, gram_chunk, C, 1, chunk_base,
                             offs_m, m_ok, M, C,
                             S)  # (BM, C) h_t . x_t
        # tokens first
        tl.store(h_dot_x_ptr + chunk * C * BM + offs_c[None, :] * BM + offs_m[:, None], h_dot_x)
        theta = _tile(theta_ptr, chunk_base, offs_m, m_ok, offs_c, M)  # (BM, C)
        decay = _tile(decay_ptr, chunk_base, offs_m, m_ok, offs_c, M, 1.0)
        decay2 = decay * decay  # a_t^2
        growth = theta * (2.0 * h_dot_x - theta * tl.load(gram_chunk + offs_c * (C + 1))[None, :])
        growth += tl.where(offs_c[None, :] == 0,
                           decay2 * tl.load(h_sq_ptr + chunk * BM + offs_m)[:, None], 0.0)
        _, sq_norm = tl.associative_scan((decay2, growth), 1, _linear)
        rms = tl.sqrt(tl.maximum(sq_norm, 0.0) / D + eps)
        _store_tile(rms_ptr, chunk_base, offs_m, m_ok, offs_c, M, rms)
        phi = _tile(phi_ptr, chunk_base, offs_m, m_ok, offs_c, M)
        _store_tile(q_ptr, chunk_base, offs_m, m_ok, offs_c, M, phi / rms)
        tl.debug_barrier()  # the rows of P read q token by token
        _store_reads(p_ptr + chunk * C * C, q_ptr, decay_ptr, theta_ptr, h_dot_x * 0.0, chunk_base,
                     offs_m, m_ok, M,
                     C, S)

    @triton.jit
    def _chunk_y_kernel(x_ptr, q_ptr, b_ptr, states_ptr, p_ptr, y_ptr, T, Tp, D, M, NC,
                        C: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, SPLIT: tl.constexpr,
                        PRECISION: tl.constexpr, OP: tl.constexpr):
        """y = P X + (q e^b) H for the SPLIT columns of D of program
        axis 2."""
        n, bi, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_c = tl.arange(0, C)
        offs_m = tl.arange(0, BM)
        t_ok = n * C + offs_c < T
        m_ok = offs_m < M
        # (C,)
        x_rows, y_rows = (_token_rows(x_ptr, bi, n, T, D, C),
                          _token_rows(y_ptr, bi, n, T, D, C))
        h_rows = _state_rows(states_ptr, bi * NC + n, M, D, BM)  # (BM,)
        p = _block(p_ptr + (bi * NC + n) * C * C, offs_c, offs_c, C).to(OP)  # (C, C)
        offs_tile = bi * Tp * M + (n * C + offs_c[:, None]) * M + offs_m[None, :]
        q_eb = _start_factor(q_ptr, b_ptr, offs_tile, m_ok).to(OP)  # (C, BM) q e^b
        for d0 in range(split * SPLIT, split * SPLIT + SPLIT, BD):
            offs_d = d0 + tl.arange(0, BD)
            x = _load_cols(x_rows, t_ok, offs_d, D).to(OP)
            h = _load_cols(h_rows, m_ok, offs_d, D).to(OP)
            y = _mm(p, x, PRECISION) + _mm(q_eb, h, PRECISION)  # (C, BD)
            tl.store(y_rows[:, None] + offs_d[None, :], y.to(y_ptr.dtype.element_ty),
                     mask=t_ok[:, None] & (offs_d < D)[None, :])


# -------------------------------------------------------- scan backward kernels: per-token factors


if triton is not None:

    @triton.jit
    def _chunk_grads_kernel(theta_ptr, q_ptr, decay_ptr, rms_ptr, gram_ptr, h_dot_x_ptr, dyx_ptr,
                            hdy_ptr,
                            dq_ptr, c_ptr, omega_ptr, kappa_ptr, dk_ptr, pw_ptr, Tp, D, M, NC,
                            C: tl.constexpr, S: tl.constexpr, BM: tl.constexpr):
        """The backward's per-token factors of a chunk, from h_t . x_t (the forward's) and the
        chunk's products with dy: dq = dy . h, the norm's factor c, omega = theta Gamma with Gamma_s
        = sum_{u>=s} c_u e^{2(b_u-b_s)}, dk (less its chunk-end term), kappa = sum_u c_u e^{2 b_u},
        and P_w, the read matrix with omega as the query."""
        n, bi = tl.program_id(0), tl.program_id(1)
        offs_c, offs_m = tl.arange(0, C), tl.arange(0, BM)
        m_ok = offs_m < M
        chunk = bi * NC + n
        gram_chunk, dyx_chunk = gram_ptr + chunk * C * C, dyx_ptr + chunk * C * C  # X X^T, dY X^T
        chunk_base = bi * Tp * M + n * C * M
        # (BM, C) h_t . x_t, the forward's
        h_dot_x = _rows_first(h_dot_x_ptr + chunk * C * BM, offs_m, offs_c, BM)
        dq = _walk_dots(_rows_first(hdy_ptr + chunk * C * BM, offs_m, offs_c, BM), decay_ptr,
                        theta_ptr, dyx_chunk, 1,
                        C, chunk_base, offs_m, m_ok, M, C, S)  # h_t . dy_t
        # 1 on padded rows, where q is 0
        rms = _tile(rms_ptr, chunk_base, offs_m, m_ok, offs_c, M, 1.0)
        query = _tile(q_ptr, chunk_base, offs_m, m_ok, offs_c, M)  # (BM, C)
        c = -dq * query / (D * rms * rms)
        _store_tile(dq_ptr, chunk_base, offs_m, m_ok, offs_c, M, dq)
        _store_tile(c_ptr, chunk_base, offs_m, m_ok, offs_c, M, c)
        # Gamma_s = c_s + a_{s+1}^2 Gamma_{s+1}
        next_decays = tl.load(decay_ptr + chunk_base + (offs_c[None, :] + 1) * M + offs_m[:, None],
                              # (BM, C) a_{s+1}
                              mask=m_ok[:, None] & (offs_c[None, :] < C - 1), other=1.0)
        _, gamma = tl.associative_scan((next_decays * next_decays, c), 1, _linear, reverse=True)
        first_decay = _at(decay_ptr, chunk_base, 0, offs_m, m_ok, M, 1.0)
        first_decay2 = first_decay * first_decay  # a_0^2
        kappa = first_decay2 * tl.sum(tl.where(offs_c[None, :] == 0, gamma, 0.0), axis=1)
        tl.store(kappa_ptr + chunk * BM + offs_m, kappa)
        omega = _tile(theta_ptr, chunk_base, offs_m, m_ok, offs_c, M) * gamma
        _store_tile(omega_ptr, chunk_base, offs_m, m_ok, offs_c, M, omega)
        tl.debug_barrier()  # the walks below read omega token by token
        # sum_{u >= s} e^{b_u - b_s} (q_u dy_u + omega_u x_u) . x_s, walked from the chunk's end;
        # kept at u = s
        # zeros in the walks' layout (_rows_first): tl.zeros would put 32 rows on a thread
        later = h_dot_x * 0.0
        reads = h_dot_x * 0.0
        for j in range(C // S):
            for du in tl.static_range(S):
                u = C - 1 - j * S - du
                # a_{u+1} (unused at C - 1)
                next_decay = _at(decay_ptr, chunk_base, (u + 1) % C, offs_m, m_ok, M, 1.0)
                q_u = _at(q_ptr, chunk_base, u, offs_m, m_ok, M)
                omega_u = _at(omega_ptr, chunk_base, u, offs_m, m_ok, M)
                dy_x = tl.load(dyx_chunk + u * C + offs_c)[None, :]
                x_x = tl.load(gram_chunk + u * C + offs_c)[None, :]
                later = next_decay[:, None] * later + q_u[:, None] * dy_x + omega_u[:, None] * x_x
                reads = tl.where(offs_c[None, :] == u, later, reads)
        diag = tl.load(gram_chunk + offs_c * (C + 1))  # x_t . x_t
        dk = reads - omega * diag[None, :] + gamma * h_dot_x
        _store_tile(dk_ptr, chunk_base, offs_m, m_ok, offs_c, M, dk)
        _store_reads(pw_ptr + chunk * C * C, omega_ptr, decay_ptr, theta_ptr, h_dot_x * 0.0,
                     chunk_base, offs_m, m_ok,
                     M, C, S)


# ---------------------------------------------------------- scan backward kernels: state gradients


if triton is not None:

    @triton.jit
    def _chunk_dstate_kernel(x_ptr, dy_ptr, q_ptr, b_ptr, states_ptr, omega_ptr, kappa_ptr,
                             dstates_ptr,
                             T, Tp, D, M, NC, C: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr,
                             SPLIT: tl.constexpr, PRECISION: tl.constexpr, OP: tl.constexpr):
        """A chunk's gradient to its start state, dS = (q e^b)^T dY +
        (omega e^b)^T X + kappa H, on SPLIT columns."""
        n, bi, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_c = tl.arange(0, C)
        offs_m = tl.arange(0, BM)
        t_ok = n * C + offs_c < T
        m_ok = offs_m < M
        # (C,)
        x_rows, dy_rows = (_token_rows(x_ptr, bi, n, T, D, C),
                           _token_rows(dy_ptr, bi, n, T, D, C))
        h_rows = _state_rows(states_ptr, bi * NC + n, M, D, BM)  # (BM,)
        offs_tile = bi * Tp * M + (n * C + offs_c[:, None]) * M + offs_m[None, :]
        # (BM, C) q e^b
        q_eb_hi, q_eb_lo = _split(tl.trans(_start_factor(q_ptr, b_ptr, offs_tile, m_ok)), OP)
        # omega e^b
        omega_eb_hi, omega_eb_lo = _split(tl.trans(_start_factor(omega_ptr, b_ptr, offs_tile,
                                                                 m_ok)), OP)
        kappa = tl.load(kappa_ptr + (bi * NC + n) * BM + offs_m, mask=m_ok, other=0.0)
        for d0 in range(split * SPLIT, split * SPLIT + SPLIT, BD):
            offs_d = d0 + tl.arange(0, BD)
            x = _load_cols(x_rows, t_ok, offs_d, D).to(OP)
            dy = _load_cols(dy_rows, t_ok, offs_d, D).to(OP)
            h = _load_cols(h_rows, m_ok, offs_d, D)
            dstate = (_mm_split(q_eb_hi, q_eb_lo, dy, PRECISION) + _mm_split(omega_eb_hi,
                                                                             omega_eb_lo, x,
                                                                             PRECISION)
                  + kappa[:, None] * h.to(tl.float32))
            tl.store(dstates_ptr + (bi * NC + n) * M * D + offs_m[:, None] * D + offs_d[None, :],
                     dstate.to(dstates_ptr.dtype.element_ty),
                     mask=m_ok[:, None] & (offs_d < D)[None, :])


# -------------------------------------------------------------------- scan backward kernels: dxbar


if triton is not None:

    @triton.jit
    def _chunk_dx_kernel(x_ptr, dy_ptr, theta_ptr, b_ptr, states_ptr, dends_ptr, omega_ptr, p_ptr,
                         pw_ptr, dhx_ptr,
                         dx_ptr, T, Tp, D, M, NC, C: tl.constexpr, BM: tl.constexpr,
                         BD: tl.constexpr,
                         SPLIT: tl.constexpr, PRECISION: tl.constexpr, OP: tl.constexpr):
        """dx = P^T dY + W X + (omega e^b) H + K_end^T dH_end with W =
        P_w + P_w^T - diag(P_w), and this program's share of dH_end X^T,
        on SPLIT columns. dx is rounded to the input dtype and only ever
        meets weights of that dtype, so its products take single OP
        operands; dH_end is stored in the states' dtype (_start_dtype),
        exact in OP."""
        n, bi, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_c = tl.arange(0, C)
        offs_m = tl.arange(0, BM)
        t_ok = n * C + offs_c < T
        m_ok = offs_m < M
        chunk = bi * NC + n
        # (C,)
        x_rows, dy_rows = (_token_rows(x_ptr, bi, n, T, D, C),
                           _token_rows(dy_ptr, bi, n, T, D, C))
        dx_rows = _token_rows(dx_ptr, bi, n, T, D, C)
        # (BM,)
        h_rows, dh_rows = (_state_rows(states_ptr, chunk, M, D, BM),
                           _state_rows(dends_ptr, chunk, M, D, BM))
        p_w = _block(pw_ptr + chunk * C * C, offs_c, offs_c, C)
        # (C, C)
        p_w_sym = (p_w + tl.trans(p_w) - tl.where(offs_c[:, None] == offs_c[None, :], p_w,
                                                  0.0)).to(OP)
        p_trans = tl.trans(_block(p_ptr + chunk * C * C, offs_c, offs_c, C)).to(OP)
        chunk_base = bi * Tp * M + n * C * M
        offs_tile = chunk_base + offs_c[:, None] * M + offs_m[None, :]
        b = tl.load(b_ptr + offs_tile, mask=m_ok[None, :], other=0.0)  # (C, BM)
        theta = tl.load(theta_ptr + offs_tile, mask=m_ok[None, :], other=0.0)
        # omega e^b
        omega_eb = (tl.load(omega_ptr + offs_tile, mask=m_ok[None, :],
                            other=0.0) * tl.exp(b)).to(OP)
        b_end = _boundary(b_ptr, chunk_base, offs_m, m_ok, C - 1, M)  # (BM,)
        keys_end = (theta * tl.exp(b_end[None, :] - b)).to(OP)  # e^{b_end - b_s} theta_s
        dhx = tl.zeros([BM, C], dtype=tl.float32)
        for d0 in range(split * SPLIT, split * SPLIT + SPLIT, BD):
            offs_d = d0 + tl.arange(0, BD)
            x = _load_cols(x_rows, t_ok, offs_d, D).to(OP)
            dy = _load_cols(dy_rows, t_ok, offs_d, D).to(OP)
            h = _load_cols(h_rows, m_ok, offs_d, D).to(OP)
            dh = _load_cols(dh_rows, m_ok, offs_d, D).to(OP)
            dx = (_mm(p_trans, dy, PRECISION) + _mm(p_w_sym, x, PRECISION) + _mm(omega_eb, h,
                                                                                 PRECISION)
                  + _mm(keys_end, dh, PRECISION))  # (C, BD)
            tl.store(dx_rows[:, None] + offs_d[None, :], dx.to(dx_ptr.dtype.element_ty),
                     mask=t_ok[:, None] & (offs_d < D)[None, :])
            dhx += _mm(dh, tl.trans(x), PRECISION)
        # this program's share of dH_end X^T
        share = (chunk * tl.num_programs(2) + split) * BM
        tl.store(dhx_ptr + (share + offs_m[:, None]) * C + offs_c[None, :], dhx)


# ---------------------------------------------------------- scan backward kernels: dtheta and dphi


if triton is not None:

    @triton.jit
    def _decay_grads_kernel(theta_ptr, q_ptr, b_ptr, rms_ptr, dq_ptr, c_ptr, dk_ptr, dhx_ptr,
                            end_dot_ptr, d_b_ptr,
                            totals_ptr, eps, T, Tp, D, M, NC, SPLITS, C: tl.constexpr,
                            BM: tl.constexpr):
        """For one chunk: dk gets its chunk-end term
        (the dH_end X^T shares summed); d loss / d b_t = q dq + c
        ||h||^2 - theta dk (+ dhT . hT at t = T - 1); stores its reverse
        cumulative sum within the chunk and the chunk's total, at index
        NC - n of a (B, BM, NC + 1) array whose index 0 is 0."""
        n, bi = tl.program_id(0), tl.program_id(1)
        offs_t, offs_m, offs_tile, rows_ok = _chunk_tile(bi, n, Tp, M, C, BM)
        offs_c = tl.arange(0, C)
        chunk = bi * NC + n
        dhx = tl.zeros([BM, C], dtype=tl.float32)
        for split in range(SPLITS):
            share = (chunk * SPLITS + split) * BM
            dhx += tl.load(dhx_ptr + (share + offs_m[:, None]) * C + offs_c[None, :])
        b = tl.load(b_ptr + offs_tile, mask=rows_ok, other=0.0)
        # (BM,)
        b_end = _boundary(b_ptr, bi * Tp * M + n * C * M, offs_m, offs_m < M, C - 1, M)
        dk = tl.load(dk_ptr + offs_tile, mask=rows_ok,
                     other=0.0) + tl.exp(b_end[None, :] - b) * tl.trans(dhx)
        tl.store(dk_ptr + offs_tile, dk, mask=rows_ok)
        rms = tl.load(rms_ptr + offs_tile, mask=rows_ok, other=1.0)
        q_dq = (tl.load(q_ptr + offs_tile, mask=rows_ok, other=0.0)
                * tl.load(dq_ptr + offs_tile, mask=rows_ok, other=0.0))
        sq_norm = D * (rms * rms - eps)
        theta = tl.load(theta_ptr + offs_tile, mask=rows_ok, other=0.0)
        d_b = q_dq + tl.load(c_ptr + offs_tile, mask=rows_ok, other=0.0) * sq_norm - theta * dk
        # (BM,) dhT . hT
        end_dot = tl.load(end_dot_ptr + bi * M + offs_m, mask=offs_m < M, other=0.0)
        d_b += tl.where((offs_t == T - 1)[:, None], end_dot[None, :], 0.0)
        tl.store(d_b_ptr + offs_tile, tl.cumsum(d_b, axis=0, reverse=True), mask=rows_ok)
        totals_row = totals_ptr + (bi * BM + offs_m) * (NC + 1)
        tl.store(totals_row + NC - n, tl.sum(d_b, axis=0))
        if n == NC - 1:
            tl.store(totals_row, tl.zeros([BM], dtype=tl.float32))

    @triton.jit
    def _rate_grads_kernel(theta_ptr, decay_ptr, rms_ptr, dq_ptr, dk_ptr, d_b_ptr, later_ptr,
                           dtheta_ptr, dphi_ptr,
                           T, Tp, M, NC, C: tl.constexpr, BM: tl.constexpr):
        """dtheta = dk - (d loss / d log(1 - theta)) / (1 - theta) and
        dphi = dq / rms for one chunk, (B, T, M); later_ptr holds, at
        index NC - 1 - n, the sum of d loss / d b over the chunks after
        n. Where the memory forgets (theta = 1), dtheta = dk:
        _forget_grads_kernel adds the decay term."""
        n, bi = tl.program_id(0), tl.program_id(1)
        offs_t, offs_m, offs_tile, rows_ok = _chunk_tile(bi, n, Tp, M, C, BM)
        later = tl.load(later_ptr + (bi * BM + offs_m) * (NC + 1) + NC - 1 - n)  # (BM,)
        d_log_decay = tl.load(d_b_ptr + offs_tile, mask=rows_ok, other=0.0) + later[None, :]
        theta = tl.load(theta_ptr + offs_tile, mask=rows_ok, other=0.0)
        # theta < 1
        decaying = tl.load(decay_ptr + offs_tile, mask=rows_ok, other=0.0) > 0.0
        dtheta = tl.load(dk_ptr + offs_tile, mask=rows_ok, other=0.0) - tl.where(
            decaying, d_log_decay / tl.where(decaying, 1.0 - theta, 1.0), 0.0)
        dphi = (tl.load(dq_ptr + offs_tile, mask=rows_ok, other=0.0)
                / tl.load(rms_ptr + offs_tile, mask=rows_ok, other=1.0))
        offs_out = bi * T * M + offs_t[:, None] * M + offs_m[None, :]
        out_ok = (offs_t < T)[:, None] & rows_ok
        tl.store(dtheta_ptr + offs_out, dtheta, mask=out_ok)
        tl.store(dphi_ptr + offs_out, dphi, mask=out_ok)

    @triton.jit
    def _forget_grads_kernel(x_ptr, dy_ptr, theta_ptr, b_ptr, q_ptr, omega_ptr, states_ptr,
                             dends_ptr, dtheta_ptr,
                             T, Tp, D, M, NC, C: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr,
                             PRECISION: tl.constexpr, OP: tl.constexpr):
        """Subtracts dtheta's decay term d loss / d a_t at the tokens where theta = 1 (the row
        forgets), which _rate_grads_kernel leaves out: it divides d loss / d log(a_t) = a_t (d loss
        / d a_t) by a_t, 0 there. d loss / d a_t = G_t . h_{t-1}, G_t the gradient at h_t. In the
        chunk, with H its start state,
            h_{t-1} = e^{b_{t-1}} H + sum_{s<t} e^{b_{t-1} - b_s} theta_s x_s,
        and, the norm's term a_t Gamma_t ||h_{t-1}||^2 being 0,
            G_t . h_{t-1} = sum_{u>=t} e^{b_u - b_t} (q_u dy_u + omega_u x_u) . h_{t-1}
                            + e^{b_C - b_t} dH_end . h_{t-1}:
        the chunk's products over D of X, dY, H and dH_end, then two (rows, C) x (C, C) products a
        token. (At every token this cross term would cost another walk a chunk; below 1 the division
        loses float32 precision like 1 / (1 - theta).) Programs of chunks without such a token
        return at once."""
        n, bi = tl.program_id(0), tl.program_id(1)
        offs_c, offs_m = tl.arange(0, C), tl.arange(0, BM)
        m_ok = offs_m < M
        chunk_base = bi * Tp * M + n * C * M
        forgets = _tile(theta_ptr, chunk_base, offs_m, m_ok, offs_c, M) >= 1.0  # (BM, C)
        if tl.max(forgets.to(tl.int32)) > 0:
            chunk = bi * NC + n
            t_ok = n * C + offs_c < T
            x_rows = _token_rows(x_ptr, bi, n, T, D, C)  # (C,)
            dy_rows = _token_rows(dy_ptr, bi, n, T, D, C)
            h_rows = _state_rows(states_ptr, chunk, M, D, BM)  # (BM,)
            dh_rows = _state_rows(dends_ptr, chunk, M, D, BM)
            gram, dyx, hx, hdy, dhx, dhh = _forget_products(
                x_rows, dy_rows, h_rows, dh_rows, t_ok, m_ok, D,
                C, BM, BD, PRECISION, OP)
            b_end = _boundary(b_ptr, chunk_base, offs_m, m_ok, C - 1, M)  # (BM,)
            for t in range(C):
                forget = _at(theta_ptr, chunk_base, t, offs_m, m_ok, M) >= 1.0  # (BM,)
                if tl.max(forget.to(tl.int32)) > 0:
                    b = _tile(b_ptr, chunk_base, offs_m, m_ok, offs_c, M)  # (BM, C)
                    b_t = _at(b_ptr, chunk_base, t, offs_m, m_ok, M)  # (BM,)
                    b_before = _boundary(b_ptr, chunk_base, offs_m, m_ok, t - 1, M)  # 0 at t = 0
                    before = offs_c[None, :] < t
                    writes = _tile(theta_ptr, chunk_base, offs_m, m_ok, offs_c, M) * tl.exp(
                        # e^{b_{t-1} - b_s} theta_s, s < t
                        tl.where(before, b_before[:, None] - b, float("-inf")))
                    # e^{b_u - b_t}, u >= t
                    reads = tl.exp(tl.where(before, float("-inf"), b - b_t[:, None]))
                    start = tl.exp(b_before)  # (BM,) e^{b_{t-1}}
                    # (BM, C) h_{t-1} . dy_u
                    h_dy = start[:, None] * hdy + _mm(writes, tl.trans(dyx), "ieee")
                    h_x = start[:, None] * hx + _mm(writes, gram, "ieee")  # h_{t-1} . x_u
                    h_dh = start * dhh + tl.sum(writes * dhx, axis=1)  # (BM,) h_{t-1} . dH_end
                    d_decay = tl.sum(reads * (_tile(q_ptr, chunk_base, offs_m, m_ok, offs_c,
                                                    M) * h_dy
                                              + _tile(omega_ptr, chunk_base, offs_m, m_ok, offs_c,
                                                      M) * h_x), axis=1)
                    d_decay += tl.exp(b_end - b_t) * h_dh
                    dtheta_t = dtheta_ptr + bi * T * M + (n * C + t) * M + offs_m  # (BM,) pointers
                    tl.store(dtheta_t, tl.load(dtheta_t, mask=forget, other=0.0) - d_decay,
                             mask=forget)

    @triton.jit
    def _forget_products(x_rows, dy_rows, h_rows, dh_rows, t_ok, m_ok, D,
                         C: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr,
                         PRECISION: tl.constexpr, OP: tl.constexpr):
        """_forget_grads_kernel's products over D: x_u . x_s and dy_u .
        x_s (C, C), H . x_u, H . dy_u and dH_end . x_s (BM, C), dH_end .
        H (BM,)."""
        gram = tl.zeros([C, C], dtype=tl.float32)  # x_u . x_s
        dyx = tl.zeros([C, C], dtype=tl.float32)  # dy_u . x_s
        hx = tl.zeros([BM, C], dtype=tl.float32)  # H . x_u
        hdy = tl.zeros([BM, C], dtype=tl.float32)  # H . dy_u
        dhx = tl.zeros([BM, C], dtype=tl.float32)  # dH_end . x_s
        dhh = tl.zeros([BM], dtype=tl.float32)  # dH_end . H
        for d0 in range(0, D, BD):
            offs_d = d0 + tl.arange(0, BD)
            x = _load_cols(x_rows, t_ok, offs_d, D).to(OP)
            dy = _load_cols(dy_rows, t_ok, offs_d, D).to(OP)
            h = _load_cols(h_rows, m_ok, offs_d, D).to(OP)
            dh = _load_cols(dh_rows, m_ok, offs_d, D).to(OP)
            gram += _mm(x, tl.trans(x), PRECISION)
            dyx += _mm(dy, tl.trans(x), PRECISION)
            hx += _mm(h, tl.trans(x), PRECISION)
            hdy += _mm(h, tl.trans(dy), PRECISION)
            dhx += _mm(dh, tl.trans(x), PRECISION)
            dhh += tl.sum(h.to(tl.float32) * dh.to(tl.float32), axis=1)
        return gram, dyx, hx, hdy, dhx, dhh


# --------------------------------------------------------------------- scan: Triton device helpers


if triton is not None:

    @triton.jit
    def _mm(a, b, precision: tl.constexpr):
        """Matrix product with float32 accumulation, precision 'tf32' or
        'ieee' (see _precision)."""
        return tl.dot(a, b, input_precision=precision)

    @triton.jit
    def _split(a, OP: tl.constexpr):
        """A float32 tile as (hi, lo) in the operand dtype OP: hi + lo =
        a to about 16 bits for bfloat16 (lo = 0 when OP is float32)."""
        hi = a.to(OP)
        return hi, (a - hi.to(tl.float32)).to(OP)

    @triton.jit
    def _mm_split(a_hi, a_lo, b, precision: tl.constexpr):
        """(a_hi + a_lo) @ b for b exact in the operand dtype: two
        bfloat16 products, or for float32 operands (a_lo = 0) one
        product at `precision`."""
        if a_hi.dtype == tl.float32:
            acc = tl.dot(a_hi, b, input_precision=precision)
        else:
            acc = tl.dot(a_hi, b, tl.dot(a_lo, b))
        return acc

    @triton.jit
    def _load_cols(row_ptrs, rows_ok, offs_d, D):
        """Columns offs_d of the rows at row_ptrs (R,): an (R, BD) tile
        in their own dtype, zeros where masked."""
        mask = rows_ok[:, None] & (offs_d < D)[None, :]
        return tl.load(row_ptrs[:, None] + offs_d[None, :], mask=mask, other=0.0)

    @triton.jit
    def _token_rows(ptr, bi, n, T, D, C: tl.constexpr):
        """Row pointers (C,) of chunk n of sequence bi in a (B, T, D)
        array."""
        return ptr + bi * T * D + (n * C + tl.arange(0, C)) * D

    @triton.jit
    def _state_rows(ptr, chunk, M, D, BM: tl.constexpr):
        """Row pointers (BM,) of one chunk's state in a (B, NC, M, D)
        array."""
        return ptr + chunk * M * D + tl.arange(0, BM) * D

    @triton.jit
    def _start_factor(v_ptr, b_ptr, offs_tile, m_ok):
        """v e^b at the (C, BM) offsets offs_tile, a per-token factor
        onto the chunk-start state: q e^b, how much each token reads of
        it, or omega e^b, the norm's share of its gradient."""
        v = tl.load(v_ptr + offs_tile, mask=m_ok[None, :], other=0.0)
        return v * tl.exp(tl.load(b_ptr + offs_tile, mask=m_ok[None, :], other=0.0))

    @triton.jit
    def _chunk_tile(bi, n, Tp, M, C: tl.constexpr, BM: tl.constexpr):
        """Chunk n of sequence bi in a (B, Tp, M) array: token offsets
        (C,), row offsets (BM,), the (C, BM) offsets of the tile and its
        row mask (1, BM)."""
        offs_t = n * C + tl.arange(0, C)
        offs_m = tl.arange(0, BM)
        offs_tile = bi * Tp * M + offs_t[:, None] * M + offs_m[None, :]
        return offs_t, offs_m, offs_tile, (offs_m < M)[None, :]

    @triton.jit
    def _chunk_at(step, NC, REVERSE: tl.constexpr):
        """The chunk a scan visits at `step`; steps past the end give
        the last one (prefetches re-read it)."""
        step = tl.minimum(step, NC - 1)
        return NC - 1 - step if REVERSE else step

    @triton.jit
    def _tile(ptr, base, offs_m, m_ok, offs_t, M, other=0.0):
        """(rows, tokens) tile of a (B, Tp, M) float32 array: [i, t] at
        base + t * M + i, `other` on padded rows."""
        return tl.load(ptr + base + offs_t[None, :] * M + offs_m[:, None], mask=m_ok[:, None],
                       other=other)

    @triton.jit
    def _store_tile(ptr, base, offs_m, m_ok, offs_t, M, value):
        """Store a (rows, tokens) tile into a (B, Tp, M) array, the
        inverse of _tile."""
        tl.store(ptr + base + offs_t[None, :] * M + offs_m[:, None], value, mask=m_ok[:, None])

    @triton.jit
    def _linear(decay_a, value_a, decay_b, value_b):
        """Combine of a scan over v_t = decay_t v_{t-1} + value_t: a
        then b."""
        return decay_a * decay_b, decay_b * value_a + value_b

    @triton.jit
    def _at(ptr, base, t, offs_m, m_ok, M, other=0.0):
        """Token t's entries (BM,) of a (B, Tp, M) float32 array,
        `other` on padded rows."""
        return tl.load(ptr + base + t * M + offs_m, mask=m_ok, other=other)

    @triton.jit
    def _block(ptr, offs_r, offs_c, width):
        """Block [offs_r, offs_c] of a row-major float32 matrix `width`
        wide."""
        return tl.load(ptr + offs_r[:, None] * width + offs_c[None, :])

    @triton.jit
    def _boundary(b_ptr, base, offs_m, m_ok, t, M):
        """b at chunk-relative token t (BM,), or 0 for t = -1
        (the chunk start)."""
        b_t = tl.load(b_ptr + base + tl.maximum(t, 0) * M + offs_m, mask=m_ok, other=0.0)
        return tl.where(t >= 0, b_t, 0.0)

    @triton.jit
    def _rows_first(ptr, offs_m, offs_c, BM: tl.constexpr):
        """(BM, C) tile of a chunk's (C, BM) float32 array
        (stored tokens first). Unmasked and contiguous along the rows,
        the load gives the walks their layout: rows along a warp's
        lanes, so that a row vector (BM,) costs a thread a few
        registers, and the sums over rows of _store_reads stay inside a
        warp."""
        return tl.load(ptr + offs_c[None, :] * BM + offs_m[:, None])

    @triton.jit
    def _walk_dots(dots, decay_ptr, theta_ptr, dot_ptr, dot_step, dot_stride, chunk_base, offs_m,
                   m_ok, M,
                   C: tl.constexpr, S: tl.constexpr):
        """dots[i, t] = H_i . v_t at the chunk start (BM, C), for
        vectors v_t (x_t or dy_t), walked through the chunk's writes:
        h_s[i] . v_t = a_s h_{s-1}[i] . v_t + theta_s x_s . v_t, where
        x_s . v_t is at dot_ptr + s * dot_step + t * dot_stride. Returns
        h_t[i] . v_t, each row at its own token."""
        offs_c = tl.arange(0, C)
        diagonal = tl.zeros_like(dots)
        for s0 in range(0, C, S):  # S steps unrolled: their loads do not wait on the walk
            for ds in tl.static_range(S):
                s = s0 + ds
                decay = _at(decay_ptr, chunk_base, s, offs_m, m_ok, M, 1.0)  # (BM,) a_s
                write = _at(theta_ptr, chunk_base, s, offs_m, m_ok, M)
                # (C,) x_s . v_t
                dot_x = tl.load(dot_ptr + s * dot_step + offs_c * dot_stride)
                dots = decay[:, None] * dots + write[:, None] * dot_x[None, :]
                diagonal = tl.where(offs_c[None, :] == s, dots, diagonal)
        return diagonal

    @triton.jit
    def _store_reads(matrix_ptr, query_ptr, decay_ptr, theta_ptr, weights, chunk_base, offs_m, m_ok,
                     M,
                     C: tl.constexpr, S: tl.constexpr):
        """A chunk's read matrix (C, C), P[t, s] = sum_i query_t[i]
        L_i[t, s], row by row: the write weights L_i[t, s] =
        e^{b_t - b_s} theta_s of every earlier token s into row i
        (`weights`, zeros (BM, C) in the walks' layout) walk with t. The
        rows collect in registers and go out in one store, cheaper than
        a store a row (docs/kernel_log.md)."""
        offs_c = tl.arange(0, C)
        reads = tl.zeros([C, C], dtype=tl.float32)
        for t0 in range(0, C, S):
            for dt in tl.static_range(S):
                t = t0 + dt
                decay = _at(decay_ptr, chunk_base, t, offs_m, m_ok, M, 1.0)
                write = _at(theta_ptr, chunk_base, t, offs_m, m_ok, M)
                weights = tl.where(offs_c[None, :] == t, write[:, None], decay[:, None] * weights)
                query = _at(query_ptr, chunk_base, t, offs_m, m_ok, M)
                reads = tl.where(offs_c[:, None] == t, tl.sum(query[:, None] * weights,
                                                              axis=0)[None, :], reads)
        tl.store(matrix_ptr + offs_c[:, None] * C + offs_c[None, :], reads)


# --------------------------------------------------------------------------- scan: launch settings


def _precision(x):
    """tf32 products for 16-bit inputs; exact float32
    ('ieee', CUDA cores) for float32 inputs."""
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _operand(x):
    """Operand dtype of the products with X, dY and the states. bfloat16
    inputs (and their bfloat16 states) are exact in bfloat16, and
    float32 tiles meet them as hi + lo bfloat16 pairs
    (16 bits, finer than tf32's 11), but in the products of y and dxbar,
    which are rounded to bfloat16, as single bfloat16 tiles; float16
    (whose range is too narrow for such pairs) and float32 inputs take
    float32 products at _precision."""
    return tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float32


def _block_m(M):
    """Padded row count: a power of two, at least 32 (Triton 3.6 once
    faulted on 16-row products)."""
    return max(32, triton.next_power_of_2(M))


def _start_dtype(x):
    """Storage dtype of the chunk-start states and of the state
    gradients (each chunk's own and those at the chunk ends): bfloat16
    for bfloat16 inputs, else float32 (half the bytes of the largest
    tensors of the scan; the products take them as single bfloat16
    operands, the scans add them into float32 carries, and hT and dh0
    stay float32), for bfloat16-level errors in the float32 gradients
    (docs/kernel_log.md)."""
    return torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32


def _sm_count(x):
    """Streaming multiprocessors of x's GPU (1 off the GPU)."""
    return torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 1


def _meta(x, M, num_warps, num_stages=1):
    """Launch settings shared by the per-chunk kernels."""
    return dict(C=CHUNK, BM=_block_m(M), PRECISION=_precision(x), num_warps=num_warps,
                num_stages=num_stages)


def _walk_meta(x, M, unroll, warps):
    """Settings of the kernels that walk (rows, tokens) tiles through a
    chunk: `unroll` steps a loop iteration, `warps` at m = 64, scaled
    with the padded rows (_block_m); the callers' values are the best of
    sweeps (docs/kernel_log.md)."""
    return dict(C=CHUNK, BM=_block_m(M), S=unroll,
                num_warps=max(2, warps * _block_m(M) // 64))


def _columns_per_program(x):
    """Columns of D each program of the streaming kernels takes: all of
    them (the per-chunk set-up, a few (C, C) and (C, m) tiles, then runs
    once per chunk), unless the chunks are fewer than the GPU's SMs
    (docs/kernel_log.md)."""
    chunks = x.shape[0] * triton.cdiv(x.shape[1], CHUNK)
    return triton.cdiv(x.shape[-1], triton.cdiv(_sm_count(x), chunks))


def _streaming(x, M, num_stages=3):
    """Grid axis 2 and settings of the kernels that stream a chunk's
    columns of X and states, SPLIT at a time (num_stages: tiles in
    flight, swept in docs/kernel_log.md)."""
    # whole steps of BD = 64 columns
    split = 64 * triton.cdiv(_columns_per_program(x), 64)
    return triton.cdiv(x.shape[-1], split), dict(BD=64, SPLIT=split, OP=_operand(x),
                                                 **_meta(x, M, num_warps=4, num_stages=num_stages))


def _scratch(theta, NC, *rows):
    """Per-chunk float32 work space (B, NC, *rows, CHUNK)."""
    return theta.new_empty(theta.shape[0], NC, *rows, CHUNK)


# -------------------------------------------------------------------------- scan forward: launches


def _padded(weights):
    """theta or phi as float32 (B, Tp, M), zero-padded in time to a
    multiple of CHUNK (no copy when it is)."""
    return _pad_time(weights.float(), CHUNK).contiguous()


def _decays(theta_p):
    """The decays e^{log(1 - theta)} (0 where the memory forgets) and
    the within-chunk cumulative sum b of log(1 - theta)
    (_log_decay and _chunk_cumsum), both (B, Tp, M), and each chunk's
    keys to its end state (B, NC, BM, C); theta_p is contiguous float32,
    padded in time to a multiple of CHUNK (_padded)."""
    B, Tp, M = theta_p.shape
    decay, b = torch.empty_like(theta_p), torch.empty_like(theta_p)
    keys = theta_p.new_empty(B, Tp // CHUNK, _block_m(M), CHUNK)
    _decay_kernel[(Tp // CHUNK, B)](theta_p, decay, b, keys, Tp, M, C=CHUNK, BM=_block_m(M),
                                    FLOOR=LOG_DECAY_FLOOR,
                                    num_warps=8)
    return decay, b, keys


def _prepare(theta, phi):
    """What the forward makes of theta and phi first: padded theta and
    phi, the decays, b and the keys."""
    theta_p = _padded(theta)
    return (theta_p, _padded(phi), *_decays(theta_p))


def _state_groups(x, NC, columns):
    """Groups of chunks that the state kernel walks in parallel: one
    while the sequences' column blocks make at least half a program an
    SM; with fewer sequences (long T), as many as make two programs an
    SM, one wave: first each group's own end state, then a scan over
    groups, then the states from the group starts
    (docs/kernel_log.md)."""
    programs, sms = x.shape[0] * triton.cdiv(x.shape[-1], columns), _sm_count(x)
    return 1 if 2 * programs >= sms else min(NC, 2 * sms // programs)


def _state_columns(M):
    """Columns of D that a program of the state kernel carries through
    its chunks: 128, or 64 above 64 rows, so that its float32 carry
    stays 8K elements and does not spill (docs/kernel_log.md)."""
    return 128 if _block_m(M) <= 64 else 64


def _chunk_states(x, keys, b, h0):
    """Chunk-start states (B, NC, M, D) in _start_dtype(x) and the final
    state (B, M, D) float32."""
    B, Tp, M = b.shape
    D = x.shape[-1]
    NC = Tp // CHUNK
    columns = _state_columns(M)
    group = triton.cdiv(NC, _state_groups(x, NC, columns))  # chunks a group
    groups = triton.cdiv(NC, group)
    states = x.new_empty(B, NC, M, D, dtype=_start_dtype(x))
    final = x.new_empty(B, M, D, dtype=torch.float32)
    grid = (B, groups, triton.cdiv(D, columns))
    meta = dict(BD=columns, OP=_operand(x), **_meta(x, M, num_warps=4, num_stages=3))
    init = h0
    if groups > 1:
        # each group's end state from zero
        group_ends = x.new_empty(B, groups, M, D, dtype=torch.float32)
        _chunk_states_kernel[grid](x, keys, b, x, x, group_ends,
                                   x.shape[1], Tp, D, M, NC, group,
                                   FINAL=False, HAS_INIT=False, **meta)
        # (B, groups * group, M)
        chunk_decays = F.pad(b[:, CHUNK - 1::CHUNK], (0, 0, 0, groups * group - NC))
        # (B, groups, M) log-decay over each group
        group_decays = chunk_decays.view(B, groups, group, M).sum(2)
        init = torch.empty_like(group_ends)
        _scan_states(group_ends, init, group_decays, h0, final, reverse=False)
    _chunk_states_kernel[grid](x, keys, b, x if init is None else init,
                               states, final,
                               x.shape[1], Tp, D, M, NC, group,
                               FINAL=True, HAS_INIT=init is not None, **meta)
    return states, final


def _products(x, states, theta, dy=None):
    """Each chunk's inner products over D: (X X^T, H X^T, ||H||^2), or
    with dy (X X^T, H dY^T, dY X^T)."""
    B, NC, M, D = states.shape
    BM = _block_m(M)
    gram = _scratch(theta, NC, CHUNK)  # (B, NC, C, C)
    h_dots = theta.new_empty(B, NC, CHUNK, BM)  # H X^T or H dY^T as [t, i] (_rows_first)
    # ||H||^2 or dY X^T
    norms_or_dyx = theta.new_empty(B, NC, BM) if dy is None else _scratch(theta, NC, CHUNK)
    _chunk_products_kernel[(NC, B)](x, x if dy is None else dy, states,
                                    gram, h_dots, norms_or_dyx, norms_or_dyx,
                                    x.shape[1], D, M, NC, BD=64, OP=_operand(x),
                                    BACKWARD=dy is not None,
                                    **_meta(x, M, num_warps=4, num_stages=3))
    return gram, h_dots, norms_or_dyx


def _chunk_out(x, theta, phi, decay, b, states, eps):
    """Forward output y (B, T, D), the row rms and q = phi / rms
    (B, Tp, M), P (B, NC, C, C), the within-chunk reads, and h_t . x_t
    (B, NC, C, BM), tokens first."""
    B, T, D = x.shape
    NC, M = states.shape[1], theta.shape[-1]
    gram, h_dot_x, h_sq = _products(x, states, theta)
    P, y = _scratch(theta, NC, CHUNK), torch.empty_like(x)
    rms, q = torch.empty_like(theta), torch.empty_like(theta)
    _chunk_norms_kernel[(NC, B)](theta, phi, decay, gram, h_dot_x, h_sq, q, P, rms, eps,
                                 theta.shape[1], D, M, NC,
                                 **_walk_meta(x, M, unroll=16, warps=4))
    splits, meta = _streaming(x, M)
    _chunk_y_kernel[(NC, B, splits)](x, q, b, states, P, y,
                                     T, theta.shape[1], D, M, NC, **meta)
    return y, rms, q, P, h_dot_x


# ------------------------------------------------------------------------- scan backward: launches


def _chunk_grads(x, dy, theta, q, decay, states, rms, h_dot_x):
    """dq, c, omega and dk less its chunk-end term, all (B, Tp, M);
    kappa (B, NC, BM); P_w (B, NC, C, C)."""
    B, _, D = x.shape
    NC, M = states.shape[1], theta.shape[-1]
    gram, hdy, dyx = _products(x, states, theta, dy)
    dq, c, omega, dk = (torch.empty_like(theta) for _ in range(4))
    kappa, p_w = theta.new_empty(B, NC, _block_m(M)), _scratch(theta, NC, CHUNK)
    _chunk_grads_kernel[(NC, B)](theta, q, decay, rms, gram, h_dot_x, dyx, hdy, dq, c, omega, kappa,
                                 dk, p_w,
                                 theta.shape[1], D, M, NC, **_walk_meta(x, M, unroll=4, warps=8))
    return dq, c, omega, kappa, dk, p_w


def _chunk_dstate(x, dy, q, b, states, omega, kappa):
    """Each chunk's gradient to its start state (B, NC, M, D)."""
    B, T, D = x.shape
    NC, M = states.shape[1], q.shape[-1]
    dstates = torch.empty_like(states)  # in the states' dtype (_start_dtype)
    splits, meta = _streaming(x, M)
    _chunk_dstate_kernel[(NC, B, splits)](x, dy, q, b, states, omega, kappa,
                                          dstates,
                                          T, q.shape[1], D, M, NC, **meta)
    return dstates


def _scan_states(added, carries, b, init, final, reverse):
    """carries[n] <- the carry entering chunk n
    (reversed: leaving it backwards), from added (B, NC, M, D), what
    each chunk adds to the carry, and b (B, NC * C, M), whose entry n *
    C + C - 1 is chunk n's log-decay: the gradients at the chunk ends,
    or the start states of groups of chunks
    (C = 1, b the groups' log-decays). Not in place: in place, the loads
    ahead would wait on the stores before them (docs/kernel_log.md)."""
    B, NC, M, D = added.shape
    # about 2048 programs
    BLOCK = max(128, min(512, triton.next_power_of_2(B * M * D // 2048)))
    _chunk_scan_kernel[(B, triton.cdiv(M * D, BLOCK))](
        added, carries, b, init if init is not None else final, final, b.shape[1], D, M, NC,
        C=b.shape[1] // NC, BLOCK=BLOCK, HAS_INIT=init is not None, REVERSE=reverse)


def _chunk_dx(x, dy, theta, b, states, dends, omega, P, p_w):
    """dxbar (B, T, D) and the shares of dH_end X^T, one per column
    split (B, NC, splits, BM, C)."""
    B, T, D = x.shape
    NC, M = states.shape[1], theta.shape[-1]
    # four tiles a step (xbar, dy, states, their gradients): 4 stages
    # fit an H200's shared memory only for bfloat16 states of at most 64
    # rows (docs/kernel_log.md)
    deep = states.element_size() == 2 and _block_m(M) <= 64
    splits, meta = _streaming(x, M, num_stages=4 if deep else 2)
    dhx = _scratch(theta, NC, splits, _block_m(M))
    dx = torch.empty_like(x)
    _chunk_dx_kernel[(NC, B, splits)](x, dy, theta, b, states, dends, omega, P, p_w, dhx, dx,
                                      T, theta.shape[1], D, M, NC, **meta)
    return dx, dhx


def _rate_grads(T, D, theta, q, decay, b, rms, dq, c, dk, dhx, end_dot, eps):
    """dtheta and dphi (B, T, M) float32 from the per-token factors (dk
    gets its chunk-end term in place). d loss / d b_t = g_t . h_t -
    theta_t dk_t, with g_t . h_t = q dq + c ||h||^2
    (+ dhT . hT at the end); b is the cumulative log-decay, so d loss /
    d log(1 - theta_t) is the sum of that over u >= t: within the chunk
    in the first kernel, over the later chunks through the cumulative
    sum of the chunk totals. Where theta = 1, dtheta lacks its decay
    term until _forget_grads adds it."""
    B, Tp, M = theta.shape
    NC, BM, splits = Tp // CHUNK, _block_m(M), dhx.shape[2]
    d_b, totals = torch.empty_like(theta), theta.new_empty(B, BM, NC + 1)
    # (C, BM) tiles: 4 warps spill (docs/kernel_log.md)
    meta = dict(C=CHUNK, BM=BM, num_warps=8)
    _decay_grads_kernel[(NC, B)](theta, q, b, rms, dq, c, dk, dhx, end_dot, d_b, totals, eps, T, Tp,
                                 D, M, NC,
                                 splits, **meta)
    # (B, BM, NC + 1): at NC - 1 - n, the sum over the chunks after n
    later = totals.cumsum(-1)
    dtheta, dphi = theta.new_empty(B, T, M), theta.new_empty(B, T, M)
    _rate_grads_kernel[(NC, B)](theta, decay, rms, dq, dk, d_b, later, dtheta, dphi, T, Tp, M, NC,
                                **meta)
    return dtheta, dphi


def _forget_grads(dtheta, x, dy, theta, b, q, omega, states, dends):
    """dtheta (B, T, M) gets its decay term where theta = 1
    (_forget_grads_kernel), in place."""
    B, Tp, M = theta.shape
    NC = Tp // CHUNK
    _forget_grads_kernel[(NC, B)](x, dy, theta, b, q, omega, states, dends, dtheta, x.shape[1], Tp,
                                  x.shape[-1], M,
                                  NC, BD=32, OP=_operand(x),
                                  **_meta(x, M, num_warps=4))


# ------------------------------------------------------------------ scan: custom ops and public API

# The scan is a pair of torch.library custom ops and the step one, so
# torch.compile traces models through them without a graph break
# (it runs the kernels as they are). The scan's forward returns what its
# backward reads besides its inputs.

Tensor = torch.Tensor


@torch.library.custom_op("fm::scan_forward", mutates_args=())
def _scan_forward(xbar: Tensor, theta: Tensor, phi: Tensor, h0: Optional[Tensor], eps: float
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                             Tensor]:
    """y, hT, then the decays, b, the chunk-start states, the row rms,
    q, P and h_t . x_t (see _chunk_out)."""
    x = xbar.contiguous()
    theta_p, phi_p, decay, b, keys = _prepare(theta, phi)
    states, hT = _chunk_states(x, keys, b, None if h0 is None else h0.float().contiguous())
    y, rms, q, P, h_dot_x = _chunk_out(x, theta_p, phi_p, decay, b, states, eps)
    return y, hT, decay, b, states, rms, q, P, h_dot_x


@_scan_forward.register_fake
def _(xbar, theta, phi, h0, eps):
    B, T, D = xbar.shape
    M, Tp = theta.shape[-1], CHUNK * -(-T // CHUNK)
    f32 = lambda *shape: xbar.new_empty(shape, dtype=torch.float32)
    starts = xbar.new_empty(B, Tp // CHUNK, M, D, dtype=_start_dtype(xbar))
    return (xbar.new_empty(B, T, D), f32(B, M, D), f32(B, Tp, M), f32(B, Tp, M), starts, f32(B, Tp,
                                                                                             M),
            f32(B, Tp, M), f32(B, Tp // CHUNK, CHUNK, CHUNK), f32(B, Tp // CHUNK, CHUNK,
                                                                  _block_m(M)))


@torch.library.custom_op("fm::scan_backward", mutates_args=())
def _scan_backward(dy: Tensor, dhT: Optional[Tensor], xbar: Tensor, theta: Tensor, hT: Tensor,
                   decay: Tensor,
                   b: Tensor, states: Tensor, rms: Tensor, q: Tensor, P: Tensor, h_dot_x: Tensor,
                   eps: float
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """dxbar (B, T, D); dtheta and dphi float32 (B, T, M); dh0
    (B, M, D). dhT None means zeros."""
    x, dy = xbar.contiguous(), dy.contiguous()
    if dhT is not None:
        dhT = dhT.float().contiguous()
    theta = _padded(theta)
    T, D = x.shape[1:]
    dq, c, omega, kappa, dk, p_w = _chunk_grads(x, dy, theta, q, decay, states, rms, h_dot_x)
    dstates = _chunk_dstate(x, dy, q, b, states, omega, kappa)  # (B, NC, M, D)
    dh0 = torch.empty_like(hT)  # (B, M, D)
    dends = torch.empty_like(dstates)  # dL/d(chunk-end state)
    _scan_states(dstates, dends, b, dhT, dh0, reverse=True)
    del dstates
    # (B, T, D), (B, NC, splits, BM, C)
    dx, dhx = _chunk_dx(x, dy, theta, b, states, dends, omega, P, p_w)
    # (B, M) dhT . hT
    end_dot = hT.new_zeros(hT.shape[:2]) if dhT is None else (dhT * hT).sum(-1)
    dtheta, dphi = _rate_grads(T, D, theta, q, decay, b, rms, dq, c, dk, dhx, end_dot, eps)
    _forget_grads(dtheta, x, dy, theta, b, q, omega, states, dends)
    return dx, dtheta, dphi, dh0


@_scan_backward.register_fake
def _(dy, dhT, xbar, theta, hT, decay, b, states, rms, q, P, hx, eps):
    dtheta = theta.new_empty(theta.shape, dtype=torch.float32)
    return xbar.new_empty(xbar.shape), dtheta, torch.empty_like(dtheta), torch.empty_like(hT)


def _scan_setup_context(ctx, inputs, output):
    xbar, theta, phi, h0, eps = inputs
    ctx.save_for_backward(xbar, theta, *output[1:])
    ctx.eps, ctx.has_h0, ctx.phi_dtype = eps, h0 is not None, phi.dtype
    # no zero gradients for the seven outputs only the backward reads
    ctx.set_materialize_grads(False)


def _scan_grads(ctx, dy, dhT, *unused):
    xbar, theta, hT, *saved = ctx.saved_tensors
    if dy is None:
        dy = torch.zeros_like(xbar)
    dx, dtheta, dphi, dh0 = _scan_backward(dy, dhT, xbar, theta, hT, *saved, ctx.eps)
    return dx, dtheta.to(theta.dtype), dphi.to(ctx.phi_dtype), dh0 if ctx.has_h0 else None, None


_scan_forward.register_autograd(_scan_grads, setup_context=_scan_setup_context)


def _check_scan_args(xbar, theta, phi, h0, eps):
    B, T, D = xbar.shape
    M = theta.shape[-1]
    if not eps > 0:
        raise ValueError(f"eps must be > 0 (it keeps rms(h) away from 0), got {eps}")
    if theta.shape != phi.shape or theta.shape[:2] != (B, T):
        raise ValueError(f"theta {tuple(theta.shape)} and phi {tuple(phi.shape)} must both be "
                         f"(B, T, M) with (B, T) = {(B, T)} from xbar")
    if h0 is not None and h0.shape != (B, theta.shape[-1], D):
        raise ValueError(f"h0 must be (B, M, D) = {(B, theta.shape[-1], D)}, got {tuple(h0.shape)}")
    if M > MAX_ROWS:
        raise ValueError(f"fm_scan's kernels take at most {MAX_ROWS} memory rows, got M = {M}: "
                         "use fm_scan_torch")
    Tp = CHUNK * -(-T // CHUNK)
    # per token: x and y, the (C, C) work, dH X^T shares
    widest = max(D, CHUNK, _block_m(M) * -(-D // 64))
    if B * Tp * widest >= 2**31 or B * (Tp // CHUNK) * M * D >= 2**31:
        raise ValueError(f"fm_scan indexes with 32-bit offsets: B*T*D = {B * T * D:,} and the "
                         "chunk states are too large for one call; split the batch into calls "
                         "of fewer tokens")


def fm_scan(xbar, theta, phi, h0=None, eps=1e-6):
    """Triton FM scan (forward and backward) -> y (B, T, D), hT
    (B, M, D) float32."""
    _check_scan_args(xbar, theta, phi, h0, eps)
    y, hT, *_ = _scan_forward(xbar, theta, phi, h0, float(eps))
    return y, hT


# -------------------------------------------------------------------- sparse scan: reference
#
# Sparse FM is a ragged recurrence per row: a token reads exactly the
# rows it writes, so with the B*T*K (token, row) pairs sorted by
# (sequence, row), time order kept, each row is a one-row FM scan over
# its own writers (a segment), and a token's output is the sum of its K
# pairs' outputs. Rows nobody writes keep h0. Nothing has m tokens'
# width: the work follows B*T*K*D, whatever m is.


def _sorted_pairs(idx, n_memory):
    """idx (B, T, K) -> each pair's b*M + row sorted
    (time order kept within one), the sort's order (N,) and where a
    segment starts (N,) bool."""
    sequence = torch.arange(idx.shape[0], device=idx.device)[:, None, None]
    keys, order = (sequence * n_memory + idx).flatten().sort(stable=True)
    starts = torch.ones_like(keys, dtype=torch.bool)
    starts[1:] = keys[1:] != keys[:-1]
    return keys, order, starts


def sparse_dispatch(idx, n_memory):
    """idx (B, T, K) -> the pairs by (sequence, row) with time order
    kept: order (N,) (each sorted pair's flat index b*T*K + t*K + j),
    seg (N,) its segment, rank (N,) its place in the segment, seg_keys
    (S,) each segment's b*M + row."""
    sorted_keys, order, starts = _sorted_pairs(idx, n_memory)
    seg = starts.cumsum(0) - 1  # (N,)
    first = starts.nonzero()[:, 0]  # (S,) the first pair of each segment
    rank = torch.arange(len(seg), device=idx.device) - first[seg]
    return order, seg, rank, sorted_keys[first]


def fm_sparse_scan_torch(xbar, idx, theta, phi, n_memory, h0=None, eps=1e-6, chunk_size=64):
    """Sparse FM scan by dispatch (above), in PyTorch; differentiable.
    xbar (B, T, D), idx (B, T, K) distinct rows a token, theta and phi
    (B, T, K), h0 (B, M, D) or None -> y (B, T, D), hT (B, M, D): each
    segment padded to the longest one and scanned as one row by
    fm_scan_torch."""
    _check_sparse_args(xbar, idx, theta, phi, n_memory, h0, eps)
    _check_rows(idx, n_memory)
    B, T, D = xbar.shape
    K, M = idx.shape[-1], n_memory
    dtype = torch.promote_types(xbar.dtype, torch.float32)
    order, seg, rank, seg_keys = sparse_dispatch(idx, M)
    token = order // K  # (N,) b*T + t
    S, L = len(seg_keys), int(rank.max()) + 1
    x = xbar.reshape(B * T, D).to(dtype)[token]  # (N, D)
    # (S, L, D): padding writes nothing
    xs = x.new_zeros(S, L, D).index_put((seg, rank), x)
    ths = x.new_zeros(S, L).index_put((seg, rank), theta.reshape(-1)[order].to(dtype))
    phs = x.new_zeros(S, L).index_put((seg, rank), phi.reshape(-1)[order].to(dtype))
    starts = None
    if h0 is not None:
        starts = h0.reshape(B * M, D).to(dtype)[seg_keys, None]  # (S, 1, D)
    ys, ends = fm_scan_torch(xs, ths[..., None], phs[..., None], starts, eps, min(chunk_size, L))
    # each token's K pairs summed
    y = x.new_zeros(B * T, D).index_add(0, token, ys[seg, rank])
    hT = x.new_zeros(B * M, D) if h0 is None else h0.reshape(B * M, D).to(dtype)
    hT = hT.index_copy(0, seg_keys, ends[:, 0])  # (B*M, D)
    return y.view(B, T, D).to(xbar.dtype), hT.view(B, M, D)


def _check_sparse_args(xbar, idx, theta, phi, n_memory, h0, eps):
    """One line for each bad argument of the sparse scans, naming it."""
    B, T, D = xbar.shape
    K = idx.shape[-1]
    if not eps > 0:
        raise ValueError(f"eps must be > 0 (it keeps rms(h) away from 0), got {eps}")
    if not 1 <= K <= n_memory:
        raise ValueError(f"top_k must be in 1..n_memory = {n_memory}, got {K} rows in idx")
    if idx.shape != (B, T, K) or idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"idx must be integer (B, T, K) with (B, T) = {(B, T)} from xbar, got "
                         f"{idx.dtype} {tuple(idx.shape)}")
    if theta.shape != idx.shape or phi.shape != idx.shape:
        raise ValueError(f"theta {tuple(theta.shape)} and phi {tuple(phi.shape)} must be idx's "
                         f"shape {tuple(idx.shape)}: the weights of the rows idx")
    if h0 is not None and h0.shape != (B, n_memory, D):
        raise ValueError(f"h0 must be (B, M, D) = {(B, n_memory, D)}, got {tuple(h0.shape)}")


def _check_rows(idx, n_memory):
    """idx's rows in 0..M-1 and distinct within a token (reads the
    values: a sync on a GPU)."""
    if idx.numel() and (idx.min() < 0 or idx.max() >= n_memory):
        raise ValueError(f"idx must hold rows 0..{n_memory - 1} (n_memory = {n_memory}), got "
                         f"{int(idx.min())}..{int(idx.max())}")
    ranked = idx.sort(-1).values
    if (ranked[..., 1:] == ranked[..., :-1]).any():
        raise ValueError("idx names a row twice for one token: a token's top_k rows must be "
                         "distinct")


# --------------------------------------------------------------------- sparse scan: Triton kernels
#
# fm_sparse_scan takes the sorted pairs (sparse_dispatch) in chunks of
# SPARSE_CHUNK pairs, whatever their segments: a chunk may hold the end
# of one segment, whole short ones and the start of another, so its work
# is C pairs however many rows there are. Inside a chunk each segment is
# a one-row FM scan (b the chunk's cumulative log-decays, s and t pairs
# of one segment):
#
#     h_t = e_t S_t + sum_{s<=t} L[t,s] x_s,   L[t,s] = theta_s e^{b_t - b_s},
#     e_t = e^{b_t - b_before}, the decay since the segment's first pair in the chunk,
#
# S_t the segment's start: the state carried in (states[c]) where the
# chunk's first segment began in a chunk before, else its row of h0
# (zeros without h0). One (C, C) @ (C, BD) product a column block gives
# h_t itself: the row norms, y and hT (at each segment's last pair)
# follow. A segment that runs past its chunk's end is walked chunk by
# chunk first (_sparse_carry_kernel: the states at the chunk starts it
# crosses); then every chunk runs in parallel (_sparse_out_kernel).
# Backward, with G_t the whole gradient reaching h_t:
#
#     g_u = q_u dy_u + c_u h_u (+ dhT's row at a segment's last pair),
#     c_u = -(dy_u . h_u) q_u / (D r_u^2),   dphi_u = (dy_u . h_u) / r_u
#     G_t = sum_{u>=t} e^{b_u - b_t} g_u (+ e^{b_end - b_t} dEnd where the segment runs on),
#     dxbar_t = theta_t G_t,   dtheta_t = G_t . (x_t - h_{t-1}),   dS = a_first G_first
#
# _sparse_grads_kernel gives dphi, c and each chunk's gradient into its
# carried state (less what comes from later chunks);
# _sparse_carry_grads_kernel adds those up backwards along each segment;
# _sparse_dx_kernel gives dxbar, dtheta and dh0. Each pair's y and dxbar
# go to a (B, T, K, D) buffer summed over K (no atomics: the same sums
# every run). Column tiles are float32; the products take tf32 for
# 16-bit inputs and exact float32 for float32.

SPARSE_CHUNK = 32  # pairs a chunk (a power of 2, at least 16 for tl.dot)
START, END = 1, 2  # a pair's flags: first, last of its segment

if triton is not None:
    _START, _END = tl.constexpr(START), tl.constexpr(END)  # what the kernels read of them

    @triton.jit
    def _sparse_carry_kernel(x_ptr, tok_ptr, theta_ptr, la_ptr, keys_ptr, chain_ptr, end_ptr,
                             h0_ptr, states_ptr, D, C: tl.constexpr, BD: tl.constexpr,
                             HAS_H0: tl.constexpr):
        """The state at each chunk start that a segment begun in chunk
        c0 runs past."""
        c0 = tl.program_id(0)
        first = tl.load(chain_ptr + c0)
        if first < 0:
            return
        offs_d = tl.program_id(1) * BD + tl.arange(0, BD)
        d_ok = offs_d < D
        H = tl.zeros([BD], tl.float32)
        if HAS_H0:
            H = tl.load(h0_ptr + tl.load(keys_ptr + first) * D + offs_d, mask=d_ok, other=0.0)
        offs = tl.arange(0, C)
        for c in range(c0, tl.load(end_ptr + c0)):
            lo = tl.maximum(first, c * C)
            ok = lo + offs < (c + 1) * C
            theta = tl.load(theta_ptr + lo + offs, mask=ok, other=0.0)
            la = tl.load(la_ptr + lo + offs, mask=ok, other=0.0)
            b = tl.cumsum(la, 0)
            b_end = tl.sum(la, 0)
            tok = tl.load(tok_ptr + lo + offs, mask=ok, other=0).to(tl.int64)
            X = _pair_tile(x_ptr, tok, ok, offs_d, D)
            H = tl.exp(b_end) * H + tl.sum((theta * tl.exp(b_end - b))[:, None] * X, 0)
            tl.store(states_ptr + (c + 1) * D + offs_d, H, mask=d_ok)

    @triton.jit
    def _sparse_out_kernel(x_ptr, tok_ptr, pair_ptr, seg_ptr, flag_ptr, theta_ptr, phi_ptr, la_ptr,
                           keys_ptr, h0_ptr, states_ptr, o_ptr, rms_ptr, hT_ptr, N, D, eps,
                           C: tl.constexpr, BD: tl.constexpr, HAS_H0: tl.constexpr,
                           PRECISION: tl.constexpr):
        """One chunk: each pair's h_t, its rms, y's share o_t = phi_t
        h_t / rms, hT's rows."""
        lo, offs, ok, seg, flags, theta, la, b, same, before, cont, out = _pair_chunk(
            seg_ptr, flag_ptr, theta_ptr, la_ptr, N, C)
        L = _writes(theta, b, b, same, C, False)  # (C, C)
        e = tl.exp(b - before)
        tok = tl.load(tok_ptr + lo + offs, mask=ok, other=0).to(tl.int64)
        keys = tl.load(keys_ptr + lo + offs, mask=ok, other=0)
        sq = tl.zeros([C], tl.float32)
        for d0 in range(0, D, BD):  # the squared norms
            offs_d = d0 + tl.arange(0, BD)
            S = _starts(states_ptr, h0_ptr, keys, cont, ok, offs_d, D, C, BD, HAS_H0)
            X = _pair_tile(x_ptr, tok, ok, offs_d, D)
            h = e[:, None] * S + tl.dot(L, X, input_precision=PRECISION)
            sq += tl.sum(h * h, 1)
        rms = tl.sqrt(sq / D + eps)
        tl.store(rms_ptr + lo + offs, rms, mask=ok)
        q = tl.load(phi_ptr + lo + offs, mask=ok, other=0.0) / rms
        pair = tl.load(pair_ptr + lo + offs, mask=ok, other=0).to(tl.int64)
        ends = ok & ((flags & _END) != 0)
        for d0 in range(0, D, BD):
            offs_d = d0 + tl.arange(0, BD)
            S = _starts(states_ptr, h0_ptr, keys, cont, ok, offs_d, D, C, BD, HAS_H0)
            X = _pair_tile(x_ptr, tok, ok, offs_d, D)
            h = e[:, None] * S + tl.dot(L, X, input_precision=PRECISION)
            cols = offs_d[None, :]
            d_ok = (offs_d < D)[None, :]
            tl.store(o_ptr + pair[:, None] * D + cols, q[:, None] * h, mask=ok[:, None] & d_ok)
            tl.store(hT_ptr + keys[:, None] * D + cols, h, mask=ends[:, None] & d_ok)

    @triton.jit
    def _sparse_grads_kernel(x_ptr, dy_ptr, dhT_ptr, tok_ptr, pair_ptr, seg_ptr, flag_ptr,
                             theta_ptr, phi_ptr, la_ptr, keys_ptr, h0_ptr, states_ptr, rms_ptr,
                             c_ptr, dphi_ptr, local_ptr, N, D, C: tl.constexpr, BD: tl.constexpr,
                             HAS_H0: tl.constexpr, HAS_DHT: tl.constexpr,
                             PRECISION: tl.constexpr):
        """One chunk: dphi, the norm's factor c, and the gradient into
        the chunk's carried state from this chunk alone, sum_t e_t g_t
        over the pairs of the segment that runs in."""
        lo, offs, ok, seg, flags, theta, la, b, same, before, cont, out = _pair_chunk(
            seg_ptr, flag_ptr, theta_ptr, la_ptr, N, C)
        L = _writes(theta, b, b, same, C, False)
        e = tl.exp(b - before)
        tok = tl.load(tok_ptr + lo + offs, mask=ok, other=0).to(tl.int64)
        keys = tl.load(keys_ptr + lo + offs, mask=ok, other=0)
        dot = tl.zeros([C], tl.float32)  # dy_t . h_t
        for d0 in range(0, D, BD):
            offs_d = d0 + tl.arange(0, BD)
            S = _starts(states_ptr, h0_ptr, keys, cont, ok, offs_d, D, C, BD, HAS_H0)
            h = e[:, None] * S + tl.dot(L, _pair_tile(x_ptr, tok, ok, offs_d, D),
                                        input_precision=PRECISION)
            dot += tl.sum(_pair_tile(dy_ptr, tok, ok, offs_d, D) * h, 1)
        rms = tl.load(rms_ptr + lo + offs, mask=ok, other=1.0)
        q = tl.load(phi_ptr + lo + offs, mask=ok, other=0.0) / rms
        c = -dot * q / (D * rms * rms)
        tl.store(c_ptr + lo + offs, c, mask=ok)
        pair = tl.load(pair_ptr + lo + offs, mask=ok, other=0)
        tl.store(dphi_ptr + pair, dot / rms, mask=ok)
        if (tl.load(flag_ptr + lo) & _START) == 0:
            ends = ok & ((flags & _END) != 0)
            for d0 in range(0, D, BD):
                offs_d = d0 + tl.arange(0, BD)
                S = _starts(states_ptr, h0_ptr, keys, cont, ok, offs_d, D, C, BD, HAS_H0)
                h = e[:, None] * S + tl.dot(L, _pair_tile(x_ptr, tok, ok, offs_d, D),
                                            input_precision=PRECISION)
                g = _direct_grads(dy_ptr, dhT_ptr, tok, keys, ends, ok, q, c, h, offs_d, D,
                                  HAS_DHT)
                local = tl.sum(tl.where(cont, e, 0.0)[:, None] * g, 0)
                tl.store(local_ptr + tl.program_id(0) * D + offs_d, local,
                         mask=offs_d < D)

    @triton.jit
    def _sparse_carry_grads_kernel(la_ptr, chain_ptr, end_ptr, local_ptr, dstates_ptr, N, D,
                                   C: tl.constexpr, BD: tl.constexpr):
        """The gradients of the carried states of a segment begun in
        chunk c0, from its last chunk back: dS[c] = local[c] +
        e^{b_end[c]} dS[c + 1]."""
        c0 = tl.program_id(0)
        if tl.load(chain_ptr + c0) < 0:
            return
        offs_d = tl.program_id(1) * BD + tl.arange(0, BD)
        d_ok = offs_d < D
        c_end = tl.load(end_ptr + c0)
        dS = tl.zeros([BD], tl.float32)
        for i in range(0, c_end - c0):
            c = c_end - i
            offs = c * C + tl.arange(0, C)
            decay = tl.exp(tl.sum(tl.load(la_ptr + offs, mask=offs < N, other=0.0), 0))
            row = c * D + offs_d
            dS = tl.load(local_ptr + row, mask=d_ok, other=0.0) + decay * dS
            tl.store(dstates_ptr + row, dS, mask=d_ok)

    @triton.jit
    def _sparse_dx_kernel(x_ptr, dy_ptr, dhT_ptr, tok_ptr, pair_ptr, seg_ptr, flag_ptr, theta_ptr,
                          phi_ptr, la_ptr, keys_ptr, h0_ptr, states_ptr, rms_ptr, c_ptr,
                          dstates_ptr, dx_ptr, dtheta_ptr, dh0_ptr, N, D, C: tl.constexpr,
                          BD: tl.constexpr, HAS_H0: tl.constexpr, HAS_DHT: tl.constexpr,
                          PRECISION: tl.constexpr):
        """One chunk: G_t, then dxbar_t = theta_t G_t, dtheta_t = G_t .
        (x_t - h_{t-1}) and dh0's row a_first G_first at each segment's
        first pair."""
        lo, offs, ok, seg, flags, theta, la, b, same, before, cont, out = _pair_chunk(
            seg_ptr, flag_ptr, theta_ptr, la_ptr, N, C)
        L = _writes(theta, b, b, same, C, False)
        prev = _writes(theta, b - la, b, same, C, True)  # L[t - 1, s]
        e = tl.exp(b - before)
        e_prev = tl.exp(b - la - before)
        causal = offs[None, :] >= offs[:, None]
        later = tl.where(same & causal, tl.exp(tl.minimum(b[None, :] - b[:, None], 0.0)), 0.0)
        # (C,) onto the state carried out
        to_end = tl.where(out, tl.exp(tl.sum(la, 0) - b), 0.0)
        tok = tl.load(tok_ptr + lo + offs, mask=ok, other=0).to(tl.int64)
        keys = tl.load(keys_ptr + lo + offs, mask=ok, other=0)
        pair = tl.load(pair_ptr + lo + offs, mask=ok, other=0).to(tl.int64)
        rms = tl.load(rms_ptr + lo + offs, mask=ok, other=1.0)
        q = tl.load(phi_ptr + lo + offs, mask=ok, other=0.0) / rms
        c = tl.load(c_ptr + lo + offs, mask=ok, other=0.0)
        ends = ok & ((flags & _END) != 0)
        firsts = ok & ((flags & _START) != 0)
        next_row = (tl.program_id(0) + 1) * D
        # one runs on
        end_ok = (tl.zeros([BD], tl.int32) + tl.max(out.to(tl.int32), 0)) > 0
        dtheta = tl.zeros([C], tl.float32)
        for d0 in range(0, D, BD):
            offs_d = d0 + tl.arange(0, BD)
            d_ok = (offs_d < D)[None, :]
            S = _starts(states_ptr, h0_ptr, keys, cont, ok, offs_d, D, C, BD, HAS_H0)
            X = _pair_tile(x_ptr, tok, ok, offs_d, D)
            h = e[:, None] * S + tl.dot(L, X, input_precision=PRECISION)
            g = _direct_grads(dy_ptr, dhT_ptr, tok, keys, ends, ok, q, c, h, offs_d, D, HAS_DHT)
            d_end = tl.load(dstates_ptr + next_row + offs_d, mask=(offs_d < D) & end_ok, other=0.0)
            G = tl.dot(later, g, input_precision=PRECISION) + to_end[:, None] * d_end[None, :]
            tl.store(dx_ptr + pair[:, None] * D + offs_d[None, :], theta[:, None] * G,
                     mask=ok[:, None] & d_ok)
            h_prev = e_prev[:, None] * S + tl.dot(prev, X, input_precision=PRECISION)
            dtheta += tl.sum(G * (X - h_prev), 1)
            if HAS_H0:
                tl.store(dh0_ptr + keys[:, None] * D + offs_d[None, :],
                         (1.0 - theta)[:, None] * G, mask=firsts[:, None] & d_ok)
        tl.store(dtheta_ptr + pair, dtheta, mask=ok)


# -------------------------------------------------------------- sparse scan: Triton device helpers


if triton is not None:

    @triton.jit
    def _pair_chunk(seg_ptr, flag_ptr, theta_ptr, la_ptr, N, C: tl.constexpr):
        """Chunk program_id(0)'s pairs: offsets, mask, segments, flags,
        theta, log-decays, their cumulative sum b, the same-segment
        mask, b before each segment's first pair, and whether a pair's
        segment runs in from the chunk before (cont) or on past this one
        (out)."""
        lo = tl.program_id(0) * C
        offs = tl.arange(0, C)
        ok = lo + offs < N
        seg = tl.load(seg_ptr + lo + offs, mask=ok, other=-1)
        flags = tl.load(flag_ptr + lo + offs, mask=ok, other=0)
        theta = tl.load(theta_ptr + lo + offs, mask=ok, other=0.0)
        la = tl.load(la_ptr + lo + offs, mask=ok, other=0.0)
        b = tl.cumsum(la, 0)  # (C,)
        same = seg[:, None] == seg[None, :]  # (C, C)
        # (C,) its segment's first pair here
        first = tl.min(tl.where(same, offs[None, :], C), 1)
        before = tl.sum(tl.where(offs[None, :] < first[:, None], la[None, :], 0.0), 1)
        runs_in = (tl.load(flag_ptr + lo) & _START) == 0
        cont = (seg == tl.load(seg_ptr + lo)) & runs_in
        last = tl.minimum(N - lo, C) - 1
        has_next = lo + C < N
        next_flags = tl.load(flag_ptr + lo + C, mask=has_next, other=_START)
        out = (seg == tl.load(seg_ptr + lo + last)) & has_next & ((next_flags & _START) == 0)
        return lo, offs, ok, seg, flags, theta, la, b, same, before, cont, out

    @triton.jit
    def _writes(theta, b_to, b, same, C: tl.constexpr, strict: tl.constexpr):
        """L[t, s] = theta_s e^{b_to[t] - b_s} over pairs s <= t
        (s < t if strict) of a segment."""
        offs = tl.arange(0, C)
        causal = offs[:, None] >= offs[None, :]
        if strict:
            causal = offs[:, None] > offs[None, :]
        decay = tl.exp(tl.minimum(b_to[:, None] - b[None, :], 0.0))
        return tl.where(same & causal, theta[None, :] * decay, 0.0)

    @triton.jit
    def _pair_tile(ptr, rows, ok, offs_d, D):
        """Columns offs_d of the rows `rows` (C,) of a (rows, D) array
        as float32 (C, BD)."""
        mask = ok[:, None] & (offs_d < D)[None, :]
        tile = tl.load(ptr + rows[:, None] * D + offs_d[None, :], mask=mask, other=0.0)
        return tile.to(tl.float32)

    @triton.jit
    def _starts(states_ptr, h0_ptr, keys, cont, ok, offs_d, D, C: tl.constexpr, BD: tl.constexpr,
                HAS_H0: tl.constexpr):
        """Each pair's segment start S (C, BD): the carried state of the
        chunk, else h0's row."""
        carried = tl.load(states_ptr + tl.program_id(0) * D + offs_d,
                          mask=offs_d < D, other=0.0)
        if HAS_H0:
            own = _pair_tile(h0_ptr, keys, ok & (cont == 0), offs_d, D)
        else:
            own = tl.zeros([C, BD], tl.float32)
        return tl.where(cont[:, None], carried[None, :], own)

    @triton.jit
    def _direct_grads(dy_ptr, dhT_ptr, tok, keys, ends, ok, q, c, h, offs_d, D,
                      HAS_DHT: tl.constexpr):
        """g = q dy + c h, and dhT's row at a segment's last pair: the
        gradient reaching h_t itself (C, BD)."""
        g = q[:, None] * _pair_tile(dy_ptr, tok, ok, offs_d, D) + c[:, None] * h
        if HAS_DHT:
            g += _pair_tile(dhT_ptr, keys, ends, offs_d, D)
        return g


# ------------------------------------------------ sparse scan: launches, custom ops and public API


def _sparse_layout(idx, theta, phi, n_memory):
    """The sorted pairs as the kernels read them (sparse_dispatch
    without its host syncs): each pair's token, flat index, segment,
    flags (START, END), theta, phi, log-decay and b*M + row; and per
    chunk, where a segment begun in it and running past it starts
    (-1: none) and the chunk of its last pair."""
    B, T, K = idx.shape
    N, C = B * T * K, SPARSE_CHUNK
    keys, order, starts = _sorted_pairs(idx, n_memory)  # (N,)
    ends = torch.ones_like(starts)
    ends[:-1] = starts[1:]
    chunk_last = (torch.arange(1, triton.cdiv(N, C) + 1, device=idx.device) * C).clamp(max=N) - 1
    # the first and last pair of the segment of each chunk's last pair:
    # NC lookups, not N
    first = torch.searchsorted(keys, keys[chunk_last])  # (NC,)
    last = torch.searchsorted(keys, keys[chunk_last], right=True) - 1
    begun_here = first >= chunk_last // C * C
    runs_past = last > chunk_last
    chain = torch.where(begun_here & runs_past, first, -1).int()
    chain_end = (last // C).int()
    weights = [w.flatten()[order].float().contiguous() for w in (theta, phi)]
    flags = (starts.to(torch.int8) * START + ends.to(torch.int8) * END)
    return dict(tok=(order // K).int(), pair=order.int(), seg=(starts.cumsum(0) - 1).int(),
                flags=flags, theta=weights[0], phi=weights[1],
                la=_log_decay(weights[0]).contiguous(), keys=keys, chain=chain, chain_end=chain_end)


def _sparse_meta(x):
    return dict(C=SPARSE_CHUNK, BD=32, PRECISION=_precision(x), num_warps=2)


def _pair_sum(pairs, B, T, dtype):
    """(N, D) per (token, slot) pair -> (B, T, D): each token's K pairs
    added in float32."""
    return pairs.view(B, T, -1, pairs.shape[-1]).sum(2, dtype=torch.float32).to(dtype)


LAYOUT = ('tok', 'pair', 'seg', 'flags', 'theta', 'phi', 'la', 'keys', 'chain', 'chain_end')


@torch.library.custom_op("fm::sparse_scan_forward", mutates_args=())
def _sparse_forward(xbar: Tensor, idx: Tensor, theta: Tensor, phi: Tensor, h0: Optional[Tensor],
                    n_memory: int, eps: float
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                               Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """y, hT, the carried states and each pair's rms, then the layout
    (LAYOUT)."""
    B, T, D = xbar.shape
    x = xbar.contiguous()
    lay = _sparse_layout(idx, theta, phi, n_memory)
    N, NC = idx.numel(), triton.cdiv(idx.numel(), SPARSE_CHUNK)
    starts = None if h0 is None else h0.float().contiguous()
    states = x.new_empty(NC, D, dtype=torch.float32)
    meta = _sparse_meta(x)
    _sparse_carry_kernel[(NC, triton.cdiv(D, 64))](
        x, lay['tok'], lay['theta'], lay['la'], lay['keys'], lay['chain'], lay['chain_end'], starts,
        states, D, C=SPARSE_CHUNK, BD=64, HAS_H0=h0 is not None, num_warps=4)
    pairs = x.new_empty(N, D)
    rms = x.new_empty(N, dtype=torch.float32)
    hT = x.new_zeros(B, n_memory, D, dtype=torch.float32) if h0 is None else starts.clone()
    _sparse_out_kernel[(NC,)](
        x, lay['tok'], lay['pair'], lay['seg'], lay['flags'], lay['theta'], lay['phi'], lay['la'],
        lay['keys'], starts, states, pairs, rms, hT, N, D, eps, HAS_H0=h0 is not None, **meta)
    return _pair_sum(pairs, B, T, x.dtype), hT, states, rms, *(lay[k] for k in LAYOUT)


@_sparse_forward.register_fake
def _(xbar, idx, theta, phi, h0, n_memory, eps):
    B, T, D = xbar.shape
    N = idx.numel()
    NC = -(-N // SPARSE_CHUNK)
    f32 = lambda *shape: xbar.new_empty(shape, dtype=torch.float32)
    i32 = lambda *shape: idx.new_empty(shape, dtype=torch.int32)
    layout = [i32(N), i32(N), i32(N), idx.new_empty(N, dtype=torch.int8), f32(N), f32(N), f32(N),
              idx.new_empty(N), i32(NC), i32(NC)]
    return xbar.new_empty(B, T, D), f32(B, n_memory, D), f32(NC, D), f32(N), *layout


@torch.library.custom_op("fm::sparse_scan_backward", mutates_args=())
def _sparse_backward(dy: Tensor, dhT: Optional[Tensor], xbar: Tensor, h0: Optional[Tensor],
                     states: Tensor, rms: Tensor, tok: Tensor, pair: Tensor, seg: Tensor,
                     flags: Tensor, theta: Tensor, phi: Tensor, la: Tensor, keys: Tensor,
                     chain: Tensor, chain_end: Tensor, eps: float
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """dxbar (B, T, D); dtheta and dphi float32 (B, T, K); dh0 (B, M, D)
    (zeros without h0)."""
    B, T, D = xbar.shape
    x, dy = xbar.contiguous(), dy.contiguous()
    N, NC = theta.numel(), states.shape[0]
    starts = None if h0 is None else h0.float().contiguous()
    if dhT is not None:
        dhT = dhT.float().contiguous()
    lay = (tok, pair, seg, flags, theta, phi, la, keys)
    flags_h = dict(HAS_H0=h0 is not None, HAS_DHT=dhT is not None)
    meta = _sparse_meta(x)
    c = torch.empty_like(rms)
    dphi = torch.empty_like(rms)
    local = torch.empty_like(states)
    _sparse_grads_kernel[(NC,)](x, dy, dhT, *lay, starts, states, rms, c, dphi, local, N, D,
                                **flags_h, **meta)
    dstates = torch.empty_like(states)
    _sparse_carry_grads_kernel[(NC, triton.cdiv(D, 64))](la, chain, chain_end, local, dstates, N, D,
                                                         C=SPARSE_CHUNK, BD=64, num_warps=4)
    pairs = x.new_empty(N, D)
    dtheta = torch.empty_like(rms)
    dh0 = x.new_zeros(0, dtype=torch.float32)
    if h0 is not None:
        dh0 = x.new_zeros(h0.shape, dtype=torch.float32) if dhT is None else dhT.clone()
    _sparse_dx_kernel[(NC,)](x, dy, dhT, *lay, starts, states, rms, c, dstates, pairs, dtheta, dh0,
                             N, D, **flags_h, **meta)
    K = N // (B * T)
    return _pair_sum(pairs, B, T, x.dtype), dtheta.view(B, T, K), dphi.view(B, T, K), dh0


@_sparse_backward.register_fake
def _(dy, dhT, xbar, h0, states, rms, tok, pair, seg, flags, theta, phi, la, keys, chain,
      chain_end, eps):
    B, T, D = xbar.shape
    K = theta.numel() // (B * T)
    f32 = lambda *shape: xbar.new_empty(shape, dtype=torch.float32)
    dh0 = f32(0) if h0 is None else f32(*h0.shape)
    return xbar.new_empty(B, T, D), f32(B, T, K), f32(B, T, K), dh0


def _sparse_setup_context(ctx, inputs, output):
    xbar, idx, theta, phi, h0, n_memory, eps = inputs
    ctx.save_for_backward(xbar, h0, *output[2:])
    ctx.eps, ctx.dtypes = eps, (theta.dtype, phi.dtype)
    ctx.set_materialize_grads(False)


def _sparse_grads(ctx, dy, dhT, *unused):
    xbar, h0, *saved = ctx.saved_tensors
    if dy is None:
        dy = torch.zeros_like(xbar)
    dx, dtheta, dphi, dh0 = _sparse_backward(dy, dhT, xbar, h0, *saved, ctx.eps)
    dh0 = None if h0 is None else dh0
    return dx, None, dtheta.to(ctx.dtypes[0]), dphi.to(ctx.dtypes[1]), dh0, None, None


_sparse_forward.register_autograd(_sparse_grads, setup_context=_sparse_setup_context)


def fm_sparse_scan(xbar, idx, theta, phi, n_memory, h0=None, eps=1e-6):
    """Triton sparse FM scan (forward and backward),
    fm_sparse_scan_torch's arguments -> y (B, T, D), hT (B, M, D)
    float32. Work and memory follow B*T*K*D at any n_memory; idx is
    trusted (fm_sparse_scan_torch checks its rows)."""
    _check_sparse_args(xbar, idx, theta, phi, n_memory, h0, eps)
    chunks = -(-idx.numel() // SPARSE_CHUNK)
    if idx.numel() >= 2**31 or (chunks + 1) * xbar.shape[-1] >= 2**31:
        raise ValueError(f"fm_sparse_scan indexes with 32-bit integers: B*T*K = {idx.numel():,} "
                         "pairs are too many for one call; split the batch into calls of fewer "
                         "tokens")
    y, hT, *_ = _sparse_forward(xbar, idx, theta, phi, h0, int(n_memory), float(eps))
    return y, hT


# -------------------------------------------------------------------------- decode step: references


def fm_step_naive(h, xbar, idx, theta, phi, eps=1e-6):
    """One decode step: reads and updates only rows idx of h (in place);
    returns y (B, D)."""
    D = h.shape[-1]
    rows_idx = idx[..., None].expand(-1, -1, D)  # (B, K, D)
    write = theta[..., None].to(h.dtype)  # (B, K, 1)
    # (B, K, D)
    rows = (1 - write) * h.gather(1, rows_idx) + write * xbar[:, None, :].to(h.dtype)
    h.scatter_(1, rows_idx, rows)
    rms = torch.sqrt(rows.pow(2).mean(-1) + eps)  # (B, K)
    return ((phi.to(h.dtype) / rms)[..., None] * rows).sum(1).to(xbar.dtype)


def route_naive(scores, top_k, tau):
    """The router from its scores (..., M + 2), float32 or float64:
    W_alpha x, then the logits of eta and mu (biases included). -> idx
    (..., K), the top_k rows of the softmax of W_alpha x / tau
    (None when top_k = M), alpha (..., K) their probabilities
    renormalised to sum to 1 (all M when dense), eta and mu (..., 1)."""
    logits, rate_logits = scores[..., :-2], scores[..., -2:]
    probs = torch.softmax(logits / tau, dim=-1)  # (..., M)
    idx, alpha = None, probs
    if top_k < probs.shape[-1]:
        # torch.compile generates a kernel for a sort of m values;
        ranked, order = probs.sort(-1, descending=True)
        alpha, idx = ranked[..., :top_k], order[..., :top_k]  # topk is a library call
        alpha = alpha / alpha.sum(-1, keepdim=True)
    rates = torch.sigmoid(rate_logits)  # (..., 2)
    return idx, alpha, rates[..., :1], rates[..., 1:]


def conv_step_naive(x, window, weight, bias):
    """Causal depthwise convolution + SiLU of one token x (B, C) after
    the window (B, C, W - 1) of the inputs before it, which moves on in
    place; weight (C, W), bias (C,). Computed in at least float32 ->
    (B, C)."""
    inputs = torch.cat([window, x[..., None].to(window.dtype)], dim=-1)  # (B, C, W)
    window.copy_(inputs[..., 1:])
    weight = weight.to(torch.promote_types(x.dtype, torch.float32))
    return F.silu((inputs * weight).sum(-1) + bias.to(weight.dtype)).to(x.dtype)


def causal_conv(x, window, weight, bias, lengths=None):
    """conv_step_naive over a sequence: x (B, T, C) after window
    (B, C, W - 1), the inputs before it (None: zeros), weight (C, W),
    bias (C,) -> (B, T, C), and the new window: the W - 1 inputs before
    each row's end (lengths (B,); None: T). W shifted multiply-adds in
    x's layout, in float32 at least: elementwise work that inductor
    fuses (F.conv1d wants (B, C, T): two transposes, and cuDNN's
    depthwise kernels outside the fusions)."""
    T, W = x.shape[1], weight.shape[-1]
    before = x.new_zeros(len(x), W - 1, x.shape[-1]) if window is None else window.transpose(1, 2)
    inputs = torch.cat([before.to(x.dtype), x], dim=1)  # (B, W - 1 + T, C)
    weight = weight.to(torch.promote_types(x.dtype, torch.float32))
    # (B, T, C)
    out = sum((inputs[:, i:i + T] * weight[:, i] for i in range(W)), bias.to(weight.dtype))
    ends = lengths
    if lengths is None:
        ends = torch.full((len(x),), T, device=x.device)
    taps = ends[:, None] + torch.arange(W - 1, device=x.device)  # (B, W - 1)
    # (B, W - 1, C)
    window = inputs.gather(1, taps[..., None].expand(-1, -1, inputs.shape[-1]))
    return F.silu(out).to(x.dtype), window.transpose(1, 2)


def fm_route_step_naive(h, xbar, scores, top_k, tau, eps=1e-6, z=None, conv=None):
    """route_naive on scores (B, M + 2), then fm_step_naive on the rows
    it selects; returns y (B, D). FM's block: conv
    (window, weight, bias) turns xbar into conv_step_naive(xbar, *conv)
    first, z gates y: y * silu(z)."""
    if conv is not None:
        xbar = conv_step_naive(xbar, *conv)
    idx, alpha, eta, mu = route_naive(scores, top_k, tau)
    if idx is None:
        idx = torch.arange(h.shape[1], device=h.device).expand(h.shape[0], -1)  # (B, M)
    y = fm_step_naive(h, xbar, idx, eta * alpha, mu * alpha, eps)
    if z is not None:
        y = y * F.silu(z)
    return y


# ---------------------------------------------------------------------- decode step: Triton kernel


if triton is not None:

    @triton.jit
    def _step_kernel(h_ptr, x_ptr, idx_ptr, theta_ptr, phi_ptr, scores_ptr, y_ptr, z_ptr,
                     window_ptr, w_ptr,
                     bias_ptr, eps, tau, D, M, K, S, X_STRIDE, Z_STRIDE,
                     BK: tl.constexpr, BD: tl.constexpr, ONE_PASS: tl.constexpr,
                     ROUTE: tl.constexpr,
                     BM: tl.constexpr, DENSE: tl.constexpr, TAPS: tl.constexpr, BW: tl.constexpr,
                     GATE: tl.constexpr):
        """One decode step of sequence bi on its K rows: h_k <- (1 - theta_k) h_k + theta_k x, then
        y = sum_k phi_k h_k / rms(h_k). ROUTE: the rows, theta and phi come from the router's scores
        (_route; rows S apart), else from idx, theta and phi. ONE_PASS (BD covers D): the rows are
        loaded at once, updated and stored, and y comes from registers; else two passes over D, BD
        columns at a time, the second re-reading the rows. FM's block: TAPS > 0 convolves x first
        (_xbar), GATE multiplies y by silu(z) (_gate, _gated)."""
        bi = tl.program_id(0)
        x_ptr += bi * X_STRIDE
        if GATE:
            z_ptr += bi * Z_STRIDE
        if TAPS > 1:
            window_ptr += bi * D * (TAPS - 1)
        # the window first: the loads after its barrier (z, the router's scores) are issued together
        if ONE_PASS:
            offs_d = tl.arange(0, BD)
            x = _xbar(x_ptr, window_ptr, w_ptr, bias_ptr, offs_d, D, BD, TAPS, BW)  # (BD,)
            gate = _gate(z_ptr, offs_d, D, GATE)
        offs_k = tl.arange(0, BK)
        k_ok = offs_k < K
        if ROUTE:
            rows, write, phi = _route(scores_ptr + bi * S, tau, M, K, offs_k, BM, DENSE)
        else:
            rows = tl.load(idx_ptr + bi * K + offs_k, mask=k_ok, other=0)  # (BK,)
            write = tl.load(theta_ptr + bi * K + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            phi = tl.load(phi_ptr + bi * K + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        write = write[:, None]  # (BK, 1)
        row_ptrs = h_ptr + bi * M * D + rows[:, None] * D  # (BK, 1)
        if ONE_PASS:
            h = _step_rows(row_ptrs, x, write, offs_d, k_ok, D)  # (BK, BD)
            sq_norm = tl.sum(h * h, axis=1)
        else:
            sq_norm = tl.zeros([BK], dtype=tl.float32)
            for d0 in range(0, D, BD):
                offs_d = d0 + tl.arange(0, BD)
                x = _xbar(x_ptr, window_ptr, w_ptr, bias_ptr, offs_d, D, BD, TAPS, BW)  # (BD,)
                h = _step_rows(row_ptrs, x, write, offs_d, k_ok, D)  # (BK, BD)
                sq_norm += tl.sum(h * h, axis=1)
            tl.debug_barrier()  # the second pass reads rows that other threads stored
        read = phi / tl.sqrt(sq_norm / D + eps)  # (BK,)
        if ONE_PASS:
            y = _gated(tl.sum(read[:, None] * h, axis=0), gate, z_ptr, GATE)
            tl.store(y_ptr + bi * D + offs_d, y.to(y_ptr.dtype.element_ty), mask=offs_d < D)
        else:
            for d0 in range(0, D, BD):
                offs_d = d0 + tl.arange(0, BD)
                h = tl.load(row_ptrs + offs_d[None, :], mask=k_ok[:, None] & (offs_d < D)[None, :],
                            other=0.0)
                y = _gated(tl.sum(read[:, None] * h, axis=0), _gate(z_ptr, offs_d, D, GATE), z_ptr,
                           GATE)
                tl.store(y_ptr + bi * D + offs_d, y.to(y_ptr.dtype.element_ty), mask=offs_d < D)


# -------------------------------------------------------------- decode step: Triton device helpers


if triton is not None:

    @triton.jit
    def _xbar(x_ptr, window_ptr, w_ptr, bias_ptr, offs_d, D, BD: tl.constexpr, TAPS: tl.constexpr,
                BW: tl.constexpr):
        """xbar's columns offs_d (BD,) in float32: x, or with TAPS > 0
        conv_step_naive's silu(sum_j w_j u_j + bias) over the window u
        of the TAPS - 1 inputs before x and x itself; the window (D,
        TAPS - 1, padded to BW columns here) moves on by x. The window
        is read in one load before one barrier and stored after it (not
        a load, a barrier and a store a tap)."""
        ok = offs_d < D
        x = tl.load(x_ptr + offs_d, mask=ok, other=0.0)  # (BD,)
        if TAPS == 0:
            xbar = x.to(tl.float32)
        else:
            u = x.to(w_ptr.dtype.element_ty)  # the window's dtype, the weight's
            acc = tl.zeros([BD], dtype=tl.float32)
            if TAPS > 1:
                offs_w = tl.arange(0, BW)
                cols = ok[:, None] & (offs_w < TAPS - 1)[None, :]
                at = offs_d[:, None] * (TAPS - 1) + offs_w[None, :]  # (BD, BW)
                window = tl.load(window_ptr + at, mask=cols, other=0.0)
                w = tl.load(w_ptr + offs_d[:, None] * TAPS + offs_w[None, :], mask=cols, other=0.0)
                products = w.to(tl.float32) * window.to(tl.float32)  # (BD, BW)
                # in conv_step_naive's order; one product plus zeros:
                # exact
                for j in tl.static_range(TAPS - 1):
                    acc += tl.sum(tl.where(offs_w[None, :] == j, products, 0.0), axis=1)
                # threads may hold copies of a column: all have read the
                # window before a store
                tl.debug_barrier()
                # u_j -> column j - 1
                tl.store(window_ptr + at - 1, window, mask=cols & (offs_w >= 1)[None, :])
                tl.store(window_ptr + offs_d * (TAPS - 1) + TAPS - 2, u, mask=ok)
            acc += tl.load(w_ptr + offs_d * TAPS + TAPS - 1, mask=ok,
                           other=0.0).to(tl.float32) * u.to(tl.float32)
            acc += tl.load(bias_ptr + offs_d, mask=ok, other=0.0).to(tl.float32)
            # rounded as the reference
            xbar = (acc * tl.sigmoid(acc)).to(x_ptr.dtype.element_ty).to(tl.float32)
        return xbar

    @triton.jit
    def _gate(z_ptr, offs_d, D, GATE: tl.constexpr):
        """silu(z) at columns offs_d (BD,) in float32, rounded to z's
        dtype as fm_route_step_naive rounds (GATE)."""
        gate = 1.0
        if GATE:
            z = tl.load(z_ptr + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
            gate = (z * tl.sigmoid(z)).to(z_ptr.dtype.element_ty).to(tl.float32)
        return gate

    @triton.jit
    def _gated(y, gate, z_ptr, GATE: tl.constexpr):
        """y (BD,) float32, rounded to z's dtype, times the gate (_gate)
        with GATE."""
        if GATE:
            y = y.to(z_ptr.dtype.element_ty).to(tl.float32) * gate
        return y

    @triton.jit
    def _step_rows(row_ptrs, x, write, offs_d, k_ok, D):
        """Columns offs_d (BK, BD) of a step's rows after its write of x
        (BD,), h <- (1 - theta) h + theta x, stored back."""
        mask = k_ok[:, None] & (offs_d < D)[None, :]
        h = tl.load(row_ptrs + offs_d[None, :], mask=mask, other=0.0)
        h = (1.0 - write) * h + write * x[None, :]
        tl.store(row_ptrs + offs_d[None, :], h, mask=mask)
        return h

    @triton.jit
    def _route(scores_ptr, tau, M, K, offs_k, BM: tl.constexpr, DENSE: tl.constexpr):
        """-> rows, theta, phi (BK,) of a token from its scores (M + 2):
        the K largest of the logits W_alpha x
        (all M in order when DENSE), theta = eta alpha and phi = mu
        alpha, alpha the softmax of the selected logits / tau among
        themselves (the full softmax renormalised over the top K), eta
        and mu the sigmoids of the rate logits. Row i takes slot rank_i,
        the number of rows ahead of it (larger, or equal and first; NaN
        counts as +inf, so that ranks stay a permutation and no other
        sequence's rows are touched): a few reductions, no loop over
        K."""
        offs_m = tl.arange(0, BM)
        # (BM,)
        logits = tl.load(scores_ptr + offs_m, mask=offs_m < M, other=float("-inf"))
        if not DENSE:
            key = tl.where(logits != logits, float("inf"), logits)
            ahead = (key[None, :] > key[:, None]) | ((key[None, :] == key[:, None]) &
                                                      # (BM, BM): j
                                                      # before i
                                                      (offs_m[None, :] < offs_m[:, None]))
            rank = tl.sum(ahead.to(tl.int32), axis=1)  # (BM,)
            slot = rank[None, :] == offs_k[:, None]  # (BK, BM): row i fills slot rank_i
            rows = tl.sum(tl.where(slot, offs_m[None, :], 0), axis=1)  # (BK,)
            picked = tl.sum(tl.where(slot, logits[None, :], 0.0), axis=1)
            picked = tl.where(offs_k < K, picked, float("-inf"))
        else:
            rows, picked = offs_k, logits  # K = M, BK = BM
        weights = tl.exp((picked - tl.max(picked, axis=0)) / tau)  # (BK,), 0 past K
        alpha = weights / tl.sum(weights, axis=0)
        eta = tl.sigmoid(tl.load(scores_ptr + M).to(tl.float32))
        mu = tl.sigmoid(tl.load(scores_ptr + M + 1).to(tl.float32))
        return rows, eta * alpha, mu * alpha


# ----------------------------------------- decode step: launch settings, custom ops and public API


def _step_meta(K, D):
    """Launch settings of _step_kernel: a sequence's rows in one tile
    when it holds at most STEP_TILE elements (one pass, 8 warps), else
    two passes of 8192 elements at a time on 4 warps
    (dense K = M = 64 at D = 2048)."""
    BK, width = max(2, triton.next_power_of_2(K)), triton.next_power_of_2(D)
    if BK * width <= STEP_TILE:
        return dict(BK=BK, BD=width, ONE_PASS=True, num_warps=8)
    return dict(BK=BK, BD=min(width, max(64, 8192 // BK)), ONE_PASS=False, num_warps=4)


def _unit_stride(x):
    """x, copied only where its last dimension is not contiguous
    (None stays None)."""
    return x if x is None or x.stride(-1) == 1 else x.contiguous()


@torch.library.custom_op("fm::step", mutates_args={"h"})
def _step(h: Tensor, xbar: Tensor, idx: Tensor, theta: Tensor, phi: Tensor, eps: float) -> Tensor:
    """y (B, D); rows idx of h updated in place."""
    B, M, D = h.shape
    x = _unit_stride(xbar)
    y = xbar.new_empty(B, D)
    _step_kernel[(B,)](h, x, idx.contiguous(), theta.contiguous(), phi.contiguous(), None, y, None,
                       None, None, None,
                       eps, 1.0, D, M, idx.shape[1], 0, x.stride(0), 0, ROUTE=False, BM=1,
                       DENSE=False, TAPS=0,
                       BW=2, GATE=False, **_step_meta(idx.shape[1], D))
    return y


@_step.register_fake
def _(h, xbar, idx, theta, phi, eps):
    return torch.empty_like(xbar, memory_format=torch.contiguous_format)


@torch.library.custom_op("fm::route_step", mutates_args={"h", "window"})
def _route_step(h: Tensor, xbar: Tensor, scores: Tensor, top_k: int, tau: float, eps: float,
                z: Optional[Tensor],
                window: Optional[Tensor], weight: Optional[Tensor],
                bias: Optional[Tensor]) -> Tensor:
    """y (B, D); the top_k rows the scores select updated in place
    (and the convolution's window)."""
    B, M, D = h.shape
    # rows may be strided (chunks, pads)
    x, z, scores = _unit_stride(xbar), _unit_stride(z), _unit_stride(scores)
    y = xbar.new_empty(B, D)
    taps = 0 if weight is None else weight.shape[-1]
    if taps <= 1:  # one tap: an empty window
        window = None
    _step_kernel[(B,)](h, x, None, None, None, scores, y, z, window, weight, bias, eps, tau, D, M,
                       top_k,
                       scores.stride(0), x.stride(0), 0 if z is None else z.stride(0), ROUTE=True,
                       BM=max(2, triton.next_power_of_2(M)), DENSE=top_k == M, TAPS=taps,
                       BW=max(2, triton.next_power_of_2(taps - 1)), GATE=z is not None,
                       **_step_meta(top_k, D))
    return y


@_route_step.register_fake
def _(h, xbar, scores, top_k, tau, eps, z, window, weight, bias):
    return xbar.new_empty(xbar.shape)


def _check_step_state(h):
    if h.dtype != torch.float32 or not h.is_contiguous():
        raise ValueError("the decode state h must be a contiguous float32 tensor (B, M, D)")


def _check_block(h, xbar, z, conv):
    """fm_route_step's xbar (B, D), its gate z (B, D) in xbar's dtype
    and its convolution (window (B, D, W - 1) in the weight's dtype,
    weight (D, W), bias (D,), contiguous): the kernel indexes them by
    these shapes."""
    B, _, D = h.shape
    got = f"xbar {xbar.dtype} {tuple(xbar.shape)}"
    bad = xbar.shape != (B, D)
    if z is not None:
        got += f", z {z.dtype} {tuple(z.shape)}"
        bad = bad or z.shape != (B, D) or z.dtype != xbar.dtype
    if bad:
        raise ValueError(f"xbar and z must be (B, D) = {(B, D)} of one dtype, got {got}")
    if conv is not None:
        window, weight, bias = conv
        W = weight.shape[-1]
        shapes = [tuple(t.shape) for t in conv]
        want = [(B, D, W - 1), (D, W), (D,)]
        contiguous = all(t.is_contiguous() for t in conv)
        if shapes != want or not contiguous or window.dtype != weight.dtype:
            raise ValueError(f"the convolution's window, weight and bias must be contiguous "
                             f"(B, D, W - 1), (D, W), (D,) = {want}, the window in the "
                             f"weight's dtype; got {shapes}, {window.dtype} and {weight.dtype}")


def fm_step(h, xbar, idx, theta, phi, eps=1e-6):
    """Triton decode step: loads, updates and stores only rows idx of h;
    returns y (B, D). A custom op (fm::step): torch.compile traces a
    decode step through it and CUDA graphs capture it."""
    _check_step_state(h)
    return _step(h, xbar, idx, theta, phi, float(eps))


def fm_route_step(h, xbar, scores, top_k, tau=1.0, eps=1e-6, z=None, conv=None):
    """Triton decode step with its router
    (fm_route_step_naive in one kernel): selects the top_k rows from
    scores (B, M + 2) float32, then updates them as fm_step does;
    returns y (B, D). FM's block: conv (window (B, D, W - 1) contiguous,
    weight (D, W), bias (D,)) convolves xbar first, z (B, D) gates y;
    tau a number or a tensor (one's own, learned). A custom op
    (fm::route_step)."""
    _check_step_state(h)
    if scores.dtype != torch.float32 or scores.shape != (h.shape[0], h.shape[1] + 2):
        raise ValueError(f"scores must be float32 (B, M + 2) = {(h.shape[0], h.shape[1] + 2)}, "
                         f"got {scores.dtype} {tuple(scores.shape)}")
    if not 1 <= top_k <= h.shape[1]:
        raise ValueError(f"top_k must be in [1, M = {h.shape[1]}], got {top_k}")
    _check_block(h, xbar, z, conv)
    # a learned temperature: the logits divided here, no host sync
    if isinstance(tau, Tensor):
        scores, tau = torch.cat([scores[:, :-2] / tau, scores[:, -2:]], -1), 1.0
    window = weight = bias = None
    if conv is not None:
        window, weight, bias = conv
    return _route_step(h, xbar, scores, int(top_k), float(tau), float(eps), z, window, weight, bias)


class DecodingError(NotImplementedError):
    """A layer whose decoding step would not compute what its forward
    pass does: one line naming its class, why, and what to do."""


def _all_rows(idx, weights, n_memory):
    """theta, phi of the rows idx (..., K) -> of all M rows, zeros
    elsewhere (idx None: as is)."""
    if idx is None:
        return list(weights)
    zeros = weights[0].new_zeros(*idx.shape[:-1], n_memory)
    return [zeros.scatter(-1, idx, w) for w in weights]


def _written(layer, x):
    """An FM layer's theta, phi of x (..., d_model), weights(*route(x)),
    of all its M rows."""
    idx, *routed = layer.route(x)
    return _all_rows(idx, layer.weights(idx, *routed), layer.n_memory)


def _same(got, want):
    """Whether the weights got are want's to 1e-9 at each token
    (float64 rounding, many times)."""
    return all(a.shape == b.shape and ((a - b).norm(dim=-1) <= 1e-9 * b.norm(dim=-1)).all()
               for a, b in zip(got, want))


def _refusal(layer, why):
    name = f"{type(layer).__module__}:{type(layer).__qualname__}"
    return DecodingError(f"{name} does not decode: {why}")


@torch.no_grad()
def route_step_takes_over(layer, tokens_alone=True):
    """Whether fm_route_step may stand in for an FM layer's route and weights (as written) after its
    router_scores, for any values of its parameters: on a float64 copy of the layer with every
    parameter and floating buffer random (uniform in [-1, 1]), at 40 probe inputs of scales 0.01 to
    100, weights(*route(x)) are the theta and phi of route_naive(router_scores(x)) to 1e-9 a token;
    and at the layer's own dtype router_scores gives (1, M + 2) scores in float32 at least (the
    kernel's). A layer that fails to run on the probe is refused too. tokens_alone (a layer whose
    step is FactorizationMemory's): DecodingError where the weights at a token read other tokens
    (the inputs as 5 sequences of 8, a random half of them changed: the others' weights move), or
    where a step's tokens (B, d_model) get other weights than the same in sequences (B, T, d_model).
    """
    weight = layer.in_proj.weight
    device = weight.device
    if device.type == "mps":  # no float64
        device = torch.device("cpu")
    gen = torch.Generator(device).manual_seed(0)

    def random(t):
        values = t.new_empty(t.shape, dtype=torch.float64, device=device)
        values.uniform_(-1, 1, generator=gen)
        if isinstance(t, torch.nn.Parameter):
            return torch.nn.Parameter(values, t.requires_grad)
        return values

    def inputs():  # (5, 8, d_model): sequence i at scale 10^(i - 2) / sqrt(d_model)
        x = torch.randn(5, 8, d, generator=gen, dtype=torch.float64, device=device)
        return x * scales[:, None, None]

    tensors = [*layer.parameters(), *layer.buffers()]
    copy = deepcopy(layer, {id(t): random(t) for t in tensors if t.is_floating_point()})
    d = layer.router.in_features
    scales = torch.logspace(-2, 2, 5, dtype=torch.float64, device=device) / d**0.5
    x = inputs()
    changed = torch.rand(5, 8, 1, generator=gen, device=device) < 0.5
    try:
        in_sequences = _written(copy, x)  # as the forward pass routes them
        others_changed = _written(copy, torch.where(changed, inputs(), x))
    except Exception:  # an edit the probe cannot run (a dtype, a shape)
        return False
    if not all(w.isfinite().all() for w in in_sequences + others_changed):
        return False  # at these random parameters (a log of one of them, say): not probed
    kept = [[w.masked_fill(changed, 0) for w in ws] for ws in (others_changed, in_sequences)]
    if tokens_alone and not _same(*kept):
        raise _refusal(layer, "its routing at a token moves when only other tokens change, and a "
                              "decoding step sees one token; give it a step of its own that keeps "
                              "what its router reads")
    x = x.flatten(0, 1)  # (40, d_model): as steps route them
    try:
        written = _written(copy, x)
        twin_idx, alpha, eta, mu = route_naive(copy.router_scores(x), copy.top_k, copy.tau)
        twin = _all_rows(twin_idx, [eta * alpha, mu * alpha], layer.n_memory)  # rows in any order
        own = layer.router_scores(weight.new_zeros(1, d))
    except Exception:
        return False
    if tokens_alone and not _same(written, [w.flatten(0, 1) for w in in_sequences]):
        raise _refusal(layer, "it routes a step's tokens (B, d_model) otherwise than the forward "
                              "pass's (B, T, d_model); route both alike, or give it a step of its "
                              "own")
    want = torch.promote_types(weight.dtype, torch.float32)
    return _same(written, twin) and own.dtype == want and own.shape == (1, layer.n_memory + 2)


# ----------------------------------------------------------------------- decode product: reference
#
# At batch 1 a decoding step is a chain of one-row products, each
# reading its whole weight once: the step's speed is the bandwidth they
# reach. inductor writes a one-row product as a reduction, fast alone,
# but inside a compiled step it fuses SwiGLU's silu(gate) * up into the
# down product's loads, where every program recomputes it: 38% of the
# copy bandwidth (docs/kernel_log.md). decode_product is a custom op, so
# that its input is computed once; it streams the weight in (BN, BK)
# tiles, STAGES of them in flight, one program per BN outputs.
# model.SwiGLU takes it through decode_linear.


def decode_product_naive(x, weight):
    """x (1, K), weight (N, K) -> x W^T (1, N): the reference."""
    return F.linear(x, weight)


# ------------------------------------------------------------------- decode product: Triton kernel


if triton is not None:
    @triton.jit
    def _decode_product_kernel(x_ptr, w_ptr, y_ptr, N, K, BN: tl.constexpr,
                               BK: tl.constexpr, STAGES: tl.constexpr,
                               ACC: tl.constexpr):
        """Outputs [pid BN, pid BN + BN): the (BN, K) slab of the weight
        in BK-wide tiles, STAGES of them in flight, times x, summed in
        ACC."""
        offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
        acc = tl.zeros((BN,), dtype=ACC)
        for k0 in tl.range(0, K, BK, num_stages=STAGES):
            offs_k = k0 + tl.arange(0, BK)
            k_ok = offs_k < K
            mask = (offs_n < N)[:, None] & k_ok[None, :]
            w_ptrs = w_ptr + offs_n[:, None] * K + offs_k[None, :]
            w = tl.load(w_ptrs, mask=mask, other=0.0).to(ACC)  # (BN, BK)
            x = tl.load(x_ptr + offs_k, mask=k_ok, other=0.0).to(ACC)  # (BK,)
            acc += tl.sum(w * x[None, :], axis=1)
        tl.store(y_ptr + offs_n, acc.to(y_ptr.dtype.element_ty), mask=offs_n < N)


# --------------------------------------- decode product: launch settings, custom op and public API


def _decode_product_meta(K):
    """Launch settings, the best of a sweep at fm_1b's down product
    (K = 5,504 inputs, N = 2048 outputs) on an H200
    (docs/kernel_log.md): 8 outputs a program, 1024-wide tiles, 3 in
    flight, 4 warps."""
    return dict(BN=8, BK=min(1024, triton.next_power_of_2(K)), STAGES=3, num_warps=4)


@torch.library.custom_op("fm::decode_product", mutates_args=())
def _decode_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T (1, N) in x's dtype."""
    N, K = weight.shape
    meta = _decode_product_meta(K)
    y = x.new_empty(1, N)
    acc = tl.float32
    if x.dtype == torch.float64:
        acc = tl.float64
    grid = (triton.cdiv(N, meta["BN"]),)
    _decode_product_kernel[grid](x.contiguous(), weight.contiguous(), y, N, K, ACC=acc, **meta)
    return y


@_decode_product.register_fake
def _(x, weight):
    return x.new_empty(1, weight.shape[0])


def decode_product(x, weight):
    """Triton x W^T for one row x (1, K) and weight (N, K) of x's dtype
    -> (1, N)."""
    one_row = x.dim() == 2 and x.shape[0] == 1 and weight.dim() == 2
    if not one_row or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x must be one row (1, K) and weight (N, K) with the same K, "
                         f"got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype != weight.dtype:
        raise ValueError(f"x and weight must have one dtype, got {x.dtype} and {weight.dtype}")
    return _decode_product(x, weight)


def decode_linear(x, weight):
    """A decoding step's product x (B, K) W^T: the Triton product for
    one row on CUDA in half precision, F.linear elsewhere (for more rows
    this kernel is far slower than cuBLAS's, docs/kernel_log.md)."""
    half = x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
    one_row = x.dim() == 2 and x.shape[0] == 1
    if triton is not None and x.is_cuda and one_row and half:
        return decode_product(x, weight)
    return F.linear(x, weight)


def router_linear(x, weight, bias):
    """F.linear(x, weight, bias), but in a compiled decoding step
    (x (B, K)) the same product as one reduction, which inductor fuses
    with the casts (docs/kernel_log.md, change 61)."""
    if x.dim() == 2 and torch.compiler.is_compiling():
        return (x[:, None, :] * weight).sum(-1) + bias
    return F.linear(x, weight, bias)
