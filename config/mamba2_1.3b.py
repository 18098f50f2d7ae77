# The published Mamba-2 1.3B shape (state-spaces/mamba2-1.3b), the paper's Mamba-2 point in its inference-speed
# comparison (Figure 6): 48 blocks of RMSNorm and a Mamba-2 mixer, no MLP (d_model 2048, expand 2: d_inner 4096
# in 64 heads of 64, state 128, one B/C group, conv 4); 1.34B parameters with the tied embedding, as published.
# Vocabulary: GPT-NeoX's 50,277 tokens padded to 50,288, as published; that tokenizer is not a tiktoken
# encoding, so this config is for `python bench.py generate` (random bf16 weights), not for training.

out_dir = 'out-mamba2-1.3b'
tokenizer = 'gpt-neox'  # bench.py: vocabulary 50,288
block_size = 2048

mixer = 'mamba2'
n_layer = 48
d_model = 2048
mamba_expand = 2
mamba_head_dim = 64
d_state = 128
d_conv = 4
d_ff = 0  # no MLP, as published
chunk_size = 256
dtype = 'bfloat16'
