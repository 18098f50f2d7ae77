"""The sparse scan on a GPU against fm_sparse_scan_torch in float64 (real shapes, bf16 and fp32,
routing even and uneven): relative errors of y, hT and every gradient.

    python dev/sparse_check.py
"""
import torch

import fm_kernel


def inputs(B, T, D, m, k, dtype, uneven):
    """x, idx, theta, phi, h0; uneven: one row in every token's top k (most rows empty)."""
    scores = torch.randn(B, T, m, device="cuda") * 2
    if uneven:
        scores[..., 0] += 100
    alpha, idx = torch.softmax(scores, -1).topk(k, -1)
    theta = torch.rand(B, T, k, device="cuda") * alpha / alpha.sum(-1, keepdim=True)
    phi = torch.rand(B, T, k, device="cuda")
    x = torch.randn(B, T, D, device="cuda").to(dtype)
    return x, idx, theta, phi, torch.randn(B, m, D, device="cuda")


def errors(B, T, D, m, k, dtype, uneven):
    x, idx, theta, phi, h0 = inputs(B, T, D, m, k, dtype, uneven)
    ref_in = [t.double().requires_grad_() for t in (x, theta, phi, h0)]
    y, hT = fm_kernel.fm_sparse_scan_torch(ref_in[0], idx, *ref_in[1:3], m, ref_in[3])
    gy, gh = torch.randn_like(y), torch.randn_like(hT)
    ref = [y, hT, *torch.autograd.grad((y * gy).sum() + (hT * gh).sum(), ref_in)]
    ins = [t.detach().to(x.dtype if i == 0 else torch.float32).requires_grad_()
           for i, t in enumerate(ref_in)]
    y, hT = fm_kernel.fm_sparse_scan(ins[0], idx, *ins[1:3], m, ins[3])
    loss = (y.double() * gy).sum() + (hT.double() * gh).sum()
    got = [y, hT, *torch.autograd.grad(loss, ins)]
    return [((a.double() - b).norm() / b.norm()).item() for a, b in zip(got, ref)]


if __name__ == "__main__":
    names = ["y", "hT", "dxbar", "dtheta", "dphi", "dh0"]
    for shape in ((2, 512, 2048, 64, 8), (8, 256, 128, 1024, 8), (2, 300, 96, 65536, 8),
                  (4, 200, 64, 16, 15)):
        for dtype in (torch.float32, torch.bfloat16):
            for uneven in (False, True):
                errs = errors(*shape, dtype, uneven)
                bad = "" if max(errs) < (1e-4 if dtype == torch.float32 else 1e-2) else "  FAIL"
                print(shape, str(dtype)[6:], "uneven" if uneven else "even  ",
                      " ".join(f"{n} {e:.1e}" for n, e in zip(names, errs)) + bad, flush=True)
