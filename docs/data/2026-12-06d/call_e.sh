#!/bin/bash
# Twenty-third session, first call: the GPU tests changed since their last GPU run (TESTS), the
# pipeline's ceiling without HTTP (probe_ceiling.py), then
# eager against --encoder-compile end to end, interleaved, each block one server through
# ../2026-12-06b/call_a.sh (POINTS raw:1x256,mp:16x64), all tarred into $OUT/all.tgz.
A=docs/data/2026-12-06b; O=$OUT; M=${MAXS:-560}  # MAXS: the seconds this call may take
OUT=$O TESTS="tests/gpu/test_torchcodec_gpu.py tests/gpu/test_nvimgcodec_gpu.py tests/gpu/test_job_arena_gpu.py tests/gpu/test_pipeline_gpu.py tests/test_decoder_choice.py" bash $A/call_t.sh
source $A/common.sh >/dev/null; python3 docs/data/2026-12-06d/probe_ceiling.py > $O/probe-ceiling.txt 2>&1; echo "probe rc=$? $SECONDS s"; grep -v "^USDT\|Warning\|warn" $O/probe-ceiling.txt | tail -20
run() { mkdir -p $O/$1; OUT=$O/$1 EXTRA="$2" ORDER="head" POINTS=raw:1x256,mp:16x64 bash $A/call_a.sh 2>&1 | grep -E "^row|featpool|Error"; }
[ $SECONDS -lt $((M-40)) ] && run a ""
[ $SECONDS -lt $((M-230)) ] && run b "--encoder-compile"
[ $SECONDS -lt $((M-80)) ] && run c ""
[ $SECONDS -lt $((M-110)) ] && run d "--encoder-compile"
cd $O && tar czf all.tgz gputests.txt probe-ceiling.txt a b c d 2>/dev/null; rm -rf a b c d e f; date -u
