"""The batch-1 decoding product: one row x (1, K) times a weight (N, K), in Triton.

At batch 1 a decoding step is a chain of one-row products, each reading its whole weight
once: the step's speed is the bandwidth they reach. inductor writes a one-row product as a
reduction, fast alone, but inside a compiled step it fuses SwiGLU's silu(gate) * up into
the down product's loads, where every program recomputes it, and the product then runs at
38% of the copy bandwidth (docs/kernel_log.md). decode_product is a custom op, so that its
input is computed once, and streams the weight in (BN, BK) tiles, STAGES of them in
flight, one program per BN outputs. model.SwiGLU takes it through decode_linear.

| function             | what it is                                                  |
| -------------------- | ----------------------------------------------------------- |
| decode_product_naive | F.linear of one row: the reference                          |
| decode_product       | the same in Triton (fm::decode_product)                     |
| decode_linear        | decode_product for one half-precision row on CUDA, else F.linear |
"""
import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # F.linear works without Triton
    triton = None


def decode_product_naive(x, weight):
    """x (1, K), weight (N, K) -> x W^T (1, N): the reference."""
    return F.linear(x, weight)


if triton is not None:
    @triton.jit
    def _decode_product_kernel(x_ptr, w_ptr, y_ptr, N, K, BN: tl.constexpr,
                               BK: tl.constexpr, STAGES: tl.constexpr,
                               ACC: tl.constexpr):
        """Outputs [pid BN, pid BN + BN): the (BN, K) slab of the weight in BK-wide
        tiles, STAGES of them in flight, times x, summed in ACC."""
        offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
        acc = tl.zeros((BN,), dtype=ACC)
        for k0 in tl.range(0, K, BK, num_stages=STAGES):
            offs_k = k0 + tl.arange(0, BK)
            k_ok = offs_k < K
            mask = (offs_n < N)[:, None] & k_ok[None, :]
            w_ptrs = w_ptr + offs_n[:, None] * K + offs_k[None, :]
            w = tl.load(w_ptrs, mask=mask, other=0.0).to(ACC)  # (BN, BK)
            x = tl.load(x_ptr + offs_k, mask=k_ok, other=0.0).to(ACC)  # (BK,)
            acc += tl.sum(w * x[None, :], axis=1)
        tl.store(y_ptr + offs_n, acc.to(y_ptr.dtype.element_ty), mask=offs_n < N)


def _decode_product_meta(K):
    """Launch settings, the best of a sweep at fm_1b's down product (K = 5,504 inputs,
    N = 2048 outputs) on an H200 (docs/kernel_log.md): 8 outputs a program, 1024-wide
    tiles, 3 in flight, 4 warps."""
    return dict(BN=8, BK=min(1024, triton.next_power_of_2(K)), STAGES=3, num_warps=4)


@torch.library.custom_op("fm::decode_product", mutates_args=())
def _decode_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T (1, N) in x's dtype."""
    N, K = weight.shape
    meta = _decode_product_meta(K)
    y = x.new_empty(1, N)
    acc = tl.float32
    if x.dtype == torch.float64:
        acc = tl.float64
    grid = (triton.cdiv(N, meta["BN"]),)
    _decode_product_kernel[grid](x.contiguous(), weight.contiguous(), y, N, K, ACC=acc, **meta)
    return y


@_decode_product.register_fake
def _(x, weight):
    return x.new_empty(1, weight.shape[0])


def decode_product(x, weight):
    """Triton x W^T for one row x (1, K) and weight (N, K) of x's dtype -> (1, N)."""
    one_row = x.dim() == 2 and x.shape[0] == 1 and weight.dim() == 2
    if not one_row or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x must be one row (1, K) and weight (N, K) with the same K, "
                         f"got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype != weight.dtype:
        raise ValueError(f"x and weight must have one dtype, got {x.dtype} and {weight.dtype}")
    return _decode_product(x, weight)


def decode_linear(x, weight):
    """A decoding step's product x (B, K) W^T: the Triton product for one row on CUDA in
    half precision, F.linear elsewhere (for more rows this kernel is far slower than
    cuBLAS's, docs/kernel_log.md)."""
    half = x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
    one_row = x.dim() == 2 and x.shape[0] == 1
    if triton is not None and x.is_cuda and one_row and half:
        return decode_product(x, weight)
    return F.linear(x, weight)
