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

try:  # optional fused Mamba-2 scan for CUDA tensors; the pure PyTorch scan below is the reference
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
except ImportError:
    mamba_chunk_scan_combined = None

MIXERS = ('fm', 'attn', 'mamba2')
PEAK_BF16_FLOPS = {'A100': 312e12, 'H100': 989e12, 'H200': 989e12}  # dense, per GPU


@dataclass
class ModelConfig:
    """Model hyper-parameters; None fields resolve through the properties below."""
    vocab_size: int = 256
    block_size: int = 256  # training context; the model itself has no length limit
    n_layer: int = 4
    d_model: int = 256
    mixer: str = 'fm'
    d_ff: int | None = None  # SwiGLU hidden size; None -> 8/3 d_model rounded up to a multiple of 64
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    init_std: float = 0.02
    # fm
    n_memory: int = 64  # m, memory rows
    top_k: int | None = None  # k rows read and written per token; None -> m (dense)
    d_memory: int | None = None  # width of a memory row; None -> d_model
    tau: float = 1.0  # router softmax temperature
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
        positive('d_ff', optional=True)
        check(self.mixer in MIXERS, 'mixer', f"unknown mixer; use one of {', '.join(MIXERS)}")
        if self.mixer == 'fm':
            positive('n_memory', 'tau', 'fm_eps', 'chunk_size')
            positive('d_memory', optional=True)
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


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.d_model, config.ffn_dim, bias=False)
        self.up_proj = nn.Linear(config.d_model, config.ffn_dim, bias=False)
        self.down_proj = nn.Linear(config.ffn_dim, config.d_model, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# ----------------------------------------------------------------------------- Factorization Memory

def memory_scan(xbar, theta, phi, eps, chunk_size):
    """Parallel FM recurrence from a zero state -> (y, hT): Triton on CUDA (up to fm_kernel.MAX_ROWS memory rows),
    chunked PyTorch elsewhere."""
    if xbar.is_cuda and xbar.dtype != torch.float64 and theta.shape[-1] <= fm_kernel.MAX_ROWS:
        return fm_kernel.fm_scan(xbar, theta, phi, None, eps)
    return fm_kernel.fm_scan_torch(xbar, theta, phi, None, eps, chunk_size)


def memory_step(h, xbar, idx, theta, phi, eps):
    """One FM decode step, updating rows idx of h in place -> y: Triton on CUDA, PyTorch elsewhere."""
    if h.is_cuda and h.dtype == torch.float32:
        return fm_kernel.fm_step(h, xbar, idx, theta, phi, eps)
    return fm_kernel.fm_step_naive(h, xbar, idx, theta, phi, eps)


class FactorizationMemory(nn.Module):
    """FM mixer: m memory rows of width d_memory, each token writes and reads its top-k rows."""

    def __init__(self, config):
        super().__init__()
        self.n_memory, self.top_k, self.memory_dim = config.n_memory, config.k, config.memory_dim
        self.tau, self.eps, self.chunk_size = config.tau, config.fm_eps, config.chunk_size
        self.router = nn.Linear(config.d_model, config.n_memory, bias=False)  # W_alpha
        self.rates = nn.Linear(config.d_model, 2)  # (w_eta, b_eta), (w_mu, b_mu); biases 0: eta = mu = 0.5 at init
        self.in_proj = nn.Linear(config.d_model, config.memory_dim, bias=False)  # W_i
        self.out_proj = nn.Linear(config.memory_dim, config.d_model, bias=False)  # W_o

    def route(self, x):
        """Router in at least float32: x (..., d_model) -> idx (..., K) of the selected rows (None when dense),
        alpha (..., K) summing to 1, eta and mu (..., 1)."""
        dtype = compute_dtype(x.dtype)
        with torch.autocast(x.device.type, enabled=False):
            weight = torch.cat([self.router.weight, self.rates.weight]).to(dtype)  # (M + 2, d_model): one product
            weight = F.pad(weight, (0, 0, 0, -len(weight) % 4))  # 16-byte rows: cuBLAS's aligned kernels
            scores = F.linear(x.to(dtype), weight)  # (..., M + 2 + pad)
            alpha = torch.softmax(scores[..., :self.n_memory] / self.tau, dim=-1)  # (..., M)
            idx = None
            if self.top_k < self.n_memory:
                ranked, order = alpha.sort(-1, descending=True)  # torch.compile generates a kernel for a sort of
                alpha, idx = ranked[..., :self.top_k], order[..., :self.top_k]  # m values; topk is a library call
                alpha = alpha / alpha.sum(-1, keepdim=True)
            rates = torch.sigmoid(scores[..., self.n_memory:self.n_memory + 2] + self.rates.bias.to(dtype))  # (..., 2)
        return idx, alpha, rates[..., :1], rates[..., 1:]

    def forward(self, x):  # x (B, T, d_model)
        idx, alpha, eta, mu = self.route(x)
        if idx is not None:  # the scan takes dense (B, T, M) weights, zero outside the top-k
            alpha = alpha.new_zeros(*x.shape[:-1], self.n_memory).scatter(-1, idx, alpha)
        xbar = self.in_proj(x)  # (B, T, d_memory)
        y, h = memory_scan(xbar, eta * alpha, mu * alpha, self.eps, self.chunk_size)  # y like xbar, h (B, M, d_memory)
        return self.out_proj(y), {'h': h}

    def step(self, x, state):  # x (B, d_model)
        idx, alpha, eta, mu = self.route(x)  # alpha (B, K)
        if idx is None:
            idx = torch.arange(self.n_memory, device=x.device).repeat(x.shape[0], 1)  # (B, M)
        y = memory_step(state['h'], self.in_proj(x), idx, eta * alpha, mu * alpha, self.eps)  # (B, d_memory)
        return self.out_proj(y), state

    def init_state(self, batch_size, device):
        dtype = compute_dtype(self.in_proj.weight.dtype)
        return {'h': torch.zeros(batch_size, self.n_memory, self.memory_dim, dtype=dtype, device=device)}


# ----------------------------------------------------------------------------- attention

def rotate(x, positions, inv_freq):
    """RoPE, rotating the two halves of the head dim: x (B, H, T, hd), positions (T,) -> (B, H, T, hd)."""
    angles = positions.float()[:, None] * inv_freq.float()  # (T, hd/2), float32 even in a bf16 model
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x.to(inv_freq.dtype).chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


class Attention(nn.Module):
    """Causal grouped-query attention with RoPE; decoding appends to a growing KV cache."""

    def __init__(self, config):
        super().__init__()
        self.n_head, self.n_kv_head = config.n_head, config.kv_heads
        self.head_dim = config.d_model // config.n_head
        self.q_proj = nn.Linear(config.d_model, self.n_head * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.d_model, self.n_kv_head * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.d_model, self.n_kv_head * self.head_dim, bias=False)
        self.out_proj = nn.Linear(self.n_head * self.head_dim, config.d_model, bias=False)
        inv_freq = config.rope_theta ** (-torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim)
        self.register_buffer('inv_freq', inv_freq, persistent=False)  # (hd/2,)

    def project(self, x, start):
        """x (B, T, d_model) at positions start.. -> q (B, H, T, hd), k, v (B, Hkv, T, hd)."""
        B, T, _ = x.shape
        positions = torch.arange(start, start + T, device=x.device)
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        return rotate(q, positions, self.inv_freq), rotate(k, positions, self.inv_freq), v

    def attend(self, q, k, v, causal):
        """q (B, H, Tq, hd), k, v (B, Hkv, Tk, hd) -> (B, Tq, d_model)."""
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)  # (B, H, Tq, hd)
        B, H, Tq, hd = y.shape
        return self.out_proj(y.transpose(1, 2).reshape(B, Tq, H * hd))

    def forward(self, x):  # x (B, T, d_model)
        q, k, v = self.project(x, 0)
        return self.attend(q, k, v, causal=True), {'k': k, 'v': v, 'len': k.shape[2]}

    def step(self, x, state):  # x (B, d_model)
        """Writes the new key and value into the cache, doubling its capacity when it is full."""
        t = state['len']
        q, k, v = self.project(x[:, None], t)
        if t == state['k'].shape[2]:
            B, H, _, hd = state['k'].shape
            state['k'], state['v'] = (torch.cat([c, c.new_zeros(B, H, max(t, 16), hd)], dim=2)
                                      for c in (state['k'], state['v']))
        state['k'][:, :, t], state['v'][:, :, t] = k[:, :, 0], v[:, :, 0]
        state['len'] = t + 1
        return self.attend(q, state['k'][:, :, :t + 1], state['v'][:, :, :t + 1], causal=False)[:, 0], state

    def init_state(self, batch_size, device):
        empty = self.k_proj.weight.new_zeros(batch_size, self.n_kv_head, 0, self.head_dim, device=device)
        return {'k': empty, 'v': empty.clone(), 'len': 0}


# ----------------------------------------------------------------------------- Mamba-2

def pad_time(x, pad):
    """Zero-pad dim 1 (time) of x at the end."""
    return F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))


def ssd_scan(x, dt, A, B, C, chunk_size):
    """Mamba-2 SSD in chunks, from a zero state: h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t.

    x (b, T, H, P), dt (b, T, H) after softplus, A (H,) negative, B, C (b, T, N)
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
    h = x.new_zeros(b, H, P, B.shape[-1])
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
        self.conv = nn.Conv1d(self.conv_dim, self.conv_dim, self.d_conv, groups=self.conv_dim, padding=self.d_conv - 1)
        dt = torch.exp(torch.empty(self.n_heads).uniform_(math.log(1e-3), math.log(1e-1)))  # log-uniform in [1e-3, 0.1]
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt
        self.A_log = nn.Parameter(torch.log(torch.empty(self.n_heads).uniform_(1, 16)))  # A = -exp(A_log)
        self.D = nn.Parameter(torch.ones(self.n_heads))
        self.norm = RMSNorm(self.d_inner, config.norm_eps)
        self.out_proj = nn.Linear(self.d_inner, config.d_model, bias=False)

    def split(self, zxbcdt):
        """in_proj output (..., *) -> z (..., d_inner), xBC (..., conv_dim), dt (..., H)."""
        return zxbcdt.split([self.d_inner, self.conv_dim, self.n_heads], dim=-1)

    def ssd(self, x, dt, B, C):
        """x (b, T, H, P), dt (b, T, H), B, C (b, T, N) -> y (b, T, H, P), hT (b, H, P, N)."""
        A = -torch.exp(self.A_log)
        if mamba_chunk_scan_combined is not None and x.is_cuda:
            return mamba_chunk_scan_combined(x, dt, A, B[:, :, None], C[:, :, None], self.chunk_size,
                                             return_final_states=True)
        return ssd_scan(x, dt, A, B, C, self.chunk_size)

    def forward(self, u):  # u (b, T, d_model)
        b, T, _ = u.shape
        z, xBC, dt = self.split(self.in_proj(u))
        xBC = xBC.transpose(1, 2)  # (b, conv_dim, T)
        conv_state = F.pad(xBC, (max(self.d_conv - T, 0), 0))[..., -self.d_conv:]  # (b, conv_dim, d_conv) last inputs
        xBC = F.silu(self.conv(xBC)[..., :T].transpose(1, 2))  # (b, T, conv_dim)
        x, B, C = xBC.split([self.d_inner, self.d_state, self.d_state], dim=-1)
        x = x.reshape(b, T, self.n_heads, self.head_dim)
        y, ssm_state = self.ssd(x, F.softplus(dt + self.dt_bias), B, C)
        y = y + self.D[:, None] * x  # (b, T, H, P)
        y = self.norm(y.reshape(b, T, self.d_inner) * F.silu(z))
        return self.out_proj(y), {'conv': conv_state, 'ssm': ssm_state}

    def step(self, u, state):  # u (b, d_model)
        z, xBC, dt = self.split(self.in_proj(u))
        conv_state = torch.cat([state['conv'][..., 1:], xBC[..., None]], dim=-1)  # (b, conv_dim, d_conv)
        xBC = F.silu((conv_state * self.conv.weight[:, 0]).sum(-1) + self.conv.bias)  # (b, conv_dim)
        x, B, C = xBC.split([self.d_inner, self.d_state, self.d_state], dim=-1)
        x = x.reshape(-1, self.n_heads, self.head_dim)  # (b, H, P)
        dtype = state['ssm'].dtype
        dt = F.softplus(dt + self.dt_bias).to(dtype)  # (b, H)
        decay = torch.exp(dt * -torch.exp(self.A_log.to(dtype)))  # (b, H)
        x_dt = dt[..., None] * x.to(dtype)  # (b, H, P)
        ssm = decay[..., None, None] * state['ssm'] + x_dt[..., None] * B.to(dtype)[:, None, None]  # (b, H, P, N)
        y = torch.einsum('bhpn,bn->bhp', ssm, C.to(dtype)).to(x.dtype) + self.D[:, None] * x  # (b, H, P)
        y = self.norm(y.reshape(-1, self.d_inner) * F.silu(z))
        return self.out_proj(y), {'conv': conv_state, 'ssm': ssm}

    def init_state(self, batch_size, device):
        dtype = self.in_proj.weight.dtype
        return {'conv': torch.zeros(batch_size, self.conv_dim, self.d_conv, dtype=dtype, device=device),
                'ssm': torch.zeros(batch_size, self.n_heads, self.head_dim, self.d_state,
                                   dtype=compute_dtype(dtype), device=device)}


# ----------------------------------------------------------------------------- the model

MIXER_CLASSES = {'fm': FactorizationMemory, 'attn': Attention, 'mamba2': Mamba2}


class Block(nn.Module):
    """x + mixer(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config):
        super().__init__()
        self.mixer_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mixer = MIXER_CLASSES[config.mixer](config)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x):  # x (B, T, d_model)
        y, state = self.mixer(self.mixer_norm(x))
        x = x + y
        return x + self.mlp(self.mlp_norm(x)), state

    def step(self, x, state):  # x (B, d_model)
        y, state = self.mixer.step(self.mixer_norm(x), state)
        x = x + y
        return x + self.mlp(self.mlp_norm(x)), state


def sample(logits, temperature, top_k):
    """logits (B, V) -> sampled token ids (B,)."""
    logits = logits / temperature
    if top_k is not None:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    return torch.multinomial(torch.softmax(logits, dim=-1), num_samples=1)[:, 0]


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

    def hidden(self, idx):
        """idx (B, T) -> last hidden states (B, T, d_model) and the per-layer states after the last token."""
        x = self.embed(idx)
        states = []
        for block in self.blocks:
            x, state = block(x)
            states.append(state)
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
        return logits, loss

    def init_state(self, batch_size, device=None):
        """Empty per-layer states: fm {'h'}, attn {'k', 'v', 'len'} (a KV cache that grows), mamba2 {'conv', 'ssm'}."""
        device = self.embed.weight.device if device is None else device
        return [block.mixer.init_state(batch_size, device) for block in self.blocks]

    def step(self, tokens, state):
        """Decode one token: tokens (B,) -> logits (B, V), new state (fm updates its state tensors in place)."""
        x = self.embed(tokens)  # (B, d_model)
        new_state = []
        for block, layer_state in zip(self.blocks, state):
            x, layer_state = block.step(x, layer_state)
            new_state.append(layer_state)
        return self.logits(x), new_state

    def prefill(self, idx):
        """Parallel pass over idx (B, T) -> logits (B, V) of the last position, and the state step continues."""
        x, states = self.hidden(idx)
        return self.logits(x[:, -1]), states

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, n_tokens=None):
        """Sample max_new_tokens after idx (B, T), prefill then a step a token -> (B, T + max_new_tokens).
        n_tokens: sample only ids below it (the tokenizer's size when the model's vocabulary is padded)."""
        if max_new_tokens <= 0:
            return idx
        logits, state = self.prefill(idx)
        tokens = [idx]
        for i in range(max_new_tokens):
            next_token = sample(logits[:, :n_tokens], temperature, top_k)  # (B,)
            tokens.append(next_token[:, None])
            if i + 1 < max_new_tokens:
                logits, state = self.step(next_token, state)
        return torch.cat(tokens, dim=1)

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
        """AdamW with weight decay on matrices and embeddings (>= 2-D) only; fused on CUDA."""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{'params': [p for p in params if p.dim() >= 2], 'weight_decay': weight_decay},
                  {'params': [p for p in params if p.dim() < 2], 'weight_decay': 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=device_type == 'cuda')
