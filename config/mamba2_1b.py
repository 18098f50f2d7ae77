# Mamba-2 baseline for fm_1b.py: the same 16 LLaMA blocks, d_model 2048, context 1024, data and schedule, with a
# Mamba-2 mixer (expand 1: d_inner 2048 in 32 heads of 64, d_state 128, one B/C group, conv 4) in place of
# Factorization Memory.
# Parameters: 882,007,552 (676,617,728 without the tied embedding), fm_1b: 880,969,760 (+0.12%). The Mamba-2
# mixer has about d_model^2 more weights per layer than FM, so the SwiGLU width is 4736 instead of 5504.
# (With the usual expand 2 the mixer alone is 3x bigger than FM's: d_ff = 2752 would match then.)
# On CUDA the model uses mamba_ssm's fused SSD scan when it is installed; the PyTorch scan it falls back to is
# slower and needs more memory.
#
#   torchrun --standalone --nproc_per_node=8 train.py config/mamba2_1b.py
# (the data and the batch: see config/fm_1b.py)
# Speed: `python bench.py train` (README, Results).

out_dir = 'out-mamba2-1b'
wandb_log = False
wandb_project = 'factorization-memory'
wandb_run_name = 'mamba2-1b'

dataset = 'hf:mlfoundations/dclm-baseline-1.0'
tokenizer = 'cl100k_base'
batch_size = 8  # per GPU
block_size = 1024
gradient_accumulation_steps = 8 * 8  # over all GPUs: 8 per GPU on 8 GPUs

mixer = 'mamba2'
n_layer = 16
d_model = 2048
mamba_expand = 1
mamba_head_dim = 64
d_state = 128
d_conv = 4
d_ff = 4736
chunk_size = 64

learning_rate = 3e-4
min_lr = 3e-5
warmup_iters = 2000
max_iters = 48_000
lr_decay_iters = 48_000
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0

eval_interval = 1000
eval_iters = 100  # 100 x 8 = 800 fixed validation windows (819K tokens), split over the GPUs
log_interval = 10
dtype = 'bfloat16'
compile = True
