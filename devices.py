"""What a device holds, checked before any work: --device, a training micro-batch, a sample's
decoding buffers."""
import contextlib
import os
import resource
from dataclasses import replace

import torch

from configurator import ConfigError
from model import Model

DTYPES = ('auto', 'float32', 'bfloat16', 'float16')  # --dtype's choices


def resolve_dtype(dtype, device):
    """--dtype's 'auto': bfloat16 on CUDA, else float32."""
    if dtype != 'auto':
        return dtype
    if torch.device(device).type == 'cuda':
        return 'bfloat16'
    return 'float32'


def check_device(name):
    """ConfigError unless name is a device of this machine."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device={name} is not a device: use 'cpu', 'cuda', 'cuda:N' or "
                          f"'mps'") from None
    counts = {'cpu': 1, 'cuda': torch.cuda.device_count(),
              'mps': int(torch.backends.mps.is_available())}
    count, kind = counts.get(device.type, 0), device.type
    if (device.index or 0) < count:
        return
    has, use = f'{count} {kind} devices', f'{kind}:0 to {kind}:{count - 1}'
    if count == 1:
        has, use = f'1 {kind} device', kind
    if count == 0:
        has, use = f'no {kind} device', 'cpu'
    raise ConfigError(f'--device={name}, but this machine has {has}: use --device={use}')


def memory(device, free=False):
    """Bytes of a GPU's memory, or the machine's RAM (free: available to new allocations)."""
    if device.type == 'cuda' and free:
        return torch.cuda.mem_get_info(device)[0]
    if device.type == 'cuda':
        return torch.cuda.get_device_properties(device).total_memory
    if free:  # Linux's MemAvailable (page cache counts as free), else all of it
        with contextlib.suppress(OSError, IndexError), open('/proc/meminfo') as f:
            lines = [line for line in f if line.startswith('MemAvailable:')]
            return int(lines[0].split()[1]) * 1024
    return os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')


def peak_memory(device):
    """GB: the peak memory allocated on a GPU, else the process's peak RSS (KiB on Linux)."""
    if device.type == 'cuda':
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def count_params(config):
    """The parameters of ModelConfig config, from 1- and 2-layer models on 'meta': a huge n_layer
    is refused by the memory check, not built; a mixer's own checks run."""
    with torch.device('meta'):
        one, two = (Model(replace(config, n_layer=n)).num_params(False) for n in (1, 2))
    return one + (config.n_layer - 1) * (two - one)


def check_model_fits(config, device):
    """The parameters of config; ConfigError if the model, its gradients and AdamW's 2 moments
    (16 bytes a parameter) cannot fit on device."""
    n_params = count_params(config)
    need, have = 16 * n_params / 1e9, memory(device) / 1e9  # GB
    if need > have:
        raise ConfigError(f"the model's {n_params:,} parameters need {need:,.1f} GB (weights, "
                          f"gradients, AdamW's moments); {device} has {have:,.1f} GB: lower "
                          f"--n_layer or --d_model, or the mixer's --n_memory or --d_state")
    return n_params


def check_batch_fits(batch_size, block_size, config, n_params, device):
    """ConfigError if a micro-batch (tokens, float32 logits and gradient, an activation a layer)
    cannot fit beside the model (check_model_fits)."""
    model, have = 16 * n_params / 1e9, memory(device) / 1e9  # GB
    token = 16 + 8 * config.vocab_size + 4 * config.n_layer * config.d_model  # bytes
    need = batch_size * block_size * token / 1e9
    if model + need > have:
        raise ConfigError(f'--batch_size={batch_size} x --block_size={block_size} tokens a '
                          f'micro-batch need more than {need:,.1f} GB beside the model; {device} '
                          f'has {have - model:,.1f} GB left: lower --batch_size (raise '
                          f'--gradient_accumulation_steps to keep the step)')


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
