"""The test suite: `python test_fm.py` runs all of it, this file and tests/ (pytest; minutes on 2 CPU cores), but the
tests marked slow (real sizes on a GPU: .ci/gpu runs them), on every core where pytest-xdist is installed (`-n 0`:
one process). `python test_fm.py -m core`: the core checks alone (the tests marked @core, all in this file), in about
a minute on a GPU (most of it Triton's compiles); `-m gpu`: the tests that need CUDA (named *_gpu*).

This file is what a forker runs after changing the model or a kernel. Kernels: the float64 loop `fm_scan_naive`
checks `fm_scan_torch`, and both check the Triton kernels, which run on the CPU under TRITON_INTERPRET=1 when no GPU
is present (as in CI). Then the model: its equations, forward = prefill + step and greedy = argmax for every mixer of
MIXER_CASES (a new mixer goes there; check_mixer runs these on a class of one's own, as --mixer=module:Class names it),
its config and accounting. The rest lives in tests/: test_generate.py
(sampling, generation, sample.py), test_train.py (training, checkpoints, configs, DDP), test_config.py (the
command line and config files), test_data.py (tokenizers, prepare_data.py), test_eval.py (eval.py, research/),
test_readme.py (the README's commands in order, its numbers against docs/results). Shared fixtures and helpers, and
the worker count and GPU of each pytest-xdist worker: conftest.py.
"""

import importlib.util
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from conftest import (CUDA, DECODING, DEVICE, REPO, apart, assert_decodes_as_it_trains, core,  # first: TRITON_INTERPRET
                      default_workers, needs_triton, prefill, randomized, rel_err, save_model_checkpoint, tiny_config,
                      using_scan)
import pytest

import fm_kernel
from fm_kernel import fm_scan, fm_scan_naive, fm_scan_torch, fm_step, fm_step_naive
import model as model_module
from generate import Generator, Sampling
from model import FactorizationMemory, Model, ModelConfig
from research import analysis


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
    pytest.param((2, 1, 24, 16, 16, True), marks=core),
    pytest.param((1, 70, 40, 20, 5, True), marks=core),  # T not a multiple of the chunk, M and D not powers of two
    pytest.param((2, 130, 64, 16, 1, False), marks=core),
    (1, 64, 96, 40, 8, True),  # 40 rows padded to 64 (_block_m); not in -m core: on a GPU its compiles (about 50 s,
]                              # the 64-row tiles) would set the core's time, the others' 32-row ones take 35-40 s


def triton_and_loop(inputs):
    """fm_scan on float32 copies of float64 inputs and the float64 loop, with the same random upstream gradients
    of y and hT: (got, on the CPU; want)."""
    (B, T, D), M = inputs[0].shape, inputs[1].shape[-1]
    grad_y, grad_h = torch.randn(B, T, D, dtype=torch.float64), torch.randn(B, M, D, dtype=torch.float64)
    want = scan_and_grads(fm_scan_naive, inputs, grad_y, grad_h)
    f32 = [t.float().to(DEVICE) if t is not None else None for t in inputs]
    return [g.cpu() for g in scan_and_grads(fm_scan, f32, grad_y.to(DEVICE), grad_h.to(DEVICE))], want


@needs_triton
@pytest.mark.parametrize("case", KERNEL_CASES)
def test_triton_scan_matches_loop(case, poisoned_outputs):
    B, T, D, M, k, with_h0 = case
    torch.manual_seed(T + M)
    assert_close_all(*triton_and_loop(scan_inputs(B, T, D, M, k, h0=with_h0)), 2e-5)


@needs_triton
@pytest.mark.parametrize("groups, h0, T", [pytest.param(2, True, 130, marks=core),  # 3 chunks: groups of 2 and 1
                                           (2, True, 300), (5, False, 300)])  # 5 chunks: groups of 3 and 2, and of 1
def test_triton_scan_walks_groups_of_chunks_in_parallel(groups, h0, T, monkeypatch, poisoned_outputs):
    """With few sequences the state kernel splits the chunks into groups and joins them by a scan over groups (a GPU
    of many SMs takes this path; -m core forces it on the CPU)."""
    monkeypatch.setattr(fm_kernel, "_state_groups", lambda x, NC, columns: groups)
    monkeypatch.setattr(fm_kernel, "_state_columns", lambda M: 64)  # D = 80: two column blocks, the second masked
    torch.manual_seed(8)
    assert_close_all(*triton_and_loop(scan_inputs(2, T, 80, 12, 3, h0=h0)), 2e-5)


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


# what a failure of fm_route_step against fm_route_step_naive means
TWIN = ("expected after an edit of fm_kernel.route_naive, the kernel's twin, which the model does not route by (edit "
        "FactorizationMemory.route for that), else a bug of the kernel")


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
    assert rel_err(y, y_naive) < 1e-6, f"y is {rel_err(y, y_naive):.1e} from fm_route_step_naive's: {TWIN}"
    assert torch.allclose(h, h_naive, rtol=1e-6, atol=1e-6), f"h is {rel_err(h, h_naive):.1e} from the twin's: {TWIN}"
    if taps:
        assert torch.equal(conv[0], conv_naive[0]), "the convolution's window moved otherwise than the twin's: a bug"
    idx, *_ = fm_kernel.route_naive(scores, K, 0.7)
    if idx is not None:
        untouched = torch.ones(B, M, dtype=torch.bool, device=DEVICE).scatter(1, idx, False)
        assert torch.equal(h[untouched], h_naive[untouched]), f"a row the twin leaves alone was written: {TWIN}"


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
    differ = f"{(y != y_naive).sum()} elements of y differ from the twin's, by {rel_err(y, y_naive):.1e}: {TWIN}"
    assert y.dtype == torch.bfloat16 and (y != y_naive).sum() <= 1 and rel_err(y, y_naive) < 2e-3, differ
    same = torch.allclose(h, h_naive, rtol=1e-5, atol=1e-5) and torch.equal(conv[0], conv_naive[0])
    assert same, f"h is {rel_err(h, h_naive):.1e} from the twin's, or the window moved otherwise: {TWIN}"


@core
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
def test_route_step_takes_a_learned_temperature_without_a_host_sync(monkeypatch):
    """tau a tensor (LearnedTauFM's parameter): the logits divided by it on the device, never float(tau) (a host sync,
    which a CUDA graph cannot capture); y and the rows as with tau a number."""
    torch.manual_seed(2)
    h, x, *_ = step_inputs(3, 3, 10, 40)
    scores, h_number = 3 * torch.randn(3, 12, device=DEVICE), h.clone()
    want = fm_kernel.fm_route_step(h_number, x, scores, 3, 0.7)
    monkeypatch.setattr(torch.Tensor, '__float__', lambda t: pytest.fail('float(tau): a host sync'))
    got = fm_kernel.fm_route_step(h, x, scores, 3, torch.tensor(0.7, device=DEVICE))
    assert rel_err(got, want) < 1e-6 and torch.allclose(h, h_number, rtol=1e-6, atol=1e-6)


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
    """decode_product against F.linear in float64 (outputs and inner width not multiples of the tiles, K over several
    tiles), and in bfloat16 against the float64 product of the same numbers; opcheck on the custom op."""
    torch.manual_seed(N + K)
    x, weight = (torch.randn(*shape, device=DEVICE, dtype=torch.float64) for shape in ((1, K), (N, K)))
    assert rel_err(fm_kernel.decode_product(x, weight), fm_kernel.decode_product_naive(x, weight)) < 1e-12
    x16, weight16 = x.bfloat16(), weight.bfloat16()
    y16 = fm_kernel.decode_product(x16, weight16)
    want = fm_kernel.decode_product_naive(x16.double(), weight16.double())
    assert y16.dtype == torch.bfloat16 and rel_err(y16, want) < 1e-2
    torch.library.opcheck(fm_kernel._decode_product, (x16, weight16))


@needs_triton
def test_decode_product_refuses_what_it_cannot_do():
    for x, weight in ((torch.zeros(1, 8), torch.zeros(4, 9)), (torch.zeros(2, 8), torch.zeros(4, 8))):
        with pytest.raises(ValueError, match="one row"):
            fm_kernel.decode_product(x.to(DEVICE), weight.to(DEVICE))
    with pytest.raises(ValueError, match="one dtype"):
        fm_kernel.decode_product(torch.zeros(1, 8, device=DEVICE), torch.zeros(4, 8, device=DEVICE).double())


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


@pytest.mark.slow
@pytest.mark.skipif(not CUDA, reason="real sizes need a GPU")
@pytest.mark.parametrize("dtype,M,tol", [(torch.float32, 64, 1e-5), (torch.bfloat16, 64, 1e-2),
                                         (torch.float32, 128, 1e-5), (torch.bfloat16, 128, 1e-2)])
def test_triton_scan_real_size_gpu(dtype, M, tol):
    """Real sizes, where the GPU's shared memory bounds the kernels' tiles (128 rows: the largest). Slow (a minute or
    two a case): marked slow, which `python test_fm.py` leaves out unless -m is given; .ci/gpu runs it."""
    torch.manual_seed(6)
    B, T, D, k = 2, 2048 + 37, 2048, 8
    inputs = scan_inputs(B, T, D, M, k, device="cuda")
    grad_y, grad_h = torch.randn_like(inputs[0]), torch.randn_like(inputs[3])
    want = scan_and_grads(fm_scan_torch, inputs, grad_y, grad_h)
    x, theta, phi, h0 = inputs
    got = scan_and_grads(fm_scan, [x.to(dtype), theta.float(), phi.float(), h0.float()], grad_y, grad_h)
    assert_close_all(got, want, tol)


# ----------------------------------------------------------------------------- sparse scan

def sparse_inputs(B, T, D, M, k, uneven=False, rate=None, h0=True, dtype=torch.float64):
    """x (B, T, D), idx (B, T, k) distinct rows, theta, phi (B, T, k), h0 (B, M, D) or None; uneven:
    row 0 in every token's top k and the others drawn from the first k + 2 rows (most rows empty);
    rate: every theta at that value."""
    scores = torch.randn(B, T, M, dtype=dtype)
    if uneven:
        scores[..., k + 2:] -= 100
        scores[..., 0] += 100
    idx = scores.argsort(-1, descending=True)[..., :k]
    theta = torch.rand(B, T, k, dtype=dtype) if rate is None else torch.full((B, T, k), rate, dtype=dtype)
    phi = torch.rand(B, T, k, dtype=dtype)
    x = torch.randn(B, T, D, dtype=dtype)
    return x, idx, theta, phi, torch.randn(B, M, D, dtype=dtype) if h0 else None


def sparse_and_grads(scan, x, idx, theta, phi, h0, M, grad_y, grad_h, **kw):
    """y, hT and the gradients of x, theta, phi (and h0) of scan(x, idx, theta, phi, M, h0)."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, theta, phi, h0) if t is not None]
    y, hT = scan(leaves[0], idx, leaves[1], leaves[2], M, leaves[3] if h0 is not None else None, **kw)
    loss = (y * grad_y.to(y.dtype)).sum() + (hT * grad_h.to(hT.dtype)).sum()
    return [y, hT, *torch.autograd.grad(loss, leaves)]


def loop_of_spread(x, idx, theta, phi, M, h0):
    """fm_scan_naive with theta and phi spread over the M rows: the dense ground truth."""
    zeros = theta.new_zeros(*theta.shape[:-1], M)
    return fm_scan_naive(x, zeros.scatter(-1, idx, theta), zeros.scatter(-1, idx, phi), h0)


@core
@pytest.mark.parametrize("T, M, k, uneven, h0", [
    (37, 8, 3, False, True), (37, 8, 1, False, True), (37, 8, 7, False, False),
    (60, 16, 2, True, True), (5, 64, 4, False, True), (1, 8, 3, False, False)])
def test_sparse_scan_torch_matches_the_loop(T, M, k, uneven, h0):
    """The dispatch form (fm_sparse_scan_torch) is fm_scan_naive's m-row scan in float64, forward and every
    gradient, with every input random: k = 1 and m - 1, one row in every token (most rows empty), rows nobody
    chooses (m = 64: their hT is h0, their dh0 dhT), T = 1."""
    torch.manual_seed(T + M + k)
    inputs = sparse_inputs(2, T, 12, M, k, uneven, h0=h0)
    grad_y, grad_h = torch.randn(2, T, 12, dtype=torch.float64), torch.randn(2, M, 12, dtype=torch.float64)
    want = sparse_and_grads(loop_of_spread, *inputs, M, grad_y, grad_h)
    got = sparse_and_grads(fm_kernel.fm_sparse_scan_torch, *inputs, M, grad_y, grad_h, chunk_size=16)
    assert_close_all(got, want, 1e-10)


@needs_triton
@pytest.mark.parametrize("T, M, k, uneven, h0, rate", [
    (37, 8, 3, False, True, None), (70, 4, 3, True, True, None), (29, 64, 2, False, False, None),
    (40, 5, 4, False, True, 1.0), (33, 6, 1, True, False, 1 - 1e-6)])
def test_triton_sparse_scan_matches_torch(T, M, k, uneven, h0, rate):
    """fm_sparse_scan (Triton, here under the interpreter) is fm_sparse_scan_torch in float32: chunks of 32 pairs
    holding many segments, segments running through several chunks (one row in every token), rows forgetting
    (theta = 1), with and without h0 and dhT."""
    torch.manual_seed(T * M + k)
    x, idx, theta, phi, h = sparse_inputs(2, T, 24, M, k, uneven, rate, h0, torch.float32)
    grad_y = torch.randn(2, T, 24, device=DEVICE)
    grad_h = torch.randn(2, M, 24, device=DEVICE) * h0  # h0 False: dhT = 0
    inputs = [t.to(DEVICE) if t is not None else None for t in (x, idx, theta, phi, h)]
    want = sparse_and_grads(fm_kernel.fm_sparse_scan_torch, *inputs, M, grad_y, grad_h)
    got = sparse_and_grads(fm_kernel.fm_sparse_scan, *inputs, M, grad_y, grad_h)
    if rate == 1.0:  # each written row forgets h0 at its first writer: dh0 is 0 there (e^-80 leaks 1e-35)
        written = torch.zeros(2, M, dtype=torch.bool).scatter(1, idx.flatten(1), True)
        assert got[5][written].abs().max() < 1e-30 and want[5][written].abs().max() < 1e-30
        got[5], want[5] = got[5][~written], want[5][~written]
    assert_close_all(got, want, 1e-4)


@pytest.mark.slow
@pytest.mark.skipif(not CUDA, reason="real sizes need a GPU")
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("B, T, D, M, uneven", [(2, 512, 2048, 1024, False), (2, 300, 96, 65536, True)])
def test_triton_sparse_scan_real_size_gpu(B, T, D, M, uneven, dtype, tol):
    """Real sizes on a GPU (d_memory 2,048; m 65,536 with one row in every token): fm_sparse_scan in
    float32 and bf16 against fm_sparse_scan_torch in float64."""
    torch.manual_seed(M)
    inputs = [t.cuda() for t in sparse_inputs(B, T, D, M, 8, uneven)]
    grad_y, grad_h = torch.randn(B, T, D, device="cuda"), torch.randn(B, M, D, device="cuda")
    want = sparse_and_grads(fm_kernel.fm_sparse_scan_torch, *inputs, M, grad_y, grad_h)
    x, idx, theta, phi, h0 = inputs
    got = sparse_and_grads(fm_kernel.fm_sparse_scan, x.to(dtype), idx, theta.float(), phi.float(),
                           h0.float(), M, grad_y, grad_h)
    assert_close_all(got, want, tol)


@pytest.mark.parametrize("change, words", [
    (dict(idx=lambda i: i[..., :0]), "top_k must be in 1"),
    (dict(idx=lambda i: torch.cat([i, i[..., :1] + 1], -1) % 8, M=2), "top_k must be in 1"),
    (dict(idx=lambda i: i + 8), "rows 0..7"),
    (dict(idx=lambda i: torch.cat([i[..., :1], i[..., :1]], -1)), "twice"),
    (dict(theta=lambda t: t[..., :1]), "idx's shape"),
    (dict(h0=lambda h: h[:, :3]), "h0 must be"),
])
def test_sparse_scan_rejects_bad_input_naming_it(change, words):
    x, idx, theta, phi, h0 = sparse_inputs(1, 6, 4, 8, 2)
    idx = change.get('idx', lambda i: i)(idx)
    theta = change.get('theta', lambda t: t)(theta[..., :idx.shape[-1]])
    h0 = change.get('h0', lambda h: h)(h0)
    with pytest.raises(ValueError, match=words):
        fm_kernel.fm_sparse_scan_torch(x, idx, theta, phi[..., :idx.shape[-1]], change.get('M', 8), h0)


# ============================================================================= model.py

MIXER_CASES = {  # name -> config overrides (the fm cases use m = 8): the one place to add a mixer, with its hand
    # count in hand_forward_flops right below; every test over the mixers, here and in tests/, takes these cases
    'fm_dense': dict(mixer='fm'),
    'fm_sparse': dict(mixer='fm', top_k=3),
    'fm_block_dense': dict(mixer='fm', fm_conv=4, fm_gate=True),  # the layer with a convolution and an output gate
    'fm_block_sparse': dict(mixer='fm', top_k=3, fm_conv=4, fm_gate=True),
    'attn': dict(mixer='attn'),
    'mamba2': dict(mixer='mamba2'),
}


def hand_forward_flops(name, seq_len):
    """tiny_config's model of MIXER_CASES[name], counted from its shapes -> (non-embedding parameters, forward FLOPs per
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
    elif name.startswith('fm'):  # m = 8 rows of 32; k = 3 (sparse) or 8 (dense)
        k = 3 if name.endswith('sparse') else 8
        per_layer += d * 8 + (2 * d + 2) + 2 * d * d  # router, rates (eta, mu; biased), in_proj, out_proj
        if name.startswith('fm_block'):
            per_layer += d * 4 + d + d * d  # a conv of 4 over xbar (and its bias), the gate's W_z
        work = k * (9 * d + 5)  # paper App. FLOPS: the recurrence costs 9 d_memory + 5 per row read and written
    else:
        pytest.fail(f"no hand count for MIXER_CASES[{name!r}]: add it to hand_forward_flops (test_fm.py)")
    params = layers * per_layer + d  # and the final norm
    return params, 2 * (params + d * vocab) + layers * work


@core
def test_every_mixer_has_a_case():
    """Each key of model.MIXER_CLASSES has a case in MIXER_CASES, which every parity test and the FLOPs counts take
    (README, Changing the model)."""
    covered = {model_module.mixer_family(case['mixer']) for case in MIXER_CASES.values()}
    for family in model_module.MIXER_CLASSES:
        assert family in covered, f"mixer {family!r} has no case: add one to MIXER_CASES (test_fm.py)"


@core
def test_every_mixer_is_registered_with_its_settings():
    """model.MIXER_CLASSES and ModelConfig.MIXER_SETTINGS name the same mixers: a mixer without settings would get
    none of its fields tagged in --help and train.py's warning that they are ignored."""
    classes, settings = set(model_module.MIXER_CLASSES), set(ModelConfig.MIXER_SETTINGS)
    for family in classes - settings:
        pytest.fail(f"mixer {family!r} has no settings: add {family!r}: (the ModelConfig fields it reads) to "
                    f"ModelConfig.MIXER_SETTINGS (model.py)")
    for family in settings - classes:
        pytest.fail(f"ModelConfig.MIXER_SETTINGS names {family!r}, no mixer: register its class in MIXER_CLASSES "
                    f"(model.py), or drop the entry")


@core
@pytest.mark.parametrize('name', list(MIXER_CASES))
def test_training_flops_match_a_hand_count(name, tmp_path):
    """Model.flops_per_token is 3x (forward + backward) the hand count, and analysis.py's training FLOPs of a run are
    the forward count x the tokens it trained."""
    params, forward = hand_forward_flops(name, 48)
    model = Model(tiny_config(**MIXER_CASES[name]))
    assert model.num_params() == params, (
        f"{name}: {model.num_params():,} parameters, {params:,} by hand: expected after an edit that adds or drops a "
        f"parameter (count it in hand_forward_flops, and its work in Model.flops_per_token), else a bug")
    for seq_len in (48, 4096):
        counted, hand = model.flops_per_token(seq_len), 3 * hand_forward_flops(name, seq_len)[1]
        assert counted == hand, (
            f"{name}: Model.flops_per_token({seq_len}) = {counted:,.0f}, 3 x {hand / 3:,.0f} by hand: expected after "
            f"an edit of the layer's work or of flops_per_token (count it in hand_forward_flops too), else a bug")
    tokens = 10 * 4 * 48  # 10 steps of 4 x 48
    save_model_checkpoint(model, tmp_path / 'run', best_val_loss=2.5, iter_num=10, data_state={'tokens_seen': tokens},
                          train_config={'max_iters': 10, 'learning_rate': 1e-3, 'min_lr': 1e-4, 'seed': 1})
    record = analysis.run_record(tmp_path / 'run')
    assert record['forward_flops'] == forward * tokens and record['non_embedding_parameters'] == params
    assert (record['learning_rate'], record['seed'], record['val_loss'], record['tokens']) == (1e-3, 1, 2.5, tokens)


# ----------------------------------------------------------------------------- FM routing

def papers(*methods):
    """The message of a test of the paper's equations: the edits of model.py after which its failure is expected."""
    edits = ' or '.join(f'FactorizationMemory.{m}' for m in methods)
    return f"no longer the paper's equations: expected after an edit of {edits}, else a bug"


ROUTER = papers('route', 'router_scores', 'weights')
PAPERS = papers('route', 'router_scores')  # eval.py's routing statistics (tests/test_eval.py)


def paper_weights(layer, x):
    """The paper's router written out: alpha = softmax(W_alpha x / tau), masked to the top k and renormalised;
    -> theta = eta alpha, phi = mu alpha (B, T, M), eta and mu = sigmoid(w.x + b)."""
    alpha = torch.softmax(layer.router(x) / layer.tau, dim=-1)  # (B, T, M)
    mask = torch.zeros_like(alpha).scatter(-1, alpha.topk(layer.top_k, dim=-1).indices, 1.0)
    alpha = mask * alpha / (mask * alpha).sum(-1, keepdim=True)
    eta, mu = torch.sigmoid(layer.rates(x)).unbind(-1)  # (B, T)
    return eta[..., None] * alpha, mu[..., None] * alpha


def fm_reference(layer, x):
    """The paper's equations written out: the router (paper_weights), xbar = W_in x, the naive scan."""
    y, h = fm_kernel.fm_scan_naive(layer.in_proj(x), *paper_weights(layer, x), eps=layer.eps)
    return layer.out_proj(y), h


def block_reference(layer, x):
    """FM with its two parts beside the paper written out: xbar = silu(causal conv of W_in x) (a loop over the taps,
    zeros before the start), the read-out gated by silu(W_z x) before W_o."""
    xbar, z = F.linear(x, layer.in_proj.weight).chunk(2, dim=-1)  # W_in x, W_z x (B, T, D)
    taps = layer.conv.weight[:, 0]  # (D, W)
    W = taps.shape[1]
    conv = sum(F.pad(xbar, (0, 0, W - 1 - j, 0))[:, :x.shape[1]] * taps[:, j] for j in range(W)) + layer.conv.bias
    y, h = fm_kernel.fm_scan_naive(F.silu(conv), *paper_weights(layer, x), eps=layer.eps)
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
    assert rel_err(y, y_ref) < 1e-10 and rel_err(state['h'], h_ref) < 1e-10, ROUTER
    xbar = F.linear(x, layer.in_proj.weight[:32])  # W_in x, the convolution's input
    assert rel_err(state['conv'], xbar[:, -3:].transpose(1, 2)) < 1e-15, papers('forward')


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
    assert rel_err(y, y_ref) < 1e-10 and rel_err(state['h'], h_ref) < 1e-10, ROUTER


@core
@pytest.mark.parametrize('top_k', [3, None])
def test_the_kernels_router_is_route(top_k):
    """fm_kernel.route_naive, the twin of the fused kernel's router (test_triton_route_step_matches_naive), of
    router_scores is route: float64, every parameter random; so the probe sends the paper's router to the fused
    kernel, also with bfloat16 weights on the device (a decoding model's)."""
    torch.manual_seed(0)
    layer = randomized(FactorizationMemory(tiny_config(top_k=top_k, tau=0.5))).double()
    x = torch.randn(2, 37, 32, dtype=torch.float64)
    twin = layer.weights(*fm_kernel.route_naive(layer.router_scores(x), layer.top_k, layer.tau))
    err = max(rel_err(a, b) for a, b in zip(twin, layer.weights(*layer.route(x))))
    message = f"route_naive (the kernel's twin) of router_scores is {err:.1e} from route: "
    assert err < 1e-15, message + papers('route') + ' (decoding then takes route as written) or of route_naive'
    assert fm_kernel.route_step_takes_over(layer), papers('route', 'weights') + ' (the probe refused it)'
    assert fm_kernel.route_step_takes_over(layer.to(DEVICE, torch.bfloat16)), 'the probe refused bfloat16 weights'


@pytest.mark.parametrize('top_k', [1, 2, 5, 8])
def test_router_weights_sum_to_one_over_k_rows(top_k):
    torch.manual_seed(0)
    layer = FactorizationMemory(tiny_config(top_k=top_k))
    x = torch.randn(3, 10, 32)
    idx, alpha, eta, mu = layer.route(x)
    if idx is not None:
        alpha = torch.zeros(3, 10, 8).scatter(-1, idx, alpha)
    message = papers('route', 'router_scores')
    assert alpha.dtype == torch.float32, f"alpha is {alpha.dtype}: {message}"
    rows = (alpha > 0).sum(-1)
    assert bool((rows == top_k).all()), f"{rows.min().item()} to {rows.max().item()} rows a token, not {top_k}: {message}"
    torch.testing.assert_close(alpha.sum(-1), torch.ones(3, 10), msg=lambda m: f"{m}\n{message}")
    kept = torch.softmax(layer.router(x), -1).topk(top_k, dim=-1).indices  # the k largest affinities
    assert bool((alpha.gather(-1, kept) > 0).all()), f"not the top k rows: {message}"
    rates = torch.cat([eta, mu], -1)
    assert bool(((rates > 0) & (rates < 1)).all()), f"eta or mu outside (0, 1): {message}"


def test_router_scores_of_a_compiled_step_are_the_product(monkeypatch):
    """router_scores as a compiled step takes them (a decoding step's 2-D input, one float32 reduction) gives the
    rows and weights of the scores as products, W_alpha x and the rates' w.x + b."""
    layer = randomized(FactorizationMemory(tiny_config(top_k=3)))
    x = torch.randn(17, 32)
    idx, *weights = fm_kernel.route_naive(layer.router_scores(x), 3, layer.tau)
    monkeypatch.setattr(torch.compiler, 'is_compiling', lambda: True)
    reduced = layer.router_scores(x)
    err = rel_err(reduced, torch.cat([layer.router(x), layer.rates(x)], -1))
    assert reduced.dtype == torch.float32 and err < 1e-6, f"the reduction is {err:.1e} from the product"
    idx_reduced, *weights_reduced = fm_kernel.route_naive(reduced, 3, layer.tau)
    same_rows = torch.equal(idx, idx_reduced)
    assert same_rows, "the reduction selects other rows than the product"
    for got, want in zip(weights, weights_reduced):
        assert (got - want).abs().max() < 1e-6, "the reduction's weights are not the product's"


# ----------------------------------------------------------------------------- every mixer

def check_step_and_prefill(case):
    """Decoding from the start, and after a prefill, gives the forward pass's logits."""
    torch.manual_seed(0)
    model = randomized(Model(tiny_config(init_std=0.1, **case))).double().eval()
    idx = torch.randint(0, 64, (2, 37))
    logits, _ = model(idx)  # (B, T, V)

    state = model.init_state(2, max_len=37)
    stepped = torch.stack([model.step(idx[:, t], state) for t in range(idx.shape[1])], 1)
    assert rel_err(stepped, logits) < 1e-12, f"{DECODING}: {apart(stepped, logits)}"

    last_logits, state = prefill(model, idx[:, :21], max_len=40)  # a cache with room to spare
    continued = torch.stack([last_logits] + [model.step(idx[:, t], state) for t in range(21, idx.shape[1])], 1)
    gap = apart(continued, logits[:, 20:], 20)
    assert rel_err(continued, logits[:, 20:]) < 1e-12, f"{DECODING} after a prefill: {gap}"


def check_ragged_prefill(case):
    """Prompts of different lengths, right-padded in one pass: each row's logits and decoding state are what the
    row alone gives (no padding token enters a recurrent state or the KV cache that is read)."""
    torch.manual_seed(1)
    model = randomized(Model(tiny_config(init_std=0.1, **case))).double().eval()
    idx = torch.randint(0, 64, (3, 37))
    lengths = torch.tensor([37, 5, 20])
    logits, state = prefill(model, idx, lengths, max_len=45)
    following = torch.randint(0, 64, (3, 6))
    stepped = torch.stack([logits] + [model.step(following[:, t], state) for t in range(6)], 1)  # (3, 7, V)
    for row, n in enumerate(lengths.tolist()):
        alone, _ = model(torch.cat([idx[row:row + 1, :n], following[row:row + 1]], 1))
        gap = apart(stepped[row:row + 1], alone[:, n - 1:], n - 1)
        assert rel_err(stepped[row], alone[0, n - 1:]) < 1e-12, f"{DECODING} for row {row} of {n} tokens: {gap}"


def check_chunked_pass(case):
    """A mixer whose state does not grow runs a long text in chunks, each continuing from the last one's state: the
    same hidden states and final state as one pass (eval.py relies on this for bounded memory at any length).
    Attention refuses (test_attention_refuses_a_parallel_pass_from_a_state)."""
    torch.manual_seed(2)
    model = randomized(Model(tiny_config(init_std=0.1, **case))).double().eval()
    idx = torch.randint(0, 64, (2, 50))
    whole, whole_state = model.hidden(idx)
    if model.config.family == 'attn':
        with pytest.raises(ValueError, match='one token at a time'):
            model.hidden(idx, whole_state)
        return
    parts, state = [], None
    for start in (0, 7, 30):  # chunks of 7, 23 and 20 tokens, none a multiple of the scan's chunk of 16
        x, state = model.hidden(idx[:, start:start + {0: 7, 7: 23, 30: 20}[start]], state)
        parts.append(x)
    parts = torch.cat(parts, 1)
    assert rel_err(parts, whole) < 1e-12, f"a pass in chunks differs from one pass: {apart(parts, whole)}"
    for layer, (got, want) in enumerate(zip(state, whole_state)):
        for k in want:
            err = rel_err(got[k], want[k])
            assert err < 1e-12, f"layer {layer}'s state {k!r} after chunks differs from one pass's by {err:.1e}"


def test_attention_refuses_a_parallel_pass_from_a_state():
    model = Model(tiny_config(mixer='attn'))
    _, state = model.hidden(torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match='one token at a time'):
        model.hidden(torch.zeros(1, 4, dtype=torch.long), state)


def test_static_kv_cache_ignores_capacity_and_stale_entries():
    """The static cache attends only over its filled part: the same logits for any capacity, and with garbage
    written beyond each row's position."""
    torch.manual_seed(3)
    model = randomized(Model(tiny_config(mixer='attn', init_std=0.1))).double().eval()
    idx = torch.randint(0, 64, (2, 30))
    runs = []
    for max_len, garbage in ((30, False), (64, True)):
        logits, state = prefill(model, idx[:, :10], max_len=max_len)
        if garbage:
            for layer in state:
                layer['k'][:, :, 10:], layer['v'][:, :, 10:] = 1e3, -1e3
        runs.append(torch.stack([logits] + [model.step(idx[:, t], state) for t in range(10, 30)], 1))
    assert rel_err(runs[1], runs[0]) < 1e-14, f"a larger cache decodes otherwise: {apart(runs[1], runs[0], 9)}"
    want = model(idx)[0][:, 9:]
    assert rel_err(runs[0], want) < 1e-12, f"{DECODING}: {apart(runs[0], want, 9)}"


def check_greedy_generation(case):
    """Batched prompts of different lengths, greedy: each row's tokens are the argmax of the full forward pass
    over its own prompt and tokens so far, token by token; also when the prefill runs a row at a time and a
    recurrent model takes its prompt in pieces of 5 tokens."""
    torch.manual_seed(4)
    model = randomized(Model(tiny_config(init_std=0.3, **case))).double().eval()
    prompts = [torch.randint(0, 64, (n,)).tolist() for n in (9, 2, 17)]
    generated = Generator(model, Sampling(temperature=0)).generate(prompts, max_new_tokens=8)
    assert Generator(model, Sampling(temperature=0), prefill_tokens=5).generate(prompts, 8) == generated
    for prompt, new in zip(prompts, generated):
        assert len(new) == 8
        tokens = list(prompt)
        for _ in range(8):
            tokens.append(model(torch.tensor([tokens]))[0][0, -1].argmax().item())
        assert new == tokens[len(prompt):]


PARITY_CHECKS = (check_step_and_prefill, check_ragged_prefill, check_chunked_pass, check_greedy_generation)


@core
@pytest.mark.parametrize('check', PARITY_CHECKS, ids=lambda check: check.__name__)
@pytest.mark.parametrize('name', MIXER_CASES)
def test_every_mixer_decodes_as_it_trains(name, check):
    """The parity checks (decoding = training) on every case of MIXER_CASES, float64, every parameter random."""
    check(MIXER_CASES[name])


def check_mixer(mixer, **settings):
    """The parity checks on a mixer of one's own, a key of MIXER_CLASSES or 'module:Class' (--mixer's), in
    tiny_config's model with settings; an AssertionError saying where decoding differs, or fm_kernel.DecodingError
    where the mixer refuses to decode. In a test file of one's own:
        from test_fm import check_mixer
        def test_my_router(): check_mixer('my_module:MyFM', top_k=3, fm_conv=4, fm_gate=True)"""
    for check in PARITY_CHECKS:
        check(dict(mixer=mixer, **settings))


def test_a_fork_through_mixer_passes_the_parity_checks():
    """check_mixer as a forker calls it, on research/levers.py's RowRatesFM (a route and a parameter of its own)."""
    check_mixer('research.levers:RowRatesFM', top_k=4, fm_conv=4, fm_gate=True)


def test_a_fork_whose_router_reads_other_tokens_fails_the_parity_checks_loudly():
    """Issue 62: the fork that trains right and decodes wrong fails check_mixer in its first check, saying why."""
    with pytest.raises(fm_kernel.DecodingError, match="^test_fm:PreviousTokenFM does not decode: its routing at a"):
        check_mixer('test_fm:PreviousTokenFM', top_k=4)


class ContrarianFM(FactorizationMemory):
    """A forker's router: the rows the standard router likes least (the softmax of -W_alpha x), through route alone."""

    def route(self, x):
        with torch.autocast(x.device.type, enabled=False):
            scores = self.router_scores(x)
            return fm_kernel.route_naive(torch.cat([-scores[..., :-2], scores[..., -2:]], -1), self.top_k, self.tau)


class TemperatureFM(FactorizationMemory):
    """A forker's router with a parameter of its own: a learned temperature on the router's logits (neutral at 1)."""

    def __init__(self, config):
        super().__init__(config)
        self.temperature = torch.nn.Parameter(torch.ones(()))

    def route(self, x):
        with torch.autocast(x.device.type, enabled=False):
            scores = self.router_scores(x)
            logits = scores[..., :-2] / self.temperature.to(scores.dtype)
            return fm_kernel.route_naive(torch.cat([logits, scores[..., -2:]], -1), self.top_k, self.tau)


class KernelRouterFM(FactorizationMemory):
    """The fused kernel's router by construction, whatever model.py's route and weights compute: route_naive (the
    kernel's twin) of router_scores, and theta = eta alpha, phi = mu alpha as the kernel forms them."""

    def route(self, x):
        return fm_kernel.route_naive(self.router_scores(x), self.top_k, self.tau)

    def weights(self, idx, alpha, eta, mu):
        return eta * alpha, mu * alpha


class CastingRouterFM(FactorizationMemory):
    """A forker's router_scores in its weights' dtype (nn.Linear casts nothing): bfloat16 scores, not the kernel's."""

    def router_scores(self, x):
        return torch.cat([self.router(x), self.rates(x)], -1)


class Float32RouteFM(FactorizationMemory):
    """A forker's route that runs in float32 alone (a kernel of one's own, say): the float64 probe cannot run it."""

    def route(self, x):
        if x.dtype == torch.float64:
            raise TypeError('this route runs in float32')
        return super().route(x)


class FlooredFM(FactorizationMemory):
    """Issue 51's fork 1b: alpha floored (alpha + 1e-5, renormalised), within 1e-3 of the paper's router."""

    def route(self, x):
        idx, alpha, eta, mu = super().route(x)
        alpha = alpha + 1e-5
        return idx, alpha / alpha.sum(-1, keepdim=True), eta, mu


class RowScoresFM(FactorizationMemory):
    """Issue 51's fork 2: router_scores with a learned bias and temperature a row, zero (neutral) at the start."""

    def __init__(self, config):
        super().__init__(config)
        self.row_bias = torch.nn.Parameter(torch.zeros(config.n_memory))
        self.row_temperature = torch.nn.Parameter(torch.zeros(config.n_memory))

    def router_scores(self, x):
        scores = super().router_scores(x)
        scale, bias = self.row_temperature.exp().to(scores.dtype), self.row_bias.to(scores.dtype)
        return torch.cat([scores[..., :-2] * scale + bias, scores[..., -2:]], -1)


class LearnedTauFM(FactorizationMemory):
    """Issue 62's one-line fork: the temperature learned (tau a parameter, which route and the fused kernel read)."""

    def __init__(self, config):
        super().__init__(config)
        self.tau = torch.nn.Parameter(torch.tensor(config.tau))


class PreviousTokenFM(FactorizationMemory):
    """Issue 62's fork: router_scores of each token plus the one before it (zeros before the start). It trains right;
    a decoding step's x (B, d_model) has no token before it, so the shift would run along the batch."""

    def router_scores(self, x):
        return super().router_scores(x + F.pad(x, (0, 0, 1, 0))[..., :-1, :])


class OwnStepFM(PreviousTokenFM):
    """PreviousTokenFM with a step of its own, which says how it decodes (here: as FactorizationMemory's)."""

    def step(self, x, state):
        return super().step(x, state)


class ShapedRouterFM(FactorizationMemory):
    """A router that reads each token alone but routes a sequence's tokens (B, T, d_model) otherwise than a step's
    (B, d_model): the logits doubled in sequences."""

    def router_scores(self, x):
        scores = super().router_scores(x)
        return torch.cat([scores[..., :-2] * (2.0 if x.dim() == 3 else 1.0), scores[..., -2:]], -1)


class LogScaleFM(FactorizationMemory):
    """A router whose logits are scaled by log(s - 1), s a parameter: NaN at the probe's draws (s in [-1, 1])."""

    def __init__(self, config):
        super().__init__(config)
        self.s = torch.nn.Parameter(torch.full((), 3.0))

    def router_scores(self, x):
        scores = super().router_scores(x)
        return torch.cat([scores[..., :-2] * (self.s - 1).log(), scores[..., -2:]], -1)


ROUTERS = {'standard': FactorizationMemory, 'override': ContrarianFM, 'temperature': TemperatureFM,
           'kernel': KernelRouterFM, 'casting': CastingRouterFM,
           'floored': FlooredFM, 'row_scores': RowScoresFM, 'float32': Float32RouteFM, 'learned_tau': LearnedTauFM,
           'previous_token': PreviousTokenFM, 'own_step': OwnStepFM, 'shaped': ShapedRouterFM, 'log': LogScaleFM}


def fm_model(router='standard', **overrides):
    """A tiny FM model whose layers are one of ROUTERS, named as a forker names a mixer of their own."""
    mixer = 'fm' if router == 'standard' else f'test_fm:{ROUTERS[router].__name__}'
    return Model(tiny_config(mixer=mixer, **overrides))


def fused(model):
    """Whether model's FM layers decode through the fused kernel (as the probe of its last init_state found)."""
    return [block.mixer.fused_router for block in model.blocks]


# why the probe may refuse the fused kernel to a fork of this file that keeps model.py's route and weights
INHERITED = ("expected after an edit of FactorizationMemory.route or .weights in model.py (this test's fork inherits "
             "it, and the fused kernel computes the paper's) or of fm_kernel.route_naive (its twin), else a bug")


@core
@pytest.mark.parametrize('top_k', [3, None])
def test_fused_and_unfused_decoding_agree(top_k):
    """A router that the probe sends to the fused kernel decodes as it trains through the fused step and through
    route as written (fused_router off): float64, every parameter random, with FM's block."""
    torch.manual_seed(0)
    model = randomized(fm_model('kernel', top_k=top_k, fm_conv=4, fm_gate=True)).double().eval()
    idx = torch.randint(0, 64, (2, 20))
    logits, _ = model(idx)
    for fused_router in (True, False):
        last, state = prefill(model, idx[:, :9], max_len=20)
        assert fused(model) == [True, True], "the probe refused a router that is the kernel's by construction"
        for block in model.blocks:
            block.mixer.fused_router = fused_router
        stepped = torch.stack([last] + [model.step(idx[:, t], state) for t in range(9, 20)], 1)
        path = 'fused' if fused_router else 'unfused'
        assert rel_err(stepped, logits[:, 8:]) < 1e-12, f"{DECODING}, {path}: {apart(stepped, logits[:, 8:], 8)}"


@core
@pytest.mark.parametrize('router', ['override', 'temperature'])
@pytest.mark.parametrize('top_k', [3, None])
def test_a_router_override_reaches_decoding(router, top_k):
    """A layer whose route is overridden, with or without parameters of its own, decodes through it (the plain
    step, not the fused kernel): forward = prefill + steps in float64, every parameter random, and its logits are
    not the standard router's."""
    torch.manual_seed(0)
    model = randomized(fm_model(router, top_k=top_k, fm_conv=4, fm_gate=True)).double().eval()
    standard = fm_model(top_k=top_k, fm_conv=4, fm_gate=True).double().eval()
    standard.load_state_dict(model.state_dict(), strict=False)
    idx = torch.randint(0, 64, (2, 20))
    assert rel_err(standard(idx)[0], model(idx)[0]) > 1e-2, "the override changes nothing"
    assert_decodes_as_it_trains(model, idx, 9)
    assert fused(model) == [False, False], "the probe took the fused kernel for a route of one's own"


@core
@pytest.mark.parametrize('init', ['default', 'random'])
def test_a_route_near_the_papers_is_refused_in_every_layer(init):
    """Fork 1b (issue 51): a route 1e-5 from the paper's decodes through route as written in every layer, at the
    default initialisation and with every parameter random (float64, 4 layers)."""
    torch.manual_seed(0)
    model = fm_model('floored', n_layer=4, top_k=3, fm_conv=4, fm_gate=True).double().eval()
    if init == 'random':
        randomized(model)
    assert_decodes_as_it_trains(model, torch.randint(0, 64, (2, 20)), 9)
    assert fused(model) == [False] * 4, f"the fused kernel was chosen in layers {fused(model)}"


@core
@pytest.mark.parametrize('compiled', [False, True])
def test_router_scores_trained_after_the_state_was_made_reach_decoding(compiled, monkeypatch):
    """Fork 2 (issue 51): a state made before training, while the fork's row bias and temperature are zero, then
    trained (every parameter random): decoding, eager and as a compiled step (torch.compiler.is_compiling), takes
    the trained router_scores, float64, with the fused kernel."""
    torch.manual_seed(0)
    model = fm_model('row_scores', top_k=3, fm_conv=4, fm_gate=True).double().eval()
    state = model.init_state(2, 20)
    randomized(model)
    idx = torch.randint(0, 64, (2, 20))
    logits, _ = model(idx)
    model_module.write_state(state, model.hidden(idx[:, :9])[1])
    if compiled:
        monkeypatch.setattr(torch.compiler, 'is_compiling', lambda: True)
    stepped = torch.stack([model.step(idx[:, t], state) for t in range(9, 20)], 1)
    assert rel_err(stepped, logits[:, 9:]) < 1e-12, f"{DECODING}: {apart(stepped, logits[:, 9:], 9)}"
    assert fused(model) == [True, True], f"the probe refused an edit of router_scores alone: {INHERITED}"


def test_a_down_proj_of_ones_own_is_called():
    """SwiGLU calls a down_proj of one's own (a LoRA, a quantised product) as it is; a plain nn.Linear may take the
    batch-1 Triton product."""
    class Doubled(torch.nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)
    mlp, x = model_module.SwiGLU(tiny_config()), torch.randn(3, 32)
    plain = mlp(x)
    doubled = Doubled(mlp.down_proj.in_features, mlp.down_proj.out_features, bias=False)
    doubled.weight, mlp.down_proj = mlp.down_proj.weight, doubled
    assert torch.allclose(mlp(x), 2 * plain)


@core
def test_router_scores_in_the_weights_dtype_decode_as_written():
    """A router whose scores come out in its weights' dtype: a float32 model takes the fused kernel and decodes as it
    trains; with bfloat16 weights the scores are not the kernel's float32 ones, and the probe refuses it."""
    torch.manual_seed(0)
    model = randomized(fm_model('casting', top_k=3, fm_conv=4, fm_gate=True)).eval()
    assert_decodes_as_it_trains(model, torch.randint(0, 64, (2, 20)), 9, tol=1e-5)
    assert fused(model) == [True, True], f"the probe refused float32 scores: {INHERITED}"
    model.to(torch.bfloat16).init_state(1, 1)
    assert fused(model) == [False, False], "the probe took bfloat16 scores for the fused kernel"


@core
def test_a_router_the_probe_cannot_run_decodes_as_written():
    """A float32 model whose route refuses float64: the probe cannot run it, and decoding takes route as written
    (not a traceback at init_state)."""
    torch.manual_seed(0)
    model = randomized(fm_model('float32', top_k=3, fm_conv=4, fm_gate=True)).eval()
    assert_decodes_as_it_trains(model, torch.randint(0, 64, (2, 20)), 9, tol=1e-5)
    assert fused(model) == [False, False], "the probe took the fused kernel for a route it could not run"


IN_PLACE_EDITS = {  # a forker's edit of model.py: (the line, its replacement)
    'route': ('        return idx, alpha, torch.sigmoid(eta_logit), torch.sigmoid(mu_logit)',  # rows moved on
              '        return (idx + 1) % self.n_memory, alpha, torch.sigmoid(eta_logit), torch.sigmoid(mu_logit)'),
    'route floored': ('        alpha = torch.softmax(logits / self.tau, dim=-1)',  # fork 1b of issue 51
                      '        alpha = torch.softmax(logits / self.tau, dim=-1) + 1e-5'),
    'router_scores': ('        x = x.to(dtype)\n',  # routing on an RMS-normalised input
                      '        x = x.to(dtype) * torch.rsqrt(x.to(dtype).pow(2).mean(-1, keepdim=True) + 1e-6)\n'),
    'weights': ('        return eta * alpha, mu * alpha\n',  # theta = eta alpha no more
                '        return 0.5 * eta * alpha, mu * alpha\n'),
    'router_scores previous token': ('        x = x.to(dtype)\n',  # issue 62: the token before read too
                                     '        x = x.to(dtype) + F.pad(x.to(dtype), (0, 0, 1, 0))[..., :-1, :]\n')}


@core
@pytest.mark.parametrize('edit', [edit for edit in IN_PLACE_EDITS if 'previous' not in edit])
def test_a_router_edited_in_place_decodes_as_it_trains(edit, tmp_path, monkeypatch):
    """A forker edits route, router_scores or weights in model.py itself: decoding follows the edit, float64, every
    parameter random, 4 layers; an edit of route or weights refuses the fused kernel in every layer (with the fused
    kernel taken regardless, the gap of rows moved on by one was 1.04), one of router_scores keeps it (the kernel
    takes router_scores as written)."""
    edited = edited_model(edit, tmp_path, monkeypatch)
    torch.manual_seed(0)
    model = randomized(edited.Model(tiny_config(n_layer=4, top_k=3, fm_conv=4, fm_gate=True))).double().eval()
    assert_decodes_as_it_trains(model, torch.randint(0, 64, (2, 20)), 9)
    why = INHERITED if edit == 'router_scores' else 'a bug'
    assert fused(model) == [edit == 'router_scores'] * 4, f"the fused kernel chosen in layers {fused(model)}: {why}"


@core
@pytest.mark.parametrize('top_k', [3, None])
def test_a_learned_temperature_keeps_the_fused_kernel(top_k):
    """LearnedTauFM (tau a parameter, random): the probe compares the copy's route with its twin at the copy's tau,
    and takes the fused kernel; decoding is training's, float64."""
    torch.manual_seed(0)
    model = randomized(fm_model('learned_tau', top_k=top_k, fm_conv=4, fm_gate=True)).double().eval()
    assert_decodes_as_it_trains(model, torch.randint(0, 64, (2, 20)), 9)
    assert fused(model) == [True, True], f"the probe refused a learned tau (the twin takes the copy's): {INHERITED}"


def edited_model(edit, tmp_path, monkeypatch):
    """model.py with IN_PLACE_EDITS[edit] made, imported as the module edited_model."""
    source = (Path(REPO) / 'model.py').read_text()
    line, replacement = IN_PLACE_EDITS[edit]
    assert source.count(line) == 1, (f"the line of this test's edit is no longer in model.py once: {line!r}: expected "
                                     f"after an edit of that line; make the edit on its new form (IN_PLACE_EDITS)")
    (tmp_path / 'model.py').write_text(source.replace(line, replacement))
    spec = importlib.util.spec_from_file_location('edited_model', tmp_path / 'model.py')
    edited = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, 'edited_model', edited)
    spec.loader.exec_module(edited)
    return edited


@core
@pytest.mark.parametrize('fork, why', [
    ('previous_token', 'its routing at a token moves when only other tokens change, and a decoding step sees one'),
    ('in place', 'its routing at a token moves when only other tokens change'),
    ('shaped', r"it routes a step's tokens \(B, d_model\) otherwise than the forward pass's \(B, T, d_model\)")])
def test_a_router_that_reads_other_tokens_refuses_to_decode(fork, why, tmp_path, monkeypatch):
    """Issue 62: a router reading the token before (through --mixer=test_fm:PreviousTokenFM, or edited in model.py)
    trains right and would decode wrong: init_state refuses in one line naming the mixer and why, and so does
    generation, before any token; so does a router that routes a step's tokens otherwise. Every parameter random."""
    torch.manual_seed(0)
    if fork == 'in place':
        edited = edited_model('router_scores previous token', tmp_path, monkeypatch)
        model, name = edited.Model(tiny_config(top_k=3)), 'edited_model:FactorizationMemory'
    else:
        model, name = fm_model(fork, top_k=3, fm_conv=4, fm_gate=True), f'test_fm:{ROUTERS[fork].__name__}'
    model = randomized(model).eval()
    for decode in (lambda: model.init_state(2, 20), lambda: Generator(model).generate([[1, 2]], 4)):
        with pytest.raises(fm_kernel.DecodingError, match=f'^{name} does not decode: {why}') as e:
            decode()
        assert '\n' not in str(e.value)


def test_a_router_the_probe_draws_to_nan_decodes_as_written():
    """A router that reads its token alone, NaN at the probe's random parameters: not refused for that, and decoded
    through route as written (float64, s = 3)."""
    torch.manual_seed(0)
    model = randomized(fm_model('log', top_k=3)).double().eval()
    with torch.no_grad():
        for block in model.blocks:
            block.mixer.s.fill_(3.0)
    assert_decodes_as_it_trains(model, torch.randint(0, 64, (2, 20)), 9)
    assert fused(model) == [False, False], "the probe took the fused kernel for NaN weights"


def test_a_router_with_a_step_of_its_own_is_not_refused():
    """A class whose step is its own says how it decodes: the probe does not refuse its router (the parity tests
    check its step)."""
    model = randomized(fm_model('own_step', top_k=3))
    model.init_state(2, 20)
    assert fused(model) == [True, True], f"the probe refused PreviousTokenFM's fused kernel: {INHERITED}"


@needs_triton
@pytest.mark.parametrize('top_k, tau, router, block', [
    (3, 1.0, 'standard', False), (None, 1.0, 'standard', False), (3, 0.5, 'standard', False),
    (3, 1.0, 'override', False), (None, 0.5, 'override', False), (3, 1.0, 'standard', True), (3, 0.5, 'kernel', True)])
def test_step_matches_forward_through_the_triton_kernels(top_k, tau, router, block):
    """The dispatch the model takes on CUDA (fm_scan; fm_route_step where the probe found the router fused, else
    fm_step; the Triton down product, the router's reduction of a compiled step), here under the interpreter, in
    float32; with tau, which reaches the step's kernel apart from the forward's router."""
    torch.manual_seed(0)
    model = randomized(fm_model(router, top_k=top_k, tau=tau, fm_conv=4 * block, fm_gate=block)).to(DEVICE).eval()
    idx = torch.randint(0, 64, (2, 37), device=DEVICE)
    plain, _ = model(idx)
    steps = []
    with using_scan(fm_scan), pytest.MonkeyPatch.context() as patch:
        patch.setattr(model_module, 'triton_step', lambda h: True)
        for name in ('fm_step', 'fm_route_step'):
            step = getattr(fm_kernel, name)
            patch.setattr(fm_kernel, name, lambda *args, step=step, **kw: steps.append(step) or step(*args, **kw))
        patch.setattr(model_module, 'decode_linear', lambda x, weight: F.linear(x, weight) if x.dim() != 2 else
                      torch.cat([fm_kernel.decode_product(row[None], weight) for row in x]))  # every step's rows
        logits, _ = model(idx)
        state = model.init_state(2, 37, DEVICE)
        with patch.context() as compiling:  # the router's scores as a compiled step reduces them
            compiling.setattr(torch.compiler, 'is_compiling', lambda: True)
            stepped = [model.step(idx[:, t], state) for t in range(idx.shape[1])]
    stepped = torch.stack(stepped, 1)
    assert rel_err(stepped, logits) < 1e-5, f"{DECODING}: {apart(stepped, logits)}"
    assert rel_err(logits, plain) < 1e-5, f"fm_scan's forward differs from fm_scan_torch's: {apart(logits, plain)}"
    assert set(steps) == {fm_kernel.fm_route_step if fused(model)[0] else fm_kernel.fm_step}
    assert fused(model)[0] or router != 'kernel', "the probe refused a router that is the kernel's by construction"


# ----------------------------------------------------------------------------- config and accounting

@pytest.mark.parametrize('overrides, field', [
    (dict(top_k=0), 'top_k'),
    (dict(top_k=9), 'top_k'),
    (dict(mixer='rnn'), 'mixer'),
    (dict(mixer='os:path'), 'mixer'),  # module:Class, but no mixer's subclass
    (dict(d_model=0), 'd_model'),
    (dict(n_layer=-1), 'n_layer'),
    (dict(tau=0.0), 'tau'),
    (dict(n_memory=0), 'n_memory'),
    (dict(mixer='attn', d_model=30), 'd_model'),
    (dict(mixer='attn', n_kv_head=3), 'n_kv_head'),
    (dict(mixer='attn', d_model=36), 'n_head'),
    (dict(mixer='mamba2', mamba_head_dim=24), 'mamba_head_dim'),
    (dict(mixer='mamba2', d_state=0), 'd_state'),
    (dict(fm_conv=1000), 'fm_conv'),
    (dict(tau=1e-30), 'tau'),
    (dict(mixer='attn', chunk_size=0), 'chunk_size'),  # every mixer's (one of one's own may chunk)
])
def test_bad_config_raises_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=rf'\b{field}\b'):
        tiny_config(**overrides)
    config = tiny_config(mixer=overrides['mixer'] if overrides.get('mixer') in model_module.MIXER_CLASSES else 'fm')
    for key, value in overrides.items():  # a good config changed afterwards: the model checks it again
        setattr(config, key, value)
    with pytest.raises(ValueError, match=rf'\b{field}\b'):
        Model(config)


def test_defaults_resolve():
    config = ModelConfig()
    assert (config.d_ff, config.d_memory, config.top_k, config.n_kv_head) == (704, 256, 64, None)
    assert ModelConfig(mixer='attn').n_kv_head == 8 and ModelConfig(fm_conv=4, fm_gate=True).d_ff == 704 - 87


@pytest.mark.parametrize('tie', [True, False])
def test_num_params(tie):
    model = Model(tiny_config(tie_embeddings=tie))
    embedding = 64 * 32
    total = sum(p.numel() for p in model.parameters())
    assert model.num_params(non_embedding=False) == total
    assert model.num_params() == total - embedding * (1 if tie else 2) > 0


@pytest.mark.parametrize('name', MIXER_CASES)
def test_flops_per_token(name):
    """Above 6 N; attention's term grows with the context (QK^T and AV), a recurrent mixer's does not; sparse FM
    saves 3 (9 d_memory + 5) FLOPs a row it skips."""
    model = Model(tiny_config(**MIXER_CASES[name]))
    assert model.flops_per_token(48) > 6 * model.num_params()
    context = 12 * 2 * (4096 - 48) * 32 if name == 'attn' else 0
    assert model.flops_per_token(4096) - model.flops_per_token(48) == context
    if name == 'fm_sparse':
        dense = Model(tiny_config(**MIXER_CASES['fm_dense']))
        assert dense.flops_per_token(48) - model.flops_per_token(48) == 3 * 2 * (8 - 3) * (9 * 32 + 5)


@core
@pytest.mark.parametrize('name', MIXER_CASES)
def test_step_state_bytes(name):
    """bench.py's decoding floor: each mixer's bytes of state a step reads and writes for one sequence after 100
    tokens, with float32 and bfloat16 weights: at most its whole state twice, and by hand: FM's k rows of 32 (float32)
    and the convolution's window of 3, Mamba-2's conv (80 channels x 3) and SSM (4 heads x 16 x 8, float32) states,
    attention's cache of 2 x 16 a token."""
    rows = 2 * (3 if name.endswith('sparse') else 8) * 32 * 4
    for dtype in (torch.float32, torch.bfloat16):
        n = dtype.itemsize  # the windows and the cache; FM's rows and Mamba-2's SSM state stay float32
        hand = {'fm_dense': rows, 'fm_sparse': rows, 'fm_block_dense': rows + 2 * 32 * 3 * n,
                'fm_block_sparse': rows + 2 * 32 * 3 * n, 'attn': 2 * 100 * 16 * n,
                'mamba2': 2 * (80 * 3 * n + 512 * 4)}
        model = Model(tiny_config(**MIXER_CASES[name])).to(dtype)
        counts = [block.mixer.step_state_bytes(100) for block in model.blocks]
        assert 0 < counts[0] <= 2 * sum(t.numel() * t.element_size() for t in model.init_state(1, 101)[0].values())
        if name in hand:
            assert counts == [hand[name]] * 2


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


if __name__ == "__main__":  # the whole suite: this file and tests/ (pytest.ini's testpaths)
    root = os.path.dirname(os.path.abspath(__file__))
    args = sys.argv[1:]
    if not any(a.startswith("-m") for a in args):  # no -m given: all but the slow real-size GPU checks (.ci/gpu's)
        args += ["-m", "not slow"]
    if (importlib.util.find_spec("xdist") and not any("no:xdist" in a for a in args)
            and not any(a.startswith(("-n", "--numprocesses", "--pdb", "--trace")) for a in args)):
        args += ["-n", str(default_workers())]  # a worker a core, on GPUs as many as they hold (conftest.py)
    sys.exit(pytest.main([os.path.join(root, "test_fm.py"), os.path.join(root, "tests"), "-q", "-rfEs", *args]))
