"""
Levers that might make FM's memory rows hold long-range information (issue 39), each a subclass of model.py's
FactorizationMemory that train.py takes as --mixer=research.levers:ClassName, here on the 4.1M block:
    python train.py research/extrapolation_fm.py --fm_conv=4 --fm_gate=True --mixer=research.levers:RowRatesFM
At 4.1M parameters on long documents, one row per layer takes most of the router's weight and is rewritten every 2-3
tokens; the write gate eta = sigmoid(w_eta.x + b_eta) starts near 0.5 for every token and no row has a rate of its
own, where Mamba-2 starts its heads at a spread of decay rates. The fourth lever, what the model is asked to
remember, is a context of 2048 with the same tokens a step (--batch_size=8 --block_size=2048); the fifth caps the
write rate (SlowWriteFM); the sixth, a longer local path that might free the rows from buffering the last few tokens,
is --fm_conv=16 (alone and with SlowWriteFM).
A class that overrides route decodes through it (fm_kernel.route_step_takes_over); LowWriteFM keeps the
fused kernel. The seventh, ConvRouterFM, routes (rows and rates) on the last few tokens rather
than the token alone (multi-query associative recall, issue 55: research/recall.py
--mixer=research.levers:ConvRouterFM); it trains but does not decode.
"""
import math

import torch
import torch.nn as nn

import fm_kernel
from model import FactorizationMemory


class LowWriteFM(FactorizationMemory):
    """1. The write gate starts low: b_eta = logit(0.05), so eta starts near 0.05 for every token (b_mu stays 0).
    Only the initialisation changes (decoding keeps the fused kernel)."""
    ETA0 = 0.05

    def __init__(self, config):
        super().__init__(config)
        with torch.no_grad():
            self.rates.bias[0] = math.log(self.ETA0 / (1 - self.ETA0))  # logit; index 0: eta's bias, 1: mu's


class RowRatesFM(FactorizationMemory):
    """2. A learned write-rate bias per row, row_rate (M,), starting at a spread of timescales as Mamba-2's dt:
    sigmoid(row_rate) log-uniform in [1e-3, 0.5] across the rows; a selected row i writes at
    eta_i = sigmoid(w_eta.x + b_eta + row_rate[i]) (dense: every row). 1-D, so without weight decay."""
    RATES = (1e-3, 0.5)

    def __init__(self, config):
        super().__init__(config)
        low, high = self.RATES
        rates = torch.logspace(math.log10(low), math.log10(high), self.n_memory, dtype=torch.float64)
        self.row_rate = nn.Parameter(torch.logit(rates).float())

    def route(self, x):
        with torch.autocast(x.device.type, enabled=False):
            scores = self.router_scores(x)  # (..., M + 2)
            idx, alpha, _, mu = fm_kernel.route_naive(scores, self.top_k, self.tau)
            bias = self.row_rate.to(scores.dtype)
            eta = torch.sigmoid(scores[..., -2:-1] + (bias if idx is None else bias[idx]))  # (..., K)
            return idx, alpha, eta, mu


class HeadsFM(FactorizationMemory):
    """3. HEADS memories of M/HEADS rows, each with its own router: the router's M scores in HEADS groups of
    consecutive rows, a softmax and the top-(K/HEADS) within each group, each head's alpha summing to 1/HEADS (all
    of them to 1, as the read-out assumes). Dense (K = M) keeps every row. M and K must be divisible by HEADS."""
    HEADS = 4

    def __init__(self, config):
        super().__init__(config)
        if self.n_memory % self.HEADS or self.top_k % self.HEADS:
            raise ValueError(f'{type(self).__name__} splits the rows into {self.HEADS} heads: n_memory='
                             f'{self.n_memory} and top_k={self.top_k} must both be divisible by {self.HEADS}')

    def route(self, x):
        H, M, K = self.HEADS, self.n_memory, self.top_k
        with torch.autocast(x.device.type, enabled=False):
            scores = self.router_scores(x)  # (..., M + 2)
            rate_logits = scores[..., None, -2:].expand(*scores.shape[:-1], H, 2)
            heads = torch.cat([scores[..., :-2].unflatten(-1, (H, M // H)), rate_logits], -1)  # (..., H, M/H + 2)
            idx, alpha, eta, mu = fm_kernel.route_naive(heads, K // H, self.tau)  # each head routed on its own
            if idx is not None:
                idx = (idx + torch.arange(0, M, M // H, device=x.device)[:, None]).flatten(-2)  # head h: its rows
            return idx, alpha.flatten(-2) / H, eta[..., 0, :], mu[..., 0, :]


class Heads16FM(HeadsFM):
    """3. HeadsFM with 16 heads: at m = 64, k = 16, one row of 4 a head, every selected row at alpha = 1/16 (the
    router picks rows but cannot weight them: the opposite of one row taking most of the weight)."""
    HEADS = 16


class SlowWriteFM(FactorizationMemory):
    """5. Writes capped: eta = ETA_MAX sigmoid(w_eta.x + b_eta), so a selected row keeps at least 1 - ETA_MAX of what
    it holds each token (the block's heaviest row is written at theta ~0.4 a token: rewritten every 2-3 tokens)."""
    ETA_MAX = 0.1

    def route(self, x):
        idx, alpha, eta, mu = super().route(x)
        return idx, alpha, self.ETA_MAX * eta, mu


class ConvRouterFM(FactorizationMemory):
    """7. The router (the rows' logits and the rates eta and mu) reads a causal depthwise
    convolution + SiLU of the last TAPS inputs (as Mamba-2's B and C), not the token alone: a
    key-value pair can be written to rows chosen by the key before the value. A pass from the start only: a decoding step, or a pass after a state,
    would need the router's window in the state (not built)."""
    TAPS = 4

    def __init__(self, config):
        super().__init__(config)
        d = config.d_model
        self.router_conv = nn.Conv1d(d, d, self.TAPS, groups=d)

    def forward(self, x, state=None, lengths=None):
        if state or lengths is not None:
            name = type(self).__name__
            raise NotImplementedError(f"{name} keeps no window of its router's inputs: "
                                      'a pass from the start of unpadded rows only')
        return super().forward(x)

    def route(self, x):  # x (B, T, d_model); init_state refuses to decode (fm_kernel.DecodingError)
        weight, bias = self.router_conv.weight[:, 0], self.router_conv.bias
        mixed = fm_kernel.causal_conv(x, None, weight, bias)[0]  # (B, T, d_model)
        return super().route(mixed)

    def init_state(self, batch_size, max_len, device):
        """FactorizationMemory's buffers and the router's window a step would keep: counted (on
        'meta', research/recall.py's bytes); on a device its probe refuses, for there is no step."""
        state = super().init_state(batch_size, max_len, device)
        shape = (batch_size, self.router_conv.in_channels, self.TAPS - 1)
        dtype = self.in_proj.weight.dtype
        state['router_window'] = torch.zeros(shape, dtype=dtype, device=device)
        return state

    def step_state_bytes(self, context):
        """FactorizationMemory's, and the router's window read and written."""
        itemsize = self.in_proj.weight.dtype.itemsize
        window = self.router_conv.in_channels * (self.TAPS - 1) * itemsize
        return super().step_state_bytes(context) + 2 * window
