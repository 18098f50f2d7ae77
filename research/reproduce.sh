#!/usr/bin/env bash
# The paper's experiments at small scale on one GPU, on the default corpus (bytes), one subset a call:
#   bash research/reproduce.sh extrapolation  # Figures 3-4: the Transformer, Mamba-2, FM (the paper's layer: dense,
#                                             # k = m/4, k = 4; with a gate, a conv or both, the block: k = m/4,
#                                             # dense and k = 4 with both) trained at 512 (research/extrapolation_*.py),
#                                             # each at 3 learning rates x its seeds (extrapolation_models below); the
#                                             # learning-rate table, then loss by position of each at its best rate
#   bash research/reproduce.sh frontier       # Figures 2-3: the Transformer, Mamba-2, FM k = m/4 = 16 and the same
#                                             # with the block at 1M, 2M, 4M and 8M parameters (frontier_sizes below),
#                                             # each at 3 learning rates, seed 1 (the 4M runs are extrapolation runs);
#                                             # loss against forward FLOPs at the training context and at 2x and 8x
#   bash research/reproduce.sh routing        # eval.py routing (which memory rows the tokens use, by selection and by
#                                             # weight) of the extrapolation subset's FM runs at their best rates
#   bash research/reproduce.sh scaling        # Figure 5: FM with m = 16..256, dense / k = 4 / k = m/4, tau = 1..0.125
#                                             # (research/scaling_fm.py, 56 runs; VARIANT=block: with the block,
#                                             # VARIANT=RowRatesFM: a lever of research/levers.py on it);
#                                             # validation loss at each m's best tau
# Every run trains 640 steps of 32 x 512 bytes = 10.5M bytes (scaling: 480 x 16 x 512 = 3.9M), about 1.9 passes
# over the 5.5M-byte training split, with min_lr = learning_rate / 10.
# Each subset trains its runs, JOBS at a time (small models leave a GPU idle between kernel launches), skipping
# finished ones and resuming stopped ones, then evaluates the finished ones into RESULTS:
#   extrapolation.txt (training summary and tables), extrapolation_lr.csv (every run), extrapolation_lr_best.txt
#   (the runs at each model's best learning rate), extrapolation.csv, .json, .png (loss by position of those);
#   frontier.txt, .csv (every run), .png;  routing.txt, .csv, .png (and routing.json, .png in each run folder);
#   scaling.txt, .csv, .png
# Settings (environment):
#   RUNS=out-repro          run folders (out-* is ignored by git); RUNS/<subset>/<run>/finished marks a finished run
#   RESULTS=$OUT or results where the results go
#   JOBS=12                 trainings at once
#   GPUS=                   the GPUs to spread the trainings over, e.g. "0 1" (empty: the default GPU)
#   TRAIN_SECONDS=420       then running trainings save a checkpoint and stop (run again to resume them); 0: no limit
#   MODELS=                 the models of extrapolation_models trained and evaluated (extrapolation, frontier);
#                           empty: all
#   SEEDS="1 2 3"           the seeds trained, of each model's own (extrapolation_models)
#   LRS_TRANSFORMER="1e-3 2e-3 4e-3"  learning rates of the Transformer (extrapolation and frontier); a rate
#   LRS_MAMBA2="2e-3 4e-3 8e-3"       added later trains only its own runs; the sweep warns when a model's best
#   LRS_FM="5e-4 1e-3 2e-3"           rate is the lowest or highest of its grid (the paper's FM layer)
#   LRS_FM_BLOCK="1e-3 2e-3 4e-3"     FM with a gate, a conv or both
#   SIZES="1M 2M 4M 8M"     frontier sizes (of frontier_sizes below)
#   MEMORIES="256 128 64 32 16", TAUS="1 0.5 0.25 0.125"  the scaling subset's m and tau; VARIANT=block: FM with the
#                           block (its runs in RUNS/scaling-block), VARIANT=RowRatesFM (a class of research/levers.py):
#                           that lever on the block
#   PREVIOUS=               the RESULTS folder of an earlier machine: the runs its extrapolation_lr.csv, frontier.csv
#                           and scaling.csv list are not trained again; the tables and plots include them
#   TRAIN_ARGS=             more train.py arguments for every run; a dry run on a CPU (with RUNS and RESULTS of its
#                           own): TRAIN_ARGS="--max_iters=2 --warmup_iters=0 --batch_size=2 --eval_iters=1 --device=cpu"
set -euo pipefail
cd "$(dirname "$0")/.."

export RUNS=${RUNS:-out-repro} TRAIN_SECONDS=${TRAIN_SECONDS:-420} TRAIN_ARGS=${TRAIN_ARGS:-} GPUS=${GPUS:-}
RESULTS=${RESULTS:-${OUT:-results}}
JOBS=${JOBS:-12}
MODELS=${MODELS:-}
SEEDS=${SEEDS:-1 2 3}
LRS_TRANSFORMER=${LRS_TRANSFORMER:-1e-3 2e-3 4e-3}
LRS_MAMBA2=${LRS_MAMBA2:-2e-3 4e-3 8e-3}
LRS_FM=${LRS_FM:-5e-4 1e-3 2e-3}
LRS_FM_BLOCK=${LRS_FM_BLOCK:-1e-3 2e-3 4e-3}
SIZES=${SIZES:-1M 2M 4M 8M}
MEMORIES=${MEMORIES:-256 128 64 32 16}
TAUS=${TAUS:-1 0.5 0.25 0.125}
VARIANT=${VARIANT:-}
export PREVIOUS=${PREVIOUS:-}
export DEADLINE=$(( $(date +%s) + TRAIN_SECONDS ))

# ----------------------------------------------------------------------------- training

train_one() {  # train_one SUBSET/RUN train.py-arguments...: train, resume or skip one run
    local name=$1 dir=$RUNS/$1 status=0 start left resume=() limit=()
    shift
    local args="$* $TRAIN_ARGS"
    if [[ -f $dir/args && $(< "$dir/args") != "$args" ]]; then
        echo "SKIPPED $name: $dir was trained with other settings ($(< "$dir/args")); remove it or set another RUNS"
        return 0
    fi
    [[ -f $dir/finished || -f $dir/diverged ]] && return 0
    if [[ -n $PREVIOUS ]] && grep -qs "/$name," "$PREVIOUS/extrapolation_lr.csv" "$PREVIOUS/frontier.csv"; then
        return 0  # trained on an earlier machine
    fi
    left=$(( DEADLINE - $(date +%s) ))
    if (( TRAIN_SECONDS > 0 && left < 30 )); then
        echo "not started (time limit): $name"
        return 0
    fi
    mkdir -p "$dir"
    echo "$args" > "$dir/args"
    [[ -f $dir/ckpt.pt ]] && resume=(--init_from=resume)
    (( TRAIN_SECONDS > 0 )) && limit=(timeout --signal=TERM --kill-after=60 "$left")
    start=$(date +%s)
    local gpus=($GPUS) gpu=()  # with several GPUs, each run on one of them, chosen by its name
    (( ${#gpus[@]} )) && gpu=(env CUDA_VISIBLE_DEVICES="${gpus[$(( $(cksum <<< "$name" | cut -d' ' -f1) \
                                                                 % ${#gpus[@]} ))]}")
    # shellcheck disable=SC2086  # TRAIN_ARGS: several arguments
    OMP_NUM_THREADS=1 "${gpu[@]}" "${limit[@]}" python train.py "$@" $TRAIN_ARGS --out_dir="$dir" "${resume[@]}" \
        >> "$dir/train.log" 2>&1 || status=$?
    case $status in
        0) touch "$dir/finished"
           echo "finished $name in $(( $(date +%s) - start )) s: $(grep -m1 '^parameters' "$dir/train.log"), \
$(grep '^step' "$dir/train.log" | tail -1)";;
        124) echo "stopped at the time limit: $name (run again to resume)";;
        *) if grep -q 'training stopped without saving' "$dir/train.log"; then  # not trained again: it would again
               touch "$dir/diverged"
               echo "DIVERGED $name: $(grep 'training stopped without saving' "$dir/train.log" | tail -1 | cut -c1-150)"
               return 0
           fi
           echo "FAILED $name (exit $status), the end of $dir/train.log:"
           tail -5 "$dir/train.log";;
    esac
}
export -f train_one

train_all() {  # run lines "SUBSET/RUN train.py-arguments..." on stdin (none may end in a blank: xargs -L joins it
    xargs -P "$JOBS" -L 1 bash -c 'train_one "$@"' _  # to the next line)
}

finished() {  # run lines on stdin -> --runs=FOLDER for each finished run
    local name rest
    while read -r name rest; do
        if [[ -f $RUNS/$name/finished ]]; then echo "--runs=$RUNS/$name"; fi
    done
}

previous() {  # previous FILE: --runs=PREVIOUS/FILE where an earlier machine's results have it
    if [[ -n $PREVIOUS && -f $PREVIOUS/$1 ]]; then echo "--runs=$PREVIOUS/$1"; fi
}

tenth() {  # tenth LR: LR / 10, the min_lr of a run at LR
    awk -v lr="$1" 'BEGIN { printf "%g", lr / 10 }'
}

lr_runs() {  # lr_runs SUBSET/NAME MODEL SEED train.py-arguments...: a run line at each learning rate of MODEL's grid
    local name=$1 model=$2 seed=$3 lrs lr
    shift 3
    case $model in
        transformer) lrs=$LRS_TRANSFORMER;;
        mamba2) lrs=$LRS_MAMBA2;;
        fm*-gate|fm*-conv|fm*-block) lrs=$LRS_FM_BLOCK;;
        fm*) lrs=$LRS_FM;;
    esac
    for lr in $lrs; do
        echo "$name-lr$lr-s$seed $* --learning_rate=$lr --min_lr=$(tenth "$lr") --seed=$seed"
    done
}

# ----------------------------------------------------------------------------- subsets: one function each

extrapolation_model() {  # extrapolation_model MODEL: its train.py arguments (the block takes its weights from d_ff)
    case $1 in
        transformer) echo research/extrapolation_transformer.py;;
        mamba2) echo research/extrapolation_mamba2.py;;
        fm-dense) echo research/extrapolation_fm.py --top_k=None;;
        fm-k16) echo research/extrapolation_fm.py;;
        fm-k4) echo research/extrapolation_fm.py --top_k=4;;
        fm-k16-gate) echo research/extrapolation_fm.py --fm_gate=True;;
        fm-k16-conv) echo research/extrapolation_fm.py --fm_conv=4;;
        fm-k16-block) echo research/extrapolation_fm.py --fm_conv=4 --fm_gate=True;;
        fm-dense-block) echo research/extrapolation_fm.py --top_k=None --fm_conv=4 --fm_gate=True;;
        fm-k4-block) echo research/extrapolation_fm.py --top_k=4 --fm_conv=4 --fm_gate=True;;
        fm-k16-rowrates-block) echo research/extrapolation_fm.py --fm_conv=4 --fm_gate=True \
                                    --mixer=research.levers:RowRatesFM;;  # the best lever (research/levers.py)
    esac
}

extrapolation_models() {  # MODEL SEEDS...: Mamba-2, the paper's layer and the best variant with 3 seeds, the rest 2
    cat <<'EOF'
transformer 1 2
mamba2 1 2 3
fm-k16 1 2 3
fm-dense 1 2
fm-k4 1 2
fm-k16-gate 1 2
fm-k16-conv 1 2
fm-k16-block 1 2 3
fm-dense-block 1 2
fm-k4-block 1 2
EOF
}

selected() {  # selected MODEL: whether MODELS (empty: all) names it
    [[ -z $MODELS || " $MODELS " == *" $1 "* ]]
}

extrapolation_runs() {  # each model at each learning rate of its grid, each of its seeds in SEEDS
    local model seeds seed
    extrapolation_models | while read -r model seeds; do
        selected "$model" || continue
        for seed in $seeds; do
            [[ " $SEEDS " == *" $seed "* ]] || continue
            # shellcheck disable=SC2046  # the config and its arguments: several words
            lr_runs "extrapolation/$model" "$model" "$seed" $(extrapolation_model "$model")
        done
    done
}

positions_of_best() {  # positions_of_best OUT BEST.txt...: eval.py's loss by position of the run folders listed
    # (a sweep's best-rate runs) that hold a checkpoint here, into RESULTS/OUT; attention runs a document in one pass:
    # its first 32,768 positions (64x its context), the others whole
    local out=$1 runs
    shift
    runs=$(cat "$@" | while read -r dir; do if [[ -f $dir/ckpt.pt ]]; then echo "--out_dir=$dir"; fi; done)
    [[ -z $runs ]] && { echo "the best-rate runs are all an earlier machine's: see its results"; return 0; }
    # shellcheck disable=SC2086  # several --out_dir
    python eval.py $runs --max_len=32768 --out="$RESULTS/$out"
}

extrapolation() {
    extrapolation_runs | train_all
    echo "training done at $(( $(date +%s) - BEGIN )) s"
    local runs
    runs="$(extrapolation_runs | finished) $(previous extrapolation_lr.csv)"
    [[ -z ${runs// /} ]] && { echo "no finished runs to evaluate yet: run again to go on"; return 0; }
    # shellcheck disable=SC2086  # several --runs
    python research/analysis.py sweep $runs --out="$RESULTS/extrapolation_lr"
    # each model at its best learning rate, every seed (those trained here; an earlier machine's are in its results)
    positions_of_best extrapolation "$RESULTS/extrapolation_lr_best.txt"
}

frontier_sizes() {  # SIZE MODEL train.py-arguments after extrapolation_model MODEL's, the slowest first
    # Parameters without the embedding (num_params), FM: 8.27M, 4.14M, 2.27M, 1.13M; the Transformer and Mamba-2
    # within 0.3% of FM's (their SwiGLU width d_ff). 4M is the extrapolation models as they are: the frontier's runs
    # at 4M are the extrapolation subset's seed-1 runs (the same folders and arguments), trained once for both.
    cat <<'EOF'
8M transformer --n_layer=12
8M mamba2      --n_layer=12
8M fm-k16      --n_layer=12
4M transformer
4M mamba2
4M fm-k16
2M transformer --n_layer=12 --d_model=128 --n_head=2 --n_kv_head=1 --d_ff=364
2M mamba2      --n_layer=12 --d_model=128 --d_ff=316
2M fm-k16      --n_layer=12 --d_model=128
1M transformer --n_layer=6 --d_model=128 --n_head=2 --n_kv_head=1 --d_ff=364
1M mamba2      --n_layer=6 --d_model=128 --d_ff=316
1M fm-k16      --n_layer=6 --d_model=128
8M fm-k16-block --n_layer=12
4M fm-k16-block
2M fm-k16-block --n_layer=12 --d_model=128
1M fm-k16-block --n_layer=6 --d_model=128
8M fm-k16-rowrates-block --n_layer=12
EOF
}

frontier_lever() {  # frontier_lever MODEL: whether MODEL is frontier_sizes' last line, the best lever of
    # research/levers.py (issue 39), and MODELS leaves it out: it trains only where MODELS names it
    [[ $1 == fm-k16-rowrates-block && " $MODELS " != *" $1 "* ]]
}

frontier_runs() {  # each model of SIZES at each learning rate of its grid, seed 1
    local size model args
    frontier_sizes | while read -r size model args; do
        [[ " $SIZES " == *" $size "* ]] && selected "$model" && ! frontier_lever "$model" || continue
        # shellcheck disable=SC2046,SC2086  # the config and its arguments: several words
        if [[ -z $args ]]; then
            lr_runs "extrapolation/$model" "$model" 1 $(extrapolation_model "$model")
        else
            lr_runs "frontier/$model-$size" "$model" 1 $(extrapolation_model "$model") $args
        fi
    done
}

frontier() {
    frontier_runs | train_all
    echo "training done at $(( $(date +%s) - BEGIN )) s"
    local runs
    runs="$(frontier_runs | finished) $(previous frontier.csv)"
    [[ -z ${runs// /} ]] && { echo "no finished runs to evaluate yet: run again to go on"; return 0; }
    # shellcheck disable=SC2086  # several --runs
    python research/analysis.py frontier $runs --out="$RESULTS/frontier"
}

routing() {  # the extrapolation subset's FM runs at their best rates (run it first)
    local runs
    runs=$(grep -s '/extrapolation/fm-' "$RESULTS/extrapolation_lr_best.txt" | while read -r dir; do
               if [[ -f $dir/ckpt.pt ]]; then echo "--out_dir=$dir"; fi; done)
    [[ -z $runs ]] && { echo "no FM runs of the extrapolation subset here: run it first"; return 0; }
    # shellcheck disable=SC2086  # several --out_dir
    python eval.py routing $runs --out="$RESULTS/routing"
}

scaling() {
    local done_before=" " subset=scaling${VARIANT:+-$VARIANT} variant=
    if [[ -n $VARIANT && $VARIANT != block ]] && ! grep -q "^class $VARIANT(" research/levers.py; then
        echo "VARIANT=$VARIANT: give block or a class of research/levers.py" >&2
        return 2
    fi
    [[ -n $VARIANT ]] && variant="--fm_conv=4 --fm_gate=True"
    [[ -n $VARIANT && $VARIANT != block ]] && variant+=" --mixer=research.levers:$VARIANT"  # a lever on the block
    [[ -n $PREVIOUS && -f $PREVIOUS/$subset.csv ]] &&
        done_before=" $(awk -F, 'NR == 1 {for (i = 1; i <= NF; i++) column[$i] = i; next}
                                 $column["iter_num"] == $column["max_iters"] {printf "%s ", $1}' "$PREVIOUS/$subset.csv")"
    # each tau in turn, the slowest runs first: m = 256 runs the PyTorch scan (the Triton kernels take m <= 128),
    # about 5 GB each, so only a few of those at a time
    for tau in $TAUS; do
        for m in $MEMORIES; do
            for k in $m $(( m / 4 )) $( (( m / 4 != 4 )) && echo 4 ); do  # at m = 16, k = m/4 is k = 4
                for seed in $SEEDS; do
                    local name="m$m-$( (( k == m )) && echo dense || echo "k$k" )-tau$tau-s$seed"
                    [[ $done_before == *" $name "* ]] && continue
                    echo "$subset/$name research/scaling_fm.py --n_memory=$m \
--top_k=$( (( k == m )) && echo None || echo "$k" ) --tau=$tau $variant --seed=$seed"
                done
            done
        done
    done | train_all
    echo "training done at $(( $(date +%s) - BEGIN )) s"
    mkdir -p "$RUNS/$subset"
    # shellcheck disable=SC2046  # previous: one argument or none
    python research/analysis.py scaling $(previous "$subset.csv") --runs="$RUNS/$subset" --out="$RESULTS/$subset"
}

# ----------------------------------------------------------------------------- levers (issue 39)
# bash research/reproduce.sh levers: levers for long-range memory (research/levers.py): FM's block at 4.1M
# parameters (the extrapolation subset's fm-k16-block runs, trained once for both) and each lever on it
# (fm-k16-block's arguments and --mixer=research.levers:CLASS; ctx2048: the block trained at a context of 2048, the
# same tokens a step; conv16: a convolution of 16 taps), each at LRS_FM_BLOCK x SEEDS (MODELS: some of
# levers_models). Writes levers.txt, levers_lr.csv, _best.txt (the 512 runs), levers_ctx2048_lr.csv, _best.txt (its
# validation loss is at 2048), and levers.csv, .json, .png: loss by position of each model at its best rate. With
# PREVIOUS, its levers*_lr.csv runs and fm-k16-block's of its extrapolation_lr.csv are not trained again (their loss
# by position: its results).

levers_models() {  # MODEL train.py-arguments after fm-k16-block's (extrapolation_model's)
    cat <<'EOF'
fm-k16-block
LowWriteFM --mixer=research.levers:LowWriteFM
RowRatesFM --mixer=research.levers:RowRatesFM
HeadsFM --mixer=research.levers:HeadsFM
Heads16FM --mixer=research.levers:Heads16FM
ctx2048 --batch_size=8 --block_size=2048
SlowWriteFM --mixer=research.levers:SlowWriteFM
conv16 --fm_conv=16
SlowWriteFM-conv16 --mixer=research.levers:SlowWriteFM --fm_conv=16
EOF
}

levers_runs() {  # each model at each rate of LRS_FM_BLOCK, each seed of SEEDS; less the runs PREVIOUS lists
    local model args seed name rest
    levers_models | while read -r model args; do
        selected "$model" || continue
        for seed in $SEEDS; do
            # shellcheck disable=SC2046,SC2086  # the config and its arguments: several words
            if [[ $model == fm-k16-block ]]; then
                lr_runs "extrapolation/$model" "$model" "$seed" $(extrapolation_model "$model")
            else
                lr_runs "levers/$model" fm-block "$seed" $(extrapolation_model fm-k16-block) $args
            fi
        done
    done | while read -r name rest; do
        [[ -n $PREVIOUS ]] && grep -qs "/$name," "$PREVIOUS"/levers*_lr.csv && continue
        echo "$name $rest"
    done
}

levers() {
    levers_runs | train_all
    echo "training done at $(( $(date +%s) - BEGIN )) s"
    local runs block_csv=$RESULTS/levers_block_previous.csv
    runs="$(levers_runs | grep -v '^levers/ctx2048' | finished) $(previous levers_lr.csv)"
    if [[ -n $PREVIOUS ]] && grep -qs '/extrapolation/fm-k16-block-lr' "$PREVIOUS/extrapolation_lr.csv"; then
        { head -1 "$PREVIOUS/extrapolation_lr.csv"; grep '/extrapolation/fm-k16-block-lr' \
            "$PREVIOUS/extrapolation_lr.csv"; } > "$block_csv"  # the block's runs of an earlier machine
        runs+=" --runs=$block_csv"
    fi
    [[ -z ${runs// /} ]] && { echo "no finished runs to evaluate yet: run again to go on"; return 0; }
    # shellcheck disable=SC2086  # several --runs
    python research/analysis.py sweep $runs --out="$RESULTS/levers_lr"
    runs="$(levers_runs | grep '^levers/ctx2048' | finished) $(previous levers_ctx2048_lr.csv)"
    # shellcheck disable=SC2086  # several --runs
    [[ -z ${runs// /} ]] || python research/analysis.py sweep $runs --out="$RESULTS/levers_ctx2048_lr"
    positions_of_best levers "$RESULTS"/levers*_lr_best.txt
}

# ----------------------------------------------------------------------------- the subset named

case ${1:-} in
    extrapolation|frontier|routing|scaling) subset=$1;;
    levers) subset=$1;;  # research/levers.py: see levers() above
    *) echo "usage: bash research/reproduce.sh extrapolation|frontier|routing|scaling  (see research/README.md)" >&2
       exit 2;;
esac
mkdir -p "$RESULTS"
BEGIN=$(date +%s)
{
    echo "$subset: $(command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name --format=csv,noheader | head -1 \
        || echo 'no GPU'), JOBS=$JOBS, TRAIN_SECONDS=$TRAIN_SECONDS, RUNS=$RUNS, \
git $(git rev-parse --short HEAD 2> /dev/null)"
    python prepare_data.py  # the default corpus, once, before the trainings start
    $subset
    echo "$subset: $(( $(date +%s) - BEGIN )) s in all"
} 2>&1 | tee "$RESULTS/$subset.txt"
