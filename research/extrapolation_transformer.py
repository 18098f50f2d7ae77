# Extrapolation at small scale: the Transformer baseline of extrapolation_fm.py (same blocks, data, tokens and
# schedule) with grouped-query causal attention (4 heads of 64, 2 KV heads, RoPE) in place of Factorization Memory.
# Parameters: 4,197,632 (extrapolation_fm: 4,200,716, -0.07%), with the SwiGLU width 640 instead of 704.
#   python train.py research/extrapolation_transformer.py

out_dir = 'out-extrapolation-transformer'
wandb_run_name = 'extrapolation-transformer'

dataset = 'default'
tokenizer = 'bytes'
batch_size = 32
block_size = 512
gradient_accumulation_steps = 1

mixer = 'attn'
n_layer = 6
d_model = 256
n_head = 4
n_kv_head = 2
d_ff = 640

learning_rate = 2e-3  # the best of 1e-3 to 4e-3, reproduce.sh extrapolation
min_lr = 2e-4
warmup_iters = 60
max_iters = 640

eval_interval = 640
eval_iters = 64
log_interval = 40
