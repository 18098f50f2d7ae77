"""Session probe (not committed): where fm_sparse_scan's time goes, and its chunk / tile / warps."""
import sys, torch
import fm_kernel, bench

torch.manual_seed(0)
K = 8


def run_one(B, T, D, m):
    x, idx, theta, phi = bench.sparse_inputs(B, T, D, m, K)
    fn = lambda x, theta, phi: fm_kernel.fm_sparse_scan(x, idx, theta, phi, m)
    return bench.time_fwd_bwd(fn, [x, theta, phi]), (x, idx, theta, phi)


def fwd_only(x, idx, theta, phi, m):
    from triton.testing import do_bench_cudagraph
    with torch.no_grad():
        return do_bench_cudagraph(lambda: fm_kernel.fm_sparse_scan(x, idx, theta, phi, m),
                                  return_mode="median")


def profile(B, T, D, m):
    ms, (x, idx, theta, phi) = run_one(B, T, D, m)
    print(f"({B},{T},{D}) m={m}: fwd+bwd {ms:.3f} ms, fwd {fwd_only(x, idx, theta, phi, m):.3f} ms")
    from torch.profiler import profile as prof, ProfilerActivity
    leaves = [t.detach().requires_grad_() for t in (x, theta, phi)]
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(5):
            y, hT = fm_kernel.fm_sparse_scan(leaves[0], idx, leaves[1], leaves[2], m)
            torch.autograd.backward((y, hT), (torch.ones_like(y), torch.ones_like(hT)))
        torch.cuda.synchronize()
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))


def sweep():
    for C in (16, 32, 64):
        for BD in (32, 64, 128):
            for w in (2, 4, 8):
                fm_kernel.SPARSE_CHUNK = C
                fm_kernel._sparse_meta = lambda x, C=C, BD=BD, w=w: dict(
                    C=C, BD=BD, PRECISION=fm_kernel._precision(x), num_warps=w)
                try:
                    a = run_one(8, 2048, 2048, 1024)[0]
                    b = run_one(64, 256, 128, 1024)[0]
                    print(f"C {C:3d} BD {BD:4d} warps {w}: fm_1b {a:.3f} ms, recall {b:.3f} ms", flush=True)
                except Exception as err:
                    print(f"C {C} BD {BD} warps {w}: {type(err).__name__} {str(err)[:100]}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "profile":
        profile(8, 2048, 2048, 1024)
        profile(64, 256, 128, 1024)
    else:
        sweep()
