#!/bin/bash
# torchcodec's nvJPEG (0.17.0 wheel carried in .whl-extra): the probe, its GPU tests with the
# pipeline's, then end to end against nvjpeg, interleaved (efe = main's code before this
# change, with nvjpeg; head = this tree with --decoder torchcodec and K prepare threads).
D=docs/data/2026-12-06c
source docs/data/2026-12-06b/common.sh
python3 $D/probe_torchcodec.py 2>&1 | tee $OUT/probe-torchcodec.txt | grep -v Warning
t0=$SECONDS
python3 -m pytest -q -p no:cacheprovider -rA --timeout=150 -s tests/gpu/test_torchcodec_gpu.py tests/gpu/test_pipeline_gpu.py tests/test_decoder_choice.py > $OUT/gputests.txt 2>&1
echo "pytest rc=$? $((SECONDS-t0)) s"; grep -E "passed|failed|error" $OUT/gputests.txt | tail -2; grep -E "^(FAILED|ERROR)|cosine|orientation .:|against" $OUT/gputests.txt | head -20
A=docs/data/2026-12-06b/call_a.sh; O=$OUT
run() { mkdir -p $O/$1; OUT=$O/$1 EXTRA="$2" ORDER="$3" bash $A 2>&1 | grep -E "^row|featpool"; }
run a "" "efe"
run b "--decoder torchcodec" "head+2"
run c "--decoder torchcodec" "head"
run d "" "efe"
run e "--decoder torchcodec" "head+3"
run f "--decoder torchcodec" "head+2"
cd $O && tar czf all.tgz a b c d e f probe-torchcodec.txt gputests.txt && rm -rf a b c d e f; date -u
