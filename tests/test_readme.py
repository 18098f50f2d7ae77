"""The README's commands (Quickstart, Training, Sampling, Evaluating) in order, at toy size."""

import os
from pathlib import Path

import torch

import eval as evaluation
import prepare_data
import sample
import train
from conftest import REPO
from research import analysis


def readme_commands(sections=('Quickstart', 'Training', 'Sampling', 'Evaluating')):
    """The python commands in the code blocks of these README sections, in order, as argument lists."""
    import shlex
    readme = open(os.path.join(REPO, 'README.md'), encoding='utf-8').read()
    commands = []
    for section in sections:
        body = readme.split(f'\n## {section}\n')[1].split('\n## ')[0]
        for block in body.split('```')[1::2]:
            if block.startswith('python\n'):  # Python code, not commands
                continue
            for line in block.splitlines():
                for command in line.split('#')[0].split('&&'):
                    words = shlex.split(command)
                    if words[:1] == ['python']:
                        commands.append(words[1:])
    return commands


def toy(command):
    """A README command at toy size: for train.py a tiny model and a hundredth of the steps (500 by default: 5), for
    sample.py 10 tokens; eval.py and research/analysis.py as written."""
    script, args = command[0], command[1:]
    if script == 'train.py':
        steps = [a.split('=')[0] + f"={int(a.split('=')[1]) // 100}" if a.startswith(('--max_iters=',
                 '--lr_decay_iters=', '--warmup_iters=')) else a for a in args]
        default_steps = ([] if any(a.startswith('--max_iters=') for a in args) else ['--max_iters=5']) + (
            [] if any(a.startswith('--warmup_iters=') for a in args) else ['--warmup_iters=0'])
        return steps + default_steps + ['--n_layer=1', '--d_model=32', '--n_memory=8', '--top_k=2', '--batch_size=2',
                                        '--block_size=32', '--eval_iters=1', '--log_interval=1']
    if script == 'sample.py':
        return args + ['--max_new_tokens=10']
    return args


def test_readme_commands_work_in_order(data_dir, tmp_path, monkeypatch, capsys):
    """The commands of the README's Quickstart, Training, Sampling and Evaluating, in order in a fresh folder (the
    default corpus prepared), at toy size; a training run's last line says where it saved."""
    commands = readme_commands()
    skipped = [c for c in commands if c[0] == 'test_fm.py' or c[:2] in (['eval.py', 'harness'],
                                                                        ['research/analysis.py', 'scaling'])]
    assert [c[:2] for c in skipped] == [['test_fm.py'], ['eval.py', 'harness'],
                                        ['research/analysis.py', 'scaling']]  # lm-eval, GPU
    assert len(commands) - len(skipped) >= 9
    os.symlink(os.path.join(REPO, 'config'), tmp_path / 'config')
    os.symlink(data_dir, tmp_path / 'data')
    monkeypatch.setattr(prepare_data, 'DEFAULT_DATA_DIR', Path(data_dir))  # the default: the suite's prepared copy,
    monkeypatch.setattr(evaluation, 'DEFAULT_DATA_DIR', data_dir)  # not the repository's data/ (parallel workers)
    monkeypatch.chdir(tmp_path)
    mains = {'train.py': train.main, 'sample.py': sample.main, 'eval.py': evaluation.main,
             'research/analysis.py': analysis.main}
    for command in commands:
        if command not in skipped:
            mains[command[0]](toy(command))
            last = capsys.readouterr().out.strip().splitlines()[-1]
            if command[0] == 'train.py':
                assert last.startswith('saved ') and 'ckpt.pt (step ' in last and 'python sample.py --out_dir=' in last
    assert {'out', 'out-fm-small', 'out-transformer-small', 'out-attn'} <= set(os.listdir(tmp_path))
    assert torch.load(tmp_path / 'out' / 'ckpt.pt', weights_only=True)['iter_num'] == 6  # resumed
    assert os.path.exists(tmp_path / 'results' / 'loss_by_position.csv')
    assert os.path.exists(tmp_path / 'out-fm-small' / 'routing.json')
    assert os.path.exists(tmp_path / 'results' / 'sweep.csv')


def test_readme_bench_commands_parse_and_sweep():
    """Every `python bench.py ...` of the README (its Benchmarking block and the commands its Results cite) parses
    with bench.py's parser, and one with --sweep sweeps: bench.SWEEP when it names no lengths (it gave none, which
    turned the sweep off), else those."""
    import re
    import shlex
    import bench
    readme = open(os.path.join(REPO, 'README.md'), encoding='utf-8').read()
    cited = [shlex.split(c)[1:] for c in re.findall(r'`(python bench\.py [^`]*)`', readme)]
    commands = [c for c in readme_commands(('Benchmarking',)) if c[0] == 'bench.py'] + cited
    assert len(commands) >= 7 and ['bench.py', 'generate', '--sweep'] in commands
    for command in commands:
        assert bool(bench.parse_args(command[1:]).sweep) == ('--sweep' in command), command
    assert bench.parse_args(['generate', '--sweep']).sweep == bench.SWEEP == [1024, 4096, 16384, 65536]
    assert bench.parse_args(['generate', '--sweep', '1024', '65536', '--batch', '1']).sweep == [1024, 65536]
