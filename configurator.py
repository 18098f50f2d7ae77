"""
Command-line overrides for train.py, sample.py and eval.py, in the style of nanoGPT:

    python train.py config/fm_small.py --batch_size=32 --compile=False

Arguments without '--' are config files: Python files that assign to some of the known keys
(they can read the current values, e.g. `max_iters = 2 * warmup_iters`; names starting with '_'
are private helpers); a script that takes none (config_files=False) says what to pass instead.
Arguments '--key=value' override one key. Values must parse to the type of the default: ints for
ints, numbers for floats, True/False for bools, any text for strings. A key whose default is None
takes None or a value of the type given in `types`. help_text lists the keys for --help, each
explained by the comment on the line of the script that sets its default.
"""
import ast
import difflib
import io
import os
import sys
import tokenize
import traceback
import types as pytypes
import typing
from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent / 'config'


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


def load_config(config, argv, types=None, config_files=True, program=None):
    """Apply config files and --key=value overrides in argv, in order, to a copy of the dict config.
    config_files=False: the program (by default sys.argv[0]) takes overrides only, and says so to a config file."""
    config, types = dict(config), types or {}
    for arg in argv:
        if not arg.startswith('--'):
            if not config_files or not os.path.isfile(arg):
                raise ConfigError(_not_a_config_file(arg, config, config_files, program))
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


def _not_a_config_file(arg, config, config_files, program):
    """What an argument without '--' that load_config cannot take as a config file was meant to be."""
    if '=' in arg and arg.split('=', 1)[0] in config and not os.path.exists(arg):
        return f"{arg} is not a config file: did you mean --{arg}?"
    if config_files:
        names = [name for name in os.listdir(CONFIG_DIR) if name.endswith('.py')]
        close = difflib.get_close_matches(os.path.basename(arg), names, n=1)
        if close:
            return f"config file not found: {arg}: did you mean {os.path.relpath(CONFIG_DIR / close[0])}?"
        return f"config file not found: {arg} (see config/, e.g. config/fm_small.py)"
    program = program or os.path.basename(sys.argv[0])
    out_dir = _out_dir_of(arg) if arg.endswith('.py') and os.path.isfile(arg) else None
    if out_dir is None:
        return f"{program} takes no config files, only --key=value settings (see --help): got {arg!r}"
    return (f"{arg} is a training config; {program} reads the model from a checkpoint: pass --out_dir={out_dir}, "
            f"the folder that config's run writes")


def _out_dir_of(path):
    """The out_dir a training config file sets, or None (not a config file, or one that sets none)."""
    namespace = {}
    try:
        _run_config_file(path, namespace)
    except ConfigError:
        return None
    return namespace.get('out_dir') if isinstance(namespace.get('out_dir'), str) else None


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


def help_text(config, *source_files):
    """One line a key, `--key=default  explanation`, the explanation the comment of the line that sets the key in the
    first of source_files that has one (`key = value  # ...`, `key: type = value  # ...` or `key=value,  # ...`)."""
    comments = [_comments(path, config) for path in source_files]
    left = {key: f'  --{key}={value!r}' for key, value in config.items()}
    width = max(map(len, left.values()), default=0)
    explained = {key: next((c[key] for c in comments if c.get(key)), '') for key in config}
    return '\n'.join(f'{left[key]:<{width}}  {explained[key]}'.rstrip() for key in config)


def _comments(path, config):
    """{key: the comment of the line that sets it} in the source file at path. Where a key is set in several groups
    (module, class, dict(...) or {...}: eval.py's settings of each mode), the group that sets most keys to config's
    values wins, then the one with fewest other keys."""
    with open(path, encoding='utf-8') as f:
        source = f.read()
    lines = {t.end[0]: t.string.lstrip('#').strip() for t in tokenize.generate_tokens(io.StringIO(source).readline)
             if t.type == tokenize.COMMENT}
    groups = [_settings(node) for node in ast.walk(ast.parse(source))]

    def rank(group):
        return (-sum(key in config and _literal(value) == config[key] for key, value, _ in group),
                sum(key not in config for key, _, _ in group))

    comments = {}
    for group in sorted(groups, key=rank):  # stable: of tied groups, the outer (ast.walk's order) first
        for key, _, line in group:
            comments[key] = comments.get(key) or lines.get(line)
    return comments


def _settings(node):
    """(key, value node, the line of its comment) for each key that a module, class, dict(...) or {...} node sets."""
    if isinstance(node, (ast.Module, ast.ClassDef)):
        targets = [(s.targets[0] if isinstance(s, ast.Assign) else s.target, s) for s in node.body
                   if isinstance(s, ast.Assign) or isinstance(s, ast.AnnAssign) and s.value]
        return [(target.id, s.value, s.end_lineno) for target, s in targets if isinstance(target, ast.Name)]
    if isinstance(node, ast.Call) and getattr(node.func, 'id', None) == 'dict':
        return [(k.arg, k.value, k.value.end_lineno) for k in node.keywords if k.arg]
    if isinstance(node, ast.Dict):
        return [(k.value, v, v.end_lineno) for k, v in zip(node.keys, node.values)
                if isinstance(k, ast.Constant) and isinstance(k.value, str)]
    return []


def _literal(node):
    """The value of a literal expression node; the node itself (equal to no setting) for any other."""
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError):
        return node


def optional_types(cls):
    """For the fields of a dataclass that default to None (e.g. top_k: int | None), the type a value must have."""
    out = {}
    for name, hint in typing.get_type_hints(cls).items():
        args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
        if len(args) == 1 and isinstance(args[0], type):
            out[name] = args[0]
    return out
