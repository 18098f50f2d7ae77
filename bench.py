"""Speed of the FM kernels, side by side with the peers, on one GPU.

    python bench.py kernels      # fm_scan vs fm_scan_torch vs SDPA vs Mamba-2 SSD vs GLA; decode; accuracy
    python bench.py sparse       # sparse FM (k = 8) against m, beside the dense scans and Mamba-2
    python bench.py stages       # time of each fm_scan kernel, to see where the time goes
    python bench.py train        # training tokens/s, MFU, peak memory: fm_1b vs transformer_1b vs mamba2_1b
    python bench.py generate     # prefill and decode after long prompts: fm_1b (k = 8, dense), mamba2_1b,
                                 # the published mamba2-1.3b shape, transformer_1b; --sweep: context sweep, plot
    python bench.py generate --profile   # one fm_1b decode step at batch 1 and 64 by kernel kind
    python bench.py gemv         # one- and 64-row products of fm_1b's shapes (cuBLAS, inductor, decode_linear's
                                 # Triton product): GB/s against the copy bandwidth

Kernel shapes: one layer, D = 2048, M = 64, k = 8, 16,384 tokens a batch,
T in {1024, 2048, 8192, 16384}; decode at batch 1 and 64 against a 16K-token KV cache.
Timing: medians of CUDA-graph replays (triton.testing.do_bench_cudagraph): GPU time without Python's launch
overhead (timed eagerly, fm_scan's forward+backward took 2.8 ms, 1.4 ms more than replayed); fresh random inputs.
Mamba-2 peers need `mamba-ssm` (its Triton parts; see README), the gated linear attention peers `fla-core`
(forward only: its gated backward refuses Hopper with Triton < 3.7.1); each is skipped when missing.
"""

import argparse
import os
import sys
import time
import types

import torch
import torch.nn.functional as F

import fm_kernel

SWEEP = [1024, 4096, 16384, 65536]  # generate --sweep's prompt lengths when it names none

D, M, K_SPARSE, TOKENS = 2048, 64, 8, 16384
SEQ_LENS = (1024, 2048, 8192, 16384)


def device_info():
    import triton
    name = torch.cuda.get_device_name()
    return f"{name} | torch {torch.__version__} | triton {triton.__version__}"


def measure_ceilings():
    """Device-to-device copy bandwidth (bytes read + written per s) and bf16 matmul FLOP/s."""
    from triton.testing import do_bench
    src = torch.randn(2**28, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    copy_ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = do_bench(lambda: a @ b, return_mode="median")
    return 2 * src.numel() * 4 / copy_ms * 1e3, 2 * 8192**3 / mm_ms * 1e3


def router_weights(B, T, m, k, device, dtype=torch.float32):
    """theta, phi (B, T, m) as the FM layer makes them: softmax, top-k renormalised, times a rate."""
    alpha = torch.softmax(torch.randn(B, T, m, device=device) * 2, -1)
    if k < m:
        top, idx = alpha.topk(k, -1)
        alpha = torch.zeros_like(alpha).scatter(-1, idx, top / top.sum(-1, keepdim=True))
    eta = torch.sigmoid(torch.randn(B, T, 1, device=device))
    mu = torch.sigmoid(torch.randn(B, T, 1, device=device))
    return (eta * alpha).to(dtype), (mu * alpha).to(dtype)


def fm_inputs(B, T, k, dtype, device="cuda", h0=True):
    x = torch.randn(B, T, D, device=device, dtype=dtype)
    theta, phi = router_weights(B, T, M, k, device)
    h = torch.randn(B, M, D, device=device) if h0 else None
    return [x, theta, phi, h]


def scan_flops_per_token(C=fm_kernel.CHUNK):
    """Matmul FLOPs of the chunked scan per token: forward, backward (the products over D; the per-chunk walks
    of the middle kernels are not counted)."""
    return 4 * C * D + 6 * M * D, 8 * C * D + 14 * M * D


def time_fwd(fn, inputs):
    """Median ms of fn(*inputs) replayed in a CUDA graph: GPU time, without Python's launch overhead."""
    from triton.testing import do_bench_cudagraph
    with torch.no_grad():
        return do_bench_cudagraph(lambda: fn(*inputs), return_mode="median")


def time_fwd_bwd(fn, inputs):
    """Median ms of forward + backward (random upstream gradients) replayed in a CUDA graph. Each step makes
    fresh leaves, so that autograd's gradient accumulators belong to the capturing stream."""
    from triton.testing import do_bench_cudagraph
    with torch.no_grad():
        out = fn(*inputs)
    grads = [torch.randn_like(o) for o in (out if isinstance(out, tuple) else (out,))]

    def step():
        leaves = [t.detach().requires_grad_() if t is not None and t.is_floating_point() else t for t in inputs]
        o = fn(*leaves)
        torch.autograd.backward(o if isinstance(o, tuple) else (o,), grads)
    return do_bench_cudagraph(step, return_mode="median")


def import_mamba():
    """mamba-ssm's Triton ops, or None. Its __init__ imports a CUDA extension we do not build:
    register an empty stand-in first (bench-side shim only)."""
    sys.modules.setdefault("selective_scan_cuda", types.ModuleType("selective_scan_cuda"))
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update
    except Exception as err:  # noqa: BLE001 - any import failure means "peer not available"
        print(f"mamba-ssm not available ({type(err).__name__}: {err}); Mamba-2 rows skipped")
        return None
    return types.SimpleNamespace(ssd=mamba_chunk_scan_combined, step=selective_state_update)


def import_fla():
    """fla-core's chunked gated linear attention (chunk_gla, chunk_simple_gla), or None."""
    try:
        from fla.ops.gla import chunk_gla
        from fla.ops.simple_gla import chunk_simple_gla
    except Exception as err:  # noqa: BLE001 - any import failure means "peer not available"
        print(f"fla-core not available ({type(err).__name__}: {err}); GLA columns skipped")
        return None
    return types.SimpleNamespace(gla=chunk_gla, simple_gla=chunk_simple_gla)


def gla_as_fm(x, theta, phi, h0):
    """FM's recurrence without the row norm as fla's chunk_gla inputs: one head, key dimension M (key theta,
    log-decay log(1 - theta), query phi), value dimension D; returns q, k, v, g (B, T, 1, *) and h0 (B, 1, M, D)."""
    return (phi.to(x.dtype)[:, :, None], theta.to(x.dtype)[:, :, None], x[:, :, None],
            torch.log1p(-theta)[:, :, None], h0[:, None])


def simple_gla_inputs(B, T):
    """A common GLA shape: 16 heads x 128 x 128, one scalar log-decay a head and token."""
    q, k, v = (torch.randn(B, T, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    g = F.logsigmoid(torch.randn(B, T, 16, device="cuda") + 4)
    return [q, k, v, g]


def sdpa_inputs(B, T):
    q = torch.randn(B, 16, T, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, 8, T, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, 8, T, 128, device="cuda", dtype=torch.bfloat16)
    return [q, k, v]


def sdpa_causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def mamba_inputs(B, T, heads=64, d_state=128, head_dim=64):
    x = torch.randn(B, T, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    dt = F.softplus(torch.randn(B, T, heads, device="cuda") - 3).to(torch.bfloat16)
    A = -torch.rand(heads, device="cuda") - 0.5
    Bm = torch.randn(B, T, 1, d_state, device="cuda", dtype=torch.bfloat16)
    Cm = torch.randn(B, T, 1, d_state, device="cuda", dtype=torch.bfloat16)
    return [x, dt, A, Bm, Cm]


def bench_scan(mamba, fla, ceilings):
    rows = []
    bw, mm = ceilings
    flops_fwd, flops_bwd = scan_flops_per_token()
    for T in SEQ_LENS:
        B = TOKENS // T
        row = {"T": T}
        for name, k in (("dense", M), ("k=8", K_SPARSE)):
            fwd = time_fwd(fm_kernel.fm_scan, fm_inputs(B, T, k, torch.bfloat16))
            row[f"fm {name} fwd"] = fwd
            row[f"fm {name} f+b"] = time_fwd_bwd(fm_kernel.fm_scan, fm_inputs(B, T, k, torch.bfloat16))
        row["fm_torch f+b"] = time_fwd_bwd(fm_kernel.fm_scan_torch, fm_inputs(B, T, K_SPARSE, torch.bfloat16))
        row["sdpa f+b"] = time_fwd_bwd(sdpa_causal, sdpa_inputs(B, T))
        if mamba is not None:
            row["mamba2 f+b"] = time_fwd_bwd(lambda x, dt, A, Bm, Cm: mamba.ssd(x, dt, A, Bm, Cm, chunk_size=256),
                                             mamba_inputs(B, T))
        if fla is not None:
            gla = lambda q, k, v, g, h: fla.gla(q, k, v, g, scale=1.0, initial_state=h, output_final_state=True)
            row["gla m=64 fwd"] = time_fwd(gla, gla_as_fm(*fm_inputs(B, T, K_SPARSE, torch.bfloat16)))
            row["simple_gla fwd"] = time_fwd(fla.simple_gla, simple_gla_inputs(B, T))
        fwd_bytes = TOKENS * (2 * D * 2 + 2 * M * 4)  # x in, y out (bf16); theta, phi (fp32)
        row["fwd GB/s"] = fwd_bytes / row["fm k=8 fwd"] / 1e6
        row["fwd TFLOP/s"] = TOKENS * flops_fwd / row["fm k=8 fwd"] / 1e9
        row["f+b TFLOP/s"] = TOKENS * (flops_fwd + flops_bwd) / row["fm k=8 f+b"] / 1e9
        rows.append(row)
        print(row, flush=True)
    print(f"\nfm_scan, one layer, {TOKENS} tokens a batch, D={D}, M={M}; times in ms; bf16 x, fp32 theta/phi")
    print(f"ceilings measured: copy {bw / 1e12:.2f} TB/s, bf16 matmul {mm / 1e12:.0f} TFLOP/s; "
          f"FM FLOPs/token: fwd {flops_fwd / 1e6:.2f} M, bwd {flops_bwd / 1e6:.2f} M")
    print_table(rows)


SPARSE_ROWS = (16, 64, 128, 256, 1024, 4096, 16384)  # m of the sparse table, k = K_SPARSE
# (B, T, d_memory): fm_1b's layer at 16K tokens; the recall model's (research/recall.py)
SPARSE_SHAPES = ((8, 2048, 2048), (64, 256, 128))


def sparse_inputs(B, T, D, m, k, dtype=torch.bfloat16):
    """x (B, T, D), the rows idx and their theta, phi (B, T, k) as the FM layer routes random scores."""
    alpha, idx = torch.softmax(torch.randn(B, T, m, device="cuda") * 2, -1).topk(k, -1)
    alpha = alpha / alpha.sum(-1, keepdim=True)
    eta, mu = torch.rand(2, B, T, 1, device="cuda")
    x = torch.randn(B, T, D, device="cuda", dtype=dtype)
    return x, idx, eta * alpha, mu * alpha


def peak_mb(fn, inputs):
    """Peak memory of one forward + backward beyond what was allocated before it, MB."""
    leaves = [t.detach().requires_grad_() if t.is_floating_point() else t for t in inputs]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn(*leaves)
    torch.autograd.backward(out, [torch.randn_like(o) for o in out])
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def sparse_row(B, T, D, m, mamba):
    """One row of bench_sparse: ms and MB of forward + backward of each scan at (B, T, D, m)."""
    x, idx, theta, phi = sparse_inputs(B, T, D, m, K_SPARSE)
    row = {"B T D": f"{B} {T} {D}", "m": m}
    sparse = lambda x, theta, phi: fm_kernel.fm_sparse_scan(x, idx, theta, phi, m)
    row["sparse ms"] = time_fwd_bwd(sparse, [x, theta, phi])
    row["sparse MB"] = peak_mb(sparse, [x, theta, phi])
    if m <= fm_kernel.MAX_ROWS:
        zeros = theta.new_zeros(B, T, m)
        dense_in = [x, zeros.scatter(-1, idx, theta), zeros.scatter(-1, idx, phi)]
        row["masked ms"] = time_fwd_bwd(fm_kernel.fm_scan, dense_in)
        row["masked MB"] = peak_mb(fm_kernel.fm_scan, dense_in)
        full = sparse_inputs(B, T, D, m, m)
        row["dense ms"] = time_fwd_bwd(fm_kernel.fm_scan, [full[0], full[2], full[3]])
    if mamba is not None and m in (16, 64, 128, 256):  # d_state m: its state is D x m a layer
        ssd = lambda x, dt, A, Bm, Cm: mamba.ssd(x, dt, A, Bm, Cm, chunk_size=256)
        row["mamba2 ms"] = time_fwd_bwd(ssd, mamba_inputs(B, T, 2 * D // 64, m))
    return row


def bench_sparse(mamba):
    """Sparse FM (fm_sparse_scan, k = 8) against m, beside the dense-masked scan (fm_scan with
    theta, phi spread over m rows), dense FM and Mamba-2's SSD (d_state m), forward + backward."""
    rows = []
    for B, T, D in SPARSE_SHAPES:
        for m in SPARSE_ROWS:
            rows.append(sparse_row(B, T, D, m, mamba))
            print(rows[-1], flush=True)
    print(f"\nforward + backward of one layer, ms (CUDA-graph medians) and peak MB beyond the inputs;"
          f" bf16 x, k = {K_SPARSE}; masked: fm_scan of the same k rows spread over all m; dense: k = m;"
          f" mamba2: SSD with expand 2, head_dim 64, d_state m")
    print_table(rows)


def bench_decode(mamba):
    from triton.testing import do_bench_cudagraph
    rows = []
    for B in (1, 64):
        row = {"batch": B}
        h = torch.randn(B, M, D, device="cuda")
        x = torch.randn(B, D, device="cuda", dtype=torch.bfloat16)
        idx = torch.stack([torch.randperm(M, device="cuda")[:K_SPARSE] for _ in range(B)])
        theta, phi = torch.rand(B, K_SPARSE, device="cuda") * 0.5, torch.rand(B, K_SPARSE, device="cuda")
        row["fm_step k=8 us"] = 1e3 * do_bench_cudagraph(lambda: fm_kernel.fm_step(h, x, idx, theta, phi))
        dense_idx = torch.arange(M, device="cuda").expand(B, M).contiguous()
        th_d, ph_d = torch.rand(B, M, device="cuda") / M, torch.rand(B, M, device="cuda") / M
        row["fm_step dense us"] = 1e3 * do_bench_cudagraph(lambda: fm_kernel.fm_step(h, x, dense_idx, th_d, ph_d))
        q = torch.randn(B, 16, 1, 128, device="cuda", dtype=torch.bfloat16)
        kv = [torch.randn(B, 8, 16384, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        row["sdpa 16K cache us"] = 1e3 * do_bench_cudagraph(
            lambda: F.scaled_dot_product_attention(q, *kv, enable_gqa=True))
        if mamba is not None:
            heads, head_dim, d_state = 64, 64, 128  # as Mamba2.step calls it: per-head scalars expanded
            state = torch.randn(B, heads, head_dim, d_state, device="cuda")
            xs = torch.randn(B, heads, head_dim, device="cuda", dtype=torch.bfloat16)
            dt = torch.rand(B, heads, 1, device="cuda", dtype=torch.bfloat16).expand(B, heads, head_dim)
            dt_bias = torch.rand(heads, 1, device="cuda").expand(heads, head_dim)
            A = -torch.rand(heads, 1, 1, device="cuda").expand(heads, head_dim, d_state)
            D_skip = torch.ones(heads, 1, device="cuda").expand(heads, head_dim)
            Bs = torch.randn(B, 1, d_state, device="cuda", dtype=torch.bfloat16)
            Cs = torch.randn(B, 1, d_state, device="cuda", dtype=torch.bfloat16)
            row["mamba2 step us"] = 1e3 * do_bench_cudagraph(
                lambda: mamba.step(state, xs, dt, A, Bs, Cs, D=D_skip, dt_bias=dt_bias, dt_softplus=True))
        rows.append(row)
    print(f"\ndecode, one layer, D={D}, M={M}, k={K_SPARSE}; times in microseconds (CUDA graph replays)")
    print_table(rows)


def gemv_shapes():
    """(name, input width, output widths of the products taken together) of fm_1b's decoding step."""
    from model import ModelConfig
    d_model = config_value("config/fm_1b.py", "d_model")
    ffn = ModelConfig(d_model=d_model).d_ff
    return [(f"{d_model}x{d_model} (in/out proj)", d_model, [d_model]),
            (f"{d_model}x{2 * ffn} (gate+up, one)", d_model, [2 * ffn]),
            (f"{d_model}x{ffn} x 2 (gate, up)", d_model, [ffn, ffn]),
            (f"{ffn}x{d_model} (down)", ffn, [d_model])]


def time_chain(products, x, weights):
    """us a use of one weight set when a CUDA graph runs products(x, w) over every set in turn (together larger
    than the L2 cache, so that each weight comes from memory, as in a decoding step)."""
    from triton.testing import do_bench_cudagraph
    with torch.no_grad():
        run = lambda: [products(x, w) for w in weights]
        run()  # compilation, library handles
        torch.cuda.synchronize()
        return 1e3 * do_bench_cudagraph(run, return_mode="median") / len(weights)


def bench_gemv():
    """Products of one and 64 rows at fm_1b's shapes, bf16: cuBLAS (F.linear), inductor's coordinate-descent
    tuned product (a reduction for one row) and, for one row, fm_kernel.decode_product (the decoding step's down
    product), as
    GB/s of weight and activations read and written, and as % of the copy bandwidth measured in the same run."""
    bandwidth = measure_ceilings()[0]
    rows = []
    for name, d_in, d_outs in gemv_shapes():
        weight_bytes = sum(d_out * d_in * 2 for d_out in d_outs)
        copies = -(-2**28 // weight_bytes)  # 256 MB of weights a replay
        weights = [[torch.randn(d_out, d_in, device="cuda", dtype=torch.bfloat16) for d_out in d_outs]
                   for _ in range(copies)]
        for batch in (1, 64):
            x = torch.randn(batch, d_in, device="cuda", dtype=torch.bfloat16)
            moved = weight_bytes + 2 * batch * (d_in + sum(d_outs))
            row = {"product": name, "rows": batch}
            torch._dynamo.reset()  # a compile per shape (dynamo's recompile limit)
            compiled = torch.compile(F.linear, dynamic=False, options={"coordinate_descent_tuning": True})
            triton = {"Triton": fm_kernel.decode_product} if batch == 1 else {}
            ways = {"cuBLAS": F.linear, "inductor": compiled, **triton}
            for way, linear in ways.items():
                us = time_chain(lambda x, ws: [linear(x, w) for w in ws], x, weights)
                row.update({f"{way} us": us, f"{way} GB/s": moved / us / 1e3,
                            f"{way} % copy": 100 * moved / us * 1e6 / bandwidth})
            rows.append(row)
            print(row, flush=True)
        del weights
    print(f"\nproducts at fm_1b's decoding shapes, bf16, each weight read from memory (CUDA graph of a chain over "
          f"256 MB of weights); copy bandwidth {bandwidth / 1e12:.2f} TB/s measured now. inductor: coordinate-"
          f"descent tuning, a reduction for one row, cuBLAS's product for more; Triton: fm_kernel.decode_product, "
          f"one row")
    print_table(rows)


def check_accuracy(T=16384):
    """fm_scan (fp32 and bf16 inputs) against float64 fm_scan_torch, which test_fm.py checks against
    the float64 loop: relative error of y, hT and every gradient."""
    print(f"\naccuracy at B=1, T={T}, D={D}, M={M}, k={K_SPARSE} against float64 (||a-b||/||b||)")
    ref_in = fm_inputs(1, T, K_SPARSE, torch.float64)
    ref_in = [t.double().requires_grad_() for t in ref_in]
    y, hT = fm_kernel.fm_scan_torch(*ref_in)
    gy, ghT = torch.randn_like(y), torch.randn_like(hT)
    ref = [y, hT, *torch.autograd.grad((y * gy).sum() + (hT * ghT).sum(), ref_in)]
    del y, hT
    for dtype in (torch.float32, torch.bfloat16):
        ins = [t.detach().to(dtype if i == 0 else torch.float32).requires_grad_() for i, t in enumerate(ref_in)]
        y, hT = fm_kernel.fm_scan(*ins)
        grads = torch.autograd.grad((y * gy.to(y.dtype)).sum() + (hT * ghT.float()).sum(), ins)
        errs = [((a.double() - b).norm() / b.norm()).item() for a, b in zip([y, hT, *grads], ref)]
        names = ["y", "hT", "dxbar", "dtheta", "dphi", "dh0"]
        print(f"  {str(dtype):15s} " + "  ".join(f"{n} {e:.1e}" for n, e in zip(names, errs)))


def bench_stages():
    """Each kernel of fm_scan alone (bf16 x, k = 8), with the bytes it must move at least."""
    from triton.testing import do_bench_cudagraph
    rows = []
    for T in (1024, 16384):
        B = TOKENS // T
        x, theta, phi, h0 = fm_inputs(B, T, K_SPARSE, torch.bfloat16)
        dy = torch.randn_like(x)
        theta_p, phi_p, decay, b, keys = fm_kernel._prepare(theta, phi)
        states, hT = fm_kernel._chunk_states(x, keys, b, h0)
        y, rms, q, P, hx = fm_kernel._chunk_out(x, theta_p, phi_p, decay, b, states, 1e-6)
        dq, c, omega, kappa, dk, p_w = fm_kernel._chunk_grads(x, dy, theta_p, q, decay, states, rms, hx)
        dstates = fm_kernel._chunk_dstate(x, dy, q, b, states, omega, kappa)
        dends, dh0 = torch.empty_like(dstates), torch.empty_like(hT)
        fm_kernel._scan_states(dstates, dends, b, None, dh0, reverse=True)
        dhx = fm_kernel._chunk_dx(x, dy, theta_p, b, states, dends, omega, P, p_w)[1]
        end_dot = (hT * torch.randn_like(hT)).sum(-1)
        stages = {
            "prepare": lambda: fm_kernel._prepare(theta, phi),
            "states": lambda: fm_kernel._chunk_states(x, keys, b, h0),
            "fwd products": lambda: fm_kernel._products(x, states, theta_p),
            "out (all)": lambda: fm_kernel._chunk_out(x, theta_p, phi_p, decay, b, states, 1e-6),
            "bwd products": lambda: fm_kernel._products(x, states, theta_p, dy),
            "grads (all)": lambda: fm_kernel._chunk_grads(x, dy, theta_p, q, decay, states, rms, hx),
            "dstate": lambda: fm_kernel._chunk_dstate(x, dy, q, b, states, omega, kappa),
            "bwd scan": lambda: fm_kernel._scan_states(dstates, dends, b, None, dh0, reverse=True),
            "dx": lambda: fm_kernel._chunk_dx(x, dy, theta_p, b, states, dends, omega, P, p_w),
            "rate grads": lambda: fm_kernel._rate_grads(T, D, theta_p, q, decay, b, rms, dq, c, dk, dhx,
                                                        end_dot, 1e-6),  # adds to dk each call: harmless here
        }
        row = {"T": T}
        row.update({name: do_bench_cudagraph(fn, return_mode="median") for name, fn in stages.items()})
        row["states MB"] = states.numel() * states.element_size() / 1e6
        rows.append(row)
    print(f"\nfm_scan stages, ms ({TOKENS} tokens, D={D}, M={M}, k={K_SPARSE}, bf16 x)")
    print_table(rows)


def config_value(path, key):
    """The value of one setting in a config/*.py file as train.py reads it."""
    import train
    from configurator import load_config, optional_types
    from model import ModelConfig
    return load_config(train.default_config(), [path], optional_types(ModelConfig))[key]


def model_from_config_file(path, vocab_size, **overrides):
    """A Model built from a config/*.py file as train.py reads it (ModelConfig fields only)."""
    import train
    from configurator import load_config, optional_types
    from model import Model, ModelConfig
    cfg = load_config(train.default_config(), [path], optional_types(ModelConfig))
    names = {f for f in ModelConfig.__dataclass_fields__}
    return Model(ModelConfig(**{**{k: v for k, v in cfg.items() if k in names}, **overrides}, vocab_size=vocab_size))


def train_step(model, optimizer, batch, autocast):
    """One AdamW step on batch (B, T + 1) under the autocast context."""
    with autocast:
        _, loss = model(batch[:, :-1], batch[:, 1:])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def bench_train(args):
    """Training steps (AdamW, bf16 autocast, optionally compiled) on random tokens of the 1B models (MODELS, those
    args.models selects)."""
    torch.set_float32_matmul_precision("high")  # as train.py: bf16 autocast, TF32 where float32 remains
    autocast = torch.autocast("cuda", dtype=torch.bfloat16)
    rows = []
    for name, path, overrides, fused in generate_models(args):
        if fused:  # a decoding kernel: the same training
            continue
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        model = model_from_config_file(path, args.vocab_size, block_size=args.block_size, **overrides).cuda()
        optimizer = model.configure_optimizers(0.1, 3e-4, (0.9, 0.95), "cuda")
        step_model = torch.compile(model, mode=args.compile_mode) if args.compile else model
        tokens = torch.randint(args.vocab_size, (args.steps + 3, args.batch_size, args.block_size + 1), device="cuda")
        for batch in tokens[:3]:  # warm-up: compilation, autotuning, allocator
            train_step(step_model, optimizer, batch, autocast)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for batch in tokens[3:]:
            train_step(step_model, optimizer, batch, autocast)
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / args.steps
        tokens_per_s = args.batch_size * args.block_size / seconds
        rows.append({"model": name, "params M": model.num_params() / 1e6,
                     "ms/step": 1e3 * seconds, "tokens/s": tokens_per_s,
                     "MFU %": 100 * model.estimate_mfu(tokens_per_s),
                     "peak GB": torch.cuda.max_memory_allocated() / 2**30})
        print(rows[-1], flush=True)
        if args.profile:
            profile_step(step_model, optimizer, tokens[0], autocast)
        del model, optimizer, step_model
    print(f"\ntraining, batch {args.batch_size} x {args.block_size} tokens, bf16 autocast, "
          f"compile={args.compile} ({args.compile_mode}), vocab {args.vocab_size}, "
          f"mean of {args.steps} steps after 3 warm-up")
    print_table(rows)


def profile_step(step_model, optimizer, batch, autocast, top=60):
    """GPU time of one training step by kernel (torch.profiler): totals by kind, then the largest kernels."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        train_step(step_model, optimizer, batch, autocast)
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: -e.self_device_time_total)
    kinds = {}
    for e in kernels:
        kind = kernel_kind(e.key)
        kinds[kind] = kinds.get(kind, 0.0) + e.self_device_time_total / 1e3
    total = sum(kinds.values())
    print(f"  one step: {total:.1f} ms of GPU kernels, {sum(e.count for e in kernels)} launches; "
          + ", ".join(f"{kind} {ms:.1f}" for kind, ms in sorted(kinds.items(), key=lambda kv: -kv[1])))
    for e in kernels[:top]:
        print(f"  {e.self_device_time_total / 1e3:8.2f} ms {e.count:6d}x  {e.key[:110]}")
    print_gaps(prof)


def print_gaps(prof, top=12):
    """Where the GPU idles in the profiled step: total idle between kernels, and the longest gaps with their
    neighbours (kernels that wait on the CPU's launches)."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    gaps = [(nxt[0] - cur[1], cur[2], nxt[2]) for cur, nxt in zip(spans, spans[1:]) if nxt[0] > cur[1]]
    print(f"  GPU idle between kernels: {sum(g[0] for g in gaps) / 1e3:.1f} ms in {len(gaps)} gaps over "
          f"{(spans[-1][1] - spans[0][0]) / 1e3:.1f} ms; > 50 us: "
          f"{sum(g[0] for g in gaps if g[0] > 50) / 1e3:.1f} ms; longest:")
    for gap, before, after in sorted(gaps, reverse=True)[:top]:
        print(f"  {gap:8.0f} us  after {before[:50]}  before {after[:50]}")


def kernel_kind(name):
    """Coarse kind of a CUDA kernel by its name, for profile_step's totals."""
    kinds = (("scan", ("_chunk", "_bmm", "_state_passing", "_step_kernel", "_grads_kernel", "_decay_kernel")),
             ("attention", ("flash", "fmha", "sdpa", "dot_do_o", "convert_dq")),  # before matmul: cuDNN's use wgmma
             ("matmul", ("gemm", "xmma", "cutlass", "nvjet", "wgmma")), ("optimizer", ("adam", "foreach")),
             ("inductor", ("triton_",)))
    return next((kind for kind, keys in kinds if any(key in name.lower() for key in keys)), "other")


MODELS = (  # (name, config file, ModelConfig overrides, use mamba-ssm's fused decode step)
    ("fm_1b k=8", "config/fm_1b.py", {}, False),  # FM's block
    ("fm_1b paper k=8", "config/fm_1b.py", {"fm_conv": 0, "fm_gate": False, "d_ff": None}, False),
    ("fm_1b dense", "config/fm_1b.py", {"top_k": None}, False),
    ("mamba2_1b", "config/mamba2_1b.py", {}, False),
    ("mamba2_1b fused", "config/mamba2_1b.py", {}, True),
    ("mamba2-1.3b fused", "config/mamba2_1.3b.py", {}, True),
    ("transformer_1b", "config/transformer_1b.py", {}, False),
)
VOCAB_SIZES = {"cl100k_base": 100288, "gpt-neox": 50288}  # the tokenizers' sizes, padded as the models have them


def step_state_bytes(model, context):
    """Bytes of decoding state one step reads and writes for one sequence after `context` tokens, as each mixer counts
    them (step_state_bytes): FM's k memory rows and window, Mamba-2's states, attention's filled KV cache."""
    return sum(block.mixer.step_state_bytes(context) for block in model.blocks)


def decode_ms(generator, n_tokens):
    """Median ms a token of CUDA-graph steps (batches of n_tokens between events, three repeats)."""
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n_tokens):
            generator.step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / n_tokens)
    return sorted(times)[1]


def prefill_ms(generator, prompts):
    """ms of Generator.start (the parallel pass, compiled with the step, its state written into the buffers), best of
    two (the first compiles)."""
    times = []
    for _ in range(2):
        torch.cuda.synchronize()
        begin = time.perf_counter()
        generator.start(prompts, 1)
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - begin))
    return min(times)


def measure_decode(model, batch, prompt_len, args, bandwidth, vocab):
    """Prefill `batch` random prompts of prompt_len tokens, then time greedy decoding: ms/token, peak GB, floor."""
    from generate import Generator, Sampling
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    generator = Generator(model, Sampling(temperature=0), compile=args.compile_mode if args.compile else None)
    prompts = torch.randint(vocab, (batch, prompt_len)).tolist()
    generator.start(prompts, args.new_tokens * 7)  # room for the warm-up and the three timed repeats
    prefill_peak = torch.cuda.max_memory_allocated() / 2**30
    torch.cuda.reset_peak_memory_stats()
    for _ in range(args.new_tokens):  # warm-up
        generator.step()
    ms = decode_ms(generator, args.new_tokens)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    floor_ms = (weights + batch * step_state_bytes(model, prompt_len)) / bandwidth * 1e3
    return {"ms/token": ms, "tokens/s": batch * 1e3 / ms, "floor ms": floor_ms, "of floor %": 100 * floor_ms / ms,
            "peak GB prefill": prefill_peak, "peak GB decode": torch.cuda.max_memory_allocated() / 2**30}


def generate_models(args):
    """MODELS whose name contains one of args.models (all when None)."""
    return [m for m in MODELS if args.models is None or any(part in m[0] for part in args.models)]


def set_decode_switches(args):
    """The decoding step's compile options as args ask (to attribute their gain)."""
    import generate
    if not args.coordinate_descent:
        generate.STEP_COMPILE_OPTIONS = {}


def bench_generate(args):
    """Decoding after long prompts, every model in one run (random bf16 weights at the 1B shapes): prefill time,
    decode ms/token at batch 1 and 64 after args.prompt tokens, a context sweep at batch 1, the bandwidth floor
    (weights + the state a step touches, over the copy bandwidth measured now) and the share of it reached."""
    import generate
    import model as model_module
    from generate import Generator, Sampling
    fused_step = model_module.selective_state_update
    bandwidth = measure_ceilings()[0]
    rows, sweep = [], {}
    for name, path, overrides, fused in generate_models(args):
        if fused and fused_step is None:
            print(f"{name}: skipped (needs mamba-ssm)")
            continue
        model_module.selective_state_update = fused_step if fused else None
        vocab = VOCAB_SIZES[config_value(path, "tokenizer")]
        with torch.device("cuda"):
            model = model_from_config_file(path, vocab, **overrides).to(torch.bfloat16).eval()
        prompt = torch.randint(vocab, (1, args.prompt)).tolist()
        row = {"model": name, "params M": model.num_params(non_embedding=False) / 1e6,
               "prefill ms": prefill_ms(Generator(model, Sampling(temperature=0),
                                                  compile=args.compile_mode if args.compile else None), prompt)}
        for batch in args.batch:
            result = measure_decode(model, batch, args.prompt, args, bandwidth, vocab)
            row.update({f"b{batch} {key}": value for key, value in result.items()})
        rows.append(row)
        print(row, flush=True)
        if args.sweep:
            sweep[name] = {n: measure_decode(model, 1, n, args, bandwidth, vocab) for n in args.sweep}
            print({n: round(r["ms/token"], 3) for n, r in sweep[name].items()}, flush=True)
        del model
        torch._dynamo.reset()  # a fresh compile for the next model (its guards would otherwise pile up)
    model_module.selective_state_update = fused_step
    print(f"\ngeneration: greedy, one CUDA graph a step (every layer, head, sampling; compile={args.compile}, "
          f"{args.compile_mode}, options {generate.STEP_COMPILE_OPTIONS}), random bf16 weights; "
          f"prefill of one {args.prompt}-token prompt; decode after {args.prompt}-token prompts, median of 3 x "
          f"{args.new_tokens} tokens; floor = (weights + batch x state a step touches) / copy "
          f"{bandwidth / 1e12:.2f} TB/s measured now")
    print_table(rows)
    if not sweep:
        return
    print("\ncontext sweep at batch 1: decode ms/token (peak GB during decode) after a prompt of n tokens")
    print_table([{"model": name, **{str(n): f"{r['ms/token']:.3f} ({r['peak GB decode']:.2f})"
                                    for n, r in runs.items()}} for name, runs in sweep.items()])
    plot_sweep(sweep, args)


DECODE_KINDS = (  # (kind, words of library kernel names, ops in inductor's kernel names), first match wins
    ("fm_step", ("_step_kernel",), ()),
    ("router/top-k", (), ("sort", "softmax", "topk", "cat")),  # cat: the router's and the rates' weights
    ("GEMV", ("gemv", "gemm", "nvjet", "cutlass", "xmma", "splitk", "_decode_product_kernel"), ("mm", "addmm", "bmm")),
    ("norms", (), ("rsqrt",)),
    ("sampling", (), ("argmax",)),
)


def decode_kernel_kind(name):
    """Kind of a decoding step's kernel by its name. inductor names a fused kernel after the ops in it (a one-row
    product that it wrote as a reduction keeps 'mm'; a norm fused into it counts as GEMV)."""
    name = name.lower()
    ops = set(name.split("_")) if name.startswith("triton_") else set()
    return next((kind for kind, words, op_names in DECODE_KINDS
                 if any(word in name for word in words) or ops & set(op_names)), "other")


def profile_decode(args, steps=10):
    """torch.profiler over the compiled decoding step of the first model args.models selects (fm_1b k = 8 by
    default), run eagerly (no graph: each kernel shows), at each of args.batch: launches and microseconds a step by
    kernel kind (the LM head is the step's last product), then the kernels by time. Printed and written to
    args.out_dir/generate_profile.txt."""
    import model as model_module
    from torch.profiler import ProfilerActivity, profile
    from generate import Generator, Sampling
    name, path, overrides, fused = generate_models(args)[0]
    if fused and model_module.selective_state_update is None:
        sys.exit(f"{name} needs mamba-ssm")
    if not fused:
        model_module.selective_state_update = None
    vocab = VOCAB_SIZES[config_value(path, "tokenizer")]
    with torch.device("cuda"):
        model = model_from_config_file(path, vocab, **overrides).to(torch.bfloat16).eval()
    lines = []
    for batch in args.batch:
        generator = Generator(model, Sampling(temperature=0), cuda_graph=False,
                              compile=args.compile_mode if args.compile else None)
        generator.start(torch.randint(vocab, (batch, 1024)).tolist(), 2 * steps + 8)  # FM's step: any context
        with torch.no_grad():
            for _ in range(5):  # compilation and tuning
                generator.compiled_step()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    generator.compiled_step()
                torch.cuda.synchronize()
        lines += decode_profile_lines(prof, f"{name}, batch {batch}", steps)
    text = "\n".join(lines)
    print(text)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "generate_profile.txt"), "w") as f:
        f.write(text + "\n")
    print(f"profile: {os.path.join(args.out_dir, 'generate_profile.txt')}")


def decode_profile_lines(prof, title, steps, top=25):
    """Per step: launches and us by kind, then the kernels by time."""
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    kinds, by_name = {}, {}
    products = [i for i, e in enumerate(events) if decode_kernel_kind(e.name) == "GEMV"]
    heads = set(products[len(products) // steps - 1::len(products) // steps]) if products else set()
    for i, e in enumerate(events):
        kind = "head" if i in heads else decode_kernel_kind(e.name)
        launches, us = kinds.get(kind, (0, 0.0))
        kinds[kind] = (launches + 1, us + e.time_range.elapsed_us())
        launches, us = by_name.get((kind, e.name), (0, 0.0))
        by_name[(kind, e.name)] = (launches + 1, us + e.time_range.elapsed_us())
    total = sum(us for _, us in kinds.values()) / steps
    lines = [f"\n{title}: {total:.0f} us of kernels a step in {len(events) / steps:.0f} launches "
             f"(compiled step run eagerly, mean of {steps} steps)", f"  {'kind':14s} {'launches':>8s} {'us':>8s}"]
    for kind, (launches, us) in sorted(kinds.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"  {kind:14s} {launches / steps:8.0f} {us / steps:8.1f}")
    lines.append("  kernels by time (us a step, launches a step, kind, name):")
    for (kind, name), (launches, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"  {us / steps:8.1f} {launches / steps:5.0f}x  {kind:13s} {name[:100]}")
    return lines


def plot_sweep(sweep, args):
    """decode ms/token against prompt length, one line a model (the paper's Figure 6), into args.out_dir."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, runs in sweep.items():
        ax.plot(list(runs), [r["ms/token"] for r in runs.values()], marker="o", label=name)
    ax.set(xscale="log", xlabel="prompt length (tokens)", ylabel="decode ms / token (batch 1)",
           title=f"decoding on {torch.cuda.get_device_name()}")
    ax.set_xticks(list(next(iter(sweep.values()))), [f"{n // 1024}K" for n in next(iter(sweep.values()))])
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, "generate_sweep.png")
    fig.savefig(path, dpi=150, bbox_inches="tight")
    print(f"plot: {path}")


def print_table(rows):
    keys = list(rows[0].keys())
    for r in rows[1:]:
        keys += [k for k in r if k not in keys]
    print(" | ".join(f"{k:>14s}" for k in keys))
    for r in rows:
        print(" | ".join(f"{r[k]:14.3f}" if isinstance(r.get(k), float) else f"{str(r.get(k, '-')):>14s}"
                         for k in keys))


def parse_args(argv=None):
    """The command line's settings; --sweep alone: the default prompt lengths (SWEEP)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["kernels", "sparse", "stages", "train", "generate", "gemv"])
    parser.add_argument("--vocab_size", type=int, default=100288, help="cl100k_base padded to a multiple of 64")
    parser.add_argument("--block_size", type=int, default=2048)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--compile", type=int, default=1)
    parser.add_argument("--compile_mode", default="default", help="torch.compile mode (train, generate)")
    parser.add_argument("--profile", action="store_true",
                        help="train: also print one step's GPU time by kernel; generate: only profile one model's step "
                             "(the first --models selects; fm_1b k = 8 by default)")
    parser.add_argument("--prompt", type=int, default=16384, help="generate: prompt length")
    parser.add_argument("--new_tokens", type=int, default=64, help="generate: tokens a timing")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64], help="generate: batch sizes")
    parser.add_argument("--sweep", type=int, nargs="*",
                        help=f"generate: a context sweep at batch 1 and its plot, at these prompt lengths (--sweep "
                             f"alone: {' '.join(map(str, SWEEP))}; without --sweep: none)")
    parser.add_argument("--models", nargs="+", help="train, generate: only the models (of MODELS) whose name contains "
                                                    "one of these")
    parser.add_argument("--coordinate_descent", type=int, default=1,
                        help="generate: 0 compiles the step without STEP_COMPILE_OPTIONS (cuBLAS GEMVs)")
    parser.add_argument("--out_dir", default="out-bench", help="where plots and profiles go")
    args = parser.parse_args(argv)
    if args.sweep == []:
        args.sweep = SWEEP
    return args


def main():
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench.py times GPU kernels: run it on a machine with a CUDA GPU")
    torch.manual_seed(0)
    print(device_info())
    if args.what == "kernels":
        mamba = import_mamba()
        check_accuracy()
        ceilings = measure_ceilings()
        bench_sparse(mamba)
        bench_decode(mamba)
        bench_scan(mamba, import_fla(), ceilings)
    if args.what == "sparse":
        bench_sparse(import_mamba())
    if args.what == "stages":
        bench_stages()
    if args.what in ("train", "generate"):
        import_mamba()  # before model.py is imported, so that its Mamba-2 uses mamba-ssm's scan when installed
    if args.what == "train":
        bench_train(args)
    if args.what == "generate":
        set_decode_switches(args)
        if args.profile:
            profile_decode(args)
        else:
            bench_generate(args)
    if args.what == "gemv":
        bench_gemv()


if __name__ == "__main__":
    main()
