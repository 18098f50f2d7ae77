"""Checkpoints of train.py: atomic writes, and loading with errors that say what to do.
sample.py, eval.py and bench.py load models through here without importing the training script."""
import os
from pathlib import Path

import torch

from model import Model, ModelConfig

CKPT_KEYS = ('model', 'optimizer', 'model_config', 'train_config', 'iter_num', 'best_val_loss', 'rng',
             'data_state', 'tokenizer')


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, unreadable or does not fit this code; the message says what to do."""


def save_checkpoint(ckpt, path):
    """Write atomically: to a temporary file beside path, then rename, so path is never half-written."""
    tmp = f'{path}.tmp'
    with open(tmp, 'wb') as f:
        torch.save(ckpt, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def link_checkpoint(src, dst, ckpt):
    """Make dst the file src without writing it again: a hard link (src is only ever replaced, never rewritten,
    so dst stays intact), or a fresh save where the file system has no hard links."""
    tmp = f'{dst}.tmp'
    try:
        if os.path.exists(tmp):
            os.remove(tmp)
        os.link(src, tmp)
        os.replace(tmp, dst)
    except OSError:
        save_checkpoint(ckpt, dst)


def load_checkpoint(path):
    """Load a checkpoint onto the CPU; raise CheckpointError saying what to do if it is missing or unreadable."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f'no checkpoint at {path}: train one first (python train.py, which writes '
                         f'out/ckpt.pt), or point --out_dir at the folder that holds it')
    try:
        ckpt = torch.load(path, map_location='cpu', weights_only=True, mmap=True)  # ranks share the pages
    except Exception as e:
        raise CheckpointError(f'{path} is not a readable checkpoint ({type(e).__name__}: {str(e)[:200]}). It may have '
                         f'been cut short or written by another program: delete it and train again with '
                         f'--init_from=scratch, or use best.pt beside it') from None
    missing = [k for k in CKPT_KEYS if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise CheckpointError(f'{path} is not a checkpoint of this train.py (missing {", ".join(missing)}): '
                         f'train again with --init_from=scratch')
    return ckpt


def model_from_checkpoint(ckpt, path):
    """Rebuild the model of a checkpoint (on the CPU) with clear errors for a config or weights mismatch."""
    try:
        model = Model(ModelConfig(**ckpt['model_config']))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f'{path} holds a model config this model.py cannot build ({e}): use the model.py '
                         f'version that wrote it, or train again with --init_from=scratch') from None
    try:
        model.load_state_dict(ckpt['model'])
    except RuntimeError as e:
        raise CheckpointError(f'the weights in {path} do not fit the model they describe ({str(e)[:500]}): '
                         f'use the model.py version that wrote it, or train again') from None
    return model
