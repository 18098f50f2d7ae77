"""Sample from a model train.py trained (decoding: generate.py); one sample streams, several run
as one batch:
    python sample.py                                   # out/ckpt.pt
    python sample.py --ckpt=best.pt --start="ROMEO:" --num_samples=4 --temperature=0.7
    python sample.py --out_dir=out-fm-1b --start=FILE:prompt.txt --top_p=0.9
"""
from configurator import (ConfigError, help_text, load_config, quit_on_ctrl_c, quit_on_sigterm,
                          run_main)

if __name__ == '__main__':  # first: a signal while the imports load is one line
    quit_on_ctrl_c()

import sys
import time
from pathlib import Path

import torch

from checkpoint import CheckpointError, load_checkpoint, model_from_checkpoint, tokenizer_of
from run import DTYPES, check_device, memory, resolve_dtype
from fm_kernel import DecodingError
from generate import Generator, Sampling
from prepare_data import read_utf8

# -----------------------------------------------------------------------------
out_dir = 'out'  # the training run's folder
ckpt = 'ckpt.pt'  # a file in out_dir (best.pt: best validation loss), or a path
start = '\n'  # the prompt, or FILE:path to read it from
num_samples = 3  # generated together, as one batch
max_new_tokens = 500  # or fewer: a sample ends at end-of-text (bytes has none)
temperature = 0.8  # below 1: more conservative; above 1: more random; 0: the likeliest token
top_k = None  # only the k most likely tokens; None: all
top_p = 1.0  # only the fewest most likely tokens reaching probability top_p; 1.0: all
seed = 1337  # the same seed, the same samples
device = 'cuda' if torch.cuda.is_available() else 'cpu'  # 'cpu', 'cuda', 'cuda:1', ...
dtype = 'auto'  # 'float32', 'bfloat16', 'float16'; 'auto': bfloat16 on CUDA, else float32
# -----------------------------------------------------------------------------
_TYPES = (int, float, str, type(None))
_DEFAULTS = {k: v for k, v in globals().items() if k[0] != '_' and isinstance(v, _TYPES)}


def load(argv):
    """argv -> cfg (checked), the checkpoint's model (device, dtype), tok, sampling, ids."""
    cfg = load_config(_DEFAULTS, argv, {'top_k': int}, config_files=False, program='sample.py')
    n, length = cfg['num_samples'], cfg['max_new_tokens']
    if cfg['dtype'] not in DTYPES or min(n, length) < 1:
        raise ConfigError(f"--dtype={cfg['dtype']!r}, --num_samples={n}, --max_new_tokens="
                          f"{length}: use auto, float32, bfloat16 or float16, and counts of 1 or "
                          f"more")
    if not 0 <= cfg['seed'] < 2**32:
        raise ConfigError(f"--seed={cfg['seed']} is out of range: set it to 0 to {2**32 - 1}")
    sampling = Sampling(cfg['temperature'], cfg['top_k'], cfg['top_p'])
    check_device(cfg['device'])
    path = Path(cfg['out_dir']) / cfg['ckpt']
    checkpoint = load_checkpoint(path)
    model, tok = model_from_checkpoint(checkpoint, path), tokenizer_of(checkpoint, path)
    if cfg['top_k'] is not None and cfg['top_k'] > tok.vocab_size:
        raise ConfigError(f"--top_k={cfg['top_k']} is more than the {tok.vocab_size} tokens of "
                          f"{checkpoint['tokenizer']}: give at most {tok.vocab_size}, or None for "
                          f"every token")
    sampling.n_tokens = tok.vocab_size  # no padding ids
    dtype = getattr(torch, resolve_dtype(cfg['dtype'], cfg['device']))
    model = model.eval().to(cfg['device'], dtype)
    prompt = read_prompt(cfg['start'])
    ids = tok.encode(prompt)
    # an empty prompt: end-of-text, or a newline where the tokenizer has none
    if not ids:
        ids = [tok.eot] if tok.eot is not None else tok.encode('\n')
    block = model.config.block_size
    if model.config.family == 'attn' and len(ids) > block:
        print(f'warning: the prompt is {len(ids):,} tokens, past the {block} this attention model '
              f'was trained at (block_size): attention does not extrapolate past block_size',
              file=sys.stderr)
    check_generation_fits(model, n, len(ids), length)
    return cfg, model, tok, sampling, ids


def read_prompt(start):
    """--start's text, or the text of the file FILE:path names; ConfigError if not UTF-8."""
    if start == 'FILE:':
        raise ConfigError('--start=FILE: names no file: give FILE:path, e.g. '
                          '--start=FILE:prompt.txt')
    try:
        if start.startswith('FILE:'):
            return read_utf8(Path(start[5:]))
        start.encode('utf-8')
        return start
    except OSError as e:
        raise ConfigError(f'--start={start}: cannot read {start[5:]} ({e.strerror}): give '
                          f'FILE:path of a UTF-8 text file') from None
    except UnicodeEncodeError as e:  # argv's non-UTF-8 bytes come as surrogates
        raise ConfigError(f'--start is not UTF-8 text (character {e.start} is not): give UTF-8 '
                          f'text, or FILE:path to read the prompt from a UTF-8 file') from None
    except ValueError as e:  # read_utf8's: names the file, the byte, the fix
        raise ConfigError(f'--start={start}: {e}') from None


def check_generation_fits(model, batch, prompt_len, max_new_tokens):
    """ConfigError if batch rows' decoding buffers (states, tokens, logits) exceed free memory."""
    device = model.embed.weight.device
    state = model.init_state(batch, prompt_len + max_new_tokens, 'meta')
    need = sum(t.numel() * t.element_size() for layer in state for t in layer.values())
    need += batch * (8 * max_new_tokens + 4 * 4 * model.config.vocab_size)
    free = memory(device, free=True)
    if need > free:
        tokens = prompt_len + max_new_tokens
        raise ConfigError(f'--num_samples={batch} x {tokens:,} tokens (prompt and '
                          f'--max_new_tokens) need about {need / 1e9:,.1f} GB of decoding buffers; '
                          f'{device} has {free / 1e9:,.1f} GB free: lower --num_samples or '
                          f'--max_new_tokens')


def main(argv=()):
    """python sample.py --key=value ... -> the samples' texts, prompt included ([] for --help)."""
    if '-h' in argv or '--help' in argv:
        print(__doc__ + '\nsettings (--key=value):\n' + help_text(_DEFAULTS, __file__))
        return []
    cfg, model, tok, sampling, ids = load(list(argv))
    n, length = cfg['num_samples'], cfg['max_new_tokens']
    generator = Generator(model, sampling, eot=tok.eot)
    stream = Stream(tok, ids) if n == 1 else None
    torch.manual_seed(cfg['seed'])
    begin = last = time.perf_counter()

    def progress(done):  # every 5 s of a long batch, to stderr
        nonlocal last
        if time.perf_counter() - last >= 5:
            last = time.perf_counter()
            print(f'{done:,} of {length:,} tokens a sample, {done / (last - begin):,.1f} steps/s',
                  file=sys.stderr, flush=True)
    on_progress = None if stream else progress
    new = generator.generate([ids] * n, length, on_tokens=stream, on_progress=on_progress)
    seconds, n_tokens = time.perf_counter() - begin, sum(map(len, new))
    samples = [tok.decode(ids + row) for row in new]
    if stream:
        print('\n---------------')
    else:
        print('\n'.join(f'{text}\n---------------' for text in samples))
    mode = 'CUDA graph' if generator.cuda_graph else 'eager'
    print(f'{n_tokens} tokens in {seconds:.2f} s: {n_tokens / seconds:,.0f} tokens/s (batch {n}, '
          f'{generator.device}, {mode})', file=sys.stderr)
    return samples


class Stream:
    """Prints a sample's text as its tokens arrive (an incomplete UTF-8 character held back)."""

    def __init__(self, tok, prompt):
        self.tok, self.ids, self.shown, self.ended = tok, [], '', False
        print(tok.decode(prompt), end='', flush=True)

    def __call__(self, tokens):
        self.ended = self.ended or tokens[0] == self.tok.eot
        if not self.ended:  # the batch decodes on; this text ended
            self.ids.append(tokens[0])
            text = self.tok.decode(self.ids)
            if not text.endswith('\ufffd'):  # an incomplete UTF-8 character waits
                print(text[len(self.shown):], end='', flush=True)
                self.shown = text


if __name__ == '__main__':
    quit_on_sigterm()
    run_main(main, CheckpointError, DecodingError)
