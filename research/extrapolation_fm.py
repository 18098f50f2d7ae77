# Extrapolation at small scale (paper Figures 3-4), Factorization Memory: trained at a context of 512 bytes, then
# evaluated by eval.py on long unseen documents out to their ends (64x the context and beyond). The runs of
# research/reproduce.sh: this file as it is (k = m/4 = 16), with --top_k=None (dense) and with --top_k=4 (fixed k).
# Baselines with the same blocks, data, tokens and schedule: extrapolation_transformer.py, extrapolation_mamba2.py.
# 6 layers, d_model = d_memory = 256, m = 64 rows (a state of 64 x 256 per layer, as Mamba-2's 4 heads x 64 x 64).
# Parameters: 4,200,716 (any k). 640 steps of 32 x 512 bytes = 10.5M bytes, about 1.9 passes over the training
# split (5.5M bytes).
#   python train.py research/extrapolation_fm.py --top_k=None --out_dir=out-extrapolation-fm-dense

out_dir = 'out-extrapolation-fm'
wandb_run_name = 'extrapolation-fm'

dataset = 'default'
tokenizer = 'bytes'
batch_size = 32
block_size = 512
gradient_accumulation_steps = 1

mixer = 'fm'
n_layer = 6
d_model = 256
n_memory = 64
top_k = 16  # k = m/4
tau = 1.0
fm_conv = 0  # the paper's layer: reproduce.sh adds FM's block where it names it
fm_gate = False
chunk_size = 64

learning_rate = 1e-3  # the best of 2.5e-4 to 2e-3 for k = 16 and dense (k = 4: 5e-4), reproduce.sh extrapolation
min_lr = 1e-4
warmup_iters = 60
max_iters = 640

eval_interval = 640  # one evaluation, at the end: best_val_loss is the final model's
eval_iters = 64  # 64 x 32 = 2,048 fixed windows of 512 (1M bytes; the validation split holds 0.9M)
log_interval = 40
