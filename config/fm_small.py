# A small Factorization Memory model on the default corpus (Shakespeare and Milton, bytes): what `python train.py`
# trains, written out: 500 steps of 16 x 256 bytes, 2.5-4 minutes on a quiet 2-core CPU (the README's Quickstart,
# docs/results/quickstart.csv); val loss 1.754 nats/byte.
# Parameters: 772,744 (772,232 with config/paper_layer.py). Compare with transformer_small.py and mamba2_small.py
# (same size within 2%).
#   python train.py config/fm_small.py

out_dir = 'out-fm-small'
wandb_run_name = 'fm-small'

dataset = 'default'
tokenizer = 'bytes'
batch_size = 16
block_size = 256
gradient_accumulation_steps = 1

mixer = 'fm'
n_layer = 4
d_model = 128
n_memory = 32
top_k = 8  # k = m/4, the paper's proportional sparsity
tau = 1.0
fm_conv = 4  # FM's block (not in the paper): a 4-tap convolution on xbar and an output gate, its weights
fm_gate = True  # taken from the MLP (d_ff 340); add config/paper_layer.py for the paper's layer exactly
chunk_size = 16  # fastest for the PyTorch scan on a CPU

learning_rate = 4e-3
min_lr = 4e-4
warmup_iters = 50
max_iters = 500

eval_interval = 100
eval_iters = 16
log_interval = 10
