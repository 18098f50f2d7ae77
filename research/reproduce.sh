#!/usr/bin/env bash
# The README's results at small scale, one table or figure a call, each with the runs behind it as its defaults (the
# models, learning rates, seeds and settings below; research/README.md says what each writes and its GPU time):
#   bash research/reproduce.sh quality        # the README's quality table and extrapolation.png (the paper's Figures
#                                             # 3-4): the Transformer, Mamba-2, FM (the paper's layer: dense, k = m/4,
#                                             # k = 4; with a gate, a conv or both, the block: k = m/4, dense, k = 4),
#                                             # 4.1M parameters trained at 512 (research/extrapolation_*.py), each at
#                                             # its rates x seeds (extrapolation_models below); the learning-rate table,
#                                             # loss by position of each at its best rate, the table (quality.csv)
#   bash research/reproduce.sh frontier       # frontier.png (Figures 2-3): the Transformer, Mamba-2, FM k = m/4 = 16
#                                             # and FM's block at 1M, 2M, 4M and 8M parameters, seed 1, each at the
#                                             # rates of frontier_sizes below (the 4M runs are quality's seed-1 runs);
#                                             # loss against forward FLOPs at the training context and at 2x and 8x
#   bash research/reproduce.sh routing        # eval.py routing (which memory rows the tokens use, by selection and by
#                                             # weight) of quality's FM runs at their best rates (run quality first)
#   bash research/reproduce.sh scaling        # scaling_block.png (Figure 5): FM's block with m = 256, 64, 16, dense /
#                                             # k = m/4 / k = 4, tau = 1 and 0.25, seeds 1-3 (research/scaling_fm.py,
#                                             # 48 runs); validation loss at each m's best tau (VARIANT= : the paper's
#                                             # layer; VARIANT=RowRatesFM: a lever of research/levers.py on the block)
#   bash research/reproduce.sh levers         # the levers paragraph and levers_gap.png (issue 39): FM's block, each
#                                             # lever of research/levers.py on it and Mamba-2 beside (levers_models)
# (extrapolation is quality's old name.) Every run trains 640 steps of 32 x 512 bytes = 10.5M bytes (scaling:
# 480 x 16 x 512 = 3.9M), about 1.9 passes over the 5.5M-byte training split, with min_lr = learning_rate / 10.
# Each call trains its runs, JOBS at a time (small models leave a GPU idle between kernel launches), skipping
# finished ones, those PREVIOUS lists and resuming stopped ones, then writes its tables and figure into RESULTS:
#   quality.txt (the log and tables), extrapolation_lr.csv (every run), extrapolation_lr_best.txt (the runs at each
#   model's best rate), extrapolation.csv, .json (loss by position of those trained here), extrapolation.png and
#   quality.csv (the README's table: every model at its best rate, with PREVIOUS's runs);
#   frontier.txt, .csv (every run), .png;  routing.txt, .csv, .png;  scaling.txt, scaling-block.csv, .png;
#   levers.txt, levers_lr.csv, levers_ctx2048_lr.csv, levers.csv, .json, .png, levers_table.csv, levers_gap.png
# Settings (environment):
#   PYTHON=python3          the Python that runs train.py, eval.py and the rest (e.g. a virtual environment's)
#   RUNS=out-repro          run folders (out-* is ignored by git); RUNS/<subset>/<run>/finished marks a finished run
#   RESULTS=$OUT or results where the results go
#   JOBS=12                 trainings at once
#   GPUS=                   the GPUs to spread the trainings over, e.g. "0 1" (empty: the default GPU)
#   TRAIN_SECONDS=420       then running trainings save a checkpoint and stop (run again to resume them); 0: no limit
#   MODELS=                 some of the models of the call's table (extrapolation_models, frontier_sizes,
#                           levers_models); empty: all
#   SEEDS="1 2 3"           of each model's seeds, those trained (scaling: the seeds)
#   LRS_TRANSFORMER=, LRS_MAMBA2=, LRS_FM=, LRS_FM_BLOCK=   learning rates that replace the tables' for the
#                           Transformer, Mamba-2, the paper's FM layer, FM with a gate, a conv or both (levers too);
#                           empty: the tables'. The sweep warns when a model's best rate is the lowest or highest trained
#   SIZES="1M 2M 4M 8M"     frontier sizes (of frontier_sizes below)
#   MEMORIES="256 64 16", TAUS="1 0.25", VARIANT=block   the scaling call's m, tau and model: block (FM's block), empty
#                           (the paper's layer, runs in RUNS/scaling) or a class of research/levers.py on the block
#   PREVIOUS=               RESULTS folders of earlier machines (several: the later's record of a run wins), e.g.
#                           docs/results/2026-11-25: the runs their CSVs list are not trained again, and the tables and
#                           plots take their records (their loss by position from their *positions.csv)
#   TRAIN_ARGS=             more train.py arguments for every run; a dry run on a CPU (with RUNS and RESULTS of its
#                           own): TRAIN_ARGS="--max_iters=2 --warmup_iters=0 --batch_size=2 --eval_iters=1 --device=cpu"
#   EVAL_ARGS=              more eval.py / analysis.py frontier arguments (the dry run: --data=corpus/COPYING.txt,
#                           a short text rather than the 0.9M-byte long split)
#   LIST=1                  print the run lines the call's settings select (recall: seed 1's; a later seed's come from
#                           recall_best.txt) and stop, nothing trained or written (quality, frontier, levers, recall)
# Exit status: 0 when every run finished (or diverged: a result), 1 when one FAILED (its train.log's end above), 2 for
# a bad setting (nothing trained), 3 when runs stopped unfinished (a signal, the time limit): run again to go on.
set -euo pipefail
cd "$(dirname "$0")/.."

export PYTHON=${PYTHON:-python3}  # exported: train_one and recall_one run in child shells (xargs)
if ! command -v "$PYTHON" > /dev/null; then
    echo "PYTHON=$PYTHON: no such command (set PYTHON to the Python that has the requirements)" >&2
    exit 2
fi
export RUNS=${RUNS:-out-repro} TRAIN_SECONDS=${TRAIN_SECONDS:-420} TRAIN_ARGS=${TRAIN_ARGS:-} GPUS=${GPUS:-}
RESULTS=${RESULTS:-${OUT:-results}}
JOBS=${JOBS:-12}
MODELS=${MODELS:-}
SEEDS=${SEEDS:-1 2 3}
LRS_TRANSFORMER=${LRS_TRANSFORMER:-}
LRS_MAMBA2=${LRS_MAMBA2:-}
LRS_FM=${LRS_FM:-}
LRS_FM_BLOCK=${LRS_FM_BLOCK:-}
SIZES=${SIZES:-1M 2M 4M 8M}
MEMORIES=${MEMORIES:-256 64 16}
TAUS=${TAUS:-1 0.25}
VARIANT=${VARIANT-block}
D_MODELS=${D_MODELS:-128 64 256}
LRS_RECALL=${LRS_RECALL:-1e-3 3e-3 1e-2 3e-2}
RECALL_ARGS=${RECALL_ARGS:-}
EVAL_ARGS=${EVAL_ARGS:-}
export PREVIOUS=${PREVIOUS:-}

# ----------------------------------------------------------------------------- training

train_one() {  # train_one SUBSET/RUN train.py-arguments...: train, resume or skip one run
    local name=$1 dir=$RUNS/$1 status=0 start left resume=() limit=()
    shift
    local args="$* $TRAIN_ARGS"
    if [[ -f $dir/args && $(< "$dir/args") != "$args" ]]; then
        echo "SKIPPED $name: $dir was trained with other settings ($(< "$dir/args")); remove it or set another RUNS"
        echo "SKIPPED $name" >> "$TRAIN_STATUS"
        return 0
    fi
    [[ -f $dir/finished || -f $dir/diverged ]] && return 0
    earlier_run "$name" && return 0  # trained on an earlier machine
    left=$(( DEADLINE - $(date +%s) ))
    if (( TRAIN_SECONDS > 0 && left < 30 )); then
        echo "not started (time limit): $name"
        echo "stopped $name" >> "$TRAIN_STATUS"
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
    OMP_NUM_THREADS=1 "${gpu[@]}" "${limit[@]}" "$PYTHON" train.py "$@" $TRAIN_ARGS --out_dir="$dir" "${resume[@]}" \
        >> "$dir/train.log" 2>&1 || status=$?
    case $status in
        0) touch "$dir/finished"
           echo "finished $name in $(( $(date +%s) - start )) s: $(grep -m1 '^parameters' "$dir/train.log"), \
$(grep '^step' "$dir/train.log" | tail -1)";;
        124|130|143) echo "stopped: $name (run again to go on)"  # the time limit, Ctrl-C, SIGTERM: it saved
             echo "stopped $name" >> "$TRAIN_STATUS";;
        *) if grep -q 'training stopped without saving' "$dir/train.log"; then  # not trained again: it would again
               touch "$dir/diverged"
               echo "DIVERGED $name: $(grep 'training stopped without saving' "$dir/train.log" | tail -1 | cut -c1-150)"
               return 0
           fi
           echo "FAILED $name (exit $status), the end of $dir/train.log:"
           tail -5 "$dir/train.log"
           echo "FAILED $name" >> "$TRAIN_STATUS";;
    esac
}
export -f train_one

train_all() {  # run lines "SUBSET/RUN train.py-arguments..." on stdin (none may end in a blank: xargs -L joins it
    xargs -r -P "$JOBS" -L 1 bash -c 'train_one "$@"' _  # to the next line)
}

finished() {  # run lines on stdin -> --runs=FOLDER for each finished run
    local name rest
    while read -r name rest; do
        if [[ -f $RUNS/$name/finished ]]; then echo "--runs=$RUNS/$name"; fi
    done
}

earlier_run() {  # earlier_run SUBSET/RUN: whether a CSV of PREVIOUS's folders lists the run (of an earlier machine)
    local folder
    for folder in $PREVIOUS; do
        grep -qs "/$1," "$folder"/*.csv && return 0
    done
    return 1
}
export -f earlier_run

previous() {  # previous OUT < run lines: PREVIOUS's records of these runs, from each of its sweep and frontier CSVs
    # into OUT-N.csv -> --runs=OUT-N.csv for each (in PREVIOUS's order: a later folder's record of a run wins)
    local names folder file n=0
    names=$(cut -d' ' -f1)
    for folder in $PREVIOUS; do
        for file in "$folder"/*.csv; do
            head -1 "$file" | grep -q '^run,model,' || continue
            n=$(( n + 1 ))
            awk -F, -v names="$names" 'BEGIN { split(names, list, "\n"); for (i in list) wanted[list[i]] = 1 }
                NR == 1 { print; next }
                { parts = split($1, path, "/"); if (path[parts - 1] "/" path[parts] in wanted) print }' \
                "$file" > "$1-$n.csv"
            if (( $(wc -l < "$1-$n.csv") > 1 )); then echo "--runs=$1-$n.csv"; else rm "$1-$n.csv"; fi
        done
    done
}

previous_positions() {  # previous_positions OUT BEST.txt...: the rows of PREVIOUS's *positions.csv (eval.py's loss by
    # position, a checkpoint named by its run folder) of the runs listed, a file each into OUT-N.csv -> --runs=...
    local out=$1 names folder file n=0
    shift
    names=$(cat "$@" | while read -r dir; do basename "$dir"; done)
    for folder in $PREVIOUS; do
        for file in "$folder"/*positions.csv; do
            [[ -f $file ]] || continue
            n=$(( n + 1 ))
            awk -F, -v names="$names" 'BEGIN { split(names, list, "\n"); for (i in list) wanted[list[i]] = 1 }
                NR == 1 || $1 in wanted' "$file" > "$out-$n.csv"
            if (( $(wc -l < "$out-$n.csv") > 1 )); then echo "--runs=$out-$n.csv"; else rm "$out-$n.csv"; fi
        done
    done
}

tenth() {  # tenth LR: LR / 10, the min_lr of a run at LR
    awk -v lr="$1" 'BEGIN { printf "%g", lr / 10 }'
}

rates() {  # rates MODEL RATES: RATES (commas between them) or, where set, the LRS_ variable of MODEL's family
    local lrs
    case $1 in
        transformer) lrs=$LRS_TRANSFORMER;;
        mamba2) lrs=$LRS_MAMBA2;;
        fm*-gate|fm*-conv|fm*-block|lever) lrs=$LRS_FM_BLOCK;;
        fm*) lrs=$LRS_FM;;
    esac
    echo "${lrs:-${2//,/ }}"
}

lr_runs() {  # lr_runs SUBSET/NAME MODEL SEED RATES train.py-arguments...: a run line at each learning rate
    local name=$1 model=$2 seed=$3 lrs=$4 lr
    shift 4
    for lr in $(rates "$model" "$lrs"); do
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

extrapolation_models() {  # MODEL RATES SEEDS (commas between several): the runs of the README's quality table
    # (docs/results/2026-11-25/; the gate's best 1e-3 and the conv's 4e-3 are at an edge: their 5e-4 and 8e-3 runs of
    # that day survive only as means in docs/kernel_log.md, LRS_FM_BLOCK trains them)
    cat <<'EOF'
transformer    2e-3                    1,2
mamba2         4e-3                    1,2
fm-k16         5e-4,1e-3,2e-3          1,2,3
fm-dense       5e-4,1e-3,2e-3          1,2
fm-k4          5e-4,1e-3,2e-3          1,2
fm-k16-gate    1e-3,2e-3,4e-3          1,2
fm-k16-conv    1e-3,2e-3,4e-3          1,2
fm-k16-block   1e-3,2e-3,4e-3          1,2,3
fm-dense-block 1e-3,2e-3,4e-3          1,2
fm-k4-block    1e-3,2e-3,4e-3          1,2
EOF
}

selected() {  # selected MODEL: whether MODELS (empty: all) names it
    [[ -z $MODELS || " $MODELS " == *" $1 "* ]]
}

extrapolation_runs() {  # each model at each of its learning rates, each of its seeds in SEEDS
    local model lrs seeds seed
    extrapolation_models | while read -r model lrs seeds; do
        selected "$model" || continue
        for seed in ${seeds//,/ }; do
            [[ " $SEEDS " == *" $seed "* ]] || continue
            # shellcheck disable=SC2046  # the config and its arguments: several words
            lr_runs "extrapolation/$model" "$model" "$seed" "$lrs" $(extrapolation_model "$model")
        done
    done
}

positions_of_best() {  # positions_of_best OUT BEST.txt...: eval.py's loss by position of the run folders listed
    # (a sweep's best-rate runs) that hold a checkpoint here, into RESULTS/OUT; attention runs a document in one pass:
    # its first 32,768 positions (64x its context), the others whole
    local out=$1 runs=()
    shift
    mapfile -t runs < <(cat "$@" | while read -r dir; do if [[ -f $dir/ckpt.pt ]]; then echo "--out_dir=$dir"; fi
                        done)
    (( ${#runs[@]} )) || { echo "the best-rate runs are all an earlier machine's: their loss by position from \
PREVIOUS"; return 0; }
    # shellcheck disable=SC2086  # EVAL_ARGS: several arguments
    "$PYTHON" eval.py "${runs[@]}" --max_len=32768 $EVAL_ARGS --out="$RESULTS/$out"
}

positions_runs() {  # positions_runs POSITIONS SWEEP...: --runs= for the loss by position of the sweeps' best-rate runs:
    # POSITIONS.json (eval.py's, of those trained here) and PREVIOUS's rows of them
    local positions=$1 sweep
    shift
    for sweep; do previous_positions "$RESULTS/previous_${sweep##*/}_positions" "${sweep}_best.txt"; done
    [[ -f $positions.json ]] && echo "--runs=$positions.json"
    return 0
}

table() {  # table NAME POSITIONS SWEEP...: the README's table of the sweeps (SWEEP.csv) and the loss by position of
    # their best-rate runs: each model at its best rate, its seeds' range, the loss so far at 1x, 8x and 64x its
    # context, into RESULTS/NAME.csv; their loss by position plotted into POSITIONS.png
    local name=$1 positions=$2 sweep runs=() csvs=()
    shift 2
    for sweep; do csvs+=("--runs=$sweep.csv"); done
    mapfile -t runs < <(positions_runs "$positions" "$@")
    (( ${#runs[@]} )) || { echo "no loss by position to tabulate yet"; return 0; }
    "$PYTHON" research/analysis.py table "${csvs[@]}" "${runs[@]}" --out="$RESULTS/$name"
    "$PYTHON" research/analysis.py positions "${runs[@]}" --out="$positions"
}

extrapolation() {  # the README's quality table (quality: the same)
    extrapolation_runs | train_all
    echo "training done at $(( $(date +%s) - BEGIN )) s"
    local runs=()
    mapfile -t runs < <(extrapolation_runs | finished; extrapolation_runs | previous "$RESULTS/previous_extrapolation")
    (( ${#runs[@]} )) || { echo "no finished runs to evaluate yet"; return 0; }
    "$PYTHON" research/analysis.py sweep "${runs[@]}" --out="$RESULTS/extrapolation_lr"
    positions_of_best extrapolation "$RESULTS/extrapolation_lr_best.txt"  # the best-rate runs trained here
    table quality "$RESULTS/extrapolation" "$RESULTS/extrapolation_lr"
}

quality() {
    extrapolation
}

frontier_sizes() {  # SIZE MODEL RATES train.py-arguments after extrapolation_model MODEL's, the slowest first
    # Parameters without the embedding (num_params), FM: 8.27M, 4.14M, 2.27M, 1.13M; the Transformer and Mamba-2
    # within 0.3% of FM's (their SwiGLU width d_ff). 4M is the extrapolation models as they are: the frontier's runs
    # at 4M are the quality table's seed-1 runs (the same folders and arguments), trained once for both. The rates:
    # each model's best of the 2026-11-24 sweep (4 to 6 rates, docs/results/2026-11-24/) and one each side.
    cat <<'EOF'
8M transformer 5e-4,1e-3,2e-3   --n_layer=12
8M mamba2      2e-3,4e-3,8e-3   --n_layer=12
8M fm-k16      5e-4,1e-3,2e-3   --n_layer=12
4M transformer 1e-3,2e-3,4e-3
4M mamba2      2e-3,4e-3,8e-3
4M fm-k16      5e-4,1e-3,2e-3
2M transformer 4e-3,8e-3,1.6e-2 --n_layer=12 --d_model=128 --n_head=2 --n_kv_head=1 --d_ff=364
2M mamba2      2e-3,4e-3,8e-3   --n_layer=12 --d_model=128 --d_ff=316
2M fm-k16      2e-3,4e-3,8e-3   --n_layer=12 --d_model=128
1M transformer 2e-3,4e-3,8e-3   --n_layer=6 --d_model=128 --n_head=2 --n_kv_head=1 --d_ff=364
1M mamba2      4e-3,8e-3,1.6e-2 --n_layer=6 --d_model=128 --d_ff=316
1M fm-k16      2e-3,4e-3,8e-3   --n_layer=6 --d_model=128
8M fm-k16-block 1e-3,2e-3,4e-3  --n_layer=12
4M fm-k16-block 1e-3,2e-3,4e-3
2M fm-k16-block 1e-3,2e-3,4e-3  --n_layer=12 --d_model=128
1M fm-k16-block 1e-3,2e-3,4e-3  --n_layer=6 --d_model=128
8M fm-k16-rowrates-block 5e-4,1e-3,2e-3,4e-3 --n_layer=12
EOF
}

frontier_lever() {  # frontier_lever MODEL: whether MODEL is frontier_sizes' last line, the best lever of
    # research/levers.py (issue 39), and MODELS leaves it out: it trains only where MODELS names it
    [[ $1 == fm-k16-rowrates-block && " $MODELS " != *" $1 "* ]]
}

frontier_runs() {  # each model of SIZES at each of its learning rates, seed 1
    local size model lrs args
    frontier_sizes | while read -r size model lrs args; do
        [[ " $SIZES " == *" $size "* ]] && selected "$model" && ! frontier_lever "$model" || continue
        # shellcheck disable=SC2046,SC2086  # the config and its arguments: several words
        if [[ -z $args ]]; then
            lr_runs "extrapolation/$model" "$model" 1 "$lrs" $(extrapolation_model "$model")
        else
            lr_runs "frontier/$model-$size" "$model" 1 "$lrs" $(extrapolation_model "$model") $args
        fi
    done
}

frontier() {
    frontier_runs | train_all
    echo "training done at $(( $(date +%s) - BEGIN )) s"
    local runs=()
    mapfile -t runs < <(frontier_runs | previous "$RESULTS/previous_frontier"; frontier_runs | finished)
    (( ${#runs[@]} )) || { echo "no finished runs to evaluate yet"; return 0; }
    # shellcheck disable=SC2086  # EVAL_ARGS: several arguments
    "$PYTHON" research/analysis.py frontier "${runs[@]}" $EVAL_ARGS --out="$RESULTS/frontier"
}

routing() {  # the quality table's FM runs at their best rates (run quality first)
    local runs=()
    mapfile -t runs < <(grep -s '/extrapolation/fm-' "$RESULTS/extrapolation_lr_best.txt" | while read -r dir; do
                            if [[ -f $dir/ckpt.pt ]]; then echo "--out_dir=$dir"; fi; done)
    if (( ! ${#runs[@]} )); then
        echo "no FM runs of the quality table in $RESULTS: run quality first (or redraw docs/results' with" \
             "python research/analysis.py routing)"
        return 1
    fi
    "$PYTHON" eval.py routing "${runs[@]}" --out="$RESULTS/routing"
}

scaling() {
    local done_before=" " subset=scaling${VARIANT:+-$VARIANT} variant= previous=() folder
    if [[ -n $VARIANT && $VARIANT != block ]] && ! grep -q "^class $VARIANT(" research/levers.py; then
        echo "VARIANT=$VARIANT: give block or a class of research/levers.py" >&2
        return 2
    fi
    [[ -n $VARIANT ]] && variant="--fm_conv=4 --fm_gate=True"
    [[ -n $VARIANT && $VARIANT != block ]] && variant+=" --mixer=research.levers:$VARIANT"  # a lever on the block
    for folder in $PREVIOUS; do
        [[ -f $folder/$subset.csv ]] && previous+=("--runs=$folder/$subset.csv") && done_before+="$(awk -F, '
            NR > 1 {printf "%s ", $1}' "$folder/$subset.csv")"  # its unfinished runs too: their records say why
    done
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
    "$PYTHON" research/analysis.py scaling "${previous[@]}" --runs="$RUNS/$subset" --out="$RESULTS/$subset"
}

# ----------------------------------------------------------------------------- levers (issue 39)
# bash research/reproduce.sh levers: levers for long-range memory (research/levers.py): FM's block at 4.1M
# parameters (the quality table's fm-k16-block runs, trained once for both) and each lever on it (fm-k16-block's
# arguments and --mixer=research.levers:CLASS; ctx2048: the block trained at a context of 2048, the same tokens a
# step; conv16: a convolution of 16 taps), each at its rates x seeds (levers_models; MODELS: some of them), and
# Mamba-2 beside (levers_peer_runs). Writes levers.txt, levers_lr.csv, _best.txt (the 512 runs),
# levers_ctx2048_lr.csv, _best.txt (its validation loss is at 2048), levers.csv, .json (loss by position of each
# model at its best rate, those trained here), levers.png and levers_table.csv (with PREVIOUS's), levers_gap.png.

levers_models() {  # MODEL RATES SEEDS train.py-arguments after fm-k16-block's: the README's levers (2026-11-27;
    # SlowWriteFM, conv16 and both on a second start with 2 seeds and 2 rates, best at the higher: 4e-3 untrained)
    cat <<'EOF'
fm-k16-block       1e-3,2e-3,4e-3 1,2,3
LowWriteFM         1e-3,2e-3,4e-3 1,2,3 --mixer=research.levers:LowWriteFM
RowRatesFM         1e-3,2e-3,4e-3 1,2,3 --mixer=research.levers:RowRatesFM
HeadsFM            1e-3,2e-3,4e-3 1,2,3 --mixer=research.levers:HeadsFM
Heads16FM          1e-3,2e-3,4e-3 1,2,3 --mixer=research.levers:Heads16FM
ctx2048            1e-3,2e-3,4e-3 1,2,3 --batch_size=8 --block_size=2048
SlowWriteFM        1e-3,2e-3      1,2   --mixer=research.levers:SlowWriteFM
conv16             1e-3,2e-3      1,2   --fm_conv=16
SlowWriteFM-conv16 1e-3,2e-3      1,2   --mixer=research.levers:SlowWriteFM --fm_conv=16
EOF
}

levers_runs() {  # each lever at each of its rates, each of its seeds in SEEDS (the block: the quality table's runs)
    local model lrs seeds args seed
    levers_models | while read -r model lrs seeds args; do
        selected "$model" || continue
        for seed in ${seeds//,/ }; do
            [[ " $SEEDS " == *" $seed "* ]] || continue
            # shellcheck disable=SC2046,SC2086  # the config and its arguments: several words
            if [[ $model == fm-k16-block ]]; then
                lr_runs "extrapolation/$model" "$model" "$seed" "$lrs" $(extrapolation_model "$model")
            else
                lr_runs "levers/$model" lever "$seed" "$lrs" $(extrapolation_model fm-k16-block) $args
            fi
        done
    done
}

levers_peer_runs() {  # Mamba-2 beside the levers, at 3 rates x SEEDS (the quality table's Mamba-2 runs among them)
    local seed
    selected mamba2 || return 0
    for seed in $SEEDS; do
        # shellcheck disable=SC2046  # the config: one word
        lr_runs extrapolation/mamba2 mamba2 "$seed" 2e-3,4e-3,8e-3 $(extrapolation_model mamba2)
    done
}

levers() {
    { levers_peer_runs; levers_runs; } | train_all
    echo "training done at $(( $(date +%s) - BEGIN )) s"
    local runs=() at_512 at_2048 sweeps=("$RESULTS/levers_lr")
    at_512=$({ levers_peer_runs; levers_runs; } | grep -v '^levers/ctx2048')
    at_2048=$(levers_runs | grep '^levers/ctx2048' || true)
    mapfile -t runs < <(previous "$RESULTS/previous_levers" <<< "$at_512"; finished <<< "$at_512")
    (( ${#runs[@]} )) || { echo "no finished runs to evaluate yet"; return 0; }
    "$PYTHON" research/analysis.py sweep "${runs[@]}" --out="$RESULTS/levers_lr"
    if [[ -n $at_2048 ]]; then
        mapfile -t runs < <(previous "$RESULTS/previous_levers_ctx2048" <<< "$at_2048"; finished <<< "$at_2048")
        if (( ${#runs[@]} )); then
            "$PYTHON" research/analysis.py sweep "${runs[@]}" --out="$RESULTS/levers_ctx2048_lr"
            sweeps+=("$RESULTS/levers_ctx2048_lr")
        fi
    fi
    positions_of_best levers "${sweeps[@]/%/_best.txt}"
    table levers_table "$RESULTS/levers" "${sweeps[@]}"
    if selected mamba2; then
        mapfile -t runs < <(positions_runs "$RESULTS/levers" "${sweeps[@]}")
        "$PYTHON" research/analysis.py gap "${runs[@]}" --reference=mamba2 --out="$RESULTS/levers_gap"
    fi
}

# ----------------------------------------------------------------------------- the settings, checked before training

refuse() {  # refuse MESSAGE: say it on stderr and stop, nothing trained
    echo "reproduce.sh $subset: $1" >&2
    exit 2
}

each_is() {  # each_is NAME PATTERN WHAT: refuse unless every word of the variable NAME matches the regex PATTERN
    local word
    for word in ${!1}; do
        [[ $word =~ ^($2)$ ]] || refuse "$1=\"${!1}\": $word is not $3"
    done
}

call_models() {  # the models MODELS may name in this call
    case $subset in
        quality|extrapolation) extrapolation_models | cut -d' ' -f1;;
        frontier) frontier_sizes | awk '{print $2}' | sort -u;;
        levers) echo mamba2; levers_models | cut -d' ' -f1;;
        recall) recall_models | cut -d' ' -f1;;
    esac
}

call_runs() {  # the run lines this call's settings select (scaling and routing: checked by their own settings)
    case $subset in
        quality|extrapolation) extrapolation_runs;;
        frontier) frontier_runs;;
        levers) levers_peer_runs; levers_runs;;
        recall) recall_runs 1;;  # the models and widths (another seed's best rate may come from PREVIOUS)
    esac
}

check_settings() {  # refuse a setting this call cannot use, before anything is trained or written
    local known model folder
    each_is JOBS '[1-9][0-9]*' 'a number of trainings at once (1 or more)'
    each_is TRAIN_SECONDS '[0-9]+' 'a number of seconds (0: no limit)'
    each_is SEEDS '[0-9]{1,9}' 'a seed (a whole number, e.g. SEEDS="1 2 3")'
    each_is GPUS '[0-9]+' 'a GPU number (e.g. GPUS="0 1")'
    each_is MEMORIES '[1-9][0-9]*' 'a number of memory rows m'
    each_is TAUS '[0-9.]+(e-?[0-9]+)?' 'a temperature tau'
    each_is SIZES '1M|2M|4M|8M' 'a frontier size: 1M, 2M, 4M or 8M'
    local lrs
    each_is D_MODELS '[1-9][0-9]*' 'a model width (e.g. D_MODELS="64 128")'
    for lrs in LRS_TRANSFORMER LRS_MAMBA2 LRS_FM LRS_FM_BLOCK LRS_RECALL; do
        each_is $lrs '[0-9.]+(e-?[0-9]+)?' 'a learning rate (e.g. 2e-3)'
    done
    [[ -n $SEEDS ]] || refuse 'SEEDS is empty: give seeds, e.g. SEEDS="1 2 3"'
    for folder in $PREVIOUS; do
        [[ -d $folder ]] || refuse "PREVIOUS: $folder is not a folder (give RESULTS folders of earlier machines, \
e.g. PREVIOUS=docs/results/2026-11-25)"
    done
    if [[ -n $MODELS ]]; then
        known=$(call_models)
        [[ -n $known ]] || refuse "MODELS=\"$MODELS\": the $subset call has no models to choose from; leave MODELS out"
        for model in $MODELS; do
            grep -qx -- "$model" <<< "$known" || refuse "MODELS: $model is not a model of the $subset call (its \
models: $(echo $known))"
        done
    fi
    if [[ $subset != scaling && $subset != routing && -z $(call_runs) ]]; then
        refuse "MODELS=\"$MODELS\" SEEDS=\"$SEEDS\" SIZES=\"$SIZES\" select no run of the $subset call (the tables at \
the top of each part of reproduce.sh list each model's seeds and sizes)"
    fi
    return 0
}

# ------------------------------------------------------------------------ recall (issues 55, 66)
# bash research/reproduce.sh recall: multi-query associative recall (research/mqar.py, recall.py) at
# Zoology's budget (recall.py's defaults: at most 50,000 steps, 5.76M examples, cosine to 0, no
# warmup, stopping once the training shapes pass 0.99): FM's block and the paper's layer at k = 8
# and m = 4096, 1024, 256, 64, 16 rows, both dense at m = 64 and 16 (m <= 128), Mamba-2 at d_state
# 256, 128, 64, 32, 16, attention (recall_models), 2 layers. A width of D_MODELS at a time (128
# first): seed 1 at each rate of LRS_RECALL (Zoology's 4: 1e-3 to 10^-1.5), then each other seed of
# SEEDS at the model's best rate (RESULTS/recall_best.txt, from seed 1's runs here or in PREVIOUS).
# Every run appends its rows (a test slice each) to RESULTS/recall.csv when it ends; a run found
# there or in a PREVIOUS folder's recall.csv is not trained again; one stopped goes on from its
# checkpoint in RUNS/recall/ (saved every --stop_interval steps). Writes recall.txt (the log and
# table), recall.csv, recall_best.txt, recall_table.csv, recall_state.png, recall_step.png; each
# run's log in RUNS/recall/.
#   D_MODELS="128 64 256"   the widths, in the order they are trained
#   LRS_RECALL="1e-3 3e-3 1e-2 3e-2"   the rates, in the order they are trained
#   RECALL_ARGS=            more research/recall.py arguments for every run (default: its budget);
#                           a dry run on a CPU: RECALL_ARGS="--device=cpu --steps=2
#                           --batch_tokens=256 --test_examples=2 --stop_examples=2" (D_MODELS=32,
#                           a few MODELS)

recall_models() {  # MODEL research/recall.py-arguments, the slowest first (m > 128: FM's sparse
    # scan on CUDA)
    cat <<'EOF'
fm-block-m4096-k8    --mixer=fm --n_memory=4096 --top_k=8 --fm_conv=4 --fm_gate=True
fm-m4096-k8          --mixer=fm --n_memory=4096 --top_k=8
fm-block-m1024-k8    --mixer=fm --n_memory=1024 --top_k=8 --fm_conv=4 --fm_gate=True
fm-m1024-k8          --mixer=fm --n_memory=1024 --top_k=8
fm-block-m256-k8     --mixer=fm --n_memory=256 --top_k=8 --fm_conv=4 --fm_gate=True
fm-m256-k8           --mixer=fm --n_memory=256 --top_k=8
mamba2-n256          --mixer=mamba2 --d_state=256
mamba2-n128          --mixer=mamba2 --d_state=128
mamba2-n64           --mixer=mamba2 --d_state=64
mamba2-n32           --mixer=mamba2 --d_state=32
mamba2-n16           --mixer=mamba2 --d_state=16
fm-block-m64-dense   --mixer=fm --n_memory=64 --top_k=None --fm_conv=4 --fm_gate=True
fm-block-m64-k8      --mixer=fm --n_memory=64 --top_k=8 --fm_conv=4 --fm_gate=True
fm-m64-dense         --mixer=fm --n_memory=64 --top_k=None
fm-m64-k8            --mixer=fm --n_memory=64 --top_k=8
fm-block-m16-dense   --mixer=fm --n_memory=16 --top_k=None --fm_conv=4 --fm_gate=True
fm-block-m16-k8      --mixer=fm --n_memory=16 --top_k=8 --fm_conv=4 --fm_gate=True
fm-m16-dense         --mixer=fm --n_memory=16 --top_k=None
fm-m16-k8            --mixer=fm --n_memory=16 --top_k=8
attn                 --mixer=attn --n_head=2
EOF
}

recall_runs() {  # recall_runs SEED: run lines "NAME research/recall.py-arguments", NAME =
    # MODEL-dD-lrLR-sSEED, a width of D_MODELS at a time; seed 1 at each rate of LRS_RECALL in turn
    # (every model at the first rate first), another seed at the model's best rate
    # (RESULTS/recall_best.txt)
    local seed=$1 lr d
    for d in $D_MODELS; do
        if [[ $seed == 1 ]]; then
            for lr in $LRS_RECALL; do recall_lines "$seed" "$lr" "$d"; done
        else
            recall_lines "$seed" best "$d"
        fi
    done
}

recall_lines() {  # recall_lines SEED LR|best D: the run lines of the models MODELS selects at
    # width D
    local seed=$1 d=$3 model args lr
    recall_models | while read -r model args; do
        selected "$model" || continue
        [[ $model == fm* ]] && args+=" --chunk_size=16"  # FM's PyTorch scan: 1/4 of 64's memory
        lr=$2
        if [[ $lr == best ]]; then  # none without the file
            lr=$(awk -v m="$model-d$d" '$1 == m {print $2}' "$RESULTS/recall_best.txt" \
                 2> /dev/null || true)
        fi
        if [[ -z $lr ]]; then
            echo "no best rate of $model-d$d (seed 1 first): seed $seed not trained" >&2
            continue
        fi
        echo "$model-d$d-lr$lr-s$seed $args --d_model=$d --learning_rate=$lr --seed=$seed"
    done
}

recall_one() {  # recall_one NAME research/recall.py-arguments...: train and test one run, unless
    # RESULTS or a PREVIOUS folder holds its rows
    local name=$1 folder left status=0 start limit=() gpu=()
    shift
    for folder in "$RESULTS" $PREVIOUS; do
        grep -qs "^$name," "$folder/recall.csv" && return 0
    done
    left=$(( DEADLINE - $(date +%s) ))
    if (( TRAIN_SECONDS > 0 && left < 30 )); then
        echo "not started (time limit): $name"
        echo "stopped $name" >> "$TRAIN_STATUS"
        return 0
    fi
    (( TRAIN_SECONDS > 0 )) && limit=(timeout "$left")
    local gpus=($GPUS)  # with several GPUs, each run on one of them, chosen by its name
    if (( ${#gpus[@]} )); then
        local pick=$(( $(cksum <<< "$name" | cut -d' ' -f1) % ${#gpus[@]} ))
        gpu=(env CUDA_VISIBLE_DEVICES="${gpus[$pick]}")
    fi
    mkdir -p "$RUNS/recall"
    start=$(date +%s)
    # shellcheck disable=SC2086  # RECALL_ARGS: several arguments
    OMP_NUM_THREADS=1 "${gpu[@]}" "${limit[@]}" "$PYTHON" research/recall.py "$@" $RECALL_ARGS \
        --name="$name" --out="$RESULTS/recall.csv" --checkpoint="$RUNS/recall/$name.pt" \
        >> "$RUNS/recall/$name.log" 2>&1 || status=$?
    case $status in
        0) echo "finished $name in $(( $(date +%s) - start )) s:" \
                "$(grep '^step' "$RUNS/recall/$name.log" | tail -1)," \
                "$(grep -c accuracy "$RUNS/recall/$name.log") slices";;
        124) echo "stopped at the time limit: $name (run again: it goes on from" \
                  "$RUNS/recall/$name.pt)"
             echo "stopped $name" >> "$TRAIN_STATUS";;
        *) echo "FAILED $name (exit $status), the end of $RUNS/recall/$name.log:"
           tail -5 "$RUNS/recall/$name.log"
           echo "FAILED $name" >> "$TRAIN_STATUS";;
    esac
}
export -f recall_one

recall_analysis() {  # the table, recall_best.txt and the plots from RESULTS's recall.csv and
    # PREVIOUS's
    local runs=() folder
    for folder in $PREVIOUS "$RESULTS"; do
        [[ -f $folder/recall.csv ]] && runs+=("--runs=$folder/recall.csv")
    done
    (( ${#runs[@]} )) || { echo "no finished runs to evaluate yet: run again to go on"; return 0; }
    "$PYTHON" research/analysis.py recall "${runs[@]}" --out="$RESULTS/recall"
}

recall() {  # a width of D_MODELS at a time: seed 1 at each rate, the table, then the other seeds
    export RESULTS RECALL_ARGS
    local d seed
    for d in $D_MODELS; do
        if [[ " $SEEDS " == *" 1 "* ]]; then
            D_MODELS=$d recall_runs 1 | xargs -r -P "$JOBS" -L 1 bash -c 'recall_one "$@"' _
            echo "d_model $d: seed 1 done at $(( $(date +%s) - BEGIN )) s"
        fi
        recall_analysis
        [[ $SEEDS == 1 ]] && continue
        for seed in $SEEDS; do
            [[ $seed == 1 ]] || D_MODELS=$d recall_runs "$seed"
        done | xargs -r -P "$JOBS" -L 1 bash -c 'recall_one "$@"' _
        recall_analysis
    done
    echo "training done at $(( $(date +%s) - BEGIN )) s"
}

report() {  # the call's end: exit 1 if a run FAILED or was SKIPPED, 3 if runs stopped unfinished, else 0
    local failed stopped
    failed=$(grep -c -v '^stopped ' "$TRAIN_STATUS" || true)
    stopped=$(grep -c '^stopped ' "$TRAIN_STATUS" || true)
    if (( failed )); then
        echo "$subset: $failed run(s) FAILED or SKIPPED (above: $(grep -v '^stopped ' "$TRAIN_STATUS" | cut -d' ' -f2 \
| head -3 | xargs)): fix them, then run again"
        return 1
    fi
    if (( stopped )); then
        echo "$subset: $stopped run(s) not finished (stopped after saving, or not started): run again to go on"
        return 3
    fi
}

# ----------------------------------------------------------------------------- the subset named

case ${1:-} in
    quality|extrapolation|frontier|routing|scaling|levers|recall) subset=$1;;
    *) echo "usage: bash research/reproduce.sh quality|frontier|routing|scaling|levers|recall  (see research/README.md)" >&2
       exit 2;;
esac
check_settings
if [[ ${LIST:-} == 1 ]]; then  # the run lines alone: nothing trained or written
    call_runs
    exit 0
fi
export DEADLINE=$(( $(date +%s) + TRAIN_SECONDS ))
TRAIN_STATUS=$(mktemp)  # a line a run that FAILED, was SKIPPED or stopped (train_one writes them)
export TRAIN_STATUS
trap 'rm -f "$TRAIN_STATUS"' EXIT
mkdir -p "$RESULTS"
BEGIN=$(date +%s)
{
    echo "$subset: $(command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name --format=csv,noheader | head -1 \
        || echo 'no GPU'), JOBS=$JOBS, TRAIN_SECONDS=$TRAIN_SECONDS, RUNS=$RUNS, \
git $(git rev-parse --short HEAD 2> /dev/null)"
    "$PYTHON" prepare_data.py  # the default corpus, once, before the trainings start
    $subset
    echo "$subset: $(( $(date +%s) - BEGIN )) s in all"
    report
} 2>&1 | tee "$RESULTS/$subset.txt"
