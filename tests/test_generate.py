"""Sampling and generation: end of text, seeded sampling, top_p, CUDA graphs and compiled steps (GPU), sample.py."""

import copy
import os
import shutil
import subprocess
import sys

import torch
import torch.nn.functional as F
import pytest

import fm_kernel
import generate
import model as model_module
import eval as evaluation
import sample
from checkpoint import CheckpointError
from configurator import ConfigError
from conftest import CUDA, REPO, prefill, rel_err, save_model_checkpoint, tiny_config
from generate import Generator, Sampling, sample_next
from model import Model
from test_fm import MIXER_CASES


def test_generation_stops_each_row_at_end_of_text():
    torch.manual_seed(5)
    model = Model(tiny_config(mixer='fm', init_std=0.3)).eval()
    prompts = [[1, 2, 3], [4, 5]]
    free = Generator(model, Sampling(temperature=0)).generate(prompts, max_new_tokens=6)
    eot = free[1][2]  # row 1 emits this at its third token: row 1 stops there
    stopped = Generator(model, Sampling(temperature=0), eot=eot).generate(prompts, max_new_tokens=6)
    assert stopped[1] == free[1][:free[1].index(eot)]
    assert stopped[0] == (free[0][:free[0].index(eot)] if eot in free[0] else free[0])
    streamed = []
    Generator(model, Sampling(temperature=0)).generate(prompts, 6, on_tokens=streamed.append)
    assert [list(row) for row in zip(*streamed)] == free


def test_seeded_sampling_is_reproducible():
    model = Model(tiny_config(mixer='fm', init_std=0.3)).eval()
    generator = Generator(model, Sampling(temperature=1.0, top_k=20, top_p=0.9))
    runs = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        runs.append(generator.generate([[1, 2, 3]] * 4, max_new_tokens=20))
    assert runs[0] == runs[1] and runs[0] != runs[2]
    assert len({tuple(row) for row in runs[0]}) > 1  # rows draw independently


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.05, 0.3, 0.15], [0.25, 0.25, 0.25, 0.25]])
    kept = generate.nucleus(probs.log(), 0.8).isfinite()
    assert kept.tolist() == [[True, False, True, False], [True, True, True, True]]  # 0.5 + 0.3 reaches 0.8
    kept = generate.nucleus(probs.log(), 0.81).isfinite()
    assert kept[0].tolist() == [True, False, True, True]
    assert generate.nucleus(probs.log(), 1e-6).isfinite().sum(-1).tolist() == [1, 1]
    torch.manual_seed(0)
    draws = torch.stack([sample_next(probs.log(), Sampling(top_p=0.8)) for _ in range(2000)])
    counts = torch.bincount(draws[:, 0], minlength=4).double() / 2000  # renormalised 0.5 : 0.3
    assert counts[1] == counts[3] == 0 and abs(counts[0] - 0.625) < 0.04


def test_sampling_follows_the_probabilities():
    torch.manual_seed(0)
    probs = torch.tensor([[0.6, 0.3, 0.1, 0.0]])
    draws = torch.cat([sample_next(probs.log(), Sampling()) for _ in range(4000)])
    freq = torch.bincount(draws, minlength=4).double() / 4000
    assert (freq - probs[0].double()).abs().max() < 0.03 and freq[3] == 0
    assert sample_next(probs.log(), Sampling(top_k=1, temperature=2.0)).item() == 0
    assert sample_next(probs.log(), Sampling(temperature=0)).item() == 0
    assert sample_next(torch.tensor([[0.0, 5.0, 1.0]]), Sampling(n_tokens=1)).item() == 0  # ids >= n_tokens never


@pytest.mark.parametrize('field, value', [('temperature', -1.0), ('top_k', 0), ('top_p', 0.0), ('top_p', 1.5)])
def test_bad_sampling_settings_raise_naming_the_field(field, value):
    """Refused when made, and when set later on a Sampling a Generator then takes."""
    with pytest.raises(ValueError, match=field):
        Sampling(**{field: value})
    sampling = Sampling()
    setattr(sampling, field, value)
    with pytest.raises(ValueError, match=field):
        Generator(Model(tiny_config()), sampling)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize('name', MIXER_CASES)
def test_cuda_graph_decoding_equals_eager_gpu(name):
    torch.manual_seed(6)
    model = Model(tiny_config(init_std=0.3, **MIXER_CASES[name])).cuda().eval()
    prompts = [torch.randint(0, 64, (n,)).tolist() for n in (9, 2, 17)]
    for compile in (None, 'default'):
        runs = [Generator(model, Sampling(temperature=0), cuda_graph=graph, compile=compile).generate(prompts, 12)
                for graph in (False, True)]
        for row, (eager, graphed) in enumerate(zip(*runs)):
            first = next((i for i, (a, b) in enumerate(zip(eager, graphed)) if a != b), None)
            assert eager == graphed, (f"CUDA-graph decoding differs from eager decoding (compile={compile}), a bug: "
                                      f"row {row}, first at new token {first}")


@pytest.mark.skipif(not CUDA, reason="inductor writes one-row products as reductions on a GPU only")
def test_compiled_step_at_batch_1_has_no_library_product_gpu():
    """STEP_COMPILE_OPTIONS reach inductor: at batch 1 every product of the compiled step (blocks, router, head) is
    a generated reduction, no cuBLAS call; at batch 4 the blocks' products stay cuBLAS's."""
    from torch._inductor.utils import run_and_get_code
    torch.manual_seed(6)
    model = Model(tiny_config(init_std=0.3, mixer='fm', top_k=3)).cuda().eval()
    for batch, library_calls in ((1, False), (4, True)):
        torch._dynamo.reset()  # a fresh compile, static in the batch size
        generator = Generator(model, Sampling(temperature=0), cuda_graph=False, compile='default')
        generator.start([[1, 2, 3]] * batch, 4)
        _, code = run_and_get_code(generator.compiled_step)
        assert ('extern_kernels.mm' in '\n'.join(code)) == library_calls, batch


@pytest.mark.skipif(not CUDA, reason="the batch-1 Triton product runs on CUDA in half precision")
def test_bf16_step_at_batch_1_takes_the_triton_product_gpu():
    """A bfloat16 model's decoding step at batch 1 sends each MLP's down product to fm_kernel.decode_product, with
    the logits of the same steps through F.linear (rounding apart)."""
    torch.manual_seed(8)
    model = Model(tiny_config(init_std=0.3, mixer='fm', top_k=3)).cuda().to(torch.bfloat16).eval()
    idx = torch.randint(0, 64, (1, 9), device='cuda')
    runs, calls = [], []
    for dispatch in (fm_kernel.decode_linear, F.linear):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(model_module, 'decode_linear', dispatch)
            patch.setattr(fm_kernel, 'decode_product',
                          lambda x, w, product=fm_kernel.decode_product: calls.append(1) or product(x, w))
            state = model.init_state(1, 9)
            runs.append(torch.stack([model.step(idx[:, t], state) for t in range(9)], 1))
    assert len(calls) == 9 * model.config.n_layer
    assert rel_err(runs[0], runs[1]) < 2e-2


@pytest.mark.skipif(not CUDA, reason="mamba-ssm's kernels need a GPU")
def test_mamba_ssm_fused_step_equals_the_models_own_gpu():
    import bench
    if bench.import_mamba() is None:
        pytest.skip('mamba-ssm is not installed')
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update
    torch.manual_seed(7)
    model = Model(tiny_config(mixer='mamba2', init_std=0.3)).cuda().eval()
    idx = torch.randint(0, 64, (3, 20), device='cuda')
    runs = []
    for fused in (None, selective_state_update):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(model_module, 'selective_state_update', fused)
            _, state = prefill(model, idx[:, :12], max_len=20)
            logits = torch.stack([model.step(idx[:, t], state) for t in range(12, 20)], 1)
            runs.append((logits, torch.cat([layer['ssm'].flatten() for layer in state])))
    assert rel_err(runs[1][0], runs[0][0]) < 1e-5 and rel_err(runs[1][1], runs[0][1]) < 1e-5


def test_sample(trained, tmp_path):
    out_dir = trained[0]
    samples = sample.main([f'--out_dir={out_dir}', '--start=ROMEO:', '--num_samples=2', '--max_new_tokens=20'])
    assert len(samples) == 2 and all(s.startswith('ROMEO:') for s in samples)
    (tmp_path / 'prompt.txt').write_text('To be')
    again = sample.main([f'--out_dir={out_dir}', '--ckpt=best.pt', f'--start=FILE:{tmp_path / "prompt.txt"}',
                         '--num_samples=1', '--max_new_tokens=20', '--top_k=5', '--temperature=0.5'])
    assert again[0].startswith('To be')
    run = subprocess.run([sys.executable, 'sample.py', f'--out_dir={out_dir}', '--num_samples=1',
                          '--max_new_tokens=10', '--seed=1', '--start=ROMEO:'], cwd=REPO, capture_output=True,
                         text=True)
    assert run.returncode == 0 and run.stdout.startswith('ROMEO:') and '---------------' in run.stdout, run.stderr
    assert 'tokens/s' in run.stderr


def test_sample_of_a_model_that_does_not_decode_is_one_line(tmp_path):
    """A fork through --mixer whose router reads the token before (test_fm.PreviousTokenFM) trains but would decode
    another model: sample.py prints no text, and one line naming the mixer and why (issue 62)."""
    torch.manual_seed(0)
    config = tiny_config(vocab_size=256, mixer='test_fm:PreviousTokenFM', top_k=3)
    out_dir = save_model_checkpoint(Model(config), tmp_path)
    run = subprocess.run([sys.executable, 'sample.py', f'--out_dir={out_dir}', '--max_new_tokens=5'], cwd=REPO,
                         capture_output=True, text=True)
    assert (run.returncode, run.stdout) == (1, ''), run.stderr
    assert run.stderr.startswith('error: test_fm:PreviousTokenFM does not decode: its routing at a token moves when '
                                 'only other tokens change') and run.stderr.count('\n') == 1, run.stderr


@pytest.mark.parametrize('arg, message', [('--top_k=-2', 'top_k=-2: must be >= 1'), ('--top_p=1.5', 'top_p=1.5'),
                                          ('--temperature=-1', 'temperature=-1'), ('--num_samples=0', 'num_samples'),
                                          ('--device=nope', 'nope'),
                                          ('--top_k=300', r'--top_k=300 is more than the 256 tokens of bytes: give at '
                                                          r'most 256, or None'),
                                          ('--num_samples=100000000', r'need about .* GB of decoding buffers'),
                                          ('--start=\udcff\udcfe', r'^--start is not UTF-8 text \(character 0 is '
                                                                 r'not\): give UTF-8 text, or FILE:path to read the '
                                                                 r'prompt from a UTF-8 file$'),  # bytes ff fe in argv
                                          ('--start=FILE:', r'^--start=FILE: names no file: give FILE:path, e.g. '
                                                            r'--start=FILE:prompt.txt$'),
                                          ('--start=FILE:/', r'^--start=FILE:/: cannot read / \(Is a directory\): '
                                                             r'give FILE:path of a UTF-8 text file$')]
                         + ([] if CUDA else [('--device=cuda', '--device=cuda, but .*: use --device=cpu')]))
def test_sample_refuses_bad_settings(trained, arg, message):
    with pytest.raises(ConfigError, match=message):
        sample.main([f'--out_dir={trained[0]}', arg])


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused(trained, tmp_path):
    """A checkpoint naming a tokenizer of more ids than its model's embedding: one line, not an IndexError."""
    ckpt = torch.load(os.path.join(trained[0], 'ckpt.pt'), weights_only=True)
    torch.save({**ckpt, 'tokenizer': 'cl100k_base'}, tmp_path / 'ckpt.pt')
    with pytest.raises(CheckpointError) as error:
        sample.main([f'--out_dir={tmp_path}', '--start=hello'])
    assert str(error.value) == (f"{tmp_path}/ckpt.pt names tokenizer 'cl100k_base' of 100,277 tokens, more than its "
                                f"model's 256: use a checkpoint train.py wrote")


def test_a_folder_holding_best_pt_only_names_it(trained, tmp_path):
    shutil.copy(os.path.join(trained[0], 'best.pt'), tmp_path)
    with pytest.raises(CheckpointError) as error:
        sample.main([f'--out_dir={tmp_path}'])
    assert str(error.value) == (f'no checkpoint at {tmp_path}/ckpt.pt, only best.pt beside it: pass --ckpt=best.pt (to '
                                f'resume from it, copy it to ckpt.pt)')
    assert sample.main([f'--out_dir={tmp_path}', '--ckpt=best.pt', '--max_new_tokens=2', '--num_samples=1'])


@pytest.mark.parametrize('main, argv, command', [
    (sample.main, ['--out_dir=out-fm-small'], 'python train.py config/fm_small.py'),  # the README's commands
    (evaluation.main, ['--out_dir=out-fm-small', '--out_dir=out-transformer-small'],
     'python train.py config/fm_small.py'),  # the first of the two
    (evaluation.main, ['routing', '--out_dir=out-transformer-small'], 'python train.py config/transformer_small.py'),
    (sample.main, ['--out_dir=out'], 'python train.py --out_dir=out'),
    (sample.main, ['--out_dir=mine/run1'], 'python train.py --out_dir=mine/run1')])
def test_a_missing_checkpoint_names_the_command_that_writes_it(main, argv, command, tmp_path, monkeypatch):
    """On a fresh clone: the training command whose run writes that out_dir (a config's, else --out_dir=)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError) as error:
        main(argv)
    out_dir = next(arg for arg in argv if arg.startswith('--out_dir=')).partition('=')[2]
    assert str(error.value) == (f'no checkpoint at {out_dir}/ckpt.pt: train one first ({command}), or point --out_dir '
                                f'at the folder that holds it')


def test_sample_warns_of_a_prompt_past_an_attention_models_context(tmp_path, capsys):
    torch.manual_seed(0)
    out_dir = save_model_checkpoint(Model(tiny_config(vocab_size=256, block_size=8, **MIXER_CASES['attn'])), tmp_path)
    sample.main([f'--out_dir={out_dir}', '--start=' + 'x' * 20, '--max_new_tokens=2', '--num_samples=2'])
    assert ('warning: the prompt is 20 tokens, past the 8 this attention model was trained at (block_size): attention '
            'does not extrapolate past block_size') in capsys.readouterr().err
    sample.main([f'--out_dir={out_dir}', '--start=' + 'x' * 8, '--max_new_tokens=2', '--num_samples=2'])
    assert 'warning' not in capsys.readouterr().err


def test_stream_stops_at_end_of_text(capsys):
    class Letters:  # a tokenizer whose end-of-text is id 0
        eot = 0

        def decode(self, ids):
            return ''.join(chr(ord('A') + i) for i in ids)

    stream = sample.Stream(Letters(), [1])
    for token in (2, 3, 0, 4, 5):  # the row decodes on after its end-of-text until the batch stops
        stream([token])
    assert capsys.readouterr().out == 'BCD'


def test_rope_keeps_float32_angles_in_a_bf16_model():
    """A model cast to bf16 (as sample.py does on a GPU) rotates with float32 angles: at tens of thousands of
    positions bf16 frequencies would be off by radians."""
    torch.manual_seed(0)
    layer = model_module.Attention(tiny_config(mixer='attn', n_head=2))  # head dim 16
    x, positions = torch.randn(1, 3, 32), torch.tensor([[5000, 20000, 60000]])
    want = layer.project(x, positions)
    got = copy.deepcopy(layer).to(torch.bfloat16).project(x.bfloat16(), positions)
    assert all(rel_err(g, w) < 2e-2 for g, w in zip(got, want))


def test_sample_streams_what_it_returns(trained, capsys):
    text = sample.main([f'--out_dir={trained[0]}', '--num_samples=1', '--max_new_tokens=30', '--start=To be'])[0]
    assert capsys.readouterr().out == text + '\n---------------\n'


@pytest.mark.parametrize('token', [64, -1])
def test_a_prompt_token_beyond_the_vocabulary_is_one_error(token):
    """A prompt id the embedding lacks: a ValueError naming it, not an IndexError from the embedding."""
    generator = Generator(Model(tiny_config(vocab_size=64)).eval())
    with pytest.raises(ValueError, match=rf'prompt token {token} is not an id of the model \(0 to 63\)'):
        generator.generate([[1, 2], [3, token]], max_new_tokens=2)

