"""The one-row product of a decoding step at batch 1: y = x W^T, x (1, K), W (N, K) as nn.Linear holds it, in
Triton, beside its naive twin.

At batch 1 a decoding step is a chain of such products, each reading its whole weight once: the step's speed is
the bandwidth they reach. inductor writes a one-row product as a reduction (STEP_COMPILE_OPTIONS in generate.py),
fast alone, but inside a compiled step it fuses SwiGLU's silu(gate) * up into the down product's loads, where every
program recomputes it, and the product then runs at 38% of the copy bandwidth (docs/kernel_log.md).
This kernel is a custom op, so that its input is computed once, and streams the weight in (BN, BK) tiles,
STAGES of them in flight, one program per BN outputs.

| function     | what it is                                      |
| ------------ | ----------------------------------------------- |
| linear_naive | F.linear, the reference                         |
| linear       | the Triton product (a custom op, decode::linear) |
"""

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def linear_naive(x, weight):
    """x (1, K), weight (N, K) -> x W^T (1, N): the reference."""
    return F.linear(x, weight)


if triton is not None:
    @triton.jit
    def _linear_kernel(x_ptr, w_ptr, y_ptr, N, K, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
                       ACC: tl.constexpr):
        """Outputs [pid BN, pid BN + BN): the (BN, K) slab of the weight in BK-wide tiles, STAGES of them in
        flight, times x, summed in ACC."""
        offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
        acc = tl.zeros((BN,), dtype=ACC)
        for k0 in tl.range(0, K, BK, num_stages=STAGES):
            offs_k = k0 + tl.arange(0, BK)
            k_ok = offs_k < K
            w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :], mask=(offs_n < N)[:, None] & k_ok[None, :],
                        other=0.0).to(ACC)  # (BN, BK)
            x = tl.load(x_ptr + offs_k, mask=k_ok, other=0.0).to(ACC)  # (BK,)
            acc += tl.sum(w * x[None, :], axis=1)
        tl.store(y_ptr + offs_n, acc.to(y_ptr.dtype.element_ty), mask=offs_n < N)


def _linear_meta(K):
    """Launch settings, the best of a sweep at fm_1b's down product (K = 5,504 inputs, N = 2048 outputs) on an H200
    (docs/kernel_log.md): 8 outputs a program, 1024-wide tiles, 3 in flight, 4 warps."""
    return dict(BN=8, BK=min(1024, triton.next_power_of_2(K)), STAGES=3, num_warps=4)


@torch.library.custom_op("decode::linear", mutates_args=())
def _linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T (1, N) in x's dtype."""
    N, K = weight.shape
    meta = _linear_meta(K)
    y = x.new_empty(1, N)
    _linear_kernel[(triton.cdiv(N, meta["BN"]),)](x.contiguous(), weight.contiguous(), y, N, K,
                                                  ACC=tl.float64 if x.dtype == torch.float64 else tl.float32, **meta)
    return y


@_linear.register_fake
def _(x, weight):
    return x.new_empty(1, weight.shape[0])


def linear(x, weight):
    """Triton x W^T for one row x (1, K) and weight (N, K) of x's dtype -> (1, N)."""
    if x.dim() != 2 or x.shape[0] != 1 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x must be one row (1, K) and weight (N, K) with the same K, got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if x.dtype != weight.dtype:
        raise ValueError(f"x and weight must have one dtype, got {x.dtype} and {weight.dtype}")
    return _linear(x, weight)


def decode_linear(x, weight):
    """A decoding step's product x (B, K) W^T: the Triton product for one row on CUDA in half precision, F.linear
    elsewhere (for more rows this kernel is far slower than cuBLAS's, docs/kernel_log.md)."""
    if triton is not None and x.is_cuda and x.dim() == 2 and x.shape[0] == 1 \
            and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype:
        return linear(x, weight)
    return F.linear(x, weight)
