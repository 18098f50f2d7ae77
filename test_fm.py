"""The test suite: `python test_fm.py` (or `pytest test_fm.py`); CPU only, a few minutes on 2 cores.
`pytest -m core test_fm.py`: the core checks alone (the tests marked @core), in under a minute.

Kernels: the float64 loop `fm_scan_naive` checks `fm_scan_torch`, and both check the Triton kernels,
which run on the CPU under TRITON_INTERPRET=1 when no GPU is present (as in CI). Then the model
(decode parity of every mixer, overfitting, configs), the data pipeline, training and sampling.
"""

import contextlib
import copy
import csv
import errno
import glob
import json
import math
import os
import re
import signal
import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first Triton import

import pytest

import fm_kernel
import gemv
import prepare_data
import sample
import train
import checkpoint
from configurator import ConfigError, help_text, load_config, optional_types
from fm_kernel import fm_scan, fm_scan_naive, fm_scan_torch, fm_step, fm_step_naive
import model as model_module
import generate
from generate import Generator, Sampling, sample_next
from model import FactorizationMemory, Model, ModelConfig
from prepare_data import HEADER, get_tokenizer, load_default_corpus, load_tokens, prepare

CUDA = torch.cuda.is_available()


def _interpret_bf16_as_on_gpu():
    """Two bfloat16 bugs of Triton 3.9's interpreter (private API, checked against that version): tl.dot
    multiplies the raw bits of bfloat16 operands (it stores bfloat16 as uint16), and float32 -> bfloat16 casts
    truncate. Hand tl.dot float32 copies (exact for bfloat16 values) and round casts to nearest even, as a GPU
    does, so CI runs the kernels' bfloat16 products."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    dot, cast = builder.create_dot, builder.cast_impl

    def as_float(h):
        if h.dtype.scalar != tl.bfloat16:
            return h
        return interpreter.TensorHandle(
            interpreter._convert_float(h.data, tl.bfloat16, tl.float32, None).view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return dot(self, as_float(a), as_float(b), d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        if not (src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16):
            return cast(self, src, dst_type)
        bits = src.data.astype(np.float32).view(np.uint32)
        nearest = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # carries into the exponent
        return interpreter.TensorHandle(np.where(np.isnan(src.data), np.uint16(0x7FC0), nearest), tl.bfloat16)

    builder.create_dot, builder.cast_impl = create_dot, cast_impl


if fm_kernel.triton is not None and os.environ.get("TRITON_INTERPRET") == "1":
    _interpret_bf16_as_on_gpu()
needs_triton = pytest.mark.skipif(fm_kernel.triton is None, reason="Triton is not installed (Linux only)")
core = pytest.mark.core  # the checks a forker runs after every change: pytest -m core test_fm.py (under a minute)
DEVICE = "cuda" if CUDA else "cpu"


def rel_err(a, b):
    """||a - b|| / ||b|| in float64; NaN anywhere fails."""
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "non-finite values"
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def router(B, T, M, k, rate=None, dtype=torch.float64, device="cpu", generator=None):
    """theta, phi (B, T, M) as the FM layer makes them: top-k softmax weights times a rate."""
    alpha = torch.softmax(2 * torch.randn(B, T, M, dtype=dtype, device=device, generator=generator), -1)
    if k < M:
        top, idx = alpha.topk(k, -1)
        alpha = torch.zeros_like(alpha).scatter(-1, idx, top / top.sum(-1, keepdim=True))
    if rate is None:
        eta = torch.rand(B, T, 1, dtype=dtype, device=device, generator=generator)
        mu = torch.rand(B, T, 1, dtype=dtype, device=device, generator=generator)
    else:  # every selected row written at (nearly) the same rate: near 0 or near 1
        alpha = (alpha > 0).to(dtype)
        eta = mu = torch.full((B, T, 1), rate, dtype=dtype, device=device)
    return eta * alpha, mu * alpha


def scan_inputs(B, T, D, M, k, h0=True, rate=None, device="cpu"):
    x = torch.randn(B, T, D, dtype=torch.float64, device=device)
    theta, phi = router(B, T, M, k, rate, device=device)
    h = torch.randn(B, M, D, dtype=torch.float64, device=device) if h0 else None
    return [x, theta, phi, h]


def scan_and_grads(fn, inputs, grad_y, grad_h, **kw):
    """Outputs y, hT and the gradients wrt every input that is not None."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in inputs]
    y, hT = fn(*leaves, **kw)
    loss = (y * grad_y.to(y.dtype)).sum() + (hT * grad_h.to(hT.dtype)).sum()
    grads = torch.autograd.grad(loss, [t for t in leaves if t is not None])
    return [y, hT, *grads]


def assert_close_all(got, want, tol):
    names = ["y", "hT", "dxbar", "dtheta", "dphi", "dh0"]
    for name, a, b in zip(names, got, want):
        err = rel_err(a, b)
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e}"


# ============================================================================= fm_kernel.py: references


@core
@pytest.mark.parametrize("T", [1, 17, 64, 200])
@pytest.mark.parametrize("k", [1, 4, 16])
@pytest.mark.parametrize("with_h0", [True, False])
def test_chunked_torch_matches_loop(T, k, with_h0):
    torch.manual_seed(T * 100 + k)
    inputs = scan_inputs(2, T, 24, 16, k, h0=with_h0)
    grad_y, grad_h = torch.randn(2, T, 24, dtype=torch.float64), torch.randn(2, 16, 24, dtype=torch.float64)
    want = scan_and_grads(fm_scan_naive, inputs, grad_y, grad_h)
    got = scan_and_grads(fm_scan_torch, inputs, grad_y, grad_h, chunk_size=16)
    assert_close_all(got, want, 1e-10)


@core
@pytest.mark.parametrize("rate", [1e-4, 0.5, 1 - 1e-6, 1.0])
def test_chunked_torch_extreme_rates(rate):
    torch.manual_seed(1)
    inputs = scan_inputs(1, 50, 16, 8, 2, rate=rate)
    grad_y, grad_h = torch.randn(1, 50, 16, dtype=torch.float64), torch.randn(1, 8, 16, dtype=torch.float64)
    want = scan_and_grads(fm_scan_naive, inputs, grad_y, grad_h)
    got = scan_and_grads(fm_scan_torch, inputs, grad_y, grad_h, chunk_size=16)
    if rate == 1.0:  # every row is written at some token, which erases h0: dh0 is 0 (e^-80 leaks about 1e-35)
        assert want[5].abs().max() == 0 and got[5].abs().max() < 1e-30
        got, want = got[:5], want[:5]
    assert_close_all(got, want, 1e-10)


def saturated_inputs(B, T, D, M, k, tokens, h0=True):
    """scan_inputs whose router saturates at `tokens`: a top weight of 1 and a rate of 1 there, so each of those
    tokens writes one row with theta = 1 exactly (the row forgets) and the others with theta = 0 exactly."""
    x, theta, phi, h = scan_inputs(B, T, D, M, k, h0)
    written = theta[:, tokens].argmax(-1, keepdim=True)  # (B, len(tokens), 1) the row each token writes
    one_hot = torch.zeros_like(theta[:, tokens]).scatter(-1, written, 1.0)
    theta[:, tokens] = one_hot
    phi[:, tokens] = one_hot * torch.rand(B, len(tokens), 1, dtype=phi.dtype)
    return [x, theta, phi, h]


SATURATED_TOKENS = [0, 5, 15, 16, 31, 49]  # with chunks of 16 in 50 tokens: the first, inside a chunk, a chunk's
# last and first tokens, the last token of a full chunk and the last token (inside a padded chunk)


@core
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
@pytest.mark.parametrize("k", [1, 8])  # 8 = M: dense
def test_chunked_torch_saturated_rates(dtype, tol, k):
    """dtheta at theta = 1, where the log-decay is floored: d loss / d theta_t = G_t . (x_t - h_{t-1}) all the same."""
    torch.manual_seed(k)
    inputs = saturated_inputs(2, 50, 16, 8, k, SATURATED_TOKENS)
    grad_y, grad_h = torch.randn(2, 50, 16, dtype=torch.float64), torch.randn(2, 8, 16, dtype=torch.float64)
    want = scan_and_grads(fm_scan_naive, inputs, grad_y, grad_h)
    low = [t.to(dtype) for t in inputs]
    got = scan_and_grads(fm_scan_torch, low, grad_y.to(dtype), grad_h.to(dtype), chunk_size=16)
    assert_close_all(got, want, tol)
    assert rel_err(got[3][:, SATURATED_TOKENS], want[3][:, SATURATED_TOKENS]) < tol


@core
def test_step_naive_matches_scan_and_leaves_other_rows_alone():
    torch.manual_seed(2)
    B, T, D, M, K = 2, 12, 20, 10, 3
    x, theta, phi, h0 = scan_inputs(B, T, D, M, K)
    y_scan, h_scan = fm_scan_naive(x, theta, phi, h0)
    h = h0.clone()
    for t in range(T):
        idx = theta[:, t].topk(K, -1).indices  # the rows the router selected
        before = h.clone()
        y = fm_step_naive(h, x[:, t], idx, theta[:, t].gather(1, idx), phi[:, t].gather(1, idx))
        assert rel_err(y, y_scan[:, t]) < 1e-12
        untouched = torch.ones(B, M, dtype=torch.bool).scatter(1, idx, False)
        assert torch.equal(h[untouched], before[untouched])
    assert rel_err(h, h_scan) < 1e-12


# ----------------------------------------------------------------------------- Triton kernels


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Buffers the kernels allocate start as NaN, so an element a kernel forgets to write fails."""
    def poison(out):
        return out.fill_(float("nan")) if out.is_floating_point() else out

    empty_like, new_empty = torch.empty_like, torch.Tensor.new_empty
    monkeypatch.setattr(torch, "empty_like", lambda t, **kw: poison(empty_like(t, **kw)))
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda t, *a, **kw: poison(new_empty(t, *a, **kw)))


KERNEL_CASES = [  # B, T, D, M, k, h0
    (2, 1, 24, 16, 16, True),
    (1, 70, 40, 20, 5, True),  # T not a multiple of the chunk, M and D not powers of two
    (2, 130, 64, 16, 1, False),
    (1, 64, 96, 40, 8, True),  # 40 rows padded to 64 (_block_m)
]


def triton_and_loop(inputs):
    """fm_scan on float32 copies of float64 inputs and the float64 loop, with the same random upstream gradients
    of y and hT: (got, on the CPU; want)."""
    (B, T, D), M = inputs[0].shape, inputs[1].shape[-1]
    grad_y, grad_h = torch.randn(B, T, D, dtype=torch.float64), torch.randn(B, M, D, dtype=torch.float64)
    want = scan_and_grads(fm_scan_naive, inputs, grad_y, grad_h)
    f32 = [t.float().to(DEVICE) if t is not None else None for t in inputs]
    return [g.cpu() for g in scan_and_grads(fm_scan, f32, grad_y.to(DEVICE), grad_h.to(DEVICE))], want


@core
@needs_triton
@pytest.mark.parametrize("case", KERNEL_CASES)
def test_triton_scan_matches_loop(case, poisoned_outputs):
    B, T, D, M, k, with_h0 = case
    torch.manual_seed(T + M)
    assert_close_all(*triton_and_loop(scan_inputs(B, T, D, M, k, h0=with_h0)), 2e-5)


@needs_triton
@pytest.mark.parametrize("groups, h0", [(2, True), (5, False)])  # 5 chunks: groups of 3 and 2, and of 1
def test_triton_scan_walks_groups_of_chunks_in_parallel(groups, h0, monkeypatch, poisoned_outputs):
    """With few sequences the state kernel splits the chunks into groups and joins them by a scan over groups."""
    monkeypatch.setattr(fm_kernel, "_state_groups", lambda x, NC, columns: groups)
    monkeypatch.setattr(fm_kernel, "_state_columns", lambda M: 64)  # D = 80: two column blocks, the second masked
    torch.manual_seed(8)
    assert_close_all(*triton_and_loop(scan_inputs(2, 300, 80, 12, 3, h0=h0)), 2e-5)


@needs_triton
@pytest.mark.parametrize("split, D", [(64, 96), (96, 200)])  # 96 rounds up to 128 columns: no overlap
def test_triton_scan_splits_columns_among_programs(split, D, monkeypatch, poisoned_outputs):
    """The streaming kernels share D out among programs when the chunks are few; the last split is partly
    masked."""
    monkeypatch.setattr(fm_kernel, "_columns_per_program", lambda x: split)
    torch.manual_seed(6)
    assert_close_all(*triton_and_loop(scan_inputs(1, 70, D, 12, 3)), 2e-5)


@needs_triton
def test_triton_log_decays_match_log1p(poisoned_outputs):
    """The kernel's decays 1 - theta, the within-chunk cumulative sum of log(1 - theta) (log1p through Goldberg's
    correction) and the chunks' keys, against float64 torch.log1p, for rates from 1e-9 to 1 (1 itself forgets:
    decay 0, log-decay at the floor)."""
    torch.manual_seed(0)
    theta = 10 ** (-9 * torch.rand(2, 128, 20))  # (B, Tp, M)
    theta[0, 5, :3] = torch.tensor([0.0, 1.0, 0.5])
    decay, b, keys = fm_kernel._decays(theta.to(DEVICE))
    b_chunks = b.cpu().double().view(2, 2, 64, 20)
    want_keys = (theta.double().view(2, 2, 64, 20) * (b_chunks[:, :, -1:] - b_chunks).exp()).transpose(-1, -2)
    torch.testing.assert_close(keys.cpu().double()[:, :, :20], want_keys, rtol=1e-5, atol=1e-30)  # float32 range
    assert (keys[:, :, 20:] == 0).all()  # padded rows
    want = torch.log1p(-theta.double()).clamp(min=fm_kernel.LOG_DECAY_FLOOR)
    assert decay[0, 5, 1] == 0
    torch.testing.assert_close(decay.cpu().double(), (1 - theta.double()).where(theta < 1, 0), rtol=1e-6, atol=0)
    want_b = want.view(2, 2, 64, 20).cumsum(2).view_as(want)
    assert ((b.cpu().double() - want_b).abs() / want_b.abs().clamp(min=1e-30)).max() < 1e-5
    own = slice(None, None, 64)  # at a chunk's first token b is that token's own log-decay
    assert ((b[:, own].cpu().double() - want[:, own]).abs() / want[:, own].abs().clamp(min=1e-30)).max() < 1e-6


@needs_triton
@pytest.mark.parametrize("rate", [1e-4, 1 - 1e-4, 1.0])  # 1: each write replaces its row (log-decay -80)
def test_triton_scan_extreme_rates(rate, poisoned_outputs):
    torch.manual_seed(3)
    got, want = triton_and_loop(scan_inputs(1, 40, 32, 8, 2, rate=rate))
    if rate == 1:  # every row is written at some token, which erases h0: dh0 is 0 (e^-80 leaks about 1e-34)
        assert want[5].abs().max() == 0 and got[5].abs().max() < 1e-30
        got, want = got[:5], want[:5]
    # Just below 1, dtheta = dk - (d loss / d log(1 - theta)) / (1 - theta) loses float32 precision like
    # 1 / (1 - theta) (measured 1.3e-3 at 1 - 1e-4), and the dh0 of nearly erased rows is tiny (1.7e-4); at 1 the
    # decay term comes from _forget_grads_kernel, as accurate as elsewhere
    near_one = {"dtheta": 1e-2, "dh0": 1e-3} if rate == 1 - 1e-4 else {}
    for name, a, b in zip(["y", "hT", "dxbar", "dtheta", "dphi", "dh0"], got, want):
        assert rel_err(a, b) < near_one.get(name, 2e-5), f"{name}: relative error {rel_err(a, b):.2e}"


TRITON_SATURATED_TOKENS = [0, 5, 63, 64, 69]  # the first token, one inside a chunk, a chunk's last and first
# tokens, the last token (inside a padded chunk)


@needs_triton
@pytest.mark.parametrize("k", [1, 8])  # 8 = M: dense
def test_triton_scan_saturated_rates(k, poisoned_outputs):
    """dtheta at theta = 1, where the log-decay is floored and the decay term comes from _forget_grads_kernel."""
    torch.manual_seed(10 + k)
    got, want = triton_and_loop(saturated_inputs(2, 70, 24, 8, k, TRITON_SATURATED_TOKENS))
    assert_close_all(got, want, 2e-5)
    assert rel_err(got[3][:, TRITON_SATURATED_TOKENS], want[3][:, TRITON_SATURATED_TOKENS]) < 2e-5


@needs_triton
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_triton_scan_16bit_inputs(dtype, poisoned_outputs):
    torch.manual_seed(4)
    inputs = scan_inputs(1, 70, 32, 16, 4)
    grad_y, grad_h = torch.randn(1, 70, 32, dtype=torch.float64), torch.randn(1, 16, 32, dtype=torch.float64)
    want = scan_and_grads(fm_scan_naive, inputs, grad_y, grad_h)
    x, theta, phi, h0 = inputs
    half = [x.to(dtype).to(DEVICE), theta.float().to(DEVICE), phi.float().to(DEVICE), h0.float().to(DEVICE)]
    got = scan_and_grads(fm_scan, half, grad_y.to(DEVICE), grad_h.to(DEVICE))
    assert got[0].dtype == dtype and got[2].dtype == dtype
    assert_close_all([g.cpu() for g in got], want, 1e-2)


@needs_triton
def test_triton_scan_bf16_inputs_accuracy(poisoned_outputs):
    """bfloat16 inputs, against float64 on the same bfloat16 values. The chunk-start states and the state
    gradients are stored in bfloat16 (one rounding, 2^-9, of what the float32 outputs read: dtheta, dphi, dh0
    measured 1.1e-3 to 1.7e-3 on the CPU); the carries stay float32 and the products take float32 factors as hi +
    lo halves, so hT keeps float32 accuracy (hi halves alone in the writes: hT 1.6e-3; in the state gradients'
    products: dtheta 2.0e-3, dh0 2.35e-3; the bounds catch both). y and dxbar, rounded to bfloat16, take single
    bfloat16 operands: within twice the error of their own rounding. Every product meets bfloat16 operands (or
    hi + lo pairs), so no tf32 enters."""
    torch.manual_seed(14)
    B, T, D, M, k = 2, 150, 72, 16, 4
    x, theta, phi, h0 = scan_inputs(B, T, D, M, k)
    x = x.bfloat16().double()
    grad_y, grad_h = torch.randn(B, T, D, dtype=torch.float64).bfloat16().double(), torch.randn(B, M, D).double()
    want = scan_and_grads(fm_scan_naive, [x, theta, phi, h0], grad_y, grad_h)
    inputs = [x.bfloat16().to(DEVICE), theta.float().to(DEVICE), phi.float().to(DEVICE), h0.float().to(DEVICE)]
    got = [g.cpu() for g in scan_and_grads(fm_scan, inputs, grad_y.to(DEVICE), grad_h.to(DEVICE))]
    float32_tols = {"hT": 1e-4, "dtheta": 1.85e-3, "dphi": 2.5e-3, "dh0": 2e-3}
    for name, a, b in zip(["y", "hT", "dxbar", "dtheta", "dphi", "dh0"], got, want):
        tol = 2 * rel_err(b.bfloat16(), b) if a.dtype == torch.bfloat16 else float32_tols[name]  # y, dxbar: 1.5x
        assert rel_err(a, b) < tol, f"{name}: relative error {rel_err(a, b):.2e} > {tol:.1e}"


def step_inputs(B, K, M, D):
    """A decode step's h (B, M, D), xbar (B, D), idx (B, K) distinct rows, theta, phi (B, K), float32."""
    h = torch.randn(B, M, D, device=DEVICE)
    x = torch.randn(B, D, device=DEVICE)
    idx = torch.stack([torch.randperm(M)[:K] for _ in range(B)]).to(DEVICE)
    return h, x, idx, torch.rand(B, K, device=DEVICE), torch.rand(B, K, device=DEVICE)


@core
@needs_triton
@pytest.mark.parametrize("K, M, D, one_pass", [(1, 4, 16, True), (3, 10, 40, True), (8, 8, 100, True),
                                               (5, 12, 3000, False), (11, 16, 1100, False)])  # looped: 2 passes
def test_triton_step_matches_naive(K, M, D, one_pass, poisoned_outputs):
    """The decode step in one pass (the rows fit in one tile) and in two passes over D (the last columns masked)."""
    assert fm_kernel._step_meta(K, D)["ONE_PASS"] == one_pass
    torch.manual_seed(K + M)
    B = 3
    h, x, idx, theta, phi = step_inputs(B, K, M, D)
    h_naive = h.clone()
    y_naive = fm_step_naive(h_naive, x, idx, theta, phi)
    y = fm_step(h, x, idx, theta, phi)
    assert rel_err(y, y_naive) < 1e-6
    assert torch.allclose(h, h_naive, rtol=1e-6, atol=1e-6)
    untouched = torch.ones(B, M, dtype=torch.bool, device=DEVICE).scatter(1, idx, False)
    assert torch.equal(h[untouched], h_naive[untouched])


def block_step_inputs(B, D, taps, dtype=torch.float32):
    """FM's block in a decoding step: xbar and z (B, D) as the halves of one product's rows (strided), the
    convolution's (window (B, D, taps - 1), weight (D, taps), bias (D,))."""
    xbar, z = torch.randn(B, 2 * D, device=DEVICE, dtype=dtype).chunk(2, dim=-1)
    conv = (torch.randn(B, D, taps - 1, device=DEVICE, dtype=dtype), torch.randn(D, taps, device=DEVICE, dtype=dtype),
            torch.randn(D, device=DEVICE, dtype=dtype))
    return xbar, z, conv


@core
@needs_triton
@pytest.mark.parametrize("K, M, D, one_pass, taps, gate", [
    (1, 4, 16, True, 0, False), (3, 10, 40, True, 0, False), (8, 64, 100, True, 0, False),
    (10, 10, 40, True, 0, False), (5, 12, 3000, False, 0, False), (16, 16, 1100, False, 0, False),
    (3, 10, 40, True, 4, True), (16, 16, 1100, False, 4, True), (3, 10, 40, True, 2, True), (3, 10, 40, True, 1, True),
    (3, 10, 40, True, 0, True), (16, 16, 1100, False, 4, False), (16, 16, 1100, False, 3, True)])
def test_triton_route_step_matches_naive(K, M, D, one_pass, taps, gate, poisoned_outputs):
    """The router in the step's kernel: the same rows (sparse and dense, K = M), weights and update as route_naive
    followed by fm_step_naive; every other row untouched. With FM's block, the convolution of xbar before (its window
    moved on alike; two taps: a window of one; one tap: none) and the gate after, each alone and both, in one pass and
    in two; xbar and z strided as the halves of one product."""
    assert fm_kernel._step_meta(K, D)["ONE_PASS"] == one_pass
    torch.manual_seed(K + M + D)
    B = 3
    h, x, *_ = step_inputs(B, K, M, D)
    z, conv = None, None
    if taps or gate:
        x, z, conv = block_step_inputs(B, D, max(taps, 1))
        z, conv = (z if gate else None), (conv if taps else None)
    scores = (3 * torch.randn(B, M + 5, device=DEVICE))[:, :M + 2]  # rows strided, as a padded product returns them
    h_naive, conv_naive = h.clone(), conv and (conv[0].clone(), *conv[1:])
    y_naive = fm_kernel.fm_route_step_naive(h_naive, x, scores, K, 0.7, z=z, conv=conv_naive)
    y = fm_kernel.fm_route_step(h, x, scores, K, 0.7, z=z, conv=conv)
    assert rel_err(y, y_naive) < 1e-6
    assert torch.allclose(h, h_naive, rtol=1e-6, atol=1e-6)
    if taps:
        assert torch.equal(conv[0], conv_naive[0])
    idx, *_ = fm_kernel.route_naive(scores, K, 0.7)
    if idx is not None:
        untouched = torch.ones(B, M, dtype=torch.bool, device=DEVICE).scatter(1, idx, False)
        assert torch.equal(h[untouched], h_naive[untouched])


@needs_triton
def test_triton_route_step_with_the_block_in_bfloat16(poisoned_outputs):
    """The model's decoding dtype: xbar, z and the window bfloat16 (h float32); the kernel rounds the convolution's
    output and the gated y where the reference does, so at most one element of y differs (by float32's summation
    order before a rounding), and the windows are equal."""
    torch.manual_seed(5)
    B, K, M, D = 3, 3, 10, 40
    h, *_ = step_inputs(B, K, M, D)
    x, z, conv = block_step_inputs(B, D, taps=4, dtype=torch.bfloat16)
    scores = 3 * torch.randn(B, M + 2, device=DEVICE)
    h_naive, conv_naive = h.clone(), (conv[0].clone(), *conv[1:])
    y_naive = fm_kernel.fm_route_step_naive(h_naive, x, scores, K, 1.0, z=z, conv=conv_naive)
    y = fm_kernel.fm_route_step(h, x, scores, K, 1.0, z=z, conv=conv)
    assert y.dtype == torch.bfloat16 and (y != y_naive).sum() <= 1 and rel_err(y, y_naive) < 2e-3
    assert torch.allclose(h, h_naive, rtol=1e-5, atol=1e-5) and torch.equal(conv[0], conv_naive[0])


@needs_triton
def test_route_step_breaks_ties_by_row_and_keeps_nan_in_its_sequence():
    """Equal logits: the first rows, equal weights. A NaN score: that sequence's y is NaN, every other sequence's
    rows and y are as without it (ranks stay a permutation: no row index past the sequence's own)."""
    torch.manual_seed(3)
    B, K, M, D = 3, 3, 10, 40
    h, x, *_ = step_inputs(B, K, M, D)
    scores = torch.randn(B, M + 2, device=DEVICE)
    scores[0, :M] = 0.5
    h_tied = h.clone()
    fm_kernel.fm_route_step(h_tied, x, scores, K)
    theta = torch.sigmoid(scores[0, M]) / K
    want = (1 - theta) * h[0, :K] + theta * x[0]
    assert torch.allclose(h_tied[0, :K], want, atol=1e-6) and torch.equal(h_tied[0, K:], h[0, K:])
    poisoned = scores.clone()
    poisoned[1, [8, 9]] = float("nan")  # unordered NaN: rows 8, 9 and the largest rank 0, slot 0 reads row >= 17
    h_clean, h_poisoned = h.clone(), h.clone()
    y_clean = fm_kernel.fm_route_step(h_clean, x, scores, K)
    y_poisoned = fm_kernel.fm_route_step(h_poisoned, x, poisoned, K)
    assert torch.isnan(y_poisoned[1]).all()
    for b in (0, 2):
        assert torch.equal(h_poisoned[b], h_clean[b]) and torch.equal(y_poisoned[b], y_clean[b])


@needs_triton
def test_route_step_refuses_bad_scores_and_block():
    h, x, *_ = step_inputs(2, 3, 10, 40)
    with pytest.raises(ValueError, match=r"scores must be float32 \(B, M \+ 2\)"):
        fm_kernel.fm_route_step(h, x, torch.zeros(2, 10, device=DEVICE), 3)
    with pytest.raises(ValueError, match="top_k must be in"):
        fm_kernel.fm_route_step(h, x, torch.zeros(2, 12, device=DEVICE), 11)
    scores = torch.zeros(2, 12, device=DEVICE)
    xbar, z, (window, weight, bias) = block_step_inputs(2, 40, taps=4)
    with pytest.raises(ValueError, match=r"xbar and z must be \(B, D\) = \(2, 40\) of one dtype"):
        fm_kernel.fm_route_step(h, xbar, scores, 3, z=z.double())
    for bad in ((window[:, :, :2], weight, bias), (window, weight, bias[:39]), (window.bfloat16(), weight, bias),
                (window.transpose(1, 2).contiguous().transpose(1, 2), weight, bias)):
        with pytest.raises(ValueError, match="the convolution's window, weight and bias must be contiguous"):
            fm_kernel.fm_route_step(h, xbar, scores, 3, z=z, conv=bad)


@core
@needs_triton
@pytest.mark.parametrize("N, K", [(8, 16), (40, 300), (33, 2100)])
def test_triton_decode_product_matches_naive(N, K, poisoned_outputs):
    """gemv.linear against F.linear in float64 (outputs and inner width not multiples of the tiles, K over several
    tiles), and in bfloat16 against the float64 product of the same numbers; opcheck on the custom op."""
    torch.manual_seed(N + K)
    x, weight = (torch.randn(*shape, device=DEVICE, dtype=torch.float64) for shape in ((1, K), (N, K)))
    assert rel_err(gemv.linear(x, weight), gemv.linear_naive(x, weight)) < 1e-12
    x16, weight16 = x.bfloat16(), weight.bfloat16()
    y16 = gemv.linear(x16, weight16)
    assert y16.dtype == torch.bfloat16 and rel_err(y16, gemv.linear_naive(x16.double(), weight16.double())) < 1e-2
    torch.library.opcheck(gemv._linear, (x16, weight16))


@needs_triton
def test_decode_product_refuses_what_it_cannot_do():
    for x, weight in ((torch.zeros(1, 8), torch.zeros(4, 9)), (torch.zeros(2, 8), torch.zeros(4, 8))):
        with pytest.raises(ValueError, match="one row"):
            gemv.linear(x.to(DEVICE), weight.to(DEVICE))
    with pytest.raises(ValueError, match="one dtype"):
        gemv.linear(torch.zeros(1, 8, device=DEVICE), torch.zeros(4, 8, device=DEVICE, dtype=torch.float64))


@needs_triton
def test_fm_step_compiles_without_graph_break():
    """fm_step and fm_route_step are registered custom ops (fm::step, fm::route_step, mutating h and the
    convolution's window; schema and fake tensors checked by opcheck), so torch.compile(fullgraph=True) traces a
    decode step through them, with the eager step's output and state."""
    torch.manual_seed(1)
    h, x, idx, theta, phi = step_inputs(2, 3, 10, 40)
    torch.library.opcheck(fm_kernel._step, (h.clone(), x, idx, theta, phi, 1e-6))
    scores = torch.randn(2, 12, device=DEVICE)
    torch.library.opcheck(fm_kernel._route_step, (h.clone(), x, scores, 3, 1.0, 1e-6, None, None, None, None))
    xbar, z, (window, weight, bias) = block_step_inputs(2, 40, taps=4)
    torch.library.opcheck(fm_kernel._route_step, (h.clone(), xbar, scores, 3, 1.0, 1e-6, z, window, weight, bias))

    def decode(h, x, idx, theta, phi):
        return fm_step(h, 2 * x, idx, theta.softmax(-1), phi).sum(-1)

    def decode_routed(h, x, scores):
        return fm_kernel.fm_route_step(h, 2 * x, scores + 1, 3, 0.5).sum(-1)

    backend = "inductor" if CUDA else "aot_eager"  # inductor on the CPU needs a C++ compiler
    scores = torch.randn(2, 12, device=DEVICE)
    for step, args in ((decode, (x, idx, theta, phi)), (decode_routed, (x, scores))):
        h_before, h_compiled, h_eager = h.clone(), h.clone(), h.clone()
        got = torch.compile(step, backend=backend, fullgraph=True)(h_compiled, *args)
        want = step(h_eager, *args)
        assert not torch.equal(h_eager, h_before)  # the step updated its state in place
        assert rel_err(got, want) < 1e-6 and rel_err(h_compiled, h_eager) < 1e-6  # fused softmax: rounding apart


@needs_triton
def test_scan_rejects_bad_shapes():
    x = torch.randn(1, 4, 8)
    with pytest.raises(ValueError, match="theta"):
        fm_scan(x, torch.rand(1, 5, 4), torch.rand(1, 5, 4))
    with pytest.raises(ValueError, match="h0"):
        fm_scan(x, torch.rand(1, 4, 4), torch.rand(1, 4, 4), h0=torch.randn(1, 3, 8))
    with pytest.raises(ValueError, match="eps"):
        fm_scan(x, torch.rand(1, 4, 4), torch.rand(1, 4, 4), eps=0.0)
    with pytest.raises(ValueError, match="fm_scan_torch"):
        fm_scan(x, torch.rand(1, 4, 129), torch.rand(1, 4, 129))
    huge = torch.empty(1, 2**21, 1024, device="meta")  # 2^31 elements: past 32-bit offsets
    with pytest.raises(ValueError, match="split the batch"):
        fm_scan(huge, torch.empty(1, 2**21, 4, device="meta"), torch.empty(1, 2**21, 4, device="meta"))


@pytest.mark.skipif(not CUDA, reason="real sizes need a GPU")
@pytest.mark.parametrize("dtype,M,tol", [(torch.float32, 64, 1e-5), (torch.bfloat16, 64, 1e-2),
                                         (torch.float32, 128, 1e-5), (torch.bfloat16, 128, 1e-2)])
def test_triton_scan_real_size_gpu(dtype, M, tol):
    """Real sizes, where the GPU's shared memory bounds the kernels' tiles (128 rows: the largest)."""
    torch.manual_seed(6)
    B, T, D, k = 2, 2048 + 37, 2048, 8
    inputs = scan_inputs(B, T, D, M, k, device="cuda")
    grad_y, grad_h = torch.randn_like(inputs[0]), torch.randn_like(inputs[3])
    want = scan_and_grads(fm_scan_torch, inputs, grad_y, grad_h)
    x, theta, phi, h0 = inputs
    got = scan_and_grads(fm_scan, [x.to(dtype), theta.float(), phi.float(), h0.float()], grad_y, grad_h)
    assert_close_all(got, want, tol)


# ============================================================================= model.py

MIXERS = {  # name -> config overrides; the fm cases use m = 8
    'fm_dense': dict(mixer='fm'),
    'fm_sparse': dict(mixer='fm', top_k=3),
    'fm_block_dense': dict(mixer='fm', fm_conv=4, fm_gate=True),  # the layer with a convolution and an output gate
    'fm_block_sparse': dict(mixer='fm', top_k=3, fm_conv=4, fm_gate=True),
    'attn': dict(mixer='attn'),
    'mamba2': dict(mixer='mamba2'),
}


def tiny_config(**overrides):
    """2 layers, d_model 32, vocab 64, chunk 16: T = 37 spans three chunks, the last one partial."""
    config = dict(vocab_size=64, block_size=48, n_layer=2, d_model=32, n_memory=8, chunk_size=16,
                  n_head=4, n_kv_head=2, d_state=8, mamba_head_dim=16)
    config.update(overrides)
    return ModelConfig(**config)


# ----------------------------------------------------------------------------- FM routing

def fm_reference(layer, x):
    """The paper's equations written out: softmax router, top-k mask and renormalisation, naive scan."""
    alpha = torch.softmax(layer.router(x) / layer.tau, dim=-1)  # (B, T, M)
    mask = torch.zeros_like(alpha).scatter(-1, alpha.topk(layer.top_k, dim=-1).indices, 1.0)
    alpha = mask * alpha / (mask * alpha).sum(-1, keepdim=True)
    eta, mu = torch.sigmoid(layer.rates(x)).unbind(-1)  # (B, T)
    y, h = fm_kernel.fm_scan_naive(layer.in_proj(x), eta[..., None] * alpha, mu[..., None] * alpha, eps=layer.eps)
    return layer.out_proj(y), h


def block_reference(layer, x):
    """FM with its two parts beside the paper written out: values silu(causal conv of W_i x) (a loop over the taps,
    zeros before the start), the read-out gated by silu(W_z x) before W_o."""
    values, z = F.linear(x, layer.in_proj.weight).chunk(2, dim=-1)  # (B, T, D)
    taps = layer.conv.weight[:, 0]  # (D, W)
    W = taps.shape[1]
    conv = sum(F.pad(values, (0, 0, W - 1 - j, 0))[:, :x.shape[1]] * taps[:, j] for j in range(W)) + layer.conv.bias
    alpha = torch.softmax(layer.router(x) / layer.tau, dim=-1)
    mask = torch.zeros_like(alpha).scatter(-1, alpha.topk(layer.top_k, dim=-1).indices, 1.0)
    alpha = mask * alpha / (mask * alpha).sum(-1, keepdim=True)
    eta, mu = torch.sigmoid(layer.rates(x)).unbind(-1)
    y, h = fm_kernel.fm_scan_naive(F.silu(conv), eta[..., None] * alpha, mu[..., None] * alpha, eps=layer.eps)
    return layer.out_proj(y * F.silu(z)), h


@core
@pytest.mark.parametrize('top_k', [3, None])
def test_fm_block_matches_its_equations(top_k):
    """fm_conv and fm_gate as block_reference writes them, in float64; the state carries the convolution's last
    W - 1 values."""
    torch.manual_seed(0)
    layer = FactorizationMemory(tiny_config(top_k=top_k, fm_conv=4, fm_gate=True)).double()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 37, 32, dtype=torch.float64)
    y, state = layer(x)
    y_ref, h_ref = block_reference(layer, x)
    assert rel_err(y, y_ref) < 1e-10 and rel_err(state['h'], h_ref) < 1e-10
    values = F.linear(x, layer.in_proj.weight[:32])  # W_i x, the convolution's input
    assert rel_err(state['conv'], values[:, -3:].transpose(1, 2)) < 1e-15


@core
@pytest.mark.parametrize('top_k', [1, 3, 7, 8, None])
def test_fm_layer_matches_paper_equations(top_k):
    """The reference always masks to the top k and renormalises: at k = m (8, None) the dense layer equals it."""
    torch.manual_seed(0)
    layer = FactorizationMemory(tiny_config(top_k=top_k, tau=0.5)).double()
    for p in layer.parameters():  # weights large enough that routing is far from uniform
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 37, 32, dtype=torch.float64)
    y, state = layer(x)
    y_ref, h_ref = fm_reference(layer, x)
    assert rel_err(y, y_ref) < 1e-10
    assert rel_err(state['h'], h_ref) < 1e-10


@pytest.mark.parametrize('top_k', [1, 2, 5, 8])
def test_router_weights_sum_to_one_over_k_rows(top_k):
    torch.manual_seed(0)
    layer = FactorizationMemory(tiny_config(top_k=top_k))
    x = torch.randn(3, 10, 32)
    idx, alpha, eta, mu = layer.route(x)
    if idx is not None:
        alpha = torch.zeros(3, 10, 8).scatter(-1, idx, alpha)
    assert alpha.dtype == torch.float32
    assert ((alpha > 0).sum(-1) == top_k).all()
    torch.testing.assert_close(alpha.sum(-1), torch.ones(3, 10))
    kept = torch.softmax(layer.router(x), -1).topk(top_k, dim=-1).indices  # the k largest affinities
    assert (alpha.gather(-1, kept) > 0).all()
    assert ((eta > 0) & (eta < 1) & (mu > 0) & (mu < 1)).all()


def test_router_reduction_of_a_decoding_step_matches_the_product():
    """A compiled decoding step computes the router's scores as one float32 reduction, elsewhere a product: both give
    the same rows and weights (compilation stood in for by is_compiling)."""
    torch.manual_seed(0)
    layer = FactorizationMemory(tiny_config(top_k=3))
    for p in layer.parameters():  # weights large enough that routing is far from uniform
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(17, 32)
    routes, products = [], []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(F, 'linear', lambda *args: products.append(len(routes)) or torch._C._nn.linear(*args))
        for compiling in (False, True):  # the product, then the reduction
            patch.setattr(torch.compiler, 'is_compiling', lambda: compiling)
            routes.append(layer.route(x))
    assert products == [0]
    (idx, *weights), (idx_reduced, *weights_reduced) = routes
    assert torch.equal(idx, idx_reduced)
    for got, want in zip(weights, weights_reduced):
        assert got.dtype == torch.float32 and (got - want).abs().max() < 1e-6


# ----------------------------------------------------------------------------- every mixer

@core
@pytest.mark.parametrize('name', MIXERS)
def test_step_and_prefill_match_forward(name):
    torch.manual_seed(0)
    model = Model(tiny_config(init_std=0.1, **MIXERS[name])).double().eval()
    idx = torch.randint(0, 64, (2, 37))
    logits, _ = model(idx)  # (B, T, V)

    state = model.init_state(2, max_len=37)
    stepped = torch.stack([model.step(idx[:, t], state) for t in range(idx.shape[1])], 1)
    assert rel_err(stepped, logits) < 1e-12

    last_logits, state = model.prefill(idx[:, :21], max_len=40)  # a cache with room to spare
    continued = [last_logits] + [model.step(idx[:, t], state) for t in range(21, idx.shape[1])]
    assert rel_err(torch.stack(continued, 1), logits[:, 20:]) < 1e-12


@core
@pytest.mark.parametrize('name', MIXERS)
def test_ragged_prefill_gives_each_row_its_own_state(name):
    """Prompts of different lengths, right-padded in one pass: each row's logits and decoding state are what the
    row alone gives (no padding token enters a recurrent state or the KV cache that is read)."""
    torch.manual_seed(1)
    model = Model(tiny_config(init_std=0.1, **MIXERS[name])).double().eval()
    idx = torch.randint(0, 64, (3, 37))
    lengths = torch.tensor([37, 5, 20])
    logits, state = model.prefill(idx, lengths, max_len=45)
    following = torch.randint(0, 64, (3, 6))
    stepped = torch.stack([logits] + [model.step(following[:, t], state) for t in range(6)], 1)  # (3, 7, V)
    for row, n in enumerate(lengths.tolist()):
        alone, _ = model(torch.cat([idx[row:row + 1, :n], following[row:row + 1]], 1))
        assert rel_err(stepped[row], alone[0, n - 1:]) < 1e-12, (row, n)


@core
@pytest.mark.parametrize('name', ['fm_dense', 'fm_sparse', 'fm_block_dense', 'fm_block_sparse', 'mamba2'])
def test_chunked_pass_carries_the_state(name):
    """Recurrent mixers run a long text in chunks, each continuing from the last one's state: the same hidden
    states and final state as one pass (eval.py relies on this for bounded memory at any length)."""
    torch.manual_seed(2)
    model = Model(tiny_config(init_std=0.1, **MIXERS[name])).double().eval()
    idx = torch.randint(0, 64, (2, 50))
    whole, whole_state = model.hidden(idx)
    parts, state = [], None
    for start in (0, 7, 30):  # chunks of 7, 23 and 20 tokens, none a multiple of the scan's chunk of 16
        x, state = model.hidden(idx[:, start:start + {0: 7, 7: 23, 30: 20}[start]], state)
        parts.append(x)
    assert rel_err(torch.cat(parts, 1), whole) < 1e-12
    for got, want in zip(state, whole_state):
        assert all(rel_err(got[k], want[k]) < 1e-12 for k in want)


def test_attention_refuses_a_parallel_pass_from_a_state():
    model = Model(tiny_config(mixer='attn'))
    _, state = model.hidden(torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match='one token at a time'):
        model.hidden(torch.zeros(1, 4, dtype=torch.long), state)


def test_static_kv_cache_ignores_capacity_and_stale_entries():
    """The static cache attends only over its filled part: the same logits for any capacity, and with garbage
    written beyond each row's position."""
    torch.manual_seed(3)
    model = Model(tiny_config(mixer='attn', init_std=0.1)).double().eval()
    idx = torch.randint(0, 64, (2, 30))
    runs = []
    for max_len, garbage in ((30, False), (64, True)):
        logits, state = model.prefill(idx[:, :10], max_len=max_len)
        if garbage:
            for layer in state:
                layer['k'][:, :, 10:], layer['v'][:, :, 10:] = 1e3, -1e3
        runs.append(torch.stack([logits] + [model.step(idx[:, t], state) for t in range(10, 30)], 1))
    assert rel_err(runs[1], runs[0]) < 1e-14
    assert rel_err(runs[0], model(idx)[0][:, 9:]) < 1e-12


@core
@pytest.mark.parametrize('name', MIXERS)
def test_greedy_generation_is_argmax_of_the_forward(name):
    """Batched prompts of different lengths, greedy: each row's tokens are the argmax of the full forward pass
    over its own prompt and tokens so far, token by token; also when the prefill runs a row at a time and a
    recurrent model takes its prompt in pieces of 5 tokens."""
    torch.manual_seed(4)
    model = Model(tiny_config(init_std=0.3, **MIXERS[name])).double().eval()
    prompts = [torch.randint(0, 64, (n,)).tolist() for n in (9, 2, 17)]
    generated = Generator(model, Sampling(temperature=0)).generate(prompts, max_new_tokens=8)
    assert Generator(model, Sampling(temperature=0), prefill_tokens=5).generate(prompts, 8) == generated
    for prompt, new in zip(prompts, generated):
        assert len(new) == 8
        tokens = list(prompt)
        for _ in range(8):
            tokens.append(model(torch.tensor([tokens]))[0][0, -1].argmax().item())
        assert new == tokens[len(prompt):]


def test_generation_stops_each_row_at_end_of_text():
    torch.manual_seed(5)
    model = Model(tiny_config(mixer='fm', init_std=0.3)).eval()
    prompts = [[1, 2, 3], [4, 5]]
    free = Generator(model, Sampling(temperature=0)).generate(prompts, max_new_tokens=6)
    eot = free[1][2]  # row 1 emits this at its third token: row 1 stops there
    stopped = Generator(model, Sampling(temperature=0), eot=eot).generate(prompts, max_new_tokens=6)
    assert stopped[1] == free[1][:free[1].index(eot)]
    assert stopped[0] == (free[0][:free[0].index(eot)] if eot in free[0] else free[0])
    streamed = []
    Generator(model, Sampling(temperature=0)).generate(prompts, 6, on_tokens=streamed.append)
    assert [list(row) for row in zip(*streamed)] == free


def test_seeded_sampling_is_reproducible():
    model = Model(tiny_config(mixer='fm', init_std=0.3)).eval()
    generator = Generator(model, Sampling(temperature=1.0, top_k=20, top_p=0.9))
    runs = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        runs.append(generator.generate([[1, 2, 3]] * 4, max_new_tokens=20))
    assert runs[0] == runs[1] and runs[0] != runs[2]
    assert len({tuple(row) for row in runs[0]}) > 1  # rows draw independently


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.05, 0.3, 0.15], [0.25, 0.25, 0.25, 0.25]])
    kept = generate.nucleus(probs.log(), 0.8).isfinite()
    assert kept.tolist() == [[True, False, True, False], [True, True, True, True]]  # 0.5 + 0.3 reaches 0.8
    kept = generate.nucleus(probs.log(), 0.81).isfinite()
    assert kept[0].tolist() == [True, False, True, True]
    assert generate.nucleus(probs.log(), 1e-6).isfinite().sum(-1).tolist() == [1, 1]
    torch.manual_seed(0)
    draws = torch.stack([sample_next(probs.log(), Sampling(top_p=0.8)) for _ in range(2000)])
    counts = torch.bincount(draws[:, 0], minlength=4).double() / 2000  # renormalised 0.5 : 0.3
    assert counts[1] == counts[3] == 0 and abs(counts[0] - 0.625) < 0.04


def test_sampling_follows_the_probabilities():
    torch.manual_seed(0)
    probs = torch.tensor([[0.6, 0.3, 0.1, 0.0]])
    draws = torch.cat([sample_next(probs.log(), Sampling()) for _ in range(4000)])
    freq = torch.bincount(draws, minlength=4).double() / 4000
    assert (freq - probs[0].double()).abs().max() < 0.03 and freq[3] == 0
    assert sample_next(probs.log(), Sampling(top_k=1, temperature=2.0)).item() == 0
    assert sample_next(probs.log(), Sampling(temperature=0)).item() == 0
    assert sample_next(torch.tensor([[0.0, 5.0, 1.0]]), Sampling(n_tokens=1)).item() == 0  # ids >= n_tokens never


@pytest.mark.parametrize('field, value', [('temperature', -1.0), ('top_k', 0), ('top_p', 0.0), ('top_p', 1.5)])
def test_bad_sampling_settings_raise_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        Sampling(**{field: value}).validate()


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize('name', MIXERS)
def test_cuda_graph_decoding_equals_eager_gpu(name):
    torch.manual_seed(6)
    model = Model(tiny_config(init_std=0.3, **MIXERS[name])).cuda().eval()
    prompts = [torch.randint(0, 64, (n,)).tolist() for n in (9, 2, 17)]
    for compile in (None, 'default'):
        runs = [Generator(model, Sampling(temperature=0), cuda_graph=graph, compile=compile).generate(prompts, 12)
                for graph in (False, True)]
        assert runs[0] == runs[1], compile


@pytest.mark.skipif(not CUDA, reason="inductor writes one-row products as reductions on a GPU only")
def test_compiled_step_at_batch_1_has_no_library_product_gpu():
    """STEP_COMPILE_OPTIONS reach inductor: at batch 1 every product of the compiled step (blocks, router, head) is
    a generated reduction, no cuBLAS call; at batch 4 the blocks' products stay cuBLAS's."""
    from torch._inductor.utils import run_and_get_code
    torch.manual_seed(6)
    model = Model(tiny_config(init_std=0.3, mixer='fm', top_k=3)).cuda().eval()
    for batch, library_calls in ((1, False), (4, True)):
        torch._dynamo.reset()  # a fresh compile, static in the batch size
        generator = Generator(model, Sampling(temperature=0), cuda_graph=False, compile='default')
        generator.start([[1, 2, 3]] * batch, 4)
        _, code = run_and_get_code(generator.compiled_step)
        assert ('extern_kernels.mm' in '\n'.join(code)) == library_calls, batch


@pytest.mark.skipif(not CUDA, reason="the batch-1 Triton product runs on CUDA in half precision")
def test_bf16_step_at_batch_1_takes_the_triton_product_gpu():
    """A bfloat16 model's decoding step at batch 1 sends each MLP's down product to gemv.linear, with the logits of
    the same steps through F.linear (rounding apart)."""
    torch.manual_seed(8)
    model = Model(tiny_config(init_std=0.3, mixer='fm', top_k=3)).cuda().to(torch.bfloat16).eval()
    idx = torch.randint(0, 64, (1, 9), device='cuda')
    runs, calls = [], []
    for dispatch in (gemv.decode_linear, F.linear):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(gemv, 'decode_linear', dispatch)
            patch.setattr(gemv, 'linear', lambda x, w, linear=gemv.linear: calls.append(1) or linear(x, w))
            state = model.init_state(1, 9)
            runs.append(torch.stack([model.step(idx[:, t], state) for t in range(9)], 1))
    assert len(calls) == 9 * model.config.n_layer
    assert rel_err(runs[0], runs[1]) < 2e-2


@pytest.mark.skipif(not CUDA, reason="mamba-ssm's kernels need a GPU")
def test_mamba_ssm_fused_step_equals_the_models_own_gpu():
    import bench
    if bench.import_mamba() is None:
        pytest.skip('mamba-ssm is not installed')
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update
    torch.manual_seed(7)
    model = Model(tiny_config(mixer='mamba2', init_std=0.3)).cuda().eval()
    idx = torch.randint(0, 64, (3, 20), device='cuda')
    runs = []
    for fused in (None, selective_state_update):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(model_module, 'selective_state_update', fused)
            _, state = model.prefill(idx[:, :12], max_len=20)
            logits = torch.stack([model.step(idx[:, t], state) for t in range(12, 20)], 1)
            runs.append((logits, torch.cat([layer['ssm'].flatten() for layer in state])))
    assert rel_err(runs[1][0], runs[0][0]) < 1e-5 and rel_err(runs[1][1], runs[0][1]) < 1e-5


class ContrarianFM(FactorizationMemory):
    """A forker's router: the rows the standard router likes least (the softmax of -W_alpha x), through route alone."""

    def route(self, x):
        with torch.autocast(x.device.type, enabled=False):
            scores = self.router_scores(x)
            return fm_kernel.route_naive(torch.cat([-scores[..., :-2], scores[..., -2:]], -1), self.top_k, self.tau)


def fm_model(router='standard', **overrides):
    """A tiny FM model whose layers are FactorizationMemory ('standard') or ContrarianFM ('override')."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(model_module.MIXER_CLASSES, 'fm', ContrarianFM if router == 'override' else FactorizationMemory)
        return Model(tiny_config(mixer='fm', **overrides))


@core
@pytest.mark.parametrize('top_k', [3, None])
def test_a_router_override_reaches_decoding(top_k):
    """A layer whose route is overridden decodes through it (the plain step, not the fused kernel of the standard
    router): forward = prefill + steps in float64, and its logits are not the standard router's."""
    torch.manual_seed(0)
    model = fm_model('override', top_k=top_k, init_std=0.3).double().eval()
    standard = fm_model(top_k=top_k).double().eval()
    standard.load_state_dict(model.state_dict())
    idx = torch.randint(0, 64, (2, 20))
    logits, _ = model(idx)
    assert rel_err(standard(idx)[0], logits) > 1e-2
    last, state = model.prefill(idx[:, :9], max_len=20)
    stepped = [last] + [model.step(idx[:, t], state) for t in range(9, 20)]
    assert rel_err(torch.stack(stepped, 1), logits[:, 8:]) < 1e-12


@needs_triton
@pytest.mark.parametrize('top_k, tau, router, block', [
    (3, 1.0, 'standard', False), (None, 1.0, 'standard', False), (3, 0.5, 'standard', False),
    (3, 1.0, 'override', False), (None, 0.5, 'override', False), (3, 1.0, 'standard', True)])
def test_step_matches_forward_through_the_triton_kernels(top_k, tau, router, block):
    """The dispatch the model takes on CUDA (fm_scan; fm_route_step, or fm_step for an overridden router;
    gemv.linear), here under the interpreter, in float32; with tau, which reaches the step's kernel apart from the
    forward's router."""
    torch.manual_seed(0)
    model = fm_model(router, top_k=top_k, init_std=0.1, tau=tau, fm_conv=4 * block, fm_gate=block).to(DEVICE).eval()
    idx = torch.randint(0, 64, (2, 37), device=DEVICE)
    steps = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(model_module, 'memory_scan', lambda x, theta, phi, h0, eps, _: fm_scan(x, theta, phi, h0, eps))
        patch.setattr(model_module, 'triton_step', lambda h: True)
        for name in ('fm_step', 'fm_route_step'):
            step = getattr(fm_kernel, name)
            patch.setattr(fm_kernel, name, lambda *args, step=step, **kw: steps.append(step) or step(*args, **kw))
        patch.setattr(gemv, 'decode_linear', lambda x, weight: torch.cat([gemv.linear(row[None], weight) for row in x]))
        logits, _ = model(idx)
        state = model.init_state(2, 37, DEVICE)
        stepped = [model.step(idx[:, t], state) for t in range(idx.shape[1])]
    assert rel_err(torch.stack(stepped, 1), logits) < 1e-5
    fused = router == 'standard'
    assert set(steps) == {fm_kernel.fm_route_step if fused else fm_kernel.fm_step}


@pytest.mark.parametrize('name', MIXERS)
def test_overfits_one_batch(name):
    torch.manual_seed(0)
    model = Model(tiny_config(**MIXERS[name]))
    optimizer = model.configure_optimizers(0.0, 1e-2, (0.9, 0.95), 'cpu')
    idx = torch.randint(0, 64, (4, 33))
    losses = []
    for _ in range(40):
        _, loss = model(idx[:, :-1], idx[:, 1:])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert math.isclose(losses[0], math.log(64), rel_tol=0.05)  # a fresh model predicts near uniformly
    assert losses[-1] < losses[0] / 2, losses


@contextlib.contextmanager
def using_scan(scan):
    """Context in which the model's FM layers run `scan` (a function like fm_scan)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(model_module, 'memory_scan', lambda x, theta, phi, h0, eps, chunk: scan(x, theta, phi, h0, eps))
        yield


def fm_scan_torch_fp32(xbar, theta, phi, h0=None, eps=1e-6):
    """fm_scan_torch in float32 with autocast off (under autocast its products run in bf16); y like xbar."""
    with torch.autocast(xbar.device.type, enabled=False):
        y, h = fm_scan_torch(xbar.float(), theta.float(), phi.float(), h0, eps)
    return y.to(xbar.dtype), h


def scan_gaps(model, idx, scan, reference):
    """Relative gaps between two scans at the same weights and batch, under bf16 autocast: of the loss, of the
    whole gradient (all parameters as one vector), and of each parameter's gradient {name: gap}."""
    results = []
    for fn in (scan, reference):
        model.zero_grad(set_to_none=True)
        with using_scan(fn), torch.autocast('cuda', dtype=torch.bfloat16):
            _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        results.append((loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}))
    (loss, grads), (loss_ref, grads_ref) = results
    model.zero_grad(set_to_none=True)
    flat = [torch.cat([g.flatten() for g in gradients.values()]) for gradients in (grads, grads_ref)]
    whole = rel_err(*flat)
    return abs(loss - loss_ref) / loss_ref, whole, {name: rel_err(grads[name], grads_ref[name]) for name in grads}


def train_losses(scan, steps, device, dtype, batches=None, probe=None, **overrides):
    """Losses of AdamW steps of a small FM model whose layers use scan, cycling over batches (N, B, T + 1)
    (default: 4 fixed random batches of vocab 64); probe(step, model, idx), if given, runs before each step."""
    torch.manual_seed(0)
    model = Model(tiny_config(**{'mixer': 'fm', 'top_k': 2, **overrides})).to(device)
    optimizer = model.configure_optimizers(0.0, 3e-3, (0.9, 0.95), device)
    if batches is None:
        batches = torch.randint(0, 64, (4, 4, 33), generator=torch.Generator().manual_seed(1))
    batches = batches.to(device)
    losses = []
    for step in range(steps):
        idx = batches[step % len(batches)]
        if probe is not None:
            probe(step, model, idx)
        with using_scan(scan):
            with torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32):
                _, loss = model(idx[:, :-1], idx[:, 1:])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return losses


def text_batches(n, batch_size, block_size, data_dir):
    """n batches of random windows of the default corpus (bytes), fixed by a seed."""
    tokens = load_tokens(prepare("default", "bytes", data_dir) / "train.bin").tokens
    starts = np.random.default_rng(0).integers(0, len(tokens) - block_size - 1, size=(n, batch_size))
    return torch.from_numpy(np.stack([[tokens[s:s + block_size + 1] for s in row] for row in starts]).astype(np.int64))


@needs_triton
def test_training_with_triton_scan_matches_torch_scan():
    """The model trained through fm_scan follows the fm_scan_torch loss curve (float32, CPU interpreter or GPU)."""
    triton_losses = train_losses(fm_scan, 6, DEVICE, torch.float32)
    torch_losses = train_losses(fm_scan_torch, 6, DEVICE, torch.float32)
    assert triton_losses == pytest.approx(torch_losses, rel=1e-4)


@needs_triton
def test_fm_scan_compiles_without_graph_break():
    """fm_scan is a pair of registered custom ops (schema, fake tensors and autograd checked by opcheck), so
    torch.compile(fullgraph=True) traces the whole FM model through it, with the eager model's loss and grads."""
    torch.manual_seed(0)
    x, theta, phi, h0 = (t.float().to(DEVICE).requires_grad_() for t in scan_inputs(2, 70, 24, 8, 3))
    torch.library.opcheck(fm_kernel._scan_forward, (x, theta, phi, h0, 1e-6))
    model = Model(tiny_config(mixer='fm', top_k=2)).to(DEVICE)
    idx = torch.randint(0, 64, (2, 33), device=DEVICE)
    losses, grads = [], []
    with using_scan(fm_scan):
        backend = "inductor" if CUDA else "aot_eager"  # inductor on the CPU needs a C++ compiler
        for forward in (torch.compile(model, backend=backend, fullgraph=True), model):
            model.zero_grad()
            _, loss = forward(idx[:, :-1], idx[:, 1:])
            loss.backward()
            losses.append(loss.item())
            grads.append([p.grad.clone() for p in model.parameters()])
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    assert max(rel_err(a, b) for a, b in zip(*grads)) < 1e-5


@pytest.mark.skipif(not CUDA, reason="a few hundred GPU steps")
def test_training_with_triton_scan_matches_torch_scan_gpu_bf16(tmp_path):
    """300 bf16 steps on text through fm_scan; every 50 steps, at the weights reached, the loss and the
    gradients agree with float32 fm_scan_torch on the same batch. Two free-running loss curves
    would test nothing here: this training is chaotic (3e-6 relative noise on the router's gradients alone
    moved the step-300 loss by -4% to +6% on an H200), so the scans are compared at shared weights."""
    batches = text_batches(300, 16, 256, tmp_path)
    big = dict(vocab_size=256, d_model=256, n_memory=64, top_k=8, block_size=256)
    gaps = []

    def probe(step, model, idx):
        if step % 50 == 0:
            gaps.append(scan_gaps(model, idx, fm_scan, fm_scan_torch_fp32))

    losses = train_losses(fm_scan, 301, "cuda", torch.bfloat16, batches, probe=probe, **big)
    assert sum(losses[280:300]) < 0.75 * sum(losses[:20])  # the loss falls (3.3 -> 2.2 to 2.35 on an H200)
    # Measured on an H200 over two trajectories (14 probes): loss gap <= 1.1e-4, whole gradient <= 2.4e-2, median
    # parameter <= 2.2e-2. Single parameters are not bounded after step 0: the router's and the rates' gradients
    # pass a softmax or sigmoid backward that subtracts nearly equal numbers, and their gaps ranged from 0.02 to
    # 0.59 with the weights a trajectory reached, the same for this kernel and its predecessor at equal weights.
    # At step 0 the weights are the seed's, so that bound is deterministic (measured worst 0.027).
    assert max(gaps[0][2].values()) < 0.1
    for loss_gap, whole_gap, grad_gaps in gaps:
        assert loss_gap < 5e-4
        assert whole_gap < 5e-2
        assert sorted(grad_gaps.values())[len(grad_gaps) // 2] < 5e-2, grad_gaps


@pytest.mark.parametrize('name', MIXERS)
def test_bf16_autocast_trains(name):
    torch.manual_seed(0)
    model = Model(tiny_config(**MIXERS[name]))
    idx = torch.randint(0, 64, (2, 20))
    targets = idx.roll(-1, 1)
    targets[:, -1] = -1  # ignored
    with torch.autocast('cpu', dtype=torch.bfloat16):
        logits, loss = model(idx, targets)
    loss.backward()
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32
    bad = [n for n, p in model.named_parameters() if p.grad is None or not (p.grad.isfinite().all() and p.grad.any())]
    assert not bad, bad  # every parameter gets a finite, nonzero gradient
    expected = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets[:, :-1].flatten())
    torch.testing.assert_close(loss, expected)


# ----------------------------------------------------------------------------- eval.py

import importlib.util

import eval as evaluation
from research import analysis


def save_model_checkpoint(model, out_dir, tokenizer='bytes', **fields):
    """A checkpoint of model as train.py writes one (without optimizer and random states) -> out_dir."""
    from dataclasses import asdict
    os.makedirs(out_dir, exist_ok=True)
    ckpt = {key: None for key in checkpoint.CKPT_KEYS}
    ckpt.update(model=model.state_dict(), model_config=asdict(model.config), train_config={'max_iters': 0},
                iter_num=0, best_val_loss=1.0, data_state={'tokens_seen': 0}, tokenizer=tokenizer)
    ckpt.update(fields)
    checkpoint.save_checkpoint(ckpt, os.path.join(out_dir, 'ckpt.pt'))
    return str(out_dir)


def increment_model(block_size=16):
    """A hand-set byte model that predicts byte b + 1 after byte b (probability 1 - 4e-5): its blocks add nothing,
    the embedding is one-hot and the head a shifted identity."""
    model = Model(ModelConfig(vocab_size=256, block_size=block_size, n_layer=1, d_model=256, n_memory=4,
                              tie_embeddings=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(('out_proj.weight', 'down_proj.weight')):
                p.zero_()
        model.embed.weight.copy_(torch.eye(256))
        model.lm_head.weight.copy_(torch.eye(256).roll(1, 0))  # logit b + 1 reads input b
    return model.eval()


def test_position_buckets_and_loss_so_far():
    """Two documents of 5 and 2 positions: buckets [1, 2), [2, 4), [4, 8) and loss so far at 1, 2, 4, by hand."""
    buckets, so_far = evaluation.position_stats([np.array([1., 2., 3., 4., 5.]), np.array([10., 20.])])
    assert [(b['start'], b['end'], b['positions'], b['documents']) for b in buckets] == [
        (1, 2, 2, 2), (2, 4, 3, 2), (4, 8, 2, 1)]
    assert [b['loss'] for b in buckets] == pytest.approx([(1 + 10) / 2, (2 + 3 + 20) / 3, (4 + 5) / 2])
    assert [(s['t'], s['documents']) for s in so_far] == [(1, 2), (2, 2), (4, 1)]
    assert [s['loss'] for s in so_far] == pytest.approx([(1 + 10) / 2, (1 + 2 + 10 + 20) / 4, (1 + 2 + 3 + 4) / 4])


@pytest.mark.parametrize('name', ['fm_dense', 'fm_sparse', 'mamba2'])
def test_loss_by_position_chunked_equals_one_pass(name):
    """eval.py's document_losses in chunks of 7 (each from the last one's state) gives the losses of one pass,
    which are the model's forward cross-entropy."""
    torch.manual_seed(6)
    model = Model(tiny_config(init_std=0.1, **MIXERS[name])).double().eval()
    tokens = torch.randint(0, 64, (60,))
    chunked = evaluation.document_losses(model, tokens.numpy(), chunk_len=7)
    whole = evaluation.document_losses(model, tokens.numpy(), chunk_len=1000)
    with torch.no_grad():
        forward = F.cross_entropy(model(tokens[None, :-1])[0][0], tokens[1:], reduction='none').numpy()
    assert chunked.shape == (59,) and chunked.dtype == np.float64
    np.testing.assert_allclose(chunked, whole, rtol=1e-12)
    np.testing.assert_allclose(whole, forward, rtol=1e-12)


def test_loss_by_position_end_to_end(tmp_path):
    """Text files, an FM and an attention checkpoint: tables, .csv, .json; attention stops at --max_len."""
    torch.manual_seed(7)
    texts = tmp_path / 'texts'
    texts.mkdir()
    for i, n in enumerate((90, 40)):
        (texts / f'{i}.txt').write_text(''.join(chr(97 + (j * 7 + i) % 26) for j in range(n)))
    dirs = [save_model_checkpoint(Model(tiny_config(vocab_size=256, block_size=8, **MIXERS[name])),
                                  tmp_path / name) for name in ('fm_sparse', 'attn')]
    out = tmp_path / 'result' / 'positions'
    results = evaluation.main([f'--out_dir={d}' for d in dirs] + [f'--data={texts}', '--max_len=32',
                                                                  '--chunk_len=16', f'--out={out}'])
    fm, attn = results
    assert [b['start'] for b in fm['buckets']] == [1, 2, 4, 8, 16, 32, 64] and fm['max_positions'] is None
    assert [b['start'] for b in attn['buckets']] == [1, 2, 4, 8, 16] and attn['max_positions'] == 32
    assert [s['t'] for s in attn['loss_so_far']] == [1, 2, 4, 8, 16, 32]
    assert fm['buckets'][-1]['positions'] == 89 - 63 and fm['buckets'][-1]['documents'] == 1
    saved = json.loads(out.with_suffix('.json').read_text())
    assert [c['label'] for c in saved['checkpoints']] == ['fm_sparse', 'attn']
    rows = out.with_suffix('.csv').read_text().splitlines()
    assert rows[0].startswith('checkpoint,model,measure') and len(rows) == 1 + 2 + 7 + 7 + 5 + 6


def test_seed_groups_hold_runs_that_differ_in_seed_alone():
    """eval.py's spread over seeds groups the runs whose settings differ in the seed (and where they were written)
    alone: two out_dirs of one seed at 500 and 600 steps are two models, not two seeds."""
    def result(seed, steps=500, **changed):
        return {'model_config': {'d_model': 32}, 'tokenizer': 'bytes', 'iter_num': steps, 'train_config': {
            'seed': seed, 'out_dir': f'out-{seed}-{steps}', 'max_iters': steps, 'learning_rate': 1e-3, **changed}}
    groups = evaluation.seed_groups([result(1), result(2), result(1, 600), result(3, learning_rate=2e-3)])
    assert [[r['train_config']['out_dir'] for r in group] for group in groups] == [
        ['out-1-500', 'out-2-500'], ['out-1-600'], ['out-3-500']]


def test_eval_help_names_the_help_of_each_mode(capsys):
    evaluation.main(['--help'])
    assert 'python eval.py routing --help' in capsys.readouterr().out


def test_loss_by_position_refuses_another_tokenizer(trained, tmp_path):
    """A checkpoint of cl100k_base on the bytes of the default corpus's long.bin: refused before any work."""
    ckpt = torch.load(os.path.join(trained[0], 'ckpt.pt'), weights_only=True)
    torch.save({**ckpt, 'tokenizer': 'cl100k_base'}, tmp_path / 'ckpt.pt')
    long_bin = os.path.join(ckpt['data_state']['folder'], 'long.bin')
    with pytest.raises(evaluation.EvalError, match=r"long.bin holds tokens of 'bytes', but .* was trained with "
                                                   r"'cl100k_base': give data tokenized with 'cl100k_base'"):
        evaluation.main([f'--out_dir={trained[0]}', f'--out_dir={tmp_path}', f'--data={long_bin}'])


def test_eval_finds_the_default_corpus_from_any_folder(data_dir, tmp_path, monkeypatch):
    """data_dir '' (the default) is prepare_data.py's folder, the repository's data/, wherever eval.py runs."""
    assert evaluation.DEFAULT_DATA_DIR == prepare_data.DEFAULT_DATA_DIR
    monkeypatch.setattr(evaluation, 'DEFAULT_DATA_DIR', data_dir)  # the suite's prepared copy
    monkeypatch.chdir(tmp_path)
    docs, description = evaluation.load_documents('', evaluation.POSITION_SETTINGS['data_dir'], 'bytes', 'ckpt.pt')
    assert len(docs) == 3 and description.startswith(os.path.join(data_dir, 'default_bytes', 'long.bin'))
    assert not os.listdir(tmp_path)


def test_rolling_windows_score_every_token_once():
    tokens = list(range(100, 123))  # 23 tokens, windows of 8 predictions
    pairs = evaluation.rolling_windows(tokens, prefix=7, max_len=8)
    assert [t for _, continuation in pairs for t in continuation] == tokens
    sequence = [7] + tokens
    for context, continuation in pairs:
        inputs = (context + continuation)[:-1]
        assert len(inputs) == 8 and inputs == sequence[sequence.index(continuation[-1]) - 8:][:8]


@torch.no_grad()
def test_harness_loglikelihood_equals_the_forward():
    """The Scorer (the lm-eval adapter's logic): batched requests of any length, an empty context, contexts cut
    to the training context, rolling log-likelihoods; each against the model's own forward on that request."""
    torch.manual_seed(8)
    model = Model(tiny_config(vocab_size=256, block_size=12, init_std=0.3, mixer='fm', top_k=3)).double().eval()
    tok = get_tokenizer('bytes')
    scorer = evaluation.Scorer(model, tok, batch_size=2)
    requests = [('To be', ', or not'), ('', 'Hamlet'), ('Now is the winter of our discontent', ' made'),
                ('a', 'b'), ('ab \n ', 'cd'), (' \n', 'ab')]
    for (context, continuation), (logprob, greedy) in zip(requests, scorer.loglikelihood(requests)):
        stripped = context.rstrip()  # its trailing whitespace belongs to the continuation
        scored = tok.encode(context[len(stripped):] + continuation)
        n = len(scored)
        ids = ((tok.encode(stripped) or [scorer.prefix]) + scored)[-13:]  # at most 12 inputs
        logits = model(torch.tensor([ids[:-1]]))[0][0, -n:]
        want = logits.log_softmax(-1).gather(-1, torch.tensor(ids[-n:])[:, None]).sum().item()
        assert logprob == pytest.approx(want, rel=1e-12, abs=1e-12)
        assert greedy == (logits.argmax(-1) == torch.tensor(ids[-n:])).all().item()
    short, long_text = 'Nymph, in', 'O, what a rogue and peasant slave am I!'  # 9 + 1 and 39 + 1 tokens
    got = scorer.loglikelihood_rolling([short, long_text])
    ids = [scorer.prefix] + tok.encode(short)
    want = model(torch.tensor([ids[:-1]]))[0][0].log_softmax(-1).gather(-1, torch.tensor(ids[1:])[:, None]).sum()
    assert got[0] == pytest.approx(want.item(), rel=1e-12)
    windows = evaluation.rolling_windows(tok.encode(long_text), scorer.prefix, 12)
    assert got[1] == pytest.approx(sum(lp for lp, _ in scorer.loglikelihood_tokens(windows)), rel=1e-12)


def test_harness_generation_cuts_at_stop_strings():
    scorer = evaluation.Scorer(increment_model(), get_tokenizer('bytes'), batch_size=2)
    requests = [('abc', {'until': ['g'], 'max_gen_toks': 6}), ('klm', {'until': 'q', 'max_gen_toks': 6}),
                ('xy', {'until': [], 'max_gen_toks': 3, 'do_sample': False, 'temperature': 0.0})]
    assert scorer.generate_until(requests) == ['def', 'nop', 'z{|']
    with pytest.raises(ValueError, match='does not take: num_beams'):
        scorer.generate_until([('abc', {'num_beams': 2})])


HARNESS_TASKS = {  # name -> (examples, task YAML lines): hand-made examples the increment model gets right
    'count_choice': ([{'context': 'abcd', 'choices': ['efgh', 'hgfe', 'xqzw'], 'label': 0},
                      {'context': 'klm', 'choices': ['qrs', 'nop', 'mlk'], 'label': 1},
                      {'context': 'n=1234', 'choices': ['5', '9', '0'], 'label': 0}],
                     ['output_type: multiple_choice', 'doc_to_text: "{{context}}"', 'doc_to_choice: "{{choices}}"',
                      'doc_to_target: "{{label}}"', 'target_delimiter: ""', 'metric_list:', '  - metric: acc']),
    'count_generation': ([{'context': 'abcd', 'answer': 'efg'}, {'context': 'n=0123', 'answer': '456'},
                          {'context': 'pq', 'answer': 'rs'}],
                         ['output_type: generate_until', 'doc_to_text: "{{context}}"', 'doc_to_target: "{{answer}}"',
                          'generation_kwargs:', '  until: ["7", "t"]', '  max_gen_toks: 3', '  do_sample: false',
                          'metric_list:', '  - metric: exact_match']),
    'count_text': ([{'text': 'abcdefghijklmnopqrstuvwxyz' * 2}, {'text': '0123456789'}],
                   ['output_type: loglikelihood_rolling', 'doc_to_text: ""', 'doc_to_target: "{{text}}"',
                    'metric_list:', '  - metric: bits_per_byte']),
}


@pytest.mark.skipif(importlib.util.find_spec('lm_eval') is None, reason='lm-eval is not installed')
def test_harness_runs_a_local_task_offline(tmp_path, monkeypatch):
    """python eval.py harness on tasks defined in local YAML files with JSON data, offline: the hand-set model
    gets every multiple-choice and generation example right, and the harness's bits per byte are the Scorer's."""
    monkeypatch.setenv('HF_DATASETS_OFFLINE', '1')
    monkeypatch.setenv('HF_HUB_OFFLINE', '1')
    for name, (examples, lines) in HARNESS_TASKS.items():
        data = tmp_path / f'{name}.jsonl'
        data.write_text(''.join(json.dumps(example) + '\n' for example in examples))
        (tmp_path / f'{name}.yaml').write_text('\n'.join([f'task: {name}', 'dataset_path: json', 'dataset_kwargs:',
                                                          '  data_files:', f'    test: {data}', 'test_split: test',
                                                          *lines]) + '\n')
    out_dir = save_model_checkpoint(increment_model(), tmp_path / 'model')
    results = evaluation.main(['harness', f'--out_dir={out_dir}', f'--tasks={",".join(HARNESS_TASKS)}',
                               f'--include_path={tmp_path}', '--batch_size=2', f'--out={tmp_path / "harness"}'])
    scores = results['results']
    assert scores['count_choice']['acc,none'] == 1.0
    assert scores['count_generation']['exact_match,none'] == 1.0
    texts = [example['text'] for example in HARNESS_TASKS['count_text'][0]]
    scorer = evaluation.Scorer(increment_model(), get_tokenizer('bytes'))
    bits = -sum(scorer.loglikelihood_rolling(texts)) / sum(len(t) for t in texts) / math.log(2)
    assert scores['count_text']['bits_per_byte,none'] == pytest.approx(bits, rel=1e-6)
    assert json.loads((tmp_path / 'harness.json').read_text())['results']['count_choice']['acc,none'] == 1.0


def test_reproduction_configs_differ_only_in_the_model():
    """The extrapolation baselines have FM's parameter count (within 0.5%) and its data, context, tokens and
    schedule; each its own learning rate (the best of reproduce.sh's sweep)."""
    config, types = defaults()
    architecture = {f.name for f in fields(ModelConfig)} - {'block_size'} | {'out_dir', 'wandb_run_name',
                                                                             'learning_rate', 'min_lr'}
    paths = {name: os.path.join(REPO, 'research', f'extrapolation_{name}.py')
             for name in ('fm', 'transformer', 'mamba2')}
    training = {name: {k: v for k, v in load_config(config, [path], types).items() if k not in architecture}
                for name, path in paths.items()}
    n_params = {name: build(path, meta=True).num_params(non_embedding=False) for name, path in paths.items()}
    for name in paths:
        assert abs(n_params[name] / n_params['fm'] - 1) < 0.005, n_params
        assert training[name] == training['fm'], name
    assert training['fm']['block_size'] == 512


def reproduce_sh(call, **env):
    """The output of `call` in bash after the definitions of research/reproduce.sh's functions (not its main part)."""
    with open(os.path.join(REPO, 'research', 'reproduce.sh')) as f:
        functions = re.findall(r'^\w+\(\) \{.*?^\}$', f.read(), re.M | re.S)
    run = subprocess.run(['bash', '-c', '\n'.join(['set -euo pipefail', *functions, call])], cwd=REPO,
                         capture_output=True, text=True, env={**os.environ, **env})
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_frontier_sizes_match_in_parameters():
    """At each size of reproduce.sh's frontier the Transformer (heads of 64, n_kv_head = n_head / 2), Mamba-2
    (expand 1, heads of 64, d_state 64) and FM (m = 64, k = 16, tau = 1) have the same non-embedding parameters
    within 1%, about the size's name; the 4M runs are the extrapolation subset's seed-1 runs, the same lines."""
    config, types = defaults()
    sizes = {}
    for line in reproduce_sh('frontier_sizes | while read -r size model args; do '
                             'echo "$size $model $(extrapolation_model "$model") $args"; done').splitlines():
        size, model, *args = line.split()
        c = load_config(config, args, types)
        with torch.device('meta'):
            n = Model(ModelConfig(**{f.name: c[f.name] for f in fields(ModelConfig) if f.name in c},
                                  vocab_size=256)).num_params()
        sizes.setdefault(size, {})[model] = n
        if c['mixer'] == 'attn':
            assert c['d_model'] == 64 * c['n_head'] == 128 * c['n_kv_head'], line
        elif c['mixer'] == 'mamba2':
            assert (c['mamba_expand'], c['mamba_head_dim'], c['d_state']) == (1, 64, 64), line
        else:
            assert (c['n_memory'], c['top_k'], c['tau']) == (64, 16, 1.0), line
    assert list(sizes) == ['8M', '4M', '2M', '1M']
    for size, n_params in sizes.items():
        assert set(n_params) == {'transformer', 'mamba2', 'fm-k16', 'fm-k16-block'}, size
        assert max(n_params.values()) / min(n_params.values()) < 1.01, (size, n_params)
        assert 0.8 < n_params['fm-k16'] / (int(size[:-1]) * 1e6) < 1.25, (size, n_params)
    grids = dict(LRS_TRANSFORMER='1e-3 2e-3', LRS_MAMBA2='2e-3', LRS_FM='5e-4 1e-3', LRS_FM_BLOCK='2e-3', SEEDS='1 2',
                 MODELS='transformer mamba2 fm-k16 fm-k16-block fm-dense')
    at_4m = reproduce_sh('frontier_runs', SIZES='4M', **grids).splitlines()
    extrapolation = reproduce_sh('extrapolation_runs', **grids).splitlines()
    assert len(at_4m) == 6 and set(at_4m) == {line for line in extrapolation if ' --seed=1' in line
                                              and not line.startswith('extrapolation/fm-dense')}


def test_extrapolation_models_match_in_parameters():
    """Every model of reproduce.sh's extrapolation subset (the variants of FM's block through d_ff) has the
    non-embedding parameters of FM k = 16 within 0.3%; the paper's layer and the block have three seeds."""
    config, types = defaults()
    params, seeds = {}, {}
    for line in reproduce_sh('extrapolation_models | while read -r model seeds; do '
                             'echo "$model $(extrapolation_model "$model")"; done').splitlines():
        model, *args = line.split()
        c = load_config(config, args, types)
        with torch.device('meta'):
            params[model] = Model(ModelConfig(**{f.name: c[f.name] for f in fields(ModelConfig) if f.name in c},
                                              vocab_size=256)).num_params()
    for line in reproduce_sh('extrapolation_models').splitlines():
        model, *model_seeds = line.split()
        seeds[model] = model_seeds
    assert {'fm-k16-gate', 'fm-k16-conv', 'fm-k16-block', 'fm-dense-block', 'fm-k4-block'} <= set(params)
    for model, n in params.items():
        assert abs(n / params['fm-k16'] - 1) < 0.003, (model, n)
    assert seeds['fm-k16'] == seeds['fm-k16-block'] == ['1', '2', '3'] and seeds['fm-k16-gate'] == ['1', '2']


def test_reproduce_frontier_dry_run(tmp_path):
    """bash research/reproduce.sh frontier on the CPU, 2 steps a run, one size and one learning rate a model: every
    run in frontier.csv, at its best rate, with its training FLOPs and losses at 2x and 8x the context."""
    env = dict(RUNS=str(tmp_path / 'runs'), RESULTS=str(tmp_path / 'results'), JOBS='3', SIZES='1M',
               LRS_TRANSFORMER='1e-3', LRS_MAMBA2='2e-3', LRS_FM='1e-3', MODELS='transformer mamba2 fm-k16',
               TRAIN_ARGS='--max_iters=2 --warmup_iters=0 --batch_size=2 --eval_iters=1 --device=cpu')
    run = subprocess.run(['bash', 'research/reproduce.sh', 'frontier'], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, **env})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    with open(tmp_path / 'results' / 'frontier.csv') as f:
        rows = {os.path.basename(row['run']): row for row in csv.DictReader(f)}
    assert set(rows) == {'transformer-1M-lr1e-3-s1', 'mamba2-1M-lr2e-3-s1', 'fm-k16-1M-lr1e-3-s1'}
    for row in rows.values():
        assert row['best_lr'] == '1' and int(row['tokens']) == 2 * 2 * 512
        assert float(row['forward_flops']) > 2 * 1e6 * 2048  # at least 2 FLOPs a parameter and token
        assert float(row['loss_so_far_2x']) > 0 and float(row['loss_so_far_8x']) > 0
    assert 'the frontier: each model at its best learning rate' in run.stdout


def test_scaling_takes_each_m_at_its_best_tau(tmp_path):
    """Runs as checkpoints and as the .csv of an earlier machine: each series keeps, per m, its best finished run
    (m = 16, k = 4 is in both sparse series); unfinished runs are left out."""
    runs = tmp_path / 'runs'
    cases = {'m16-k4-tau1': (16, 4, 1.0, 2.0, 10), 'm16-k4-tau0.5': (16, 4, 0.5, 1.9, 10),
             'm16-dense-tau1': (16, None, 1.0, 1.8, 10), 'm64-k16-tau1': (64, 16, 1.0, 1.5, 4)}
    for name, (m, k, tau, loss, iters) in cases.items():
        model = Model(tiny_config(n_memory=m, top_k=k, tau=tau))
        save_model_checkpoint(model, runs / name, best_val_loss=loss, iter_num=iters, train_config={'max_iters': 10})
    earlier = tmp_path / 'earlier.csv'
    earlier.write_text('run,n_memory,top_k,tau,val_loss,iter_num,max_iters\n'
                       'm64-k16-tau0.25,64,16,0.25,1.6,10,10\nm16-k4-tau1,16,4,1.0,9.9,10,10\n')
    rows, best = analysis.main(['scaling', f'--runs={earlier}', f'--runs={runs}', f'--out={tmp_path / "s"}'])
    assert len(rows) == 5 and {r['run']: r['val_loss'] for r in rows}['m16-k4-tau1'] == 2.0  # the later source
    assert {name: {m: r['run'] for m, r in series.items()} for name, series in best.items()} == {
        'dense (k = m)': {16: 'm16-dense-tau1'}, 'k = m/4': {16: 'm16-k4-tau0.5', 64: 'm64-k16-tau0.25'},
        'k = 4': {16: 'm16-k4-tau0.5'}}
    again, _ = analysis.main(['scaling', f'--runs={tmp_path / "s.csv"}', f'--out={tmp_path / "t"}'])
    assert again == rows


def sweep_record(model, lr, seed, loss, finished=True):
    """A hand-made run record of analysis.py's sweep."""
    return {'run': f'{model}-lr{lr:g}-s{seed}', 'model': model, 'learning_rate': lr, 'seed': seed, 'val_loss': loss,
            'iter_num': 10 if finished else 5, 'max_iters': 10}


def test_sweep_takes_each_model_at_its_best_mean_learning_rate(capsys):
    """The best rate has the lowest mean over seeds (not the lowest single run); unfinished runs are left out; a best
    rate at an end of its model's grid is warned about, with the rate to add."""
    grids = {
        'middle': [(1e-3, 1, 1.7), (1e-3, 2, 1.7), (2e-3, 1, 1.45), (2e-3, 2, 1.55), (4e-3, 1, 1.4), (4e-3, 2, 1.8)],
        'lowest': [(5e-4, 1, 1.6), (1e-3, 1, 1.7), (2e-3, 1, 1.8)],
        'highest': [(2e-3, 1, 1.9), (4e-3, 1, 1.8), (8e-3, 1, 1.7)],
        'single': [(1e-3, 1, 2.0)],
    }
    records = [sweep_record(model, *run) for model, runs in grids.items() for run in runs]
    records.append(sweep_record('lowest', 2e-3, 2, 1.0, finished=False))
    table = analysis.by_model_and_lr(records)
    best = analysis.best_learning_rates(table)
    assert best == {'middle': 2e-3, 'lowest': 5e-4, 'highest': 8e-3, 'single': 1e-3}
    assert [len(members) for members in table['lowest'].values()] == [1, 1, 1]  # the unfinished run is not in it
    warnings = analysis.edge_warnings(table, best)
    assert len(warnings) == 3 and not any('middle' in w for w in warnings)
    assert 'lowest:' in warnings[0] and warnings[0].endswith('train at 0.00025 too')
    assert 'highest:' in warnings[1] and warnings[1].endswith('train at 0.016 too')
    assert 'single:' in warnings[2] and warnings[2].endswith('train at 0.0005 and 0.002 too')
    analysis.print_sweep(records, table, best)
    out = capsys.readouterr().out
    assert 'left out, not finished: lowest-lr0.002-s2' in out
    assert ['middle', '0.002', '2', '1.5000', '(1.4500-1.5500)', '*'] in [line.split() for line in out.splitlines()]


def hand_forward_flops(name, seq_len):
    """tiny_config's model of MIXERS[name], counted from its shapes -> (non-embedding parameters, forward FLOPs per
    token at seq_len): 2 FLOPs a multiply-add of every weight (norm scales, biases and the conv counted as weights,
    as Model.flops_per_token does), the tied LM head, and the mixer's work on its sequence or state."""
    d, vocab, layers, ffn = 32, 64, 2, 128
    if name.startswith('fm_block'):  # the block's weights taken from the MLP: 128 - round((32 * 32 + 5 * 32) / 96)
        ffn = 116
    per_layer = 2 * d + 3 * d * ffn  # the two norms' scales; SwiGLU gate, up, down
    if name == 'attn':  # 4 query heads of 8, 2 key/value heads
        per_layer += d * 32 + 2 * d * 16 + 32 * d  # q, k, v, out
        work = 2 * 2 * seq_len * 32  # q.k with each of the seq_len keys, the sum of as many values: 32 dimensions
    elif name == 'mamba2':  # d_inner 64 (4 heads of 16), d_state 8, a conv of 4 over (x, B, C): 80 channels
        per_layer += d * (64 + 80 + 4) + 80 * 4 + 80 + 3 * 4 + 64 + 64 * d  # in_proj, conv, dt, A, D, norm, out_proj
        work = 5 * 64 * 8  # each state element: decay, input outer product, add, C readout (2)
    else:  # m = 8 rows of 32; k = 3 (sparse) or 8 (dense)
        k = 3 if name.endswith('sparse') else 8
        per_layer += d * 8 + (2 * d + 2) + 2 * d * d  # router, rates (eta, mu; biased), in_proj, out_proj
        if name.startswith('fm_block'):
            per_layer += d * 4 + d + d * d  # a conv of 4 over the values (and its bias), the gate's W_z
        work = k * (9 * d + 5)  # paper App. FLOPS: the recurrence costs 9 d_memory + 5 per row read and written
    params = layers * per_layer + d  # and the final norm
    return params, 2 * (params + d * vocab) + layers * work


@pytest.mark.parametrize('name', list(MIXERS))
def test_training_flops_match_a_hand_count(name, tmp_path):
    """Model.flops_per_token is 3x (forward + backward) the hand count, and analysis.py's training FLOPs of a run are
    the forward count x the tokens it trained."""
    params, forward = hand_forward_flops(name, 48)
    model = Model(tiny_config(**MIXERS[name]))
    assert model.num_params() == params
    assert model.flops_per_token(48) == 3 * forward
    assert hand_forward_flops(name, 4096)[1] == model.flops_per_token(4096) / 3
    tokens = 10 * 4 * 48  # 10 steps of 4 x 48
    save_model_checkpoint(model, tmp_path / 'run', best_val_loss=2.5, iter_num=10, data_state={'tokens_seen': tokens},
                          train_config={'max_iters': 10, 'learning_rate': 1e-3, 'min_lr': 1e-4, 'seed': 1})
    record = analysis.run_record(tmp_path / 'run')
    assert record['forward_flops'] == forward * tokens and record['non_embedding_parameters'] == params
    assert (record['learning_rate'], record['seed'], record['val_loss'], record['tokens']) == (1e-3, 1, 2.5, tokens)


# ----------------------------------------------------------------------------- FM's router settings, eval.py routing,
# the results of an earlier machine

def planted_router_model(top_k):
    """A byte FM model (m = 8) whose blocks add nothing (out_proj and down_proj zero), so that every layer's router
    sees norm(embed[token]). The embedding's first coordinate is 1 for every token, so that input's first coordinate
    is positive; row 0 of each router, -20 on it and 0 elsewhere, loses to every other row (0 on it): a dead row."""
    torch.manual_seed(11)
    model = Model(tiny_config(vocab_size=256, top_k=top_k))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(('out_proj.weight', 'down_proj.weight')):
                p.zero_()
        model.embed.weight.normal_(std=0.3)[:, 0] = 1.0
        for block in model.blocks:
            weight = block.mixer.router.weight.normal_(std=0.5)  # (8, 32): routing far from uniform
            weight[:, 0] = 0.0
            weight[0] = 0.0
            weight[0, 0] = -20.0
    for block in model.blocks:  # row 0's logit is below every other row's for every token of the vocabulary
        logits = block.mixer.router(block.mixer_norm(model.embed.weight)).detach()  # (256, 8)
        assert (logits[:, 1:].min(-1).values - logits[:, 0] > 5).all()
    return model


def routing_by_hand(model, tokens):
    """Each layer's usage (dense: mean alpha a row; sparse: the share of tokens selecting it), mean entropy of the
    softmax and mean eta, for a planted_router_model, whose every layer sees norm(embed[token])."""
    layers = []
    for block in model.blocks:
        mixer = block.mixer
        x = block.mixer_norm(model.embed(tokens)).detach().double()  # (N, 32)
        probs = torch.softmax(x @ mixer.router.weight.detach().double().T, -1)  # (N, 8), tau = 1
        if mixer.top_k < 8:  # a selection counts 1
            probs_or_selections = torch.zeros_like(probs).scatter(-1, probs.topk(mixer.top_k).indices, 1.0)
        else:
            probs_or_selections = probs
        eta = torch.sigmoid(x @ mixer.rates.weight[0].detach().double() + mixer.rates.bias[0].item())
        kept = probs_or_selections if mixer.top_k < 8 else torch.ones_like(probs)  # the rows a token reads
        weight = probs * kept / (probs * kept).sum(-1, keepdim=True)  # alpha renormalised over them
        heaviest = weight.mean(0).argmax()
        layers.append({'usage': probs_or_selections.mean(0), 'entropy': float(-(probs * probs.log()).sum(-1).mean()),
                       'eta_mean': float(eta.mean()), 'weight_usage': weight.mean(0),
                       'busiest_row_theta': float((eta * weight[:, heaviest]).mean())})
    return layers


def routing_texts(folder):
    """Two .txt files of 90 and 40 printable bytes."""
    folder.mkdir()
    for i, n in enumerate((90, 40)):
        (folder / f'{i}.txt').write_text(''.join(chr(33 + (j * 37 + i * 11) % 90) for j in range(n)))
    return folder


def test_routing_measures_usage_dead_rows_entropy_and_eta(tmp_path):
    """eval.py routing on a sparse (k = 3) and a dense FM checkpoint, every token measured: usage, dead rows, entropy
    and eta as counted by hand; usage sums to k (dense: 1); the planted dead row is counted, with usage 0 (dense: below
    1/(10 m)); routing.json in each out_dir, --out's .csv a row a checkpoint and layer."""
    texts = routing_texts(tmp_path / 'texts')
    models = {'sparse': planted_router_model(3), 'dense': planted_router_model(None)}
    dirs = {name: save_model_checkpoint(model, tmp_path / name) for name, model in models.items()}
    out = tmp_path / 'all' / 'routing'
    results = evaluation.main(['routing', *(f'--out_dir={d}' for d in dirs.values()), f'--data={texts}',
                               '--tokens=1000', '--chunk_len=16', f'--out={out}', '--device=cpu'])
    tokens = torch.tensor([b for i in (0, 1) for b in (texts / f'{i}.txt').read_bytes()])
    assert [r['label'] for r in results] == ['sparse', 'dense']
    for (name, model), result in zip(models.items(), results):
        k = 3 if name == 'sparse' else 1
        assert result['tokens'] == 130 and len(result['layers']) == 2
        for layer, want in zip(result['layers'], routing_by_hand(model, tokens)):
            usage = torch.tensor(layer['usage'], dtype=torch.float64)
            assert (usage - want['usage']).abs().max() < 1e-9, name
            assert abs(usage.sum() - k) < 1e-9
            assert usage[0] == 0 if name == 'sparse' else usage[0] < 1e-3
            assert layer['dead_rows'] == int((want['usage'] < 1 / 80).sum()) >= 1
            assert layer['entropy'] == pytest.approx(want['entropy'], abs=1e-9)
            assert layer['eta_mean'] == pytest.approx(want['eta_mean'], abs=1e-6)
            weight = torch.tensor(layer['weight_usage'], dtype=torch.float64)
            assert (weight - want['weight_usage']).abs().max() < 1e-9 and abs(weight.sum() - 1) < 1e-9
            entropy = -torch.special.xlogy(want['weight_usage'], want['weight_usage']).sum()  # 0 log 0 = 0
            assert layer['weight_effective_rows'] == pytest.approx(float(torch.exp(entropy)))
            assert layer['busiest_row_theta'] == pytest.approx(want['busiest_row_theta'], abs=1e-6)
            assert layer['busiest_row_ablation'] == 0  # the planted blocks add nothing: no read-out reaches the loss
        saved = json.loads((tmp_path / name / 'routing.json').read_text())
        keys = ('usage', 'dead_rows', 'entropy', 'eta_mean')
        assert [[layer[key] for key in keys] for layer in saved['layers']] == [
            [layer[key] for key in keys] for layer in result['layers']]
    with open(out.with_suffix('.csv')) as f:
        rows = list(csv.DictReader(f))
    assert [(row['checkpoint'], row['layer']) for row in rows] == [('sparse', '0'), ('sparse', '1'), ('dense', '0'),
                                                                   ('dense', '1')]
    assert [int(row['dead_rows']) for row in rows] == [layer['dead_rows'] for r in results for layer in r['layers']]


def test_busiest_row_ablation_zeroes_that_rows_read_out_only():
    """The ablation of a layer's heaviest row is the loss with that row's phi zeroed in that layer alone (the row
    still written), written out by hand; the model computes as before afterwards."""
    torch.manual_seed(12)
    model = Model(tiny_config(top_k=3, init_std=0.3)).double().eval()
    tokens = torch.randint(0, 64, (40,))
    layers = [{'weight_usage': [0.0] * 8} for _ in model.blocks]
    layers[1]['weight_usage'][5] = 1.0  # layer 1's row 5
    cfg = {'device': 'cpu', 'dtype': 'float32', 'chunk_len': 16}
    base = model(tokens[None, :-1], tokens[None, 1:])[1].item()
    evaluation.add_ablations(model, [tokens.numpy()], cfg, layers)
    x = model.embed(tokens[None, :-1])
    x, _ = model.blocks[0](x)
    block, mixer = model.blocks[1], model.blocks[1].mixer
    h = block.mixer_norm(x)
    idx, alpha, eta, mu = mixer.route(h)
    alpha = torch.zeros(*h.shape[:-1], 8, dtype=alpha.dtype).scatter(-1, idx, alpha)
    phi = (mu * alpha).index_fill(-1, torch.tensor([5]), 0.0)
    y, _ = fm_kernel.fm_scan_naive(mixer.in_proj(h), eta * alpha, phi, eps=mixer.eps)
    x = block.add_mlp(x + mixer.out_proj(y))
    ablated = F.cross_entropy(model.head(x)[0], tokens[1:]).item()
    assert layers[1]['busiest_row_ablation'] == pytest.approx(ablated - base, abs=1e-9)
    assert abs(ablated - base) > 1e-4
    assert model(tokens[None, :-1], tokens[None, 1:])[1].item() == base


@pytest.mark.parametrize('name', ['attn', 'mamba2'])
def test_routing_refuses_a_checkpoint_of_another_mixer(name, tmp_path):
    """An FM and a non-FM checkpoint: refused before any work, naming the other one and its mixer."""
    fm = save_model_checkpoint(Model(tiny_config(vocab_size=256)), tmp_path / 'fm')
    other = save_model_checkpoint(Model(tiny_config(vocab_size=256, **MIXERS[name])), tmp_path / name)
    with pytest.raises(evaluation.EvalError, match=rf'{os.path.join(other, "ckpt.pt")} is a {name} model: .*FM'):
        evaluation.main(['routing', f'--out_dir={fm}', f'--out_dir={other}', '--device=cpu'])
    assert not (tmp_path / 'fm' / 'routing.json').exists()


def test_routing_stats_of_uniform_and_token_independent_routers():
    """A router of zero weights is uniform: entropy log m, dense usage 1/m a row, m effective rows. The same input for
    every token leaves only a token-independent part in the router's input and centred logits (shares 1); inputs
    drawn around zero have almost none."""
    torch.manual_seed(0)
    mixer = FactorizationMemory(tiny_config())
    torch.nn.init.zeros_(mixer.router.weight)
    stats = evaluation.RoutingStats(8, 8, 32)
    stats.add(mixer, torch.randn(3, 20, 32))
    layer = stats.summary()
    assert layer['entropy'] == pytest.approx(math.log(8), abs=1e-12) and layer['entropy_uniform'] == math.log(8)
    assert layer['usage'] == pytest.approx([1 / 8] * 8, abs=1e-12)
    assert layer['effective_rows'] == pytest.approx(8) and layer['dead_rows'] == layer['rare_rows'] == 0
    mixer = FactorizationMemory(tiny_config(top_k=3))
    torch.nn.init.normal_(mixer.router.weight, std=0.5)
    same, spread = evaluation.RoutingStats(8, 3, 32), evaluation.RoutingStats(8, 3, 32)
    same.add(mixer, torch.randn(32).expand(2, 50, 32))
    spread.add(mixer, torch.randn(2, 2000, 32))
    same, spread = same.summary(), spread.summary()
    assert same['logit_bias_share'] == pytest.approx(1, abs=1e-9) and same['input_mean_share'] == pytest.approx(1)
    assert same['usage'].count(1.0) == 3 and same['dead_rows'] == 5 and same['busiest_row'] == 1.0
    assert spread['logit_bias_share'] < 0.01 and spread['input_mean_share'] < 0.01


def sweep_run(folder, lr, loss, block_size=48, **model):
    """A finished run folder of tiny_config(**model), block_size as given, trained at lr to validation loss."""
    return save_model_checkpoint(Model(tiny_config(block_size=block_size, **model)), folder, best_val_loss=loss,
                                 iter_num=10, data_state={'tokens_seen': 10 * 4 * block_size},
                                 train_config={'max_iters': 10, 'learning_rate': lr, 'min_lr': lr / 10, 'seed': 1})


def test_sweep_merges_the_csv_of_an_earlier_machine(tmp_path):
    """analysis.py sweep of an earlier machine's .csv and this machine's runs: every run once (the later source's
    record of a run of the same subset/name), the best learning rate over both."""
    earlier, here = tmp_path / 'earlier' / 'extrapolation', tmp_path / 'here' / 'extrapolation'
    for folder, lr, loss in ((earlier, 5e-4, 1.5), (earlier, 1e-3, 9.9), (here, 1e-3, 2.0), (here, 2e-3, 1.9)):
        sweep_run(folder / f'fm-lr{lr:g}-s1', lr, loss, **MIXERS['fm_sparse'])
    analysis.main(['sweep', f'--runs={earlier}', f'--out={tmp_path / "earlier_lr"}'])
    records, best = analysis.main(['sweep', f'--runs={tmp_path / "earlier_lr.csv"}', f'--runs={here}',
                                     f'--out={tmp_path / "lr"}'])
    assert {analysis.run_key(r): r['val_loss'] for r in records} == {
        'extrapolation/fm-lr0.0005-s1': 1.5, 'extrapolation/fm-lr0.001-s1': 2.0, 'extrapolation/fm-lr0.002-s1': 1.9}
    assert list(best.values()) == [5e-4] and sum(r['best_lr'] for r in records) == 1
    assert (tmp_path / 'lr_best.txt').read_text() == f"{earlier / 'fm-lr0.0005-s1'}\n"
    with open(tmp_path / 'lr.csv') as f:
        assert len(list(csv.DictReader(f))) == 3
    records, _ = analysis.main(['sweep', f'--runs={here}', f'--runs={tmp_path / "earlier_lr.csv"}',
                                  f'--out={tmp_path / "lr2"}'])
    assert {analysis.run_key(r): r['val_loss'] for r in records}['extrapolation/fm-lr0.001-s1'] == 9.9


def test_frontier_evaluates_only_the_runs_without_losses(tmp_path, monkeypatch):
    """analysis.py frontier of an earlier machine's frontier.csv (FM, its best rate with its losses) and this
    machine's attention run: only the attention checkpoint is opened; frontier.csv holds both, the earlier losses as
    they were."""
    earlier = tmp_path / 'earlier' / 'frontier'
    for lr, loss in ((5e-4, 1.5), (1e-3, 1.7)):
        sweep_run(earlier / f'fm-lr{lr:g}-s1', lr, loss, block_size=8, vocab_size=256, **MIXERS['fm_sparse'])
    records, _, _ = analysis.sweep([str(earlier)])
    for r in records:
        if r['best_lr']:
            r['loss_so_far_2x'], r['loss_so_far_8x'] = 1.25, 1.125
    fields = analysis.SWEEP_FIELDS + ('loss_so_far_2x', 'loss_so_far_8x')
    analysis.write_records(records, fields, tmp_path / 'earlier_frontier.csv')
    attn = sweep_run(tmp_path / 'here' / 'frontier' / 'attn-lr1e-3-s1', 1e-3, 2.0, block_size=8, vocab_size=256,
                     **MIXERS['attn'])
    opened, open_checkpoint = [], analysis.open_checkpoint
    monkeypatch.setattr(analysis, 'open_checkpoint', lambda out_dir, name: opened.append(out_dir) or (
        open_checkpoint(out_dir, name) if out_dir == attn else pytest.fail(f'opened {out_dir}')))
    texts = routing_texts(tmp_path / 'texts')
    _, points = analysis.main(['frontier', f'--runs={tmp_path / "earlier_frontier.csv"}',
                                 f'--runs={tmp_path / "here" / "frontier"}', f'--data={texts}',
                                 f'--out={tmp_path / "frontier"}', '--device=cpu'])
    assert opened == [attn]
    with open(tmp_path / 'frontier.csv') as f:
        rows = {analysis.run_key(row): row for row in csv.DictReader(f)}
    assert set(rows) == {'frontier/fm-lr0.0005-s1', 'frontier/fm-lr0.001-s1', 'frontier/attn-lr1e-3-s1'}
    fm, attn_row = rows['frontier/fm-lr0.0005-s1'], rows['frontier/attn-lr1e-3-s1']
    assert (fm['best_lr'], float(fm['loss_so_far_2x']), float(fm['loss_so_far_8x'])) == ('1', 1.25, 1.125)
    assert attn_row['best_lr'] == '1' and float(attn_row['loss_so_far_8x']) > 0
    assert rows['frontier/fm-lr0.001-s1']['loss_so_far_8x'] == ''
    assert sorted(points) == ['attn', 'fm m=8 k=3 tau=1']


def test_reproduce_skips_the_runs_of_an_earlier_machine(tmp_path):
    """bash research/reproduce.sh frontier on the CPU (2 steps a run, one size, one rate a model) with PREVIOUS, whose
    frontier.csv lists the Mamba-2 run: that run is not trained here, the others are, and frontier.csv holds all
    three, the earlier one as it was."""
    previous = tmp_path / 'previous'
    earlier = {'run': 'out-old/frontier/mamba2-1M-lr2e-3-s1', 'model': '6x128 mamba2 (1.13M)', 'parameters': 1163008,
               'non_embedding_parameters': 1130240, 'learning_rate': 2e-3, 'min_lr': 2e-4, 'seed': 1,
               'val_loss': 3.5, 'best_lr': 1, 'iter_num': 2, 'max_iters': 2, 'block_size': 512, 'tokens': 2048,
               'forward_flops': 1e10, 'loss_so_far_2x': 3.25, 'loss_so_far_8x': 3.125}
    analysis.write_records([earlier], analysis.SWEEP_FIELDS + ('loss_so_far_2x', 'loss_so_far_8x'),
                             previous / 'frontier.csv')
    env = dict(RUNS=str(tmp_path / 'runs'), RESULTS=str(tmp_path / 'results'), PREVIOUS=str(previous), JOBS='2',
               SIZES='1M', LRS_TRANSFORMER='1e-3', LRS_MAMBA2='2e-3', LRS_FM='1e-3', MODELS='transformer mamba2 fm-k16',
               TRAIN_ARGS='--max_iters=2 --warmup_iters=0 --batch_size=2 --eval_iters=1 --device=cpu')
    run = subprocess.run(['bash', 'research/reproduce.sh', 'frontier'], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, **env})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    trained = tmp_path / 'runs' / 'frontier'
    assert sorted(os.listdir(trained)) == ['fm-k16-1M-lr1e-3-s1', 'transformer-1M-lr1e-3-s1']
    assert all((trained / name / 'finished').is_file() for name in os.listdir(trained))
    with open(tmp_path / 'results' / 'frontier.csv') as f:
        rows = {os.path.basename(row['run']): row for row in csv.DictReader(f)}
    assert set(rows) == {'transformer-1M-lr1e-3-s1', 'mamba2-1M-lr2e-3-s1', 'fm-k16-1M-lr1e-3-s1'}
    old = rows['mamba2-1M-lr2e-3-s1']
    assert (old['run'], old['val_loss'], old['loss_so_far_8x']) == (earlier['run'], '3.5', '3.125')
    for row in rows.values():
        assert row['best_lr'] == '1' and float(row['loss_so_far_8x']) > 0


@pytest.mark.parametrize('script, argv, message', [
    ('eval.py', ['rooting'], "unknown subcommand 'rooting': did you mean routing? (eval.py [routing|harness] --key"),
    ('eval.py', ['sweep', '--runs=x'], 'sweep is in research/analysis.py: run python research/analysis.py sweep --'),
    ('analysis.py', ['scalling'], "unknown subcommand 'scalling': did you mean scaling? (research/analysis.py sweep"),
    ('analysis.py', ['routing'], 'routing is in eval.py: run python eval.py routing --key=value'),
    ('analysis.py', ['--runs=x'], 'name a subcommand (research/analysis.py sweep|frontier|scaling'),
])
def test_a_mistyped_or_moved_subcommand_says_what_to_run(script, argv, message):
    main = evaluation.main if script == 'eval.py' else analysis.main
    with pytest.raises(ConfigError) as error:
        main(argv)
    assert message in str(error.value)


@pytest.mark.parametrize('script, argv, message', [
    ('eval.py', ['--chunk_len=0'], '--chunk_len=0 is out of range: set it to at least 1 (tokens a chunk)'),
    ('eval.py', ['--max_len=-1'], '--max_len=-1 is out of range: set it to at least 1'),
    ('eval.py', ['routing', '--tokens=1'], '--tokens=1 is out of range: set it to at least 2'),
    ('eval.py', ['routing', '--chunk_len=0'], '--chunk_len=0 is out of range: set it to at least 1'),
    ('eval.py', ['harness', '--batch_size=0'], '--batch_size=0 is out of range: set it to at least 1'),
    ('eval.py', ['harness', '--limit=0'], '--limit=0 is out of range: set it to at least 1'),
    ('eval.py', ['harness', '--num_fewshot=-1'], '--num_fewshot=-1 is out of range: set it to at least 0'),
    ('analysis.py', ['frontier', '--runs=x', '--chunk_len=0'], '--chunk_len=0 is out of range: set it to at least 1'),
])
def test_eval_and_analysis_refuse_numbers_out_of_range(tmp_path, script, argv, message):
    """Refused before anything is read or written."""
    main, more = (evaluation.main, [f'--out_dir={tmp_path / "none"}']) if script == 'eval.py' else (analysis.main, [])
    with pytest.raises(ConfigError) as error:
        main([*argv, *more, f'--out={tmp_path / "results" / "x"}'])
    assert message in str(error.value) and not os.listdir(tmp_path)


def test_sweep_and_scaling_name_a_missing_or_foreign_runs_path(tmp_path):
    """--runs: missing, a path that does not exist, an empty .csv, the .csv of another subcommand."""
    sweep_like = 'a run folder (with ckpt.pt), a folder of run folders or a .csv that sweep or frontier wrote'
    with pytest.raises(ConfigError, match=re.escape(f'--runs is missing: give {sweep_like} (--runs may repeat)')):
        analysis.main(['frontier', f'--out={tmp_path / "f"}'])
    for mode, what in (('sweep', sweep_like), ('scaling', 'a folder of FM run folders or a .csv that scaling')):
        with pytest.raises(ConfigError, match=re.escape(f'--runs={tmp_path / "bad.csv"} does not exist: give {what}')):
            analysis.main([mode, f'--runs={tmp_path / "bad.csv"}', f'--out={tmp_path / "s"}'])
    (tmp_path / 'empty.csv').write_text('')
    with pytest.raises(evaluation.EvalError, match='empty.csv: not a .csv that analysis.py sweep or frontier wrote'):
        analysis.main(['sweep', f'--runs={tmp_path / "empty.csv"}', f'--out={tmp_path / "s"}'])
    analysis.write_records([sweep_record('m', 1e-3, 1, 2.0)], ('run', 'model', 'val_loss'), tmp_path / 'sweep.csv')
    with pytest.raises(evaluation.EvalError, match='sweep.csv: not a .csv that analysis.py scaling wrote'):
        analysis.main(['scaling', f'--runs={tmp_path / "sweep.csv"}', f'--out={tmp_path / "s"}'])


def test_eval_and_analysis_give_one_line_errors_from_any_folder(tmp_path):
    """The scripts run from another working directory (analysis.py finds eval.py) and say what is wrong in one line."""
    for script, args, message in (
            ('eval.py', ['rooting'], "error: unknown subcommand 'rooting': did you mean routing?"),
            ('research/analysis.py', ['sweep', '--runs=bad.csv'], 'error: --runs=bad.csv does not exist: give a run')):
        run = subprocess.run([sys.executable, os.path.join(REPO, script), *args], cwd=tmp_path, capture_output=True,
                             text=True)
        assert run.returncode == 1 and run.stderr.startswith(message) and len(run.stderr.splitlines()) == 1, run.stderr


# ----------------------------------------------------------------------------- config and accounting

@pytest.mark.parametrize('overrides, field', [
    (dict(top_k=0), 'top_k'),
    (dict(top_k=9), 'top_k'),
    (dict(mixer='rnn'), 'mixer'),
    (dict(d_model=0), 'd_model'),
    (dict(n_layer=-1), 'n_layer'),
    (dict(tau=0.0), 'tau'),
    (dict(n_memory=0), 'n_memory'),
    (dict(mixer='attn', d_model=30), 'd_model'),
    (dict(mixer='attn', n_kv_head=3), 'n_kv_head'),
    (dict(mixer='attn', d_model=36), 'n_head'),
    (dict(mixer='mamba2', mamba_head_dim=24), 'mamba_head_dim'),
    (dict(mixer='mamba2', d_state=0), 'd_state'),
])
def test_bad_config_raises_naming_the_field(overrides, field):
    config = tiny_config(**overrides)
    with pytest.raises(ValueError, match=rf'\b{field}\b'):
        config.validate()
    with pytest.raises(ValueError, match=rf'\b{field}\b'):
        Model(config)


def test_defaults_resolve():
    config = ModelConfig()
    config.validate()
    assert (config.ffn_dim, config.memory_dim, config.k, config.kv_heads) == (704, 256, 64, 8)


@pytest.mark.parametrize('tie', [True, False])
def test_num_params(tie):
    model = Model(tiny_config(tie_embeddings=tie))
    embedding = 64 * 32
    total = sum(p.numel() for p in model.parameters())
    assert model.num_params(non_embedding=False) == total
    assert model.num_params() == total - embedding * (1 if tie else 2) > 0


def test_flops_per_token():
    names = ('fm_dense', 'fm_sparse', 'attn', 'mamba2')
    fm_dense, fm_sparse, attn, mamba2 = (Model(tiny_config(**MIXERS[name])) for name in names)
    for model in (fm_dense, fm_sparse, attn, mamba2):
        assert model.flops_per_token(48) > 6 * model.num_params()
    assert fm_dense.flops_per_token(48) == fm_dense.flops_per_token(4096)  # recurrent: no context term
    assert mamba2.flops_per_token(48) == mamba2.flops_per_token(4096)
    assert attn.flops_per_token(4096) - attn.flops_per_token(48) == 12 * 2 * (4096 - 48) * 32
    assert fm_dense.flops_per_token(48) - fm_sparse.flops_per_token(48) == 3 * 2 * (8 - 3) * (9 * 32 + 5)


def test_estimate_mfu():
    model = Model(tiny_config())
    flops = model.flops_per_token(48)
    assert model.estimate_mfu(1e9, 'NVIDIA H100 80GB HBM3') == pytest.approx(flops * 1e9 / 989e12)
    assert model.estimate_mfu(1e9, 'NVIDIA A100-SXM4-40GB') == pytest.approx(flops * 1e9 / 312e12)
    assert model.estimate_mfu(1e9, 'cpu') == 0.0
    if not torch.cuda.is_available():
        assert model.estimate_mfu(1e9) == 0.0


def test_configure_optimizers_decays_only_matrices():
    model = Model(tiny_config(mixer='mamba2'))
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), 'cpu')
    decay, no_decay = optimizer.param_groups
    assert decay['weight_decay'] == 0.1 and no_decay['weight_decay'] == 0.0
    assert all(p.dim() >= 2 for p in decay['params']) and all(p.dim() < 2 for p in no_decay['params'])
    assert len(decay['params']) + len(no_decay['params']) == len(list(model.parameters()))


# ============================================================================= prepare_data.py

TEXT = "To be, or not to be: that is the question.\n\tCafé — ‘naïve’ 🎭 ends <|endoftext|> here\n"

# documents of the local corpora: ASCII, accents, emoji, CJK, blank lines, a literal special token
DOCUMENTS = [f"Document {i}: {TEXT * (i % 5 + 1)}{'世界' * i}\n\n{'x' * (i * 37 % 101)}" for i in range(40)]


def read_split_documents(folder, tokenizer):
    """The texts of the documents of train.bin and val.bin, decoded through doc_offsets."""
    tok = get_tokenizer(tokenizer)
    skip = 0 if tok.eot is None else 1
    texts = {}
    for split in ("train", "val"):
        tokens = load_tokens(folder / f"{split}.bin", tokenizer, tok.vocab_size)
        if tok.eot is not None:
            assert (tokens.tokens[tokens.doc_offsets] == tok.eot).all()  # each document begins with eot
        texts[split] = [tok.decode(tokens.document(i)[skip:]) for i in range(len(tokens.doc_offsets))]
    return texts


def assert_split_round_trip(folder, tokenizer, documents):
    texts = read_split_documents(folder, tokenizer)
    assert texts["train"] and texts["val"]
    assert sorted(texts["train"] + texts["val"]) == sorted(documents)


# ----------------------------------------------------------------------------- tokenizers

@pytest.mark.parametrize("name, vocab_size, eot", [("bytes", 256, None), ("cl100k_base", 100277, 100257)])
def test_tokenizer_round_trip(name, vocab_size, eot):
    tok = get_tokenizer(name)
    assert (tok.name, tok.vocab_size, tok.eot) == (name, vocab_size, eot)
    ids = tok.encode(TEXT)
    assert all(0 <= i < vocab_size for i in ids) and eot not in ids  # a literal <|endoftext|> is plain text
    assert tok.decode(ids) == TEXT
    assert tok.decode(np.array(ids, dtype=prepare_data.token_dtype(vocab_size))) == TEXT


def test_tokenizer_errors(monkeypatch):
    import tiktoken

    with pytest.raises(ValueError, match="unknown tokenizer 'nope'"):
        get_tokenizer("nope")

    def offline(name):
        raise ConnectionError("no network")

    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    with pytest.raises(RuntimeError, match="internet access.*cl100k_base"):
        prepare_data._load_tiktoken("gpt2")


def test_token_dtype():
    assert [prepare_data.token_dtype(v).itemsize for v in (256, 257, 65536, 65537, 200019)] == [1, 2, 2, 4, 4]


# ----------------------------------------------------------------------------- default corpus

def test_default_corpus_contents():
    works = load_default_corpus()
    titles = [work["title"] for work in works]
    assert len(works) == 49 and len(set(titles)) == 49
    assert len({work["text"] for work in works}) == 49
    assert sum(work["author"] == "Milton, John" for work in works) == 7
    assert not any("gutenberg" in work["text"].lower() or "\r" in work["text"] for work in works)
    assert "Actus primus" not in "".join(titles)  # no First Folio edition
    assert set(prepare_data.VALIDATION_WORKS) <= set(titles)
    lengths = {work["title"]: len(work["text"]) for work in works}
    longest_val = sorted(prepare_data.VALIDATION_WORKS, key=lengths.get)[-len(prepare_data.LONG_WORKS):]
    assert set(prepare_data.LONG_WORKS) == set(longest_val)


@pytest.fixture(scope="module")
def default_bytes(tmp_path_factory):
    return prepare(data_dir=tmp_path_factory.mktemp("data"), num_proc=2)


def test_prepare_default_bytes(default_bytes):
    assert default_bytes.name == "default_bytes"
    works = load_default_corpus()
    title_of = {work["text"]: work["title"] for work in works}
    tok = get_tokenizer("bytes")
    titles = {}
    for split in ("train", "val", "long"):
        tokens = load_tokens(default_bytes / f"{split}.bin", "bytes", 256)
        assert tokens.tokens.dtype == np.uint8 and isinstance(tokens.tokens, np.memmap)
        titles[split] = [title_of[tok.decode(tokens.document(i))] for i in range(len(tokens.doc_offsets))]
        assert len(tokens) == sum(len(w["text"].encode()) for w in works if w["title"] in titles[split])
    assert not set(titles["train"]) & set(titles["val"])
    assert sorted(titles["train"] + titles["val"]) == sorted(w["title"] for w in works)
    assert sorted(titles["val"]) == sorted(prepare_data.VALIDATION_WORKS)
    assert sorted(titles["long"]) == sorted(prepare_data.LONG_WORKS)
    meta = json.loads((default_bytes / "meta.json").read_text())
    train, val = meta["files"]["train.bin"]["tokens"], meta["files"]["val.bin"]["tokens"]
    assert train > 5_000_000 and 0.1 < val / (train + val) < 0.2
    assert not [path for path in default_bytes.iterdir() if "tmp" in path.name]


def flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))


def test_prepare_is_idempotent_and_repairs(default_bytes, capsys):
    """A token file that is cut short or changed is named as it is rebuilt."""
    mtime = (default_bytes / "train.bin").stat().st_mtime_ns
    assert prepare(data_dir=default_bytes.parent) == default_bytes
    assert "already prepared" in capsys.readouterr().out
    assert (default_bytes / "train.bin").stat().st_mtime_ns == mtime
    with open(default_bytes / "long.bin", "r+b") as f:
        f.truncate(1000)
    prepare(data_dir=default_bytes.parent, num_proc=2)
    out, err = capsys.readouterr()
    assert "wrote" in out
    assert re.search(r"default_bytes/long.bin is truncated \(1000 bytes, its header says [0-9]+\): rebuilding it from "
                     r"the embedded corpus\n", err)
    assert len(load_tokens(default_bytes / "long.bin").doc_offsets) == len(prepare_data.LONG_WORKS)
    flip_byte(default_bytes / "val.bin", 5000)  # changed in place: the same size, caught by the checksum
    prepare(data_dir=default_bytes.parent, num_proc=2)
    out, err = capsys.readouterr()
    assert "wrote" in out
    assert (f"{default_bytes / 'val.bin'} is corrupt (its contents do not match the checksum in its header: the file "
            "was changed or damaged after prepare_data.py wrote it): rebuilding it from the embedded corpus\n") in err
    load_tokens(default_bytes / "val.bin", verify=True)


def test_the_default_corpus_notes_the_arguments_it_ignores(default_bytes, capsys):
    prepare_data.main(["--data_dir", str(default_bytes.parent), "--val_fraction", "0.1", "--max_docs", "5",
                       "--text_field", "text"])  # the default --text_field: no note
    out, err = capsys.readouterr()
    assert "already prepared" in out
    assert err == ("note: --val_fraction, --max_docs do not apply to the default corpus (a fixed set of works, split "
                   "by work): ignored\n")


# ----------------------------------------------------------------------------- refusals

@pytest.fixture
def token_file(tmp_path):
    folder = tmp_path / "default_bytes"
    folder.mkdir()
    with prepare_data._TokenWriter(folder / "train.bin", get_tokenizer("bytes")) as writer:
        writer.add(np.frombuffer(b"hello", dtype=np.uint8))
        writer.add(np.frombuffer(b"world!", dtype=np.uint8))
    return folder / "train.bin"


def test_load_tokens_reads_header_offsets_and_tokens(token_file):
    tokens = load_tokens(token_file, "bytes", 256)
    assert (tokens.tokenizer, tokens.vocab_size, len(tokens)) == ("bytes", 256, 11)
    assert tokens.doc_offsets.tolist() == [0, 5]
    assert bytes(tokens.document(-1)) == b"world!" and bytes(tokens.tokens) == b"helloworld!"


RERUN = "python prepare_data.py --dataset default --tokenizer bytes"


def corrupt(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.mark.parametrize("damage, message", [
    (lambda p: os.truncate(p, p.stat().st_size - 1), "truncated"),
    (lambda p: os.truncate(p, 10), "truncated"),
    (lambda p: corrupt(p, 0, b"NOTTOKEN"), "bad magic"),
    (lambda p: corrupt(p, 8, (7).to_bytes(2, "little")), "format version 7"),
    (lambda p: corrupt(p, 10, (3).to_bytes(2, "little")), "corrupt"),
    (lambda p: corrupt(p, HEADER.size, (3).to_bytes(8, "little")), "invalid document offsets"),
    (lambda p: open(p, "ab").write(b"\0"), "corrupt"),
])
def test_load_tokens_refuses_damaged_files(token_file, damage, message):
    damage(token_file)
    with pytest.raises(ValueError, match=message) as error:
        load_tokens(token_file, "bytes", 256)
    assert RERUN in str(error.value)


def test_checksum_catches_changes_of_the_same_size(token_file):
    size, original = token_file.stat().st_size, token_file.read_bytes()
    for offset, data in ((size - 1, b"?"), (HEADER.size + 8, (4).to_bytes(8, "little"))):  # a token; offset 5 -> 4
        corrupt(token_file, offset, data)
        assert token_file.stat().st_size == size and len(load_tokens(token_file, "bytes", 256)) == 11  # unchecked
        with pytest.raises(ValueError, match="do not match the checksum in its header") as error:
            load_tokens(token_file, "bytes", 256, verify=True)
        assert RERUN in str(error.value)
        token_file.write_bytes(original)
    assert bytes(load_tokens(token_file, "bytes", 256, verify=True).tokens) == b"helloworld!"


def test_token_files_of_format_1_are_refused_with_the_rebuild_command(token_file):
    import struct

    magic, _, *fields, checksum = HEADER.unpack_from(token_file.read_bytes())
    version_1 = struct.pack("<8sHHIQQ64s", magic, 1, *fields)  # the header without the checksum
    token_file.write_bytes(version_1 + token_file.read_bytes()[HEADER.size:])
    with pytest.raises(ValueError, match=r"format version 1, this code reads version 2 \(it was written by an older "
                                         r"prepare_data.py\)") as error:
        load_tokens(token_file, "bytes", 256)
    assert RERUN in str(error.value)


def test_load_tokens_refuses_mismatch_and_missing(token_file):
    with pytest.raises(ValueError, match="not of the expected tokenizer 'cl100k_base'") as error:
        load_tokens(token_file, "cl100k_base")
    assert "--dataset default --tokenizer cl100k_base" in str(error.value)
    with pytest.raises(ValueError, match="vocabulary size 256, not the expected 512"):
        load_tokens(token_file, vocab_size=512)
    with pytest.raises(FileNotFoundError, match=RERUN):
        load_tokens(token_file.with_name("val.bin"), "bytes")


@pytest.mark.parametrize("args, message", [
    (["--val_fraction", "1.5"],  # refused for the default corpus too, which ignores it
     "--val_fraction 1.5 is out of range: give a fraction of the documents between 0 and 1 (exclusive), e.g. 0.01"),
    (["--dataset", "corpus", "--val_fraction", "0"], "--val_fraction 0.0 is out of range"),
    (["--dataset", "corpus", "--max_docs", "0"],
     "--max_docs 0 is out of range: give at least 1 (or leave it out: every document)"),
    (["--num_proc", "-1"], "--num_proc -1 is out of range: give at least 1 (or leave it out: all CPUs)"),
    (["--data_dir", "notes.txt"], "notes.txt is a file, not a folder, so notes.txt/default_bytes cannot be written: "
                                  "move it away or pass another --data_dir"),
    (["--dataset", "nowhere"], "no corpus at nowhere: pass --dataset default, hf:NAME, or a .txt/.jsonl/.parquet"),
])
def test_bad_arguments_get_one_line_before_anything_is_written(tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("not a folder")
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text(TEXT)
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(SystemExit) as exit:
        prepare_data.main(["--data_dir", "data", *args])
    assert exit.value.code.startswith(f"error: {message}") and "\n" not in exit.value.code
    assert sorted(tmp_path.rglob("*")) == before


def test_interrupted_write_leaves_nothing(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        with prepare_data._TokenWriter(tmp_path / "train.bin", get_tokenizer("bytes")) as writer:
            writer.add(np.zeros(10, dtype=np.uint8))
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- user corpora

def test_txt_directory_corpus(tmp_path):
    corpus = tmp_path / "texts"
    (corpus / "more").mkdir(parents=True)
    for i, text in enumerate(DOCUMENTS):
        (corpus / ("more" if i % 2 else "") / f"{i:02d}.txt").write_text(text, encoding="utf-8")
    (corpus / "empty.txt").write_text("")  # skipped: no tokens
    (corpus / "notes.md").write_text("not a document")
    folder = prepare(str(corpus), "bytes", tmp_path / "data", val_fraction=0.25, num_proc=2)
    assert folder == tmp_path / "data" / "texts_bytes"
    assert_split_round_trip(folder, "bytes", DOCUMENTS)
    first = {name: (folder / name).read_bytes() for name in ("train.bin", "val.bin")}
    prepare(str(corpus), "bytes", tmp_path / "other", val_fraction=0.25, num_proc=1)  # split and files deterministic
    assert all((tmp_path / "other" / "texts_bytes" / name).read_bytes() == data for name, data in first.items())


def test_lone_txt_file_is_cut_into_documents(tmp_path):
    lines = [f"line {i}: to be, or not to be 🎭\n" for i in range(3000)]
    (tmp_path / "input.txt").write_text("".join(lines), encoding="utf-8")
    folder = prepare(str(tmp_path / "input.txt"), "bytes", tmp_path / "data", val_fraction=0.1, num_proc=1)
    train_docs, val_docs = (load_tokens(folder / name) for name in ("train.bin", "val.bin"))
    assert len(train_docs.doc_offsets) + len(val_docs.doc_offsets) == 3000 // prepare_data.TXT_PIECE
    assert len(val_docs) > 0 and len(train_docs) + len(val_docs) == len("".join(lines).encode("utf-8"))


def test_jsonl_corpus_cl100k(tmp_path, capsys):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"id": i, "content": text}) + "\n" for i, text in enumerate(DOCUMENTS)))
    prepare_data.main(["--dataset", str(path), "--tokenizer", "cl100k_base", "--data_dir", str(tmp_path),
                       "--text_field", "content", "--val_fraction", "0.25", "--num_proc", "2"])
    out = capsys.readouterr().out
    assert "wrote" in out and "train.bin" in out and "val.bin" in out
    folder = tmp_path / "docs_cl100k_base"
    assert load_tokens(folder / "train.bin").tokens.dtype == np.uint32
    assert_split_round_trip(folder, "cl100k_base", DOCUMENTS)
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["files"]["train.bin"]["documents"] + meta["files"]["val.bin"]["documents"] == len(DOCUMENTS)
    prepare(str(path), "cl100k_base", tmp_path, text_field="content", val_fraction=0.25, max_docs=10)
    assert sum(len(docs) for docs in read_split_documents(folder, "cl100k_base").values()) == 10


def test_a_damaged_token_file_is_rebuilt_from_its_corpus(tmp_path, capsys):
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in DOCUMENTS))
    folder = prepare(str(corpus), "bytes", tmp_path / "data", val_fraction=0.25, num_proc=1)
    flip_byte(folder / "train.bin", (folder / "train.bin").stat().st_size - 1)
    prepare(str(corpus), "bytes", tmp_path / "data", val_fraction=0.25, num_proc=1)
    assert (f"{folder / 'train.bin'} is corrupt (its contents do not match the checksum in its header: the file was "
            f"changed or damaged after prepare_data.py wrote it): rebuilding it from {corpus.resolve()}\n"
            ) in capsys.readouterr().err
    load_tokens(folder / "train.bin", verify=True)
    assert_split_round_trip(folder, "bytes", DOCUMENTS)


def disk_full(*args):
    raise OSError(errno.ENOSPC, "No space left on device")


class FullStagingFile:
    """A _TokenWriter's staging file on a full disk: writes fail, and so does the flush on closing."""
    write = disk_full

    def __init__(self, file):
        self.file = file

    def close(self):
        self.file.close()
        disk_full()

    @staticmethod
    def enter(writer):
        writer.file = FullStagingFile(open(writer.staging, "wb"))
        return writer


@pytest.mark.parametrize("where", ["staging file", "token file"])
def test_a_full_disk_leaves_nothing_and_says_so(tmp_path, monkeypatch, where):
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in DOCUMENTS))
    if where == "staging file":
        monkeypatch.setattr(prepare_data._TokenWriter, "__enter__", FullStagingFile.enter)
    else:  # the header and offsets are in, the tokens do not fit
        monkeypatch.setattr(prepare_data.shutil, "copyfileobj", lambda source, destination, length: disk_full())
    with pytest.raises(SystemExit) as exit:
        prepare_data.main(["--dataset", str(corpus), "--data_dir", str(tmp_path / "data"), "--val_fraction", "0.25",
                           "--num_proc", "1"])
    assert re.fullmatch(r"error: could not write the token files: the disk is full \([0-9,.]+ MB free in "
                        rf"{re.escape(str(tmp_path / 'data' / 'docs_bytes'))}\): free some space and run again",
                        exit.value.code)
    assert os.listdir(tmp_path / "data") == []  # no token file, temporary file or empty folder


def test_an_empty_data_dir_is_the_repository_data_folder(tmp_path, monkeypatch):
    """So train.py and eval.py, whose default is '', read where prepare_data.py writes, from any folder."""
    assert prepare_data.dataset_dir("default", "bytes", "") == prepare_data.DEFAULT_DATA_DIR / "default_bytes"
    assert prepare_data.dataset_dir("default", "bytes", None) == prepare_data.DEFAULT_DATA_DIR / "default_bytes"
    monkeypatch.setattr(prepare_data, "DEFAULT_DATA_DIR", tmp_path / "repository" / "data")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in DOCUMENTS))
    folder = prepare("docs.jsonl", "bytes", "", val_fraction=0.25, num_proc=1)
    assert folder == tmp_path / "repository" / "data" / "docs_bytes" and (folder / "meta.json").exists()


def test_corpus_errors(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"content": "hello"}) + "\n")
    with pytest.raises(ValueError, match="no field 'text'.*--text_field"):
        prepare(str(path), "bytes", tmp_path, num_proc=1)
    with pytest.raises(ValueError, match="no documents for val"):
        prepare(str(path), "bytes", tmp_path, text_field="content", val_fraction=1e-9, num_proc=1)
    with pytest.raises(FileNotFoundError, match="no corpus at"):
        prepare(str(tmp_path / "missing"), "bytes", tmp_path)
    assert not (tmp_path / "docs_bytes").exists()  # nothing half-written, no empty folder


@pytest.mark.parametrize("name, content, message", [
    ("docs.jsonl", b'{"text": "fine"}\n{text: "fine"}\n', r"docs.jsonl, line 2, is not JSON \(Expecting property "
                                                         r"name enclosed in double quotes at column 2\)"),
    ("docs.jsonl", b'{"text": "fine"}\n\n{"text": 5}\n', r"docs.jsonl, line 3, has a 'text' that is not a string "
                                                       r"\(int: 5\): fix that record"),
    ("docs.jsonl", b'["a", "list"]\n', r"docs.jsonl, line 1, is a JSON list, not an object"),
    ("docs.jsonl", b'{"text": "caf\xe9"}\n', r"docs.jsonl, line 1, is not UTF-8 \(byte 0xe9 at column 14\)"),
    ("noise.txt", np.random.default_rng(0).bytes(4096), r"noise.txt is not UTF-8 text \(byte [0-9]+ of 4,096 is 0x"),
], ids=["not JSON", "text not a string", "not an object", "line not UTF-8", "random bytes"])
def test_bad_corpus_records_are_named(tmp_path, name, content, message):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ValueError, match=message):
        prepare(str(tmp_path / name), "bytes", tmp_path / "data", num_proc=1)


def test_parquet_corpus(tmp_path):
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet

    path = tmp_path / "docs.parquet"
    pyarrow.parquet.write_table(pyarrow.table({"text": DOCUMENTS}), path, row_group_size=7)
    folder = prepare(str(path), "bytes", tmp_path, val_fraction=0.25, num_proc=2)
    assert_split_round_trip(folder, "bytes", DOCUMENTS)


def test_hf_dataset(tmp_path):
    pytest.importorskip("datasets")
    corpus = tmp_path / "hub_like"
    corpus.mkdir()
    (corpus / "train.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in DOCUMENTS))
    folder = prepare(f"hf:{corpus}", "bytes", tmp_path / "data", val_fraction=0.25, num_proc=2)  # a local folder
    assert folder.name.startswith("hf_") and folder.name.endswith("hub_like_bytes")
    assert_split_round_trip(folder, "bytes", DOCUMENTS)


# ============================================================================= train.py, sample.py, config/

REPO = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope='module')
def data_dir(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp('data')
    prepare(dataset='default', tokenizer='bytes', data_dir=str(data_dir))
    return str(data_dir)


def tiny(data_dir, out_dir, *extra):
    """Arguments for a tiny FM model that trains in about 20 ms a step."""
    return [f'--data_dir={data_dir}', f'--out_dir={out_dir}', '--n_layer=2', '--d_model=32', '--n_memory=8',
            '--top_k=2', '--chunk_size=16', '--block_size=48', '--batch_size=4', '--eval_iters=2',
            '--eval_interval=4', '--log_interval=1', '--warmup_iters=1', '--learning_rate=1e-2', '--min_lr=1e-3',
            *extra]


@pytest.fixture(scope='module')
def trained(data_dir, tmp_path_factory):
    """out_dir of a tiny model trained for 8 steps, and its history."""
    out_dir = str(tmp_path_factory.mktemp('out'))
    history = train.main(tiny(data_dir, out_dir, '--max_iters=8', '--lr_decay_iters=8'))
    return out_dir, history


# ----------------------------------------------------------------------------- configuration

def defaults():
    return train.default_config(), optional_types(ModelConfig)


def test_overrides_parse_to_the_default_types():
    config, types = defaults()
    c = load_config(config, ['--batch_size=3', '--learning_rate=1', '--compile=True', '--wandb_log=false',
                             '--mixer=attn', '--out_dir="my out"', '--top_k=None', '--d_ff=512', '--tau=0.5'], types)
    assert c['batch_size'] == 3 and c['learning_rate'] == 1.0 and isinstance(c['learning_rate'], float)
    assert c['compile'] is True and c['wandb_log'] is False
    assert c['mixer'] == 'attn' and c['out_dir'] == 'my out'
    assert c['top_k'] is None and c['d_ff'] == 512 and c['tau'] == 0.5
    assert config['batch_size'] == 16  # the defaults are left alone
    assert set(f.name for f in fields(ModelConfig)) - {'vocab_size'} <= set(config)  # every model field


@pytest.mark.parametrize('arg, message', [
    ('--batch_size=2.5', "bad value for 'batch_size'"),
    ('--batch_size=x', "bad value for 'batch_size'"),
    ('--compile=1', "bad value for 'compile'"),  # bools take True/False only
    ('--n_layer=True', "bad value for 'n_layer'"),
    ('--learning_rate=fast', "bad value for 'learning_rate'"),
    ('--top_k=2.0', "bad value for 'top_k'"),
    ('--batch_size', 'expected --key=value'),
    ('--batch_sise=4', "unknown config key 'batch_sise'. Did you mean batch_size"),
    ('--max_iter=5', "unknown config key 'max_iter'. Did you mean max_iters"),
    ('--learningrate=0.1', "unknown config key 'learningrate'. Did you mean learning_rate?"),
    ('config/nothing_here.py', 'config file not found: config/nothing_here.py (see config/, e.g. config/fm_small.py)'),
    ('config/fm_smal.py', 'config file not found: config/fm_smal.py (see config/, e.g. config/fm_small.py)'),
    ('max_iters=5', 'max_iters=5 is not a config file: did you mean --max_iters=5?'),
    ('max_iterz=5', 'config file not found: max_iterz=5 (see config/'),  # not a key: no --
])
def test_bad_overrides_are_refused(arg, message, monkeypatch):
    monkeypatch.chdir(REPO)  # the suggested config file is named from here
    config, types = defaults()
    with pytest.raises(ConfigError) as error:
        load_config(config, [arg], types)
    assert str(error.value).startswith(message)


@pytest.mark.parametrize('program', ['sample.py', 'eval.py'])
def test_scripts_without_config_files_say_what_to_pass(program, tmp_path):
    """A training config, a setting without its '--' and any other file are each named for what they are."""
    fm_small, prompt = os.path.join(REPO, 'config', 'fm_small.py'), tmp_path / 'prompt.txt'
    prompt.write_text('ROMEO:')
    settings = sample._DEFAULTS if program == 'sample.py' else evaluation.POSITION_SETTINGS
    for arg, message in (
            (fm_small, f"{fm_small} is a training config; {program} reads the model from a checkpoint: pass "
                       "--out_dir=out-fm-small, the folder that config's run writes"),
            ('device=cpu', 'device=cpu is not a config file: did you mean --device=cpu?'),
            (str(prompt), f"{program} takes no config files, only --key=value settings (see --help): got '{prompt}'")):
        with pytest.raises(ConfigError) as error:
            load_config(settings, [arg], config_files=False, program=program)
        assert str(error.value) == message


@pytest.mark.parametrize('script', ['sample', 'eval'])
def test_sample_and_eval_name_a_training_config(script):
    fm_small = os.path.join(REPO, 'config', 'fm_small.py')
    with pytest.raises(ConfigError, match=f'fm_small.py is a training config; {script}.py reads the model from a '
                                          'checkpoint: pass --out_dir=out-fm-small'):
        {'sample': sample, 'eval': evaluation}[script].main([fm_small])


def test_help_explains_the_settings(capsys):
    train.main(['--help'])
    sample.main(['--help'])
    evaluation.main(['harness', '--help'])
    out = capsys.readouterr().out
    for setting, explanation in (('--eval_iters=16', 'the validation set is eval_iters * batch_size fixed windows'),
                                 ('--fm_eps=1e-06', "[fm] epsilon of the memory rows' RMS norm"),  # model.py's
                                 ('--num_samples=3', 'generated together, as one batch'),
                                 ("--tasks=''", 'lm-eval task names, comma-separated')):
        assert re.search(rf'^  {re.escape(setting)} +{re.escape(explanation)}$', out, re.M), setting


@pytest.mark.parametrize('settings, sources', [
    pytest.param(train.default_config(), ('train.py', 'model.py'), id='train'),
    pytest.param(sample._DEFAULTS, ('sample.py',), id='sample'),
    *[pytest.param(getattr(evaluation, name), ('eval.py',), id=f'eval {name}')
      for name in ('POSITION_SETTINGS', 'HARNESS_SETTINGS', 'ROUTING_SETTINGS')],
    *[pytest.param(getattr(analysis, name), ('research/analysis.py',), id=f'analysis {name}')
      for name in ('SCALING_SETTINGS', 'SWEEP_SETTINGS', 'FRONTIER_SETTINGS')],
])
def test_every_setting_has_a_help_line(settings, sources):
    lines = help_text(settings, *(os.path.join(REPO, source) for source in sources)).splitlines()
    assert len(lines) == len(settings)
    assert [key for key, line in zip(settings, lines) if line == f'  --{key}={settings[key]!r}'] == []


def test_help_text_reads_each_key_from_its_comment(tmp_path):
    """The comment of the line that sets the key (a '#' in a string is none), in the first file that has one; of
    several lines setting a key, one that sets it to the default first; a key set under a line `# word` (before a blank
    line) is tagged [word]; explanations in one column."""
    first, second = tmp_path / 'first.py', tmp_path / 'second.py'
    first.write_text("a = '# no comment'\nbb = 2  # bb's\nc = 3  # c, first\nX = dict(\n    c=4,  # c of X\n    a='x')\n")
    second.write_text("class C:\n    a: str = 'y'  # a's, second\n    # fm\n    c: int = 3  # c, second\n\n"
                      "    bb: int = 2  # untagged\n")
    assert help_text({'a': '# no comment', 'bb': 2, 'c': 3}, first, second).splitlines() == [
        "  --a='# no comment'  a's, second",
        "  --bb=2              bb's",
        "  --c=3               c, first"]
    assert help_text({'c': 4, 'a': 'x'}, first).splitlines() == ["  --c=4    c of X", "  --a='x'"]
    assert help_text({'c': 3, 'bb': 2}, second).splitlines() == ["  --c=3   [fm] c, second", "  --bb=2  untagged"]


def test_config_files(tmp_path):
    config, types = defaults()
    good = tmp_path / 'good.py'
    good.write_text('import math\n_helper = 3\nmax_iters = 2 * warmup_iters\nd_model = 64\ntop_k = None\n')
    c = load_config(config, [str(good), '--d_model=96'], types)  # later arguments win
    assert c['max_iters'] == 2 * config['warmup_iters'] and c['d_model'] == 96 and c['top_k'] is None
    bad = tmp_path / 'bad.py'
    bad.write_text('n_layers = 4\n')
    with pytest.raises(ConfigError, match="bad.py: unknown config key 'n_layers'. Did you mean n_layer"):
        load_config(config, [str(bad)], types)
    bad.write_text('batch_size = "16"\n')
    with pytest.raises(ConfigError, match="bad value for 'batch_size'"):
        load_config(config, [str(bad)], types)


def build(path, meta=False):
    config, types = defaults()
    c = load_config(config, [path], types)
    model_args = {f.name: c[f.name] for f in fields(ModelConfig) if f.name in c}
    vocab = 100288 if c['tokenizer'] == 'cl100k_base' else 256  # cl100k_base's 100,277 padded to a multiple of 64
    with torch.device('meta' if meta else 'cpu'):
        return Model(ModelConfig(**model_args, vocab_size=vocab))


def test_every_config_builds():
    paths = sorted(glob.glob(os.path.join(REPO, 'config', '*.py')))
    assert len(paths) >= 6
    paths += glob.glob(os.path.join(REPO, 'research', 'extrapolation_*.py'))  # the reproduction's configs
    paths.append(os.path.join(REPO, 'research', 'scaling_fm.py'))
    for path in paths:
        build(path, meta=True)


@pytest.mark.parametrize('size', ['1b', 'small'])
def test_baselines_match_fm_in_parameters(size):
    n_fm = build(os.path.join(REPO, 'config', f'fm_{size}.py'), meta=True).num_params(non_embedding=False)
    for mixer in ('transformer', 'mamba2'):
        n = build(os.path.join(REPO, 'config', f'{mixer}_{size}.py'), meta=True).num_params(non_embedding=False)
        assert abs(n / n_fm - 1) < 0.02, (mixer, n, n_fm)


def test_missing_data_and_unknown_tokenizer(data_dir, tmp_path):
    with pytest.raises(train.TrainError, match='no dataset at .*Prepare it with:\n  python prepare_data.py'):
        train.main(tiny(data_dir, tmp_path, f'--dataset={tmp_path / "corpus.txt"}'))
    with pytest.raises(ConfigError, match="unknown tokenizer 'nope'"):  # a setting: refused before anything is written
        train.main(tiny(data_dir, tmp_path, '--tokenizer=nope'))
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize('arg, message', [
    ('--batch_size=0', '--batch_size=0 is out of range: set it to at least 1'),
    ('--gradient_accumulation_steps=0', '--gradient_accumulation_steps=0 is out of range: set it to at least 1'),
    ('--max_iters=-5', '--max_iters=-5 is out of range: set it to at least 1'),
    ('--device=cuda:99', '--device=cuda:99, but '),  # no CUDA here, or fewer GPUs
    ('--device=gpu', "--device=gpu is not a device: use 'cpu', 'cuda', 'cuda:N' or 'mps'"),
    ('--device=cpu:5', '--device=cpu:5, but this machine has 1 cpu device: use --device=cpu'),
    ('--warmup_iters=600', '--warmup_iters=600 is beyond --max_iters=500: the run would end before its learning rate '
                           'peaks; set at most 500'),
    ('--learning_rate=0', '--learning_rate=0.0 is out of range: set it above 0'),
    ('--learning_rate=-1', '--learning_rate=-1.0 is out of range: set it above 0'),
    ('--beta1=1.5', "--beta1=1.5 is out of range: AdamW's beta1 must be at least 0 and below 1 (the default is 0.9)"),
    ('--beta2=1', "--beta2=1.0 is out of range: AdamW's beta2 must be at least 0 and below 1"),
    ('--min_lr=-1', '--min_lr=-1.0 is out of range: set it to at least 0'),
    ('--weight_decay=-1', '--weight_decay=-1.0 is out of range: set it to at least 0'),
    ('--grad_clip=-1', '--grad_clip=-1.0 is out of range: set it to at least 0'),
    ('--out_dir=', '--out_dir is empty: name the folder the checkpoints go to'),
    ('--seed=-1', '--seed=-1 is out of range: set it to at least 0'),
    ('--min_lr=1.0', '--min_lr=1.0 is above --learning_rate=0.01: the cosine decays from learning_rate to min_lr'),
    ('--vocab_multiple=0', '--vocab_multiple=0 is out of range: set it to at least 1'),
    ('--chunk_size=7', 'ModelConfig.chunk_size=7: must be a power of 2'),
    ('--mixer=foo', "ModelConfig.mixer='foo': unknown mixer; use one of fm, attn, mamba2"),
    ('--n_layer=0', 'ModelConfig.n_layer=0: must be positive'),
    ('--fm_conv=-1', 'ModelConfig.fm_conv=-1: must be >= 0'),
    ('--batch_size=100000000', '--batch_size=100000000 x --block_size=48 tokens a micro-batch need more than'),
    ('--data_dir=FILE', 'is a file: give the folder of prepare_data.py'),
    *([] if importlib.util.find_spec('wandb') else [('--wandb_log=True', '--wandb_log=True needs wandb: pip install')]),
])
def test_bad_settings_are_refused(data_dir, tmp_path, arg, message):
    """Each refused before anything is written: no out_dir, no lock file."""
    arg = arg.replace('FILE', str(Path(data_dir) / 'default_bytes' / 'train.bin'))
    out_dir = tmp_path / 'new'
    with pytest.raises(ConfigError) as error:
        train.main([*tiny(data_dir, out_dir), arg])  # after tiny's --data_dir
    assert message in str(error.value)
    assert not out_dir.exists()


def test_a_run_refused_after_claiming_its_folder_leaves_nothing(data_dir, tmp_path):
    """A refusal that only the data can tell (no dataset there) removes the lock file, and the out_dir it made."""
    out_dir = tmp_path / 'new'
    with pytest.raises(train.TrainError, match='no dataset at'):
        train.main(tiny(data_dir, out_dir, f'--dataset={tmp_path / "corpus.txt"}'))
    assert not out_dir.exists()
    out_dir.mkdir()
    with pytest.raises(train.TrainError, match='no dataset at'):
        train.main(tiny(data_dir, out_dir, f'--dataset={tmp_path / "corpus.txt"}'))
    assert out_dir.exists() and not os.listdir(out_dir)  # a folder the user made stays


def test_paper_layer_config_gives_the_papers_layer():
    """config/paper_layer.py after an FM config removes the block: the paper's layer at its own SwiGLU width."""
    for name, paper_params in (('fm_small', 772_232), ('fm_1b', 882_903_072)):
        with_block = build(os.path.join(REPO, 'config', f'{name}.py'), meta=True)
        config, types = defaults()
        files = [os.path.join(REPO, 'config', file) for file in (f'{name}.py', 'paper_layer.py')]
        c = load_config(config, files, types)
        assert (with_block.config.fm_conv, with_block.config.fm_gate) == (4, True)
        assert (c['fm_conv'], c['fm_gate'], c['d_ff']) == (0, False, None)
        vocab = 100288 if c['tokenizer'] == 'cl100k_base' else 256
        with torch.device('meta'):
            paper = Model(ModelConfig(**{f.name: c[f.name] for f in fields(ModelConfig) if f.name in c},
                                      vocab_size=vocab))
        assert paper.num_params(non_embedding=False) == paper_params
        assert abs(with_block.num_params(non_embedding=False) / paper_params - 1) < 0.003


def test_command_line_errors_are_clear():
    run = subprocess.run([sys.executable, 'train.py', '--batch_sise=4'], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 1
    assert "error: unknown config key 'batch_sise'. Did you mean batch_size or" in run.stderr
    assert 'Traceback' not in run.stderr


@pytest.mark.parametrize('script', ['train.py', 'sample.py', 'eval.py'])
def test_ctrl_c_while_starting_is_one_line(script, tmp_path):
    """Ctrl-C before a script's own handling (here while torch loads): one line on stderr, exit code 130."""
    import time
    proc = subprocess.Popen([sys.executable, script, f'--out_dir={tmp_path}', f'--data_dir={tmp_path}'][:3 if script ==
                            'train.py' else 2], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 130 and err == 'interrupted\n', (proc.returncode, err)


# ----------------------------------------------------------------------------- training

def test_lr_schedule():
    cfg = train.SimpleNamespace(learning_rate=1.0, min_lr=0.1, warmup_iters=10, lr_decay_iters=110)
    assert train.get_lr(0, cfg) == pytest.approx(1 / 11)
    assert train.get_lr(10, cfg) == pytest.approx(1.0)
    assert train.get_lr(60, cfg) == pytest.approx(0.55)
    assert train.get_lr(110, cfg) == train.get_lr(1000, cfg) == 0.1


def test_loss_falls(data_dir, tmp_path):
    history = train.main(tiny(data_dir, tmp_path, '--max_iters=40', '--lr_decay_iters=40', '--eval_interval=40',
                              '--batch_size=8', '--block_size=64'))
    (_, first), (_, last) = history['val'][0], history['val'][-1]
    assert first > 5.0 and last < first - 1.5, history['val']
    assert {'ckpt.pt', 'best.pt'} <= set(os.listdir(tmp_path)) and not glob.glob(str(tmp_path / '*.tmp'))


def test_resume_is_exact(data_dir, tmp_path, trained):
    """8 steps straight == 4 steps, save, resume, 4 steps: same losses and weights, bit for bit."""
    straight_dir, straight = trained
    out_dir = str(tmp_path)
    first = train.main(tiny(data_dir, out_dir, '--max_iters=4', '--lr_decay_iters=8'))
    second = train.main(tiny(data_dir, out_dir, '--max_iters=8', '--lr_decay_iters=8', '--init_from=resume'))
    assert first['train'] + second['train'] == straight['train']  # float losses compared exactly
    assert first['val'] + second['val'] == straight['val']
    a = torch.load(os.path.join(straight_dir, 'ckpt.pt'), weights_only=True)
    b = torch.load(os.path.join(out_dir, 'ckpt.pt'), weights_only=True)
    assert a['iter_num'] == b['iter_num'] == 8 and a['best_val_loss'] == b['best_val_loss']
    for name, tensor in a['model'].items():
        assert torch.equal(tensor, b['model'][name]), name
    for i, state in a['optimizer']['state'].items():
        assert all(torch.equal(v, b['optimizer']['state'][i][k]) for k, v in state.items())
    assert a['rng']['batch'] == b['rng']['batch']


def test_resume_in_another_dtype(data_dir, tmp_path):
    """A float32 checkpoint resumes under float16 autocast: its gradient scaler starts fresh (scale 2**16, counting
    steps from the resume), and a float16 checkpoint resumes with the scaler it saved."""
    out_dir = str(tmp_path)

    def scaler():
        return torch.load(tmp_path / 'ckpt.pt', weights_only=True)['scaler']

    train.main(tiny(data_dir, out_dir, '--max_iters=2', '--dtype=float32'))
    assert scaler() == {}  # a disabled scaler has no state
    history = train.main(tiny(data_dir, out_dir, '--max_iters=4', '--dtype=float16', '--init_from=resume'))
    assert len(history['train']) == 2 and all(math.isfinite(loss) for _, loss in history['train'])
    assert scaler()['scale'] == 2.0 ** 16 and scaler()['_growth_tracker'] == 2  # fresh: two steps, no overflow
    train.main(tiny(data_dir, out_dir, '--max_iters=5', '--dtype=float16', '--init_from=resume'))
    assert scaler()['scale'] == 2.0 ** 16 and scaler()['_growth_tracker'] == 3  # went on from the saved 2


def test_resume_with_gradient_accumulation_is_exact(data_dir, tmp_path):
    args = ['--gradient_accumulation_steps=2', '--lr_decay_iters=6', '--eval_interval=3']
    straight = train.main(tiny(data_dir, tmp_path / 'a', '--max_iters=6', *args))
    first = train.main(tiny(data_dir, tmp_path / 'b', '--max_iters=3', *args))
    second = train.main(tiny(data_dir, tmp_path / 'b', '--max_iters=6', '--init_from=resume', *args))
    assert first['train'] + second['train'] == straight['train']


def copy_run(trained, out_dir, names=('ckpt.pt', 'best.pt')):
    """Copy the checkpoints of the trained fixture into out_dir, to resume or damage them there."""
    os.makedirs(out_dir, exist_ok=True)
    for name in names:
        with open(os.path.join(trained[0], name), 'rb') as f, open(os.path.join(out_dir, name), 'wb') as g:
            g.write(f.read())


def test_checkpoint_contents(trained):
    ckpt = torch.load(os.path.join(trained[0], 'ckpt.pt'), weights_only=True)
    assert set(checkpoint.CKPT_KEYS) <= set(ckpt)
    assert ckpt['tokenizer'] == 'bytes' and ckpt['model_config']['d_model'] == 32
    assert ckpt['train_config']['max_iters'] == 8
    assert {'python', 'numpy', 'torch', 'cuda', 'batch'} <= set(ckpt['rng'])
    assert not any(k.startswith(('_orig_mod.', 'module.')) for k in ckpt['model'])
    best = torch.load(os.path.join(trained[0], 'best.pt'), weights_only=True)
    assert best['best_val_loss'] == min(v for i, v in trained[1]['val'] if i > 0)
    ckpt_path, best_path = (os.path.join(trained[0], name) for name in ('ckpt.pt', 'best.pt'))
    assert os.stat(best_path).st_nlink == 1 and not os.path.samefile(ckpt_path, best_path)  # a file of its own


def test_missing_and_corrupt_checkpoints(data_dir, tmp_path, trained):
    """Each is refused naming what is wrong; best.pt beside a damaged ckpt.pt is suggested only if it loads."""
    args = tiny(data_dir, tmp_path, '--max_iters=10', '--init_from=resume')
    with pytest.raises(checkpoint.CheckpointError, match='no checkpoint at .*ckpt.pt: train one first'):
        train.main(args)
    good = open(os.path.join(trained[0], 'ckpt.pt'), 'rb').read()
    cause = 'is not a readable checkpoint: it is empty, cut short, damaged or not written by torch.save ('
    for damaged in (b'', b'not a checkpoint', good[:len(good) // 2], good[:-10]):
        (tmp_path / 'ckpt.pt').write_bytes(damaged)
        with pytest.raises(checkpoint.CheckpointError) as error:
            train.main(args)
        assert f'ckpt.pt {cause}' in str(error.value)
        assert 'best.pt' not in str(error.value) and 'Start a new run' in str(error.value)
        with pytest.raises(checkpoint.CheckpointError, match=re.escape(cause)):
            sample.main([f'--out_dir={tmp_path}'])
    (tmp_path / 'best.pt').write_bytes(good)
    with pytest.raises(checkpoint.CheckpointError, match=r'cut short, .*best.pt beside it loads \(step 8\): use it'):
        train.main(args)
    (tmp_path / 'best.pt').write_bytes(good[:-10])  # damaged too: not suggested
    with pytest.raises(checkpoint.CheckpointError, match=r'cut short, .*\. Start a new run'):
        train.main(args)
    torch.save({'model': {}}, tmp_path / 'ckpt.pt')
    with pytest.raises(checkpoint.CheckpointError, match='missing optimizer, model_config'):
        train.main(args)


def old_format(state_dict, config):
    """A state dict as model.py wrote it before gate and up (and attention's q, k, v) became one product."""
    head_dim = config.d_model // config.n_head
    parts = {'gate_up_proj': {'gate_proj': config.ffn_dim, 'up_proj': config.ffn_dim},
             'qkv_proj': {'q_proj': config.n_head * head_dim, 'k_proj': config.kv_heads * head_dim,
                          'v_proj': config.kv_heads * head_dim}}
    old = {}
    for name, weight in state_dict.items():
        module, fused = name.rsplit('.', 2)[0], name.split('.')[-2]
        if fused not in parts:
            old[name] = weight
            continue
        for part, piece in zip(parts[fused], weight.split(list(parts[fused].values()))):
            old[f'{module}.{part}.weight'] = piece.clone()
    return old


def test_an_old_checkpoint_layout_is_refused_in_one_line():
    """A checkpoint of the layout before gate and up (and q, k, v) became one product gets a one-line refusal that
    names the weights, not a traceback."""
    config = tiny_config(mixer='attn')
    old = old_format(Model(config).state_dict(), config)
    with pytest.raises(checkpoint.CheckpointError) as error:
        checkpoint.model_from_checkpoint({'model_config': vars(config), 'model': old}, 'old.pt')
    message = str(error.value)
    assert '\n' not in message and message.startswith('old.pt holds a model this model.py cannot build or load (')
    assert 'missing blocks.0.mixer.qkv_proj.weight' in message and 'unexpected blocks.0.mixer.q_proj.weight' in message
    assert 'the version of model.py that wrote it' in message


def test_incompatible_checkpoints(trained, tmp_path):
    ckpt = torch.load(os.path.join(trained[0], 'ckpt.pt'), weights_only=True)
    cases = [({'model_config': {**ckpt['model_config'], 'd_model': 48}}, 'cannot build or load .*size mismatch'),
             ({'model_config': {**ckpt['model_config'], 'n_experts': 2}}, "cannot build or load .*'n_experts'"),
             ({'model': {k: v for k, v in ckpt['model'].items() if 'router' not in k}}, 'cannot build or load .missing'),
             ({'tokenizer': 'no_such_tokenizer'}, "tokenizer 'no_such_tokenizer', which cannot be loaded")]
    for change, message in cases:
        torch.save({**ckpt, **change}, tmp_path / 'ckpt.pt')
        with pytest.raises(checkpoint.CheckpointError, match=message):
            sample.main([f'--out_dir={tmp_path}', '--max_new_tokens=2'])


def ctrl_c_in_first_step(monkeypatch):
    """As if Ctrl-C came during a run's first step: a SIGINT from its first gradient clipping."""
    clip, calls = torch.nn.utils.clip_grad_norm_, []

    def clip_and_interrupt(*args, **kw):
        if not calls:
            calls.append(os.kill(os.getpid(), signal.SIGINT))
        return clip(*args, **kw)
    monkeypatch.setattr(torch.nn.utils, 'clip_grad_norm_', clip_and_interrupt)


def test_a_new_run_keeps_a_trained_out_dir(data_dir, tmp_path, trained, monkeypatch):
    copy_run(trained, tmp_path)
    before = {name: (tmp_path / name).read_bytes() for name in ('ckpt.pt', 'best.pt')}
    with pytest.raises(train.TrainError) as error:
        train.main(tiny(data_dir, tmp_path, '--max_iters=2'))
    assert 'holds ckpt.pt and best.pt of an earlier run' in str(error.value)
    assert all(way in str(error.value) for way in ('--init_from=resume', 'a new --out_dir', '--overwrite=True'))
    assert all((tmp_path / name).read_bytes() == data for name, data in before.items())
    (tmp_path / 'ckpt.pt').unlink()
    with pytest.raises(train.TrainError, match='holds best.pt of an earlier run'):
        train.main(tiny(data_dir, tmp_path, '--max_iters=2'))
    with monkeypatch.context() as patch:  # replaced when the new run first saves, not before
        ctrl_c_in_first_step(patch)
        train.main(tiny(data_dir, tmp_path, '--max_iters=2', '--overwrite=True'))
    assert os.listdir(tmp_path) == ['best.pt'] and (tmp_path / 'best.pt').read_bytes() == before['best.pt']
    train.main(tiny(data_dir, tmp_path, '--max_iters=1', '--overwrite=True'))
    assert torch.load(tmp_path / 'ckpt.pt', weights_only=True)['iter_num'] == 1


def test_one_run_at_a_time_in_an_out_dir(data_dir, tmp_path, monkeypatch, capsys):
    """A run holds out_dir/train.lock: a second run is refused, naming the first; once the first is killed
    (SIGKILL: nothing cleaned up), the next run takes the lock over."""
    import errno

    cmd = [sys.executable, 'train.py', *tiny(data_dir, tmp_path, '--max_iters=100000', '--eval_interval=2')]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:
            if line.startswith('iter 3:'):  # after the checkpoint of step 2
                break
        with pytest.raises(train.TrainError) as error:
            train.main(tiny(data_dir, tmp_path, '--max_iters=100000', '--init_from=resume'))
        assert f'is in use by another training run (process {proc.pid} on ' in str(error.value)
        assert (tmp_path / 'train.lock').read_text().startswith(f'process {proc.pid} on ')  # the holder
    finally:
        proc.kill()
        proc.wait()
    step = torch.load(tmp_path / 'ckpt.pt', weights_only=True)['iter_num']
    history = train.main(tiny(data_dir, tmp_path, f'--max_iters={step + 1}', '--init_from=resume'))
    assert [i for i, _ in history['train']] == [step + 1]
    assert not (tmp_path / 'train.lock').exists()  # released

    def no_locks(file, operation):  # e.g. Lustre mounted without flock
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(train.fcntl, 'flock', no_locks)
    train.main(tiny(data_dir, tmp_path, f'--max_iters={step + 2}', '--init_from=resume'))
    assert 'warning: cannot lock' in capsys.readouterr().out


def test_a_failed_save_keeps_the_last_checkpoint(data_dir, tmp_path, monkeypatch):
    """A disk that fills up during the save of step 4: the partial file is removed, ckpt.pt of step 2 stays, and
    the message says how much space a checkpoint needs; after that, the run resumes."""
    import errno
    import io

    partial = []

    class FullDisk(io.FileIO):
        def write(self, data):
            if self.tell() + memoryview(data).nbytes > 1000:
                partial.append(os.path.getsize(self.name))
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return super().write(data)

    opened = []

    def open_on_a_disk_that_fills(path, mode):  # the saves of step 2 (ckpt.pt, best.pt) fit
        opened.append(path)
        return open(path, mode) if len(opened) <= 2 else FullDisk(path, 'w')

    monkeypatch.setattr(checkpoint, 'open', open_on_a_disk_that_fills, raising=False)
    with pytest.raises(checkpoint.CheckpointError) as error:
        train.main(tiny(data_dir, tmp_path, '--max_iters=4', '--eval_interval=2'))
    message, size = str(error.value), os.path.getsize(tmp_path / 'ckpt.pt')
    assert partial and partial[0] > 0 and sorted(os.listdir(tmp_path)) == ['best.pt', 'ckpt.pt']
    assert f'could not write {tmp_path / "ckpt.pt"}: the disk is full (No space left on device)' in message
    assert f'MB free. {tmp_path / "ckpt.pt"} is unchanged: free some space, then continue with --init_from=resume' \
        in message
    needed = float(message.split('A checkpoint needs about ')[1].split(' MB')[0])
    assert abs(needed - size / 1e6) < 0.1 * size / 1e6 + 0.05, (needed, size)
    assert torch.load(tmp_path / 'ckpt.pt', weights_only=True)['iter_num'] == 2
    monkeypatch.undo()
    train.main(tiny(data_dir, tmp_path, '--max_iters=4', '--eval_interval=2', '--init_from=resume'))
    assert torch.load(tmp_path / 'ckpt.pt', weights_only=True)['iter_num'] == 4

    def denied(path, mode):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)

    monkeypatch.setattr(checkpoint, 'open', denied, raising=False)
    with pytest.raises(checkpoint.CheckpointError, match=r'could not write .*ckpt.pt \(Permission denied\)\. .*ckpt.pt '
                                                         r'is unchanged: make .* writable'):
        checkpoint.save_checkpoint({'x': torch.zeros(3)}, tmp_path / 'ckpt.pt')


def test_resume_keeps_the_model_and_needs_steps_to_go(data_dir, tmp_path, trained):
    """Resume refuses other model settings (naming them) and a max_iters the checkpoint has reached; changed
    training settings are taken, and the saved configs agree."""
    copy_run(trained, tmp_path, ['ckpt.pt'])
    with pytest.raises(train.TrainError) as error:
        train.main(tiny(data_dir, tmp_path, '--max_iters=10', '--init_from=resume', '--n_memory=16', '--top_k=None'))
    assert 'holds a model with n_memory=8, top_k=2; this run asks for n_memory=16, top_k=None' in str(error.value)
    assert 'new --out_dir' in str(error.value)
    with pytest.raises(train.TrainError, match='is at step 8, which --max_iters=8 does not pass: set --max_iters '
                                               'above 8'):
        train.main(tiny(data_dir, tmp_path, '--max_iters=8', '--init_from=resume'))
    train.main(tiny(data_dir, tmp_path, '--max_iters=9', '--init_from=resume', '--learning_rate=5e-3'))
    ckpt = torch.load(tmp_path / 'ckpt.pt', weights_only=True)
    assert ckpt['iter_num'] == 9 and ckpt['train_config']['learning_rate'] == 5e-3
    assert all(ckpt['train_config'][k] == v for k, v in ckpt['model_config'].items() if k != 'vocab_size')


def test_a_resume_on_other_data_starts_the_best_loss_over(tmp_path, trained, monkeypatch, capsys):
    """A validation loss of another validation set does not compare with best.pt's: a resume on another dataset
    starts the best loss over (a note says so), so its next evaluation writes best.pt."""
    copy_run(trained, tmp_path / 'run')
    corpus = tmp_path / 'texts'
    corpus.mkdir()
    for i, text in enumerate(DOCUMENTS):
        (corpus / f'{i:02d}.txt').write_text(text, encoding='utf-8')
    prepare(str(corpus), 'bytes', tmp_path / 'data', val_fraction=0.25, num_proc=1)
    best = torch.load(tmp_path / 'run' / 'best.pt', weights_only=True)['best_val_loss']
    monkeypatch.setattr(train, 'estimate_loss', lambda *args: best + 0.1)  # above the other set's best
    train.main(tiny(tmp_path / 'data', tmp_path / 'run', f'--dataset={corpus}', '--max_iters=12', '--init_from=resume'))
    assert "resume: the validation set is not the checkpoint's" in capsys.readouterr().out
    saved = torch.load(tmp_path / 'run' / 'best.pt', weights_only=True)
    assert saved['iter_num'] == 12 and saved['best_val_loss'] == best + 0.1


def test_changed_token_file_is_refused(tmp_path):
    corpus = tmp_path / 'texts'
    corpus.mkdir()
    for i, text in enumerate(DOCUMENTS):
        (corpus / f'{i:02d}.txt').write_text(text, encoding='utf-8')
    folder = prepare(str(corpus), 'bytes', tmp_path / 'data', val_fraction=0.25, num_proc=1)
    corrupt(folder / 'train.bin', 500, b'?')
    args = tiny(tmp_path / 'data', tmp_path / 'out', f'--dataset={corpus}', '--max_iters=1')
    with pytest.raises(train.TrainError) as error:
        train.main(args)
    assert 'train.bin is corrupt (its contents do not match the checksum' in str(error.value)
    assert f're-run `python prepare_data.py --dataset {corpus} --tokenizer bytes' in str(error.value)
    train.main(args + ['--verify_data=False'])  # the user's call


def test_sample(trained, tmp_path):
    out_dir = trained[0]
    samples = sample.main([f'--out_dir={out_dir}', '--start=ROMEO:', '--num_samples=2', '--max_new_tokens=20'])
    assert len(samples) == 2 and all(s.startswith('ROMEO:') for s in samples)
    (tmp_path / 'prompt.txt').write_text('To be')
    again = sample.main([f'--out_dir={out_dir}', '--ckpt=best.pt', f'--start=FILE:{tmp_path / "prompt.txt"}',
                         '--num_samples=1', '--max_new_tokens=20', '--top_k=5', '--temperature=0.5'])
    assert again[0].startswith('To be')
    run = subprocess.run([sys.executable, 'sample.py', f'--out_dir={out_dir}', '--num_samples=1',
                          '--max_new_tokens=10', '--seed=1', '--start=ROMEO:'], cwd=REPO, capture_output=True,
                         text=True)
    assert run.returncode == 0 and run.stdout.startswith('ROMEO:') and '---------------' in run.stdout, run.stderr
    assert 'tokens/s' in run.stderr


@pytest.mark.parametrize('arg, message', [('--top_k=-2', 'top_k=-2: must be >= 1'), ('--top_p=1.5', 'top_p=1.5'),
                                          ('--temperature=-1', 'temperature=-1'), ('--num_samples=0', 'num_samples'),
                                          ('--device=nope', 'nope'),
                                          ('--top_k=300', r'--top_k=300 is more than the 256 tokens of bytes: give at '
                                                          r'most 256, or None'),
                                          ('--num_samples=100000000', r'need about .* GB of decoding buffers')]
                         + ([] if CUDA else [('--device=cuda', '--device=cuda, but .*: use --device=cpu')]))
def test_sample_refuses_bad_settings(trained, arg, message):
    with pytest.raises(ConfigError, match=message):
        sample.main([f'--out_dir={trained[0]}', arg])


def test_sample_warns_of_a_prompt_past_an_attention_models_context(tmp_path, capsys):
    torch.manual_seed(0)
    out_dir = save_model_checkpoint(Model(tiny_config(vocab_size=256, block_size=8, **MIXERS['attn'])), tmp_path)
    sample.main([f'--out_dir={out_dir}', '--start=' + 'x' * 20, '--max_new_tokens=2', '--num_samples=2'])
    assert ('warning: the prompt is 20 tokens, past the 8 this attention model was trained at (block_size): attention '
            'does not extrapolate past block_size') in capsys.readouterr().err
    sample.main([f'--out_dir={out_dir}', '--start=' + 'x' * 8, '--max_new_tokens=2', '--num_samples=2'])
    assert 'warning' not in capsys.readouterr().err


def test_stream_stops_at_end_of_text(capsys):
    class Letters:  # a tokenizer whose end-of-text is id 0
        eot = 0

        def decode(self, ids):
            return ''.join(chr(ord('A') + i) for i in ids)

    stream = sample.Stream(Letters(), [1])
    for token in (2, 3, 0, 4, 5):  # the row decodes on after its end-of-text until the batch stops
        stream([token])
    assert capsys.readouterr().out == 'BCD'


def test_rope_keeps_float32_angles_in_a_bf16_model():
    """A model cast to bf16 (as sample.py does on a GPU) rotates with float32 angles: at tens of thousands of
    positions bf16 frequencies would be off by radians."""
    torch.manual_seed(0)
    layer = model_module.Attention(tiny_config(mixer='attn', n_head=2))  # head dim 16
    x, positions = torch.randn(1, 3, 32), torch.tensor([[5000, 20000, 60000]])
    want = layer.project(x, positions)
    got = copy.deepcopy(layer).to(torch.bfloat16).project(x.bfloat16(), positions)
    assert all(rel_err(g, w) < 2e-2 for g, w in zip(got, want))


def test_sample_streams_what_it_returns(trained, capsys):
    text = sample.main([f'--out_dir={trained[0]}', '--num_samples=1', '--max_new_tokens=30', '--start=To be'])[0]
    assert capsys.readouterr().out == text + '\n---------------\n'


def test_ctrl_c_saves_the_last_step(data_dir, tmp_path):
    cmd = [sys.executable, 'train.py', *tiny(data_dir, tmp_path, '--max_iters=100000', '--eval_interval=100000')]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:
            if line.startswith('iter 3:'):
                proc.send_signal(signal.SIGINT)
                break
        output = proc.communicate(timeout=120)[0]
    finally:
        proc.kill()
    assert proc.returncode == 0, output
    ckpt = torch.load(tmp_path / 'ckpt.pt', weights_only=True)
    assert ckpt['iter_num'] >= 3 and f'saved {tmp_path / "ckpt.pt"} at step {ckpt["iter_num"]}' in output
    history = train.main(tiny(data_dir, tmp_path, f'--max_iters={ckpt["iter_num"] + 2}', '--init_from=resume'))
    assert [i for i, _ in history['train']] == [ckpt['iter_num'] + 1, ckpt['iter_num'] + 2]


def test_ddp_on_cpu(data_dir, tmp_path):
    """Two gloo processes: 4 steps straight == 2 steps, resume, 2 steps, bit for bit; a scratch run into the
    trained out_dir stops on both ranks with the message, not a traceback."""
    def torchrun(out_dir, *extra, returncode=0):
        cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2', 'train.py',
               *tiny(data_dir, out_dir, '--device=cpu', '--gradient_accumulation_steps=2', '--lr_decay_iters=4',
                     '--eval_interval=2', *extra)]
        run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, 'OMP_NUM_THREADS': '1'})
        assert run.returncode == returncode, run.stdout + run.stderr
        return run
    straight = torchrun(tmp_path / 'a', '--max_iters=4').stdout
    resumed = torchrun(tmp_path / 'b', '--max_iters=2').stdout
    refused = torchrun(tmp_path / 'b', '--max_iters=4', returncode=1).stderr
    assert refused.count('error: ') == 2 and '--overwrite=True' in refused and '[rank' not in refused
    diverged = torchrun(tmp_path / 'b', '--max_iters=4', '--overwrite=True', '--learning_rate=1e6',
                        '--eval_interval=100', returncode=1).stderr  # every rank knows the earlier run it keeps
    errors = [line for line in diverged.splitlines() if line.startswith('error: ')]
    assert len(errors) == 2 and all("the earlier run's ckpt.pt and best.pt in" in line for line in errors), diverged
    resumed += torchrun(tmp_path / 'b', '--max_iters=4', '--init_from=resume').stdout
    logged = [[line.split(',')[0] for line in out.splitlines() if line.startswith(('iter', 'step'))]
              for out in (straight, resumed)]
    assert logged[0] == logged[1] and len(logged[0]) == 4 + 3
    a, b = (torch.load(tmp_path / run / 'ckpt.pt', weights_only=True) for run in 'ab')
    assert a['data_state']['world_size'] == 2 and len(a['rng']['batch']) == 2
    assert a['rng']['batch'][0] != a['rng']['batch'][1] and a['rng']['batch'] == b['rng']['batch']
    assert a['best_val_loss'] == b['best_val_loss']  # float, exactly
    for name, tensor in a['model'].items():
        assert torch.equal(tensor, b['model'][name]), name
    for i, state in a['optimizer']['state'].items():
        assert all(torch.equal(v, b['optimizer']['state'][i][k]) for k, v in state.items())



# ----------------------------------------------------------------------------- nothing lost: damage, divergence,
# overwrite, bad inputs, leftovers, the README's commands

def flip_a_bit(path, tensor):
    """Flip an exponent bit of the first element of tensor where its bytes lie in the file at path."""
    data = bytearray(path.read_bytes())
    at = data.find(tensor.contiguous().numpy().tobytes())
    assert at > 0
    data[at + 3] ^= 0x40
    path.write_bytes(data)


def test_damaged_checkpoints_are_refused(data_dir, tmp_path, trained, capsys):
    """A flipped bit in the optimizer state or the weights fails the checksum on every load (train.py, sample.py,
    eval.py), best.pt is offered only while it is sound; NaN weights and a folder are refused too."""
    copy_run(trained, tmp_path)
    ckpt = torch.load(tmp_path / 'ckpt.pt', weights_only=True)
    flip_a_bit(tmp_path / 'ckpt.pt', ckpt['optimizer']['state'][0]['exp_avg_sq'])
    with pytest.raises(checkpoint.CheckpointError) as error:
        train.main(tiny(data_dir, tmp_path, '--max_iters=10', '--init_from=resume'))
    assert 'ckpt.pt is damaged: the bytes of its record archive/data/' in str(error.value)
    assert 'do not match the checksum saved with them' in str(error.value)
    assert 'best.pt beside it loads (step 8)' in str(error.value)
    with pytest.raises(checkpoint.CheckpointError, match='ckpt.pt is damaged'):
        sample.main([f'--out_dir={tmp_path}', '--max_new_tokens=2'])
    with pytest.raises(checkpoint.CheckpointError, match='ckpt.pt is damaged'):
        evaluation.main([f'--out_dir={tmp_path}', f'--out={tmp_path / "eval"}'])
    flip_a_bit(tmp_path / 'best.pt', ckpt['model']['embed.weight'])
    with pytest.raises(checkpoint.CheckpointError, match=r'best.pt is damaged.*\. Start a new run'):
        sample.main([f'--out_dir={tmp_path}', '--ckpt=best.pt', '--max_new_tokens=2'])
    torch.save({**ckpt, 'model': {**ckpt['model'], 'embed.weight': ckpt['model']['embed.weight'] * math.nan}},
               tmp_path / 'ckpt.pt')
    with pytest.raises(checkpoint.CheckpointError, match=r'holds weights that are not finite \(NaN or infinity in '
                                                         r'embed.weight\): it was saved by a run that diverged'):
        sample.main([f'--out_dir={tmp_path}', '--max_new_tokens=2'])
    with pytest.raises(checkpoint.CheckpointError, match='is a folder, not a checkpoint file: give the folder as '):
        sample.main([f'--ckpt={tmp_path}'])
    assert checkpoint.load_checkpoint(os.path.join(trained[0], 'ckpt.pt'))['iter_num'] == 8  # sound: no note
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(ckpt, tmp_path / 'ckpt.pt')
    finally:
        torch.serialization.set_crc32_options(True)
    capsys.readouterr()
    assert checkpoint.load_checkpoint(tmp_path / 'ckpt.pt')['iter_num'] == 8
    assert 'ckpt.pt carries no checksums' in capsys.readouterr().err



def test_advice_points_at_what_helps(tmp_path, trained):
    """A damaged best.pt beside a sound ckpt.pt is told to use ckpt.pt, not to start over; a --ckpt that names no
    checkpoint of a run is not told to overwrite its folder; a corpus of one document is told to add documents, which
    --val_fraction cannot replace."""
    copy_run(trained, tmp_path)
    flip_a_bit(tmp_path / 'best.pt', torch.load(tmp_path / 'best.pt', weights_only=True)['model']['embed.weight'])
    with pytest.raises(checkpoint.CheckpointError) as error:
        sample.main([f'--out_dir={tmp_path}', '--ckpt=best.pt', '--max_new_tokens=2'])
    assert f'{tmp_path / "ckpt.pt"} beside it loads (step 8): use it instead (--ckpt=ckpt.pt)' in str(error.value)
    assert 'new run' not in str(error.value)
    (tmp_path / 'notes.txt').write_text('not a checkpoint')
    with pytest.raises(checkpoint.CheckpointError) as error:
        sample.main([f'--ckpt={tmp_path / "notes.txt"}'])
    assert str(error.value).endswith('. Give --ckpt a checkpoint that train.py wrote (ckpt.pt or best.pt)')
    (tmp_path / 'one.jsonl').write_text(json.dumps({'text': 'a lone document'}) + '\n')
    with pytest.raises(ValueError) as error:
        prepare(str(tmp_path / 'one.jsonl'), 'bytes', tmp_path / 'data', val_fraction=0.5, num_proc=1)
    assert 'add documents: train and val take whole documents, two at least' in str(error.value)
    assert 'val_fraction' not in str(error.value)


def test_a_checkpoint_with_any_byte_changed_is_refused(tmp_path):
    """A byte changed anywhere (the zip index at the end included) gets the damaged or not-readable message, never a
    traceback; or, where no reader looks (the records' local headers repeat the index; alignment padding), the file
    loads with the same contents. A changed key is damage, not a key missing."""
    weights = {'embed.weight': torch.arange(32.0).view(8, 4), 'norm.weight': torch.ones(4)}
    path = tmp_path / 'ckpt.pt'
    checkpoint.save_checkpoint({**dict.fromkeys(checkpoint.CKPT_KEYS), 'model': weights, 'iter_num': 3}, path)
    good = path.read_bytes()
    start = len(good) - 100
    positions, refused = [*range(0, start, start // 40), *range(start, len(good))], 0
    for at in positions:
        path.write_bytes(good[:at] + bytes([good[at] ^ 0xff]) + good[at + 1:])
        try:
            ckpt = checkpoint.load_checkpoint(path)
        except checkpoint.CheckpointError as e:
            assert re.match(rf'{re.escape(str(path))} (is damaged|is not a readable checkpoint): ', str(e)), (at, e)
            assert '\n' not in str(e)
            refused += 1
        else:
            assert ckpt['iter_num'] == 3 and all(torch.equal(ckpt['model'][k], w) for k, w in weights.items()), at
    assert refused > len(positions) // 2  # most bytes are read
    path.write_bytes(good.replace(b'tokenizer', b'tokenizes', 1))  # a key of the pickle: damaged, not 'missing'
    with pytest.raises(checkpoint.CheckpointError, match='ckpt.pt is damaged: the bytes of its record .*data.pkl'):
        checkpoint.load_checkpoint(path)

def run_bytes(out_dir):
    return {name: (out_dir / name).read_bytes() for name in ('ckpt.pt', 'best.pt')}


def test_a_diverging_run_stops_without_saving(data_dir, tmp_path, trained, monkeypatch):
    """A NaN loss or gradient norm, a NaN validation loss, and NaN weights about to be saved each stop the run with
    the step and the likely causes; ckpt.pt and best.pt stay as they were."""
    copy_run(trained, tmp_path)
    before = run_bytes(tmp_path)
    with pytest.raises(train.TrainError) as error:
        train.main(tiny(data_dir, tmp_path, '--max_iters=20', '--init_from=resume', '--learning_rate=1e6'))
    message = str(error.value)
    assert ' is not finite (NaN or infinity) at step ' in message and message.startswith(('the loss', 'the gradient'))
    assert f'training stopped without saving; {tmp_path / "ckpt.pt"} (step 8) is the last good checkpoint' in message
    assert 'Likely causes: a learning rate too high' in message and run_bytes(tmp_path) == before
    ckpt = torch.load(tmp_path / 'ckpt.pt', weights_only=True)  # a sound file whose optimizer state is NaN:
    ckpt['optimizer']['state'][0]['exp_avg'] *= math.nan  # step 9's loss and gradients are finite, its update not
    torch.save(ckpt, tmp_path / 'ckpt.pt')
    before = run_bytes(tmp_path)
    with pytest.raises(train.TrainError, match='the validation loss is nan at step 9'):
        train.main(tiny(data_dir, tmp_path, '--max_iters=9', '--init_from=resume'))
    ctrl_c_in_first_step(monkeypatch)
    with pytest.raises(train.TrainError, match=r'is not finite \(NaN or infinity\) at step 9: .*ckpt.pt \(step 8\) is '):
        train.main(tiny(data_dir, tmp_path, '--max_iters=20', '--init_from=resume'))
    assert run_bytes(tmp_path) == before


def test_a_nonfinite_gradient_norm_alone_stops_the_run(data_dir, tmp_path, trained, monkeypatch):
    """A step whose loss is finite but whose gradient norm is not stops the run, naming the gradient."""
    copy_run(trained, tmp_path)
    before = run_bytes(tmp_path)
    clip = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, 'clip_grad_norm_', lambda *args, **kw: clip(*args, **kw) * math.nan)
    with pytest.raises(train.TrainError, match=r'^the gradient norm is not finite .* at step 9 '):
        train.main(tiny(data_dir, tmp_path, '--max_iters=12', '--init_from=resume'))
    assert run_bytes(tmp_path) == before


def test_divergence_names_the_best_checkpoint_of_a_run_that_saves_only_best(data_dir, tmp_path, monkeypatch):
    """--always_save_checkpoint=False writes best.pt alone; a later non-finite step names it as the last good one."""
    clip, calls = torch.nn.utils.clip_grad_norm_, []
    monkeypatch.setattr(torch.nn.utils, 'clip_grad_norm_',
                        lambda *args, **kw: clip(*args, **kw) * (math.nan if calls.append(1) or len(calls) > 3 else 1))
    with pytest.raises(train.TrainError, match=r'at step 4 .*/best.pt \(step 2\) is the last good checkpoint'):
        train.main(tiny(data_dir, tmp_path, '--max_iters=10', '--eval_interval=2', '--always_save_checkpoint=False'))
    assert sorted(os.listdir(tmp_path)) == ['best.pt']


def test_overwrite_replaces_the_earlier_run_when_it_first_saves(data_dir, tmp_path, trained, monkeypatch, capsys):
    """--overwrite=True: a new run that fails or is stopped (Ctrl-C) before its first checkpoint leaves the earlier
    run whole, and says so; its first save replaces ckpt.pt and best.pt as a pair (here best.pt alone: the earlier
    ckpt.pt goes)."""
    copy_run(trained, tmp_path)
    before = run_bytes(tmp_path)
    with pytest.raises(train.TrainError, match=r"at step \d+ .* the earlier run's ckpt.pt and best.pt in .* stay as"):
        train.main(tiny(data_dir, tmp_path, '--max_iters=20', '--eval_interval=100', '--learning_rate=1e6',
                        '--overwrite=True'))
    assert run_bytes(tmp_path) == before
    with monkeypatch.context() as patch:
        ctrl_c_in_first_step(patch)
        train.main(tiny(data_dir, tmp_path, '--max_iters=20', '--overwrite=True'))
    assert ("stopped at step 1, before this run's first checkpoint: nothing of it was saved, and the earlier run's "
            f"ckpt.pt and best.pt in {tmp_path} stay as they were") in capsys.readouterr().out
    assert run_bytes(tmp_path) == before and sorted(os.listdir(tmp_path)) == ['best.pt', 'ckpt.pt']
    clip, calls = torch.nn.utils.clip_grad_norm_, []
    monkeypatch.setattr(torch.nn.utils, 'clip_grad_norm_',  # a NaN gradient at step 3, after best.pt of step 2
                        lambda *args, **kw: clip(*args, **kw) * (math.nan if calls.append(1) or len(calls) > 2 else 1))
    with pytest.raises(train.TrainError, match=r'at step 3 .*best.pt \(step 2\) is the last good checkpoint'):
        train.main(tiny(data_dir, tmp_path, '--max_iters=8', '--eval_interval=2', '--always_save_checkpoint=False',
                        '--overwrite=True'))
    assert f"replaced the earlier run's ckpt.pt and best.pt in {tmp_path}" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path)) == ['best.pt']
    assert torch.load(tmp_path / 'best.pt', weights_only=True)['iter_num'] == 2


def test_overwrite_replaces_the_earlier_runs_outputs(data_dir, tmp_path, trained):
    """An --overwrite run's first save replaces all of the earlier run's files in out_dir: eval.py routing's too."""
    copy_run(trained, tmp_path)
    (tmp_path / 'routing.json').write_text('{"label": "the earlier run"}')
    (tmp_path / 'routing.png').write_bytes(b'a heat map')
    train.main(tiny(data_dir, tmp_path, '--max_iters=2', '--eval_interval=2', '--overwrite=True'))
    assert sorted(os.listdir(tmp_path)) == ['best.pt', 'ckpt.pt']
    assert {torch.load(path, weights_only=True)['iter_num'] for path in tmp_path.glob('*.pt')} == {2}


class Killed(BaseException):
    """A kill -9 where it is raised: nothing of the process runs after it that would not run after a kill."""


def dies_on_call(n, real):
    """real, but the n-th call is killed (before it does anything)."""
    calls = []
    return lambda *args, **kw: real(*args, **kw) if calls.append(1) or len(calls) != n else (_ for _ in ()).throw(
        Killed())


def test_a_kill_during_an_overwrite_leaves_the_earlier_run_to_every_reader(data_dir, tmp_path, trained, monkeypatch):
    """A kill while an --overwrite run writes its first checkpoint (here: after ckpt.pt, during best.pt) leaves the
    earlier run in place, as it was: sample.py, eval.py and the next train.py find it, not 'no checkpoint'."""
    copy_run(trained, tmp_path)
    (tmp_path / 'routing.json').write_text('{}')
    before = run_bytes(tmp_path)
    monkeypatch.setattr(train, 'save_checkpoint', dies_on_call(2, checkpoint.save_checkpoint))
    with pytest.raises(Killed):
        train.main(tiny(data_dir, tmp_path, '--max_iters=2', '--eval_interval=2', '--overwrite=True'))
    monkeypatch.undo()
    assert run_bytes(tmp_path) == before and (tmp_path / 'routing.json').exists()
    assert sample.main([f'--out_dir={tmp_path}', '--max_new_tokens=2', '--num_samples=2'])
    assert evaluation.open_checkpoint(tmp_path, 'ckpt.pt')[0]['iter_num'] == 8
    with pytest.raises(train.TrainError, match='holds ckpt.pt and best.pt of an earlier run'):
        train.main(tiny(data_dir, tmp_path, '--max_iters=2'))
    assert run_bytes(tmp_path) == before and sorted(os.listdir(tmp_path)) == ['best.pt', 'ckpt.pt', 'routing.json']


def test_a_kill_during_the_swap_is_finished_by_the_next_run(data_dir, tmp_path, trained, monkeypatch):
    """A kill between the renames that swap an --overwrite run's whole files in (after ckpt.pt, before best.pt), and
    again while the next run finishes that swap: the run after finds the new run's files alone."""
    copy_run(trained, tmp_path)
    (tmp_path / 'routing.json').write_text('{}')
    replace = os.replace
    monkeypatch.setattr(os, 'replace', dies_on_call(3, replace))  # the journal, ckpt.pt, then best.pt
    with pytest.raises(Killed):
        train.main(tiny(data_dir, tmp_path, '--max_iters=2', '--eval_interval=2', '--overwrite=True'))
    monkeypatch.setattr(os, 'replace', dies_on_call(1, replace))  # the next claim's first rename
    with pytest.raises(Killed):
        train.main(tiny(data_dir, tmp_path, '--max_iters=3', '--init_from=resume'))
    monkeypatch.undo()
    assert (tmp_path / 'replacing').exists()  # the journal: the swap is not done yet
    with pytest.raises(train.TrainError, match='is at step 2, which --max_iters=2 does not pass'):
        train.main(tiny(data_dir, tmp_path, '--max_iters=2', '--init_from=resume'))
    assert sorted(os.listdir(tmp_path)) == ['best.pt', 'ckpt.pt']
    assert {torch.load(path, weights_only=True)['iter_num'] for path in tmp_path.glob('*.pt')} == {2}


def test_a_failed_first_save_of_an_overwrite_leaves_the_earlier_run(data_dir, tmp_path, trained, monkeypatch):
    """A disk that fills up during an --overwrite run's first save: the earlier run is untouched, and the message says
    to start the new run again (a resume would continue the earlier one)."""
    import errno
    copy_run(trained, tmp_path)
    before = run_bytes(tmp_path)

    def full_disk(path, mode):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(checkpoint, 'open', full_disk, raising=False)
    with pytest.raises(checkpoint.CheckpointError, match=r'the disk is full .* then start this run again with '
                                                         r'--overwrite=True \(the earlier run is untouched\)'):
        train.main(tiny(data_dir, tmp_path, '--max_iters=2', '--eval_interval=2', '--overwrite=True'))
    assert run_bytes(tmp_path) == before and sorted(os.listdir(tmp_path)) == ['best.pt', 'ckpt.pt']


def test_a_blow_up_is_a_divergence(data_dir, tmp_path, trained, monkeypatch):
    """A finite validation loss above the untrained model's (the run's first evaluation, kept in the checkpoint)
    stops the run without saving, as a non-finite one does; a run that does not blow up saves as usual."""
    copy_run(trained, tmp_path)
    before = run_bytes(tmp_path)
    untrained = torch.load(tmp_path / 'ckpt.pt', weights_only=True)['untrained_loss']
    assert untrained == trained[1]['val'][0][1]  # step 0 of the trained fixture
    with pytest.raises(train.TrainError) as error:  # the issue's run: a learning rate of 30, no clipping
        train.main(tiny(data_dir, tmp_path, '--max_iters=40', '--eval_interval=4', '--init_from=resume',
                        '--learning_rate=30', '--grad_clip=0'))
    assert 'training stopped without saving' in str(error.value) and run_bytes(tmp_path) == before
    with monkeypatch.context() as patch:
        patch.setattr(train, 'estimate_loss', lambda *args: untrained + 1.0)
        with pytest.raises(train.TrainError, match=rf"the validation loss {untrained + 1:.4f} is more than 0.5 above "
                                                   rf"the untrained model's {untrained:.4f} at step 12: training stopped"):
            train.main(tiny(data_dir, tmp_path, '--max_iters=12', '--init_from=resume'))
    assert run_bytes(tmp_path) == before
    train.main(tiny(data_dir, tmp_path, '--max_iters=12', '--init_from=resume'))
    assert torch.load(tmp_path / 'ckpt.pt', weights_only=True)['iter_num'] == 12


def test_a_validation_loss_near_the_untrained_models_is_no_blow_up(data_dir, tmp_path, monkeypatch):
    """The issue's runs, whose validation loss is at or a little above the untrained model's (noise), train and save;
    a blow-up is a rise of more than BLOW_UP (0.5 nats a token)."""
    train.main(tiny(data_dir, tmp_path / 'a', '--max_iters=1', '--eval_interval=1'))
    train.main(tiny(data_dir, tmp_path / 'b', '--block_size=1', '--max_iters=3', '--eval_interval=3'))
    losses = iter([5.0, 5.0 + 0.49, 5.0 + 0.51])  # the untrained model's, a rise within the margin, one past it
    monkeypatch.setattr(train, 'estimate_loss', lambda *args: next(losses))
    with pytest.raises(train.TrainError, match=r"the validation loss 5.5100 is more than 0.5 above the untrained "
                                               r"model's 5.0000 at step 2: training stopped without saving"):
        train.main(tiny(data_dir, tmp_path / 'c', '--max_iters=4', '--eval_interval=1'))
    assert torch.load(tmp_path / 'c' / 'ckpt.pt', weights_only=True)['iter_num'] == 1


def test_bad_config_files_and_out_dirs_get_a_message(data_dir, tmp_path, capsys):
    """A config file with a syntax or a run-time error names its line; an out_dir that cannot be a folder is named;
    float16 on the CPU trains with a warning; grad_clip=0 (no clipping) trains."""
    config, types = defaults()
    bad = tmp_path / 'bad.py'
    bad.write_text('n_layer = 4\nd_model = (128\n')
    with pytest.raises(ConfigError, match=r"bad.py, line 2: '\(' was never closed: fix the config file"):
        load_config(config, [str(bad)], types)
    bad.write_text('n_layer = 4\n\nd_model = 2 * undefined\n')
    with pytest.raises(ConfigError, match="bad.py, line 3: NameError: name 'undefined' is not defined: fix the"):
        load_config(config, [str(bad)], types)
    for out_dir, reason in ((bad, 'it is a file'), (bad / 'out', 'Not a directory')):
        with pytest.raises(train.TrainError, match=f'cannot write to --out_dir={out_dir} \\({reason}\\): pass a'):
            train.main(tiny(data_dir, out_dir, '--max_iters=1'))
    train.main(tiny(data_dir, tmp_path / 'out', '--max_iters=1', '--dtype=float16', '--grad_clip=0'))
    assert 'warning: --dtype=float16 on the CPU is slow' in capsys.readouterr().out



def test_leftovers_are_removed(tmp_path):
    """A failed prepare_data.py leaves no empty folder; the temporary files of a killed one go at the next run (those
    of a running process stay); a checkpoint's temporary file goes when the next run claims its out_dir."""
    latin1 = tmp_path / 'latin1.txt'
    latin1.write_bytes('café au lait'.encode('latin-1'))
    with pytest.raises(ValueError, match=r'latin1.txt is not UTF-8 text \(byte 3 of 12 is 0xe9\): convert it'):
        prepare(str(latin1), 'bytes', tmp_path / 'data', num_proc=1)
    assert os.listdir(tmp_path / 'data') == []
    corpus = tmp_path / 'texts'
    corpus.mkdir()
    for i, text in enumerate(DOCUMENTS):
        (corpus / f'{i:02d}.txt').write_text(text, encoding='utf-8')
    folder = tmp_path / 'data' / 'texts_bytes'
    folder.mkdir()
    killed, running = folder / 'train.bin.99999999.tokens.tmp', folder / f'val.bin.{os.getppid()}.tokens.tmp'
    for path in (killed, running, folder / 'meta.json.99999999.tmp'):
        path.write_bytes(b'partial')
    assert prepare(str(corpus), 'bytes', tmp_path / 'data', val_fraction=0.25, num_proc=1) == folder
    assert sorted(os.listdir(folder)) == ['meta.json', 'train.bin', 'val.bin', running.name]
    (tmp_path / 'out').mkdir()
    (tmp_path / 'out' / 'ckpt.pt.tmp').write_bytes(b'partial')
    with pytest.raises(train.TrainError, match='no dataset at'):  # refused after it claimed out_dir
        train.main(tiny(tmp_path / 'data', tmp_path / 'out', f'--dataset={tmp_path / "none"}'))
    assert os.listdir(tmp_path / 'out') == []


def test_eval_reads_text_as_prepare_data_does_and_writes_under_results(trained, tmp_path, monkeypatch, capsys):
    """A .txt file that is not UTF-8 is refused as prepare_data.py refuses it; an --out that cannot be written is
    refused before the evaluation; the default output goes to results/, which git ignores; the plot where matplotlib
    (optional) is installed, else a note that it was skipped."""
    latin1 = tmp_path / 'latin1.txt'
    latin1.write_bytes('café au lait'.encode('latin-1'))
    with pytest.raises(evaluation.EvalError, match=r'latin1.txt is not UTF-8 text \(byte 3 of 12 is 0xe9\): convert'):
        evaluation.main([f'--out_dir={trained[0]}', f'--data={latin1}', f'--out={tmp_path / "x"}'])
    with pytest.raises(ConfigError, match=rf'--out={latin1}/x: cannot write to {latin1} \(it is a file\)'):
        evaluation.main([f'--out_dir={trained[0]}', f'--out={latin1}/x'])
    with pytest.raises(ConfigError, match="--out='' is not a path prefix"):
        evaluation.main([f'--out_dir={trained[0]}', '--out='])
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'doc.txt').write_text('To be, or not to be, that is the question.\n')
    evaluation.main([f'--out_dir={trained[0]}', '--data=doc.txt'])
    plotted = importlib.util.find_spec('matplotlib') is not None
    assert sorted(os.listdir(tmp_path / 'results')) == ['loss_by_position.csv', 'loss_by_position.json'] + [
        'loss_by_position.png'] * plotted
    assert plotted or 'no plot: matplotlib is not installed (pip install matplotlib)' in capsys.readouterr().out
    assert '/results/' in open(os.path.join(REPO, '.gitignore')).read().split()



def readme_commands(sections=('Quickstart', 'Training', 'Sampling', 'Evaluating')):
    """The python commands in the code blocks of these README sections, in order, as argument lists."""
    import shlex
    readme = open(os.path.join(REPO, 'README.md'), encoding='utf-8').read()
    commands = []
    for section in sections:
        body = readme.split(f'\n## {section}\n')[1].split('\n## ')[0]
        for block in body.split('```')[1::2]:
            if block.startswith('python\n'):  # Python code, not commands
                continue
            for line in block.splitlines():
                for command in line.split('#')[0].split('&&'):
                    words = shlex.split(command)
                    if words[:1] == ['python']:
                        commands.append(words[1:])
    return commands


def toy(command):
    """A README command at toy size: for train.py a tiny model and a hundredth of the steps (500 by default: 5), for
    sample.py 10 tokens; eval.py and research/analysis.py as written."""
    script, args = command[0], command[1:]
    if script == 'train.py':
        steps = [a.split('=')[0] + f"={int(a.split('=')[1]) // 100}" if a.startswith(('--max_iters=',
                 '--lr_decay_iters=', '--warmup_iters=')) else a for a in args]
        default_steps = ([] if any(a.startswith('--max_iters=') for a in args) else ['--max_iters=5']) + (
            [] if any(a.startswith('--warmup_iters=') for a in args) else ['--warmup_iters=0'])
        return steps + default_steps + ['--n_layer=1', '--d_model=32', '--n_memory=8', '--top_k=2', '--batch_size=2',
                                        '--block_size=32', '--eval_iters=1', '--log_interval=1']
    if script == 'sample.py':
        return args + ['--max_new_tokens=10']
    return args


def test_readme_commands_work_in_order(data_dir, tmp_path, monkeypatch, capsys):
    """The commands of the README's Quickstart, Training, Sampling and Evaluating, in order in a fresh folder (the
    default corpus prepared), at toy size; a training run's last line says where it saved."""
    commands = readme_commands()
    skipped = [c for c in commands if c[0] == 'test_fm.py' or c[:2] in (['eval.py', 'harness'],
                                                                        ['research/analysis.py', 'scaling'])]
    assert [c[:2] for c in skipped] == [['test_fm.py'], ['eval.py', 'harness'],
                                        ['research/analysis.py', 'scaling']]  # lm-eval, GPU
    assert len(commands) - len(skipped) >= 9
    os.symlink(os.path.join(REPO, 'config'), tmp_path / 'config')
    os.symlink(data_dir, tmp_path / 'data')
    monkeypatch.setattr(evaluation, 'DEFAULT_DATA_DIR', data_dir)  # eval.py's default: the suite's prepared copy
    monkeypatch.chdir(tmp_path)
    mains = {'train.py': train.main, 'sample.py': sample.main, 'eval.py': evaluation.main,
             'research/analysis.py': analysis.main}
    for command in commands:
        if command not in skipped:
            mains[command[0]](toy(command))
            last = capsys.readouterr().out.strip().splitlines()[-1]
            if command[0] == 'train.py':
                assert last.startswith('saved ') and 'ckpt.pt (step ' in last and 'python sample.py --out_dir=' in last
    assert {'out', 'out-fm-small', 'out-transformer-small', 'out-attn'} <= set(os.listdir(tmp_path))
    assert torch.load(tmp_path / 'out' / 'ckpt.pt', weights_only=True)['iter_num'] == 6  # resumed
    assert os.path.exists(tmp_path / 'results' / 'loss_by_position.csv')
    assert os.path.exists(tmp_path / 'out-fm-small' / 'routing.json')
    assert os.path.exists(tmp_path / 'results' / 'sweep.csv')


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", *sys.argv[1:]]))
