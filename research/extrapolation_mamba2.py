# Extrapolation at small scale: the Mamba-2 baseline of extrapolation_fm.py (same blocks, data, tokens and
# schedule): expand 1 (d_inner 256 in 4 heads of 64), d_state 64 (a state of 4 x 64 x 64 per layer, as FM's
# 64 x 256), conv 4. Parameters: 4,192,328 (extrapolation_fm: 4,200,716, -0.20%), with the SwiGLU width 592.
# Without mamba-ssm the model runs its PyTorch SSD scan, slower on a GPU but the same function.
#   python train.py research/extrapolation_mamba2.py

out_dir = 'out-extrapolation-mamba2'
wandb_run_name = 'extrapolation-mamba2'

dataset = 'default'
tokenizer = 'bytes'
batch_size = 32
block_size = 512
gradient_accumulation_steps = 1

mixer = 'mamba2'
n_layer = 6
d_model = 256
mamba_expand = 1
mamba_head_dim = 64
d_state = 64
d_conv = 4
d_ff = 592
chunk_size = 64

learning_rate = 4e-3  # the best of 2e-3 to 8e-3, reproduce.sh extrapolation
min_lr = 4e-4
warmup_iters = 60
max_iters = 640

eval_interval = 640
eval_iters = 64
log_interval = 40
