"""
A LLaMA-style decoder whose mixer is Factorization Memory ('fm'), attention ('attn') or
Mamba-2 ('mamba2'), each with a parallel path (training, prefill) and a one-token step
(decoding) that agree to rounding.

Factorization Memory (the paper's Section 3), per token x:
    alpha = softmax(W_alpha x / tau)   (m) the router (route); sparse: its top k,
                                           renormalised to sum 1
    eta, mu = sigmoid(w_eta.x + b_eta), sigmoid(w_mu.x + b_mu)
    theta, phi = eta alpha, mu alpha   (m) write and read weights, 0 outside the top k
    xbar = W_in x
    h[i] = (1 - theta[i]) h[i] + theta[i] xbar   each memory row i: fm_scan_naive's loop
    y = W_o sum_i phi[i] h[i] / rms(h[i])
FM's block, not in the paper: fm_conv, a causal convolution + SiLU on xbar; fm_gate,
y = W_o (read-out * silu(W_z x)).
"""

import importlib
import math
import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import fm_kernel
from fm_kernel import decode_linear

try:  # mamba-ssm's Mamba-2 scan and step for CUDA tensors, where installed
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
except ImportError:
    mamba_chunk_scan_combined = selective_state_update = None

# memory rows from which sparse FM scans its k rows a token alone (memory_scan): the crossovers
# measured (docs/kernel_log.md). Triton: the dense scan is faster up to its MAX_ROWS (H100)
SPARSE_ROWS = {'triton': fm_kernel.MAX_ROWS + 1, 'torch': 64}
PEAK_BF16_FLOPS = {'A100': 312e12, 'H100': 989e12, 'H200': 989e12}  # dense, per GPU


@dataclass
class ModelConfig:
    """Model settings, checked when built: a None field takes the value its comment names."""
    # the fields each mixer family reads: --help's tags; train.py warns of one the mixer ignores
    MIXER_SETTINGS = {
        'fm': ('n_memory', 'top_k', 'd_memory', 'tau', 'fm_eps', 'fm_conv', 'fm_gate',
               'chunk_size'),
        'attn': ('n_head', 'n_kv_head', 'rope_theta'),
        'mamba2': ('d_state', 'mamba_head_dim', 'mamba_expand', 'd_conv', 'chunk_size'),
    }
    vocab_size: int = 256  # tokens the embedding holds (train.py: the tokenizer's)
    block_size: int = 256  # training context in tokens (the model has no length limit)
    n_layer: int = 4
    d_model: int = 256  # width of the residual stream
    mixer: str = 'fm'  # the blocks' mixer: a key of MIXER_CLASSES, or 'module:Class' extending one
    d_ff: int | None = None  # SwiGLU width; None: 8/3 d_model in 64s, less FM's block; 0: no MLP
    norm_eps: float = 1e-5  # RMSNorm's epsilon
    tie_embeddings: bool = True  # the LM head shares the embedding's weight
    init_std: float = 0.02  # std of every matrix's normal initialisation
    # fm
    n_memory: int = 64  # m, memory rows
    top_k: int | None = None  # k rows read and written per token; None: m (dense)
    d_memory: int | None = None  # width of a memory row; None: d_model
    tau: float = 1.0  # router softmax temperature
    fm_eps: float = 1e-6  # epsilon of the memory rows' RMS norm
    fm_conv: int = 0  # taps of a causal depthwise convolution + SiLU on xbar; 0: none (the paper's)
    fm_gate: bool = False  # gate the read-out, W_o (y * silu(W_z x)); False: none (the paper's)
    chunk_size: int = 64  # tokens a chunk of the PyTorch scans (FM's on CPU, Mamba-2's); power of 2
    # attn
    n_head: int = 8  # query heads
    n_kv_head: int | None = None  # key/value heads (grouped-query attention); None: n_head
    rope_theta: float = 10000.0  # RoPE's base
    # mamba2
    d_state: int = 64  # N, the state size of a head
    mamba_head_dim: int = 64  # P, channels a head
    mamba_expand: int = 2  # d_inner = mamba_expand * d_model
    d_conv: int = 4  # taps of the causal depthwise convolution

    def __post_init__(self):
        # checked, then the None fields resolved (a checkpoint records the values)
        self.validate()
        if self.family == 'fm':
            self.top_k = self.top_k or self.n_memory
            self.d_memory = self.d_memory or self.d_model
        if self.family == 'attn':
            self.n_kv_head = self.n_kv_head or self.n_head
        # FM's block takes its weights (W_z, the convolution's) from the MLP
        if self.d_ff is None:
            block = 0
            if self.family == 'fm':
                taps = self.fm_conv + 1 if self.fm_conv > 0 else 0
                block = self.d_memory * (self.fm_gate * self.d_model + taps)
            swiglu = 64 * math.ceil(8 * self.d_model / 3 / 64)
            self.d_ff = swiglu - round(block / (3 * self.d_model))
            if self.d_ff < 0:
                raise ValueError(f"ModelConfig.d_ff=None resolves to {self.d_ff} (FM's block "
                                 f"outweighs the MLP): set d_ff, or a smaller d_memory")

    mamba_d_inner = property(lambda self: self.mamba_expand * self.d_model)
    mamba_n_heads = property(lambda self: self.mamba_d_inner // self.mamba_head_dim)

    # the built-in mixer whose settings it takes
    family = property(lambda self: mixer_family(self.mixer))

    def validate(self):
        """ValueError naming the first bad field (of the chosen mixer's) and what to change."""
        def check(ok, field, hint):
            if not ok:
                raise ValueError(f"ModelConfig.{field}={getattr(self, field)!r}: {hint}")

        def positive(*fields):  # a field that defaults to None may be None
            for field in fields:
                value = getattr(self, field)
                optional = ModelConfig.__dataclass_fields__[field].default is None
                number = isinstance(value, (int, float)) and value > 0
                hint = 'must be positive or None' if optional else 'must be positive'
                check((optional and value is None) or number, field, hint)

        positive('vocab_size', 'block_size', 'n_layer', 'd_model', 'norm_eps', 'init_std')
        check(self.d_ff is None or (isinstance(self.d_ff, int) and self.d_ff >= 0), 'd_ff',
              'must be >= 0 (0: no MLP, as the original Mamba-2) or None')
        try:
            family = self.family
        except Exception as e:  # an import of module:Class fails in any way
            check(False, 'mixer', f"unknown mixer; use one of {', '.join(MIXER_CLASSES)} or "
                                  f"module:Class extending one ({type(e).__name__}: {e}); "
                                  f"register a new one in MIXER_CLASSES and "
                                  f"ModelConfig.MIXER_SETTINGS (model.py)")
        positive('chunk_size')  # any mixer's (one of one's own may chunk)
        check(self.chunk_size & (self.chunk_size - 1) == 0, 'chunk_size', 'must be a power of 2')
        if family == 'fm':
            positive('n_memory', 'fm_eps', 'd_memory')
            check(isinstance(self.tau, (int, float)) and self.tau >= 1e-3, 'tau',
                  'must be at least 1e-3 (below it, W_alpha x / tau overflows float32)')
            check(isinstance(self.fm_conv, int) and 0 <= self.fm_conv <= 16, 'fm_conv',
                  "must be 0 (no convolution) to 16 taps (the step kernel's window)")
            check(self.top_k is None or 1 <= self.top_k <= self.n_memory, 'top_k',
                  f"must be 1 to n_memory={self.n_memory}, or None (dense)")
        if family == 'attn':
            positive('n_head', 'rope_theta', 'n_kv_head')
            check(self.d_model % self.n_head == 0, 'd_model',
                  f"must be divisible by n_head={self.n_head}")
            check((self.d_model // self.n_head) % 2 == 0, 'n_head',
                  f"d_model/n_head must be even (RoPE); change n_head or d_model={self.d_model}")
            check(self.n_head % (self.n_kv_head or self.n_head) == 0, 'n_kv_head',
                  f"must divide n_head={self.n_head}")
        if family == 'mamba2':
            positive('d_state', 'mamba_head_dim', 'mamba_expand', 'd_conv')
            check(self.mamba_d_inner % self.mamba_head_dim == 0, 'mamba_head_dim',
                  f"must divide d_inner = mamba_expand * d_model = {self.mamba_d_inner}")


def compute_dtype(dtype):
    """float32 for half precision, else the dtype itself (float64)."""
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in at least float32."""

    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x_acc = x.to(compute_dtype(x.dtype))
        rms = torch.rsqrt(x_acc.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x_acc * rms).type_as(x) * self.weight


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up as one product."""

    def __init__(self, config):
        super().__init__()
        d, d_ff = config.d_model, config.d_ff
        self.gate_up_proj = nn.Linear(d, 2 * d_ff, bias=False)  # gate's rows, up's
        self.down_proj = nn.Linear(d_ff, d, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        hidden = F.silu(gate) * up
        # one's own (a LoRA, a quantised product)
        if type(self.down_proj) is not nn.Linear:
            return self.down_proj(hidden)
        # F.linear, but in Triton for one row in half precision on CUDA (batch-1 decoding)
        return decode_linear(hidden, self.down_proj.weight)


def real_positions(lengths, T):
    """lengths (B,) of right-padded rows -> (B, T), True at the real positions."""
    return torch.arange(T, device=lengths.device) < lengths[:, None]


# ----------------------------------------------------------------------------- Factorization Memory

def spread(idx, theta, phi, n_memory):
    """Weights of the rows idx (..., K) -> of all m rows (..., M), zeros elsewhere (idx None: as
    given)."""
    if idx is None:
        return theta, phi
    zeros = theta.new_zeros(*theta.shape[:-1], n_memory)
    return zeros.scatter(-1, idx, theta), zeros.scatter(-1, idx, phi)


def memory_scan(xbar, idx, theta, phi, h0, n_memory, eps, chunk_size):
    """The FM scan of weights' output from h0 (None: zeros) -> (y, hT). Sparse (idx (B, T, K)):
    fm_kernel.fm_sparse_scan, k rows a token, from SPARSE_ROWS rows up; else the dense scan, its
    theta and phi spread over the m rows (zeros outside idx). Triton on CUDA, else PyTorch."""
    triton_ok = triton_scan(xbar)
    if idx is not None and n_memory >= SPARSE_ROWS['triton' if triton_ok else 'torch']:
        if triton_ok:
            return fm_kernel.fm_sparse_scan(xbar, idx, theta, phi, n_memory, h0, eps)
        return fm_kernel.fm_sparse_scan_torch(xbar, idx, theta, phi, n_memory, h0, eps, chunk_size)
    theta, phi = spread(idx, theta, phi, n_memory)
    if triton_ok and n_memory <= fm_kernel.MAX_ROWS:
        return fm_kernel.fm_scan(xbar, theta, phi, h0, eps)
    if triton_ok:
        warnings.warn(f"dense FM with n_memory = {n_memory} > {fm_kernel.MAX_ROWS} runs PyTorch's "
                      f"scan (slow) on the GPU: set top_k < n_memory for the sparse scan")
    return fm_kernel.fm_scan_torch(xbar, theta, phi, h0, eps, chunk_size)


def triton_scan(xbar):
    """Whether the scans of xbar (B, T, D) run in Triton."""
    return xbar.is_cuda and xbar.dtype != torch.float64


def triton_step(h):
    """Whether a decoding step on the memory h (B, M, D) runs in Triton."""
    fits = h.shape[1] <= fm_kernel.MAX_ROWS
    return h.is_cuda and h.dtype == torch.float32 and fm_kernel.triton is not None and fits


class FactorizationMemory(nn.Module):
    """FM: m memory rows of width d_memory; each token writes and reads its top-k rows."""

    def __init__(self, config):
        super().__init__()
        d, self.d_memory = config.d_model, config.d_memory
        self.n_memory, self.top_k, self.tau = config.n_memory, config.top_k, config.tau
        self.eps, self.chunk_size, self.gated = config.fm_eps, config.chunk_size, config.fm_gate
        self.router = nn.Linear(d, self.n_memory, bias=False)  # W_alpha
        self.rates = nn.Linear(d, 2)  # (w_eta, b_eta), (w_mu, b_mu)
        nn.init.zeros_(self.rates.bias)  # eta and mu start near 0.5
        self.in_proj = nn.Linear(d, (1 + self.gated) * self.d_memory, bias=False)  # W_in (then W_z)
        self.conv = None
        if config.fm_conv:  # on xbar
            dim = self.d_memory
            self.conv = nn.Conv1d(dim, dim, config.fm_conv, groups=dim)
        self.out_proj = nn.Linear(self.d_memory, d, bias=False)  # W_o
        # step routes in fm_kernel.fm_route_step (init_state decides)
        self.fused_router = False

    def router_scores(self, x):
        """x (..., d_model) -> W_alpha x, w_eta.x + b_eta, w_mu.x + b_mu (..., M + 2),
        in float32 at least."""
        with torch.autocast(x.device.type, enabled=False):
            dtype = compute_dtype(x.dtype)
            x = x.to(dtype)
            weight = torch.cat([self.router.weight, self.rates.weight])
            weight = weight.to(dtype)  # (M + 2, d_model)
            bias = F.pad(self.rates.bias.to(dtype), (self.n_memory, 0))  # (M + 2,): 0 on W_alpha x
            # F.linear, fused in a compiled step
            return fm_kernel.router_linear(x, weight, bias)

    def route(self, x):
        """x (..., d_model) -> rows idx (..., K) (None: dense), alpha (..., K), eta, mu (..., 1)."""
        scores = self.router_scores(x)
        logits, eta_logit, mu_logit = scores.split([self.n_memory, 1, 1], dim=-1)
        alpha = torch.softmax(logits / self.tau, dim=-1)  # softmax(W_alpha x / tau)  (..., M)
        idx = None
        if self.top_k < self.n_memory:  # sparse: the top k, renormalised
            # sort compiles to a kernel (topk: a library call)
            alpha, idx = alpha.sort(dim=-1, descending=True)
            alpha, idx = alpha[..., :self.top_k], idx[..., :self.top_k]
            alpha = alpha / alpha.sum(-1, keepdim=True)
        # eta, mu = sigmoid(w.x + b)
        return idx, alpha, torch.sigmoid(eta_logit), torch.sigmoid(mu_logit)

    def weights(self, idx, alpha, eta, mu):
        """route's output -> theta = eta alpha, phi = mu alpha (..., K): the weights of the rows
        idx (of all M rows when idx is None)."""
        return eta * alpha, mu * alpha

    def forward(self, x, state=None, lengths=None):  # x (B, T, d_model)
        """-> y (B, T, d_model), state {'h', 'conv'} after each row's last real token."""
        idx, *routed = self.route(x)
        theta, phi = self.weights(idx, *routed)  # (B, T, K)
        if lengths is not None:  # padding writes nothing (theta = 0)
            theta = theta * real_positions(lengths, x.shape[1])[..., None]
        state = state or {}
        xbar, z = self.in_proj(x), None  # (B, T, d_memory)
        if self.gated:
            xbar, z = xbar.chunk(2, dim=-1)
        new_state = {}
        if self.conv is not None:  # from the last inputs of the pass before
            weight, bias = self.conv.weight[:, 0], self.conv.bias
            xbar, new_state['conv'] = fm_kernel.causal_conv(
                xbar, state.get('conv'), weight, bias, lengths)
        y, new_state['h'] = memory_scan(xbar, idx, theta, phi, state.get('h'), self.n_memory,
                                        self.eps, self.chunk_size)
        if z is not None:
            y = y * F.silu(z)
        return self.out_proj(y), new_state

    def step(self, x, state):  # x (B, d_model)
        """One token: the state updated in place -> y (B, d_model). fused_router: from
        router_scores in one kernel (fm_kernel.fm_route_step); else route and weights as
        written, then fm_step."""
        h, xbar, z = state['h'], self.in_proj(x), None  # xbar (B, d_memory)
        if self.gated:
            xbar, z = xbar.chunk(2, dim=-1)
        conv = None
        if self.conv is not None:
            conv = (state['conv'], self.conv.weight[:, 0], self.conv.bias)
        if self.fused_router:  # route, weights and step in one kernel
            return self.out_proj(self.fused_step(x, h, xbar, z, conv))
        if conv is not None:
            xbar = fm_kernel.conv_step_naive(xbar, *conv)
        idx, *routed = self.route(x)
        theta, phi = self.weights(idx, *routed)  # (B, K)
        if idx is None:  # dense: every row
            idx = torch.arange(self.n_memory, device=x.device).expand(len(x), -1)
        step = fm_kernel.fm_step_naive
        if triton_step(h):
            step = fm_kernel.fm_step
        y = step(h, xbar, idx, theta, phi, self.eps)
        if z is not None:
            y = y * F.silu(z)
        return self.out_proj(y)

    def fused_step(self, x, h, xbar, z, conv):
        """step's route, weights and update of h from router_scores in one kernel
        (fm_kernel.fm_route_step; its reference off Triton) -> y (B, d_memory)."""
        route_step = fm_kernel.fm_route_step_naive
        if triton_step(h):
            route_step = fm_kernel.fm_route_step
        scores = self.router_scores(x)  # (B, M + 2)
        return route_step(h, xbar, scores, self.top_k, self.tau, self.eps, z, conv)

    def step_state_bytes(self, context):
        """Bytes of state a decoding step reads and writes a sequence: k rows, the window."""
        dtype = self.in_proj.weight.dtype
        rows = self.top_k * self.d_memory * compute_dtype(dtype).itemsize
        window = 0
        if self.conv is not None:
            window = self.d_memory * (self.conv.kernel_size[0] - 1) * dtype.itemsize
        return 2 * (rows + window)

    def init_state(self, batch_size, max_len, device):
        """Empty buffers; and whether step routes fused (fm_kernel.route_step_takes_over), or
        fm_kernel.DecodingError where a router reads other tokens and the step is not its own."""
        if torch.device(device).type != 'meta':  # a meta state only counts bytes
            own_step = type(self).step is not FactorizationMemory.step
            self.fused_router = fm_kernel.route_step_takes_over(self, tokens_alone=not own_step)
        dtype = self.in_proj.weight.dtype
        shape = (batch_size, self.n_memory, self.d_memory)
        state = {'h': torch.zeros(shape, dtype=compute_dtype(dtype), device=device)}
        if self.conv is not None:  # the convolution's last inputs
            window = self.conv.kernel_size[0] - 1
            shape = (batch_size, self.d_memory, window)
            state['conv'] = torch.zeros(shape, dtype=dtype, device=device)
        return state


# ----------------------------------------------------------------------------- attention

def rotate(x, positions, rope_theta):
    """RoPE (halves) on x (B, H, T, hd) at positions (B or 1, T); float32 angles (bfloat16's are
    off by radians)."""
    hd = x.shape[-1]
    dims = torch.arange(0, hd, 2, dtype=torch.float32, device=x.device)
    inv_freq = rope_theta ** (-dims / hd)  # (hd/2,)
    angles = positions.float()[:, None, :, None] * inv_freq  # (B, 1, T, hd/2)
    dtype = compute_dtype(x.dtype)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    x1, x2 = x.to(dtype).chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


class Attention(nn.Module):
    """Causal grouped-query attention with RoPE; decoding fills a static KV cache."""

    def __init__(self, config):
        super().__init__()
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head
        self.head_dim = config.d_model // config.n_head
        heads = self.n_head + 2 * self.n_kv_head  # q, k, v
        self.qkv_proj = nn.Linear(config.d_model, heads * self.head_dim, bias=False)
        self.out_proj = nn.Linear(self.n_head * self.head_dim, config.d_model, bias=False)
        self.rope_theta = config.rope_theta

    def project(self, x, positions):
        """x (B, T, d_model) at positions (B, T) -> q (B, H, T, hd), k, v (B, Hkv, T, hd)."""
        B, T, _ = x.shape
        heads = self.qkv_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        q, k, v = heads.split([self.n_head, self.n_kv_head, self.n_kv_head], dim=1)
        return rotate(q, positions, self.rope_theta), rotate(k, positions, self.rope_theta), v

    def merge_heads(self, y):
        """(B, H, T, hd) -> out_proj over the heads: (B, T, d_model)."""
        B, H, T, hd = y.shape
        return self.out_proj(y.transpose(1, 2).reshape(B, T, H * hd))

    def forward(self, x, state=None, lengths=None):  # x (B, T, d_model)
        """-> y (B, T, d_model), state {'k', 'v' (B, Hkv, T, hd), 'pos' (B,): tokens cached}."""
        if state is not None:
            raise ValueError('attention continues from its KV cache one token at a time (step)')
        B, T, _ = x.shape
        q, k, v = self.project(x, torch.arange(T, device=x.device)[None])
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        pos = torch.full((B,), T, device=x.device)  # (B,)
        if lengths is not None:
            pos = lengths.clone()
        return self.merge_heads(y), {'k': k, 'v': v, 'pos': pos}

    def step(self, x, state):  # x (B, d_model)
        """One token: its key and value into each row's cache, attention over the filled part."""
        pos = state['pos']  # (B,)
        q, k, v = self.project(x[:, None], pos[:, None])  # q (B, H, 1, hd), k, v (B, Hkv, 1, hd)
        rows = torch.arange(len(pos), device=pos.device)
        state['k'][rows, :, pos], state['v'][rows, :, pos] = k[:, :, 0], v[:, :, 0]
        pos += 1
        B, Hkv, L, hd = state['k'].shape
        # query head h reads KV head h // (H / Hkv), as SDPA's
        q = q.view(B, Hkv, self.n_head // Hkv, hd)
        scores = q @ state['k'].transpose(-1, -2)  # (B, Hkv, H/Hkv, L)
        scores = scores.to(compute_dtype(q.dtype)) / math.sqrt(hd)
        filled = torch.arange(L, device=pos.device) < pos[:, None]  # (B, L)
        probs = torch.softmax(scores.masked_fill(~filled[:, None, None], -math.inf), dim=-1)
        y = probs.to(v.dtype) @ state['v']  # (B, Hkv, H / Hkv, hd)
        return self.merge_heads(y.view(B, self.n_head, 1, hd))[:, 0]

    def step_state_bytes(self, context):
        """Bytes of state a decoding step reads a sequence after context tokens: its cache."""
        return 2 * context * self.n_kv_head * self.head_dim * self.qkv_proj.weight.element_size()

    def init_state(self, batch_size, max_len, device):
        shape = (batch_size, self.n_kv_head, max_len, self.head_dim)
        cache = self.qkv_proj.weight.new_zeros(shape, device=device)
        pos = torch.zeros(batch_size, dtype=torch.long, device=device)
        return {'k': cache, 'v': cache.clone(), 'pos': pos}


# ----------------------------------------------------------------------------- Mamba-2

def ssd_scan(x, dt, A, B, C, chunk_size, h0=None):
    """Mamba-2's SSD in chunks from h0 (None: zeros):
    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t.
    x (b, T, H, P), dt (b, T, H) after softplus, A (H,) < 0, B, C (b, T, N),
    h0 (b, H, P, N) -> y (like x), hT."""
    out_dtype, dtype = x.dtype, compute_dtype(x.dtype)
    b, T, H, P = x.shape
    L = min(chunk_size, T)
    pad = -T % L  # padded steps have dt = 0: no decay, no input
    x, dt, B, C = (F.pad(t.to(dtype), (0, 0) * (t.dim() - 2) + (0, pad)) for t in (x, dt, B, C))
    n_chunks = (T + pad) // L
    x, dt = x.view(b, n_chunks, L, H, P), dt.view(b, n_chunks, L, H)
    B, C = B.view(b, n_chunks, L, -1), C.view(b, n_chunks, L, -1)  # (b, c, L, N)
    log_decay = torch.cumsum(dt * A.to(dtype), dim=2)  # (b, c, L, H) from the chunk's start to t
    x_dt = x * dt[..., None]  # (b, c, L, H, P)
    causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()[..., None]  # (t, s, 1)
    # (b, c, t, s, H) from step s to step t
    log_decay_ts = log_decay[:, :, :, None] - log_decay[:, :, None]
    decay_ts = log_decay_ts.masked_fill(~causal, -math.inf).exp()
    weights = torch.einsum('bctn,bcsn->bcts', C, B)[..., None] * decay_ts  # (b, c, t, s, H)
    y = torch.einsum('bctsh,bcshp->bcthp', weights, x_dt)  # within a chunk
    decay_to_end = (log_decay[:, :, -1:] - log_decay).exp()  # (b, c, L, H)
    # each chunk's own end state
    chunk_states = torch.einsum('bclh,bclhp,bcln->bchpn', decay_to_end, x_dt, B)
    h = x.new_zeros(b, H, P, B.shape[-1])
    if h0 is not None:
        h = h0.to(dtype)
    states_in = []  # state entering each chunk
    for c in range(n_chunks):
        states_in.append(h)
        h = log_decay[:, c, -1].exp()[..., None, None] * h + chunk_states[:, c]
    states_in = torch.stack(states_in, dim=1)  # (b, c, H, P, N)
    y = y + torch.einsum('bctn,bchpn->bcthp', C, states_in) * log_decay.exp()[..., None]
    return y.reshape(b, n_chunks * L, H, P)[:, :T].to(out_dtype), h


class Mamba2(nn.Module):
    """Mamba-2: in_proj -> z, x, B, C, dt; conv + SiLU on (x, B, C); SSD scan, D skip;
    norm(y * silu(z)); out_proj."""

    def __init__(self, config):
        super().__init__()
        self.d_inner, self.n_heads = config.mamba_d_inner, config.mamba_n_heads
        self.head_dim, self.d_state = config.mamba_head_dim, config.d_state
        self.chunk_size = config.chunk_size
        self.conv_dim = self.d_inner + 2 * self.d_state  # channels of (x, B, C)
        width = self.d_inner + self.conv_dim + self.n_heads  # z, (x, B, C), dt
        self.in_proj = nn.Linear(config.d_model, width, bias=False)
        channels = self.conv_dim
        self.conv = nn.Conv1d(channels, channels, config.d_conv, groups=channels)
        log_dt = torch.empty(self.n_heads).uniform_(math.log(1e-3), math.log(1e-1))
        dt = torch.exp(log_dt)  # log-uniform
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt
        A = torch.empty(self.n_heads).uniform_(1, 16)
        self.A_log = nn.Parameter(torch.log(A))  # A = -exp(A_log)
        self.D = nn.Parameter(torch.ones(self.n_heads))
        self.norm = RMSNorm(self.d_inner, config.norm_eps)
        self.out_proj = nn.Linear(self.d_inner, config.d_model, bias=False)

    def forward(self, u, state=None, lengths=None):  # u (b, T, d_model)
        """-> y (b, T, d_model), state {'conv', 'ssm'} after each row's last real token."""
        b, T, _ = u.shape
        state = state or {}
        z, xBC, dt = self.in_proj(u).split([self.d_inner, self.conv_dim, self.n_heads], dim=-1)
        weight, bias = self.conv.weight[:, 0], self.conv.bias
        xBC, conv_state = fm_kernel.causal_conv(xBC, state.get('conv'), weight, bias, lengths)
        x, B, C = xBC.split([self.d_inner, self.d_state, self.d_state], dim=-1)
        x = x.reshape(b, T, self.n_heads, self.head_dim)
        dt = F.softplus(dt + self.dt_bias)  # (b, T, H)
        if lengths is not None:  # padding: dt = 0, no decay and no input
            dt = dt * real_positions(lengths, T)[..., None]
        A = -torch.exp(self.A_log)
        if mamba_chunk_scan_combined is not None and x.is_cuda:  # mamba-ssm's kernel
            y, ssm_state = mamba_chunk_scan_combined(
                x, dt, A, B[:, :, None], C[:, :, None], self.chunk_size,
                initial_states=state.get('ssm'), return_final_states=True)
        else:
            y, ssm_state = ssd_scan(x, dt, A, B, C, self.chunk_size, state.get('ssm'))
        y = y + self.D[:, None] * x  # (b, T, H, P)
        y = self.norm(y.reshape(b, T, self.d_inner) * F.silu(z))
        return self.out_proj(y), {'conv': conv_state, 'ssm': ssm_state}

    def step(self, u, state):  # u (b, d_model)
        """One token: ssm (b, H, P, N) <- exp(dt A) ssm + dt x B^T in place,
        y = ssm C + D x -> (b, d_model)."""
        z, xBC, dt = self.in_proj(u).split([self.d_inner, self.conv_dim, self.n_heads], dim=-1)
        xBC = fm_kernel.conv_step_naive(xBC, state['conv'], self.conv.weight[:, 0], self.conv.bias)
        x, B, C = xBC.split([self.d_inner, self.d_state, self.d_state], dim=-1)
        x = x.reshape(-1, self.n_heads, self.head_dim)  # (b, H, P)
        ssm = state['ssm']  # (b, H, P, N)
        if selective_state_update is not None and u.is_cuda:
            # mamba-ssm's kernel, per-head values over (P, N)
            b, H, P = x.shape
            A = -torch.exp(self.A_log.float())[:, None, None].expand(H, P, self.d_state)
            D, dt_bias = self.D[:, None].expand(H, P), self.dt_bias[:, None].expand(H, P)
            dt = dt[..., None].expand(b, H, P)
            y = selective_state_update(ssm, x, dt, A, B[:, None], C[:, None], D=D,
                                       dt_bias=dt_bias, dt_softplus=True)
        else:
            dtype = ssm.dtype
            dt = F.softplus(dt + self.dt_bias).to(dtype)  # (b, H)
            decay = torch.exp(dt * -torch.exp(self.A_log.to(dtype)))  # (b, H)
            x_dt = dt[..., None] * x.to(dtype)  # (b, H, P)
            ssm.mul_(decay[..., None, None]).add_(x_dt[..., None] * B.to(dtype)[:, None, None])
            y = torch.einsum('bhpn,bn->bhp', ssm, C.to(dtype)).to(x.dtype) + self.D[:, None] * x
        y = self.norm(y.reshape(-1, self.d_inner) * F.silu(z))
        return self.out_proj(y)

    def step_state_bytes(self, context):
        """Bytes of state a decoding step reads and writes a sequence: all of it."""
        return 2 * sum(t.numel() * t.element_size() for t in self.init_state(1, 1, 'meta').values())

    def init_state(self, batch_size, max_len, device):
        dtype, window = self.in_proj.weight.dtype, self.conv.kernel_size[0] - 1
        return {'conv': torch.zeros(batch_size, self.conv_dim, window, dtype=dtype, device=device),
                'ssm': torch.zeros(batch_size, self.n_heads, self.head_dim, self.d_state,
                                   dtype=compute_dtype(dtype), device=device)}


# ----------------------------------------------------------------------------- the model

# a new mixer: README, Changing the model
MIXER_CLASSES = {'fm': FactorizationMemory, 'attn': Attention, 'mamba2': Mamba2}


def mixer_class(name):
    """The class a key of MIXER_CLASSES or 'module:Class' names."""
    if name in MIXER_CLASSES:
        return MIXER_CLASSES[name]
    module, colon, cls = str(name).partition(':')
    if not colon:
        raise ValueError('not a built-in mixer, nor module:Class')
    return getattr(importlib.import_module(module), cls)


def mixer_family(name):
    """The key of MIXER_CLASSES whose class the mixer is or extends."""
    cls = mixer_class(name)
    for family, base in MIXER_CLASSES.items():
        if isinstance(cls, type) and issubclass(cls, base):
            return family
    raise ValueError(f'{name} extends none of them')


class Block(nn.Module):
    """x + mixer(norm(x)), then x + mlp(norm(x)) unless d_ff = 0."""

    def __init__(self, config):
        super().__init__()
        self.mixer_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mixer = mixer_class(config.mixer)(config)
        self.mlp_norm, self.mlp = None, None
        if config.d_ff:
            self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
            self.mlp = SwiGLU(config)

    def add_mlp(self, x):
        if self.mlp is None:
            return x
        return x + self.mlp(self.mlp_norm(x))

    def forward(self, x, state=None, lengths=None):  # x (B, T, d_model)
        y, state = self.mixer(self.mixer_norm(x), state, lengths)
        return self.add_mlp(x + y), state

    def step(self, x, state):  # x (B, d_model)
        return self.add_mlp(x + self.mixer.step(self.mixer_norm(x), state))


class Model(nn.Module):
    """Embedding, n_layer Blocks, a final RMSNorm, the LM head (tied to the embedding)."""

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
        self.apply(self._init_weights)  # children before parents, as nn.Module.apply
        # residual output projections, GPT-2 style
        for name, p in self.named_parameters():
            if name.endswith(('out_proj.weight', 'down_proj.weight')):
                nn.init.normal_(p, mean=0.0, std=config.init_std / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):  # a bias is its module's (FM's rates: zero)
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.init_std)

    def head(self, x):
        """Final norm and LM head: logits in the head's dtype."""
        return self.lm_head(self.norm(x))

    def logits(self, x):
        """Logits for sampling, in at least float32."""
        logits = self.head(x)
        return logits.to(compute_dtype(logits.dtype))

    def hidden(self, idx, state=None, lengths=None):
        """idx (B, T) from state (None: fresh) -> hidden states (B, T, d_model), the states after
        each row's last real token (lengths (B,) of right-padded rows; None: T)."""
        x, states = self.embed(idx), []
        for block, layer_state in zip(self.blocks, state or [None] * len(self.blocks)):
            x, layer_state = block(x, layer_state, lengths)
            states.append(layer_state)
        return x, states

    def forward(self, idx, targets=None):
        """idx (B, T) -> logits (B, T, V) in the head's dtype; with targets, the mean loss."""
        logits = self.head(self.hidden(idx)[0])
        if targets is None:
            return logits, None
        flat = logits.flatten(0, 1).to(compute_dtype(logits.dtype))
        return logits, F.cross_entropy(flat, targets.flatten(), ignore_index=-1)

    def init_state(self, batch_size, max_len, device=None):
        """Empty decoding states for max_len tokens a row: a dict a layer, its mixer's."""
        if device is None:
            device = self.embed.weight.device
        return [block.mixer.init_state(batch_size, max_len, device) for block in self.blocks]

    def decoding_refusal(self):
        """None where the model decodes, else the line of init_state's fm_kernel.DecodingError."""
        try:
            self.init_state(1, 1)
        except fm_kernel.DecodingError as e:
            return str(e)
        return None

    def step(self, tokens, state):
        """Decode one token: tokens (B,) -> logits (B, V), the state updated in place."""
        x = self.embed(tokens)  # (B, d_model)
        for block, layer_state in zip(self.blocks, state):
            x = block.step(x, layer_state)
        return self.logits(x)

    def num_params(self, non_embedding=True):
        """Parameters; non_embedding: without the embedding and the LM head."""
        n = sum(p.numel() for p in self.parameters())  # the tied weight once
        if not non_embedding:
            return n
        n -= self.embed.weight.numel()
        if not self.config.tie_embeddings:
            n -= self.lm_head.weight.numel()
        return n

    def flops_per_token(self, seq_len):
        """Training FLOPs a token at seq_len: 6 (N_nonembedding + d_model V), n_layer mixers'."""
        c = self.config
        if c.family == 'attn':  # QK^T, AV; no causal discount, as nanoGPT
            mixer = 12 * seq_len * c.d_model
        elif c.family == 'fm':  # the paper's App. FLOPS
            mixer = 3 * c.top_k * (9 * c.d_memory + 5)
        elif c.family == 'mamba2':  # decay, x B^T, add, C
            mixer = 3 * 5 * c.mamba_d_inner * c.d_state
        else:
            raise ValueError(f'no FLOPs count for mixer {c.mixer!r}: '
                             'add its term to Model.flops_per_token')
        return float(6 * (self.num_params() + c.d_model * c.vocab_size) + c.n_layer * mixer)

    def estimate_mfu(self, tokens_per_sec, device_name=None):
        """Model FLOPs utilisation of a GPU (None: the model's; 0 if not in PEAK_BF16_FLOPS)."""
        if device_name is None and self.embed.weight.is_cuda:
            device_name = torch.cuda.get_device_name(self.embed.weight.device)
        peak = math.inf
        for key, flops in PEAK_BF16_FLOPS.items():
            if key in (device_name or '').upper():
                peak = flops
                break
        return self.flops_per_token(self.config.block_size) * tokens_per_sec / peak

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        """AdamW, weight decay on matrices and embeddings only; fused on CUDA."""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{'params': [p for p in params if p.dim() >= 2], 'weight_decay': weight_decay},
                  {'params': [p for p in params if p.dim() < 2], 'weight_decay': 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=device_type == 'cuda')


def write_state(static, states, rows=slice(None)):
    """Copy a parallel pass's states into rows of static decoding buffers, at each start."""
    for static_layer, layer in zip(static, states):
        for name, tensor in layer.items():
            static_layer[name][rows][tuple(slice(0, n) for n in tensor.shape)] = tensor
