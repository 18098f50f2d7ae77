# Transformer baseline for fm_1b.py: the same 16 LLaMA blocks, d_model 2048, context 1024, data and schedule, with
# grouped-query causal attention (16 heads of 128, 4 KV heads, RoPE) in place of Factorization Memory.
# Parameters: 882,837,504 (677,447,680 without the tied embedding), fm_1b: 880,969,760 (+0.21%). Attention with
# 4 KV heads has 0.5 d_model^2 more weights per layer than FM, so the SwiGLU width is 5184 instead of 5504.
#
#   torchrun --standalone --nproc_per_node=8 train.py config/transformer_1b.py
# (the data and the batch: see config/fm_1b.py)
# Speed: `python bench.py train` (README, Results).

out_dir = 'out-transformer-1b'
wandb_log = False
wandb_project = 'factorization-memory'
wandb_run_name = 'transformer-1b'

dataset = 'hf:mlfoundations/dclm-baseline-1.0'
tokenizer = 'cl100k_base'
batch_size = 8  # per GPU
block_size = 1024
gradient_accumulation_steps = 8 * 8  # over all GPUs: 8 per GPU on 8 GPUs

mixer = 'attn'
n_layer = 16
d_model = 2048
n_head = 16
n_kv_head = 4
d_ff = 5184

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
