"""
Sample from a model trained by train.py, decoding with the recurrent step (constant memory for fm and mamba2).

    python sample.py                                   # out/ckpt.pt
    python sample.py --ckpt=best.pt --start="ROMEO:" --num_samples=2 --max_new_tokens=300 --temperature=0.7
    python sample.py --out_dir=out-fm-1b --start=FILE:prompt.txt --top_k=50
"""
import os
import sys
from contextlib import nullcontext

import torch

from checkpoint import CheckpointError, load_checkpoint, model_from_checkpoint
from configurator import ConfigError, help_text, load_config
from prepare_data import get_tokenizer

# -----------------------------------------------------------------------------
out_dir = 'out'
ckpt = 'ckpt.pt'  # a file in out_dir (best.pt: the best validation loss), or a path
start = '\n'  # the prompt, or FILE:path to read it from a file
num_samples = 3
max_new_tokens = 500
temperature = 0.8  # below 1: more conservative; above 1: more random
top_k = None  # sample from the k most likely tokens only; None: all
seed = 1337
device = 'cuda' if torch.cuda.is_available() else 'cpu'
dtype = 'auto'  # 'float32', 'bfloat16', 'float16'; 'auto': bfloat16 on CUDA, float32 elsewhere
# -----------------------------------------------------------------------------
_DEFAULTS = {k: v for k, v in globals().items() if not k.startswith('_') and isinstance(v, (bool, int, float, str))}
_DEFAULTS['top_k'] = None


def main(argv=()):
    argv = list(argv)
    if '-h' in argv or '--help' in argv:
        print(__doc__ + '\nsettings (--key=value):\n' + help_text(_DEFAULTS))
        return []
    cfg = load_config(_DEFAULTS, argv, types={'top_k': int})
    if cfg['dtype'] not in ('auto', 'float32', 'bfloat16', 'float16'):
        raise ConfigError(f"dtype must be 'auto', 'float32', 'bfloat16' or 'float16', not {cfg['dtype']!r}")
    if cfg['temperature'] <= 0:
        raise ConfigError('temperature must be above 0')
    torch.manual_seed(cfg['seed'])
    device = torch.device(cfg['device'])
    dtype = cfg['dtype'] if cfg['dtype'] != 'auto' else ('bfloat16' if device.type == 'cuda' else 'float32')
    ctx = nullcontext() if dtype == 'float32' else torch.autocast(device.type, dtype=getattr(torch, dtype))

    path = os.path.join(cfg['out_dir'], cfg['ckpt'])
    checkpoint = load_checkpoint(path)  # onto the CPU first
    model = model_from_checkpoint(checkpoint, path)
    try:
        tok = get_tokenizer(checkpoint['tokenizer'])
    except Exception as e:
        raise CheckpointError(f'{path} was trained with tokenizer {checkpoint["tokenizer"]!r}, which cannot be loaded '
                         f'here ({e}); install what it needs (see requirements.txt)') from None
    del checkpoint
    model.eval().to(device)

    prompt = cfg['start']
    if prompt.startswith('FILE:'):
        if not os.path.isfile(prompt[5:]):
            raise ConfigError(f'--start=FILE:{prompt[5:]}: no such file')
        with open(prompt[5:], encoding='utf-8') as f:
            prompt = f.read()
    ids = tok.encode(prompt) or ([tok.eot] if tok.eot is not None else tok.encode('\n'))
    if max(ids) >= model.config.vocab_size:
        raise CheckpointError(f'the prompt has token {max(ids)}, outside the model vocab of {model.config.vocab_size}: '
                         f'is {path} from another tokenizer?')
    idx = torch.tensor(ids, dtype=torch.long, device=device)[None].repeat(cfg['num_samples'], 1)
    with torch.no_grad(), ctx:
        out = model.generate(idx, cfg['max_new_tokens'], temperature=cfg['temperature'], top_k=cfg['top_k'] or None,
                             n_tokens=tok.vocab_size)  # never the padding ids of a padded vocabulary
    samples = [tok.decode(row.tolist()) for row in out]
    for text in samples:
        print(text)
        print('---------------')
    return samples


if __name__ == '__main__':
    try:
        main(sys.argv[1:])
    except (ConfigError, CheckpointError) as e:
        sys.exit(f'error: {e}')
