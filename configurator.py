"""Settings in nanoGPT's style, `python train.py config/fm_small.py --batch_size=32`: a config file is Python that sets
known keys; --key=value sets one, as the type of its default (of types[key] for a key whose default is None)."""
import ast
import difflib
import os
import re
import sys
import traceback
import typing


class ConfigError(ValueError):
    """A setting, argument or config file that cannot be taken; the message says what to pass instead."""


def _check(key, value, config, types, where=''):
    """value (where '': the text of --key=value, parsed) as the type of config[key]; ConfigError if it is not one."""
    if key not in config:
        close = difflib.get_close_matches(key, list(config), n=3, cutoff=0.6)
        raise ConfigError(f"{where}unknown config key '{key}'" + f". Did you mean {' or '.join(close)}?" * bool(close))
    want = type(config[key]) if config[key] is not None else types.get(key)
    if not where:  # a string without quotes; True/False in any case; a Python literal, or the text (refused below)
        value = value.strip('\'"') if want is str else value.title() if value.lower() in ('true', 'false') else value
        try:
            value = value if want is str else ast.literal_eval(value)
        except (ValueError, SyntaxError):
            pass
    if want is None or value is None and (config[key] is None or key in types):
        return value
    if isinstance(value, want) and isinstance(value, bool) == (want is bool) or want is float and type(value) is int:
        return want(value)  # bools are ints to Python, not here
    raise ConfigError(f"{where}bad value for '{key}': {value!r} is a {type(value).__name__}, expected a "
                      f"{want.__name__} (default: {config[key]!r})")


def load_config(config, argv, types=None, config_files=True, program=None):
    """A copy of config with argv's config files and --key=value settings applied in order; config_files=False: the
    program (sys.argv[0] by default) takes settings alone."""
    config, program = dict(config), program or os.path.basename(sys.argv[0])
    for arg in argv:
        key, eq, text = arg.removeprefix('--').partition('=')
        if arg.startswith('--') and eq:
            config[key] = _check(key, text, config, types or {})
        elif config_files and os.path.isfile(arg):
            namespace = dict(config)
            try:
                exec(compile(open(arg).read(), arg, 'exec'), namespace)
            except Exception as e:  # named by its line in the file
                line = e.lineno if isinstance(e, SyntaxError) else [
                    frame.lineno for frame in traceback.extract_tb(e.__traceback__) if frame.filename == arg][-1]
                error = e.msg if isinstance(e, SyntaxError) else f'{type(e).__name__}: {e}'
                raise ConfigError(f'{arg}, line {line}: {error}: fix the config file') from None
            for key, value in namespace.items():
                if not key.startswith('_') and not callable(value) and not isinstance(value, type(os)):
                    config[key] = _check(key, value, config, types or {}, where=f'{arg}: ')
        else:  # what it was meant to be
            configs = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'config')
            close = difflib.get_close_matches(os.path.basename(arg), os.listdir(configs), n=1) if config_files else 0
            trained = arg.endswith('.py') and os.path.isfile(arg) and re.search("^out_dir = '(.*)'", open(arg).read(),
                                                                                 re.M)
            raise ConfigError(
                f'expected --key=value, got {arg!r}' if arg.startswith('--') else
                f'{arg} is not a config file: did you mean --{arg}?' if eq and key in config else
                f'config file not found: {arg}: did you mean {os.path.relpath(configs)}/{close[0]}?' if close else
                f'config file not found: {arg} (see config/, e.g. config/fm_small.py)' if config_files else
                f"{arg} is a training config; {program} reads the model from a checkpoint: pass --out_dir="
                f"{trained[1]}, the folder that config's run writes" if trained else
                f'{program} takes no config files, only --key=value settings (see --help): got {arg!r}')
    return config


def help_text(config, *sources):
    """`  --key=default  comment`, a line a key: the comment on the line that sets the key (`key = value  # ...`,
    `key=value,  # ...`) in the first of sources that has one, one setting the default first. A key set after a line
    `# word` (model.py's `# fm`, `# attn`, `# mamba2`), before a blank line, is tagged [word]."""
    notes = {}  # key -> [(whether the line sets the default, [section] or '', comment)]
    for source in sources:
        section = ''
        for line in open(source, encoding='utf-8'):
            section = (re.fullmatch(r'\s*# ([a-z0-9]+)\s*', line) or [0, section if line.strip() else ''])[1]
            m = re.match(r'''\s*(\w+)\s*(?::[^=]*)?=\s*((?:'[^']*'|"[^"]*"|[^'"#])+?),?\s+#\s*(.*)''', line)
            if m and m[1] in config:
                notes.setdefault(m[1], []).append((m[2] == repr(config[m[1]]), section and f'[{section}] ', m[3]))
    left = {key: f'  --{key}={value!r}' for key, value in config.items()}
    width, best = max(map(len, left.values())), {k: next((n for n in v if n[0]), v[0]) for k, v in notes.items()}
    return '\n'.join(f'{left[k]:<{width}}  {"".join(best.get(k, "   ")[1:])}'.rstrip() for k in config)


def optional_types(cls):
    """For the fields of a dataclass that default to None (e.g. top_k: int | None), the type a value must have."""
    hints = typing.get_type_hints(cls)
    args = {name: [a for a in typing.get_args(hint) if a is not type(None)] for name, hint in hints.items()}
    return {name: a[0] for name, a in args.items() if len(a) == 1 and isinstance(a[0], type)}


def interrupted(*_):
    """SIGINT's handler while a script starts (torch's import takes seconds): one line, not a traceback; exit 130."""
    sys.stderr.write('interrupted\n')
    raise SystemExit(130)
