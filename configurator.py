"""nanoGPT's settings, `python train.py config/fm_small.py --batch_size=32`: a config file is
Python setting known keys; --key=value sets one, of its default's type (types[key] where the
default is None). And how a script's command line ends: a signal or a refusal is one line and
an exit code. Every script imports this module first, before torch: its handlers come first."""
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

STOPS = {signal.SIGINT: 'interrupted', signal.SIGTERM: 'terminated', signal.SIGHUP: 'hung up'}
SEEDS = 2 ** 32  # numpy's seeds: 0 to 2^32 - 1
NOTE = re.compile(r'''\s*(\w+)\s*(?::[^=]*)?=\s*((?:'[^']*'|"[^"]*"|[^'"#])+?),?\s+#\s*(.*)''')


class ConfigError(ValueError):
    """A setting, argument or config file refused: the message says what to pass instead."""


def leave(line, code, exit=sys.exit):
    """One line on stderr (one write), then exit code."""
    sys.stderr.write(f'{line}\n')
    exit(code)


def quit_on_ctrl_c():
    """A script's first step: Ctrl-C, SIGTERM or SIGHUP while torch loads: a line, 128 + signal."""
    for sig, line in STOPS.items():  # SIGHUP last: once it is caught, all are
        signal.signal(sig, lambda signum, _, line=line: leave(line, 128 + signum, os._exit))


def quit_on_sigterm():
    """SIGTERM or SIGHUP (a closed terminal) stops the script as Ctrl-C does, through its
    cleanups (with, finally): 143 or 129."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, _: leave(STOPS[signum], 128 + signum))


def run_main(main, *errors):
    """main(sys.argv[1:]): a Ctrl-C, a ConfigError or one of errors is one line, exit 130 or 1."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        main(sys.argv[1:])
    except KeyboardInterrupt:
        leave('interrupted', 130)
    except (ConfigError, *errors) as e:
        leave(f'error: {e}', 1)


def check_training(cfg, at_least):
    """ConfigError naming the first setting of cfg (a dict) out of range, and its fix: at_least's
    bounds, and those train.py and research/recall.py share (the optimizer's, the seed)."""
    for key, low in (at_least | dict(weight_decay=0, grad_clip=0, seed=0)).items():
        if not cfg[key] >= low:
            raise ConfigError(f'--{key}={cfg[key]} is out of range: set it to at least {low}')
    for key in ('beta1', 'beta2'):
        if not 0 <= cfg[key] < 1:
            raise ConfigError(f'--{key}={cfg[key]} is out of range: set it to at least 0 and '
                              f'below 1')
    if not 0 < cfg['learning_rate'] <= 1e6:  # far above, AdamW's step overflows float32
        raise ConfigError(f"--learning_rate={cfg['learning_rate']} is out of range: set it above 0 "
                          f'and at most 1e6 (typical: 1e-4 to 1e-2)')
    if cfg['seed'] >= SEEDS:
        raise ConfigError(f"--seed={cfg['seed']} is out of range: set it to at most {SEEDS - 1}")


def load_config(config, argv, types=None, config_files=True, program=None):
    """config with argv's config files and --key=value settings applied in order (a warning for an
    argument a later one undoes); ConfigError naming the fix."""
    config, defaults, types = dict(config), dict(config), types or {}
    program = program or os.path.basename(sys.argv[0])
    origin = {}  # key -> the argument that last changed it
    for arg, after in zip(argv, [*argv[1:], None]):
        key, eq, text = arg.removeprefix('--').partition('=')
        is_file = config_files and os.path.isfile(arg)
        if not (arg.startswith('--') and eq or is_file):
            raise ConfigError(not_a_setting(arg, after, config, config_files, program))
        settings, where = {key: text}, ''
        if not arg.startswith('--'):  # a config file: the names it sets
            settings, where = read_config_file(arg, config), f'{arg}: '
        before = dict(config)
        for key, value in settings.items():
            if key not in config:
                raise ConfigError(where + unknown_key(key, config))
            want = types.get(key)
            if config[key] is not None:
                want = type(config[key])
            if not where:  # --key=value's text
                value = parse(value, want)
            config[key] = checked(key, value, want, config[key], defaults[key], types, where)
        changed = {key: origin.get(key) for key in config if config[key] != before[key]}
        origin |= dict.fromkeys(changed, arg)
        warn_undone(arg, changed, origin)
    return config


def read_config_file(path, config):
    """{name: value} of the settings a config file sets (not its imports, functions, _names)."""
    settings = dict(config)
    try:
        with open(path, encoding='utf-8') as f:
            source = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f'{path} is not a config file that can be read ({type(e).__name__}): '
                          f'give one like config/fm_small.py') from None
    try:
        exec(compile(source, path, 'exec'), settings)
    except (Exception, SystemExit) as e:  # named by its line in the file
        frames = traceback.extract_tb(e.__traceback__)
        lines = [frame.lineno for frame in frames if frame.filename == path]
        line, error = (lines or ['?'])[-1], f'{type(e).__name__}: {e}'
        if isinstance(e, SyntaxError):
            line, error = e.lineno, e.msg
        raise ConfigError(f'{path}, line {line}: {error}: fix the config file') from None
    settings = {k: v for k, v in settings.items() if k[0] != '_'}
    tools = [k for k, v in settings.items() if callable(v) or isinstance(v, type(os))]
    return {k: v for k, v in settings.items() if k in config or k not in tools}


def parse(text, want):
    """--key=value's text: a string without quotes, True/False in any case, a Python literal;
    else the text itself."""
    if want is str:
        return text.strip('\'"')
    if text.lower() in ('true', 'false'):
        text = text.title()
    with contextlib.suppress(ValueError, SyntaxError):
        return ast.literal_eval(text)
    return text


def checked(key, value, want, current, default, types, where):
    """value as a setting of key (of type want); ConfigError if it is not one."""
    bad = f"{where}bad value for '{key}'"
    number = want in (int, float)
    if number and str(value).lower().lstrip('+-') in ('nan', 'inf', 'infinity'):
        raise ConfigError(f'{bad}: {value}: must be a finite number (default: {default!r})')
    if want is None:
        return value
    if value is None and (current is None or key in types):
        return value
    if want is float and type(value) is int:
        return float(value)
    if isinstance(value, want) and isinstance(value, bool) == (want is bool):  # bools: not ints
        return want(value)
    raise ConfigError(f'{bad}: {value!r} is a {type(value).__name__}, expected a {want.__name__} '
                      f'(default: {default!r})')


def warn_undone(arg, changed, origin):
    """A warning for each earlier argument whose settings arg changed all of ({key: setter})."""
    undone = [a for a in changed.values() if a and a not in origin.values()]
    for earlier in dict.fromkeys(undone):
        keys = ', '.join(k for k, a in changed.items() if a == earlier)
        advice = ''
        if not arg.startswith('--'):
            advice = f'; give {earlier} last'
        print(f'warning: {arg} sets {keys} after {earlier}: the later wins, and {earlier} changes '
              f'nothing{advice}', file=sys.stderr)


def not_a_setting(arg, after, config, config_files, program):
    """What an argument (after: the next) neither --key=value nor a config file meant: the fix."""
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
    run, reads_checkpoints = None, 'out_dir' in config or 'ckpt' in config
    if arg.endswith('.py') and os.path.isfile(arg) and reads_checkpoints:
        run = re.search("^out_dir = '(.*)'", open(arg).read(), re.M)
    if run:
        return f"{arg} is a training config; {program} reads the model from a checkpoint: pass " \
               f"--out_dir={run[1]}, the folder that config's run writes"
    return f'{program} takes no config files, only --key=value settings (see --help): got {arg!r}'


def unknown_key(key, config):
    """The refusal of a key config lacks, naming the closest keys it has."""
    close = difflib.get_close_matches(key, list(config), n=3, cutoff=0.6)
    if not close:
        return f"unknown config key '{key}'"
    return f"unknown config key '{key}'. Did you mean {' or '.join(close)}?"


def setting_notes(config, *sources):
    """{key: comment} of `key = value  # comment` lines in sources (the default's first)."""
    notes = {}  # key -> (whether its line sets the default, comment)
    for source in sources:
        for line in open(source, encoding='utf-8'):
            m = NOTE.match(line)
            if not m or m[1] not in config:
                continue
            default = m[2] == repr(config.get(m[1]))
            if m[1] not in notes or default and not notes[m[1]][0]:
                notes[m[1]] = (default, m[3])
    return {key: note for key, (_, note) in notes.items()}


def help_text(config, *sources, tags=None):
    """`  --key=default  [tags] comment` a key (setting_notes' comments); tags: {key: names}."""
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
    fields = {f.name: typing.get_args(f.type) for f in dataclasses.fields(cls)}
    return {name: args[0] for name, args in fields.items() if type(None) in args}
