#!/usr/bin/env bash
# The paper's experiments at small scale on one GPU, on the default corpus (bytes):
#   bash config/reproduce.sh extrapolation   # Figures 3-4: Transformer, Mamba-2, FM dense, k = m/4, k = 4 trained at
#                                            # 512 (config/extrapolation_*.py), x 2 seeds; loss by position
#   bash config/reproduce.sh scaling         # Figure 5: FM with m = 16..256, dense / k = 4 / k = m/4, tau = 1..0.125
#                                            # (config/scaling_fm.py, 56 runs); validation loss at each m's best tau
# Each trains its runs, JOBS at a time (small models leave a GPU idle between kernel launches), skipping finished
# ones and resuming stopped ones, then evaluates the finished ones into RESULTS:
#   extrapolation.txt (training summary and tables), .csv, .json, .png;  scaling.txt, .csv, .png
# Settings (environment):
#   RUNS=out-repro          run folders (out-* is ignored by git); RUNS/<subset>/<run>/finished marks a finished run
#   RESULTS=$OUT or results where the results go
#   JOBS=12                 trainings at once
#   TRAIN_SECONDS=420       then running trainings save a checkpoint and stop (run again to resume them); 0: no limit
#   SEEDS="1 2"             extrapolation seeds ("1 2 3" adds a third: the first two are not trained again)
#   PREVIOUS=               a scaling.csv of an earlier machine: its finished runs are not trained again and are plotted
#   TRAIN_ARGS=             more train.py arguments for every run; a dry run on a CPU (with RUNS and RESULTS of its own):
#                           TRAIN_ARGS="--max_iters=2 --batch_size=2 --eval_iters=1 --device=cpu"
set -euo pipefail
cd "$(dirname "$0")/.."

export RUNS=${RUNS:-out-repro} TRAIN_SECONDS=${TRAIN_SECONDS:-420} TRAIN_ARGS=${TRAIN_ARGS:-}
RESULTS=${RESULTS:-${OUT:-results}}
JOBS=${JOBS:-12}
SEEDS=${SEEDS:-1 2}
PREVIOUS=${PREVIOUS:-}
export DEADLINE=$(( $(date +%s) + TRAIN_SECONDS ))

train_one() {  # train_one SUBSET/RUN train.py-arguments...: train, resume or skip one run
    local name=$1 dir=$RUNS/$1 status=0 start left resume=() limit=()
    shift
    local args="$* $TRAIN_ARGS"
    if [[ -f $dir/args && $(< "$dir/args") != "$args" ]]; then
        echo "SKIPPED $name: $dir was trained with other settings ($(< "$dir/args")); remove it or set another RUNS"
        return 0
    fi
    [[ -f $dir/finished ]] && return 0
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
    # shellcheck disable=SC2086  # TRAIN_ARGS: several arguments
    OMP_NUM_THREADS=1 "${limit[@]}" python train.py "$@" $TRAIN_ARGS --out_dir="$dir" "${resume[@]}" \
        >> "$dir/train.log" 2>&1 || status=$?
    case $status in
        0) touch "$dir/finished"
           echo "finished $name in $(( $(date +%s) - start )) s: $(grep -m1 '^parameters' "$dir/train.log"), \
$(grep '^step' "$dir/train.log" | tail -1)";;
        124) echo "stopped at the time limit: $name (run again to resume)";;
        *) echo "FAILED $name (exit $status), the end of $dir/train.log:"
           tail -5 "$dir/train.log";;
    esac
}
export -f train_one

train_all() {  # lines "SUBSET/RUN arguments..." on stdin
    xargs -P "$JOBS" -L 1 bash -c 'train_one "$@"' _
}

finished_runs() {  # the finished run folders of a subset, as --out_dir=... arguments
    for dir in "$RUNS/$1"/*/; do
        [[ -f $dir/finished ]] && echo "--out_dir=${dir%/}"
    done
}

extrapolation() {
    for seed in $SEEDS; do
        echo "extrapolation/transformer-s$seed config/extrapolation_transformer.py --seed=$seed"
        echo "extrapolation/mamba2-s$seed config/extrapolation_mamba2.py --seed=$seed"
        echo "extrapolation/fm-dense-s$seed config/extrapolation_fm.py --top_k=None --seed=$seed"
        echo "extrapolation/fm-k16-s$seed config/extrapolation_fm.py --seed=$seed"
        echo "extrapolation/fm-k4-s$seed config/extrapolation_fm.py --top_k=4 --seed=$seed"
    done | train_all
    echo "training done at $(( $(date +%s) - BEGIN )) s"
    local runs
    runs=$(finished_runs extrapolation)
    [[ -z $runs ]] && { echo "no finished runs to evaluate yet: run again to go on"; return 0; }
    # attention runs a document in one pass: its first 32,768 positions (64x its context); the others whole
    python eval.py $runs --max_len=32768 --out="$RESULTS/extrapolation"
}

routing() {
    # FM's router and its unspecified choices, each against the plain layer at FM's learning rate (LR_FM), x SEEDS:
    # extrapolation_fm.py (k = m/4 = 16, and dense), then the memory-scaling shape (scaling_fm.py) at m = 16, 64, 128
    # with k = m/4 and dense, plain and with each remedy; then the routing of every run (eval.py routing)
    local lr=${LR_FM:-1e-3} seed variant m k
    local base="--learning_rate=$lr --min_lr=$(python -c "print($lr / 10)")"
    local variants=("plain:" "balance:--router_balance=0.01" "center:--router_center=True"
                    "init:--router_init_std=0.0625" "tau0.5:--tau=0.5" "eta-2:--eta_bias=-2"
                    "nodecay:--router_weight_decay=False")
    for seed in $SEEDS; do
        for variant in "${variants[@]}"; do
            echo "routing/k16-${variant%%:*}-s$seed config/extrapolation_fm.py $base ${variant#*:} --seed=$seed"
        done
        for variant in "${variants[@]:0:3}"; do
            echo "routing/dense-${variant%%:*}-s$seed config/extrapolation_fm.py --top_k=None $base ${variant#*:} --seed=$seed"
        done
    done | train_all
    for m in 128 64 16; do
        for k in $(( m / 4 )) $m; do
            for variant in "${variants[@]:0:3}"; do
                echo "routing/m$m-$( (( k == m )) && echo dense || echo "k$k" )-${variant%%:*} config/scaling_fm.py \
--n_memory=$m --top_k=$( (( k == m )) && echo None || echo "$k" ) $base ${variant#*:}"
            done
        done
    done | train_all
    echo "training done at $(( $(date +%s) - BEGIN )) s"
    local runs
    runs=$(finished_runs routing)
    [[ -z $runs ]] && { echo "no finished runs to evaluate yet: run again to go on"; return 0; }
    python eval.py routing $runs --out="$RESULTS/routing"
}

scaling() {
    local done_before=" "
    [[ -n $PREVIOUS ]] && done_before=" $(awk -F, 'NR > 1 && $6 == $7 {printf "%s ", $1}' "$PREVIOUS")"
    # each tau in turn, the slowest runs first: m = 256 runs the PyTorch scan (the Triton kernels take m <= 128),
    # about 5 GB each, so only a few of those at a time
    for tau in 1 0.5 0.25 0.125; do
        for m in 256 128 64 32 16; do
            for k in $m $(( m / 4 )) $( (( m / 4 != 4 )) && echo 4 ); do  # at m = 16, k = m/4 is k = 4
                local name="m$m-$( (( k == m )) && echo dense || echo "k$k" )-tau$tau"
                [[ $done_before == *" $name "* ]] && continue
                echo "scaling/$name config/scaling_fm.py --n_memory=$m --top_k=$( (( k == m )) && echo None || echo "$k" ) --tau=$tau"
            done
        done
    done | train_all
    echo "training done at $(( $(date +%s) - BEGIN )) s"
    mkdir -p "$RUNS/scaling"
    python eval.py scaling ${PREVIOUS:+--runs="$PREVIOUS"} --runs="$RUNS/scaling" --out="$RESULTS/scaling"
}

case ${1:-} in
    extrapolation|scaling|routing) subset=$1;;
    *) echo "usage: bash config/reproduce.sh extrapolation|scaling|routing  (settings: see the top of this file)" >&2
       exit 2;;
esac
mkdir -p "$RESULTS"
BEGIN=$(date +%s)
{
    echo "$subset: $(command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name --format=csv,noheader | head -1 \
        || echo 'no GPU'), JOBS=$JOBS, TRAIN_SECONDS=$TRAIN_SECONDS, RUNS=$RUNS, git $(git rev-parse --short HEAD 2> /dev/null)"
    python prepare_data.py  # the default corpus, once, before the trainings start
    $subset
    echo "$subset: $(( $(date +%s) - BEGIN )) s in all"
} 2>&1 | tee "$RESULTS/$subset.txt"
