"""
Multi-query associative recall (MQAR; Arora et al., "Zoology", arXiv 2312.04927, Section 3 and its
appendix), written from the paper's definition. An example of seq_len tokens holds n_pairs key-value
pairs first (key, value, key, value, ...; keys distinct, drawn from the vocabulary's lower half less
token 0, values from its upper half), then the keys again, each once, in a random order, at even
offsets of the rest drawn without replacement from a power law (slot g of seq_len / 2 - n_pairs with
probability proportional to a g^(a - 1), a = 0.01: most queries come soon after the pairs, some
late), every other position a random token that is none of the example's keys (uniform over the
others). The target at a query is the value that followed its key; every other target is -1
(model.py's ignore index).
    inputs, targets = mqar(8, 256, 16, torch.Generator().manual_seed(1))
"""
import torch

VOCAB = 8192
POWER_A = 0.01
TRAIN = ((64, 4), (128, 8), (256, 16), (256, 32), (256, 64))  # (seq_len, n_pairs), a batch each
TEST = ((64, 4), (64, 8), (64, 16), (128, 32), (256, 64), (512, 128), (1024, 256))  # 2 beyond TRAIN
TEST_SEED = 10 ** 6  # the test slices' generators: TEST_SEED + the slice's index


def distinct(n, k, low, high, generator):
    """(n, k) int64: k distinct integers in [low, high) a row, uniformly."""
    uniform = torch.rand(n, high - low, generator=generator, device=generator.device)
    return uniform.topk(k, -1).indices + low


def mqar(n, seq_len, n_pairs, generator, vocab=VOCAB, power_a=POWER_A):
    """n examples -> inputs, targets (n, seq_len) int64 on the generator's device; targets -1 except
    at the queries."""
    if seq_len % 2 or 4 * n_pairs > seq_len or n_pairs >= vocab // 2:
        raise ValueError(f'MQAR of {n_pairs} pairs in {seq_len} tokens of {vocab}: give an even '
                         f'seq_len of at least 4 x n_pairs, and fewer pairs than vocab / 2')
    device = generator.device
    keys = distinct(n, n_pairs, 1, vocab // 2, generator)  # (n, P)
    values = distinct(n, n_pairs, vocab // 2, vocab, generator)  # (n, P)
    slots = seq_len // 2 - n_pairs  # query slots: even offsets after the pairs
    weights = torch.arange(1, slots + 1, dtype=torch.float64, device=device) ** (power_a - 1)
    gaps = torch.multinomial(weights.expand(n, slots), n_pairs, replacement=False,
                             generator=generator)  # (n, P)
    query = 2 * n_pairs + 2 * gaps  # (n, P): key i asked again here
    inputs = fillers(n, seq_len, keys, vocab, generator)
    inputs[:, 0:2 * n_pairs:2], inputs[:, 1:2 * n_pairs:2] = keys, values
    inputs.scatter_(1, query, keys)
    targets = torch.full((n, seq_len), -1, dtype=torch.long, device=device)
    return inputs, targets.scatter_(1, query, values)


def fillers(n, seq_len, keys, vocab, generator):
    """(n, seq_len) tokens uniform over those that are none of their row's keys: the j-th such token
    for j uniform in [0, vocab - n_pairs), which is j + #{i: k_i - i <= j} for the row's keys sorted,
    k_0 < k_1 < ..."""
    n_pairs = keys.shape[1]
    holes = keys.sort(-1).values - torch.arange(n_pairs, device=keys.device)  # (n, P), nondecreasing
    j = torch.randint(vocab - n_pairs, (n, seq_len), generator=generator, device=generator.device)
    return j + torch.searchsorted(holes, j, right=True)


def held_out(n, seed=TEST_SEED, slices=TEST):
    """{(seq_len, n_pairs): (inputs, targets)} of n held-out examples a slice on the CPU, the same
    for every run."""
    return {(seq_len, n_pairs): mqar(n, seq_len, n_pairs, torch.Generator().manual_seed(seed + i))
            for i, (seq_len, n_pairs) in enumerate(slices)}
