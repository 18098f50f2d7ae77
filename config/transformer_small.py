# A small Transformer on the default corpus, the baseline for fm_small.py (same blocks, data and schedule):
# causal attention with 4 heads of 32, 2 KV heads, RoPE. Parameters: 771,200 (fm_small: 772,744), with the
# SwiGLU width 352 instead of 384. About 2.5 minutes on a 2-core CPU.
#   python train.py config/transformer_small.py

out_dir = 'out-transformer-small'
wandb_run_name = 'transformer-small'

dataset = 'default'
tokenizer = 'bytes'
batch_size = 16
block_size = 256
gradient_accumulation_steps = 1

mixer = 'attn'
n_layer = 4
d_model = 128
n_head = 4
n_kv_head = 2
d_ff = 352

learning_rate = 4e-3
min_lr = 4e-4
warmup_iters = 50
max_iters = 500

eval_interval = 100
eval_iters = 16
log_interval = 10
