"""configurator.py: settings as a user mistypes them, for every script that reads them (train.py's own checks:
test_train.py)."""

import pytest

import eval as evaluation
import sample
import train
from configurator import ConfigError, load_config
from conftest import defaults


@pytest.mark.parametrize('main, argv, message', [
    (train.main, ['--dataset', 'path'], "--dataset takes its value after '=': pass --dataset=path"),
    (train.main, ['-max_iters', '20'], "-max_iters takes its value after '=': pass --max_iters=20"),
    (sample.main, ['--out_dir', 'out-fm-small'], "--out_dir takes its value after '=': pass --out_dir=out-fm-small"),
    (evaluation.main, ['--out_dir', 'out-fm-small'], "--out_dir takes its value after '=': pass --out_dir=out-fm-small"),
    (evaluation.main, ['routing', '--ckpt', 'best.pt'], "--ckpt takes its value after '=': pass --ckpt=best.pt"),
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
    assert str(error.value) == (f"{'nan.py: ' * (arg == 'nan.py')}bad value for '{key}': "
                                f"{'inf' if text == '1e999' else text}: must be a finite number (default: {config[key]!r})")
