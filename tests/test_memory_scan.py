"""model.memory_scan's choice of scan: sparse FM through the sparse scans, and what a dense FM past the
Triton rows says."""
import warnings

import pytest
import torch

import fm_kernel
import model as model_module
from fm_kernel import fm_scan_torch
from model import Model
from test_fm import DEVICE, assert_decodes_as_it_trains, core, randomized, rel_err, tiny_config, using_scan


def test_dense_fm_past_the_triton_rows_says_it_runs_the_slow_scan(monkeypatch):
    """Dense FM above MAX_ROWS on a GPU takes PyTorch's scan: a warning says so and names top_k; sparse FM
    (the sparse scan) and dense FM within MAX_ROWS say nothing."""
    monkeypatch.setattr(model_module, 'triton_scan', lambda x: True)
    monkeypatch.setattr(fm_kernel, 'fm_scan', lambda x, theta, phi, h0, eps: (x, h0))
    monkeypatch.setattr(fm_kernel, 'fm_sparse_scan', lambda x, *args: (x, None))
    M = fm_kernel.MAX_ROWS + 1
    x, theta, phi = torch.randn(1, 3, 4), torch.rand(1, 3, M), torch.rand(1, 3, M)
    with pytest.warns(UserWarning, match="top_k < n_memory"):
        model_module.memory_scan(x, None, theta, phi, None, M, 1e-6, 16)
    idx = torch.arange(2).expand(1, 3, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model_module.memory_scan(x, idx, theta[..., :2], phi[..., :2], None, M, 1e-6, 16)
        model_module.memory_scan(x, None, theta[..., :M - 1], phi[..., :M - 1], None, M - 1, 1e-6, 16)


@core
@pytest.mark.parametrize("triton", [False, True])
def test_sparse_fm_trains_and_decodes_through_the_sparse_scan(triton):
    """A sparse FM block (every parameter random, float32, padded rows) takes the sparse scan at every m when
    SPARSE_ROWS says so: Triton (under the interpreter) or PyTorch, equal to the dense scan of the same model, and
    its decoding matches its forward pass."""
    torch.manual_seed(0)
    model = randomized(Model(tiny_config(n_memory=40, top_k=3, fm_conv=4, fm_gate=True))).to(DEVICE).eval()
    idx = torch.randint(0, 64, (2, 37), device=DEVICE)
    lengths = torch.tensor([37, 20], device=DEVICE)
    scans = []
    with using_scan(fm_scan_torch):
        dense = model.hidden(idx, lengths=lengths)[0]
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(model_module.SPARSE_ROWS, 'torch', 1)
        patch.setitem(model_module.SPARSE_ROWS, 'triton', 1)
        patch.setattr(model_module, 'triton_scan', lambda x: triton)
        for name in ('fm_sparse_scan', 'fm_sparse_scan_torch'):
            scan = getattr(fm_kernel, name)
            patch.setattr(fm_kernel, name, lambda *a, scan=scan, **kw: scans.append(scan) or scan(*a, **kw))
        sparse = model.hidden(idx, lengths=lengths)[0]
        assert_decodes_as_it_trains(model, idx, 9, tol=1e-5)
    want = fm_kernel.fm_sparse_scan if triton else fm_kernel.fm_sparse_scan_torch
    assert set(scans) == {want}, f"the sparse model ran {scans}"
    assert rel_err(sparse[0], dense[0]) < 1e-5 and rel_err(sparse[1, :20], dense[1, :20]) < 1e-5
