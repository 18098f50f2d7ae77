"""Inductor's code for fm_1b's compiled decoding step at batch 1 (2 layers, random weights), with the block or the
paper's layer, to read which kernels a step launches:

    TORCH_LOGS=output_code python dev/step_code.py block 2> code_block.txt   # or: paper
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import model_from_config_file  # noqa: E402
from generate import Generator, Sampling  # noqa: E402

overrides = {} if sys.argv[1] == "block" else {"fm_conv": 0, "fm_gate": False, "d_ff": None}
with torch.device("cuda"):
    model = model_from_config_file("config/fm_1b.py", 100288, n_layer=2, **overrides).to(torch.bfloat16).eval()
generator = Generator(model, Sampling(temperature=0), compile="default")
generator.start([[1, 2, 3, 4]], 8)
for _ in range(3):
    generator.step()
