# Levers for long-range memory (issue 39): FM's block at 4.1M parameters, trained at 512 bytes as the extrapolation
# subset's fm-k16-block (research/extrapolation_fm.py with --fm_conv=4 --fm_gate=True: d_ff = None gives the block's
# weights from the SwiGLU, d_ff 704 -> 617), with a lever of research/levers.py as its mixer:
#   python train.py research/levers_fm.py --mixer=research.levers:RowRatesFM --seed=1 --out_dir=out-levers-rowrates
# Parameters without the embedding: 4,135,180 (the block, LowWriteFM, HeadsFM, Heads16FM); RowRatesFM 4,135,564.
# bash research/reproduce.sh levers trains each at 3 learning rates x SEEDS.

out_dir = 'out-levers-fm'
wandb_run_name = 'levers-fm'

dataset = 'default'
tokenizer = 'bytes'
batch_size = 32
block_size = 512
gradient_accumulation_steps = 1

mixer = 'fm'  # --mixer=research.levers:LowWriteFM, RowRatesFM, HeadsFM or Heads16FM
n_layer = 6
d_model = 256
n_memory = 64
top_k = 16  # k = m/4
tau = 1.0
fm_conv = 4  # the block
fm_gate = True
chunk_size = 64

learning_rate = 2e-3  # the block's best of 1e-3 to 4e-3 (reproduce.sh extrapolation, fm-k16-block)
min_lr = 2e-4
warmup_iters = 60
max_iters = 640

eval_interval = 640  # one evaluation, at the end: best_val_loss is the final model's
eval_iters = 64  # 64 x 32 = 2,048 fixed windows of 512 (1M bytes; the validation split holds 0.9M)
log_interval = 40
