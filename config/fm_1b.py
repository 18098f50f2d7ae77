# Factorization Memory, the paper's 1B model (Section 4.4): 16 layers, d_model = d_memory = 2048, m = 64 memory
# rows, k = 8 read and written per token, LLaMA blocks (RMSNorm, SwiGLU), context 1024, tokenizer cl100k_base; with
# FM's block (a convolution on xbar = W_in x and an output gate, not in the paper; config/paper_layer.py removes it).
# Parameters: 880,969,760 (675,579,936 without the tied embedding; vocab 100,277 padded to 100,288); the paper's
# layer: 882,903,072. transformer_1b.py and mamba2_1b.py match them within 0.3%.
#
# Data, prepared once (streams the dataset and tokenizes it with all CPUs into data/hf_mlfoundations_...):
#   python prepare_data.py --dataset hf:mlfoundations/dclm-baseline-1.0 --tokenizer cl100k_base --max_docs 25000000
# Train on one node of 8 GPUs:
#   torchrun --standalone --nproc_per_node=8 train.py config/fm_1b.py
#
# Tokens: 8 sequences x 1024 tokens x 64 micro-batches (8 per GPU on 8 GPUs) = 524,288 tokens per step;
# 48,000 steps = 25.2B tokens, about 28 tokens per parameter (the paper trains compute-optimally, >= 20 tokens
# per parameter; its public DCLM comparison uses 84B tokens: max_iters = lr_decay_iters = 160_000).
# Speed: `python bench.py train` (tokens/s, MFU and memory of the 1B configs; README, Results). Batch 8 fits 80 GB
# GPUs; with 141 GB, --batch_size=16 --gradient_accumulation_steps=32 is the same step.

out_dir = 'out-fm-1b'
wandb_log = False
wandb_project = 'factorization-memory'
wandb_run_name = 'fm-1b'

dataset = 'hf:mlfoundations/dclm-baseline-1.0'
tokenizer = 'cl100k_base'
batch_size = 8  # per GPU
block_size = 1024
gradient_accumulation_steps = 8 * 8  # over all GPUs: 8 per GPU on 8 GPUs

mixer = 'fm'
n_layer = 16
d_model = 2048
n_memory = 64
top_k = 8
d_memory = 2048
tau = 1.0
fm_conv = 4  # FM's block (not in the paper): a 4-tap convolution on xbar and an output gate, which close
fm_gate = True  # most of the gap to Mamba-2 at small scale (README); add config/paper_layer.py for the paper's layer
d_ff = 4800  # None would give 4,820 (the block's weights taken from the MLP's 5,504): a multiple of 64 instead
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
