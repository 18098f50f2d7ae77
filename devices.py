"""What a device holds, checked before any work: --device, a training micro-batch, a sample's decoding buffers."""
import contextlib
import os
import resource

import torch

from configurator import ConfigError

DTYPES = ('auto', 'float32', 'bfloat16', 'float16')  # --dtype's choices


def resolve_dtype(dtype, device):
    """--dtype's 'auto': bfloat16 on CUDA, else float32."""
    return dtype if dtype != 'auto' else 'bfloat16' if torch.device(device).type == 'cuda' else 'float32'


def check_device(name):
    """ConfigError unless name is a device of this machine."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device={name} is not a device: use 'cpu', 'cuda', 'cuda:N' or 'mps'") from None
    count = {'cpu': 1, 'cuda': torch.cuda.device_count(), 'mps': int(torch.backends.mps.is_available())}.get(
        device.type, 0)
    if (device.index or 0) >= count:
        use = f'{device.type}:0 to {device.type}:{count - 1}' if count > 1 else device.type if count else 'cpu'
        raise ConfigError(f'--device={name}, but this machine has {count or "no"} {device.type} device'
                          f'{"s" * (count > 1)}: use --device={use}')


def memory(device, free=False):
    """Bytes of a GPU's memory, or the machine's RAM (free: available to new allocations)."""
    if device.type == 'cuda':
        return torch.cuda.mem_get_info(device)[0] if free else torch.cuda.get_device_properties(device).total_memory
    if free:  # Linux's MemAvailable (page cache counts as free), else all of it
        with contextlib.suppress(OSError, StopIteration), open('/proc/meminfo') as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith('MemAvailable:'))
    return os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')


def peak_memory(device):
    """GB: the peak memory allocated on a GPU, else the process's peak RSS (KiB on Linux)."""
    if device.type == 'cuda':
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def check_batch_fits(batch_size, block_size, config, n_params, device):
    """ConfigError if the model (weights, gradients, AdamW's 2 moments: 16 bytes a parameter) and a micro-batch (tokens,
    float32 logits and gradient, an activation a layer) cannot fit."""
    model, have = 16 * n_params / 1e9, memory(device) / 1e9  # GB
    need = batch_size * block_size * (16 + 8 * config.vocab_size + 4 * config.n_layer * config.d_model) / 1e9
    if model > have:
        raise ConfigError(f"the model's {n_params:,} parameters need {model:,.1f} GB (weights, gradients, AdamW's "
                          f"moments); {device} has {have:,.1f} GB: lower --n_layer or --d_model")
    if model + need > have:
        raise ConfigError(f'--batch_size={batch_size} x --block_size={block_size} tokens a micro-batch need more than '
                          f'{need:,.1f} GB beside the model; {device} has {have - model:,.1f} GB left: lower '
                          f'--batch_size (raise --gradient_accumulation_steps to keep the step)')


def check_generation_fits(model, batch, prompt_len, max_new_tokens):
    """ConfigError if the decoding buffers of batch rows (states, new tokens, logits) exceed the free memory."""
    device = model.embed.weight.device
    state = model.init_state(batch, prompt_len + max_new_tokens, 'meta')
    need = sum(t.numel() * t.element_size() for layer in state for t in layer.values())
    need += batch * (8 * max_new_tokens + 4 * 4 * model.config.vocab_size)
    if need > (free := memory(device, free=True)):
        raise ConfigError(f'--num_samples={batch} x {prompt_len + max_new_tokens:,} tokens (prompt and '
                          f'--max_new_tokens) need about {need / 1e9:,.1f} GB of decoding buffers; {device} has '
                          f'{free / 1e9:,.1f} GB free: lower --num_samples or --max_new_tokens')
