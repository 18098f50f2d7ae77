"""configurator.py: settings as a user mistypes them, for every script that reads them (train.py's own checks:
test_train.py)."""

import pytest

import eval as evaluation
import sample
import train
from configurator import ConfigError, load_config
from conftest import REPO, defaults


@pytest.mark.parametrize('main, argv, message', [
    (train.main, ['--dataset', 'path'], "--dataset takes its value after '=': pass --dataset=path"),
    (train.main, ['-max_iters', '20'], "-max_iters takes its value after '=': pass --max_iters=20"),
    (sample.main, ['--out_dir', 'out-fm-small'], "--out_dir takes its value after '=': pass --out_dir=out-fm-small"),
    (evaluation.main, ['--out_dir', 'out-fm-small'],
     "--out_dir takes its value after '=': pass --out_dir=out-fm-small"),  # eval.py's repeated key
    (evaluation.main, ['routing', '--ckpt', 'best.pt'], "--ckpt takes its value after '=': pass --ckpt=best.pt"),
    (train.main, ['--batch_sise', '4'],  # a typo, then the space: the typo first
     "unknown config key 'batch_sise'. Did you mean batch_size or chunk_size or block_size?"),
    (sample.main, ['--tmperature', '0'], "unknown config key 'tmperature'. Did you mean temperature?"),
])
def test_a_value_after_a_space_is_refused_naming_the_setting(main, argv, message):
    """`--key value` (prepare_data.py's argparse form) in the scripts that take --key=value only."""
    with pytest.raises(ConfigError) as error:
        main(argv)
    assert str(error.value) == message


@pytest.mark.parametrize('program, arg', [('train.py', '-max_iters=20'), ('sample.py', '-seed=7')])
def test_one_dash_is_refused_with_the_setting_meant(program, arg):
    settings = defaults()[0] if program == 'train.py' else sample._DEFAULTS
    with pytest.raises(ConfigError) as error:
        load_config(settings, [arg], config_files=program == 'train.py', program=program)
    assert str(error.value) == f'{arg} is not a config file: did you mean -{arg}?'


@pytest.mark.parametrize('arg', ['--learning_rate=nan', '--learning_rate=inf', '--learning_rate=-Infinity',
                                 '--learning_rate=1e999', '--max_iters=inf', 'nan.py'])
def test_a_number_that_is_not_finite_is_refused(arg, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'nan.py').write_text("learning_rate = float('nan')\n")
    key, text = arg.removeprefix('--').partition('=')[::2] if arg.startswith('--') else ('learning_rate', 'nan')
    config, types = defaults()
    with pytest.raises(ConfigError) as error:
        load_config(config, [arg], types)
    shown = 'inf' if text == '1e999' else text  # a float literal too large: inf
    assert str(error.value) == (f"{'nan.py: ' * (arg == 'nan.py')}bad value for '{key}': {shown}: must be a finite "
                                f"number (default: {config[key]!r})")


def test_a_setting_given_twice_is_warned_the_later_wins(capsys):
    config, types = defaults()
    assert load_config(config, ['--out_dir=a', '--batch_size=4', '--out_dir=b'], types)['out_dir'] == 'b'
    assert capsys.readouterr().err == 'warning: --out_dir=b sets out_dir after --out_dir=a: the later wins, and ' \
                                      '--out_dir=a changes nothing\n'
    assert load_config(config, ['--out_dir=a', '--out_dir=a', '--batch_size=4'], types)['out_dir'] == 'a'
    assert capsys.readouterr().err == ''  # the same value twice changes nothing


def test_config_files_in_the_wrong_order_are_warned(capsys, monkeypatch):
    """A config file a later argument undoes whole is named, with the fix; the documented orders are not warned."""
    monkeypatch.chdir(REPO)
    config, types = defaults()
    for argv in (['config/fm_small.py', 'config/paper_layer.py'], ['config/fm_small.py', '--batch_size=32'],
                 ['config/fm_small.py', 'config/paper_layer.py', '--out_dir=out-fm-paper']):
        load_config(config, argv, types)
        assert capsys.readouterr().err == '', argv
    c = load_config(config, ['config/paper_layer.py', 'config/fm_small.py'], types)
    assert (c['fm_conv'], c['fm_gate']) == (4, True)
    assert capsys.readouterr().err == (
        'warning: config/fm_small.py sets fm_conv, fm_gate after config/paper_layer.py: the later wins, and '
        'config/paper_layer.py changes nothing; give config/paper_layer.py last\n')
    load_config(config, ['--batch_size=32', 'config/fm_small.py'], types)  # a setting before the file it overrides
    assert capsys.readouterr().err == ('warning: config/fm_small.py sets batch_size after --batch_size=32: the later '
                                       'wins, and --batch_size=32 changes nothing; give --batch_size=32 last\n')


@pytest.mark.parametrize('source, argv, message', [
    ('import sys\nsys.exit(0)\n', [], 'bad.py, line 2: SystemExit: 0: fix the config file'),
    ('def mixer():\n    pass\n', [], "bad.py: bad value for 'mixer': <function mixer"),  # not dropped
    ('', ['--batch_size=8', '--batch_size=x'], "'x' is a str, expected a int (default: 16)"),  # not 8
])
def test_a_config_mistake_is_named_not_dropped(source, argv, message, tmp_path):
    (tmp_path / 'bad.py').write_text(source)
    config, types = defaults()
    with pytest.raises(ConfigError) as error:
        load_config(config, [str(tmp_path / 'bad.py'), *argv], types)
    assert message in str(error.value)


@pytest.mark.parametrize('seed', ['99999999999999999999999', '-1'])
def test_sample_refuses_a_seed_out_of_range(seed):
    with pytest.raises(ConfigError, match=f'--seed={seed} is out of range: set it to 0 to 4294967295'):
        sample.main([f'--seed={seed}'])
