# The paper's Factorization Memory layer exactly, without FM's block (the convolution on xbar and the output
# gate, which the FM configs add): put it after an FM config, which it changes only there.
#   python train.py config/fm_small.py config/paper_layer.py --out_dir=out-fm-small-paper
#   python train.py config/fm_1b.py config/paper_layer.py --out_dir=out-fm-1b-paper

fm_conv = 0
fm_gate = False
d_ff = None  # the SwiGLU width of 8/3 d_model (fm_1b.py sets one for the block)
