"""nanoGPT's settings, `python train.py config/fm_small.py --batch_size=32`: a config file is Python setting known keys;
--key=value sets one, of its default's type (types[key] where the default is None)."""
import ast
import contextlib
import dataclasses
import difflib
import os
import re
import signal
import sys
import traceback
import typing


class ConfigError(ValueError):
    """A setting, argument or config file refused: the message says what to pass instead."""


def quit_on_ctrl_c():
    """A script's first step: a Ctrl-C or SIGTERM while torch loads exits 130 or 143 with one line."""
    signal.signal(signal.SIGINT, lambda *_: os._exit(sys.stderr.write('interrupted\n') and 130))
    signal.signal(signal.SIGTERM, lambda *_: os._exit(sys.stderr.write('terminated\n') and 143))


def quit_on_sigterm():
    """SIGTERM stops the script as Ctrl-C does, through its cleanups (with, finally): one line, 'terminated', and exit
    code 143."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(sys.stderr.write('terminated\n') and 143))


def run_main(main, *errors):
    """main(sys.argv[1:]): a Ctrl-C, a ConfigError or one of errors is one line (one write), exit code 130 or 1."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        main(sys.argv[1:])
    except KeyboardInterrupt:
        sys.exit(sys.stderr.write('interrupted\n') and 130)
    except (ConfigError, *errors) as e:
        sys.exit(sys.stderr.write(f'error: {e}\n') and 1)

def load_config(config, argv, types=None, config_files=True, program=None):
    """config with argv's config files and --key=value settings applied in order (a warning for an argument a later one
    undoes whole); ConfigError naming the fix."""
    config, types, program = dict(config), types or {}, program or os.path.basename(sys.argv[0])
    defaults = dict(config)
    origin = {}  # key -> the argument that last changed it
    for arg, after in zip(argv, [*argv[1:], None]):
        key, eq, text = arg.removeprefix('--').partition('=')
        if not (arg.startswith('--') and eq or config_files and os.path.isfile(arg)):
            raise ConfigError(not_a_setting(arg, after, config, config_files, program))
        settings, where = {key: text}, ''
        if not arg.startswith('--'):  # a config file: the names it sets
            settings, where = dict(config), f'{arg}: '
            try:
                with open(arg, encoding='utf-8') as f:
                    source = f.read()
            except (OSError, UnicodeDecodeError) as e:
                raise ConfigError(f'{arg} is not a config file that can be read ({type(e).__name__}): give one '
                                  f'like config/fm_small.py') from None
            try:
                exec(compile(source, arg, 'exec'), settings)
            except (Exception, SystemExit) as e:  # named by its line in the file
                lines = [frame.lineno for frame in traceback.extract_tb(e.__traceback__) if frame.filename == arg]
                line = e.lineno if isinstance(e, SyntaxError) else (lines or ['?'])[-1]
                error = e.msg if isinstance(e, SyntaxError) else f'{type(e).__name__}: {e}'
                raise ConfigError(f'{arg}, line {line}: {error}: fix the config file') from None
        before = dict(config)
        for key, value in settings.items():
            if key.startswith('_'):
                continue
            if key not in config and (callable(value) or isinstance(value, type(os))):
                continue  # the file's imports and functions
            if key not in config:
                raise ConfigError(where + unknown_key(key, config))
            want = type(config[key]) if config[key] is not None else types.get(key)
            if not where:  # --key=value's text: a string without quotes, True/False in any case, a Python literal
                with contextlib.suppress(ValueError, SyntaxError):  # else the text itself
                    value = value.strip('\'"') if want is str else ast.literal_eval(
                        value.title() if value.lower() in ('true', 'false') else value)
            if want in (int, float) and str(value).lower().lstrip('+-') in ('nan', 'inf', 'infinity'):
                raise ConfigError(f"{where}bad value for '{key}': {value}: must be a finite number (default: "
                                  f"{defaults[key]!r})")
            if want is None or value is None and (config[key] is None or key in types):
                config[key] = value
            elif want is float and type(value) is int or isinstance(value, want) and isinstance(value, bool) == (
                    want is bool):
                config[key] = want(value)  # bools are ints to Python, not here
            else:
                raise ConfigError(f"{where}bad value for '{key}': {value!r} is a {type(value).__name__}, expected a "
                                  f"{want.__name__} (default: {defaults[key]!r})")
        changed = {key: origin.get(key) for key in config if config[key] != before[key]}  # key -> its earlier setter
        origin |= dict.fromkeys(changed, arg)
        for earlier in dict.fromkeys(a for a in changed.values() if a and a not in origin.values()):  # undone whole
            keys, advice = ', '.join(k for k, a in changed.items() if a == earlier), f'; give {earlier} last'
            print(f'warning: {arg} sets {keys} after {earlier}: the later wins, and {earlier} changes nothing'
                  + advice * (not arg.startswith('--')), file=sys.stderr)
    return config


def not_a_setting(arg, after, config, config_files, program):
    """What an argument (after: the next) neither --key=value nor a config file was meant to be, and what to pass."""
    key, eq, _ = arg.lstrip('-').partition('=')
    if arg.startswith('--') and key not in config:
        return unknown_key(key, config)
    if not eq and key in config and after and not after.startswith('--'):  # --key value
        return f"{arg} takes its value after '=': pass --{key}={after}"
    if arg.startswith('--'):
        return f'expected --key=value, got {arg!r}'
    if eq and key in config:  # key=value, -key=value
        return f"{arg} is not a config file: did you mean --{arg.lstrip('-')}?"
    if config_files:
        return f'config file not found: {arg} (see config/, e.g. config/fm_small.py)'
    run = arg.endswith('.py') and os.path.isfile(arg) and re.search("^out_dir = '(.*)'", open(arg).read(), re.M)
    if run:
        return (f"{arg} is a training config; {program} reads the model from a checkpoint: pass --out_dir={run[1]}, "
                f"the folder that config's run writes")
    return f'{program} takes no config files, only --key=value settings (see --help): got {arg!r}'


def unknown_key(key, config):
    """The refusal of a key config lacks, naming the closest keys it has."""
    close = difflib.get_close_matches(key, list(config), n=3, cutoff=0.6)
    return f"unknown config key '{key}'" + f". Did you mean {' or '.join(close)}?" * bool(close)


def setting_notes(config, *sources):
    """{key: comment} of `key = value  # comment` lines in sources (the first that sets the default)."""
    notes = {}  # key -> (whether its line sets the default, comment)
    for source in sources:
        for line in open(source, encoding='utf-8'):
            m = re.match(r'''\s*(\w+)\s*(?::[^=]*)?=\s*((?:'[^']*'|"[^"]*"|[^'"#])+?),?\s+#\s*(.*)''', line)
            if not m or m[1] not in config:
                continue
            default = m[2] == repr(config.get(m[1]))
            if m[1] not in notes or default and not notes[m[1]][0]:
                notes[m[1]] = (default, m[3])
    return {key: note for key, (_, note) in notes.items()}


def help_text(config, *sources, tags=None):
    """`  --key=default  [tags] comment` a key, the comments as setting_notes finds them; tags:
    {key: names} (train.py: the mixers that read a model setting)."""
    notes, tags = setting_notes(config, *sources), tags or {}
    width = max(len(f'{key}={value!r}') for key, value in config.items())
    lines = []
    for key, value in config.items():
        note = notes.get(key, '')
        if key in tags:
            note = f"[{', '.join(tags[key])}] {note}"
        lines.append(f"  --{f'{key}={value!r}':<{width}}  {note}".rstrip())
    return '\n'.join(lines)


def optional_types(cls):
    """{name: X} of a dataclass's fields typed X | None (top_k: int | None -> int)."""
    return {f.name: typing.get_args(f.type)[0] for f in dataclasses.fields(cls)
            if type(None) in typing.get_args(f.type)}
