# Memory scaling at small scale (paper Figure 5): Factorization Memory with m = 16 ... 256 memory rows, dense
# (k = m), fixed k = 4 and proportional k = m/4, each at tau in {1, 0.5, 0.25, 0.125}; everything else as here,
# the same seed and so the same batches in every run. research/reproduce.sh runs the grid with --n_memory, --top_k
# and --tau; `python research/analysis.py scaling` plots the validation losses at each m's best tau.
# 4 layers, d_model = d_memory = 256. Parameters: 2,773,256 at m = 16 ... 3,019,016 at m = 256 (the router
# grows with m). 480 steps of 16 x 512 bytes = 3.9M bytes.
#   python train.py research/scaling_fm.py --n_memory=128 --top_k=32 --tau=0.25 --out_dir=out-scaling-m128-k32-tau0.25

out_dir = 'out-scaling-fm'
wandb_run_name = 'scaling-fm'

dataset = 'default'
tokenizer = 'bytes'
batch_size = 16
block_size = 512
gradient_accumulation_steps = 1

mixer = 'fm'
n_layer = 4
d_model = 256
n_memory = 64
top_k = 16
tau = 1.0
fm_conv = 0  # the paper's layer: reproduce.sh adds FM's block where it names it
fm_gate = False
chunk_size = 16  # the PyTorch scan (m = 256 on a GPU, above the Triton kernels' 128 rows): 16 keeps its memory low

learning_rate = 3e-3
min_lr = 3e-4
warmup_iters = 40
max_iters = 480

eval_interval = 480  # one evaluation, at the end: best_val_loss is the final model's
eval_iters = 40  # 40 x 16 = 640 fixed windows of 512 bytes, the same in every run
log_interval = 40
