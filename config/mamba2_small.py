# A small Mamba-2 model on the default corpus, the baseline for fm_small.py (same blocks, data and schedule):
# expand 1 (d_inner 128 in 4 heads of 32), d_state 32. Parameters: 761,264 (fm_small: 772,744), with the SwiGLU
# width 320 instead of 384. About 2.5 minutes on a 2-core CPU.
#   python train.py config/mamba2_small.py

out_dir = 'out-mamba2-small'
wandb_run_name = 'mamba2-small'

dataset = 'default'
tokenizer = 'bytes'
batch_size = 16
block_size = 256
gradient_accumulation_steps = 1

mixer = 'mamba2'
n_layer = 4
d_model = 128
mamba_expand = 1
mamba_head_dim = 32
d_state = 32
d_ff = 320
chunk_size = 32

learning_rate = 4e-3
min_lr = 4e-4
warmup_iters = 50
max_iters = 500

eval_interval = 100
eval_iters = 16
log_interval = 10
