"""The test suite: `python test_fm.py` (or `pytest test_fm.py`).

Chain of references: the float64 loop `fm_scan_naive` checks `fm_scan_torch`, and both check the
Triton kernels, which run on the CPU under TRITON_INTERPRET=1 when no GPU is present (as in CI).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first Triton import

import pytest

import fm_kernel
from fm_kernel import fm_scan, fm_scan_naive, fm_scan_torch, fm_step, fm_step_naive

CUDA = torch.cuda.is_available()
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


# ----------------------------------------------------------------------------- references


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


@pytest.mark.parametrize("rate", [1e-4, 0.5, 1 - 1e-6, 1.0])
def test_chunked_torch_extreme_rates(rate):
    torch.manual_seed(1)
    inputs = scan_inputs(1, 50, 16, 8, 2, rate=rate)
    grad_y, grad_h = torch.randn(1, 50, 16, dtype=torch.float64), torch.randn(1, 8, 16, dtype=torch.float64)
    want = scan_and_grads(fm_scan_naive, inputs, grad_y, grad_h)
    got = scan_and_grads(fm_scan_torch, inputs, grad_y, grad_h, chunk_size=16)
    if rate == 1.0:  # every row is overwritten, so dh0 is 0 up to e^-80; dtheta omits the decay term
        assert got[5].abs().max() < 1e-30 and torch.isfinite(got[3]).all()  # at theta = 1 (documented)
        got[3] = want[3] = got[5] = want[5] = torch.ones(1)
    assert_close_all(got, want, 1e-10)


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
    (1, 64, 96, 8, 8, True),
]


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_triton_scan_matches_loop(case, poisoned_outputs):
    B, T, D, M, k, with_h0 = case
    torch.manual_seed(T + M)
    inputs = scan_inputs(B, T, D, M, k, h0=with_h0)
    grad_y, grad_h = torch.randn(B, T, D, dtype=torch.float64), torch.randn(B, M, D, dtype=torch.float64)
    want = scan_and_grads(fm_scan_naive, inputs, grad_y, grad_h)
    f32 = [t.float().to(DEVICE) if t is not None else None for t in inputs]
    got = scan_and_grads(fm_scan, f32, grad_y.to(DEVICE), grad_h.to(DEVICE))
    assert_close_all([g.cpu() for g in got], want, 2e-5)


@pytest.mark.parametrize("rate", [1e-4, 1 - 1e-4])
def test_triton_scan_extreme_rates(rate, poisoned_outputs):
    torch.manual_seed(3)
    inputs = scan_inputs(1, 40, 32, 8, 2, rate=rate)
    grad_y, grad_h = torch.randn(1, 40, 32, dtype=torch.float64), torch.randn(1, 8, 32, dtype=torch.float64)
    want = scan_and_grads(fm_scan_naive, inputs, grad_y, grad_h)
    got = scan_and_grads(fm_scan, [t.float().to(DEVICE) for t in inputs], grad_y.to(DEVICE), grad_h.to(DEVICE))
    got = [g.cpu() for g in got]
    # dtheta = dk - dlog(1-theta) / (1 - theta): float32 rounding grows like 1 / (1 - theta) there
    assert rel_err(got[3], want[3]) < 2e-5 / (1 - rate)
    got[3] = want[3] = torch.ones(1)
    assert_close_all(got, want, 2e-5 if rate < 0.5 else 1e-3)  # dh0 of nearly erased rows is tiny


def test_triton_scan_bf16_inputs():
    torch.manual_seed(4)
    inputs = scan_inputs(1, 70, 32, 16, 4)
    grad_y, grad_h = torch.randn(1, 70, 32, dtype=torch.float64), torch.randn(1, 16, 32, dtype=torch.float64)
    want = scan_and_grads(fm_scan_naive, inputs, grad_y, grad_h)
    x, theta, phi, h0 = inputs
    bf16 = [x.bfloat16().to(DEVICE), theta.float().to(DEVICE), phi.float().to(DEVICE), h0.float().to(DEVICE)]
    got = scan_and_grads(fm_scan, bf16, grad_y.to(DEVICE), grad_h.to(DEVICE))
    assert got[0].dtype == torch.bfloat16 and got[2].dtype == torch.bfloat16
    assert_close_all([g.cpu() for g in got], want, 1e-2)


def test_triton_scan_packed_documents_restart_memory(poisoned_outputs):
    torch.manual_seed(5)
    lengths = [5, 70, 1, 30]
    D, M, k = 16, 8, 3
    x, theta, phi, _ = scan_inputs(1, sum(lengths), D, M, k, h0=False)
    x, theta, phi = (t.float().to(DEVICE).requires_grad_() for t in (x, theta, phi))
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=DEVICE)
    y, hT = fm_scan(x, theta, phi, cu_seqlens=cu_seqlens)
    grad_y = torch.randn_like(y)
    grads = torch.autograd.grad((y * grad_y).sum(), [x, theta, phi])
    ys, grads_docs = [], [[], [], []]
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        doc = [t.detach()[:, start:end].double().requires_grad_() for t in (x, theta, phi)]
        y_doc, h_doc = fm_scan_naive(*doc)
        ys.append(y_doc)
        for acc, g in zip(grads_docs, torch.autograd.grad((y_doc * grad_y[:, start:end].double()).sum(), doc)):
            acc.append(g)
    assert rel_err(y, torch.cat(ys, 1)) < 1e-5
    assert rel_err(hT, h_doc) < 1e-5
    for g, g_docs in zip(grads, grads_docs):
        assert rel_err(g, torch.cat(g_docs, 1)) < 1e-4


@pytest.mark.parametrize("K,M,D", [(1, 4, 16), (3, 10, 40), (8, 8, 100)])
def test_triton_step_matches_naive(K, M, D, poisoned_outputs):
    torch.manual_seed(K + M)
    B = 3
    h = torch.randn(B, M, D, device=DEVICE)
    x = torch.randn(B, D, device=DEVICE)
    idx = torch.stack([torch.randperm(M)[:K] for _ in range(B)]).to(DEVICE)
    theta, phi = torch.rand(B, K, device=DEVICE), torch.rand(B, K, device=DEVICE)
    h_naive = h.clone()
    y_naive = fm_step_naive(h_naive, x, idx, theta, phi)
    y = fm_step(h, x, idx, theta, phi)
    assert rel_err(y, y_naive) < 1e-6
    assert torch.allclose(h, h_naive, rtol=1e-6, atol=1e-6)
    untouched = torch.ones(B, M, dtype=torch.bool, device=DEVICE).scatter(1, idx, False)
    assert torch.equal(h[untouched], h_naive[untouched])


def test_scan_rejects_bad_shapes():
    x = torch.randn(1, 4, 8)
    with pytest.raises(ValueError, match="theta"):
        fm_scan(x, torch.rand(1, 5, 4), torch.rand(1, 5, 4))
    with pytest.raises(ValueError, match="h0"):
        fm_scan(x, torch.rand(1, 4, 4), torch.rand(1, 4, 4), h0=torch.randn(1, 3, 8))


@pytest.mark.skipif(not CUDA, reason="real sizes need a GPU")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_triton_scan_real_size_gpu(dtype, tol):
    torch.manual_seed(6)
    B, T, D, M, k = 2, 2048 + 37, 2048, 64, 8
    inputs = scan_inputs(B, T, D, M, k, device="cuda")
    grad_y, grad_h = torch.randn_like(inputs[0]), torch.randn_like(inputs[3])
    want = scan_and_grads(fm_scan_torch, inputs, grad_y, grad_h)
    x, theta, phi, h0 = inputs
    got = scan_and_grads(fm_scan, [x.to(dtype), theta.float(), phi.float(), h0.float()], grad_y, grad_h)
    assert_close_all(got, want, tol)


if __name__ == "__main__":
    import sys
    sys.exit(pytest.main([__file__, "-q", *sys.argv[1:]]))
