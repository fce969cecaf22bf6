#!/usr/bin/env bash
# The measurements of docs/performance.md in one run, on a host whose python has MLX (its CUDA build on a GPU):
#
#   bash bench/gpu_suite.sh OUT_DIR [MODEL_DIR]
#
# MODEL_DIR (default /tmp/voicechat-full4) is generated when it has no config.json: the PRESET preset (default
# full) at 4 bits, 2-3 minutes on a GPU host. Then, each step's output in OUT_DIR/<step>.log and its table
# printed as it ends:
#   warmup     a few frames of every engine: on a fresh machine the first full-model run spends minutes
#              building MLX's CUDA kernels, which must not land in a timed step
#   stages     per-stage cost of a sequential frame, split inside and outside evaluations (bench.stages)
#   sweep      the stages again under each of SWEEP's MLX settings (';'-separated sets of VAR=VALUE): how MLX's
#              CUDA backend groups a frame's kernels into graphs (MLX_MAX_OPS_PER_BUFFER, default 20 a graph;
#              MLX_CUDA_GRAPH_CACHE_SIZE) or launches them without graphs (MLX_USE_CUDA_GRAPHS=0)
#   engines    each engine alone at 1 and SESSIONS sessions (bench.service --no-grpc --host-split; the language model
#              as stored, in bf16, in bf16 with --float32-weights, and with --split-matmuls too; perception
#              and speech as stored, with --float32-weights, and with --split-matmuls too); on CUDA also
#              the language model's float32 x bf16 products at 1 and SESSIONS rows, the split-matmul kernel
#              against cuBLAS's float32 GEMM, shape by shape, with their accuracy (bench.matmuls)
#   live       SESSIONS and 1 conversations through `orchestrator serve` at each of PACES (bench.load, its
#              timeline kept, and each service's memory before and after: --memory); after each, every
#              service's batch sizes and memory from its /metrics (ports 9101-9104), and its steps in the
#              run beside the clients' intervals (bench.timeline of each
#              service's --step-log)
#   contention each engine at SESSIONS sessions alone, then beside the other three stepping as many in processes
#              of their own (bench.contention, the many-conversation configuration; under MPS with MPS=1): how
#              much of a live step is waiting for the others' work on the shared GPU; with KERNELS=1 each
#              measured step's kernels recorded too, timed on the device (--kernels: needs PyTorch with CUDA)
#   rtf        one session side by side with the reference (bench.rtf online --grpc), when REFERENCE_PYTHON
#              names a Python that has mlx-vlm and mlx-audio
#   rtf-flags  one session of ours again, its services started with ONE_FLAGS
#   failover   (only when named in STEPS) the pause when the replica holding a conversation dies, at each of
#              FAILOVER_AGES (10,60,300 s) in each of FAILOVER_NETWORKS (all four), with a snapshot every
#              SNAPSHOT_SECONDS (10; 0: replay only) (bench.failover, two replicas of each service)
#   long       (only when named in STEPS) one conversation of LONG_MINUTES (20) at LONG_PACE (burst), its
#              services started with ONE_FLAGS: per-frame figures and every process's memory at LONG_AT
#              minutes (1,5,10,20), each row printed as it is reached (bench.long_session)
#   openings   (only when named in STEPS) perception, the language model and speech, each alone in its live
#              configuration, meeting sessions that open in OPENING_WAVES (28,4): each step's time over three
#              rounds and its evaluated graph's operations, the PTX cache empty (bench.opening --graph-nodes)
# Knobs: PRESET, SESSIONS (16), AUDIO_SECONDS (10: audio per live conversation), PYTHON (python3),
# SERVE_FLAGS (the services' flags for the live run, default the batched GPU configuration; EXTRA_SERVE_FLAGS
# are added to them), STEPS (the steps to run, default "warmup stages sweep engines contention rtf rtf-flags
# live": a device call has 10 minutes, so a lease splits them over calls, the checkpoint kept between them),
# REFERENCE_PYTHON, ONE_FLAGS (default float32 weights in the language model, perception and speech), MPS (1: the
# processes of the contention, rtf, long and live steps share the GPU through an MPS daemon of their own, `--mps`; no
# device setting changes). MLX settings exported before
# the suite apply to every step (the services it starts inherit them). SETTLE_SECONDS (0): each live
# conversation's opening seconds left out of its interval percentiles (bench.load --settle-seconds). Where
# nvidia-smi is on PATH, each step's GPU clocks, power, utilization, temperature and device memory used are sampled
# every 0.5 s into OUT_DIR/<step>.gpu.csv, and every process's device memory every second into
# OUT_DIR/<step>.apps.csv (what MLX's own figures leave out: CUDA contexts, libraries' workspaces, MPS; reading
# them changes no setting).
# COUNTS ("SESSIONS 1"): the live step's numbers of conversations, each run at every pace.
# REPLICAS (none): the live step's services started as several processes, e.g. "perception=2 tts=2"
# (`--replicas`, up to 9 each here); each replica keeps its own step log (steps-NAME-R.jsonl) and metrics
# port (91R<n>), and compiles at load the batch sizes up to its share of the SESSIONS.
# ORCHESTRATORS (1): with K > 1 the live step's conversations are dealt over K orchestrator processes sharing one
# set of services (bench.load --orchestrators K, which starts them all with the same flags); a list such as 4,8
# runs the load with each K in turn on the same services (REPEAT runs each, their timelines numbered on).
# PACES ("live"): the live step's paces, in order (bench.load --pace): `live` sends each conversation's audio as a
# microphone would, so a frame's interval is bounded below by the input's 80 ms and shows the delivery's jitter;
# `burst` sends it all at once, so the interval is how fast the server completes each conversation's frames.
# REPEAT (1): each live run N times on the same services (bench.load --repeat; the services outlive the runs),
# each run's timeline kept (PACE-K.timeline.json, PACE-K.timeline-2.json, ...) and its first OPENING seconds (2)
# printed step by step beside the services' steps (bench.timeline --opening): a cost the first run pays and a
# second does not is the services' first use, one both pay is the opening of many conversations itself.
set -uo pipefail
out=${1:?usage: bash bench/gpu_suite.sh OUT_DIR [MODEL_DIR]}
model=${2:-/tmp/voicechat-full4}
preset=${PRESET:-full}
sessions=${SESSIONS:-16}
seconds=${AUDIO_SECONDS:-10}
py=${PYTHON:-python3}
batched="--service-flags llm=--weights-dtype=bfloat16 --service-flags all=--precompile-batches=$sessions"
cuda=0  # the language model's split matmuls, in the live run and the engines step, need MLX's CUDA backend
"$py" -c "import mlx.core as mx, sys; sys.exit(not mx.cuda.is_available())" 2>/dev/null && cuda=1
[ $cuda = 1 ] && batched="$batched --service-flags llm=--split-matmuls"
# CUDA graphs off in perception and speech: faster at 16 conversations, slower for one (docs/performance.md)
for name in perception tts; do
  [ $cuda = 1 ] && batched="$batched --service-env $name=MLX_USE_CUDA_GRAPHS=0"
done
# under MPS (MPS=1), perception's kernels first on the shared GPU: the others' clients below normal priority
for name in llm tts codec; do
  [ $cuda = 1 ] && batched="$batched --service-env $name=CUDA_MPS_CLIENT_PRIORITY=1"
done
for name in llm perception tts; do batched="$batched --service-flags $name=--float32-weights"; done
serve_flags="${SERVE_FLAGS:-$batched} ${EXTRA_SERVE_FLAGS:-}"
steps=" ${STEPS:-warmup stages sweep engines contention rtf rtf-flags live} "
sweep="MLX_USE_CUDA_GRAPHS=0;MLX_MAX_OPS_PER_BUFFER=100 MLX_CUDA_GRAPH_CACHE_SIZE=1000"
sweep=${SWEEP:-"$sweep;MLX_MAX_OPS_PER_BUFFER=400 MLX_CUDA_GRAPH_CACHE_SIZE=1000"}
reference=${REFERENCE_PYTHON:-}
rtf_flags="--service-flags perception=--precompile-batches=1"  # its full-cache step traced before frame 70
one_flags=$rtf_flags
for name in llm perception tts; do one_flags="$one_flags --service-flags $name=--float32-weights"; done
one_flags=${ONE_FLAGS:-$one_flags}
mkdir -p "$out"
export PYTHONUNBUFFERED=1

step() {  # step NAME COMMAND...: run, keep the log (and the GPU's clocks meanwhile), print its last lines
  local name=$1 sampler=""
  shift
  echo "== $(date +%T) $name: $*"
  if command -v nvidia-smi > /dev/null; then  # read-only: what the clocks, power and load were during the step
    nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,utilization.gpu,temperature.gpu,memory.used \
      --format=csv,noheader -lms 500 > "$out/$name.gpu.csv" 2>/dev/null &
    sampler=$!
    nvidia-smi --query-compute-apps=timestamp,pid,process_name,used_memory --format=csv,noheader -lms 1000 \
      > "$out/$name.apps.csv" 2>/dev/null &
    sampler="$sampler $!"
  fi
  "$@" > "$out/$name.log" 2>&1
  local rc=$?
  [ -n "$sampler" ] && kill $sampler 2>/dev/null
  tail -n 40 "$out/$name.log"
  [ $rc -eq 0 ] || echo "== $name failed with exit code $rc (log: $out/$name.log)"
  return $rc
}

if [ ! -f "$model/config.json" ]; then
  step checkpoint "$py" -m tools.make_checkpoint --out "$model" --preset "$preset" --seed 0 --bits 4 || exit 1
fi
wants() { [[ $steps == *" $1 "* ]]; }

mps=""
[ "${MPS:-0}" = 1 ] && mps="--mps"
kernels=""
[ "${KERNELS:-0}" = 1 ] && kernels="--kernels"

if wants warmup; then
  step warmup "$py" -m bench.stages --model "$model" --frames 3 --warmup 2 || exit 1
fi
if wants stages; then
  step stages "$py" -m bench.stages --model "$model" --frames 40 --warmup 8 --split-eval
fi
if wants sweep; then
  IFS=';' read -ra settings <<< "$sweep"
  for i in "${!settings[@]}"; do
    echo "== sweep $i: ${settings[$i]}"
    # shellcheck disable=SC2086  # each setting is a list of VAR=VALUE words
    step "sweep-$i" env ${settings[$i]} "$py" -m bench.stages --model "$model" --frames 30 --warmup 6 --split-eval
  done
fi
if wants engines; then
  for name in perception tts codec; do
    step "engine-$name" "$py" -m bench.service "$name" --model "$model" --sessions "1,$sessions" --frames 25 \
      --warmup 5 --no-grpc --host-split
  done
  for name in perception tts; do
    step "engine-$name-float32" "$py" -m bench.service "$name" --model "$model" --sessions "1,$sessions" \
      --frames 25 --warmup 5 --no-grpc --host-split --float32-weights
    [ $cuda = 1 ] && step "engine-$name-split" "$py" -m bench.service "$name" --model "$model" \
      --sessions "1,$sessions" --frames 25 --warmup 5 --no-grpc --host-split --float32-weights --split-matmuls
  done
  step engine-llm "$py" -m bench.service llm --model "$model" --sessions "1,$sessions" --frames 25 --warmup 5 \
    --no-grpc --host-split
  step engine-llm-bf16 "$py" -m bench.service llm --model "$model" --sessions "1,$sessions" --frames 25 \
    --warmup 5 --no-grpc --host-split --weights-dtype bfloat16
  step engine-llm-bf16-float32 "$py" -m bench.service llm --model "$model" --sessions "1,$sessions" --frames 25 \
    --warmup 5 --no-grpc --host-split --weights-dtype bfloat16 --float32-weights
  [ $cuda = 1 ] && step engine-llm-bf16-split "$py" -m bench.service llm --model "$model" --sessions "1,$sessions" --frames 25 \
    --warmup 5 --no-grpc --host-split --weights-dtype bfloat16 --float32-weights --split-matmuls
  [ $cuda = 1 ] && step matmuls "$py" -m bench.matmuls --model "$model" --rows "1,$sessions"
fi
if wants contention; then
  # shellcheck disable=SC2086  # $mps and $kernels are each empty or one flag
  step contention "$py" -m bench.contention --model "$model" --sessions "$sessions" $mps $kernels
fi
if wants rtf && [ -n "$reference" ]; then
  # shellcheck disable=SC2086  # a list of flags
  step rtf "$py" -m bench.rtf online --model "$model" --seconds "$seconds" --grpc --reference-python "$reference" \
    $rtf_flags $mps
fi
if wants rtf-flags; then
  # shellcheck disable=SC2086  # ONE_FLAGS is a list of flags
  step rtf-flags "$py" -m bench.rtf online --model "$model" --seconds "$seconds" --grpc --ours-only $one_flags $mps
fi
if wants failover; then
  step failover "$py" -m bench.failover --model "$model" --ages "${FAILOVER_AGES:-10,60,300}" \
    --networks "${FAILOVER_NETWORKS:-perception,llm,tts,codec}" --snapshot-seconds "${SNAPSHOT_SECONDS:-10}"
fi
if wants long; then
  # shellcheck disable=SC2086  # ONE_FLAGS is a list of flags, $mps empty or one flag
  step long "$py" -m bench.long_session --model "$model" --minutes "${LONG_MINUTES:-20}" --pace "${LONG_PACE:-burst}" \
    --at "${LONG_AT:-1,5,10,20}" $one_flags $mps
fi
if wants openings; then
  for name in perception llm tts; do
    flags="--float32-weights" graphs=0  # as the live configuration starts each service
    [ "$name" = llm ] && flags="--weights-dtype bfloat16 --float32-weights --split-matmuls" graphs=1
    # shellcheck disable=SC2086  # a list of flags
    step "openings-$name" env MLX_PTX_CACHE_DIR="$(mktemp -d)" MLX_USE_CUDA_GRAPHS=$graphs "$py" -m bench.opening \
      "$name" --model "$model" --waves "${OPENING_WAVES:-28,4}" --steps 6 --rounds 3 --graph-nodes $flags
  done
fi
wants live || { echo "== $(date +%T) done: logs in $out"; exit 0; }

# live conversations: the orchestrator and its four services, then the load; every wait gives up when the
# process it waits for has died
port=50060
metrics=(perception=1 llm=2 tts=3 codec=4)  # metrics port 91R<n> for replica R of service n: 9101-9104 for one each
declare -A replicas=()
for entry in ${REPLICAS:-}; do replicas[${entry%=*}]=${entry#*=}; serve_flags="$serve_flags --replicas $entry"; done
steps_of=""  # each service's (each replica's) --step-log, read with each run's timeline by bench.timeline
memory=""  # bench.load's memory table of each service started as one process: before and after each run
ports=()
for entry in "${metrics[@]}"; do
  name=${entry%=*}
  count=${replicas[$name]:-1}
  serve_flags="$serve_flags --service-flags $name=--metrics-port=91{replica}${entry#*=}"
  if [ "$count" = 1 ]; then
    serve_flags="$serve_flags --service-flags $name=--step-log=$out/steps-$name.jsonl"
    steps_of="$steps_of --steps $name=$out/steps-$name.jsonl"
    memory="$memory --service-metrics $name=http://127.0.0.1:910${entry#*=}/metrics"
  else  # round robin gives each replica its share of the sessions: only those batch sizes compiled at load
    serve_flags="$serve_flags --service-flags $name=--step-log=$out/steps-$name-{replica}.jsonl"
    share=$(( (sessions + count - 1) / count ))
    [ -z "${SERVE_FLAGS:-}" ] && serve_flags="$serve_flags --service-flags $name=--precompile-batches=$share"
  fi
  for r in $(seq 0 $((count - 1))); do
    ports+=("91$r${entry#*=}")
    [ "$count" = 1 ] || steps_of="$steps_of --steps $name-$r=$out/steps-$name-$r.jsonl"
  done
done
scrape() {  # scrape NAME: each service's batch-size histogram totals and memory gauges, kept and printed
  for p in "${ports[@]}"; do
    "$py" -c 'import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())' \
      "http://127.0.0.1:$p/metrics"
  done > "$out/$1.metrics" 2>&1
  grep -E '^voicechat_(batch_size_(sum|count)|memory_bytes)' "$out/$1.metrics"
}
orchestrator_counts=${ORCHESTRATORS:-1}
runs=$(( ${REPEAT:-1} * $(tr ',' '\n' <<< "$orchestrator_counts" | wc -l) ))  # bench.load's runs: their timelines
live_runs() {  # live_runs FLAGS...: each pace and count through bench.load with these connection flags
  for pace in ${PACES:-live}; do
    for k in ${COUNTS:-$sessions 1}; do
      # shellcheck disable=SC2086  # $memory is a list of flags
      step "$pace-$k" "$py" -m bench.load "$@" --grpc "$k" --ws 0 --seconds "$seconds" --pace "$pace" \
        --settle-seconds "${SETTLE_SECONDS:-0}" --timeline "$out/$pace-$k.timeline.json" ${memory:+--memory $memory} \
        --repeat "${REPEAT:-1}"
      [ -n "${serve:-}" ] && scrape "$pace-$k"  # the services outlive the run only under our `serve`
      for r in $(seq 1 "$runs"); do
        run=""; [ "$r" = 1 ] || run=-$r
        # shellcheck disable=SC2086  # a list of flags
        "$py" -m bench.timeline "$out/$pace-$k.timeline$run.json" $steps_of \
          --settle-seconds "${SETTLE_SECONDS:-0}" | tee "$out/$pace-$k$run.steps.txt"
        # shellcheck disable=SC2086  # a list of flags
        "$py" -m bench.timeline "$out/$pace-$k.timeline$run.json" $steps_of --opening "${OPENING:-2}" \
          | tee "$out/$pace-$k$run.opening.txt"
      done
    done
  done
}
if [ "$orchestrator_counts" != 1 ]; then  # bench.load starts the services and the K orchestrators itself
  live_runs --model "$model" --orchestrators "$orchestrator_counts" --serve-flags "$serve_flags $mps"
  echo "== $(date +%T) done: logs in $out"
  exit 0
fi
echo "== $(date +%T) serve: --max-sessions $sessions $serve_flags $mps"
# shellcheck disable=SC2086  # SERVE_FLAGS is a list of flags
"$py" -m orchestrator.cli serve --model "$model" --port "$port" --no-realtime --max-sessions "$sessions" \
  $serve_flags $mps > "$out/serve.log" 2>&1 &
serve=$!
ready=0
for _ in $(seq 1 450); do
  if grep -q "listening on .*:$port" "$out/serve.log"; then ready=1; break; fi
  kill -0 "$serve" 2>/dev/null || break
  sleep 2
done
if [ $ready -eq 1 ]; then
  live_runs --address "127.0.0.1:$port"
else
  echo "== orchestrator serve did not become ready:"
  tail -n 20 "$out/serve.log"
fi
kill "$serve" 2>/dev/null
wait "$serve" 2>/dev/null
echo "== $(date +%T) done: logs in $out"
