"""
A LLaMA-style decoder whose sequence mixer is Factorization Memory ('fm'), causal attention ('attn')
or Mamba-2 ('mamba2'). Every mixer has a parallel path (training, prefill) and a one-token step
path (decoding) that agree to rounding.

Factorization Memory ("Language Modeling With Factorization Memory", Section 3), per token x:
    alpha = softmax(W_alpha x / tau)        (m)  router; sparse keeps the top-k, renormalised to sum 1
    eta, mu = sigmoid(w_eta.x + b_eta), sigmoid(w_mu.x + b_mu)
    theta, phi = eta * alpha, mu * alpha     (m)  write and read weights, zero outside the top-k
    h[i] = (1 - theta[i]) h[i] + theta[i] W_i x                 for each memory row i
    y = W_o sum_i phi[i] h[i] / rms(h[i])
The recurrence itself lives in fm_kernel.py.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import fm_kernel
import gemv

try:  # optional fused Mamba-2 scan and decode step for CUDA tensors; the pure PyTorch ones below are the reference
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
except ImportError:
    mamba_chunk_scan_combined = selective_state_update = None

MIXERS = ('fm', 'attn', 'mamba2')
CENTER_MOMENTUM = 0.01  # router_center: the weight of each training batch's mean in the running mean
PEAK_BF16_FLOPS = {'A100': 312e12, 'H100': 989e12, 'H200': 989e12}  # dense, per GPU


@dataclass
class ModelConfig:
    """Model hyper-parameters; None fields resolve through the properties below."""
    vocab_size: int = 256
    block_size: int = 256  # training context; the model itself has no length limit
    n_layer: int = 4
    d_model: int = 256
    mixer: str = 'fm'
    d_ff: int | None = None  # SwiGLU hidden size; None -> 8/3 d_model rounded up to a multiple of 64; 0: no MLP
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    init_std: float = 0.02
    # fm
    n_memory: int = 64  # m, memory rows
    top_k: int | None = None  # k rows read and written per token; None -> m (dense)
    d_memory: int | None = None  # width of a memory row; None -> d_model
    tau: float = 1.0  # router softmax temperature
    # choices the paper leaves open (see the README's "departures from the paper")
    router_init_std: float | None = None  # std of W_alpha's normal init; None -> init_std
    eta_bias: float = 0.0  # initial b_eta: 0 gives eta = 0.5 at init; below 0 the memory starts writing (and forgetting) slower
    router_weight_decay: bool = True  # AdamW's weight decay on W_alpha, w_eta and w_mu (False: none)
    router_balance: float = 0.0  # weight of a load-balancing loss on the router's row usage (0: none, the paper's layer)
    router_center: bool = False  # the router sees its input minus a running mean over training tokens (False: as is)
    fm_eps: float = 1e-6
    chunk_size: int = 64  # chunk length of the PyTorch fm scan and of the mamba2 scan (Triton fm: 64)
    # attn
    n_head: int = 8
    n_kv_head: int | None = None  # None -> n_head
    rope_theta: float = 10000.0
    # mamba2
    d_state: int = 64
    mamba_head_dim: int = 64
    mamba_expand: int = 2
    d_conv: int = 4

    @property
    def ffn_dim(self):
        return 64 * math.ceil(8 * self.d_model / 3 / 64) if self.d_ff is None else self.d_ff

    @property
    def memory_dim(self):
        return self.d_model if self.d_memory is None else self.d_memory

    @property
    def k(self):
        return self.n_memory if self.top_k is None else self.top_k

    @property
    def kv_heads(self):
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def mamba_d_inner(self):
        return self.mamba_expand * self.d_model

    @property
    def mamba_n_heads(self):
        return self.mamba_d_inner // self.mamba_head_dim

    def validate(self):
        """Raise ValueError naming the first bad field and what to change (checks the chosen mixer's fields only)."""
        def check(ok, field, hint):
            if not ok:
                raise ValueError(f"ModelConfig.{field}={getattr(self, field)!r}: {hint}")

        def positive(*fields, optional=False):
            for field in fields:
                value = getattr(self, field)
                check((optional and value is None) or (isinstance(value, (int, float)) and value > 0), field,
                      'must be positive' + (' or None' if optional else ''))

        positive('vocab_size', 'block_size', 'n_layer', 'd_model', 'norm_eps', 'init_std')
        check(self.d_ff is None or (isinstance(self.d_ff, int) and self.d_ff >= 0), 'd_ff',
              'must be >= 0 (0: blocks without an MLP, as the original Mamba-2) or None')
        check(self.mixer in MIXERS, 'mixer', f"unknown mixer; use one of {', '.join(MIXERS)}")
        if self.mixer == 'fm':
            positive('n_memory', 'tau', 'fm_eps', 'chunk_size')
            positive('d_memory', 'router_init_std', optional=True)
            check(self.router_balance >= 0, 'router_balance', 'must be >= 0 (0: no load-balancing loss)')
            check(self.top_k is None or 1 <= self.top_k <= self.n_memory, 'top_k',
                  f"must be between 1 and n_memory={self.n_memory} (None means dense, k = m)")
        if self.mixer == 'attn':
            positive('n_head', 'rope_theta')
            positive('n_kv_head', optional=True)
            check(self.d_model % self.n_head == 0, 'd_model', f"must be divisible by n_head={self.n_head}")
            check((self.d_model // self.n_head) % 2 == 0, 'n_head',
                  f"d_model/n_head must be even for RoPE; change n_head or d_model={self.d_model}")
            check(self.n_head % self.kv_heads == 0, 'n_kv_head', f"must divide n_head={self.n_head}")
        if self.mixer == 'mamba2':
            positive('d_state', 'mamba_head_dim', 'mamba_expand', 'd_conv', 'chunk_size')
            check(self.mamba_d_inner % self.mamba_head_dim == 0, 'mamba_head_dim',
                  f"must divide d_inner = mamba_expand * d_model = {self.mamba_d_inner}")


def compute_dtype(dtype):
    """float32 for half precision inputs, the input dtype otherwise (float64 stays float64)."""
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in at least float32."""

    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x_acc = x.to(compute_dtype(x.dtype))
        return (x_acc * torch.rsqrt(x_acc.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def merge_split_weights(state_dict, prefix, old_names, new_name):
    """Checkpoints written before some products became one hold their weights apart (e.g. gate_proj and up_proj):
    concatenate them, in place in state_dict, into the weight of the one product (rows in old_names' order)."""
    old_keys = [f'{prefix}{name}.weight' for name in old_names]
    if all(key in state_dict for key in old_keys):
        state_dict[f'{prefix}{new_name}.weight'] = torch.cat([state_dict.pop(key) for key in old_keys])


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up as one product (one launch, one weight read when decoding)."""

    def __init__(self, config):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.d_model, 2 * config.ffn_dim, bias=False)  # gate's rows, then up's
        self.down_proj = nn.Linear(config.ffn_dim, config.d_model, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def step(self, x):  # x (B, d_model)
        """One token: the down product as a decoding product (gemv.decode_linear: its input materialised once)."""
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return gemv.decode_linear(F.silu(gate) * up, self.down_proj.weight)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        merge_split_weights(state_dict, prefix, ('gate_proj', 'up_proj'), 'gate_up_proj')
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


# ----------------------------------------------------------------------------- Factorization Memory

def memory_scan(xbar, theta, phi, h0, eps, chunk_size):
    """Parallel FM recurrence from h0 (None: zeros) -> (y, hT): Triton on CUDA (up to fm_kernel.MAX_ROWS memory
    rows), chunked PyTorch elsewhere."""
    if xbar.is_cuda and xbar.dtype != torch.float64 and theta.shape[-1] <= fm_kernel.MAX_ROWS:
        return fm_kernel.fm_scan(xbar, theta, phi, h0, eps)
    return fm_kernel.fm_scan_torch(xbar, theta, phi, h0, eps, chunk_size)


def memory_step(h, xbar, scores, top_k, tau, eps):
    """One FM decode step from the router's scores (B, M + 2), updating the top_k rows of h in place -> y: one Triton
    kernel on CUDA (up to fm_kernel.MAX_ROWS memory rows), PyTorch elsewhere."""
    if h.is_cuda and h.dtype == torch.float32 and fm_kernel.triton is not None and h.shape[1] <= fm_kernel.MAX_ROWS:
        return fm_kernel.fm_route_step(h, xbar, scores, top_k, tau, eps)
    return fm_kernel.fm_route_step_naive(h, xbar, scores, top_k, tau, eps)


class FactorizationMemory(nn.Module):
    """FM mixer: m memory rows of width d_memory, each token writes and reads its top-k rows."""

    def __init__(self, config):
        super().__init__()
        self.n_memory, self.top_k, self.memory_dim = config.n_memory, config.k, config.memory_dim
        self.tau, self.eps, self.chunk_size = config.tau, config.fm_eps, config.chunk_size
        self.balance, self.balance_loss = config.router_balance, None  # the loss of the last training pass
        if config.router_center:  # the router input's mean over training tokens: the mean of the first batches, then
            self.register_buffer('input_mean', torch.zeros(config.d_model))  # a running average
            self.register_buffer('input_mean_batches', torch.zeros((), dtype=torch.long))
        self.router = nn.Linear(config.d_model, config.n_memory, bias=False)  # W_alpha
        self.rates = nn.Linear(config.d_model, 2)  # (w_eta, b_eta), (w_mu, b_mu); b_eta = eta_bias, b_mu = 0
        self.in_proj = nn.Linear(config.d_model, config.memory_dim, bias=False)  # W_i
        self.out_proj = nn.Linear(config.memory_dim, config.d_model, bias=False)  # W_o

    def init_router(self, config):
        """The router's and gates' initialisation where the config departs from the model-wide one."""
        if config.router_init_std is not None:
            nn.init.normal_(self.router.weight, mean=0.0, std=config.router_init_std)
        with torch.no_grad():
            self.rates.bias[0] = config.eta_bias

    def router_scores(self, x):
        """x (..., d_model) -> the router's scores (..., M + 2): W_alpha x, then the logits of eta and mu with their
        biases, in at least float32 (so that the top-k is exact); call with autocast off."""
        dtype = compute_dtype(x.dtype)
        weight = torch.cat([self.router.weight, self.rates.weight]).to(dtype)  # (M + 2, d_model): one product
        bias = F.pad(self.rates.bias.to(dtype), (self.n_memory, 0))  # (M + 2,): 0 for the router's rows
        if hasattr(self, 'input_mean'):  # W_alpha (x - mean) = W_alpha x - W_alpha mean
            bias = bias - F.pad(F.linear(self.input_mean.to(dtype, copy=True), self.router.weight.to(dtype)), (0, 2))
            if self.training:
                with torch.no_grad():
                    self.input_mean_batches += 1
                    share = (1 / self.input_mean_batches).clamp(min=CENTER_MOMENTUM).to(self.input_mean.dtype)
                    self.input_mean.lerp_(x.flatten(0, -2).mean(0).to(self.input_mean.dtype), share)
        if x.dim() == 2 and torch.compiler.is_compiling():  # a compiled decoding step: one reduction kernel
            return (x.to(dtype)[:, None, :] * weight).sum(-1) + bias  # (B, M + 2); the weight's cat is not stored
        pad = -len(weight) % 4  # 16-byte rows: cuBLAS's aligned kernels
        return F.linear(x.to(dtype), F.pad(weight, (0, 0, 0, pad)), F.pad(bias, (0, pad)))[..., :len(weight)]

    def route(self, x):
        """Router in at least float32: x (..., d_model) -> idx (..., K) of the selected rows (None when dense),
        alpha (..., K) summing to 1, eta and mu (..., 1)."""
        with torch.autocast(x.device.type, enabled=False):
            probs, idx, alpha, eta, mu = fm_kernel.route_naive(self.router_scores(x), self.top_k, self.tau)
            if self.training and self.balance > 0:
                self.balance_loss = balance_loss(probs, self.top_k)
        return idx, alpha, eta, mu

    def forward(self, x, state=None, lengths=None):  # x (B, T, d_model)
        """-> y (B, T, d_model), state {'h'} after each row's last real token (lengths (B,); None: all T)."""
        idx, alpha, eta, mu = self.route(x)
        if idx is not None:  # the scan takes dense (B, T, M) weights, zero outside the top-k
            alpha = alpha.new_zeros(*x.shape[:-1], self.n_memory).scatter(-1, idx, alpha)
        theta = eta * alpha
        if lengths is not None:  # padding writes nothing: theta = 0 leaves every row as it is
            theta = theta * real_positions(lengths, x.shape[1])[..., None]
        xbar = self.in_proj(x)  # (B, T, d_memory)
        h0 = None if state is None else state['h']
        y, h = memory_scan(xbar, theta, mu * alpha, h0, self.eps, self.chunk_size)  # y like xbar, h (B, M, d_memory)
        return self.out_proj(y), {'h': h}

    def step(self, x, state):  # x (B, d_model)
        """One token: updates state['h'] in place -> y (B, d_model)."""
        with torch.autocast(x.device.type, enabled=False):
            scores = self.router_scores(x)  # (B, M + 2)
        y = memory_step(state['h'], self.in_proj(x), scores, self.top_k, self.tau, self.eps)  # (B, d_memory)
        return self.out_proj(y)

    def init_state(self, batch_size, max_len, device):
        dtype = compute_dtype(self.in_proj.weight.dtype)
        return {'h': torch.zeros(batch_size, self.n_memory, self.memory_dim, dtype=dtype, device=device)}


def balance_loss(alpha, top_k):
    """Load balancing of a router (Switch Transformer): m * sum_i share_i * p_i over the tokens of alpha (..., m),
    the full softmax, where p_i is row i's mean probability and share_i its share of the routing (the fraction of
    the top-k selections, or p_i itself when dense; not differentiated). It is 1 when every row is used equally,
    and m (dense) or m / k (top-k) when every token puts all its weight on one row."""
    alpha = alpha.flatten(0, -2)  # (N, m)
    p = alpha.mean(0)  # (m,)
    if top_k < alpha.shape[-1]:
        selected = alpha.topk(top_k, dim=-1).indices  # (N, k)
        share = torch.zeros_like(p).scatter_add_(0, selected.flatten(), torch.ones_like(selected.flatten(), dtype=p.dtype))
        share = share / selected.numel()
    else:
        share = p.detach()
    return alpha.shape[-1] * (share * p).sum()


# ----------------------------------------------------------------------------- attention

def real_positions(lengths, T):
    """lengths (B,) of right-padded rows -> (B, T) bool, True at the real (non-padding) positions."""
    return torch.arange(T, device=lengths.device) < lengths[:, None]


def rotate(x, positions, rope_theta):
    """RoPE, rotating the two halves of the head dim: x (B, H, T, hd), positions (B or 1, T) -> (B, H, T, hd).
    The frequencies and angles are float32 whatever the model's dtype (in bf16 they would be off by radians at
    thousands of positions), and x's dtype computes the rotation where it is float32 or more."""
    hd = x.shape[-1]
    inv_freq = rope_theta ** (-torch.arange(0, hd, 2, dtype=torch.float32, device=x.device) / hd)  # (hd/2,)
    angles = positions.float()[:, None, :, None] * inv_freq  # (B, 1, T, hd/2)
    dtype = compute_dtype(x.dtype)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    x1, x2 = x.to(dtype).chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


class Attention(nn.Module):
    """Causal grouped-query attention with RoPE; decoding writes into a static KV cache."""

    def __init__(self, config):
        super().__init__()
        self.n_head, self.n_kv_head = config.n_head, config.kv_heads
        self.head_dim = config.d_model // config.n_head
        self.qkv_proj = nn.Linear(config.d_model, (self.n_head + 2 * self.n_kv_head) * self.head_dim, bias=False)
        self.out_proj = nn.Linear(self.n_head * self.head_dim, config.d_model, bias=False)
        self.rope_theta = config.rope_theta

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        merge_split_weights(state_dict, prefix, ('q_proj', 'k_proj', 'v_proj'), 'qkv_proj')
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def project(self, x, positions):
        """x (B, T, d_model) at positions (B, T) -> q (B, H, T, hd), k, v (B, Hkv, T, hd), from one product."""
        B, T, _ = x.shape
        heads = self.qkv_proj(x).view(B, T, self.n_head + 2 * self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k, v = heads.split([self.n_head, self.n_kv_head, self.n_kv_head], dim=1)
        return rotate(q, positions, self.rope_theta), rotate(k, positions, self.rope_theta), v

    def merge_heads(self, y):
        """(B, H, T, hd) -> out_proj over the heads: (B, T, d_model)."""
        B, H, T, hd = y.shape
        return self.out_proj(y.transpose(1, 2).reshape(B, T, H * hd))

    def forward(self, x, state=None, lengths=None):  # x (B, T, d_model)
        """-> y (B, T, d_model), state {'k', 'v' (B, Hkv, T, hd), 'pos' (B,): tokens in the cache}."""
        if state is not None:
            raise ValueError('attention continues from a KV cache one token at a time (step), not in a parallel pass')
        B, T, _ = x.shape
        q, k, v = self.project(x, torch.arange(T, device=x.device)[None])  # one table of angles for the batch
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # (B, H, T, hd)
        pos = torch.full((B,), T, device=x.device) if lengths is None else lengths.clone()
        return self.merge_heads(y), {'k': k, 'v': v, 'pos': pos}

    def step(self, x, state):  # x (B, d_model)
        """One token: writes its key and value at each row's position in the static cache (in place) and attends
        over the filled part through a length mask -> y (B, d_model)."""
        pos = state['pos']  # (B,)
        q, k, v = self.project(x[:, None], pos[:, None])  # q (B, H, 1, hd), k, v (B, Hkv, 1, hd)
        rows = torch.arange(len(pos), device=pos.device)
        state['k'][rows, :, pos], state['v'][rows, :, pos] = k[:, :, 0], v[:, :, 0]
        pos += 1
        B, Hkv, L, hd = state['k'].shape
        q = q.view(B, Hkv, self.n_head // Hkv, hd)  # query head h reads KV head h // (H / Hkv), as SDPA's GQA
        scores = (q @ state['k'].transpose(-1, -2)).to(compute_dtype(q.dtype)) / math.sqrt(hd)  # (B, Hkv, H/Hkv, L)
        filled = torch.arange(L, device=pos.device) < pos[:, None]  # (B, L)
        probs = torch.softmax(scores.masked_fill(~filled[:, None, None], -math.inf), dim=-1)
        y = probs.to(v.dtype) @ state['v']  # (B, Hkv, H / Hkv, hd)
        return self.merge_heads(y.view(B, self.n_head, 1, hd))[:, 0]

    def init_state(self, batch_size, max_len, device):
        cache = self.qkv_proj.weight.new_zeros(batch_size, self.n_kv_head, max_len, self.head_dim, device=device)
        return {'k': cache, 'v': cache.clone(), 'pos': torch.zeros(batch_size, dtype=torch.long, device=device)}


# ----------------------------------------------------------------------------- Mamba-2

def pad_time(x, pad):
    """Zero-pad dim 1 (time) of x at the end."""
    return F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))


def ssd_scan(x, dt, A, B, C, chunk_size, h0=None):
    """Mamba-2 SSD in chunks, from h0 (None: zeros): h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t.

    x (b, T, H, P), dt (b, T, H) after softplus, A (H,) negative, B, C (b, T, N), h0 (b, H, P, N)
    -> y (b, T, H, P), hT (b, H, P, N).
    Inside a chunk the output is a masked (C B^T * decay) matrix product; the state is carried between chunks.
    """
    out_dtype, dtype = x.dtype, compute_dtype(x.dtype)
    b, T, H, P = x.shape
    L = min(chunk_size, T)
    pad = -T % L  # padded steps have dt = 0: no decay, no input
    x, dt, B, C = (pad_time(t.to(dtype), pad) for t in (x, dt, B, C))
    n_chunks = (T + pad) // L
    x, dt = x.view(b, n_chunks, L, H, P), dt.view(b, n_chunks, L, H)
    B, C = B.view(b, n_chunks, L, -1), C.view(b, n_chunks, L, -1)  # (b, c, L, N)
    log_decay = torch.cumsum(dt * A.to(dtype), dim=2)  # (b, c, L, H) from the chunk start to t, inclusive
    x_dt = x * dt[..., None]  # (b, c, L, H, P)

    causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()[..., None]  # (t, s, 1)
    log_decay_ts = log_decay[:, :, :, None] - log_decay[:, :, None]  # (b, c, t, s, H) from step s to step t
    decay_ts = log_decay_ts.masked_fill(~causal, -math.inf).exp()
    weights = torch.einsum('bctn,bcsn->bcts', C, B)[..., None] * decay_ts  # (b, c, t, s, H)
    y = torch.einsum('bctsh,bcshp->bcthp', weights, x_dt)  # within-chunk part

    decay_to_end = (log_decay[:, :, -1:] - log_decay).exp()  # (b, c, L, H)
    chunk_states = torch.einsum('bclh,bclhp,bcln->bchpn', decay_to_end, x_dt, B)  # each chunk's own end state
    h = x.new_zeros(b, H, P, B.shape[-1]) if h0 is None else h0.to(dtype)
    states_in = []  # state entering each chunk
    for c in range(n_chunks):
        states_in.append(h)
        h = log_decay[:, c, -1].exp()[..., None, None] * h + chunk_states[:, c]
    states_in = torch.stack(states_in, dim=1)  # (b, c, H, P, N)
    y = y + torch.einsum('bctn,bchpn->bcthp', C, states_in) * log_decay.exp()[..., None]
    return y.reshape(b, n_chunks * L, H, P)[:, :T].to(out_dtype), h


class Mamba2(nn.Module):
    """Mamba-2 block: in_proj -> (z, x, B, C, dt), causal depthwise conv + SiLU on (x, B, C), SSD scan with
    D skip, gated RMSNorm norm(y * silu(z)), out_proj. One group for B and C."""

    def __init__(self, config):
        super().__init__()
        self.d_inner, self.n_heads = config.mamba_d_inner, config.mamba_n_heads
        self.head_dim, self.d_state, self.d_conv = config.mamba_head_dim, config.d_state, config.d_conv
        self.chunk_size = config.chunk_size
        self.conv_dim = self.d_inner + 2 * self.d_state  # channels of (x, B, C)
        self.in_proj = nn.Linear(config.d_model, self.d_inner + self.conv_dim + self.n_heads, bias=False)
        self.conv = nn.Conv1d(self.conv_dim, self.conv_dim, self.d_conv, groups=self.conv_dim)  # see conv_window
        dt = torch.exp(torch.empty(self.n_heads).uniform_(math.log(1e-3), math.log(1e-1)))  # log-uniform in [1e-3, 0.1]
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt
        self.A_log = nn.Parameter(torch.log(torch.empty(self.n_heads).uniform_(1, 16)))  # A = -exp(A_log)
        self.D = nn.Parameter(torch.ones(self.n_heads))
        self.norm = RMSNorm(self.d_inner, config.norm_eps)
        self.out_proj = nn.Linear(self.d_inner, config.d_model, bias=False)

    def split(self, zxbcdt):
        """in_proj output (..., *) -> z (..., d_inner), xBC (..., conv_dim), dt (..., H)."""
        return zxbcdt.split([self.d_inner, self.conv_dim, self.n_heads], dim=-1)

    def ssd(self, x, dt, B, C, h0):
        """x (b, T, H, P), dt (b, T, H), B, C (b, T, N), h0 (b, H, P, N) or None -> y (b, T, H, P), hT."""
        A = -torch.exp(self.A_log)
        if mamba_chunk_scan_combined is not None and x.is_cuda:
            return mamba_chunk_scan_combined(x, dt, A, B[:, :, None], C[:, :, None], self.chunk_size,
                                             initial_states=h0, return_final_states=True)
        return ssd_scan(x, dt, A, B, C, self.chunk_size, h0)

    def conv_window(self, xBC, history):
        """Causal depthwise conv + SiLU: xBC (b, L, conv_dim) after history (b, conv_dim, d_conv - 1), the inputs
        before it -> (b, L, conv_dim), and the inputs it ran over (b, conv_dim, d_conv - 1 + L)."""
        inputs = torch.cat([history.to(xBC.dtype), xBC.transpose(1, 2)], dim=-1)
        out = F.conv1d(inputs, self.conv.weight, self.conv.bias, groups=self.conv_dim)  # (b, conv_dim, L)
        return F.silu(out.transpose(1, 2)), inputs

    def forward(self, u, state=None, lengths=None):  # u (b, T, d_model)
        """-> y (b, T, d_model), state {'conv', 'ssm'} after each row's last real token (lengths (b,); None: T)."""
        b, T, _ = u.shape
        z, xBC, dt = self.split(self.in_proj(u))
        history = u.new_zeros(b, self.conv_dim, self.d_conv - 1) if state is None else state['conv']
        xBC, inputs = self.conv_window(xBC, history)  # inputs (b, conv_dim, d_conv - 1 + T)
        ends = torch.full((b,), T, device=u.device) if lengths is None else lengths
        window = ends[:, None] + torch.arange(self.d_conv - 1, device=u.device)  # the d_conv - 1 inputs before the end
        conv_state = inputs.gather(2, window[:, None].expand(-1, self.conv_dim, -1))  # (b, conv_dim, d_conv - 1)
        x, B, C = xBC.split([self.d_inner, self.d_state, self.d_state], dim=-1)
        x = x.reshape(b, T, self.n_heads, self.head_dim)
        dt = F.softplus(dt + self.dt_bias)  # (b, T, H)
        if lengths is not None:  # padding changes nothing: dt = 0 is no decay and no input
            dt = dt * real_positions(lengths, T)[..., None]
        y, ssm_state = self.ssd(x, dt, B, C, None if state is None else state['ssm'])
        y = y + self.D[:, None] * x  # (b, T, H, P)
        y = self.norm(y.reshape(b, T, self.d_inner) * F.silu(z))
        return self.out_proj(y), {'conv': conv_state, 'ssm': ssm_state}

    def step(self, u, state):  # u (b, d_model)
        """One token: updates state['conv'] and state['ssm'] in place -> y (b, d_model)."""
        z, xBC, dt = self.split(self.in_proj(u))
        xBC, inputs = self.conv_window(xBC[:, None], state['conv'])
        state['conv'].copy_(inputs[..., 1:])
        x, B, C = xBC[:, 0].split([self.d_inner, self.d_state, self.d_state], dim=-1)
        x = x.reshape(-1, self.n_heads, self.head_dim)  # (b, H, P)
        if selective_state_update is not None and u.is_cuda:
            y = self.fused_ssm_step(state['ssm'], x, dt, B, C)
        else:
            y = self.ssm_step(state['ssm'], x, dt, B, C)
        y = self.norm(y.reshape(-1, self.d_inner) * F.silu(z))
        return self.out_proj(y)

    def ssm_step(self, ssm, x, dt, B, C):
        """ssm (b, H, P, N) <- exp(dt A) ssm + dt x B^T in place; -> y = ssm C + D x (b, H, P)."""
        dtype = ssm.dtype
        dt = F.softplus(dt + self.dt_bias).to(dtype)  # (b, H)
        decay = torch.exp(dt * -torch.exp(self.A_log.to(dtype)))  # (b, H)
        x_dt = dt[..., None] * x.to(dtype)  # (b, H, P)
        ssm.mul_(decay[..., None, None]).add_(x_dt[..., None] * B.to(dtype)[:, None, None])
        return torch.einsum('bhpn,bn->bhp', ssm, C.to(dtype)).to(x.dtype) + self.D[:, None] * x

    def fused_ssm_step(self, ssm, x, dt, B, C):
        """ssm_step through mamba-ssm's fused Triton kernel (selective_state_update), which takes per-head values
        expanded over (P, N)."""
        b, H, P = x.shape
        N = self.d_state
        A = -torch.exp(self.A_log.float())[:, None, None].expand(H, P, N)
        return selective_state_update(ssm, x, dt[..., None].expand(b, H, P), A, B[:, None], C[:, None],
                                      D=self.D[:, None].expand(H, P), dt_bias=self.dt_bias[:, None].expand(H, P),
                                      dt_softplus=True)

    def init_state(self, batch_size, max_len, device):
        dtype = self.in_proj.weight.dtype
        return {'conv': torch.zeros(batch_size, self.conv_dim, self.d_conv - 1, dtype=dtype, device=device),
                'ssm': torch.zeros(batch_size, self.n_heads, self.head_dim, self.d_state,
                                   dtype=compute_dtype(dtype), device=device)}


# ----------------------------------------------------------------------------- the model

MIXER_CLASSES = {'fm': FactorizationMemory, 'attn': Attention, 'mamba2': Mamba2}


class Block(nn.Module):
    """x + mixer(norm(x)), then x + mlp(norm(x)) unless d_ff = 0."""

    def __init__(self, config):
        super().__init__()
        self.mixer_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mixer = MIXER_CLASSES[config.mixer](config)
        has_mlp = config.ffn_dim > 0
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps) if has_mlp else None
        self.mlp = SwiGLU(config) if has_mlp else None

    def add_mlp(self, x):
        return x if self.mlp is None else x + self.mlp(self.mlp_norm(x))

    def forward(self, x, state=None, lengths=None):  # x (B, T, d_model)
        y, state = self.mixer(self.mixer_norm(x), state, lengths)
        return self.add_mlp(x + y), state

    def step(self, x, state):  # x (B, d_model)
        x = x + self.mixer.step(self.mixer_norm(x), state)
        return x if self.mlp is None else x + self.mlp.step(self.mlp_norm(x))


class Model(nn.Module):
    """Decoder LM: embedding, n_layer Blocks, final RMSNorm, LM head (tied to the embedding by default)."""

    def __init__(self, config):
        super().__init__()
        config.validate()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # residual output projections, GPT-2 style
            if name.endswith(('out_proj.weight', 'down_proj.weight')):
                nn.init.normal_(p, mean=0.0, std=config.init_std / math.sqrt(2 * config.n_layer))
        for block in self.blocks:
            if isinstance(block.mixer, FactorizationMemory):
                block.mixer.init_router(config)

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.init_std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def head(self, x):
        """Final norm and LM head: logits in the head's dtype (bfloat16 under autocast)."""
        return self.lm_head(self.norm(x))

    def logits(self, x):
        """Logits for sampling, in at least float32."""
        logits = self.head(x)
        return logits.to(compute_dtype(logits.dtype))

    def hidden(self, idx, state=None, lengths=None):
        """idx (B, T) -> last hidden states (B, T, d_model) and the per-layer states after each row's last real token.
        state: per-layer states to continue from (fm, mamba2; None: a fresh start); lengths (B,): the real length of
        each right-padded row (None: all T), so that no padding enters a state."""
        x = self.embed(idx)
        states = []
        for i, block in enumerate(self.blocks):
            x, layer_state = block(x, None if state is None else state[i], lengths)
            states.append(layer_state)
        return x, states

    def forward(self, idx, targets=None):
        """idx (B, T) -> logits (B, T, V) in the head's dtype, and when targets is given the mean cross-entropy
        over targets != -1, in at least float32. (A float32 copy of the logits would be 6.6 GB at 16K tokens and a 100K
        vocabulary; compiled, the upcast happens inside the loss kernels.)"""
        logits = self.head(self.hidden(idx)[0])
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.flatten(0, 1).to(compute_dtype(logits.dtype)), targets.flatten(),
                                   ignore_index=-1)
            if self.training and self.config.mixer == 'fm' and self.config.router_balance > 0:
                balance = torch.stack([block.mixer.balance_loss for block in self.blocks]).mean()
                loss = loss + self.config.router_balance * balance
        return logits, loss

    def init_state(self, batch_size, max_len, device=None):
        """Empty decoding states in static buffers for up to max_len tokens a row, one dict a layer: fm {'h'},
        attn {'k', 'v' (a KV cache of max_len positions), 'pos'}, mamba2 {'conv', 'ssm'}."""
        device = self.embed.weight.device if device is None else device
        return [block.mixer.init_state(batch_size, max_len, device) for block in self.blocks]

    def step(self, tokens, state):
        """Decode one token: tokens (B,) -> logits (B, V). Updates the static buffers of state in place, so a CUDA
        graph of this call can be replayed token after token."""
        x = self.embed(tokens)  # (B, d_model)
        for block, layer_state in zip(self.blocks, state):
            x = block.step(x, layer_state)
        return self.logits(x)

    def prefill(self, idx, lengths=None, max_len=None):
        """One parallel pass over right-padded prompts idx (B, T) of real lengths (B,) (None: all T) -> logits (B, V)
        after each row's last real token, and the decoding state, in buffers for max_len tokens a row (None: T)."""
        B, T = idx.shape
        x, states = self.hidden(idx, lengths=lengths)
        last = torch.full((B,), T - 1, device=idx.device) if lengths is None else lengths - 1
        state = self.init_state(B, T if max_len is None else max_len, idx.device)
        write_state(state, states)
        return self.logits(x[torch.arange(B, device=idx.device), last]), state

    def num_params(self, non_embedding=True):
        """Parameter count; non_embedding leaves out the token embedding and the LM head (tied or not)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.embed.weight.numel()
            if not self.config.tie_embeddings:
                n -= self.lm_head.weight.numel()
        return n

    def flops_per_token(self, seq_len):
        """Training (forward + backward = 3 x forward) FLOPs per token at context seq_len, 2 FLOPs a multiply-add:

            6 * N_nonembedding + 6 * d_model * vocab_size     every weight matmul, LM head included
            + n_layer * mixer term:
              attn    12 * seq_len * d_model                 QK^T and AV, no causal discount (nanoGPT / PaLM)
              fm      3 * k * (9 * d_memory + 5)             paper App. FLOPS: the recurrence costs 9 d_memory + 5
                                                             per row read and written (k = m when dense)
              mamba2  3 * 5 * d_inner * d_state              per state element: decay, input outer product, add,
                                                             and the C readout (2)
        """
        c = self.config
        if c.mixer == 'attn':
            mixer = 12 * seq_len * c.d_model
        elif c.mixer == 'fm':
            mixer = 3 * c.k * (9 * c.memory_dim + 5)
        else:
            mixer = 3 * 5 * c.mamba_d_inner * c.d_state
        return float(6 * (self.num_params() + c.d_model * c.vocab_size) + c.n_layer * mixer)

    def estimate_mfu(self, tokens_per_sec, device_name=None):
        """Model FLOPs utilisation of one GPU processing tokens_per_sec at block_size context, against its bf16
        dense peak (PEAK_BF16_FLOPS). device_name None -> the GPU holding the model; CPU or an unknown GPU -> 0.0."""
        if device_name is None:
            device = next(self.parameters()).device
            if device.type != 'cuda':
                return 0.0
            device_name = torch.cuda.get_device_name(device)
        peak = next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in device_name.upper()), None)
        if peak is None:
            return 0.0
        return self.flops_per_token(self.config.block_size) * tokens_per_sec / peak

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        """AdamW with weight decay on matrices and embeddings (>= 2-D) only, and not on FM's router and gates when
        router_weight_decay is False; fused on CUDA."""
        params = [p for p in self.parameters() if p.requires_grad]
        exempt = set()
        if self.config.mixer == 'fm' and not self.config.router_weight_decay:
            exempt = {id(p) for block in self.blocks for p in (block.mixer.router.weight, block.mixer.rates.weight)}
        decays = [p.dim() >= 2 and id(p) not in exempt for p in params]
        groups = [{'params': [p for p, d in zip(params, decays) if d], 'weight_decay': weight_decay},
                  {'params': [p for p, d in zip(params, decays) if not d], 'weight_decay': 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=device_type == 'cuda')


def write_state(static, states, rows=slice(None)):
    """Copy per-layer states (as a parallel pass returns them) into rows of static decoding buffers; each tensor
    lands in the leading part of every dimension (a KV cache of T positions in one of max_len)."""
    for static_layer, layer in zip(static, states):
        for name, tensor in layer.items():
            static_layer[name][rows][tuple(slice(0, n) for n in tensor.shape)] = tensor


# ----------------------------------------------------------------------------- generation

@dataclass
class Sampling:
    """How the next token is drawn from the logits."""
    temperature: float = 1.0  # 0: greedy (the most likely token)
    top_k: int | None = None  # only the k most likely tokens
    top_p: float = 1.0  # only the smallest set of most likely tokens whose probability reaches top_p (nucleus)
    n_tokens: int | None = None  # only ids below this (the tokenizer's size when the model's vocabulary is padded)

    def validate(self):
        """Raise ValueError naming the first bad field and its range."""
        if not self.temperature >= 0:
            raise ValueError(f'temperature={self.temperature!r}: must be >= 0 (0 is greedy decoding)')
        if self.top_k is not None and not self.top_k >= 1:
            raise ValueError(f'top_k={self.top_k!r}: must be >= 1, or None for every token')
        if not 0 < self.top_p <= 1:
            raise ValueError(f'top_p={self.top_p!r}: must be in (0, 1] (1 keeps every token)')


def nucleus(logits, top_p):
    """Keep the smallest set of most likely tokens whose probability reaches top_p: logits (B, V), the rest -inf."""
    ranked, order = logits.sort(-1, descending=True)
    probs = torch.softmax(ranked, -1)
    dropped = probs.cumsum(-1) - probs >= top_p  # the mass before a token already reaches top_p
    return logits.scatter(-1, order, ranked.masked_fill(dropped, -math.inf))


def sample_next(logits, sampling):
    """logits (B, V) in float32 or more -> token ids (B,). Draws from torch's default generator (torch.manual_seed)
    without a host sync, so that a CUDA graph can hold it."""
    logits = logits[:, :sampling.n_tokens]
    if sampling.temperature == 0:
        return logits.argmax(-1)
    logits = logits / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < logits.shape[-1]:
        kth = logits.topk(sampling.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if sampling.top_p < 1:
        logits = nucleus(logits, sampling.top_p)
    probs = torch.softmax(logits, dim=-1)
    race = torch.empty_like(probs).exponential_().clamp_(min=torch.finfo(probs.dtype).tiny)
    return (probs / race).argmax(-1)  # argmax p_i / E_i, E_i ~ Exp(1), is i with probability p_i


# inductor options of the compiled decoding step, on top of the mode's. Coordinate-descent tuning (gpt-fast's
# setting) makes inductor write a product with one row (batch 1) as a reduction tuned for this GPU instead of a
# cuBLAS GEMV, whose 64-row tiles leave most SMs idle at 2048 outputs (kernel_log.md, changes 63 and 64).
STEP_COMPILE_OPTIONS = {'coordinate_descent_tuning': True}


def step_options(mode):
    """torch.compile options of a decoding step compiled in `mode`: the mode's own, then STEP_COMPILE_OPTIONS."""
    import torch._inductor
    return {**torch._inductor.list_mode_options(mode), **STEP_COMPILE_OPTIONS}


class Generator:
    """Batched generation from a Model with static buffers. The prompts are prefilled in parallel passes (right-
    padded; no padding enters a state), then each step (every layer, the head and sampling) updates the buffers
    in place; on CUDA a step is one CUDA-graph replay, captured once per batch size and length."""

    def __init__(self, model, sampling=Sampling(), eot=None, cuda_graph=None, compile=None, prefill_tokens=16384):
        """compile: None (the step as written) or a torch.compile mode ('default', 'max-autotune-no-cudagraphs'),
        which fuses the step's small kernels at the cost of a compilation per batch size; with STEP_COMPILE_OPTIONS."""
        sampling.validate()
        self.model, self.sampling, self.eot = model, sampling, eot
        self.device = model.embed.weight.device
        self.cuda_graph = self.device.type == 'cuda' if cuda_graph is None else cuda_graph
        self.compiled_step = self._step if compile is None else torch.compile(self._step, options=step_options(compile))
        self.prefill_tokens = prefill_tokens  # tokens of one prefill pass, at least a prompt's (bounds memory)
        self.shape = self.graph = None

    def _allocate(self, batch_size, max_len):
        """Static buffers (state, next tokens, finished rows) for batch_size rows of max_len tokens, and the graph."""
        self.shape, self.graph = (batch_size, max_len), None
        self.state = self.model.init_state(batch_size, max_len, self.device)
        self.tokens = torch.zeros(batch_size, dtype=torch.long, device=self.device)
        self.done = torch.zeros(batch_size, dtype=torch.bool, device=self.device)
        if self.cuda_graph:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            device = self.device.index if self.device.index is not None else torch.cuda.current_device()
            with torch.random.fork_rng(devices=[device]), torch.cuda.stream(stream):  # warm-up outside the capture
                for _ in range(2):  # (kernel compilation, library handles), drawing nothing from the seeded RNG
                    self.compiled_step()
            torch.cuda.current_stream(self.device).wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.compiled_step()

    def _step(self):
        logits = self.model.step(self.tokens, self.state)  # (B, V)
        self.tokens.copy_(sample_next(logits, self.sampling))
        if self.eot is not None:
            self.done |= self.tokens == self.eot

    @torch.no_grad()
    def start(self, prompts, max_new_tokens):
        """Prefill prompts (lists of token ids) into buffers with room for max_new_tokens more -> the first new
        token of each row (B,), a buffer that the next step overwrites."""
        lengths = [len(p) for p in prompts]
        if min(lengths) < 1 or max_new_tokens < 1:
            raise ValueError('every prompt needs at least one token, and max_new_tokens must be at least 1')
        shape = (len(prompts), max(lengths) + max_new_tokens)
        if shape != self.shape:
            self._allocate(*shape)
        rows_per_pass = max(1, self.prefill_tokens // max(lengths))
        for first in range(0, len(prompts), rows_per_pass):
            rows = slice(first, first + rows_per_pass)
            last, states = self._prefill(prompts[rows])
            write_state(self.state, states, rows)
            self.tokens[rows] = sample_next(self.model.logits(last), self.sampling)
        self.done.zero_()
        if self.eot is not None:
            self.done |= self.tokens == self.eot
        return self.tokens

    def _prefill(self, prompts):
        """Parallel passes over right-padded prompts -> the hidden state after each one's last token (B, d_model)
        and the per-layer states. A recurrent model takes a prompt longer than prefill_tokens (then alone: see
        start) in pieces, carrying its state, so that memory does not grow with the prompt; attention takes it whole."""
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)  # (B,)
        width = int(lengths.max())
        idx = torch.tensor([p + [0] * (width - len(p)) for p in prompts], device=self.device)  # (B, width)
        piece = width if self.model.config.mixer == 'attn' else self.prefill_tokens
        states = None
        for start in range(0, width, piece):
            x, states = self.model.hidden(idx[:, start:start + piece], states, (lengths - start).clamp(max=piece))
        return x[torch.arange(len(prompts), device=self.device), lengths - 1 - start], states  # in the last piece

    @torch.no_grad()
    def step(self):
        """Decode one token a row -> the next tokens (B,), a buffer that the next step overwrites. At most
        max_new_tokens - 1 steps follow a start (the buffers hold no more)."""
        if self.graph is not None:
            self.graph.replay()
        else:
            self.compiled_step()
        return self.tokens

    def generate(self, prompts, max_new_tokens, on_tokens=None):
        """New tokens for each prompt: up to max_new_tokens, a row ending at its end-of-text token (not returned).
        on_tokens(list of B ids), if given, gets each step's tokens as they come (streaming; a host sync a token)."""
        if max_new_tokens < 1:
            return [[] for _ in prompts]
        steps = [self.start(prompts, max_new_tokens).clone()]
        while True:
            if on_tokens is not None:
                on_tokens(steps[-1].tolist())
            finished = self.eot is not None and len(steps) % 16 == 0 and self.done.all()  # a host sync every 16
            if len(steps) == max_new_tokens or finished:
                break
            steps.append(self.step().clone())
        rows = torch.stack(steps, 1).tolist()  # (B, steps)
        return [row[:row.index(self.eot)] if self.eot in row else row for row in rows]
