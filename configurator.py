"""
Command-line overrides for train.py and sample.py, in the style of nanoGPT:

    python train.py config/fm_small.py --batch_size=32 --compile=False

Arguments without '--' are config files: Python files that assign to some of the known keys
(they can read the current values, e.g. `max_iters = 2 * warmup_iters`; names starting with '_'
are private helpers). Arguments '--key=value' override one key. Values must parse to the type of
the default: ints for ints, numbers for floats, True/False for bools, any text for strings.
A key whose default is None takes None or a value of the type given in `types`.
"""
import ast
import difflib
import os
import traceback
import types as pytypes


class ConfigError(ValueError):
    pass


def _check(key, value, config, types):
    """Return value converted to the type of config[key]; raise ConfigError if it does not fit."""
    if key not in config:
        close = difflib.get_close_matches(key, list(config), n=3, cutoff=0.6)
        hint = f"Did you mean {' or '.join(close)}?" if close else f"Known keys: {', '.join(sorted(config))}"
        raise ConfigError(f"unknown config key '{key}'. {hint}")
    default = config[key]
    want = type(default) if default is not None else types.get(key)
    if value is None and (default is None or key in types):
        return None
    if want is None:
        return value
    if isinstance(value, bool) == (want is bool):  # bools are ints to Python, not here
        if isinstance(value, want):
            return value
        if want is float and isinstance(value, int):
            return float(value)
    raise ConfigError(f"bad value for '{key}': {value!r} is a {type(value).__name__}, "
                      f"expected a {want.__name__} (default: {default!r})")


def _parse(key, text, config, types):
    """Parse the text of --key=text to the type of the key's default."""
    default = config.get(key)
    want = type(default) if default is not None else types.get(key)
    if want is str:
        if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
            text = text[1:-1]
        return text
    if want is bool and text.lower() in ('true', 'false'):
        return text.lower() == 'true'
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise ConfigError(f"bad value for '{key}': cannot parse {text!r} as a "
                          f"{want.__name__ if want else 'Python literal'} value (default: {default!r})") from None


def load_config(config, argv, types=None):
    """Apply config files and --key=value overrides in argv, in order, to a copy of the dict config."""
    config, types = dict(config), types or {}
    for arg in argv:
        if not arg.startswith('--'):
            if not os.path.isfile(arg):
                raise ConfigError(f"config file not found: {arg} (see config/, e.g. config/fm_small.py)")
            namespace = dict(config)
            _run_config_file(arg, namespace)
            for key, value in namespace.items():
                if key.startswith('_') or isinstance(value, (pytypes.ModuleType, pytypes.FunctionType, type)):
                    continue
                try:
                    config[key] = _check(key, value, config, types)
                except ConfigError as e:
                    raise ConfigError(f"{arg}: {e}") from None
        else:
            if '=' not in arg:
                raise ConfigError(f"expected --key=value, got {arg!r}")
            key, text = arg[2:].split('=', 1)
            if key not in config:
                _check(key, None, config, types)  # raises the unknown-key error
            config[key] = _check(key, _parse(key, text, config, types), config, types)
    return config


def _run_config_file(path, namespace):
    """Execute a config file in namespace; ConfigError naming the line of a syntax or other error in it."""
    with open(path) as f:
        source = f.read()
    try:
        exec(compile(source, path, 'exec'), namespace)
    except SyntaxError as e:
        raise ConfigError(f"{path}, line {e.lineno}: {e.msg}: fix the config file") from None
    except Exception as e:
        line = [frame.lineno for frame in traceback.extract_tb(e.__traceback__) if frame.filename == path][-1:]
        where = f"{path}, line {line[0]}" if line else path
        raise ConfigError(f"{where}: {type(e).__name__}: {e}: fix the config file") from None


def help_text(config):
    return "\n".join(f"  --{k}={v!r}" for k, v in config.items())
