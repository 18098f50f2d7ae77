"""Time fm::route_step alone at fm_1b's decode shapes (M = 64, K = 8, D = 2048, bf16, 4 taps and the gate, or the
paper's layer), batch 1 and 64: one CUDA graph of 100 steps, median of 7 replays. The fm_kernel.py timed is the one
in FOLDER, so two versions can be compared on one GPU, and each run saves its outputs to compare them bit for bit:

    git archive COMMIT fm_kernel.py | tar x -C /tmp/before
    python dev/step_bench.py /tmp/before before && python dev/step_bench.py . after   # outputs in $OUT or /tmp
"""
import os
import sys

import torch

folder, name = sys.argv[1:3]
sys.path.insert(0, folder)
import fm_kernel  # noqa: E402  (the folder's)

out = os.environ.get("OUT", "/tmp")
M, K, D, W = 64, 8, 2048, 4
for B in (1, 64):
    for block in (False, True):
        g = torch.Generator(device="cuda").manual_seed(0)
        r = lambda *shape, dtype=torch.bfloat16: torch.randn(*shape, device="cuda", generator=g).to(dtype)
        h = r(B, M, D, dtype=torch.float32)
        xz = r(B, 2 * D)  # in_proj's output: xbar, then z
        scores = r(B, M + 2, dtype=torch.float32)
        conv = (r(B, D, W - 1), r(D, W), r(D)) if block else None
        z = xz[:, D:] if block else None
        step = lambda: fm_kernel.fm_route_step(h, xz[:, :D], scores, K, 1.0, 1e-6, z=z, conv=conv)
        for _ in range(3):  # the first compiles
            y = step()
        torch.save({"y": y, "h": h, "window": None if conv is None else conv[0]}, f"{out}/{name}_B{B}_{block}.pt")
        with torch.cuda.stream(torch.cuda.Stream()):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(100):
                    step()
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(7):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 10)  # us a step
        print(f"{name:6} B={B:3} {'block' if block else 'paper'}: {sorted(times)[3]:.2f} us a step (median of 7 x 100)")
