# A dense Factorization Memory model (every token reads and writes all m rows), otherwise fm_small.py (the block too).
#   python train.py config/fm_small_dense.py

out_dir = 'out-fm-small-dense'
wandb_run_name = 'fm-small-dense'

dataset = 'default'
tokenizer = 'bytes'
batch_size = 16
block_size = 256
gradient_accumulation_steps = 1

mixer = 'fm'
n_layer = 4
d_model = 128
n_memory = 32
top_k = None  # dense: k = m
tau = 1.0
fm_conv = 4  # FM's block, as fm_small.py
fm_gate = True
chunk_size = 16  # fastest for the PyTorch scan on a CPU

learning_rate = 4e-3
min_lr = 4e-4
warmup_iters = 50
max_iters = 500

eval_interval = 100
eval_iters = 16
log_interval = 10
