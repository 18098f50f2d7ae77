"""research/reproduce.sh as a user calls it: settings refused before anything is trained, its exit status (a run
FAILED: 1; stopped, as train.py exits on Ctrl-C / SIGTERM after saving: 3, "run again to go on"), paths with spaces."""

import csv
import os
import subprocess
import sys

import pytest

from conftest import REPO

DRY_RUN = '--max_iters=2 --warmup_iters=0 --batch_size=2 --eval_iters=1 --device=cpu'


def reproduce(call, tmp_path, **env):
    """bash research/reproduce.sh CALL with RUNS and RESULTS in tmp_path (both with a space) -> the finished process."""
    env = {'RUNS': str(tmp_path / 'my runs'), 'RESULTS': str(tmp_path / 'my results'), **env}
    return subprocess.run(['bash', 'research/reproduce.sh', call], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, **env})


@pytest.mark.parametrize('call, env, message', [
    ('quality', {'MODELS': 'nope'}, 'MODELS: nope is not a model of the quality call (its models: transformer'),
    ('levers', {'MODELS': 'fm-k4'}, 'MODELS: fm-k4 is not a model of the levers call'),
    ('scaling', {'MODELS': 'mamba2'}, 'the scaling call has no models to choose from; leave MODELS out'),
    ('quality', {'SEEDS': 'abc'}, 'SEEDS="abc": abc is not a seed (a whole number'),
    ('quality', {'SEEDS': '9'}, 'SEEDS="9" SIZES="1M 2M 4M 8M" select no run of the quality call'),
    ('frontier', {'SIZES': '3M'}, 'SIZES="3M": 3M is not a frontier size: 1M, 2M, 4M or 8M'),
    ('frontier', {'SIZES': '1M', 'MODELS': 'fm-k16-gate'}, 'fm-k16-gate is not a model of the frontier call'),
    ('quality', {'JOBS': '0'}, 'JOBS="0": 0 is not a number of trainings at once (1 or more)'),
    ('quality', {'JOBS': 'many'}, 'JOBS="many": many is not a number of trainings at once'),
    ('quality', {'TRAIN_SECONDS': '-1'}, 'TRAIN_SECONDS="-1": -1 is not a number of seconds (0: no limit)'),
    ('scaling', {'MEMORIES': '64,16'}, 'MEMORIES="64,16": 64,16 is not a number of memory rows m'),
    ('quality', {'LRS_FM': '1e-3,2e-3'}, 'LRS_FM="1e-3,2e-3": 1e-3,2e-3 is not a learning rate'),
    ('quality', {'PREVIOUS': 'docs/results/2026-11-25 docs/results/nowhere'},
     'PREVIOUS: docs/results/nowhere is not a folder'),
])
def test_reproduce_refuses_a_bad_setting_before_it_trains(call, env, message, tmp_path):
    """A setting the call cannot use: exit 2, one line naming it and the fix, nothing trained or written (were it
    not refused, TRAIN_SECONDS=1 starts no training)."""
    run = reproduce(call, tmp_path, **{'TRAIN_SECONDS': '1', **env})
    assert run.returncode == 2 and message in run.stderr, run.stderr  # a bug, unless the message was reworded
    assert not os.listdir(tmp_path)


@pytest.fixture
def fake_train(tmp_path):
    """A `python3` first on PATH whose train.py exits with $TRAIN_STATUS_CODE, saying so; other scripts run as they
    are (prepare_data.py)."""
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    (bin_dir / 'python3').write_text(f'#!/bin/bash\nif [[ $1 == train.py ]]; then echo "fake train.py"; '
                                     f'exit $TRAIN_STATUS_CODE; fi\nexec {sys.executable} "$@"\n')
    (bin_dir / 'python3').chmod(0o755)  # reproduce.sh's Python: $PYTHON, python3 unless set
    return f"{bin_dir}:{os.environ['PATH']}"


STOPPED = 'quality: 1 run(s) not finished (stopped after saving, or not started): run again to go on'


@pytest.mark.parametrize('code, status, line', [
    (130, 3, STOPPED),  # train.py after Ctrl-C, saved
    (143, 3, STOPPED),  # train.py after SIGTERM, saved
    (1, 1, 'quality: 1 run(s) FAILED or SKIPPED (above: extrapolation/mamba2-lr4e-3-s1): fix them, then run again'),
])
def test_reproduce_exits_with_what_its_runs_did(code, status, line, repo_corpus, fake_train, tmp_path):
    """train.py stopped (130 / 143: it saved) -> exit 3 and "run again to go on"; failed (any other status) -> exit 1,
    FAILED with the end of its log; both said last."""
    run = reproduce('quality', tmp_path, MODELS='mamba2', SEEDS='1', LRS_MAMBA2='4e-3', PATH=fake_train,
                    TRAIN_STATUS_CODE=str(code))
    assert run.returncode == status, run.stdout[-2000:] + run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == line
    if status == 1:
        assert 'FAILED extrapolation/mamba2-lr4e-3-s1 (exit 1), the end of' in run.stdout
        assert 'fake train.py' in run.stdout


def test_reproduce_quality_dry_run_with_spaces_in_its_paths(repo_corpus, tmp_path):
    """A CPU dry run (2 steps of one layer, one model, one rate, one seed, eval.py on a short text) with RUNS and
    RESULTS holding spaces: trained, evaluated, tabulated, exit 0."""
    run = reproduce('quality', tmp_path, MODELS='mamba2', SEEDS='1', LRS_MAMBA2='4e-3', TRAIN_ARGS=f'{DRY_RUN} --n_layer=1',
                    EVAL_ARGS='--data=corpus/COPYING.txt')
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    with open(tmp_path / 'my results' / 'quality.csv') as f:
        rows = list(csv.DictReader(f))
    assert [(row['name'], row['seeds']) for row in rows] == [('mamba2', '1')]
    assert (tmp_path / 'my runs' / 'extrapolation' / 'mamba2-lr4e-3-s1' / 'finished').is_file()
    assert 'warning' not in run.stdout  # one rate trained: no edge to warn about

