"""The learner's path in numbers (issues 54, 64): python dev/path_stats.py [FILE ...]

Per file and in all: lines, bytes, mean characters a non-blank line, lines over 100
columns, conditional expressions (`a if c else b`), the longest functions and those
over 60 lines. Default files: every file of the path that exists, the kernels included.
"""
import ast
import sys
from pathlib import Path

PATH = ['model.py', 'train.py', 'run.py', 'sample.py', 'generate.py', 'checkpoint.py',
        'configurator.py', 'prepare_data.py', 'fm_kernel.py']
LONG = 60  # lines: a function longer is one to split


def function_lengths(tree):
    """(lines, name) of every function in a module's tree."""
    lengths = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lengths.append((node.end_lineno - node.lineno + 1, node.name))
    return lengths


def stats(path):
    """A dict of one file's numbers."""
    text = Path(path).read_text()
    lines = text.splitlines()
    non_blank = [line for line in lines if line.strip()]
    tree = ast.parse(text)
    if_exps = sum(isinstance(node, ast.IfExp) for node in ast.walk(tree))
    return {
        'lines': len(lines),
        'bytes': len(text.encode()),
        'chars': sum(len(line) for line in non_blank),
        'non_blank': len(non_blank),
        'over_100': sum(len(line) > 100 for line in lines),
        'if_exps': if_exps,
        'functions': [(n, f'{path}:{name}') for n, name in function_lengths(tree)],
    }


def row(name, s):
    mean = s['chars'] / max(s['non_blank'], 1)
    numbers = f"{s['lines']:>6} {s['bytes']:>8} {mean:>6.1f} {s['over_100']:>5} {s['if_exps']:>6}"
    return f"{name:<16} {numbers}"


def main(files):
    print(f"{'file':<16} {'lines':>6} {'bytes':>8} {'mean':>6} {'>100':>5} {'ifexp':>6}")
    per_file = {f: stats(f) for f in files}
    for f, s in per_file.items():
        print(row(f, s))
    path = [per_file[f] for f in files if f in PATH]
    keys = ('lines', 'bytes', 'chars', 'non_blank', 'over_100', 'if_exps')
    total = {k: sum(s[k] for s in path) for k in keys}
    print(row('the path', total))
    functions = sorted((fn for s in per_file.values() for fn in s['functions']), reverse=True)
    print('longest functions:', ', '.join(f'{name} {n}' for n, name in functions[:8]))
    print(f'functions over {LONG} lines: {sum(n > LONG for n, _ in functions)}')


if __name__ == '__main__':
    main(sys.argv[1:] or [f for f in PATH if Path(f).exists()])
