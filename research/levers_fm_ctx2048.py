# Levers for long-range memory (issue 39), what the model is asked to remember: research/levers_fm.py (FM's block
# at 4.1M parameters) trained at a context of 2048 bytes, 8 x 2048 = 32 x 512 tokens a step (the same tokens, steps
# and schedule). Its validation loss is at 2048, not comparable with the 512 runs': compare loss by position.
#   python train.py research/levers_fm_ctx2048.py --seed=1 --out_dir=out-levers-ctx2048

out_dir = 'out-levers-fm-ctx2048'
wandb_run_name = 'levers-fm-ctx2048'

dataset = 'default'
tokenizer = 'bytes'
batch_size = 8
block_size = 2048
gradient_accumulation_steps = 1

mixer = 'fm'  # a lever too: --mixer=research.levers:RowRatesFM
n_layer = 6
d_model = 256
n_memory = 64
top_k = 16  # k = m/4
tau = 1.0
fm_conv = 4  # the block
fm_gate = True
chunk_size = 64

learning_rate = 2e-3  # as research/levers_fm.py
min_lr = 2e-4
warmup_iters = 60
max_iters = 640

eval_interval = 640  # one evaluation, at the end: best_val_loss is the final model's
eval_iters = 64  # 64 x 8 = 512 fixed windows of 2048 (1M bytes; the validation split holds 0.9M)
log_interval = 40
